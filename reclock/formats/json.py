"""The ``json`` format: typed columns from JSON objects (a C parser for the
common cases, pyarrow and Python for the rest), bad records isolated."""

from __future__ import annotations

import io
import json
import math
import re
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pjson
from pydantic import Field

from reclock.contracts.config import ColumnType, ConfigModel
from reclock.contracts.decode import (
    INT_RANGE,
    MAX_JSON_DEPTH,
    STRING_CONVERTERS,
    Bad,
    Collector,
    ColumnField,
    DecodeResult,
    DecoderOptions,
    Fail,
    FormatPlugin,
    Joined,
    Ok,
    SlowOut,
    arrow_schema,
    as_binary,
    convert_isolating,
    declared_fields,
    decode_screened,
    depth_over,
    json_native,
    native_fields,
    offsets,
    read_options_block,
    row_hint,
    screen,
    show,
    too_deep,
    valid_mask,
)

I64 = npt.NDArray[np.int64]

# json


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


def _decimal_via_arrow(f: ColumnField, text: str) -> Any:
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


def _suspect_pattern(fields: Sequence[ColumnField]) -> str:
    """An RE2 pattern matching records where an int or decimal field holds a
    value that may fail Arrow's conversion (a superset: false hits only cost a
    per-record decode)."""
    alts = []
    for f in fields:
        key = '"' + _re2_literal(f.name) + r'"\s*:\s*'
        if f.kind in INT_RANGE:
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
        self.fields: tuple[ColumnField, ...] | None = (
            None if schema is None else declared_fields(schema, "json format")
        )
        if self.fields is None:
            self.schema = pa.schema([pa.field("value", pa.string())])
            self._read_schema = pa.schema([])
        else:
            self.schema = arrow_schema(self.fields)
            self._read_schema = pa.schema([
                pa.field(f.name, pa.string() if f.kind in STRING_CONVERTERS else f.type)
                for f in self.fields
            ])
        self._all_slow = self.fields is not None and any(f.kind == "json" for f in self.fields)
        self._native = native_fields(self._read_schema) if self.fields is not None else None
        self._suspect_re = _suspect_pattern(self.fields or ())

    # -- entry point -------------------------------------------------------

    def decode(self, data: pa.Array) -> DecodeResult:
        data = as_binary(data)
        c = Collector(self.schema, "json")
        if self._all_slow:
            valid = valid_mask(data)
            for i, raw in enumerate(data.to_pylist()):
                if not valid[i]:
                    c.null(i, self.allow_null)
                else:
                    c.add(i, self._slow(raw))
            return c.result()
        _, cand = screen(data, ord("{"), ord("}"), utf8=True)
        return decode_screened(
            c, data, cand, self._slow, self.allow_null, self._fast, self._suspects,
            small=_JSON_SMALL, budget=_JSON_BUDGET,
        )

    # -- fast path ---------------------------------------------------------

    def _suspects(self, joined: Joined, lo: int, hi: int, message: str) -> list[int]:
        """Records whose int/decimal fields may not convert: a conversion error
        names no row, so look for the value shapes that can fail."""
        if not self._suspect_re or not _JSON_CONVERSION_RE.search(message):
            return []
        hits = pc.match_substring_regex(joined.records.slice(lo, hi - lo), self._suspect_re)
        return np.flatnonzero(hits.fill_null(False).to_numpy(zero_copy_only=False)).tolist()

    def _fast(self, joined: Joined, lo: int, hi: int) -> Ok | Fail:
        parsed = None if self._native is None else self._parse_native(joined, lo, hi)
        if parsed is None:
            try:
                parsed = self._read_arrow(joined, lo, hi)
            except pa.ArrowException as exc:
                return Fail(row_hint(str(exc)), str(exc))
        return self._typed(joined, lo, hi, parsed)

    def _parse_native(self, joined: Joined, lo: int, hi: int) -> pa.Table | None:
        """The run through the C parser (reclock/json_native.c), or None where
        it cannot be sure to read it as pyarrow does."""
        assert self._native is not None
        off, values = offsets(joined.records.slice(lo, hi - lo))
        cols = json_native.parse(off, values, self._native)
        if cols is None:
            return None
        n = hi - lo
        arrays = []
        for f, (vals, data, valid, nulls) in zip(self._read_schema, cols, strict=True):
            bufs = [pa.py_buffer(vals)] + ([pa.py_buffer(data)] if f.type == pa.string() else [])
            arrays.append(pa.Array.from_buffers(
                f.type, n, [pa.py_buffer(valid) if nulls else None, *bufs], null_count=nulls))
        return pa.Table.from_arrays(arrays, schema=self._read_schema)

    def _read_arrow(self, joined: Joined, lo: int, hi: int) -> pa.Table:
        span = joined.span(lo, hi)
        return pjson.read_json(
            pa.BufferReader(span),
            read_options=pjson.ReadOptions(
                use_threads=False, block_size=read_options_block(span.size)
            ),
            parse_options=pjson.ParseOptions(
                explicit_schema=self._read_schema, unexpected_field_behavior="ignore"
            ),
        )

    def _typed(self, joined: Joined, lo: int, hi: int, parsed: pa.Table) -> Ok | Fail:
        if parsed.num_rows != hi - lo:
            return Fail(None, f"{parsed.num_rows} rows for {hi - lo} records")
        if self.fields is None:
            text = joined.records.slice(lo, hi - lo).cast(pa.string())
            deep = too_deep(text)
            table = pa.Table.from_arrays([text], schema=self.schema)
            if not deep:
                return Ok(table)
            keep = np.ones(hi - lo, dtype=bool)
            keep[deep] = False
            return Ok(table.filter(pa.array(keep)),
                       [(i, f"json: nested deeper than {MAX_JSON_DEPTH} levels") for i in deep])
        cols = []
        rejected: dict[int, str] = {}
        for f in self.fields:
            col = parsed.column(f.name).combine_chunks()
            if f.kind == "decimal":
                try:  # the reader can yield values beyond the precision (Arrow 26)
                    col.validate(full=True)
                except pa.ArrowException as exc:
                    return Fail(None, str(exc))
            conv = STRING_CONVERTERS.get(f.kind)
            if conv is not None:
                strings = col
                col, bad = convert_isolating(strings, conv)
                for p in bad:
                    rejected.setdefault(
                        p, f"json: field {f.name!r}: cannot parse {show(strings[p].as_py())} "
                        f"as {f.label}"
                    )
            cols.append(col)
        table = pa.Table.from_arrays(cols, schema=self.schema)
        if rejected:
            keep = np.ones(hi - lo, dtype=bool)
            keep[list(rejected)] = False
            table = table.filter(pa.array(keep))
        return Ok(table, sorted(rejected.items()))

    # -- per-record path ---------------------------------------------------

    def _slow(self, raw: bytes) -> SlowOut:
        out = self._slow_parse(raw)
        if self.fields is None and isinstance(out, list) and depth_over(out[0]):
            return Bad(f"json: nested deeper than {MAX_JSON_DEPTH} levels")
        return out

    def _slow_parse(self, raw: bytes) -> SlowOut:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return Bad(f"json: invalid utf-8: {exc}")
        try:
            obj = _loads(text) if self.fields is None else _loads_decimal(text)
        except json.JSONDecodeError as exc:
            return Bad(f"json: {exc.msg}: line {exc.lineno} column {exc.colno}")
        except RecursionError:
            return Bad("json: nested too deeply")
        if self.fields is None:
            # Like the fast path, refuse text whose escapes decode to a lone
            # surrogate (not Unicode; no reader could store it).
            if "\\u" in text and _has_surrogate(json.dumps(obj, ensure_ascii=False)):
                return Bad("json: string holds a lone surrogate")
            return [text]
        if type(obj) is not dict:
            return Bad(f"json: expected an object, got {_json_kind(obj)}")
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
                if type(v) is int and INT_RANGE[kind][0] <= v <= INT_RANGE[kind][1]:
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
            if type(out) is Bad:
                return Bad(f"json: field {f.name!r}: {out.reason}")
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


