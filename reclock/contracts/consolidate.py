"""Consolidation: an output's update log, read back as the collection it means.

A persist sink stores updates ``(row, _into_time, _diff)``. The collection as
of IntoTime ``t`` is the multiset::

    { row : count }   count = sum of _diff over updates of row with _into_time <= t

with rows whose count is 0 left out (an insert and its retraction cancel).
Error rows (``_error`` not null) are a separate collection (:func:`errors`).

Equality of rows is value equality per column, as in SQL ``GROUP BY``: nulls
equal each other, NaN equals NaN, and ``-0.0`` equals ``0.0`` (it is stored
as ``0.0`` in the result). Columns Arrow cannot group natively (lists,
structs, maps) are grouped by a canonical JSON encoding of the row instead.
Results are sorted by the user columns (or by that encoding when Arrow cannot
sort them), so the same updates always give the same table.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import math
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from reclock.core.columns import DIFF, ERROR, INTO_TIME, SRC_OFFSET, SRC_PART, SRC_SEQ

COUNT = "_count"

# Internal column names: user columns are renamed to _c<i> while grouping, so
# no user column name can collide with them.
_DIFF = "_d"
_KEY = "_k"
_IDX = "_i"


def consolidate(updates: pa.Table, as_of: int | None, user_columns: list[str]) -> pa.Table:
    """The non-error collection as of ``as_of`` (everything if ``None``):
    ``user_columns`` plus ``_count`` (int64, never 0), sorted."""
    missing = [c for c in user_columns if c not in updates.column_names]
    if missing:
        raise ValueError(f"updates have no columns {missing} (have {updates.column_names})")
    data = _as_of(updates, as_of)
    if ERROR in data.column_names:
        data = data.filter(pc.is_null(data.column(ERROR)))
    names = [f"_c{i}" for i in range(len(user_columns))]
    work = pa.table(
        [normalize_floats(data.column(c)) for c in user_columns] + [data.column(DIFF)],
        names=[*names, _DIFF],
    )
    try:
        grouped = work.group_by(names).aggregate([(_DIFF, "sum")])
        counts = grouped.column(f"{_DIFF}_sum")
        result = grouped.select(names).append_column(COUNT, counts)
        keys: list[str] | None = None
    except (pa.ArrowNotImplementedError, pa.ArrowTypeError):
        # Arrow cannot hash these key types: group by one canonical string.
        keys = row_keys(work, names)
        keyed = pa.table(
            {_KEY: keys, _IDX: pa.array(range(work.num_rows), pa.int64()), _DIFF: work[_DIFF]}
        )
        grouped = keyed.group_by([_KEY]).aggregate([(_DIFF, "sum"), (_IDX, "min")])
        first = grouped.column(f"{_IDX}_min")
        result = work.select(names).take(first).append_column(COUNT, grouped[f"{_DIFF}_sum"])
        keys = grouped.column(_KEY).to_pylist()
    result = result.cast(result.schema.set(len(names), pa.field(COUNT, pa.int64())))
    nonzero = pc.not_equal(result.column(COUNT), 0)
    if keys is not None:
        keys = [k for k, keep in zip(keys, nonzero.to_pylist(), strict=True) if keep]
    result = result.filter(nonzero)
    result = _sorted(result, names, keys)
    return result.rename_columns([*user_columns, COUNT])


def errors(updates: pa.Table, as_of: int | None) -> pa.Table:
    """The error rows (``_error`` not null) as of ``as_of``, all columns,
    ordered by IntoTime and source position."""
    data = _as_of(updates, as_of)
    if ERROR not in data.column_names:
        return data.slice(0, 0)
    data = data.filter(pc.is_valid(data.column(ERROR)))
    position = (INTO_TIME, SRC_PART, SRC_OFFSET, SRC_SEQ)
    order = [c for c in position if c in data.column_names]
    return data.sort_by([(c, "ascending") for c in order]) if order else data


def _as_of(updates: pa.Table, as_of: int | None) -> pa.Table:
    if as_of is None:
        return updates
    return updates.filter(pc.less_equal(updates.column(INTO_TIME), as_of))


def normalize_floats(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """``-0.0 -> 0.0`` in float columns: equal values must hash equal."""
    if pa.types.is_float32(col.type) or pa.types.is_float64(col.type):
        zero = pa.scalar(0.0, col.type)
        return pc.if_else(pc.equal(col, zero), zero, col)
    return col


def row_keys(table: pa.Table, names: list[str]) -> list[str]:
    """One canonical JSON text per row of ``table``'s columns ``names``: equal
    for rows whose values are equal as :func:`consolidate` groups them (NaN
    equals NaN, ``-0.0`` equals ``0.0``), different otherwise; for columns
    Arrow cannot group, and for comparing rows across tables."""
    columns = [table.column(n).to_pylist() for n in names]
    return [
        json.dumps([_canon(v) for v in row], sort_keys=True, separators=(",", ":"))
        for row in zip(*columns, strict=True)
    ] if columns else [""] * table.num_rows


def _canon(v: Any) -> Any:
    """A JSON-able value that is equal for equal values and differs otherwise."""
    if isinstance(v, float):
        if math.isnan(v):
            return {"nan": True}
        return 0.0 if v == 0 else v
    if isinstance(v, bytes):
        return {"b64": base64.b64encode(v).decode("ascii")}
    if isinstance(v, dict):
        return {str(k): _canon(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_canon(x) for x in v]
    if isinstance(v, dt.datetime | dt.date | dt.time):
        return {"t": v.isoformat()}
    if isinstance(v, dt.timedelta | decimal.Decimal):
        return {"s": str(v)}
    return v


def _sorted(table: pa.Table, names: list[str], keys: list[str] | None) -> pa.Table:
    if not names or table.num_rows <= 1:
        return table
    if keys is None:
        try:
            return table.sort_by([(n, "ascending") for n in names])
        except (pa.ArrowNotImplementedError, pa.ArrowTypeError):
            keys = row_keys(table, names)
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return table.take(pa.array(order, pa.int64()))
