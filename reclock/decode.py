"""Decode: raw record bytes -> typed rows, with bad records kept as data.

The contract (every decoder, every format)::

    data: pa.Array (binary / large_binary, nulls allowed), n records
        |
        v   Decoder.decode(data)
    DecodeResult
        table    user columns only, one row per decoded record, in input order
        ok       int64 indices into data of the rows in table (ascending)
        errors   int64 indices of the records that did not decode (ascending)
        reasons  one string per error: "<format>: <what was wrong>"

* Every input index is in exactly one of ``ok`` and ``errors``. A record
  that does not decode is never an exception: it is an error row carrying the
  reason, and the caller records it with its source position (DESIGN:
  "bad input is data, not a crash"). Only two things raise from ``decode``:
  an input of the wrong Arrow type (a bug upstream) and a transient fault
  (:class:`~reclock.errors.TransientError`, e.g. the schema registry is
  unreachable), which the data plane retries.
* A null record (a Kafka tombstone) is the error :data:`NULL_REASON`, unless
  the decoder was made with ``allow_null=True`` (the upsert envelope, for
  deletes): then it is a row whose columns are all null.
* Decoders are pure and picklable: they hold only their spec, are built on the
  driver by :func:`make_decoder`, shipped to Spark tasks, and keep no state
  between calls except caches derived from immutable facts (Avro writer
  schemas by registry id).
* ``table`` may be chunked; every column is nullable.

Formats (``spec`` mirrors the YAML ``format:`` block)::

    {"type": "bytes"}                          -> data: binary, never fails
    {"type": "text"}                           -> text: string (utf-8 checked)
    {"type": "json"}                           -> value: string (the record's text, validated)
    {"type": "json", "schema": {"id": "int64", "ts": "timestamp", ...}}
    {"type": "csv", "columns": ["id", "name"], "types": {"id": "int64"},
     "delimiter": ",", "quote": "\\""}
    {"type": "avro", "schema": "<avro schema json>" | {...},
     "registry_url": "http://registry:8081", "subject": "orders-value"}

Column types (:data:`TYPE_NAMES`): ``int32 int64 float64 bool string binary
timestamp date decimal(p,s) json``. ``timestamp`` is ``timestamp[us, UTC]``,
read from ISO-8601 text (``YYYY-MM-DD[(T| )hh[:mm[:ss[.ffffff]]]][Z|+hh[:mm]]``;
no offset means UTC); ``date`` is ``date32`` from ``YYYY-MM-DD``; ``json``
holds the field's JSON text, re-serialised compactly.

How the vectorised formats stay exact (json, csv)::

    records --screen--> candidates --join "\\n"--> runs of <= 1 MiB
       |                                          |  one pyarrow reader call each
       |                                          v
       |                     accepted -> rows     failed -> cut out the record the
       |                                          error names (json/csv row number),
       |                                          else the suspects (records whose
       |                                          values could fail the conversion),
       |                                          else split in 8; retry the rest
       |                                               |
       +-- excluded (null, not utf-8, json not {...},  v  short runs, dense chunks
           csv holding a line break) ------------> per-record path (json.loads,
                                                   one-line csv) -> row or reason

A clean batch is parsed once. A bad record costs a re-parse of part of its own
run, not of the batch; where bad records are dense (more than about 1 in 64)
the rest of a run is decoded record by record, so malformed input degrades
towards the per-record speed (``json.loads`` plus conversions), no further.
Alignment of records and
parsed rows is checked, never assumed: a run whose row count differs from its
record count fails like a malformed one. ``text`` is one vectorised UTF-8
check, bisected when it fails.

The fast path and the per-record path accept the same records and produce the
same rows (tested against ``json.loads`` with Hypothesis), with one known
exception: the json fast path (RapidJSON) also accepts ``Inf``/``-Inf`` as
numbers, and nesting deeper than Python's recursion limit, which the
per-record path rejects; only for such records can the outcome depend on which
path judged them.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, NamedTuple, Protocol, TypeAlias

import fastavro
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.json as pjson

from reclock.errors import DefiniteError, TransientError
from reclock.native import load_extension

__all__ = [
    "NULL_REASON",
    "TIMESTAMP",
    "TYPE_NAMES",
    "AvroDecoder",
    "BytesDecoder",
    "CsvDecoder",
    "DecodeResult",
    "Decoder",
    "FormatError",
    "JsonDecoder",
    "KeyValueDecoder",
    "SchemaRegistryResolver",
    "TextDecoder",
    "arrow_type",
    "decode_key_value",
    "make_decoder",
]

I64 = npt.NDArray[np.int64]

#: The reason recorded for a null record when nulls are not allowed.
NULL_REASON = "value is null"

#: The Arrow type of the ``timestamp`` column type.
TIMESTAMP = pa.timestamp("us", tz="UTC")

#: Column type names accepted in specs (``decimal(p,s)`` stands for all decimals).
TYPE_NAMES = (
    "int32", "int64", "float64", "bool", "string", "binary", "timestamp", "date",
    "decimal(p,s)", "json",
)

#: Upper bound on the bytes handed to one pyarrow reader call. Small enough that
#: a bad record costs little to re-parse around, large enough that per-call
#: overhead is noise (about 10k records of 100 bytes).
CHUNK_BYTES = 1 << 20

_INT_RANGE = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_DECIMAL_RE = re.compile(r"decimal\(\s*(\d+)\s*,\s*(\d+)\s*\)")
_HINT_RE = re.compile(r" in row (\d+)\s*$")
_ZONED_RE = r"[T ]\d{2}(?::\d{2}(?::\d{2}(?:\.\d+)?)?)?(?:Z|[+-]\d{2}(?::?\d{2})?)$"


class FormatError(DefiniteError, ValueError):
    """A format spec that cannot be built (unknown type, missing schema, ...).

    Raised on the driver, when the pipeline is built, never while decoding."""


# --------------------------------------------------------------------------
# Column types
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Field:
    """One declared column: its name, type kind, Arrow type and spelling."""

    name: str
    kind: str  # int32 int64 float64 bool string binary timestamp date decimal json
    type: pa.DataType
    label: str  # as written in the spec, for messages


def _parse_type(label: str) -> tuple[str, pa.DataType]:
    name = label.strip().lower() if isinstance(label, str) else label
    simple: dict[str, pa.DataType] = {
        "int32": pa.int32(), "int64": pa.int64(), "float64": pa.float64(),
        "bool": pa.bool_(), "string": pa.string(), "binary": pa.binary(),
        "timestamp": TIMESTAMP, "date": pa.date32(), "json": pa.string(),
    }
    if isinstance(name, str) and name in simple:
        return name, simple[name]
    m = _DECIMAL_RE.fullmatch(name) if isinstance(name, str) else None
    if m:
        p, s = int(m.group(1)), int(m.group(2))
        if not 1 <= p <= 76 or s > p:
            raise FormatError(
                f"column type {label!r}: need 1 <= precision <= 76 and scale <= precision"
            )
        return "decimal", pa.decimal128(p, s) if p <= 38 else pa.decimal256(p, s)
    raise FormatError(f"unknown column type {label!r}; expected one of {', '.join(TYPE_NAMES)}")


def arrow_type(name: str) -> pa.DataType:
    """The Arrow type of a column type name (``"int64"``, ``"decimal(10,2)"``, ...)."""
    return _parse_type(name)[1]


#: Schemaless JSON documents nested deeper than this are error rows: readers
#: (Python's json.loads among them) cannot parse them back.
MAX_JSON_DEPTH = 512


def _depth_over(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON ``text`` nests objects and arrays deeper than ``limit``."""
    depth = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch == "{" or ch == "[":
            depth += 1
            if depth > limit:
                return True
        elif ch == "}" or ch == "]":
            depth -= 1
    return False


def _too_deep(texts: pa.Array) -> list[int]:
    """Rows of ``texts`` nested deeper than :data:`MAX_JSON_DEPTH`; only rows
    with more openers than that are scanned."""
    openers = pc.add(pc.count_substring(texts, "{"), pc.count_substring(texts, "["))
    many = np.flatnonzero(pc.fill_null(pc.greater(openers, MAX_JSON_DEPTH), False)
                          .to_numpy(zero_copy_only=False))
    return [int(i) for i in many if _depth_over(texts[int(i)].as_py() or "")]


def _fields(schema: Mapping[str, str], where: str) -> tuple[_Field, ...]:
    if not isinstance(schema, Mapping) or not schema:
        raise FormatError(f"{where}: 'schema' must be a non-empty mapping of column -> type")
    out = []
    for name, label in schema.items():
        if not isinstance(name, str) or not name:
            raise FormatError(f"{where}: column names must be non-empty strings, got {name!r}")
        try:
            kind, typ = _parse_type(label)
        except FormatError as exc:
            raise FormatError(f"{where}: column {name!r}: {exc}") from None
        out.append(_Field(name, kind, typ, str(label)))
    return tuple(out)


def _arrow_schema(fields: Sequence[_Field]) -> pa.Schema:
    return pa.schema([pa.field(f.name, f.type, nullable=True) for f in fields])


