"""The status model, and the observation of one running source.

One frozen type says what a pipeline's status is: :class:`PipelineStatus`
(a driver's document), :class:`SourceStatus` per source and
:class:`OutputStatus` per output. A source's status is built either by its
runner (:meth:`SourceStatus.from_runner`) or from durable state
(:meth:`SourceStatus.from_durable`: the remap store's bindings and the sinks'
states, for a source no runner describes). ``status.json``,
``/status.json``, ``/metrics``, the status page and ``reclock status`` only
render it (``to_json``, ``view_json``). The module imports no plug-in and no
data-plane library: ``reclock status`` reads a running driver's document
with it, fast.

:meth:`Status.document` reads the runner (its frontiers, health, outputs
and counts) without taking part in its tick: it is asked from other threads,
every second and more, so what is costly to compute from a frontier is
remembered while the frontier is the same object (:meth:`Status.memo`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from reclock.core.errors import ReclockError
from reclock.core.frontier import Antichain, frontier_distance
from reclock.core.time import IntoTime
from reclock.runtime.health import STALLED, Health

if TYPE_CHECKING:
    from reclock.contracts.sink import SinkState
    from reclock.contracts.source import Source
    from reclock.core.bindings import Bindings
    from reclock.core.mint import RemapOperator
    from reclock.runtime.jobs import Jobs
    from reclock.runtime.progress_log import ProgressLog
    from reclock.runtime.site import OutputRuntime, Site
    from reclock.runtime.snapshot_progress import SnapshotProgress

log = logging.getLogger("reclock.driver")


class Observed(Protocol):
    """What a status reads of a source's runner
    (:class:`~reclock.runtime.driver.SourceRunner`, which composes it)."""

    name: str
    source: Source[Any]
    outputs: list[OutputRuntime]
    site: Site
    events: ProgressLog
    jobs: Jobs
    snapshots: SnapshotProgress
    operator: RemapOperator[Any] | None
    read_from: Antichain[Any] | None
    last_probe: Antichain[Any] | None

    @property
    def records(self) -> int: ...

    @property
    def resume(self) -> Antichain[Any] | None: ...


class Status:
    """Observation of one source's runner (see the module)."""

    def __init__(self, runner: Observed) -> None:
        self.runner = runner
        #: the source's health (set by the run loop)
        self.health = Health(since_ms=runner.site.clock.now())
        #: When the runner was made: an output that has committed nothing
        #: yet lags from here (so a lag alert fires for it too).
        self.started_ms = runner.site.clock.now()
        self._samples: deque[tuple[float, int]] = deque(maxlen=64)
        #: how long the last ticks took (ms; opening the source included)
        self.tick_ms: deque[float] = deque(maxlen=64)
        self._memos: dict[str, tuple[tuple[Any, ...], Any]] = {}  # see memo
        self._memo_lock = threading.Lock()

    def set_health(self, status: str, error: str | None = None, hint: str | None = None,
                   definite: bool = False) -> None:
        """The source's health is ``status`` now (with the error met, its
        hint, and whether it is definite): logged as an event when it
        changes, and said once in the log when the source stalls."""
        h, name = self.health, self.runner.name
        if (h.status, h.error) != (status, error):
            self.health = Health(status, error, hint, self.runner.site.clock.now(), definite)
            self.runner.events.log(name, "health", status=status, error=error, hint=hint)
            if status == STALLED:  # (said once per change of the error, as it happens)
                log.warning("source %s: stalled (%s): %s%s", name,
                            "definite" if definite else "retried", error,
                            f" (hint: {hint})" if hint else "")

    @property
    def rate(self) -> float:
        """Records per second over the last ~10 s of wall time."""
        records = self.runner.records
        now = time.monotonic()
        self._samples.append((now, records))
        while len(self._samples) > 2 and now - self._samples[0][0] > 10:
            self._samples.popleft()
        t0, r0 = self._samples[0]
        return (records - r0) / (now - t0) if now - t0 > 0.5 else 0.0

    def memo(self, key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
        """``compute()``, remembered while the frontiers in ``key`` are the
        same objects (frontiers never change; a tick makes new ones): status
        is asked for every second and more, and a Kafka frontier of 2,048
        partitions takes milliseconds to encode."""
        with self._memo_lock:
            hit = self._memos.get(key[0])
            if hit is not None and len(hit[0]) == len(key) and all(
                    a is b for a, b in zip(hit[0][1:], key[1:], strict=True)):
                return hit[1]
        value = compute()
        with self._memo_lock:
            self._memos[key[0]] = (key, value)
        return value

    def encoded(self, name: str, f: Antichain[Any] | None) -> Any:
        """``f.encode()``; the status field ``name`` remembers its last one."""
        return None if f is None else self.memo((f"encode:{name}", f), f.encode)

    def model(self) -> SourceStatus:
        """The source's status now (see :meth:`SourceStatus.from_runner`)."""
        return SourceStatus.from_runner(self)

    def document(self) -> dict[str, Any]:
        """The source's status dict (see ``reclock status``)."""
        return self.model().to_json()


# -- the status model ---------------------------------------------------------------------
#: a health of a source that no runner describes (its state is read from storage)
NOT_RUNNING = {"status": "not running"}


@dataclass(frozen=True)
class OutputStatus:
    """One output's status, or one sink's of an output with several
    (``sinks:``: ``name`` is then ``<output>.<sink>``, and ``sink`` the
    sink's name). ``rows``, ``errors``, ``dropped_values`` and ``snapshot``
    are a runner's counts (``live``); an output read from its sink's state
    has only its upper and lag."""

    name: str
    #: the sink's upper (IntoTime); ``None``: closed (complete), 0: nothing committed yet
    upper: int | None
    #: how far the upper is behind now (ms); ``None``: closed, or not known
    lag_ms: int | None
    #: the output's health (``None``: no runner describes it)
    health: dict[str, Any] | None
    live: bool = False
    rows: int | None = None
    errors: int | None = None
    #: values dropped by the schema-change policy, per reason (only when any)
    dropped_values: dict[str, int] | None = None
    #: the initial snapshot's rows read and in all (``None``: none in this run)
    snapshot: dict[str, Any] | None = None
    #: the sink's name, for one of an output's several sinks (else ``None``)
    sink: str | None = None

    @classmethod
    def from_sink(cls, name: str, upper: int | None, now: int) -> OutputStatus:
        """An output of a source not running: its sink's upper, and the lag
        of that upper at ``now`` (none while nothing was committed)."""
        sink = name.split(".", 1)[1] if "." in name else None
        return cls(name, upper, None if not upper else max(0, now - upper), None, sink=sink)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> OutputStatus:
        """An output's dict of a runner's document (``status.json``)."""
        return cls(d["name"], d.get("upper"), d.get("lag_ms"), d.get("health"), True,
                   d.get("rows"), d.get("errors"), d.get("dropped_values"), d.get("snapshot"),
                   d.get("sink"))

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "upper": self.upper, "lag_ms": self.lag_ms}
        if self.sink is not None:
            d["sink"] = self.sink
        if self.live:
            d["rows"], d["errors"] = self.rows, self.errors
        d["health"] = self.health
        if self.dropped_values:
            d["dropped_values"] = dict(self.dropped_values)
        if self.live:
            d["snapshot"] = self.snapshot
        return d


