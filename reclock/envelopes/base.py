"""The envelope contract, and the row builders the envelopes share.

An envelope says how an output's decoded records become updates
``(row, time, diff)``. It is the output's configuration model (``type`` and
its settings, e.g. a ``key``) and its behaviour at once:

* driver side, when the pipeline is built: :meth:`Envelope.resolve` checks
  that it fits the output and names the key columns of a *keyed* output (one
  whose rows are intents the driver settles against the key state,
  :class:`~reclock.envelopes.upsert.UpsertState`);
* executor side, in every Spark task: :meth:`Envelope.rows` turns a batch of
  raw records into stored rows (or intents), bad records into error rows.

Adding an envelope: a module here with a model on
:class:`~reclock.config.base._Model` that meets :class:`Envelope`, one entry
in :data:`reclock.envelopes.ENVELOPES`, and one member of the schema's
``EnvelopeConfig``.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from reclock.core.columns import SRC_OFFSET, SRC_PART, SRC_SEQ, SRC_TS
from reclock.core.errors import DefiniteError

POS_COLUMNS = [SRC_PART, SRC_OFFSET, SRC_SEQ, SRC_TS]


class RowPlan(Protocol):
    """What an envelope reads of an output's plan (the data plane's
    ``OutputPlan``): its columns, its decoders and its key."""

    @property
    def name(self) -> str: ...

    @property
    def user_schema(self) -> pa.Schema: ...

    @property
    def key_decoder(self) -> Any | None: ...

    @property
    def value_decoder(self) -> Any | None: ...

    @property
    def schema(self) -> pa.Schema:
        """The stored schema: user columns, then reclock's."""
        ...

    @property
    def keyed(self) -> bool:
        """Whether rows are intents the driver settles by key."""
        ...

    @property
    def upstream_key(self) -> tuple[str, ...]:
        """The key columns by their upstream names."""
        ...

    def picks(self) -> list[tuple[str, pa.Field]]:
        """(upstream name, output field) of each user column."""
        ...


class Envelope(Protocol):
    """What every envelope model offers (see the module docstring)."""

    @property
    def type(self) -> str:
        """Its name in the configuration (``type:``)."""
        ...

    @property
    def allow_null(self) -> bool:
        """Whether a null value is a record (a tombstone), not an error."""
        ...

    def resolve(self, what: str, columns: list[str], key_columns: list[str] | None
                ) -> tuple[str, ...] | None:
        """Check the envelope fits an output whose user columns are
        ``columns`` (upstream names); ``key_columns``: those decoded from the
        record key, ``None`` for typed rows. Returns the key of a keyed
        output, ``None`` otherwise; a :class:`DefiniteError` naming ``what``
        when it does not fit."""
        ...

    def rows(self, plan: RowPlan, batch: pa.RecordBatch, into: npt.NDArray[np.int64]
             ) -> tuple[pa.Table, int]:
        """Raw records -> stored rows (or intents of a keyed output), and how
        many of them are error rows."""
        ...


def null_columns(schema: pa.Schema, n: int) -> list[pa.Array]:
    return [pa.nulls(n, f.type) for f in schema]


def meta_columns(
    pos: pa.RecordBatch, into: npt.NDArray[np.int64], idx: npt.NDArray[np.int64] | None
) -> list[pa.Array]:
    cols = [pos.column(c) for c in POS_COLUMNS]
    t = into
    if idx is not None:
        cols = [c.take(pa.array(idx)) for c in cols]
        t = into[idx]
    n = len(t)
    return [pa.array(t, pa.int64()), pa.array(np.ones(n, dtype=np.int64)), *cols]




def decoded_rows(plan: RowPlan, batch: pa.RecordBatch, into: npt.NDArray[np.int64],
                 tombstones: bool) -> tuple[pa.Table, int]:
    """Decoded key/value records, each an insertion (``_diff`` 1); with
    ``tombstones``, a null value is a tombstone (an intent with ``_diff`` 0)."""
    schema = plan.schema
    err_type = pa.string()
    from reclock.formats import decode_key_value

    key = batch.column("key")
    value = batch.column("value")
    if plan.value_decoder is None:
        raise DefiniteError(f"output {plan.name!r}: raw records need a value format")
    res = decode_key_value(plan.key_decoder, plan.value_decoder, key, value)
    ok_idx = np.asarray(res.ok, dtype=np.int64)
    parts = []
    # a column the source hands over as it is (Kafka's headers, a multi-topic
    # source's _topic and _partition) is not decoded: error rows keep it too
    decoded = set(res.table.column_names)
    if len(ok_idx):
        cols = [res.table.column(up).cast(f.type) if up in decoded
                else batch.column(up).take(pa.array(ok_idx)) for up, f in plan.picks()]
        k = len(ok_idx)
        meta = meta_columns(batch, into, ok_idx)
        if tombstones:
            # a null value is a tombstone: its intent carries diff 0
            tomb = np.asarray(value.is_null().to_numpy(zero_copy_only=False))[ok_idx]
            meta[1] = pa.array(np.where(tomb, 0, 1).astype(np.int64))
        parts.append(pa.Table.from_arrays(
            [*cols, *meta, pa.nulls(k, err_type), pa.nulls(k, pa.binary()),
             pa.nulls(k, pa.binary())], schema=schema))
    err_idx = np.asarray(res.errors, dtype=np.int64)
    if len(err_idx):
        k = len(err_idx)
        take = pa.array(err_idx)
        handed = [batch.column(up).take(take).cast(f.type)
                  if up not in decoded and up in batch.schema.names else pa.nulls(k, f.type)
                  for up, f in plan.picks()]
        parts.append(pa.Table.from_arrays(
            [*handed, *meta_columns(batch, into, err_idx),
             pa.array(list(res.reasons), err_type), key.take(take).cast(pa.binary()),
             value.take(take).cast(pa.binary())], schema=schema))
    if not parts:
        return schema.empty_table(), 0
    table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
    return table, len(err_idx)