# --------------------------------------------------------------------------
# Result and contract
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeResult:
    """Decoded rows and rejected records of one input array (see module doc)."""

    table: pa.Table
    ok: I64
    errors: I64
    reasons: list[str]

    def __post_init__(self) -> None:
        if self.table.num_rows != len(self.ok) or len(self.errors) != len(self.reasons):
            raise ValueError(
                f"inconsistent DecodeResult: {self.table.num_rows} rows for {len(self.ok)} "
                f"ok indices, {len(self.reasons)} reasons for {len(self.errors)} errors"
            )


class Decoder(Protocol):
    """Turns one array of raw records into typed rows (see module doc)."""

    schema: pa.Schema  # the user columns it produces

    def decode(self, data: pa.Array) -> DecodeResult:
        """Decode every record of ``data``; never raises for a bad record."""
        ...


# --------------------------------------------------------------------------
# Array helpers
# --------------------------------------------------------------------------


def _as_binary(data: pa.Array | pa.ChunkedArray) -> pa.Array:
    """``data`` as one binary or large_binary array (string types are viewed)."""
    if isinstance(data, pa.ChunkedArray):
        data = data.combine_chunks()
    t = data.type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return data
    if pa.types.is_string(t):
        return data.cast(pa.binary())
    if pa.types.is_large_string(t):
        return data.cast(pa.large_binary())
    if pa.types.is_binary_view(t) or pa.types.is_string_view(t):
        return data.cast(pa.binary())
    raise TypeError(f"decode expects a binary array of raw records, got {t}")


def _offsets(arr: pa.Array) -> tuple[I64, npt.NDArray[np.uint8]]:
    """Value offsets (``n + 1``, int64) and the value bytes of a binary array."""
    n = len(arr)
    bufs = arr.buffers()
    width = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    off = np.frombuffer(bufs[1], dtype=width, count=n + 1, offset=arr.offset * width().itemsize)
    values = (
        np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None
        else np.zeros(0, np.uint8)
    )
    return off.astype(np.int64), values


def _valid_mask(arr: pa.Array) -> npt.NDArray[np.bool_]:
    if arr.null_count == 0:
        return np.ones(len(arr), dtype=bool)
    return np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)


def _count_newlines(values: npt.NDArray[np.uint8]) -> int:
    """Number of ``\\n`` and ``\\r`` bytes, in cache-sized steps (fast, no big temporaries)."""
    total = 0
    step = 1 << 16
    for a in range(0, len(values), step):
        w = values[a : a + step]
        total += int(np.count_nonzero(w == 10)) + int(np.count_nonzero(w == 13))
    return total


def _bad_positions(arr: pa.Array, check: Callable[[pa.Array], object]) -> list[int]:
    """Positions of ``arr`` whose one-element slice makes ``check`` raise, found by
    bisection (``check`` is vectorised and all-or-nothing)."""
    bad: list[int] = []
    stack = [(0, len(arr))]
    while stack:
        lo, hi = stack.pop()
        try:
            check(arr.slice(lo, hi - lo))
            continue
        except (pa.ArrowException, ValueError, UnicodeError):
            pass
        if hi - lo == 1:
            bad.append(lo)
        else:
            mid = (lo + hi) // 2
            stack += [(mid, hi), (lo, mid)]
    return bad


def _convert_isolating(
    arr: pa.Array, fn: Callable[[pa.Array], pa.Array]
) -> tuple[pa.Array, list[int]]:
    """``fn(arr)``, with the values ``fn`` rejects replaced by null and listed."""
    try:
        return fn(arr), []
    except (pa.ArrowException, ValueError):
        pass
    bad = sorted(_bad_positions(arr, fn))
    mask = np.zeros(len(arr), dtype=bool)
    mask[bad] = True
    cleaned = pc.if_else(pa.array(mask), pa.scalar(None, arr.type), arr)
    return fn(cleaned), bad


def _to_timestamp(arr: pa.Array) -> pa.Array:
    """ISO-8601 strings -> ``timestamp[us, UTC]``; text without an offset is UTC.
    Raises ``ArrowInvalid`` if any value does not parse."""
    arr = arr.cast(pa.string())
    zoned = pc.match_substring_regex(arr, _ZONED_RE)
    n_zoned = pc.sum(zoned).as_py() or 0
    if n_zoned == 0:
        return arr.cast(pa.timestamp("us")).cast(TIMESTAMP)
    if n_zoned == len(arr) - arr.null_count:
        return arr.cast(TIMESTAMP)
    none = pa.scalar(None, pa.string())
    aware = pc.if_else(zoned, arr, none).cast(TIMESTAMP)
    naive = pc.if_else(zoned, none, arr).cast(pa.timestamp("us")).cast(TIMESTAMP)
    return pc.if_else(zoned, aware, naive)


def _to_date(arr: pa.Array) -> pa.Array:
    return arr.cast(pa.string()).cast(pa.date32())


_STRING_CONVERTERS: dict[str, Callable[[pa.Array], pa.Array]] = {
    "timestamp": _to_timestamp,
    "date": _to_date,
}


def _show(value: object, limit: int = 40) -> str:
    """A short rendering of a value for a reason: strings quoted, numbers as written."""
    text = repr(value) if isinstance(value, str | bytes) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------
# The isolation engine shared by the vectorised formats
# --------------------------------------------------------------------------


class _Fail(NamedTuple):
    """A fast-path call that rejected its range: ``hint`` is the range-relative
    position the reader named, if any; ``message`` says why."""

    hint: int | None
    message: str = ""


@dataclass
class _Ok:
    """A fast-path call that accepted its range: ``table`` holds the rows of
    every record of the range except the ``rejected`` ones (range-relative
    positions with reasons), in order."""

    table: pa.Table
    rejected: list[tuple[int, str]] = field(default_factory=list)


class _Bad(NamedTuple):
    reason: str


_SlowOut: TypeAlias = "list[Any] | pa.Table | _Bad"
_FastFn = Callable[[int, int], "_Ok | _Fail"]


class _Collector:
    """Accumulates rows (tables or Python rows) and errors by input index."""

    def __init__(self, schema: pa.Schema, prefix: str) -> None:
        self.schema = schema
        self.prefix = prefix
        self.pieces: list[pa.Table] = []
        self.ok: list[I64] = []
        self.rows: list[list[Any]] = []
        self.row_idx: list[int] = []
        self.err_idx: list[int] = []
        self.reasons: list[str] = []

    def table(self, table: pa.Table, idx: I64) -> None:
        if len(idx):
            self._flush()
            self.pieces.append(table)
            self.ok.append(idx)

    def row(self, i: int, values: list[Any]) -> None:
        self.rows.append(values)
        self.row_idx.append(i)

    def error(self, i: int, reason: str) -> None:
        self.err_idx.append(i)
        self.reasons.append(reason)

    def add(self, i: int, out: _SlowOut) -> None:
        if isinstance(out, _Bad):
            self.error(i, out.reason)
        elif isinstance(out, pa.Table):
            self.table(out, np.array([i], dtype=np.int64))
        else:
            self.row(i, out)

    def null(self, i: int, allow: bool) -> None:
        if allow:
            self.row(i, [None] * len(self.schema))
        else:
            self.error(i, NULL_REASON)

    def _flush(self) -> None:
        if not self.rows:
            return
        rows, idx = self.rows, self.row_idx
        self.rows, self.row_idx = [], []
        try:
            table = self._build(rows)
            self.pieces.append(table)
            self.ok.append(np.array(idx, dtype=np.int64))
            return
        except (pa.ArrowException, ValueError, TypeError, OverflowError):
            pass
        for i, r in zip(idx, rows, strict=True):  # isolate the row Arrow refuses
            try:
                self.pieces.append(self._build([r]))
                self.ok.append(np.array([i], dtype=np.int64))
            except (pa.ArrowException, ValueError, TypeError, OverflowError) as exc:
                self.error(i, f"{self.prefix}: cannot store the row: {exc}")

    def _build(self, rows: list[list[Any]]) -> pa.Table:
        cols = [
            pa.array([r[k] for r in rows], type=f.type) for k, f in enumerate(self.schema)
        ]
        return pa.Table.from_arrays(cols, schema=self.schema)

    def result(self) -> DecodeResult:
        self._flush()
        pieces = [p if p.schema == self.schema else p.cast(self.schema) for p in self.pieces]
        table = pa.concat_tables(pieces) if pieces else self.schema.empty_table()
        ok = np.concatenate(self.ok) if self.ok else np.zeros(0, dtype=np.int64)
        if len(ok) > 1 and not bool(np.all(ok[1:] > ok[:-1])):
            order = np.argsort(ok, kind="stable")
            ok = ok[order]
            table = table.take(pa.array(order))
        err = np.array(self.err_idx, dtype=np.int64)
        reasons = self.reasons
        if len(err) > 1 and not bool(np.all(err[1:] > err[:-1])):
            order = np.argsort(err, kind="stable")
            err = err[order]
            reasons = [reasons[k] for k in order]
        return DecodeResult(table, ok, err, list(reasons))


