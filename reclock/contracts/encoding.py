"""Arrow values as JSON (binary as base64, non-finite floats as strings, maps
as pairs) and back, rows as Python values whatever their types
(:func:`py_rows`), and Arrow IPC staging files: what refused rows, the
printing commands and the staging sinks (Kafka, Postgres) share."""

from __future__ import annotations

import base64
import math
from decimal import Decimal
from typing import Any, BinaryIO

import pyarrow as pa

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def is_binary(t: pa.DataType) -> bool:
    return bool(pa.types.is_binary(t) or pa.types.is_large_binary(t)
                or pa.types.is_fixed_size_binary(t) or pa.types.is_binary_view(t))

def is_listlike(t: pa.DataType) -> bool:
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t)
                or pa.types.is_fixed_size_list(t) or pa.types.is_list_view(t)
                or pa.types.is_large_list_view(t))

def is_nanos(t: pa.DataType) -> bool:
    """A timestamp, time or duration in nanoseconds (more than Python's
    datetime and timedelta, or Delta, can hold)."""
    return getattr(t, "unit", None) == "ns" and bool(
        pa.types.is_timestamp(t) or pa.types.is_time(t) or pa.types.is_duration(t))


def _nanos_as_text(t: pa.DataType) -> pa.DataType:
    """``t`` with every nanosecond timestamp, time or duration inside it
    (nested too) as a string: Python's datetime and timedelta hold only
    microseconds, and pyarrow turns such values into Python objects only
    through pandas, which reclock does not require."""
    if is_nanos(t):
        return pa.string()
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_nanos_as_text(f.type)) for f in t])
    if pa.types.is_map(t):
        return pa.map_(_nanos_as_text(t.key_type), _nanos_as_text(t.item_type))
    if pa.types.is_large_list(t):
        return pa.large_list(t.value_field.with_type(_nanos_as_text(t.value_type)))
    if pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(_nanos_as_text(t.value_type)))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(t.value_field.with_type(_nanos_as_text(t.value_type)), t.list_size)
    if pa.types.is_dictionary(t):
        inner = _nanos_as_text(t.value_type)
        return t if inner == t.value_type else inner
    return t


def py_rows(table: pa.Table) -> list[dict[str, Any]]:
    """``table.to_pylist()``, with nanosecond temporal values (as in
    :func:`_nanos_as_text`) given as their ISO text (``2023-11-14
    22:13:20.123456789``; durations as a count of nanoseconds): for printing
    rows and for a refused row's JSON, whatever the column types."""
    cols = []
    for f in table.schema:
        safe = _nanos_as_text(f.type)
        cols.append(table.column(f.name) if safe == f.type else table.column(f.name).cast(safe))
    rows: list[dict[str, Any]] = pa.table(cols, names=table.column_names).to_pylist()
    return rows


def to_json(v: Any, t: pa.DataType) -> Any:
    if v is None:
        return None
    if is_binary(t):
        return base64.b64encode(v).decode("ascii")
    if pa.types.is_floating(t):
        f = float(v)
        if math.isfinite(f):
            return f
        return "NaN" if math.isnan(f) else ("Infinity" if f > 0 else "-Infinity")
    if is_listlike(t):
        return [to_json(x, t.value_type) for x in v]
    if pa.types.is_map(t):
        return [[to_json(k, t.key_type), to_json(x, t.item_type)] for k, x in v]
    if pa.types.is_struct(t):
        return {t.field(i).name: to_json(v.get(t.field(i).name), t.field(i).type)
                for i in range(t.num_fields)}
    return v

def from_json(v: Any, t: pa.DataType) -> Any:
    """A parsed JSON value back into a value ``pa.array`` takes for type ``t``
    (temporal values stay integers in their unit, which it accepts)."""
    if v is None:
        return None
    if pa.types.is_dictionary(t):
        return from_json(v, t.value_type)
    if pa.types.is_decimal(t):
        return Decimal(v)
    if is_binary(t):
        return base64.b64decode(v)
    if pa.types.is_floating(t):
        return _NONFINITE[v] if isinstance(v, str) else v
    if is_listlike(t):
        return [from_json(x, t.value_type) for x in v]
    if pa.types.is_map(t):
        return [(from_json(k, t.key_type), from_json(x, t.item_type)) for k, x in v]
    if pa.types.is_struct(t):
        return {t.field(i).name: from_json(v.get(t.field(i).name), t.field(i).type)
                for i in range(t.num_fields)}
    return v

def write_ipc(table: pa.Table, f: BinaryIO) -> None:
    with pa.ipc.new_file(f, table.schema) as writer:
        writer.write_table(table, max_chunksize=64 * 1024)
