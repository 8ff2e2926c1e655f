"""PostgreSQL column types as Arrow types, and text values as Arrow arrays.

Both halves of the source see values in PostgreSQL's *text* form: pgoutput
(protocol version 1) sends every tuple column as text, and the initial
snapshot reads rows with ``COPY ... TO STDOUT`` in text format. The sessions
run with ``TimeZone=UTC``, ``DateStyle=ISO`` and ``IntervalStyle=iso_8601``
and ``bytea_output=hex``, so one converter serves both.

Types (by OID of the column's type; a domain maps as its base type)::

    bool -> bool                 int2 -> int16   int4 -> int32   int8 -> int64
    oid -> int64                 float4 -> float32   float8 -> float64
    numeric(p,s), p <= 38 -> decimal128(p,s)      numeric (unconstrained) -> string
    text, varchar, bpchar, name, char, enums, json, jsonb, uuid, xml -> string
    bytea -> binary              date -> date32  time -> time64[us]
    timestamp -> timestamp[us]   timestamptz -> timestamp[us, UTC]
    arrays of the above (one dimension) -> list<element>
    anything else (interval, inet, money, ranges, ...) -> string (its text form)

Unconstrained ``numeric`` stays text because it has no fixed precision (a
decimal128 would round). ``infinity``/``-infinity`` timestamps and dates map
to the smallest/largest value Arrow can hold; a numeric ``NaN`` in a
constrained column, and any text that does not parse, is a
:class:`~reclock.core.errors.DefiniteError` naming the table, the column and the
value. Whole-column conversions do the work (Arrow's casts; bytea's hex
decoded with numpy; times cast as timestamps on 1970-01-01); only a column
one of them refuses (its per-value pass finds and names the value, or
takes what only it reads: ``24:00:00``, ``infinity``), and arrays, are
converted value by value.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from reclock.core.errors import DefiniteError

BOOL, BYTEA, CHAR, NAME, INT8, INT2, INT4, TEXT, OID = 16, 17, 18, 19, 20, 21, 23, 25, 26
JSON, XML, FLOAT4, FLOAT8, BPCHAR, VARCHAR = 114, 142, 700, 701, 1042, 1043
DATE, TIME, TIMESTAMP, TIMESTAMPTZ, NUMERIC, UUID, JSONB = 1082, 1083, 1114, 1184, 1700, 2950, 3802

_SCALAR: dict[int, pa.DataType] = {
    BOOL: pa.bool_(), BYTEA: pa.binary(), CHAR: pa.string(), NAME: pa.string(),
    INT8: pa.int64(), INT2: pa.int16(), INT4: pa.int32(), TEXT: pa.string(), OID: pa.int64(),
    JSON: pa.string(), XML: pa.string(), FLOAT4: pa.float32(), FLOAT8: pa.float64(),
    BPCHAR: pa.string(), VARCHAR: pa.string(), DATE: pa.date32(), TIME: pa.time64("us"),
    TIMESTAMP: pa.timestamp("us"), TIMESTAMPTZ: pa.timestamp("us", tz="UTC"),
    UUID: pa.string(), JSONB: pa.string(),
}

#: Session settings under which the text forms below are produced.
SESSION_OPTIONS = ("-c TimeZone=UTC -c DateStyle=ISO -c IntervalStyle=iso_8601 "
                   "-c bytea_output=hex -c extra_float_digits=3")


@dataclass(frozen=True)
class PgType:
    """A column's type as the converter needs it: the OID of the (base) type,
    its modifier, its name as ``format_type`` prints it, and for arrays the
    element type's OID (0 otherwise)."""

    oid: int
    typmod: int
    name: str
    elem: int = 0

    @property
    def arrow(self) -> pa.DataType:
        if self.elem:
            return pa.list_(PgType(self.elem, self.typmod, self.name.removesuffix("[]")).arrow)
        if self.oid == NUMERIC:
            p, s = numeric_precision(self.typmod)
            return pa.decimal128(p, s) if p is not None and p <= 38 else pa.string()
        return _SCALAR.get(self.oid, pa.string())


