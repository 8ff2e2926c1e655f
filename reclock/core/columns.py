"""The stored column layout, named once: the position columns every raw batch
carries (a record's FromTime coordinates) and the columns every output row
carries after the user's. Imports nothing of reclock: sources, sinks, the
data plane and the app all take the names from here."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from reclock.core.errors import DefiniteError

#: Position columns every raw batch carries (the record's FromTime coordinates).
SRC_PART = "_src_part"  # int32: Kafka partition, 0 otherwise
SRC_OFFSET = "_src_offset"  # int64: Kafka offset, Postgres commit LSN, counter
SRC_SEQ = "_src_seq"  # int32: position among records sharing part+offset
SRC_TS = "_src_ts"  # int64 ms: upstream timestamp (for freshness), may be null

#: Columns an output row carries besides the positions.
INTO_TIME = "_into_time"  # int64 ms: the IntoTime the record was reclocked to
DIFF = "_diff"  # int64: +1 insertion, -1 retraction
ERROR = "_error"  # string: why the record is an error row (null: a data row)
RAW_KEY = "_raw_key"  # binary: an error row's key bytes
RAW_VALUE = "_raw_value"  # binary: an error row's value bytes

#: Optional column of typed batches (CDC sources): the row's diff, -1/+1, or
#: for outputs with the upsert envelope 1 = value, 0 = tombstone and
#: ``TRUNCATED`` = every key removed (the other columns are null).
SRC_DIFF = DIFF
TRUNCATED = -2
#: The ``_src_part`` of what a re-snapshot retracts (``reclock resnapshot``):
#: apart from every snapshot chunk's part (-1 - chunk) and below them, so
#: that ordered by position the retraction comes before what replaces it.
RESNAPSHOT_PART = -(2**31)
#: Kafka corrections (``reclock resnapshot`` by replay, :mod:`reclock.runtime.replay`)
#: keep the position of the record they restate, with its partition ``p``
#: coded in ``_src_part``: ``-1 - p`` where a correction inserts the row of
#: record ``(p, o, s)``, ``RESNAPSHOT_PART + p`` where it retracts a row held
#: at ``(p, o, s)``. Ordered by position, every retraction comes before every
#: insertion, and both before the records of the same IntoTime (``p >= 0``).
#: (Snapshot sources give negative parts their own meaning: chunks.)
CORRECTION_SPLIT = -(2**30)
#: The time kinds of replayable sources, whose negative parts are corrections.
REPLAYED_KINDS = frozenset({"kafka", "counter"})


def correction_part(partition: int, retract: bool) -> int:
    """The ``_src_part`` of a Kafka correction of a row at ``partition``."""
    return RESNAPSHOT_PART + partition if retract else -1 - partition


def restated(parts: Any) -> tuple[Any, Any]:
    """Kafka ``_src_part`` values (numpy int64) -> (the partition of the
    record each row stands for, which rows are corrections)."""
    corr = parts < 0
    retract = parts < CORRECTION_SPLIT
    orig = np.where(retract, parts - RESNAPSHOT_PART, np.where(corr, -1 - parts, parts))
    return orig, corr
#: Optional column of typed upsert intents (list<int32>): positions of user
#: columns the change left as they were without sending them (Postgres'
#: unchanged TOASTed values); the key state fills them from the current row.
SRC_UNCHANGED = "_unchanged"

POSITION_FIELDS = [
    pa.field(SRC_PART, pa.int32(), nullable=False),
    pa.field(SRC_OFFSET, pa.int64(), nullable=False),
    pa.field(SRC_SEQ, pa.int32(), nullable=False),
    pa.field(SRC_TS, pa.int64()),
]

#: Columns every output row carries after the user's columns.
META_FIELDS = [
    pa.field(INTO_TIME, pa.int64(), nullable=False),
    pa.field(DIFF, pa.int64(), nullable=False),
    *POSITION_FIELDS,
    pa.field(ERROR, pa.string()),
    pa.field(RAW_KEY, pa.binary()),
    pa.field(RAW_VALUE, pa.binary()),
]
META_NAMES = [f.name for f in META_FIELDS]


def rename_columns(what: str, schema: pa.Schema, rename: dict[str, str],
             key: tuple[str, ...] | None
             ) -> tuple[pa.Schema, tuple[str, ...], tuple[str, ...] | None]:
    """An output's ``rename`` mapping applied: the output's user schema, each
    column's upstream name, and the key by output names."""
    unknown = sorted(set(rename) - set(schema.names))
    if unknown:
        raise DefiniteError(
            f"{what}: rename names fields {unknown} that the output does not have "
            f"(it has {schema.names})",
            hint="rename maps upstream field names, as decoded, to output column names")
    names = [rename.get(n, n) for n in schema.names]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DefiniteError(f"{what}: after rename, columns {twice} appear twice",
                            hint="give each renamed field a name no other column has")
    out = pa.schema([f.with_name(n) for f, n in zip(schema, names, strict=True)])
    return out, tuple(schema.names), (None if key is None
                                      else tuple(rename.get(k, k) for k in key))