def _hint(message: str) -> int | None:
    m = _HINT_RE.search(message)
    return int(m.group(1)) if m else None


def _decode_slowly(
    c: _Collector, data: pa.Array, which: npt.NDArray[np.bool_],
    slow: Callable[[bytes], _SlowOut], allow_null: bool,
) -> None:
    """Decode the records ``which`` selects one by one (the fast path cannot
    take them): nulls per ``allow_null``, the rest through ``slow``."""
    rest = np.flatnonzero(which)
    for i, raw in zip(rest.tolist(), data.take(pa.array(rest)).to_pylist(), strict=True):
        if raw is None:
            c.null(i, allow_null)
        else:
            c.add(i, slow(raw))


def _decode_screened(
    c: _Collector,
    data: pa.Array,
    cand: npt.NDArray[np.bool_],
    slow: Callable[[bytes], _SlowOut],
    allow_null: bool,
    fast: Callable[[_Joined, int, int], Any],
    suspects: Callable[[_Joined, int, int, str], list[int]],
    **isolate: Any,
) -> DecodeResult:
    """The shared shape of the delimited-text decoders: records that passed the
    screen (``cand``) are joined and read in runs by ``fast``, failing runs
    isolated down to the bad records; the others are decoded one by one."""
    all_cand = bool(cand.all())
    if not all_cand:
        _decode_slowly(c, data, ~cand, slow, allow_null)
    gidx = np.flatnonzero(cand).astype(np.int64)
    if len(gidx):
        records = data if all_cand else data.filter(pa.array(cand))
        joined = _Joined.of(records)
        _isolate(
            c, gidx, joined.bounds(),
            lambda lo, hi: fast(joined, lo, hi),
            lambda lo, hi: [slow(r) for r in joined.records[lo:hi].to_pylist()],
            suspects=lambda lo, hi, msg: suspects(joined, lo, hi, msg),
            **isolate,
        )
    return c.result()


def _chunks(starts: I64, ends: I64, limit: int) -> list[int]:
    """Boundaries splitting records into runs of at most ``limit`` bytes (at
    least one record each)."""
    m = len(starts)
    bounds = [0]
    lo = 0
    while lo < m:
        hi = int(np.searchsorted(ends, starts[lo] + limit, side="right"))
        hi = max(hi, lo + 1)
        bounds.append(hi)
        lo = hi
    return bounds


#: ``suspects(lo, hi, message)``: range-relative positions of the records that
#: may have caused a failure the reader did not pin to a row (may be empty).
_SuspectsFn = Callable[[int, int, str], "list[int]"]


