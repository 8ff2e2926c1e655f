"""The rows an output stores, as the runtime and every sink see them.

:func:`output_schema` is an output's stored schema (its user columns, then
reclock's own, :data:`~reclock.core.columns.META_FIELDS`); :func:`refuse_rows`
turns the rows a sink cannot store into error rows (bad input is data);
:func:`conform` fits a staged batch to the stored schema.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from reclock.contracts.encoding import py_rows
from reclock.contracts.sink import SinkError
from reclock.core.columns import DIFF, ERROR, META_FIELDS, META_NAMES, RAW_VALUE
from reclock.core.errors import DefiniteError


def output_schema(user: pa.Schema) -> pa.Schema:
    """The stored schema of an output: user columns (nullable, since error rows
    carry none), then :data:`META_FIELDS`."""
    meta = {n.lower() for n in META_NAMES}
    clash = [f.name for f in user if f.name.lower() in meta]
    if clash:
        raise DefiniteError(
            f"output columns {clash} clash with reclock's own columns (names are compared "
            "ignoring case: Delta, Postgres and most readers fold case)",
            hint="rename it on the way in, with the output's rename mapping "
                 f"(rename: {{{clash[0]}: upstream{clash[0]}}}), or upstream")
    seen: dict[str, str] = {}
    twins: list[str] = []
    for f in user:
        key = f.name.lower()
        if key in seen:
            twins.append(f"{seen[key]!r} and {f.name!r}")
        else:
            seen[key] = f.name
    if twins:
        raise DefiniteError(
            f"output columns {', '.join(twins)} differ only in case: Delta tables and "
            "case-insensitive readers (Spark SQL) cannot hold both",
            hint="rename one of them on the way in, with the output's rename mapping "
                 "(for example rename: {A: A_2}), or upstream")
    return pa.schema([f.with_nullable(True) for f in user] + META_FIELDS)


def check_output_names(what: str, user: pa.Schema) -> None:
    """Refuse up front (a definite error naming ``what``) user columns that an
    output cannot hold: twins by case, or reclock's own names."""
    try:
        output_schema(user)
    except DefiniteError as exc:
        raise DefiniteError(f"{what}: {exc}", hint=exc.hint) from None


#: Raw bytes kept on an error row that a sink refused, at most (a refused row
#: may be refused for its size).
REFUSED_RAW_MAX = 64 * 1024


def refuse_rows(table: pa.Table, mask: Any, reason: str | Mapping[int, str],
                raw_max: int = REFUSED_RAW_MAX) -> pa.Table:
    """``table`` (rows of an output schema) with the rows where ``mask`` holds
    turned into error rows: bad input is data, so a row the sink cannot store
    lands in the error collection with ``reason``, its position, and what it
    held (its columns as JSON in ``_raw_value``, cut at ``raw_max`` bytes)
    instead of failing the batch. Rows that are errors already stay.
    ``reason`` may give each refused row its own (by row index)."""
    m = pa.array(mask, pa.bool_()) if not isinstance(mask, pa.Array | pa.ChunkedArray) else mask
    m = pc.and_(pc.fill_null(m, False), pc.is_null(table.column(ERROR)))
    if not pc.any(m).as_py():
        return table
    user = [f.name for f in table.schema if f.name not in META_NAMES]
    flags = m.to_pylist()
    raw = table.column(RAW_VALUE).to_pylist()
    errors = table.column(ERROR).to_pylist()
    diffs = table.column(DIFF).to_pylist()
    hits = [i for i, hit in enumerate(flags) if hit]
    # only the refused rows become Python values (a refusal is a few rows of
    # a batch that may hold a million)
    rows = (py_rows(table.select(user).take(pa.array(hits, pa.int64()))) if user
            else [{} for _ in hits])
    for i, row in zip(hits, rows, strict=True):
        text = json.dumps(row, default=str, ensure_ascii=True).encode()
        raw[i] = text[:raw_max]
        why = reason if isinstance(reason, str) else reason[i]
        errors[i] = why if len(text) <= raw_max else (
            f"{why} (the row's {len(text):,} bytes of JSON are cut to {raw_max:,})")
        diffs[i] = 1
    cols = []
    for f in table.schema:
        if f.name in user:
            cols.append(pc.if_else(m, pa.nulls(len(table), f.type), table.column(f.name)))
        elif f.name == RAW_VALUE:
            cols.append(pa.array(raw, f.type))
        elif f.name == ERROR:
            cols.append(pa.array(errors, f.type))
        elif f.name == DIFF:
            cols.append(pa.array(diffs, f.type))
        else:
            cols.append(table.column(f.name))
    return pa.Table.from_arrays(cols, schema=table.schema)


def conform(output: str, table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with exactly ``schema``'s columns, in order and types.

    Stored columns the batch lacks are filled with nulls (an older writer, or
    a column added by schema evolution); columns the table does not have are
    an error, as are nulls in a NOT NULL column.
    """
    extra = [c for c in table.column_names if schema.get_field_index(c) < 0]
    if extra:
        raise SinkError(
            f"output {output!r}: staged columns {extra} are not in the output's schema",
            hint="call ensure() with the new schema before staging",
        )
    cols = []
    for field in schema:
        if field.name in table.column_names:
            col = table.column(field.name)
            if col.type != field.type:
                try:
                    col = col.cast(field.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
                    raise SinkError(
                        f"output {output!r}: column {field.name!r} of type {col.type} "
                        f"cannot be stored as {field.type}: {exc}"
                    ) from exc
        elif field.nullable:
            col = pa.chunked_array([pa.nulls(table.num_rows, field.type)])
        else:
            raise SinkError(f"output {output!r}: staged rows lack column {field.name!r}")
        if not field.nullable and col.null_count:
            raise SinkError(
                f"output {output!r}: column {field.name!r} is NOT NULL but has "
                f"{col.null_count} nulls"
            )
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=schema)
