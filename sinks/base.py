"""The persist sink contract: make one output durable, exactly once.

A sink keeps, durably and atomically with its data, a :class:`SinkState`:

* ``upper`` -- IntoTime upper: every update at a time ``< upper`` is durable.
  ``None`` is the empty frontier (the output is complete).
* ``progress`` -- the FromTime frontier (canonical JSON of an antichain): every
  source record at a position *not* contained in it has been written. It is
  finer than ``upper``: it lets a binding's data be written in several
  bounded jobs while the upper stays at that binding's time until all of it is
  durable.

The commit path, per output (driver side)::

    1. Stager.stage(batch_id, part, table)   executors: write data, not visible
    2. PersistSink.commit(staged, expected, new)   driver: data + new state, one
                                                     atomic step; fenced on expected
    3. (driver) resumption recomputed from every output's upper
    4. (driver) upstream acknowledged

Rules every implementation keeps:

* ``commit`` is atomic: after a crash either all of the staged data and the
  new state are visible, or none of it.
* ``commit`` is fenced: if the durable state is not ``expected`` it raises
  :class:`SinkFenced` and writes nothing (a zombie pipeline or a lost race).
* Uppers and progress only move forward (asserted by the driver).
* Staging is idempotent: staging the same ``(batch_id, part)`` again replaces
  the earlier attempt; staged data never becomes visible without a commit.
* Retried data is dropped, not rewritten: the data plane filters out records
  whose position is not in ``progress`` before staging.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from reclock.core.columns import (
    DIFF,
    ERROR,
    META_FIELDS,
    META_NAMES,
    RAW_VALUE,
)
from reclock.core.errors import DefiniteError, TransientError
from reclock.core.frontier import Antichain


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
    import json

    import pyarrow.compute as pc

    from reclock.sinks._encoding import py_rows

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


@dataclass(frozen=True)
class SinkContext:
    """What a sink's config needs besides itself to build the sink."""

    source: str
    output: str
    state_dir: Path  # the pipeline's state directory (staging, defaults)
    #: the pipeline's identity, minted once in the remap store: names the sink
    #: creates in shared systems (transactional ids) carry it
    identity: str

    @property
    def name(self) -> str:
        """The output's full name, ``<source>.<output>``."""
        return f"{self.source}.{self.output}"

    @property
    def owner(self) -> Owner:
        """The pipeline this output's commits belong to (:class:`Owner`)."""
        return Owner(self.identity, str(self.state_dir))


@dataclass(frozen=True)
class Owner:
    """The pipeline an output belongs to, recorded by every commit of it
    with the output's state (Delta: the commit info; Postgres: its row in
    ``reclock_uppers``; Kafka: its progress records) and compared whenever
    the state is read: ``pipeline`` is the pipeline's identity (minted once
    in its remap store), ``state`` where it keeps its state (for messages).
    An output whose state records no owner (written before owners were
    recorded) is adopted by the first pipeline that commits to it."""

    pipeline: str
    state: str | None = None

    def check(self, output: str, where: str, recorded: str | None,
              recorded_state: str | None) -> None:
        """Raise :class:`OutputOwned` when the output's state at ``where``
        was committed by another pipeline than this one (``recorded``: its
        identity; None: no owner recorded, which any pipeline adopts)."""
        if recorded is not None and recorded != self.pipeline:
            raise OutputOwned(output, where, Owner(recorded, recorded_state), self)


@dataclass(frozen=True)
class SinkState:
    """Durable progress of one output (see module docstring)."""

    upper: int | None = 0
    progress: str | None = None

    def less_equal(self, other: SinkState) -> bool:
        """Uppers only move forward."""
        if other.upper is None:
            return True
        return self.upper is not None and self.upper <= other.upper

    def held(self, kind: str) -> Antichain[Any] | None:
        """The FromTime frontier the output holds (``progress`` decoded for a
        source of time ``kind``); ``None`` when nothing was committed yet."""
        return None if self.progress is None else _decoded(kind, self.progress)


