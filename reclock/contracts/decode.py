"""Decode: raw record bytes -> typed rows, with bad records kept as data.

This module is the decode contract (:class:`Decoder`, :class:`DecodeResult`,
:class:`FormatError`; keys and values decoded together by
:class:`KeyValueDecoder`), how a format declares itself
(:class:`FormatPlugin`), and the screening machinery the built-in formats
share (below), which a format of another package may use as well.

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
  reason, and the caller records it with its source position (bad input is
  data: docs/design.md, "Outputs and envelopes"). Only two things raise from
  ``decode``:
  an input of the wrong Arrow type (a bug upstream) and a transient fault
  (:class:`~reclock.core.errors.TransientError`, e.g. the schema registry is
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

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from reclock.clients.native import load_extension
from reclock.contracts.config import ConfigModel
from reclock.core.errors import DefiniteError

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

INT_RANGE = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_DECIMAL_RE = re.compile(r"decimal\(\s*(\d+)\s*,\s*(\d+)\s*\)")
_HINT_RE = re.compile(r" in row (\d+)\s*$")
_ZONED_RE = r"[T ]\d{2}(?::\d{2}(?::\d{2}(?:\.\d+)?)?)?(?:Z|[+-]\d{2}(?::?\d{2})?)$"


class FormatError(DefiniteError, ValueError):
    """A format spec that cannot be built (unknown type, missing schema, ...).

    Raised on the driver, when the pipeline is built, never while decoding."""


@dataclass(frozen=True)
class ColumnField:
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


def depth_over(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
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


def too_deep(texts: pa.Array) -> list[int]:
    """Rows of ``texts`` nested deeper than :data:`MAX_JSON_DEPTH`; only rows
    with more openers than that are scanned."""
    openers = pc.add(pc.count_substring(texts, "{"), pc.count_substring(texts, "["))
    many = np.flatnonzero(pc.fill_null(pc.greater(openers, MAX_JSON_DEPTH), False)
                          .to_numpy(zero_copy_only=False))
    return [int(i) for i in many if depth_over(texts[int(i)].as_py() or "")]


def declared_fields(schema: Mapping[str, str], where: str) -> tuple[ColumnField, ...]:
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
        out.append(ColumnField(name, kind, typ, str(label)))
    return tuple(out)


def arrow_schema(fields: Sequence[ColumnField]) -> pa.Schema:
    return pa.schema([pa.field(f.name, f.type, nullable=True) for f in fields])


@dataclass(frozen=True)
class DecodeResult:
    """Decoded rows and rejected records of one input array (see module doc)."""

    table: pa.Table
    ok: I64
    errors: I64
    reasons: list[str]
    #: values of fields the output does not have that the decoder left out,
    #: per field (an Avro writer schema wider than a frozen output's)
    dropped: Mapping[str, int] = field(default_factory=dict)

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


def as_binary(data: pa.Array | pa.ChunkedArray) -> pa.Array:
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


def offsets(arr: pa.Array) -> tuple[I64, npt.NDArray[np.uint8]]:
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


def valid_mask(arr: pa.Array) -> npt.NDArray[np.bool_]:
    if arr.null_count == 0:
        return np.ones(len(arr), dtype=bool)
    return np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)


def count_newlines(values: npt.NDArray[np.uint8]) -> int:
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


def convert_isolating(
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


STRING_CONVERTERS: dict[str, Callable[[pa.Array], pa.Array]] = {
    "timestamp": _to_timestamp,
    "date": _to_date,
}


def show(value: object, limit: int = 40) -> str:
    """A short rendering of a value for a reason: strings quoted, numbers as written."""
    text = repr(value) if isinstance(value, str | bytes) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Fail(NamedTuple):
    """A fast-path call that rejected its range: ``hint`` is the range-relative
    position the reader named, if any; ``message`` says why."""

    hint: int | None
    message: str = ""


@dataclass
class Ok:
    """A fast-path call that accepted its range: ``table`` holds the rows of
    every record of the range except the ``rejected`` ones (range-relative
    positions with reasons), in order."""

    table: pa.Table
    rejected: list[tuple[int, str]] = field(default_factory=list)


class Bad(NamedTuple):
    reason: str


SlowOut: TypeAlias = "list[Any] | pa.Table | Bad"
_FastFn = Callable[[int, int], "Ok | Fail"]


class Collector:
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

    def add(self, i: int, out: SlowOut) -> None:
        if isinstance(out, Bad):
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


def row_hint(message: str) -> int | None:
    m = _HINT_RE.search(message)
    return int(m.group(1)) if m else None


def _decode_slowly(
    c: Collector, data: pa.Array, which: npt.NDArray[np.bool_],
    slow: Callable[[bytes], SlowOut], allow_null: bool,
) -> None:
    """Decode the records ``which`` selects one by one (the fast path cannot
    take them): nulls per ``allow_null``, the rest through ``slow``."""
    rest = np.flatnonzero(which)
    for i, raw in zip(rest.tolist(), data.take(pa.array(rest)).to_pylist(), strict=True):
        if raw is None:
            c.null(i, allow_null)
        else:
            c.add(i, slow(raw))


def decode_screened(
    c: Collector,
    data: pa.Array,
    cand: npt.NDArray[np.bool_],
    slow: Callable[[bytes], SlowOut],
    allow_null: bool,
    fast: Callable[[Joined, int, int], Any],
    suspects: Callable[[Joined, int, int, str], list[int]],
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
        joined = Joined.of(records)
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
    col: Collector,
    gidx: I64,
    bounds: list[int],
    fast: _FastFn,
    slow: Callable[[int, int], list[SlowOut]],
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
        if isinstance(out, Ok):
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
class Joined:
    """Candidate records with their spans in the records joined by ``\n``;
    the joined buffer itself is built on first use (the C JSON parser reads
    the records where they are and never needs it)."""

    records: pa.Array  # the candidates, binary or large_binary
    starts: I64
    ends: I64

    @classmethod
    def of(cls, records: pa.Array) -> Joined:
        off, _ = offsets(records)
        if pa.types.is_binary(records.type) and int(off[-1] - off[0]) + len(records) >= 2**31:
            records = records.cast(pa.large_binary())  # the joined value needs 64-bit offsets
            off, _ = offsets(records)
        pos = np.arange(len(records), dtype=np.int64)
        starts = off[:-1] - off[0] + pos
        ends = off[1:] - off[0] + pos
        return cls(records, starts, ends)

    @cached_property
    def buf(self) -> pa.Buffer:
        """The records joined by ``\n`` into one buffer."""
        lists = pa.ListArray.from_arrays(pa.array([0, len(self.records)], pa.int32()),
                                         self.records)
        sep = pa.scalar(b"\n", self.records.type)
        return pc.binary_join(lists, sep)[0].as_buffer()

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
json_native: Any = load_extension("reclock", "_json_native")

#: Arrow types of the read schema the C parser fills, and its codes for them.
_NATIVE_KINDS = {pa.int64(): 0, pa.int32(): 1, pa.float64(): 2, pa.bool_(): 3, pa.string(): 4}


def native_fields(schema: pa.Schema) -> tuple[tuple[bytes, int], ...] | None:
    """``(name, kind)`` per field for the C parser, or None if it cannot fill
    them all (or is not built)."""
    if json_native is None or any(f.type not in _NATIVE_KINDS for f in schema):
        return None
    return tuple((f.name.encode(), _NATIVE_KINDS[f.type]) for f in schema)


def read_options_block(size: int) -> int:
    # One block for the whole span: row numbers in errors are then span-relative.
    return min(max(size + 1, 1 << 12), 2**31 - 1)


def screen(data: pa.Array, first: int | None, last: int | None, utf8: bool
            ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """(valid, candidate) masks: candidates are the valid records that, when
    ``first``/``last`` are given, are non-empty and begin/end with those bytes
    and, if ``utf8``, are valid UTF-8."""
    valid = valid_mask(data)
    cand = valid.copy()
    if first is not None or last is not None:
        off, values = offsets(data)
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
            return DecodeResult(vr.table, vr.ok, vr.errors, reasons, vr.dropped)
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
        dropped = dict(vr.dropped)
        for k, v in kr.dropped.items():
            dropped[k] = dropped.get(k, 0) + v
        return DecodeResult(table, np.flatnonzero(both).astype(np.int64), errors, reasons,
                            dropped)


def decode_key_value(
    key_dec: Decoder | None, value_dec: Decoder, key: pa.Array, value: pa.Array
) -> DecodeResult:
    """Decode ``key``/``value`` arrays together (see :class:`KeyValueDecoder`)."""
    return KeyValueDecoder(key_dec, value_dec).decode(key, value)


@dataclass(frozen=True)
class DecoderOptions:
    """What the pipeline adds to a format spec when it builds a decoder.

    ``allow_null`` is set by the envelope, not the user: the upsert envelope
    passes ``True`` for the value decoder so that a tombstone becomes a row of
    nulls (a delete) instead of an error. ``policy`` is the output's
    ``schema_change``; ``known`` and ``seen`` feed a decoder that keeps a
    union of writer schemas (Avro's, see
    :class:`~reclock.formats.avro.AvroDecoder`); ``part`` says which part of
    the record it decodes (``key`` or ``value``), for messages."""

    allow_null: bool = False
    policy: str = "evolve"
    known: Mapping[str, Any] | None = None
    seen: Sequence[int] = ()
    part: str = "value"


@dataclass(frozen=True)
class FormatPlugin:
    """How a format declares itself: the one value its module offers to the
    ``reclock.formats`` entry point group (``json = "pkg.mod:PLUGIN"``; the
    entry point's name is ``name``).

    ``config`` is the model of the output's ``format:`` block (its ``type``
    literal is ``name``); ``decoder(spec, options)`` builds the
    :class:`Decoder` from a spec, the block as ``config.model_dump()`` gives
    it (or a mapping written in code, with the same keys and the
    ``extra_keys``), on the driver: a bad spec is a :class:`FormatError`.
    The decoder is pickled to the Spark tasks."""

    name: str
    config: type[ConfigModel]
    decoder: Callable[[Mapping[str, Any], DecoderOptions], Decoder]
    #: spec keys a mapping written in code may hold besides the config's
    extra_keys: tuple[str, ...] = ()

    @property
    def keys(self) -> frozenset[str]:
        """Every key a spec of this format may hold."""
        fields = self.config.model_fields
        return frozenset([*(f.alias or n for n, f in fields.items()), *self.extra_keys])