def numeric_precision(typmod: int) -> tuple[int | None, int]:
    """``(precision, scale)`` of ``numeric(p,s)``; ``(None, 0)`` when unconstrained."""
    if typmod < 4:
        return None, 0
    t = typmod - 4
    p, s = (t >> 16) & 0xFFFF, t & 0xFFFF
    if s > 0x7FF:  # negative scales (PG 15) are stored as 11-bit two's complement
        s -= 0x800
    return p, s


class ConversionError(DefiniteError):
    """A text value that does not fit its column's Arrow type."""


def _fail(where: str, value: Any, why: str) -> ConversionError:
    shown = value if not isinstance(value, str) or len(value) < 80 else value[:77] + "..."
    return ConversionError(f"{where}: value {shown!r} {why}",
                           hint="reclock maps PostgreSQL types as documented in "
                                "sources/postgres/types.py")


_TS_MIN, _TS_MAX = -(2**63) + 1, 2**63 - 1
_DATE_MIN, _DATE_MAX = -(2**31) + 1, 2**31 - 1


def _py_timestamp(v: str, tz: bool) -> int:
    """Microseconds since the epoch of one timestamp text (BC, infinity)."""
    if v == "infinity":
        return _TS_MAX
    if v == "-infinity":
        return _TS_MIN
    bc = v.endswith(" BC")
    if bc:
        raise ValueError("dates before the year 1 are not supported")
    s = v
    if tz:
        # '+00', '+05:30', '-08' offsets; normalize to +HH:MM for fromisoformat
        for i in range(len(s) - 1, 9, -1):
            if s[i] in "+-":
                off = s[i + 1:]
                if ":" not in off:
                    off = off[:2] + ":" + (off[2:] or "00")
                s = s[:i] + s[i] + off
                break
    d = dt.datetime.fromisoformat(s)
    if d.tzinfo is None:
        d = d.replace(tzinfo=dt.UTC)
    delta = d - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _py_date(v: str) -> int:
    if v == "infinity":
        return _DATE_MAX
    if v == "-infinity":
        return _DATE_MIN
    if v.endswith(" BC"):
        raise ValueError("dates before the year 1 are not supported")
    return (dt.date.fromisoformat(v) - dt.date(1970, 1, 1)).days


def _py_time(v: str) -> int:
    if v.startswith("24:00:00"):
        return 86_400_000_000
    t = dt.time.fromisoformat(v)
    return ((t.hour * 60 + t.minute) * 60 + t.second) * 1_000_000 + t.microsecond


def _py_bytea(v: str) -> bytes:
    if not v.startswith("\\x"):
        raise ValueError("is not in hex format (bytea_output=hex)")
    return bytes.fromhex(v[2:])


def _py_bool(v: str) -> bool:
    if v in ("t", "true"):
        return True
    if v in ("f", "false"):
        return False
    raise ValueError("is not a boolean")


