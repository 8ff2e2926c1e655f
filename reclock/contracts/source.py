"""The source contract: what a connector provides to the driver and the data plane,
and how it declares itself (:class:`SourcePlugin`, its configuration block a
:class:`ConnectorConfig`).

A source has two halves::

    driver (control plane)                        executors (data plane)
    ----------------------                        ----------------------
    Source.open(resume, bound)   once at start
    Source.probe()        -> upstream frontier   (minting)
    Source.plan(lo, hi)   -> [ReadTask]  ------>  SourceReader.read(task)
    Source.acknowledge(f)   after durability       -> (output, RecordBatch)*

* ``probe`` returns the *upstream* frontier (Kafka high watermarks, Postgres
  flush LSN, the generator's counter). It must not block for long and never
  goes backwards for a healthy upstream; a transient fault raises
  :class:`~reclock.core.errors.TransientError` (the driver stalls and retries), a
  definite one :class:`~reclock.core.errors.DefiniteError`.
* ``plan(lower, upper, max_task, max_job)`` splits the FromTime interval
  ``[lower, upper)`` into picklable read tasks of at most ``max_task`` records
  each (one Kafka partition range per task), stopping at ``max_job`` records
  in all; it returns the tasks and the frontier they reach. Half-open, always.
* ``SourceReader.read(task)`` runs in a Spark task. It must be deterministic:
  the same task yields the same records on every retry, on any executor. It
  keeps no state that is not derived from the task.
* ``acknowledge(frontier)`` is called only with the resumption frontier (data
  before it is durable in every output); it is the only thing that may release
  upstream resources (Kafka offsets committed, Postgres ``confirmed_flush_lsn``).
* The initial frontier (the configured start position) is fixed when the
  source is constructed, not patched afterwards.

Record batches carry the position columns below plus, per output, either raw
``key``/``value`` bytes (decoded later by the output's format) or typed
columns (``typed=True`` outputs, e.g. generator tables and Postgres rows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol

import pyarrow as pa

from reclock.contracts.config import ConfigModel
from reclock.core.columns import POSITION_FIELDS
from reclock.core.errors import DefiniteError
from reclock.core.frontier import Antichain
from reclock.core.time import T

#: The raw (undecoded) record schema: positions + key/value bytes.
RAW_SCHEMA = pa.schema([*POSITION_FIELDS, pa.field("key", pa.binary()),
                        pa.field("value", pa.binary())])


@dataclass(frozen=True)
class OutputSpec:
    """One output of a source, as the source declares it.

    ``typed`` outputs carry ready columns described by ``schema`` (without the
    position columns); others carry raw ``key``/``value`` bytes.
    """

    name: str
    typed: bool = False
    schema: pa.Schema | None = None
    key: tuple[str, ...] = ()
    #: typed outputs: the envelope the source's rows need (``upsert`` keyed
    #: by ``key``: ``_diff`` 1 = value, 0 = tombstone), None = the configured one
    envelope: str | None = None
    #: raw outputs: columns each record carries besides key and value, handed
    #: to the output as they are, after the decoded ones (Kafka's headers)
    extra: pa.Schema | None = None
    #: typed outputs: shape changes the source resolved itself and that
    #: ``schema`` does not show (a column renamed upstream read under the
    #: output's name, a dropped column kept); a ``schema_change: fail``
    #: output refuses them (reclock.core.schema_change.Change)
    changes: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Facts:
    """Durable key/values of the source's remap shard
    (:meth:`reclock.contracts.remap_store.RemapStore.facts`): what the source's bindings
    depend on besides themselves, such as the identity of the upstream
    objects they name (a Kafka topic's id). ``read() -> {key: JSON text}``;
    ``write({key: text or None})`` sets or removes keys, durably, in one
    transaction. A source writes an identity before any binding relies on it."""

    read: Callable[[], dict[str, str]]
    write: Callable[[Mapping[str, str | None]], None]


@dataclass(frozen=True)
class SourceContext:
    """What a connector's config needs besides itself to build its source
    (:meth:`ConnectorConfig.build`)."""

    clock: Any  # reclock.core.clock.Clock: milliseconds, injectable in tests
    #: the pipeline's identity, minted once in the remap store: names of what
    #: the source creates upstream (slots, publications, consumer groups)
    #: carry it, so two pipelines never share them
    identity: str
    #: the configured outputs' names, in order
    output_names: tuple[str, ...] = ()
    #: the pipeline's state directory (a oneshot source keeps its requests
    #: and ledger of loads there); None where there is none
    state_dir: Any = None
    #: ``coordinates(names) -> {name: id}``: durable dense ids for the
    #: coordinates of a partitioned FromTime, assigned once in the remap
    #: store (:meth:`reclock.contracts.remap_store.RemapStore.coordinates`): a multi-topic
    #: Kafka source numbers its (topic, partition) pairs with them. None
    #: where no store is at hand.
    coordinates: Any = None
    #: the source's durable facts (:class:`Facts`); None where no store is at
    #: hand (upstream identities, a CDC table's column history, are then kept
    #: in memory only)
    facts: Facts | None = None
    #: each output's ``schema_change`` policy, by output name
    schema_change: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ReadTask:
    """A picklable unit of reading: ``[lower, upper)`` of one source, in the
    source's own encoding (``spec``), with an estimated record count.

    ``snapshot``: the task reads a chunk of output ``snapshot``'s initial
    snapshot (a Postgres table's existing rows); its records count as that
    snapshot's rows read (:mod:`reclock.runtime.snapshot_progress`). Every
    chunk of one output's snapshot is planned into one job: the output holds
    its snapshot once that job commits."""

    source: str
    index: int
    spec: Any
    records: int
    snapshot: int | None = None


@dataclass(frozen=True)
class SnapshotSize:
    """How many rows an output's initial snapshot holds, as far as its source
    knows: ``rows`` None while unknown; ``exact`` False while it is an
    estimate (e.g. from the catalog's statistics). ``table`` names what is
    read (``schema.table``)."""

    rows: int | None
    exact: bool
    table: str = ""


class SourceReader(Protocol):
    """Executor side: picklable, stateless between tasks."""

    def read(self, task: ReadTask) -> Iterator[tuple[int, pa.RecordBatch]]:
        """Yield ``(output_index, batch)`` for every record in the task's range."""
        ...


class Source(Protocol, Generic[T]):
    """Driver side of a connector."""

    name: str
    kind: str  # FromTime kind: "counter", "kafka", "lsn", "gtid" (reclock.core.time.TIME_KINDS)

    # -- capabilities (defaults in :class:`SourceBase`) --
    @property
    def replayable(self) -> bool:
        """Whether what was ingested can be read again (``reclock verify``
        re-reads it): a Kafka topic within retention, a generator; not a
        replication slot, which releases what was acknowledged. (A property
        here: a source may decide it when asked.)"""
        ...

    plan_again: bool
    """Whether :meth:`plan` may be called again for the same range with a
    smaller ``max_task`` (it changes nothing but caches): the driver then
    spreads a job that would leave cores idle over every core (a burst that
    fits one task). False where planning takes something (a stream's
    buffered changes, a snapshot's chunks)."""
    jobs_in_flight: int | None
    """At most that many of the source's jobs read at once (a Postgres slot
    serves one reader at a time); ``None``: the pipeline's setting."""

    def current_outputs(self) -> list[OutputSpec]:
        """The outputs as they are upstream now (a Postgres table's columns
        may have changed since :meth:`outputs`); called when the driver
        (re)opens the source."""
        ...

    def drop(self) -> str | None:
        """After ``reclock drop``: release what the source holds upstream when
        configured to (a Postgres replication slot); returns what was
        released (None: nothing). Called by the driver and the CLI."""
        ...

    def outputs(self) -> list[OutputSpec]:
        """The outputs this source feeds; index 0 is the main one."""
        ...

    def initial_frontier(self) -> Antichain[T]:
        """The configured start position (bound at ``as_of`` by the first binding)."""
        ...

    def open(self, resume: Antichain[T], bound: Antichain[T],
             held: Sequence[Antichain[T] | None] = (),
             resnapshot: Sequence[int] = ()) -> None:
        """Called before the first probe (and again after a re-open) with the
        resumption frontier, the last bound frontier, and per output the
        FromTime frontier it holds (``None``: nothing committed yet), all read
        back from durable state. ``resnapshot``: outputs to read from scratch
        although they hold data (``reclock resnapshot``; only when
        :attr:`can_resnapshot`), as for an output that holds nothing."""
        ...

    first_task_records: int | None
    """Records per task until the source's tasks have reported how large
    its records are (``None``: as many as the settings allow): a source whose
    records may each be megabytes (Kafka) starts small."""
    can_resnapshot: bool
    """Whether an output that holds data can be read again (``reclock
    resnapshot``): a :attr:`replayable` source replays its retained records
    (:mod:`reclock.runtime.replay`), another one takes a new snapshot at
    :meth:`open`."""

    def retained(self) -> Antichain[T]:
        """The earliest frontier the source can still read (a replayable
        source's retention): a replay reads from its join with the initial
        frontier."""
        ...

    def snapshot_position(self, output: int) -> tuple[int, int] | None:
        """Where the rows of ``output``'s snapshot being taken are stamped:
        ``(_src_part, _src_offset)`` of a position that reclocks to the
        snapshot's IntoTime (a Postgres snapshot at ``s``: ``(0, s - 1)``);
        ``None`` when no snapshot of it is being taken."""
        ...

    def probe(self) -> Antichain[T]:
        """The upstream frontier now."""
        ...

    def plan(
        self, lower: Antichain[T], upper: Antichain[T], max_task: int, max_job: int
    ) -> tuple[list[ReadTask], Antichain[T]]:
        """Read tasks covering ``[lower, reached)`` for some ``reached <= upper``:
        each task at most ``max_task`` records, all of them at most ``max_job``
        (a bounded job when far behind). ``reached == upper`` when everything
        fits; the driver continues from ``reached`` in the next job."""
        ...

    def reader(self) -> SourceReader:
        """The picklable executor-side reader."""
        ...

    def confirm(self, tasks: Sequence[ReadTask]) -> None:
        """Called once a job's ``tasks`` (planned by :meth:`plan`) have all
        read, before anything they read is committed: raise when what they
        read may not be what the bindings name, because an upstream object
        was replaced under the same name since the probe that bound it (a
        Kafka topic deleted and re-created). Nothing of the job is then
        committed, and it is planned again after the next probe."""
        ...

    def snapshot_sizes(self) -> dict[int, SnapshotSize]:
        """Per output whose initial snapshot the source is taking (from the
        open that decided to take it until it is durable everywhere): the
        rows it holds. Called from the status thread, concurrently with the
        source's own loop: must not block on upstream (report what is known)."""
        ...

    def accept_replaced(self, name: str, bound: Antichain[T] | None = None) -> str:
        """After an upstream object this source reads was replaced under the
        same name (a Kafka topic deleted and re-created), which stalls it
        with an :class:`~reclock.core.errors.IdentityChanged` error: accept
        the object as it is now, durably, so that the next open reads it as a
        new part of the source (``reclock accept-recreated``). ``bound``: the
        last frontier the source's bindings name (None: none yet). Returns
        what was accepted, for the user; a definite error where nothing was
        replaced or the source cannot accept it."""
        ...

    def unreadable(self, parts: Sequence[int]) -> dict[int, str]:
        """Of the partition ids ``parts``, those whose records cannot be read
        again however long retention would keep them, each with why: a Kafka
        topic's earlier incarnation (deleted and re-created), a listed topic
        re-created and not accepted, a topic deleted. ``reclock verify``
        reports the rows it holds of them as not checked rather than as
        breaches, and does not plan reading them. Asked after
        :meth:`retained` (which reads the upstream's metadata)."""
        ...

    def shape_seen(self, output: int, shape: object) -> None:
        """A task of this source raised
        :class:`~reclock.core.errors.ShapeSeen` for ``output``: a record was
        written under an upstream shape (``shape``, in the source's own
        form) that the output's description lacks. Called by the driver
        before it re-opens the source: the next describe takes it in."""
        ...

    def output_errors(self) -> dict[int, DefiniteError]:
        """Outputs whose upstream is gone for good while the others go on (a
        deleted topic of a several-topic Kafka source): output index -> the
        definite error its health shows. The output holds what was read and
        keeps advancing (nothing more can come); ``status`` and ``/readyz``
        report it. Asked once per tick, after the probe."""
        ...

    def acknowledge(self, frontier: Antichain[T]) -> bool | None:
        """Release upstream resources before ``frontier`` (durable everywhere).
        ``False``: it could not be done just now (e.g. a replication slot in
        use by a running task); the driver asks again."""
        ...

    def close(self) -> None:
        """Release connections; must not raise on an already-closed source."""
        ...


class SourceBase:
    """The capabilities' defaults, for connectors to inherit: not replayable,
    the pipeline's jobs in flight, outputs as declared, nothing to release,
    no snapshot (and none again)."""

    replayable: bool = False
    plan_again: bool = False
    jobs_in_flight: int | None = None
    can_resnapshot: bool = False
    first_task_records: int | None = None

    def snapshot_position(self, output: int) -> tuple[int, int] | None:
        return None

    def retained(self) -> Antichain[Any]:
        return self.initial_frontier()  # type: ignore[attr-defined,no-any-return]

    def outputs(self) -> list[OutputSpec]:
        raise NotImplementedError

    def current_outputs(self) -> list[OutputSpec]:
        return self.outputs()

    def drop(self) -> str | None:
        return None

    def snapshot_sizes(self) -> dict[int, SnapshotSize]:
        return {}

    def output_errors(self) -> dict[int, DefiniteError]:
        return {}

    def shape_seen(self, output: int, shape: object) -> None:
        return None  # (no source but one that raises ShapeSeen is handed one)

    def confirm(self, tasks: Sequence[ReadTask]) -> None:
        return None

    def unreadable(self, parts: Sequence[int]) -> dict[int, str]:
        return {}

    def accept_replaced(self, name: str, bound: Antichain[Any] | None = None) -> str:
        raise DefiniteError(f"source {getattr(self, 'name', '?')!r} keeps no identity of "
                            f"{name!r}: there is nothing to accept",
                            hint="only a Kafka source's re-created topics can be accepted")


def take_position_columns(batch: pa.RecordBatch) -> dict[str, pa.Array]:
    """The position columns of a batch, by name."""
    return {f.name: batch.column(f.name) for f in POSITION_FIELDS}


def frontier_lower_bound(frontier: Antichain[Any]) -> Any:
    """The single element of a totally ordered frontier (``None`` when empty)."""
    return frontier.as_option()


class ConnectorConfig(ConfigModel):
    """Base of connector blocks: a connector's whole configuration, defined in
    the connector's own module. Each registered connector is one optional
    block of a source, under its plug-in's name (exactly one is given), and
    :meth:`build` makes the source from it, so that every option is spelled
    once: in the model, and read by the connector itself."""

    #: The connector's outputs carry raw records (``key``/``value`` bytes),
    #: which each output's envelope turns into updates: the envelope alone
    #: says what key such an output keeps (a Kafka topic). False: the
    #: connector describes typed rows and their key itself (a CDC table).
    RAW_RECORDS: ClassVar[bool] = False

    @classmethod
    def output_problem(cls, data: Mapping[str, Any], outputs: Sequence[str]
                       ) -> tuple[str, str] | None:
        """What is wrong with the outputs named ``outputs`` (in the file's
        order) for a raw (unvalidated) block ``data`` of this connector, when
        the file alone decides it (a generator kind's fixed outputs, a Kafka
        source's one output): ``(problem, fix)``, checked when the
        configuration loads, before anything starts. ``None``: nothing wrong,
        or only the upstream can tell (a CDC source's tables: checked when
        the source describes its outputs)."""
        return None

    def build(self, name: str, ctx: SourceContext) -> Source[Any]:
        """The connector's :class:`Source` named ``name``; ``ctx`` holds the
        clock, the pipeline's identity and the configured outputs' names."""
        raise NotImplementedError


def listed_outputs_problem(what: str, entries: Sequence[Any], outputs: Sequence[str],
                          key: str = "table") -> tuple[str, str] | None:
    """:meth:`ConnectorConfig.output_problem` for a connector whose block
    lists what feeds each output (``entries``: raw mappings with ``key`` and
    an optional ``output``, e.g. a CDC source's tables; ``what``: their
    plural for messages): each feeds the output it names, by default its own
    name. ``None`` while an entry is malformed (its own error says so)."""
    import re

    from reclock.contracts.config import NAME_PATTERN

    want: list[str] = []
    for e in entries:
        name = e.get("output") or e.get(key) if isinstance(e, Mapping) else None
        if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
            return None
        want.append(name)
    missing = [o for o in want if o not in outputs]
    unknown = [o for o in outputs if o not in want]
    if not missing and not unknown:
        return None
    said = "; ".join(([f"no entry under outputs for {missing}"] if missing else [])
                     + ([f"none of them feeds {unknown}"] if unknown else []))
    return (f"its {what} feed the outputs {want}: {said}",
            f"give each of its {what} an entry under outputs (named after it, or as its "
            "output: says), and no other")


@dataclass(frozen=True)
class SourcePlugin:
    """How a connector declares itself: the one value its module offers to
    the ``reclock.sources`` entry point group (``kafka = "pkg.mod:PLUGIN"``;
    the entry point's name is ``name``). ``name`` is the key of the
    connector's block in a source (``kafka: {...}``), ``config`` the block's
    model. ``rank`` places it among the blocks a message lists (``missing
    connector block (expected one of: ...)``): lower first, then by name;
    reclock's own rank 1 to 5."""

    name: str
    config: type[ConnectorConfig]
    rank: int = 100