def _convert_json(f: ColumnField, v: Any) -> Any:
    """One JSON value (parsed with ``parse_float=Decimal``) -> the Python value
    of ``f``'s column, or :class:`Bad`. Accepts exactly what the fast path
    accepts (decimals go through Arrow's reader itself)."""

    def expected() -> Bad:
        return Bad(f"expected {f.label}, got {_json_kind(v)} {show(v)}")

    kind = f.kind
    if kind in INT_RANGE:
        if type(v) is not int:
            return expected()
        lo, hi = INT_RANGE[kind]
        return v if lo <= v <= hi else Bad(f"{v} is out of range for {f.label}")
    if kind == "float64":
        if isinstance(v, bool) or not isinstance(v, int | float | Decimal):
            return expected()
        if isinstance(v, float):
            return v  # NaN / Infinity constants
        try:
            x = float(v)
        except OverflowError:
            x = math.inf
        return x if math.isfinite(x) else Bad(f"{show(v)} is out of range for float64")
    if kind == "bool":
        return v if isinstance(v, bool) else expected()
    if kind in ("string", "binary", "timestamp", "date"):
        if not isinstance(v, str):
            return expected()
        if _has_surrogate(v):
            return Bad("string holds a lone surrogate")
        if kind == "string":
            return v
        if kind == "binary":
            return v.encode("utf-8")
        conv = STRING_CONVERTERS[kind]
        try:
            return conv(pa.array([v], pa.string()))[0].as_py()
        except (pa.ArrowException, ValueError):
            return Bad(f"cannot parse {show(v)} as {f.label}")
    if kind == "decimal":
        if isinstance(v, bool) or not isinstance(v, int | Decimal | str):
            return expected()
        text = json.dumps(v) if isinstance(v, str) else str(v)
        try:
            return _decimal_via_arrow(f, text)
        except (pa.ArrowException, ValueError) as exc:
            return Bad(f"cannot convert {show(v)} to {f.label}: {_decimal_why(str(exc))}")
    # json: the value's text
    out = _dumps(v)
    return Bad("string holds a lone surrogate") if _has_surrogate(out) else out


class JsonFormat(ConfigModel):
    """Each record is one JSON object."""

    type: Literal["json"] = "json"
    """``json``."""
    schema_: dict[str, ColumnType] | None = Field(default=None, alias="schema")
    """Columns to extract, ``column: type`` (types: int32, int64, float64, bool,
    string, binary, timestamp, date, decimal(p,s), json). Without a schema the
    whole document is kept as one ``json`` column."""


def _decoder(spec: Mapping[str, Any], options: DecoderOptions) -> JsonDecoder:
    return JsonDecoder(spec.get("schema"), allow_null=options.allow_null)


PLUGIN = FormatPlugin(name="json", config=JsonFormat, decoder=_decoder)