def _isolate(
    col: _Collector,
    gidx: I64,
    bounds: list[int],
    fast: _FastFn,
    slow: Callable[[int, int], list[_SlowOut]],
    *,
    suspects: _SuspectsFn | None = None,
    small: int = 1,
    fanout: int = 8,
    budget: int | None = None,
) -> None:
    """Run ``fast`` over each run of candidates (``bounds``) and isolate the
    records that make a run fail.

    A failing run is cut around the records its failure points at -- the row
    the reader's error names, else the ``suspects`` -- which go to ``slow``
    (``slow(lo, hi)`` judges each record of ``[lo, hi)`` alone); the runs
    between them are retried. A failure that points nowhere splits the run
    into ``fanout`` parts. A run of at most ``small`` records that failed or
    lies between suspects goes to ``slow`` whole, and so does the rest of a
    chunk (one of ``bounds``) once it has used one fast call per ``budget`` of
    its records: bad records that dense are cheaper to decode one by one.
    Every record ends up either in a run the fast path accepted or judged by
    ``slow``. Results are emitted in candidate order; ``gidx`` maps candidate
    positions to input indices.
    """
    run, alone = 0, 1
    # items: (lo, hi, run | alone, chunk)
    stack: list[tuple[int, int, int, int]] = [
        (bounds[k], bounds[k + 1], run, k) for k in range(len(bounds) - 2, -1, -1)
    ]
    calls = [0] * max(len(bounds) - 1, 0)
    allowed = [
        max(4, (bounds[k + 1] - bounds[k]) // budget) if budget else -1
        for k in range(len(bounds) - 1)
    ]
    while stack:
        lo, hi, what, chunk = stack.pop()
        n = hi - lo
        if what == alone or calls[chunk] == allowed[chunk]:
            for i, out in zip(gidx[lo:hi].tolist(), slow(lo, hi), strict=True):
                col.add(i, out)
            continue
        calls[chunk] += 1
        out = fast(lo, hi)
        if isinstance(out, _Ok):
            idx = gidx[lo:hi]
            if out.rejected:
                keep = np.ones(n, dtype=bool)
                for p, reason in out.rejected:
                    keep[p] = False
                    col.error(int(idx[p]), reason)
                idx = idx[keep]
            col.table(out.table, idx)
            continue
        if n <= small:
            stack.append((lo, hi, alone, chunk))
            continue
        if out.hint is not None and 0 <= out.hint < n:
            cut = [out.hint]
        elif suspects is not None:
            cut = sorted({p for p in suspects(lo, hi, out.message) if 0 <= p < n})
        else:
            cut = []
        items: list[tuple[int, int, int, int]] = []
        if cut:
            prev = lo
            for p in cut:
                if lo + p > prev:
                    items.append((prev, lo + p, run if lo + p - prev > small else alone, chunk))
                if items and items[-1][2] == alone and items[-1][1] == lo + p:
                    items[-1] = (items[-1][0], lo + p + 1, alone, chunk)  # adjacent suspects
                else:
                    items.append((lo + p, lo + p + 1, alone, chunk))
                prev = lo + p + 1
            if prev < hi:
                items.append((prev, hi, run if hi - prev > small else alone, chunk))
        else:
            step = -(-n // fanout)
            items = [(a, min(a + step, hi), run, chunk) for a in range(lo, hi, step)]
        stack += items[::-1]


@dataclass
class _Joined:
    """Candidate records joined by ``\\n`` into one buffer, with their spans."""

    records: pa.Array  # the candidates, binary or large_binary
    buf: pa.Buffer
    starts: I64
    ends: I64

    @classmethod
    def of(cls, records: pa.Array) -> _Joined:
        off, _ = _offsets(records)
        if pa.types.is_binary(records.type) and int(off[-1] - off[0]) + len(records) >= 2**31:
            records = records.cast(pa.large_binary())  # the joined value needs 64-bit offsets
            off, _ = _offsets(records)
        lists = pa.ListArray.from_arrays(pa.array([0, len(records)], pa.int32()), records)
        sep = pa.scalar(b"\n", records.type)
        buf = pc.binary_join(lists, sep)[0].as_buffer()
        pos = np.arange(len(records), dtype=np.int64)
        starts = off[:-1] - off[0] + pos
        ends = off[1:] - off[0] + pos
        return cls(records, buf, starts, ends)

    def span(self, lo: int, hi: int) -> pa.Buffer:
        """Records ``[lo, hi)`` as one buffer, separated by ``\\n``."""
        a, b = int(self.starts[lo]), int(self.ends[hi - 1])
        return self.buf.slice(a, b - a)

    def lines(self, lo: int, hi: int) -> pa.Buffer:
        """Like :meth:`span`, each record ending with ``\\n`` (the last one too)."""
        a, b = int(self.starts[lo]), int(self.ends[hi - 1])
        if b < self.buf.size:
            return self.buf.slice(a, b + 1 - a)
        return pa.py_buffer(self.buf.slice(a, b - a).to_pybytes() + b"\n")

    def bounds(self) -> list[int]:
        return _chunks(self.starts, self.ends, CHUNK_BYTES)


# the C parser of flat objects (optional: built when a compiler was there)
_json_native: Any = load_extension("reclock", "_json_native")

#: Arrow types of the read schema the C parser fills, and its codes for them.
_NATIVE_KINDS = {pa.int64(): 0, pa.int32(): 1, pa.float64(): 2, pa.bool_(): 3, pa.string(): 4}


def _native_fields(schema: pa.Schema) -> tuple[tuple[bytes, int], ...] | None:
    """``(name, kind)`` per field for the C parser, or None if it cannot fill
    them all (or is not built)."""
    if _json_native is None or any(f.type not in _NATIVE_KINDS for f in schema):
        return None
    return tuple((f.name.encode(), _NATIVE_KINDS[f.type]) for f in schema)


def _read_options_block(size: int) -> int:
    # One block for the whole span: row numbers in errors are then span-relative.
    return min(max(size + 1, 1 << 12), 2**31 - 1)


def _screen(data: pa.Array, first: int | None, last: int | None, utf8: bool
            ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """(valid, candidate) masks: candidates are the valid records that, when
    ``first``/``last`` are given, are non-empty and begin/end with those bytes
    and, if ``utf8``, are valid UTF-8."""
    valid = _valid_mask(data)
    cand = valid.copy()
    if first is not None or last is not None:
        off, values = _offsets(data)
        nonempty = off[1:] > off[:-1]
        cand &= nonempty
        safe_first = np.where(nonempty, off[:-1], 0)
        safe_last = np.where(nonempty, off[1:] - 1, 0)
        if len(values):
            if first is not None:
                cand &= values[safe_first] == first
            if last is not None:
                cand &= values[safe_last] == last
        else:
            cand[:] = False
    if utf8:
        text = pa.large_string() if pa.types.is_large_binary(data.type) else pa.string()
        try:
            data.cast(text)
        except (pa.ArrowException, ValueError):
            cand[_bad_positions(data, lambda a: a.cast(text))] = False
    return valid, cand


# --------------------------------------------------------------------------
# bytes / text
# --------------------------------------------------------------------------


class BytesDecoder:
    """``{"type": "bytes"}``: the record as column ``data`` (binary). Never fails
    except on a null record (see module doc)."""

    def __init__(self, allow_null: bool = False) -> None:
        self.allow_null = allow_null
        self.schema = pa.schema([pa.field("data", pa.binary())])

    def decode(self, data: pa.Array) -> DecodeResult:
        data = _as_binary(data)
        n = len(data)
        if data.null_count == 0 or self.allow_null:
            col = data.cast(pa.binary())
            table = pa.Table.from_arrays([col], schema=self.schema)
            return DecodeResult(table, np.arange(n, dtype=np.int64), np.zeros(0, np.int64), [])
        valid = _valid_mask(data)
        ok = np.flatnonzero(valid).astype(np.int64)
        err = np.flatnonzero(~valid).astype(np.int64)
        col = data.filter(pa.array(valid)).cast(pa.binary())
        table = pa.Table.from_arrays([col], schema=self.schema)
        return DecodeResult(table, ok, err, [NULL_REASON] * len(err))


class TextDecoder:
    """``{"type": "text"}``: the record as column ``text`` (string); a record
    that is not valid UTF-8 is an error row."""

    def __init__(self, allow_null: bool = False) -> None:
        self.allow_null = allow_null
        self.schema = pa.schema([pa.field("text", pa.string())])

    def decode(self, data: pa.Array) -> DecodeResult:
        data = _as_binary(data)
        n = len(data)
        if data.null_count == 0 or self.allow_null:
            try:  # a null record stays a null row: exactly what the cast gives
                col = data.cast(pa.string())
                table = pa.Table.from_arrays([col], schema=self.schema)
                return DecodeResult(
                    table, np.arange(n, dtype=np.int64), np.zeros(0, np.int64), []
                )
            except (pa.ArrowException, ValueError):
                pass
        _, cand = _screen(data, None, None, utf8=True)
        c = _Collector(self.schema, "text")
        rest = np.flatnonzero(~cand)
        for i, raw in zip(rest.tolist(), data.take(pa.array(rest)).to_pylist(), strict=True):
            if raw is None:
                c.null(i, self.allow_null)
                continue
            try:
                raw.decode("utf-8")
                c.error(i, "text: invalid utf-8")  # pragma: no cover - the screen said so
            except UnicodeDecodeError as exc:
                c.error(i, f"text: invalid utf-8: {exc}")
        good = np.flatnonzero(cand).astype(np.int64)
        col = data.filter(pa.array(cand)).cast(pa.string())
        c.table(pa.Table.from_arrays([col], schema=self.schema), good)
        return c.result()


# --------------------------------------------------------------------------
# json
# --------------------------------------------------------------------------


def _json_kind(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float | Decimal):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _dumps(v: object) -> str:
    """Compact JSON text of a value parsed with ``parse_float=Decimal``."""
    if isinstance(v, Decimal):
        return str(v)
    if isinstance(v, dict):
        return "{" + ",".join(
            json.dumps(k, ensure_ascii=False) + ":" + _dumps(x) for k, x in v.items()
        ) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_dumps(x) for x in v) + "]"
    return json.dumps(v, ensure_ascii=False)


def _decimal_via_arrow(f: _Field, text: str) -> Any:
    """One JSON number/string -> ``f.type`` exactly as the fast path converts it."""
    t = pjson.read_json(
        io.BytesIO(b'{"v":' + text.encode("utf-8") + b"}"),
        read_options=pjson.ReadOptions(use_threads=False),
        parse_options=pjson.ParseOptions(explicit_schema=pa.schema([("v", f.type)])),
    )
    col = t.column(0)
    col.validate(full=True)  # the reader can yield a value beyond the precision
    return col[0].as_py()


def _decimal_why(message: str) -> str:
    if "requires scale" in message:
        return "too many digits after the point"
    if "requires precision" in message or "does not fit in precision" in message:
        return "too many digits"
    if "is not a valid decimal" in message:
        return "not a decimal number"
    return message


#: Messages of the fast path's conversion errors (they name no row).
_JSON_CONVERSION_RE = re.compile(
    r"Failed to convert JSON|is not a valid decimal|does not fit in precision"
)


def _re2_literal(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch == "_" else f"\\x{{{ord(ch):x}}}" for ch in text)


def _suspect_pattern(fields: Sequence[_Field]) -> str:
    """An RE2 pattern matching records where an int or decimal field holds a
    value that may fail Arrow's conversion (a superset: false hits only cost a
    per-record decode)."""
    alts = []
    for f in fields:
        key = '"' + _re2_literal(f.name) + r'"\s*:\s*'
        if f.kind in _INT_RANGE:
            digits = 10 if f.kind == "int32" else 19
            alts.append(key + r"-?(?:\d*[.eE]|\d{" + str(digits) + ",})")
        elif f.kind == "decimal":
            p, sc = f.type.precision, f.type.scale
            frac, whole = str(sc + 1), str(p - sc + 1)
            alts.append(
                key + r'"?[-+]?(?:\d*\.\d{' + frac + r"}|\d{" + whole + r"}|[\d.]*[eE])"
            )
            alts.append(key + r'"[^"]*[^-+\d."]')
    return "|".join(f"(?:{a})" for a in alts)


#: A run this short is decoded record by record rather than with one more
#: reader call: ``json.loads`` and the conversions cost ~4 us a record, a
#: pyarrow reader call ~150-300 us plus ~0.5 us a record.
_JSON_SMALL = 64
#: A chunk may use one reader call per this many of its records; past that the
#: bad records are dense enough (1 in 64) that the rest of the chunk is cheaper
#: to decode record by record.
_JSON_BUDGET = 64


class JsonDecoder:
    """``{"type": "json"}`` (column ``value``: the record's JSON text, validated)
    or ``{"type": "json", "schema": {...}}`` (typed columns from the record's
    top-level object; missing fields and JSON nulls are null; other fields are
    ignored).

    Fast path: one ``pyarrow.json.read_json`` per ~1 MiB of records with the
    declared schema (dates and timestamps read as text, then converted).
    Per-record path (``json.loads`` + per-field conversion, :func:`_convert_json`)
    for the records a failing run is cut around, for short failing runs and
    chunks dense with bad records, for records that are not ``{...}`` byte for
    byte (surrounding whitespace, arrays, scalars, garbage), and for every
    record when a column has type ``json`` (the reader cannot hand back a
    field's text).
    """

    def __init__(self, schema: Mapping[str, str] | None = None, allow_null: bool = False) -> None:
        self.allow_null = allow_null
        self.fields: tuple[_Field, ...] | None = (
            None if schema is None else _fields(schema, "json format")
        )
        if self.fields is None:
            self.schema = pa.schema([pa.field("value", pa.string())])
            self._read_schema = pa.schema([])
        else:
            self.schema = _arrow_schema(self.fields)
            self._read_schema = pa.schema([
                pa.field(f.name, pa.string() if f.kind in _STRING_CONVERTERS else f.type)
                for f in self.fields
            ])
        self._all_slow = self.fields is not None and any(f.kind == "json" for f in self.fields)
        self._native = _native_fields(self._read_schema) if self.fields is not None else None
        self._suspect_re = _suspect_pattern(self.fields or ())

    # -- entry point -------------------------------------------------------

    def decode(self, data: pa.Array) -> DecodeResult:
        data = _as_binary(data)
        c = _Collector(self.schema, "json")
        if self._all_slow:
            valid = _valid_mask(data)
            for i, raw in enumerate(data.to_pylist()):
                if not valid[i]:
                    c.null(i, self.allow_null)
                else:
                    c.add(i, self._slow(raw))
            return c.result()
        _, cand = _screen(data, ord("{"), ord("}"), utf8=True)
        return _decode_screened(
            c, data, cand, self._slow, self.allow_null, self._fast, self._suspects,
            small=_JSON_SMALL, budget=_JSON_BUDGET,
        )

    # -- fast path ---------------------------------------------------------

    def _suspects(self, joined: _Joined, lo: int, hi: int, message: str) -> list[int]:
        """Records whose int/decimal fields may not convert: a conversion error
        names no row, so look for the value shapes that can fail."""
        if not self._suspect_re or not _JSON_CONVERSION_RE.search(message):
            return []
        hits = pc.match_substring_regex(joined.records.slice(lo, hi - lo), self._suspect_re)
        return np.flatnonzero(hits.fill_null(False).to_numpy(zero_copy_only=False)).tolist()

    def _fast(self, joined: _Joined, lo: int, hi: int) -> _Ok | _Fail:
        parsed = None if self._native is None else self._parse_native(joined, lo, hi)
        if parsed is None:
            try:
                parsed = self._read_arrow(joined, lo, hi)
            except pa.ArrowException as exc:
                return _Fail(_hint(str(exc)), str(exc))
        return self._typed(joined, lo, hi, parsed)

    def _parse_native(self, joined: _Joined, lo: int, hi: int) -> pa.Table | None:
        """The run through the C parser (reclock/_json_native.c), or None where
        it cannot be sure to read it as pyarrow does."""
        assert self._native is not None
        off, values = _offsets(joined.records.slice(lo, hi - lo))
        cols = _json_native.parse(off, values, self._native)
        if cols is None:
            return None
        n = hi - lo
        arrays = []
        for f, (vals, data, valid, nulls) in zip(self._read_schema, cols, strict=True):
            bufs = [pa.py_buffer(vals)] + ([pa.py_buffer(data)] if f.type == pa.string() else [])
            arrays.append(pa.Array.from_buffers(
                f.type, n, [pa.py_buffer(valid) if nulls else None, *bufs], null_count=nulls))
        return pa.Table.from_arrays(arrays, schema=self._read_schema)

    def _read_arrow(self, joined: _Joined, lo: int, hi: int) -> pa.Table:
        span = joined.span(lo, hi)
        return pjson.read_json(
            pa.BufferReader(span),
            read_options=pjson.ReadOptions(
                use_threads=False, block_size=_read_options_block(span.size)
            ),
            parse_options=pjson.ParseOptions(
                explicit_schema=self._read_schema, unexpected_field_behavior="ignore"
            ),
        )

    def _typed(self, joined: _Joined, lo: int, hi: int, parsed: pa.Table) -> _Ok | _Fail:
        if parsed.num_rows != hi - lo:
            return _Fail(None, f"{parsed.num_rows} rows for {hi - lo} records")
        if self.fields is None:
            text = joined.records.slice(lo, hi - lo).cast(pa.string())
            deep = _too_deep(text)
            table = pa.Table.from_arrays([text], schema=self.schema)
            if not deep:
                return _Ok(table)
            keep = np.ones(hi - lo, dtype=bool)
            keep[deep] = False
            return _Ok(table.filter(pa.array(keep)),
                       [(i, f"json: nested deeper than {MAX_JSON_DEPTH} levels") for i in deep])
        cols = []
        rejected: dict[int, str] = {}
        for f in self.fields:
            col = parsed.column(f.name).combine_chunks()
            if f.kind == "decimal":
                try:  # the reader can yield values beyond the precision (Arrow 26)
                    col.validate(full=True)
                except pa.ArrowException as exc:
                    return _Fail(None, str(exc))
            conv = _STRING_CONVERTERS.get(f.kind)
            if conv is not None:
                strings = col
                col, bad = _convert_isolating(strings, conv)
                for p in bad:
                    rejected.setdefault(
                        p, f"json: field {f.name!r}: cannot parse {_show(strings[p].as_py())} "
                        f"as {f.label}"
                    )
            cols.append(col)
        table = pa.Table.from_arrays(cols, schema=self.schema)
        if rejected:
            keep = np.ones(hi - lo, dtype=bool)
            keep[list(rejected)] = False
            table = table.filter(pa.array(keep))
        return _Ok(table, sorted(rejected.items()))

    # -- per-record path ---------------------------------------------------

    def _slow(self, raw: bytes) -> _SlowOut:
        out = self._slow_parse(raw)
        if self.fields is None and isinstance(out, list) and _depth_over(out[0]):
            return _Bad(f"json: nested deeper than {MAX_JSON_DEPTH} levels")
        return out

    def _slow_parse(self, raw: bytes) -> _SlowOut:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return _Bad(f"json: invalid utf-8: {exc}")
        try:
            obj = _loads(text) if self.fields is None else _loads_decimal(text)
        except json.JSONDecodeError as exc:
            return _Bad(f"json: {exc.msg}: line {exc.lineno} column {exc.colno}")
        except RecursionError:
            return _Bad("json: nested too deeply")
        if self.fields is None:
            # Like the fast path, refuse text whose escapes decode to a lone
            # surrogate (not Unicode; no reader could store it).
            if "\\u" in text and _has_surrogate(json.dumps(obj, ensure_ascii=False)):
                return _Bad("json: string holds a lone surrogate")
            return [text]
        if type(obj) is not dict:
            return _Bad(f"json: expected an object, got {_json_kind(obj)}")
        # a lone surrogate (which Arrow cannot store) can only come from an escape
        surrogates = "\\u" in text
        row: list[Any] = []
        for f in self.fields:
            v = obj.get(f.name)
            if v is None:
                row.append(None)
                continue
            kind = f.kind
            if kind == "int64" or kind == "int32":  # the common cases, inline
                if type(v) is int and _INT_RANGE[kind][0] <= v <= _INT_RANGE[kind][1]:
                    row.append(v)
                    continue
            elif kind == "string":
                if type(v) is str and not (surrogates and _has_surrogate(v)):
                    row.append(v)
                    continue
            elif kind == "bool" and type(v) is bool:
                row.append(v)
                continue
            out = _convert_json(f, v)
            if type(out) is _Bad:
                return _Bad(f"json: field {f.name!r}: {out.reason}")
            row.append(out)
        return row


_loads = json.JSONDecoder().decode
_loads_decimal = json.JSONDecoder(parse_float=Decimal).decode


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _convert_json(f: _Field, v: Any) -> Any:
    """One JSON value (parsed with ``parse_float=Decimal``) -> the Python value
    of ``f``'s column, or :class:`_Bad`. Accepts exactly what the fast path
    accepts (decimals go through Arrow's reader itself)."""

    def expected() -> _Bad:
        return _Bad(f"expected {f.label}, got {_json_kind(v)} {_show(v)}")

    kind = f.kind
    if kind in _INT_RANGE:
        if type(v) is not int:
            return expected()
        lo, hi = _INT_RANGE[kind]
        return v if lo <= v <= hi else _Bad(f"{v} is out of range for {f.label}")
    if kind == "float64":
        if isinstance(v, bool) or not isinstance(v, int | float | Decimal):
            return expected()
        if isinstance(v, float):
            return v  # NaN / Infinity constants
        try:
            x = float(v)
        except OverflowError:
            x = math.inf
        return x if math.isfinite(x) else _Bad(f"{_show(v)} is out of range for float64")
    if kind == "bool":
        return v if isinstance(v, bool) else expected()
    if kind in ("string", "binary", "timestamp", "date"):
        if not isinstance(v, str):
            return expected()
        if _has_surrogate(v):
            return _Bad("string holds a lone surrogate")
        if kind == "string":
            return v
        if kind == "binary":
            return v.encode("utf-8")
        conv = _STRING_CONVERTERS[kind]
        try:
            return conv(pa.array([v], pa.string()))[0].as_py()
        except (pa.ArrowException, ValueError):
            return _Bad(f"cannot parse {_show(v)} as {f.label}")
    if kind == "decimal":
        if isinstance(v, bool) or not isinstance(v, int | Decimal | str):
            return expected()
        text = json.dumps(v) if isinstance(v, str) else str(v)
        try:
            return _decimal_via_arrow(f, text)
        except (pa.ArrowException, ValueError) as exc:
            return _Bad(f"cannot convert {_show(v)} to {f.label}: {_decimal_why(str(exc))}")
    # json: the value's text
    out = _dumps(v)
    return _Bad("string holds a lone surrogate") if _has_surrogate(out) else out


# --------------------------------------------------------------------------
# csv
# --------------------------------------------------------------------------

_CSV_ROW_RE = re.compile(r"In CSV column #(\d+): Row #(\d+): (.*)", re.S)
_CSV_FIELDS_RE = re.compile(r"CSV parse error: (Row #(\d+)): Expected (\d+) columns, got (\d+)")
_CSV_CONV_RE = re.compile(r"CSV conversion error to [^:]+: invalid value (.*)", re.S)
_CSV_DEC_RE = re.compile(r"The string (.*) is not a valid decimal\d* number", re.S)


def _csv_converter(f: _Field) -> Callable[[pa.Array], pa.Array]:
    """Text -> ``f.type``: Arrow's cast (ints in decimal or ``0x`` hex, floats
    incl. ``nan``/``inf``, bools ``true``/``false``/``1``/``0`` in any case,
    decimals without precision loss), ISO-8601 for dates and timestamps."""
    conv = _STRING_CONVERTERS.get(f.kind)
    if conv is not None:
        return conv
    return _Cast(f.type)


@dataclass(frozen=True)
class _Cast:
    type: pa.DataType

    def __call__(self, arr: pa.Array) -> pa.Array:
        return arr.cast(self.type)


class CsvDecoder:
    """``{"type": "csv", "columns": [...], "types": {...}, "delimiter": ",",
    "quote": "\\""}``: each record is one CSV line (a quoted field may hold a
    newline). Columns default to ``string``; an empty field is null in a
    non-string column and ``""`` in a string column. A record with the wrong
    number of fields, or a field that does not convert, is an error row that
    names the column.

    Fields are read as text and converted column by column (see
    :func:`_csv_converter`). There is no header: a Kafka value is one line, so
    ``header: true`` is rejected when the decoder is built.
    """

    def __init__(
        self,
        columns: Sequence[str],
        types: Mapping[str, str] | Sequence[str] | None = None,
        delimiter: str = ",",
        quote: str = '"',
        header: bool = False,
        allow_null: bool = False,
    ) -> None:
        if header:
            raise FormatError(
                "csv format: header: true is not supported: each record is one CSV line "
                "(a Kafka value), so there is no header line to skip; list the columns "
                "under 'columns' instead"
            )
        if isinstance(columns, str) or not columns or not all(
            isinstance(c, str) and c for c in columns
        ):
            raise FormatError("csv format: 'columns' must be a non-empty list of column names")
        if len(set(columns)) != len(columns):
            raise FormatError(f"csv format: duplicate names in 'columns': {list(columns)}")
        if not (isinstance(delimiter, str) and len(delimiter) == 1 and delimiter not in "\r\n"):
            raise FormatError(f"csv format: 'delimiter' must be one character, got {delimiter!r}")
        if not (isinstance(quote, str) and len(quote) == 1 and quote != delimiter):
            raise FormatError(f"csv format: 'quote' must be one character, got {quote!r}")
        if types is None:
            labels = dict.fromkeys(columns, "string")
        elif isinstance(types, Mapping):
            unknown = [k for k in types if k not in columns]
            if unknown:
                raise FormatError(f"csv format: 'types' names columns not in 'columns': {unknown}")
            labels = {c: types.get(c, "string") for c in columns}
        else:
            if len(types) != len(columns):
                raise FormatError(
                    f"csv format: 'types' has {len(types)} entries for {len(columns)} columns"
                )
            labels = dict(zip(columns, types, strict=True))
        self.fields = _fields(labels, "csv format")
        for f in self.fields:
            if f.kind == "json":
                raise FormatError(
                    f"csv format: column {f.name!r}: type json is not supported in csv; "
                    "use string"
                )
        self.delimiter = delimiter
        self.quote = quote
        self.allow_null = allow_null
        self.schema = _arrow_schema(self.fields)

    def decode(self, data: pa.Array) -> DecodeResult:
        data = _as_binary(data)
        c = _Collector(self.schema, "csv")
        # not UTF-8: judged alone (also keeps non-text rows from pyarrow's row handler)
        _, cand = _screen(data, None, None, utf8=True)
        off, values = _offsets(data)
        if len(self.fields) > 1:
            cand &= off[1:] > off[:-1]  # empty records: see _slow
        if _count_newlines(values) and len(data):
            # A record holding a line break would read as two lines: judge it alone.
            nl = pc.match_substring_regex(data, "[\r\n]").fill_null(False)
            cand &= ~np.asarray(nl.to_numpy(zero_copy_only=False), dtype=bool)
        return _decode_screened(
            c, data, cand, self._slow, self.allow_null,
            lambda joined, lo, hi: self._fast(joined.lines(lo, hi), hi - lo, False),
            lambda joined, lo, hi, msg: self._suspects(joined, lo, hi),
        )

    def _suspects(self, joined: _Joined, lo: int, hi: int) -> list[int]:
        """A run that read as fewer lines than records holds a quoted field
        that is not closed: it swallowed the next records. Such a record has an
        odd number of quote characters."""
        quotes = pc.count_substring(joined.records.slice(lo, hi - lo), self.quote)
        odd = pc.bit_wise_and(quotes, 1).to_numpy(zero_copy_only=False)
        return np.flatnonzero(odd).tolist()

    def _read(self, buf: pa.Buffer | bytes, multiline: bool, handler: bool = True
              ) -> tuple[pa.Table, list[tuple[int | None, str]]]:
        """Read ``buf``; rows with the wrong number of fields are skipped and
        listed (1-based row number, reason) if ``handler``, else they raise.
        (pyarrow hands the handler the row as text: only use it on UTF-8.)"""
        invalid: list[tuple[int | None, str]] = []

        def on_invalid(row: Any) -> str:
            invalid.append((
                row.number,
                f"csv: expected {row.expected_columns} columns, got {row.actual_columns}",
            ))
            return "skip"

        size = buf.size if isinstance(buf, pa.Buffer) else len(buf)
        table = pcsv.read_csv(
            pa.BufferReader(buf),
            read_options=pcsv.ReadOptions(
                column_names=[f.name for f in self.fields], use_threads=False,
                block_size=_read_options_block(size),
            ),
            parse_options=pcsv.ParseOptions(
                delimiter=self.delimiter, quote_char=self.quote, double_quote=True,
                escape_char=False, newlines_in_values=multiline, ignore_empty_lines=False,
                invalid_row_handler=on_invalid if handler else None,
            ),
            convert_options=pcsv.ConvertOptions(
                # text only: typed columns are converted afterwards, column by
                # column, so that a bad value rejects its record, not the run
                column_types={
                    f.name: pa.binary() if f.kind == "binary" else pa.string()
                    for f in self.fields
                },
                null_values=[], strings_can_be_null=False, quoted_strings_can_be_null=False,
                check_utf8=True,
            ),
        )
        return table, invalid

    def _fast(self, buf: pa.Buffer | bytes, n: int, multiline: bool, handler: bool = True,
              run: bool = True) -> _Ok | _Fail:
        """Parse ``n`` records of ``buf``, each ending with a line break; see
        :class:`_Ok`. In a ``run`` no record holds a line break, so a line break
        in a value means that a quote was left open: the record is judged alone."""
        try:
            parsed, invalid = self._read(buf, multiline, handler)
        except pa.ArrowException as exc:
            m = _CSV_ROW_RE.match(str(exc)) or _CSV_FIELDS_RE.match(str(exc))
            return _Fail(int(m.group(2)) - 1 if m else None, self._reason(str(exc)))
        lines = parsed.num_rows + len(invalid)
        if lines != n:
            return _Fail(None, f"csv: {lines} lines for {n} records")
        rejected: dict[int, str] = {}
        for number, reason in invalid:
            if number is None or not 1 <= number <= n:
                return _Fail(None, reason)
            rejected[number - 1] = reason
        # positions (in the range) of the parsed rows
        rows = np.array([p for p in range(n) if p not in rejected], dtype=np.int64) \
            if rejected else np.arange(n, dtype=np.int64)
        if run and len(rows) and rows[-1] == n - 1:
            # An open quote in an earlier record swallows the next records (the
            # line count shows it); in the last one it swallows only the break.
            last = parsed.slice(parsed.num_rows - 1, 1)
            for column in last.columns:
                text = column[0].as_py()
                raw = text.encode() if isinstance(text, str) else text
                if isinstance(raw, bytes) and (b"\n" in raw or b"\r" in raw):
                    return _Fail(n - 1, "csv: a quoted field is not closed")
        cols = []
        unparsed: set[int] = set()  # parsed-row indices whose text did not convert
        for f in self.fields:
            col = parsed.column(f.name).combine_chunks()
            if f.kind not in ("string", "binary"):
                # an empty field is null in a typed column
                strings = pc.if_else(pc.equal(col, ""), pa.scalar(None, pa.string()), col)
                col, bad = _convert_isolating(strings, _csv_converter(f))
                for b in bad:
                    unparsed.add(b)
                    rejected.setdefault(
                        int(rows[b]), f"csv: column {f.name!r}: cannot convert "
                        f"{_show(strings[b].as_py())} to {f.label}"
                    )
            cols.append(col)
        table = pa.Table.from_arrays(cols, schema=self.schema)
        if unparsed:
            keep = np.ones(len(rows), dtype=bool)
            keep[sorted(unparsed)] = False
            table = table.filter(pa.array(keep))
        return _Ok(table, sorted(rejected.items()))

    def _slow(self, raw: bytes) -> _SlowOut:
        """One record alone; a quoted field may span lines here."""
        if not raw and len(self.fields) > 1:
            # Arrow reads an empty line as a row of empty fields; it holds one field.
            return _Bad(f"csv: expected {len(self.fields)} columns, got 1")
        try:
            raw.decode("utf-8")
            utf8 = True
        except UnicodeDecodeError:
            utf8 = False
        out = self._fast(raw + b"\n", 1, True, handler=utf8, run=False)
        if isinstance(out, _Ok):
            if out.rejected:
                return _Bad(out.rejected[0][1])
            # A quote left open runs to the end of the input, taking the line
            # break after the record with it: end the record differently and see.
            alt = self._fast(raw + b"\r\n", 1, True, handler=utf8, run=False)
            if not (isinstance(alt, _Ok) and alt.table.equals(out.table)):
                return _Bad("csv: a quoted field is not closed")
            return out.table
        if out.message.startswith("csv: ") and " lines for 1 records" in out.message:
            lines = out.message.split()[1]
            return _Bad(f"csv: the record holds {lines} lines; a record is one CSV line")
        return _Bad(out.message)

    def _reason(self, message: str) -> str:
        if fm := _CSV_FIELDS_RE.match(message):
            return f"csv: expected {fm.group(3)} columns, got {fm.group(4)}"
        m = _CSV_ROW_RE.match(message)
        if not m:
            return message if message.startswith("csv: ") else f"csv: {message}"
        k = int(m.group(1))
        f = self.fields[k] if k < len(self.fields) else None
        name = f.name if f else f"#{k}"
        detail = m.group(3)
        label = f.label if f else "?"
        if (v := _CSV_CONV_RE.match(detail)) or (v := _CSV_DEC_RE.match(detail)):
            return f"csv: column {name!r}: cannot convert {v.group(1)} to {label}"
        if "invalid UTF8" in detail:
            return f"csv: column {name!r}: invalid utf-8"
        return f"csv: column {name!r}: {detail}"


# --------------------------------------------------------------------------
# avro
# --------------------------------------------------------------------------


class _SchemaMissing(DefiniteError):
    """The registry does not know a schema id a record names."""


class SchemaRegistryResolver:
    """Writer schemas from a Confluent-compatible schema registry, by id.

    ``GET {url}/schemas/ids/{id}``, cached by id for the life of the object
    (ids are immutable). A schema id the registry does not know (HTTP 404) is
    a definite fault of the records naming it; anything else (connection
    refused, timeout, 5xx) raises :class:`~reclock.errors.TransientError`. Basic
    auth may be given as ``http://user:secret@host``; the secret never appears
    in a message. Picklable: the cache travels with it.
    """

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise FormatError(f"registry_url must be an http(s) URL, got {_redact(url)!r}")
        self._auth: str | None = None
        if parts.username is not None:
            user = urllib.parse.unquote(parts.username)
            secret = urllib.parse.unquote(parts.password or "")
            self._auth = "Basic " + base64.b64encode(f"{user}:{secret}".encode()).decode()
            netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
            parts = parts._replace(netloc=netloc)
        self.url = urllib.parse.urlunsplit(parts).rstrip("/")
        self.timeout = timeout
        self._schemas: dict[int, Any] = {}

    def __repr__(self) -> str:
        return f"SchemaRegistryResolver({self.url!r})"

    def _get(self, path: str) -> Any:
        req = urllib.request.Request(
            self.url + path, headers={"Accept": "application/vnd.schemaregistry.v1+json"}
        )
        if self._auth:
            req.add_header("Authorization", self._auth)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read().decode("utf-8"))
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise _SchemaMissing(f"{self.url}{path}: not found") from None
            raise TransientError(
                f"schema registry {self.url}: GET {path} answered HTTP {exc.code}",
                hint="check the registry is healthy; the source retries",
            ) from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise TransientError(
                f"schema registry {self.url}: GET {path} failed: {reason}",
                hint="check the registry is reachable from the executors; the source retries",
            ) from None
        except ValueError as exc:
            raise TransientError(
                f"schema registry {self.url}: GET {path} returned invalid JSON: {exc}"
            ) from None

    @staticmethod
    def _avro_text(body: Any, where: str) -> str:
        if not isinstance(body, dict) or not isinstance(body.get("schema"), str):
            raise TransientError(f"schema registry: {where}: no 'schema' in the answer")
        kind = body.get("schemaType", "AVRO")
        if kind != "AVRO":
            raise _SchemaMissing(f"{where} is a {kind} schema, not AVRO")
        return str(body["schema"])

    def writer_schema(self, schema_id: int) -> Any:
        """The parsed writer schema registered under ``schema_id``."""
        hit = self._schemas.get(schema_id)
        if hit is None:
            text = self._avro_text(self._get(f"/schemas/ids/{schema_id}"), f"id {schema_id}")
            try:
                hit = fastavro.parse_schema(json.loads(text))
            except Exception as exc:  # any parse failure is definite
                raise _SchemaMissing(f"schema id {schema_id} is not valid Avro: {exc}") from None
            self._schemas[schema_id] = hit
        return hit

    def latest(self, subject: str) -> str:
        """The schema text of the latest version of ``subject``."""
        quoted = urllib.parse.quote(subject, safe="")
        return self._avro_text(
            self._get(f"/subjects/{quoted}/versions/latest"), f"subject {subject!r}"
        )


def _redact(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


_AVRO_PRIMITIVES: dict[str, pa.DataType] = {
    "null": pa.null(), "boolean": pa.bool_(), "int": pa.int32(), "long": pa.int64(),
    "float": pa.float32(), "double": pa.float64(), "bytes": pa.binary(), "string": pa.string(),
}

_Fix = Callable[[Any], Any]


class _AvroMapper:
    """Avro schema -> Arrow type, plus the fix-ups Arrow needs on fastavro's
    Python values (only ``uuid`` -> ``str`` today)."""

    def __init__(self, named: Mapping[str, Any]) -> None:
        self.named = named
        self.visiting: set[str] = set()

    def arrow(self, s: Any) -> tuple[pa.DataType, _Fix | None]:
        if isinstance(s, str):
            if s in _AVRO_PRIMITIVES:
                return _AVRO_PRIMITIVES[s], None
            if s in self.visiting:
                raise FormatError(f"avro format: recursive type {s!r} is not supported")
            if s not in self.named:
                raise FormatError(f"avro format: unknown type name {s!r}")
            return self.arrow(self.named[s])
        if isinstance(s, list):
            branches = [b for b in s if b != "null"]
            if not branches:
                return pa.null(), None
            if len(branches) > 1:
                raise FormatError(
                    f"avro format: union {json.dumps(s)[:80]} has several non-null "
                    "branches; only [\"null\", T] unions map to a column"
                )
            return self.arrow(branches[0])
        if not isinstance(s, dict):
            raise FormatError(f"avro format: unexpected schema node {s!r}")
        t = s.get("type")
        logical = s.get("logicalType")
        if t in ("record", "error"):
            name = s.get("name", "")
            self.visiting.add(name)
            fields = []
            fixes: dict[str, _Fix] = {}
            for f in s["fields"]:
                ft, fx = self.arrow(f["type"])
                fields.append(pa.field(f["name"], ft, nullable=True))
                if fx:
                    fixes[f["name"]] = fx
            self.visiting.discard(name)
            return pa.struct(fields), _RecordFix(fixes) if fixes else None
        if t == "enum":
            return pa.string(), None
        if t == "fixed":
            if logical == "decimal":
                return _avro_decimal(s), None
            return pa.binary(int(s["size"])), None
        if t == "array":
            it, ifx = self.arrow(s["items"])
            return pa.list_(it), _ListFix(ifx) if ifx else None
        if t == "map":
            vt, vfx = self.arrow(s["values"])
            return pa.map_(pa.string(), vt), _MapFix(vfx) if vfx else None
        if isinstance(t, str) and t in _AVRO_PRIMITIVES:
            match (t, logical):
                case ("int", "date"):
                    return pa.date32(), None
                case ("int", "time-millis"):
                    return pa.time32("ms"), None
                case ("long", "time-micros"):
                    return pa.time64("us"), None
                case ("long", "timestamp-millis"):
                    return pa.timestamp("ms", tz="UTC"), None
                case ("long", "timestamp-micros"):
                    return pa.timestamp("us", tz="UTC"), None
                case ("long", "timestamp-nanos"):
                    return pa.timestamp("ns", tz="UTC"), None
                case ("long", "local-timestamp-millis"):
                    return pa.timestamp("ms"), None
                case ("long", "local-timestamp-micros"):
                    return pa.timestamp("us"), None
                case ("long", "local-timestamp-nanos"):
                    return pa.timestamp("ns"), None
                case ("bytes", "decimal"):
                    return _avro_decimal(s), None
                case ("string", "uuid"):
                    return pa.string(), _UuidFix()
            return _AVRO_PRIMITIVES[t], None
        return self.arrow(t)


def _avro_decimal(s: Mapping[str, Any]) -> pa.DataType:
    p, sc = int(s["precision"]), int(s.get("scale", 0))
    return pa.decimal128(p, sc) if p <= 38 else pa.decimal256(p, sc)


class _UuidFix:
    def __call__(self, v: Any) -> Any:
        return None if v is None else str(v)


@dataclass(frozen=True)
class _RecordFix:
    fixes: dict[str, _Fix]

    def __call__(self, v: Any) -> Any:
        if v is None:
            return None
        return {k: (self.fixes[k](x) if k in self.fixes else x) for k, x in v.items()}


@dataclass(frozen=True)
class _ListFix:
    item: _Fix

    def __call__(self, v: Any) -> Any:
        return None if v is None else [self.item(x) for x in v]


@dataclass(frozen=True)
class _MapFix:
    value: _Fix

    def __call__(self, v: Any) -> Any:
        return None if v is None else {k: self.value(x) for k, x in v.items()}


class AvroDecoder:
    """``{"type": "avro", "schema": ..., "registry_url": ..., "subject": ...}``.

    * Without ``registry_url``: each record is a bare Avro datum written with
      ``schema``.
    * With ``registry_url``: each record is in the Confluent wire format
      (``0x00``, 4-byte big-endian schema id, datum). The writer schema is
      fetched by id (:class:`SchemaRegistryResolver`) and resolved against the
      reader schema: ``schema`` if given, else the latest version of
      ``subject``, fetched once when the decoder is built.

    The columns are the fields of the top-level record (one column ``value``
    if the schema is not a record): nested records -> struct, arrays -> list,
    maps -> map, ``["null", T]`` -> nullable T, enums -> string, bytes ->
    binary, fixed -> fixed-size binary, logical dates/times/timestamps/decimals
    -> the Arrow logical types. A datum that does not read (or leaves
    trailing bytes) is an error row with fastavro's message.
    """

    def __init__(
        self,
        schema: str | Mapping[str, Any] | list[Any] | None = None,
        registry_url: str | None = None,
        subject: str | None = None,
        allow_null: bool = False,
        timeout: float = 10.0,
    ) -> None:
        self.allow_null = allow_null
        self.resolver = SchemaRegistryResolver(registry_url, timeout) if registry_url else None
        if schema is None:
            if self.resolver is None or not subject:
                raise FormatError(
                    "avro format: give 'schema' (the reader schema), or 'registry_url' "
                    "with 'subject' to use the subject's latest schema"
                )
            schema = self.resolver.latest(subject)
        parsed: Any = schema
        if isinstance(schema, str):
            try:
                parsed = json.loads(schema)
            except ValueError:
                parsed = schema.strip()  # a bare primitive name such as string
        elif isinstance(schema, Mapping):
            parsed = dict(schema)
        named: dict[str, Any] = {}
        try:
            self._reader = fastavro.parse_schema(parsed, named_schemas=named)
        except Exception as exc:  # fastavro raises many types
            raise FormatError(f"avro format: invalid schema: {exc}") from None
        arrow, fix = _AvroMapper(named).arrow(self._reader)
        if isinstance(self._reader, dict) and self._reader.get("type") in ("record", "error"):
            self.schema = pa.schema(list(arrow))
            self._columns = [f.name for f in arrow]
            self._record = True
        else:
            self.schema = pa.schema([pa.field("value", arrow)])
            self._columns = ["value"]
            self._record = False
        self._fix = fix

    def _read_one(self, raw: bytes) -> Any:
        """One datum (raises on bad bytes; ``_SchemaMissing``/``TransientError``
        for registry faults)."""
        if self.resolver is not None:
            if len(raw) < 5 or raw[0] != 0:
                head = f"0x{raw[0]:02x}" if raw else "nothing"
                raise ValueError(
                    f"not in the Confluent wire format (starts with {head}, expected 0x00 "
                    "and a 4-byte schema id)"
                )
            writer = self.resolver.writer_schema(int.from_bytes(raw[1:5], "big"))
            body = io.BytesIO(raw)
            body.seek(5)
            value = fastavro.schemaless_reader(body, writer, self._reader)
        else:
            body = io.BytesIO(raw)
            value = fastavro.schemaless_reader(body, self._reader, None)
        rest = len(raw) - body.tell()
        if rest:
            raise ValueError(f"{rest} trailing bytes after the datum")
        return value

    def decode(self, data: pa.Array) -> DecodeResult:
        data = _as_binary(data)
        c = _Collector(self.schema, "avro")
        for i, raw in enumerate(data.to_pylist()):
            if raw is None:
                c.null(i, self.allow_null)
                continue
            try:
                value = self._read_one(raw)
                if self._fix is not None:
                    value = self._fix(value)
            except TransientError:
                raise
            except _SchemaMissing as exc:
                c.error(i, f"avro: {exc}")
                continue
            except Exception as exc:  # bad bytes fail in many ways
                msg = str(exc)
                c.error(i, f"avro: {type(exc).__name__}: {msg}" if msg else
                        f"avro: {type(exc).__name__} (truncated or corrupt datum)")
                continue
            c.row(i, [value.get(k) for k in self._columns] if self._record else [value])
        return c.result()


# --------------------------------------------------------------------------
# Construction and key/value
# --------------------------------------------------------------------------

_SPEC_KEYS = {
    "bytes": {"type"},
    "text": {"type"},
    "json": {"type", "schema"},
    "csv": {"type", "columns", "types", "delimiter", "quote", "header"},
    "avro": {"type", "schema", "registry_url", "subject", "timeout"},
}


def make_decoder(spec: Mapping[str, Any], *, allow_null: bool = False) -> Decoder:
    """Build the decoder a format spec describes (driver side; checks the spec).

    ``allow_null`` is set by the envelope, not the user: the upsert envelope
    passes ``True`` for the value decoder so that a tombstone becomes a row of
    nulls (a delete) instead of an error.
    """
    if not isinstance(spec, Mapping) or "type" not in spec:
        raise FormatError(f"format spec needs a 'type' ({', '.join(_SPEC_KEYS)}), got {spec!r}")
    kind = spec["type"]
    if kind not in _SPEC_KEYS:
        raise FormatError(f"unknown format type {kind!r}; expected one of {', '.join(_SPEC_KEYS)}")
    extra = sorted(set(spec) - _SPEC_KEYS[kind])
    if extra:
        raise FormatError(
            f"{kind} format: unknown keys {extra}; allowed: {sorted(_SPEC_KEYS[kind])}"
        )
    if kind == "bytes":
        return BytesDecoder(allow_null=allow_null)
    if kind == "text":
        return TextDecoder(allow_null=allow_null)
    if kind == "json":
        return JsonDecoder(spec.get("schema"), allow_null=allow_null)
    if kind == "csv":
        if "columns" not in spec:
            raise FormatError("csv format: 'columns' is required")
        return CsvDecoder(
            spec["columns"], spec.get("types"), delimiter=spec.get("delimiter", ","),
            quote=spec.get("quote", '"'), header=bool(spec.get("header", False)),
            allow_null=allow_null,
        )
    return AvroDecoder(
        spec.get("schema"), registry_url=spec.get("registry_url"), subject=spec.get("subject"),
        allow_null=allow_null, timeout=float(spec.get("timeout", 10.0)),
    )


def _mask(idx: I64, n: int) -> npt.NDArray[np.bool_]:
    m = np.zeros(n, dtype=bool)
    m[idx] = True
    return m


def _part_reason(part: str, reason: str) -> str:
    return f"{part} is null" if reason == NULL_REASON else f"{part}: {reason}"


class KeyValueDecoder:
    """Decodes Kafka key and value together: key columns (as declared) then
    value columns (as declared). Names must not clash (``FormatError``, a
    ``ValueError``, when built). A record fails if either part fails; the
    reason says which (``"key: ..."``, ``"value: ..."``, both joined by
    ``"; "``). Without a key decoder the key is ignored."""

    def __init__(self, key: Decoder | None, value: Decoder) -> None:
        if key is not None:
            clash = sorted(set(key.schema.names) & set(value.schema.names))
            if clash:
                raise FormatError(
                    f"key and value formats both produce columns {clash}; rename them "
                    "(e.g. declare the key's columns under other names)"
                )
        self.key = key
        self.value = value
        fields = ([*key.schema] if key is not None else []) + [*value.schema]
        self.schema = pa.schema(fields)

    def decode(self, key: pa.Array, value: pa.Array) -> DecodeResult:
        vr = self.value.decode(value)
        if self.key is None:
            reasons = [_part_reason("value", r) for r in vr.reasons]
            return DecodeResult(vr.table, vr.ok, vr.errors, reasons)
        n = len(value)
        if len(key) != n:
            raise ValueError(f"key has {len(key)} records, value has {n}")
        kr = self.key.decode(key)
        k_ok, v_ok = _mask(kr.ok, n), _mask(vr.ok, n)
        both = k_ok & v_ok
        kt = kr.table.filter(pa.array(both[kr.ok])) if not both[kr.ok].all() else kr.table
        vt = vr.table.filter(pa.array(both[vr.ok])) if not both[vr.ok].all() else vr.table
        cols = [*kt.columns, *vt.columns]
        table = pa.Table.from_arrays(cols, schema=self.schema)
        why: dict[int, list[str]] = {}
        for i, r in zip(kr.errors.tolist(), kr.reasons, strict=True):
            why.setdefault(i, []).append(_part_reason("key", r))
        for i, r in zip(vr.errors.tolist(), vr.reasons, strict=True):
            why.setdefault(i, []).append(_part_reason("value", r))
        errors = np.array(sorted(why), dtype=np.int64)
        reasons = ["; ".join(why[int(i)]) for i in errors]
        return DecodeResult(table, np.flatnonzero(both).astype(np.int64), errors, reasons)


def decode_key_value(
    key_dec: Decoder | None, value_dec: Decoder, key: pa.Array, value: pa.Array
) -> DecodeResult:
    """Decode ``key``/``value`` arrays together (see :class:`KeyValueDecoder`)."""
    return KeyValueDecoder(key_dec, value_dec).decode(key, value)