#: hex digit -> its value; 255 for every other byte
_HEX = np.full(256, 255, np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i


def _bytea_column(arr: pa.Array) -> pa.Array | None:
    """A string column of bytea hex forms (``\\x0a1b``) as binary, decoded
    for the whole column at once; None when a value is not a hex form (the
    per-value pass then names it), or when values are long: numpy's passes
    over the bytes then cost more than ``bytes.fromhex`` per value (on
    2026-11-27: 5x faster at 4-byte values, 3x at 16, 3x slower at 1 KiB)."""
    n = len(arr)
    if arr.nbytes > 256 * (n - arr.null_count) + 4 * (n + 1):
        return None
    validity, offs, data = arr.buffers()
    offsets = np.frombuffer(offs, np.int32, n + 1, arr.offset * 4).astype(np.int64)
    raw = np.frombuffer(data, np.uint8) if data is not None else np.empty(0, np.uint8)
    if arr.null_count:
        bits = np.unpackbits(np.frombuffer(validity, np.uint8), bitorder="little")
        valid = bits[arr.offset:arr.offset + n].astype(bool)
    else:
        valid = np.ones(n, bool)
    starts = offsets[:-1][valid]
    lens = np.diff(offsets)[valid]
    if (lens < 2).any() or (lens % 2).any():
        return None
    if not ((raw[starts] == ord("\\")) & (raw[starts + 1] == ord("x"))).all():
        return None
    hex_lens = lens - 2
    lo, hi = int(offsets[0]), int(offsets[-1])
    if (np.diff(offsets)[~valid] != 0).any():
        return None  # a null slot with bytes (Arrow allows it; nothing here makes one)
    # every value's hex digits: the column's bytes without each value's "\x"
    keep = np.ones(hi - lo, bool)
    keep[starts - lo] = False
    keep[starts - lo + 1] = False
    nibbles = _HEX[raw[lo:hi][keep]]
    if (nibbles == 255).any():
        return None
    out = (nibbles[0::2] << 4) | nibbles[1::2]
    out_lens = np.zeros(n, np.int64)
    out_lens[valid] = hex_lens // 2
    new_offsets = np.zeros(n + 1, np.int32)
    np.cumsum(out_lens, out=new_offsets[1:])
    mask = None
    if arr.null_count:
        mask = pa.py_buffer(np.packbits(valid, bitorder="little").tobytes())
    return pa.Array.from_buffers(pa.binary(), n, [mask, pa.py_buffer(new_offsets.tobytes()),
                                                  pa.py_buffer(out.tobytes())],
                                 null_count=arr.null_count)


def _time_column(arr: pa.Array) -> pa.Array | None:
    """A string column of times (``HH:MM:SS[.ffffff]``) as time64[us], cast
    for the whole column as timestamps on 1970-01-01; None when Arrow
    refuses one (``24:00:00``, or not a time: the per-value pass)."""
    try:
        stamps = pc.binary_join_element_wise("1970-01-01 ", arr, "").cast(pa.timestamp("us"))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    return stamps.cast(pa.int64()).view(pa.time64("us"))


def _per_value(values: Sequence[str | None], fn: Callable[[str], Any], typ: pa.DataType,
               where: str) -> pa.Array:
    out: list[Any] = []
    for v in values:
        if v is None:
            out.append(None)
            continue
        try:
            out.append(fn(v))
        except (ValueError, OverflowError) as exc:
            raise _fail(where, v, f"is not a valid {typ}: {exc}") from None
    if pa.types.is_timestamp(typ) or pa.types.is_date(typ) or pa.types.is_time(typ):
        storage = {32: pa.int32(), 64: pa.int64()}[typ.bit_width]
        return pa.array(out, storage).view(typ)
    return pa.array(out, typ)


def convert(values: Sequence[str | None] | pa.Array, pgtype: PgType, where: str) -> pa.Array:
    """The Arrow array of ``values`` (text forms, ``None`` for NULL) of one column.

    ``where`` names the column in errors (``table public.t column c``).
    """
    typ = pgtype.arrow
    if isinstance(values, pa.Array):
        arr = values if values.type == pa.string() else values.cast(pa.string())
    else:
        arr = pa.array(values, pa.string())
    if pgtype.elem:
        return _convert_array(arr.to_pylist(), pgtype, typ, where)
    if typ == pa.string():
        return arr
    if typ == pa.binary():
        got = _bytea_column(arr)
        return got if got is not None else _per_value(arr.to_pylist(), _py_bytea, typ, where)
    if typ == pa.bool_():
        if pc.all(pc.is_in(arr.drop_null(), pa.array(["t", "f"]))).as_py() is not False:
            return pc.equal(arr, "t")
        return _per_value(arr.to_pylist(), _py_bool, typ, where)
    if pa.types.is_time(typ):
        got = _time_column(arr)
        return got if got is not None else _per_value(arr.to_pylist(), _py_time, typ, where)
    try:
        return arr.cast(typ)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    if pa.types.is_timestamp(typ):
        tz = typ.tz is not None
        return _per_value(arr.to_pylist(), lambda v: _py_timestamp(v, tz), typ, where)
    if pa.types.is_date(typ):
        return _per_value(arr.to_pylist(), _py_date, typ, where)
    # find the offending value for the message
    for v in arr.to_pylist():
        if v is None:
            continue
        try:
            pa.array([v], pa.string()).cast(typ)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise _fail(where, v, f"does not fit {typ}: {exc}") from None
    raise _fail(where, None, f"does not fit {typ}")  # pragma: no cover - cast failed as a whole


def parse_array(text: str) -> list[str | None]:
    """The elements (text forms, ``None`` for NULL) of a one-dimensional array
    in PostgreSQL's output format: ``{1,2,NULL}``, ``{"a b","c\\"d"}``,
    ``[0:1]={x,y}``. Multi-dimensional arrays raise ValueError."""
    s = text
    if s.startswith("["):  # explicit bounds
        eq = s.find("=")
        if eq < 0:
            raise ValueError("malformed array bounds")
        s = s[eq + 1:]
    if len(s) < 2 or s[0] != "{" or s[-1] != "}":
        raise ValueError("is not an array literal")
    body = s[1:-1]
    out: list[str | None] = []
    if not body:
        return out
    i, n = 0, len(body)
    while i <= n:
        if i < n and body[i] == "{":
            raise ValueError("multi-dimensional arrays are not supported")
        if i < n and body[i] == '"':
            i += 1
            buf = []
            while i < n and body[i] != '"':
                if body[i] == "\\" and i + 1 < n:
                    i += 1
                buf.append(body[i])
                i += 1
            if i >= n:
                raise ValueError("unterminated quoted element")
            i += 1  # closing quote
            out.append("".join(buf))
        else:
            j = body.find(",", i)
            j = n if j < 0 else j
            tok = body[i:j]
            out.append(None if tok == "NULL" else tok)
            i = j
        if i < n and body[i] != ",":
            raise ValueError(f"unexpected {body[i]!r} in array")
        i += 1
    return out


def _convert_array(texts: Sequence[str | None], pgtype: PgType, typ: pa.DataType,
                   where: str) -> pa.Array:
    offsets = [0]
    flat: list[str | None] = []
    valid: list[bool] = []
    for v in texts:
        if v is None:
            valid.append(False)
        else:
            try:
                flat.extend(parse_array(v))
            except ValueError as exc:
                raise _fail(where, v, f"is not a supported array: {exc}") from None
            valid.append(True)
        offsets.append(len(flat))
    elem = PgType(pgtype.elem, pgtype.typmod, pgtype.name.removesuffix("[]"))
    values = convert(flat, elem, f"{where} (array element)")
    mask = pa.array([not x for x in valid], pa.bool_())
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values, type=typ, mask=mask)


def widens_to(new: pa.DataType, stored: pa.DataType) -> bool:
    """Whether values of Arrow type ``new`` fit the output's ``stored`` type
    exactly: a column retyped upstream may still be read into the output."""
    if new == stored:
        return True
    ints = [pa.int16(), pa.int32(), pa.int64()]
    if new in ints and stored in ints:
        return ints.index(new) <= ints.index(stored)
    if new == pa.float32() and stored == pa.float64():
        return True
    if pa.types.is_decimal(new) and pa.types.is_decimal(stored):
        return bool(new.scale <= stored.scale
                    and new.precision - new.scale <= stored.precision - stored.scale)
    if new in ints and pa.types.is_decimal(stored):
        digits = {pa.int16(): 5, pa.int32(): 10, pa.int64(): 19}[new]
        return bool(stored.precision - stored.scale >= digits)
    return bool(stored == pa.string() and (pa.types.is_decimal(new) or new in ints))