@functools.lru_cache(maxsize=256)
def _decoded(kind: str, progress: str) -> Antichain[Any]:
    """A progress decoded once (antichains never change): the driver asks for
    each output's several times a tick, and a Kafka progress of 2,048
    partitions takes milliseconds to decode."""
    return Antichain.decode_json(kind, progress)


class SinkFenced(TransientError):
    """The sink's durable state is not what the committer expected."""


class Superseded(SinkFenced):
    """Another writer took this output over for good: the target itself fenced
    this writer (Kafka fences a producer once a newer one initialises the same
    transactional id). The driver stops writing the output; the newer driver
    carries on."""


class SinkError(DefiniteError):
    """A sink cannot write (permissions, disk full, schema clash): nothing was
    committed, nothing already accepted is lost."""


class OutputOwned(SinkError):
    """The output's target holds the state of another pipeline's output:
    two pipelines must never write one output (see :class:`Owner`). Nothing
    was written."""

    def __init__(self, output: str, where: str, theirs: Owner, ours: Owner) -> None:
        self.theirs, self.ours = theirs, ours
        at = f" (state in {theirs.state})" if theirs.state else ""
        super().__init__(
            f"output {output!r} at {where} belongs to another pipeline: its commits there "
            f"carry pipeline id {theirs.pipeline!r}{at}, this pipeline is {ours.pipeline!r} "
            f"(state in {ours.state}); nothing was written",
            hint="two pipelines must not write one output: point this output at a target of "
                 "its own, or run it from the other pipeline's state (its state_dir and "
                 "remap_store); to take the target over, stop the other pipeline and remove "
                 "the target first")


class Stager(Protocol):
    """Executor side of a sink: picklable, no connection held between tasks."""

    def screen(self, table: pa.Table) -> pa.Table:
        """``table`` with the rows this sink cannot store turned into error rows
        (:func:`refuse_rows`). :meth:`stage` screens what it writes; keyed
        outputs screen their upsert intents in the task, before the driver's
        key state sees them, so that a refused value never becomes a key's
        current row."""
        ...

    def stage(self, batch_id: str, part: int, table: pa.Table) -> list[dict[str, Any]]:
        """Write ``table`` (rows of :func:`output_schema`) so that a later commit
        can make it visible; return JSON-able descriptors of what was staged:
        per file its ``path`` (relative to the staging root or table), ``size``
        (bytes; a commit checks the file still is), ``rows``, ``errors`` (error
        rows among them) and sink-specific fields (Delta: ``stats``). The
        sinks check them with :func:`reclock.sinks._fs.check_descriptor`."""
        ...


class PersistSink(Protocol):
    """Driver side of a sink."""

    name: str
    holds_state: bool
    """The output holds each key's current row (a state table), not the update
    log: its history cannot be audited row by row."""

    def ensure(self, user_schema: pa.Schema) -> None:
        """Create the output if absent; check an existing one is compatible."""
        ...

    def state(self) -> SinkState:
        """The durable state (``SinkState()`` for an output never written)."""
        ...

    def stager(self) -> Stager:
        ...

    def commit(
        self, staged: list[dict[str, Any]], expected: SinkState, new: SinkState
    ) -> None:
        """Make ``staged`` visible and move the state ``expected -> new`` atomically."""
        ...

    def read_updates(self, as_of: int | None = None) -> pa.Table:
        """The raw update log (all columns) with ``_into_time <= as_of``."""
        ...

    def vacuum_orphans(self, grace_seconds: float) -> list[str]:
        """Delete staged files that no commit references and that are older
        than ``grace_seconds`` (left by failed commits and discarded jobs);
        return their names. A commit whose staged file is gone fails cleanly."""
        ...

    def maintain(self, now_ms: int) -> dict[str, int]:
        """Optional upkeep of the output, called by the driver between ticks
        (none of the source's jobs in flight, no commit of it under way) on
        every tick with the driver clock's ``now_ms``: the sink decides itself
        whether anything is due (the Delta sink compacts small files and
        deletes the ones a compaction removed once they are past their
        retention). Upkeep changes neither the rows an output holds nor its
        :class:`SinkState`. Returns what it did as counts (``{}``: nothing);
        sinks with nothing to maintain return ``{}``."""
        ...

    def close(self) -> None:
        ...


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
