"""The persist sink contract: make one output durable, exactly once; and how
a sink declares itself (:class:`SinkPlugin`, its configuration block a
:class:`SinkConfigBase`).

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
from typing import Any, ClassVar, Protocol

import pyarrow as pa

from reclock.contracts.config import ConfigModel, Name
from reclock.core.errors import DefiniteError, TransientError
from reclock.core.frontier import Antichain


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
        (:func:`~reclock.contracts.rows.refuse_rows`). :meth:`stage` screens what it writes; keyed
        outputs screen their upsert intents in the task, before the driver's
        key state sees them, so that a refused value never becomes a key's
        current row."""
        ...

    def stage(self, batch_id: str, part: int, table: pa.Table) -> list[dict[str, Any]]:
        """Write ``table`` (rows of :func:`~reclock.contracts.rows.output_schema`)
        so that a later commit can make it visible; return JSON-able descriptors of what was staged:
        per file its ``path`` (relative to the staging root or table), ``size``
        (bytes; a commit checks the file still is), ``rows``, ``errors`` (error
        rows among them) and sink-specific fields (Delta: ``stats``). The
        built-in sinks check them with :func:`reclock.sinks._fs.check_descriptor`."""
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


class SinkConfigBase(ConfigModel):
    """Base of sink blocks: a sink's whole configuration, defined in the sink's
    own module, discriminated on its ``type`` literal (the plug-in's name and
    aliases: ``type: Literal["delta", "file"]``); :meth:`build` makes the
    :class:`PersistSink` from it."""

    #: What names the place the sink writes, for messages ("path", "table", "topic").
    TARGET: ClassVar[str] = "target"

    name: Name | None = None
    """The sink's name within its output, for an entry of ``sinks:`` (default:
    its ``type``; required where two sinks of one output share a type);
    ``reclock read``/``verify --sink`` and the status name it. Not given under
    ``sink:`` (an output's only sink)."""

    @classmethod
    def target_of(cls, raw: Mapping[str, Any]) -> tuple[str, ...] | None:
        """Where a raw (unvalidated) block of this kind writes, comparable
        across outputs (two outputs with equal targets would mix their rows);
        ``None`` when the target derives from the output's own name. Its last
        element is what messages show."""
        return None

    @classmethod
    def state_key_of(cls, raw: Mapping[str, Any]) -> tuple[str, ...] | None:
        """The key of a raw (unvalidated) block of this kind that keeps one
        row per key (a state table:
        :func:`~reclock.contracts.config.state_key_problem` says which outputs
        it may hold); ``None`` for a sink that keeps the update log."""
        return None

    @property
    def state_key(self) -> tuple[str, ...] | None:
        """:meth:`state_key_of` this block."""
        return type(self).state_key_of(self.model_dump())

    def resolved(self, default: Path, base: Path) -> SinkConfigBase:
        """This block as the loaded pipeline keeps it: ``default`` is where
        the output lives when the block does not say (``<state_dir>/outputs/
        <source>/<output>``), ``base`` the YAML file's directory, against
        which relative paths resolve. Unchanged unless the sink writes to a
        path."""
        return self

    def build(self, ctx: SinkContext) -> PersistSink:
        """The sink of the output ``ctx`` names."""
        raise NotImplementedError


@dataclass(frozen=True)
class SinkPlugin:
    """How a sink declares itself: the one value its module offers to the
    ``reclock.sinks`` entry point group (``delta = "pkg.mod:PLUGIN"``; the
    entry point's name is ``name``). ``name`` and ``aliases`` are the
    ``type`` values that select it, exactly the members of its ``config``'s
    ``type`` literal."""

    name: str
    config: type[SinkConfigBase]
    aliases: tuple[str, ...] = ()
