"""What the Delta sink's two commit paths share (:mod:`reclock.sinks.delta`:
the update log; :mod:`reclock.sinks.delta_state`: state tables): the output's
transaction (its version is the upper, :data:`CLOSED` the empty frontier),
the commitInfo keys that carry its state, the table version a commit builds
on (:class:`_Head`), staged file names and descriptors, the types Delta
stores, the schema evolution a commit carries, and how data files are
written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable, Schema

from reclock.contracts.rows import output_schema
from reclock.contracts.sink import SinkState
from reclock.sinks._fs import check_descriptor

#: Transaction version standing for the empty frontier (a closed output).
CLOSED = 2**63 - 1
#: Attempts when unrelated commits race ours (ours unchanged each time).
COMMIT_ATTEMPTS = 8
KEY_UPPER = "reclock.upper"
KEY_PROGRESS = "reclock.progress"
KEY_OUTPUT = "reclock.output"
#: commitInfo keys naming the pipeline that committed (:class:`~reclock.contracts.sink.Owner`)
KEY_PIPELINE = "reclock.pipeline"
KEY_PIPELINE_STATE = "reclock.pipeline_state"
#: commitInfo key of maintenance commits: ``compact``, ``expire``, ``retention``.
KEY_MAINTENANCE = "reclock.maintenance"
RETENTION_PROPERTY = "delta.deletedFileRetentionDuration"
# Batch ids become part of file names: keep them to characters that need no
# escaping in a path or in the Delta log's URL-encoded paths.
_STAGED = re.compile(r"part-[A-Za-z0-9_.-]+-\d{5,}-\d{3}\.parquet")
# Part of the names of the files compactions write.
_COMPACTED = "-compact-"


@dataclass(frozen=True)
class _Head:
    """A version of the table and what a commit right after it needs."""

    version: int
    state: SinkState  # the output's state as of ``version``
    direct: bool  # the next log entry may be written by reclock itself


#: ``engineInfo`` of reclock's own log entries.
_ENGINE = "reclock"


def _write_parquet(table: pa.Table, f: BinaryIO) -> None:
    pq.write_table(table, f, use_dictionary=dictionary_columns(table))


#: Rows sampled per column to choose its encoding, and the share of distinct
#: values below which it is dictionary-encoded.
DICT_SAMPLE, DICT_DISTINCT = 2048, 0.5


def dictionary_columns(table: pa.Table) -> list[str]:
    """The columns worth a dictionary: few distinct values in an even sample.

    Parquet writers dictionary-encode every column by default and fall back to
    plain encoding once a column's dictionary page grows too large. For
    high-cardinality columns (ids, offsets, timestamps, free text) that costs
    the whole dictionary build for nothing: 2-3x the write time of the file
    here, with a larger file. Low-cardinality ones (the IntoTime, diffs,
    partitions, enum-like strings) keep it, and their dictionary's run-length
    encoding makes them nearly free."""
    n = table.num_rows
    step = max(1, n // DICT_SAMPLE)
    sample = table.take(pa.array(range(0, n, step))) if step > 1 else table
    m = sample.num_rows
    out = []
    for f in sample.schema:
        if pa.types.is_nested(f.type):
            continue
        col = sample.column(f.name)
        if m == 0 or pc.count_distinct(col, mode="all").as_py() <= DICT_DISTINCT * m:
            out.append(f.name)
    return out


def _interval(hours: int) -> str:
    """A Delta interval property value of ``hours`` hours."""
    return f"interval {hours} hours"


def _encode_txn(upper: int | None) -> int:
    if upper is None:
        return CLOSED
    if not 0 <= upper < CLOSED:
        raise ValueError(f"upper {upper} out of range [0, 2**63 - 1)")
    return upper


def _decode_txn(version: int) -> int | None:
    return None if version == CLOSED else version


def _check_descriptor(output: str, d: dict[str, Any]) -> dict[str, Any]:
    check_descriptor(output, "Delta", d, _STAGED, {"size": int, "stats": str})
    return d


def _delta_schema(user_schema: pa.Schema) -> Schema:
    """The Delta schema of an output of ``user_schema``: reclock's columns
    added, types as Delta stores them."""
    return Schema.from_arrow(output_schema(pa.schema(
        [f.with_type(storage_type(f.type)) for f in user_schema])))


def storage_type(t: pa.DataType) -> pa.DataType:
    """The type a column of Arrow type ``t`` is stored as: Delta has no time
    of day, duration or unsigned types. Times and durations are stored as
    int64 microseconds, unsigned integers as the next wider signed type
    (uint64 as decimal(20,0)), float16 as float32; lists element-wise.
    Timestamps are stored in microseconds (Delta's own unit: a nanosecond
    table needs a reader feature most readers lack)."""
    if pa.types.is_time(t) or pa.types.is_duration(t):
        return pa.int64()
    if pa.types.is_timestamp(t) and t.unit == "ns":
        return pa.timestamp("us", tz=t.tz)
    if pa.types.is_unsigned_integer(t):
        return {8: pa.int16(), 16: pa.int32(), 32: pa.int64()}.get(t.bit_width,
                                                                   pa.decimal128(20, 0))
    if pa.types.is_float16(t):
        return pa.float32()
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(storage_type(t.value_type))
    return t


def _micro(t: pa.DataType) -> pa.DataType:
    if pa.types.is_timestamp(t) and t.unit == "ns":
        return pa.timestamp("us", tz=t.tz)
    if pa.types.is_time(t):
        return pa.time64("us")
    if pa.types.is_duration(t):
        return pa.duration("us")
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(_micro(t.value_type))
    return t


def _in_microseconds(table: pa.Table) -> pa.Table:
    """Times and durations in microseconds, so that they store as int64 µs."""
    for i, f in enumerate(table.schema):
        m = _micro(f.type)
        if m != f.type:
            table = table.set_column(i, f.with_type(m), table.column(i).cast(m))
    return table


@dataclass(frozen=True)
class _Evolution:
    """What the next commit changes in the table's schema: ``schema`` is the
    whole new one; columns ``added``; columns ``widened`` (their files are
    rewritten in the new type by that commit)."""

    schema: Schema
    added: tuple[str, ...]
    widened: tuple[str, ...]


def _metadata_action(dt: DeltaTable, schema: Schema) -> dict[str, Any]:
    """The metaData action of ``dt`` with ``schema``."""
    meta = dt.metadata()
    return {"metaData": {
        "id": meta.id, "name": meta.name, "description": meta.description,
        "format": {"provider": "parquet", "options": {}},
        "schemaString": schema.to_json(),
        "partitionColumns": list(meta.partition_columns),
        "configuration": dict(meta.configuration or {}), "createdTime": meta.created_time}}
