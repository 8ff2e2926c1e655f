"""Shared encodings of the staging sinks (Kafka, Postgres): Arrow values as
JSON (binary as base64, non-finite floats as strings, maps as pairs) and
back, and Arrow IPC staging files."""

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