#: a runner's numbers, in the order the documents list them (see :class:`RunNumbers`)
RUN_FIELDS = ("probe", "read_from", "records", "records_per_s", "lag_records",
              "job_seconds", "tick_ms")


@dataclass(frozen=True)
class RunNumbers:
    """What only a running source knows: its upstream's frontier (``probe``),
    where it reads from, records read, their rate, how many records it is
    behind, seconds spent in jobs and the median tick (ms)."""

    probe: Any = None
    read_from: Any = None
    records: int | None = None
    records_per_s: float | None = None
    lag_records: int | None = None
    job_seconds: float | None = None
    tick_ms: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in RUN_FIELDS}


@dataclass(frozen=True)
class SourceStatus:
    """One source's status: built by its runner (:meth:`from_runner`, live)
    or from durable state (:meth:`from_durable`: the remap store's bindings
    and the sinks' states of a source not running), and read back from
    ``status.json`` (:meth:`from_json`). :meth:`to_json` is the runner's
    dict of ``status.json``, ``/status.json`` and ``/metrics``;
    :meth:`view_json` is ``reclock status``'s entry."""

    source: str
    kind: str | None
    health: dict[str, Any]
    #: the last binding's frontier (encoded; ``None``: no binding)
    bound: Any
    #: the remap store's upper (``None``: closed)
    remap_upper: int | None
    #: bindings held
    bindings: int | None
    #: where the source resumes (encoded frontier), or why that is unavailable
    #: (a string); ``None``: not known yet (a runner that has not opened)
    resume: Any
    outputs: tuple[OutputStatus, ...]
    #: a running source's numbers (``None``: not running)
    run: RunNumbers | None = None

    @property
    def whole(self) -> bool:
        """Whether this describes the source whole (a runner that opened,
        or durable state)."""
        return self.resume is not None and self.kind is not None

    @property
    def resume_into(self) -> int | None:
        """The IntoTime the source resumes at: its outputs' least upper
        (``None``: all closed)."""
        finite = [o.upper for o in self.outputs if o.upper is not None]
        return min(finite) if finite else None

    @classmethod
    def from_runner(cls, observed: Status) -> SourceStatus:
        """A running source's status, read from its runner (see
        :class:`Status`)."""
        r = observed.runner
        source = r.source
        b = r.operator.bindings if r.operator is not None else None
        now = r.site.clock.now()
        snapshots = r.snapshots.status(source.snapshot_sizes())
        outs = []
        for o in r.outputs:
            upper = o.state.upper
            outs.append(OutputStatus(
                o.key, upper,
                # None: closed (complete, no lag); 0: nothing committed yet
                None if upper is None else max(0, now - (upper or observed.started_ms)),
                o.health.as_dict(), True, o.rows, o.errors,
                dict(o.dropped.counts) if o.dropped.counts else None,
                snapshots.get(o.index), o.sink_name if o.several else None))
        enc = observed.encoded
        read_from, probe = r.read_from, r.last_probe
        ticks = observed.tick_ms
        remap = None if b is None else b.upper.as_option()
        return cls(
            r.name, source.kind, observed.health.as_dict(),
            None if b is None or b.last is None else enc("bound", b.last.frontier),
            None if remap is None else int(remap),
            0 if r.operator is None else r.operator.retained,
            enc("resume", r.resume), tuple(outs),
            RunNumbers(
                enc("probe", probe), enc("read_from", read_from), r.records,
                round(observed.rate, 1),
                observed.memo(("distance", read_from, probe),
                              lambda: frontier_distance(source.kind, read_from, probe)),
                round(r.jobs.seconds, 3),
                # the median of the last 64 ticks (mint, read, commit, acknowledge)
                round(sorted(ticks)[len(ticks) // 2], 1) if ticks else None))

    @classmethod
    def from_durable(cls, name: str, source: Source[Any],
                     bindings: Callable[[], Bindings[Any] | None],
                     outputs: Sequence[tuple[str, Callable[[], SinkState]]], now: int,
                     live: SourceStatus | None = None) -> SourceStatus:
        """The status of a source from durable state: its bindings in the
        remap store (``bindings()``; ``None``: none stored) and its outputs'
        sink states (``(name, state)`` per output; lag as of ``now``). Where
        it resumes asks ``source`` when no binding exists yet (its initial
        frontier).

        ``live``: the status of a runner that has not opened yet (it does
        not know the source whole): what it shows is kept (its health,
        numbers, bindings and outputs), the rest (the kind, the outputs it
        does not show, where it resumes) is read here. Only what is needed
        is read: a sink may be unreachable (the runner shows why), and at
        2,048 partitions reading the bindings decodes every frontier."""
        shown = {} if live is None else {o.name: o for o in live.outputs}
        outs = tuple(shown.get(n) or OutputStatus.from_sink(n, state().upper, now)
                     for n, state in outputs)
        b: Bindings[Any] | None = None
        if live is None:
            b = bindings()
            remap = None if b is None else b.upper.as_option()
            st = cls(name, source.kind, dict(NOT_RUNNING),
                     None if b is None or b.last is None else b.last.frontier.encode(),
                     None if remap is None else int(remap), 0 if b is None else len(b),
                     None, outs)
        else:
            st = dataclasses.replace(live, kind=source.kind, outputs=outs)
            if st.resume is None:
                b = bindings()
        if st.resume is None:
            st = dataclasses.replace(st, resume=_resume(b, st.resume_into, source))
        return st

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SourceStatus:
        """A runner's dict of a driver's document (``status.json``)."""
        return cls(d["source"], d.get("kind"), d.get("health") or {}, d.get("bound"),
                   d.get("remap_upper"), d.get("bindings"), d.get("resume"),
                   tuple(OutputStatus.from_json(o) for o in d.get("outputs") or []),
                   RunNumbers(*(d.get(k) for k in RUN_FIELDS)))

    def to_json(self) -> dict[str, Any]:
        """The runner's dict (``status.json``, ``/status.json``, ``/metrics``)."""
        run = self.run or RunNumbers()
        return {
            "source": self.source, "kind": self.kind, "health": self.health,
            "probe": run.probe, "bound": self.bound, "remap_upper": self.remap_upper,
            "bindings": self.bindings, "read_from": run.read_from, "resume": self.resume,
            "records": run.records, "records_per_s": run.records_per_s,
            "lag_records": run.lag_records, "job_seconds": run.job_seconds,
            "tick_ms": run.tick_ms, "outputs": [o.to_json() for o in self.outputs],
        }

    def view_json(self, live: SourceStatus | None = None,
                  history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """``reclock status``'s entry: with a running source's numbers, its
        runner's dict whole (``live``) and its last events (``history``)."""
        d: dict[str, Any] = {"source": self.source, "kind": self.kind, "health": self.health,
                             "bindings": self.bindings, "remap_upper": self.remap_upper,
                             "bound": self.bound}
        if self.run is not None:
            d.update(self.run.to_json())
        d["outputs"] = [o.to_json() for o in self.outputs]
        d["resume_into"] = self.resume_into
        d["resume"] = self.resume
        if live is not None:
            d["live"] = live.to_json()
        if history is not None:
            d["history"] = history
        return d


@dataclass(frozen=True)
class PipelineStatus:
    """A driver's document (``status.json``, ``/status.json``): its
    process, when it was written, its status page, the fingerprint of the
    configuration it runs, one :class:`SourceStatus` per running source,
    the dropped sources, and whether the run ended (``stopped``)."""

    sources: tuple[SourceStatus, ...]
    pid: int | None = None
    updated_ms: int | None = None
    http: str | None = None
    config: str | None = None
    dropped: tuple[str, ...] = ()
    stopped: bool = False

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PipelineStatus:
        return cls(tuple(SourceStatus.from_json(s) for s in d.get("sources") or []),
                   d.get("pid"), d.get("updated_ms"), d.get("http"), d.get("config"),
                   tuple(d.get("dropped") or ()), bool(d.get("stopped")))

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"pid": self.pid, "updated_ms": self.updated_ms,
                             "http": self.http, "config": self.config,
                             "sources": [s.to_json() for s in self.sources],
                             "dropped": list(self.dropped)}
        if self.stopped:
            d["stopped"] = True
        return d

    def by_source(self) -> dict[str, SourceStatus]:
        return {s.source: s for s in self.sources}


def _resume(b: Bindings[Any] | None, resume_into: int | None, source: Source[Any]) -> Any:
    """Where a source not running resumes: its bindings' source upper at the
    outputs' upper, else (no binding yet) its initial frontier, which asks
    upstream (a Kafka source: the topic's partitions); or why it is
    unavailable."""
    try:
        if b is not None and len(b):
            ri = (Antichain.empty() if resume_into is None
                  else Antichain.from_elem(IntoTime(resume_into)))
            return b.source_upper_at(ri).encode()
        return source.initial_frontier().encode()
    except ReclockError as exc:
        return f"unavailable: {exc}"
