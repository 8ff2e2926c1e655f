"""What the rooms of one source's runtime share.

A :class:`~reclock.runtime.driver.SourceRunner` keeps the numbered tick and
is composed of rooms, each a module of its own: job planning and execution
(:mod:`~reclock.runtime.jobs`), the commit path
(:mod:`~reclock.runtime.commit`), keyed state (:mod:`~reclock.runtime.keyed`),
re-snapshots (:mod:`~reclock.runtime.resnapshot`), the outputs' shapes
(:mod:`~reclock.runtime.shapes`), housekeeping
(:mod:`~reclock.runtime.housekeeping`) and status
(:mod:`~reclock.runtime.status`). They share one :class:`Site`: the source,
its outputs, the driver-wide services, and whether the source is open.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from reclock.contracts.envelope import Envelope
from reclock.contracts.remap_store import RemapStore
from reclock.contracts.sink import PersistSink, SinkState
from reclock.contracts.source import OutputSpec, Source
from reclock.core.clock import Clock
from reclock.core.frontier import Antichain
from reclock.core.schema_change import DEFAULT_POLICY, DroppedTally, Policy
from reclock.core.time import IntoTime
from reclock.registry import default_envelope
from reclock.runtime.health import Health
from reclock.runtime.lock import LockWatch
from reclock.runtime.progress_log import ProgressLog
from reclock.runtime.settings import Settings
from reclock.runtime.upsert_state import UpsertState


@dataclass
class OutputRuntime:
    """One sink of one output of a running source: its *slot*.

    An output with one sink (``sink:``) is one slot; an output with
    ``sinks: [...]`` is one slot per sink. Everything the runtime keeps per
    durable target is the slot's: the sink, its state (upper and progress),
    its commit ledger entry and key state (under :attr:`key`), its counts and
    health. What is the output's (:attr:`index`, :attr:`name`, its spec,
    decoders, envelope and columns) the slots of one output share: equal in
    each, and changed in all at once (:meth:`reclock.runtime.shapes.Shapes.describe`).
    """

    index: int  # the output's index among the source's outputs (shared by its slots)
    name: str  # the output's name
    spec: OutputSpec
    sink: PersistSink
    user_schema: Any
    key_decoder: Any | None = None
    value_decoder: Any | None = None
    envelope: Envelope = field(default_factory=default_envelope)
    upsert_key: tuple[str, ...] | None = None  # by output column names
    upstream: tuple[str, ...] = ()  # each user column's upstream name, if renamed
    rename: dict[str, str] = field(default_factory=dict)  # the output's rename mapping
    #: the key of a sink that keeps one row per key (a state table), else None
    state_key: tuple[str, ...] | None = None
    #: the output's schema_change policy (reclock/core/schema_change.py)
    policy: Policy = DEFAULT_POLICY
    #: the key and value format specs of a raw output (its decoders are built
    #: again at every open when they follow a schema registry)
    formats: tuple[dict[str, Any] | None, dict[str, Any] | None] = (None, None)
    #: registry schema ids records named that the decoders' union lacked,
    #: per decoder part (schema_change: evolve re-opens to take them)
    seen: dict[str, list[int]] = field(default_factory=dict)
    #: values of upstream columns the output does not take (freeze)
    dropped: DroppedTally = field(default_factory=DroppedTally)
    upsert: UpsertState | None = None
    state: SinkState = field(default_factory=SinkState)
    rows: int = 0
    errors: int = 0
    health: Health = field(default_factory=Health)
    #: the slot's position among the source's slots (site.outputs)
    slot: int = 0
    #: the sink's name within its output (its type for the one sink of ``sink:``)
    sink_name: str = ""
    #: the name the slot's state is kept under: the output's name for the
    #: one sink of ``sink:``, ``<output>.<sink>`` for each of ``sinks:``
    #: (:meth:`reclock.config.schema.OutputConfig.slot`)
    key: str = ""
    #: whether the output has several sinks (``sinks:``)
    several: bool = False
    #: a slot whose sink failed while others went on is parked: out of the
    #: jobs and commits until this time (``time.monotonic()``), then the
    #: source re-opens to bring it back (None: not parked)
    parked_until: float | None = None
    #: consecutive failures of the slot's sink (its retry backoff)
    failures: int = 0

    def __post_init__(self) -> None:
        if not self.key:
            self.key = self.name

    @property
    def label(self) -> str:
        """``output 'x'``, or ``output 'x' sink 'y'`` for one of several sinks."""
        return (f"output {self.name!r} sink {self.sink_name!r}" if self.several
                else f"output {self.name!r}")


@dataclass(eq=False)
class Site:
    """One source's runtime as every room sees it. The runner makes it;
    the rooms read it, and change only :attr:`opened`."""

    source: Source[Any]
    outputs: list[OutputRuntime]
    store: RemapStore
    clock: Clock
    settings: Settings
    events: ProgressLog
    #: set when the source stops (or is dropped): no new job starts, and a
    #: job in flight gets ``jobs.STOP_GRACE_S`` to finish
    stop: threading.Event
    #: the pipeline's driver lock, which every mint and sink commit
    #: requires (None: no store lock, or a rehearsed zombie)
    lock: LockWatch | None = None
    #: whether the source is open; False: the next round of the run loop
    #: opens it again, re-reading every output's durable state
    opened: bool = False

    @property
    def name(self) -> str:
        return self.source.name


def upper_value(upper: Antichain[IntoTime]) -> int | None:
    u = upper.as_option()
    return None if u is None else int(u)


def min_upper(states: list[SinkState]) -> int | None:
    """The meet of the outputs' uppers; ``None`` (the empty upper: complete) is
    the top, so complete outputs never hold the others back."""
    ups = [s.upper for s in states if s.upper is not None]
    return min(ups) if ups else None


def by_output(slots: list[OutputRuntime]) -> list[list[OutputRuntime]]:
    """The slots grouped by output, in the outputs' order (index)."""
    groups: dict[int, list[OutputRuntime]] = {}
    for o in slots:
        groups.setdefault(o.index, []).append(o)
    return [groups[i] for i in sorted(groups)]


#: The fields of an :class:`OutputRuntime` that are its output's, not its
#: sink's: equal in every slot of one output (:func:`share`).
OUTPUT_FIELDS = ("spec", "user_schema", "key_decoder", "value_decoder", "envelope",
                 "upsert_key", "upstream", "seen")


def share(slots: list[OutputRuntime]) -> None:
    """What the first slot of an output holds of the output itself (its
    shape, decoders and key, as :meth:`reclock.runtime.shapes.Shapes.describe`
    made them), given to its other slots."""
    first = slots[0]
    for other in slots[1:]:
        for name in OUTPUT_FIELDS:
            setattr(other, name, getattr(first, name))


def resume_into(outputs: list[OutputRuntime]) -> Antichain[IntoTime]:
    """The resumption frontier in IntoTime: the meet of the outputs' uppers."""
    u = min_upper([o.state for o in outputs])
    return Antichain.empty() if u is None else Antichain.from_elem(IntoTime(u))
