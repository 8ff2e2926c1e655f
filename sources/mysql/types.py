"""MariaDB column types as Arrow types, and values (from a ``SELECT`` through
PyMySQL, or from a row event of the binary log) as Arrow arrays.

====================================  ==========================================
``information_schema.COLUMNS``        Arrow
====================================  ==========================================
tinyint .. bigint, year               int64
bigint unsigned                       decimal128(20, 0)
decimal(p, s)                         decimal128(p, s) (decimal256 past 38 digits)
float, double                         float64
char, varchar, text, enum, set, json  string (a set as ``a,b`` in its members' order)
binary, varbinary, blob, geometry     binary
bit(n)                                int64
date                                  date32 (a zero date is null)
datetime(fsp)                         timestamp[us]
timestamp(fsp)                        timestamp[us, UTC]
time(fsp)                             string ``[-]HHH:MM:SS[.ffffff]`` (the range
                                      passes a day: no Arrow time type holds it)
====================================  ==========================================

The two roads give the same Python values once :func:`normalize` has run
(the binary log sends a set as a Python set and a bit as ``"0101"``; a
``SELECT`` sends them as text and bytes), so that a snapshot row and a
streamed row of one table compare equal.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa

_INTS = {"tinyint", "smallint", "mediumint", "int", "integer", "bigint", "year"}
_TEXT = {"char", "varchar", "tinytext", "text", "mediumtext", "longtext", "json", "enum",
         "set", "uuid", "inet4", "inet6"}
_BINARY = {"binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob", "geometry",
           "point", "linestring", "polygon", "multipoint", "multilinestring", "multipolygon",
           "geometrycollection"}


@dataclass(frozen=True)
class MyColumn:
    """One column as ``information_schema.COLUMNS`` describes it."""

    name: str
    data_type: str  # DATA_TYPE, lower case
    column_type: str  # COLUMN_TYPE, e.g. "int(10) unsigned", "enum('a','b')"
    kind: str  # int | uint64 | decimal | float | string | set | binary | bit | date |
    #            datetime | timestamp | time
    arrow: pa.DataType
    members: tuple[str, ...] = ()  # a set's members, in their order
    #: dropped upstream: kept in the output (null from then on), read from
    #: the changes written before the drop (sources/mysql/source.py history)
    gone: bool = False

    @property
    def label(self) -> str:
        return self.column_type


def _members(column_type: str) -> tuple[str, ...]:
    inner = column_type[column_type.find("(") + 1: column_type.rfind(")")]
    return tuple(m.replace("''", "'") for m in re.findall(r"'((?:[^']|'')*)'", inner))


def describe_column(name: str, data_type: str, column_type: str, precision: int | None,
                    scale: int | None) -> MyColumn:
    """The Arrow type of a column; a type it does not know is read as text."""
    t = data_type.lower()
    ct = column_type.lower()
    if t in _INTS:
        if t == "bigint" and "unsigned" in ct:
            return MyColumn(name, t, ct, "uint64", pa.decimal128(20, 0))
        return MyColumn(name, t, ct, "int", pa.int64())
    if t in ("decimal", "numeric"):
        p, s = int(precision or 10), int(scale or 0)
        typ = pa.decimal128(p, s) if p <= 38 else pa.decimal256(p, s)
        return MyColumn(name, t, ct, "decimal", typ)
    if t in ("float", "double", "real"):
        return MyColumn(name, t, ct, "float", pa.float64())
    if t == "set":
        return MyColumn(name, t, ct, "set", pa.string(), _members(column_type))
    if t in _TEXT:
        return MyColumn(name, t, ct, "string", pa.string())
    if t in _BINARY:
        return MyColumn(name, t, ct, "binary", pa.binary())
    if t == "bit":
        return MyColumn(name, t, ct, "bit", pa.int64())
    if t == "date":
        return MyColumn(name, t, ct, "date", pa.date32())
    if t == "datetime":
        return MyColumn(name, t, ct, "datetime", pa.timestamp("us"))
    if t == "timestamp":
        return MyColumn(name, t, ct, "timestamp", pa.timestamp("us", tz="UTC"))
    if t == "time":
        return MyColumn(name, t, ct, "time", pa.string())
    return MyColumn(name, t, ct, "string", pa.string())


#: The column type families of a binary log's table map (FIELD_TYPE codes), by
#: what :func:`describe_column` makes of the column: a row event of another
#: family was written after the column changed type.
_FAMILY = {
    "int": {1, 2, 3, 8, 9, 13}, "uint64": {8}, "decimal": {0, 246}, "float": {4, 5},
    "string": {15, 253, 254, 252, 249, 250, 251, 247, 245},
    "set": {248, 254}, "binary": {15, 253, 254, 252, 249, 250, 251, 255},
    "bit": {16}, "date": {10, 14}, "datetime": {12, 18}, "timestamp": {7, 17},
    "time": {11, 19},
}


def event_fits(col: MyColumn, event_col: Any) -> bool:
    """Whether a table map column (python-mysql-replication's ``Column``) is
    read as ``col``'s Arrow type without loss: the same family, an integer
    not unsigned 64-bit where the output is int64, text where the output is
    text, a decimal that fits."""
    code = int(event_col.type)
    if code not in _FAMILY.get(col.kind, set()):
        return False
    binary_charset = (getattr(event_col, "character_set_name", None) or "") == "binary"
    if col.kind == "int":
        return not (code == 8 and bool(getattr(event_col, "unsigned", False)))
    if col.kind == "string" and code in (15, 253, 254, 252, 249, 250, 251):
        return not binary_charset
    if col.kind == "binary" and code != 255:
        return binary_charset
    if col.kind == "decimal" and code == 246:
        p, s = int(getattr(event_col, "precision", 0)), int(getattr(event_col, "decimals", 0))
        typ = col.arrow
        return bool(s <= typ.scale and p - s <= typ.precision - typ.scale)
    return True


def _time_text(v: dt.timedelta) -> str:
    us = v.days * 86_400_000_000 + v.seconds * 1_000_000 + v.microseconds
    sign = "-" if us < 0 else ""
    us = abs(us)
    secs, frac = divmod(us, 1_000_000)
    h, rest = divmod(secs, 3600)
    m, s = divmod(rest, 60)
    text = f"{sign}{h:02d}:{m:02d}:{s:02d}"
    return f"{text}.{frac:06d}" if frac else text


def normalize(col: MyColumn, v: Any) -> Any:
    """One value as the Python value its Arrow type takes (None: null)."""
    if v is None:
        return None
    k = col.kind
    if k == "int":
        return int(v)
    if k == "uint64":
        return Decimal(int(v))
    if k == "decimal":
        return v if isinstance(v, Decimal) else Decimal(str(v))
    if k == "float":
        # a FLOAT arrives from the binary log as its single-precision value,
        # from a SELECT as the shortest text of it: both as that value
        return float(np.float32(v)) if col.data_type == "float" else float(v)
    if k == "string":
        return v.decode("utf-8", "replace") if isinstance(v, bytes | bytearray) else str(v)
    if k == "set":
        if isinstance(v, set | frozenset):
            return ",".join(m for m in col.members if m in v)
        return v.decode() if isinstance(v, bytes) else str(v)
    if k == "binary":
        return bytes(v) if isinstance(v, bytes | bytearray) else str(v).encode()
    if k == "bit":
        if isinstance(v, bytes | bytearray):
            return int.from_bytes(v, "big")
        return int(v, 2) if isinstance(v, str) else int(v)
    if k == "date":
        return v if isinstance(v, dt.date) else None  # a zero date
    if k in ("datetime", "timestamp"):
        return v if isinstance(v, dt.datetime) else None
    if k == "time":
        return _time_text(v) if isinstance(v, dt.timedelta) else str(v)
    return v


def arrow_array(col: MyColumn, values: list[Any]) -> pa.Array:
    """Normalized values as an array of the column's type."""
    if col.kind in ("datetime", "timestamp"):
        # naive datetimes are UTC (the session reads timestamps in UTC, the
        # binary log sends them as UTC)
        return pa.array(values, pa.timestamp("us")).cast(col.arrow)
    return pa.array(values, col.arrow)
