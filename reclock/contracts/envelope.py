"""The envelope contract, the row builders the envelopes share, and how an
envelope declares itself (:class:`EnvelopePlugin`).

An envelope says how an output's decoded records become updates
``(row, time, diff)``. It is the output's configuration model (``type`` and
its settings, e.g. a ``key``: an :class:`EnvelopeModel`) and its behaviour at
once:

* driver side, when the pipeline is built: :meth:`Envelope.resolve` checks
  that it fits the output and names the key columns of a *keyed* output (one
  whose rows are intents the driver settles against the key state,
  :class:`~reclock.runtime.upsert_state.UpsertState`: ``_diff`` 1 for a
  row, 0 for a tombstone);
* executor side, in every Spark task: :meth:`Envelope.rows` turns a batch of
  raw records into stored rows (or intents), bad records into error rows.

Adding an envelope: a module with an :class:`EnvelopeModel` that meets
:class:`Envelope`, its :class:`EnvelopePlugin` as the module's one
declaration, and an entry point naming it in the ``reclock.envelopes``
group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from reclock.contracts.config import ConfigModel
from reclock.contracts.decode import convert_isolating, decode_key_value, show
from reclock.core.columns import SRC_OFFSET, SRC_PART, SRC_SEQ, SRC_TS
from reclock.core.errors import DefiniteError
from reclock.core.schema_change import with_dropped

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




def fit_column(col: pa.Array | pa.ChunkedArray, t: pa.DataType, name: str
               ) -> tuple[pa.Array, dict[int, str]]:
    """``col`` as type ``t``, and the rows whose value ``t`` cannot hold
    (row -> reason; such values are nulled): upstream widened a column whose
    output type stays (``schema_change: freeze``), so that one value that
    does not fit is an error row, not a failed batch."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if col.type == t:
        return col, {}
    try:
        fixed, bad = convert_isolating(col, lambda a: a.cast(t))
    except (pa.ArrowException, ValueError) as exc:
        raise DefiniteError(f"column {name!r}: {col.type} cannot be stored as {t}: {exc}",
                            hint="an incompatible schema change: see the output's "
                                 "schema_change") from None
    return fixed, {i: (f"column {name!r}: value {show(col[i].as_py())} does not fit the "
                       f"output's {t} (the output keeps the column's type: schema_change)")
                   for i in bad}


def unpicked_values(table: pa.Table | pa.RecordBatch, picked: set[str],
                    skip: frozenset[str] = frozenset()) -> dict[str, int]:
    """Non-null values per column of ``table`` that the output does not
    take (not in ``picked``, nor reclock's own in ``skip``): what a frozen
    output drops, to be counted."""
    return {c: len(table) - table.column(c).null_count for c in table.column_names
            if c not in picked and c not in skip and not c.startswith("_src_")
            and len(table) - table.column(c).null_count}


def decoded_rows(plan: RowPlan, batch: pa.RecordBatch, into: npt.NDArray[np.int64],
                 tombstones: bool) -> tuple[pa.Table, int]:
    """Decoded key/value records, each an insertion (``_diff`` 1); with
    ``tombstones``, a null value is a tombstone (an intent with ``_diff`` 0)."""
    schema = plan.schema
    err_type = pa.string()
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
    picks = plan.picks()
    dropped = dict(res.dropped)
    for c, v in unpicked_values(res.table, {up for up, _ in picks}).items():
        dropped[c] = dropped.get(c, 0) + v
    err_idx = np.asarray(res.errors, dtype=np.int64)
    reasons = list(res.reasons)
    if len(ok_idx):
        cols = []
        refused: dict[int, str] = {}
        for up, f in picks:
            if up in decoded:
                col, bad = fit_column(res.table.column(up), f.type, f.name)
                for i, why in bad.items():
                    refused.setdefault(i, why)
            elif up in batch.schema.names:
                col = batch.column(up).take(pa.array(ok_idx))
            else:  # a column the output keeps that upstream no longer has
                col = pa.nulls(len(ok_idx), f.type)
            cols.append(col)
        if refused:
            # values the output's column cannot hold: those records are error rows
            keep = np.ones(len(ok_idx), dtype=bool)
            keep[list(refused)] = False
            mask = pa.array(keep)
            cols = [c.filter(mask) for c in cols]
            moved = sorted(refused)
            merged = sorted([*zip(err_idx.tolist(), reasons, strict=True),
                             *((int(ok_idx[i]), refused[i]) for i in moved)])
            err_idx = np.array([i for i, _ in merged], dtype=np.int64)
            reasons = [r for _, r in merged]
            ok_idx = ok_idx[keep]
    if len(ok_idx):
        k = len(ok_idx)
        meta = meta_columns(batch, into, ok_idx)
        if tombstones:
            # a null value is a tombstone: its intent carries diff 0
            tomb = np.asarray(value.is_null().to_numpy(zero_copy_only=False))[ok_idx]
            meta[1] = pa.array(np.where(tomb, 0, 1).astype(np.int64))
        parts.append(pa.Table.from_arrays(
            [*cols, *meta, pa.nulls(k, err_type), pa.nulls(k, pa.binary()),
             pa.nulls(k, pa.binary())], schema=schema))
    if len(err_idx):
        k = len(err_idx)
        take = pa.array(err_idx)
        handed = [batch.column(up).take(take).cast(f.type)
                  if up not in decoded and up in batch.schema.names else pa.nulls(k, f.type)
                  for up, f in plan.picks()]
        parts.append(pa.Table.from_arrays(
            [*handed, *meta_columns(batch, into, err_idx),
             pa.array(reasons, err_type), key.take(take).cast(pa.binary()),
             value.take(take).cast(pa.binary())], schema=schema))
    if not parts:
        return with_dropped(schema.empty_table(), dropped), 0
    table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
    return with_dropped(table, dropped), len(err_idx)


class EnvelopeModel(ConfigModel):
    """Base of envelope models (the output's ``envelope:`` block), which meet
    :class:`Envelope` too. An envelope with a ``key`` field names the
    output's upstream key with it."""

    #: Every record the envelope reads is an insertion that no later record
    #: retracts (``none``): an output of raw records read with it keeps no
    #: key, so no state table can hold it.
    APPEND_ONLY: ClassVar[bool] = False
    #: Its rows hold the columns a source hands over besides key and value
    #: (Kafka's headers), after the decoded ones. False: the envelope builds
    #: its rows from the value alone (debezium's images), and an output that
    #: would carry such columns is refused.
    TAKES_EXTRA: ClassVar[bool] = True

    @classmethod
    def key_of(cls, raw: Mapping[str, Any]) -> tuple[str, ...] | None:
        """The upstream key a raw (unvalidated) block of this envelope names
        (``None``: it names none, or the block is not valid, which its own
        validation reports)."""
        if "key" not in cls.model_fields:
            return None
        key = raw.get("key")
        if not isinstance(key, Sequence) or isinstance(key, str) or not key:
            return None
        return tuple(str(k) for k in key)


@dataclass(frozen=True)
class EnvelopePlugin:
    """How an envelope declares itself: the one value its module offers to the
    ``reclock.envelopes`` entry point group (``upsert = "pkg.mod:PLUGIN"``;
    the entry point's name is ``name``). ``config`` is its model, whose
    ``type`` literal is ``name``."""

    name: str
    config: type[EnvelopeModel]
