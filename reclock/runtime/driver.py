"""The driver: one control loop per source, the data plane on Spark.

Each source runs in its own thread (sources are independent: one stuck or
failing source does not stall the others) and its Spark jobs in its own FAIR
pool. One tick of a source:

1. **mint** -- probe the upstream frontier, append a binding through the remap
   store (compare-and-append), read the bindings back;
2. **read** -- plan the newly bound FromTime range ``[read_from, bound)`` into
   tasks (bounded jobs when far behind) and run them on Spark: read, reclock
   with the broadcast bindings (only those the range needs:
   :meth:`~reclock.core.bindings.Bindings.covering`, not the retained
   history), decode, envelope, stage;
3. **commit** -- per output, data and the new (upper, progress) in one atomic
   sink commit, fenced on the state we last saw; uppers only move forward.
   When far behind, several jobs read at once (``jobs_in_flight`` per source,
   2 by default: job k+1 reads while job k finishes and commits, which hides
   each Spark job's fixed cost): commits still happen one job at a time, in
   order, and what job k+1 staged is only made visible by its own commit;
4. **resume** -- the resumption frontier (min over the outputs' uppers) is
   converted through the bindings into FromTime;
5. **acknowledge** -- only that frontier is acknowledged upstream;
6. **compact** -- the remap store's since follows the resumption frontier,
   keeping ``remap_retention`` of history for ``reclock verify``;
7. **maintain** -- housekeeping of the outputs: orphaned staged files, and
   each sink's own upkeep when due (a file output merges its small files).

:class:`SourceRunner` keeps the run loop and this numbered tick; each other
concern is a room of its own, which it composes (they share a
:class:`~reclock.runtime.site.Site`):

* :mod:`~reclock.runtime.jobs` -- planning, job sizing, the job threads,
  timeouts and abandoning (step 2);
* :mod:`~reclock.runtime.commit` -- the commit path as a state machine
  checked at every step (steps 3 to 5);
* :mod:`~reclock.runtime.keyed` -- the key state of keyed outputs: opened,
  settled, saved, healed;
* :mod:`~reclock.runtime.resnapshot` -- ``reclock resnapshot`` requests and
  the corrections they commit;
* :mod:`~reclock.runtime.shapes` -- each output's columns at every open
  (schema change);
* :mod:`~reclock.runtime.housekeeping` -- steps 6 and 7;
* :mod:`~reclock.runtime.status` -- what the runner shows (``status()``).

Faults: a :class:`~reclock.core.errors.TransientError` stalls the source (health
``stalled`` with the error) and retries with exponential backoff; a
:class:`~reclock.core.errors.DefiniteError` also stalls it, with the hint, and
retries slowly (the operator fixes the cause). Neither closes a frontier.
Shutdown and drop stop a source between steps or cancel its Spark job; a job
that finishes after its source was dropped is discarded, never committed.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any

from reclock import faults
from reclock.contracts.remap_store import RemapStore
from reclock.contracts.sink import SinkFenced, Superseded
from reclock.contracts.source import Source
from reclock.core.bindings import Bindings
from reclock.core.clock import Clock
from reclock.core.errors import (
    IdentityChanged,
    LockTaken,
    ReclockError,
    Reopen,
    classified,
)
from reclock.core.frontier import Antichain
from reclock.core.mint import RemapOperator
from reclock.runtime.commit import Committer
from reclock.runtime.health import (
    DROPPED,
    FINISHED,
    RUNNING,
    STALLED,
    STOPPED,
    Health,
    described,
)
from reclock.runtime.housekeeping import Housekeeping
from reclock.runtime.jobs import Job, Jobs
from reclock.runtime.keyed import KeyedState, spill_dir
from reclock.runtime.ledger import CommitLedger
from reclock.runtime.lock import LockWatch
from reclock.runtime.progress_log import ProgressLog
from reclock.runtime.resnapshot import Requests, Resnapshots
from reclock.runtime.settings import Settings
from reclock.runtime.shapes import Shapes, check_state_key
from reclock.runtime.site import OutputRuntime, Site, by_output, resume_into, upper_value
from reclock.runtime.snapshot_progress import SnapshotProgress
from reclock.runtime.status import Status

log = logging.getLogger("reclock.driver")

#: a tick starts this long after an IntoTime a binding can take (timers wake late, not early)
TICK_AFTER_BOUNDARY_MS = 5

#: A tick far behind runs jobs one after another for at most this long
#: before it commits what it has and lets the next tick mint a binding.
JOB_TIME_BUDGET_S = 10.0

__all__ = ["TICK_AFTER_BOUNDARY_MS", "OutputRuntime", "Settings", "SourceRunner",
           "check_state_key", "next_tick_in"]


def next_tick_in(interval_ms: int, remap_upper: int | None, now_ms: int,
                 elapsed_s: float) -> float:
    """Seconds until a source's next tick: until just past the first IntoTime
    a new binding can take (the first multiple of the interval at or above
    the remap upper, on the source's clock). The binding's time is then when
    its frontier was probed, and an output's lag after a commit is the
    tick's own time, not up to an interval more. Never more than the rest
    of the interval after the tick began ``elapsed_s`` ago, plus that margin
    (a clock that does not move, in tests); 0 when the tick overran."""
    left = interval_ms / 1000.0 - elapsed_s
    if left <= 0 or remap_upper is None:
        return max(0.0, left)
    nxt = -(-remap_upper // interval_ms) * interval_ms + TICK_AFTER_BOUNDARY_MS
    return max(0.0, min(left + TICK_AFTER_BOUNDARY_MS / 1000.0, (nxt - now_ms) / 1000.0))


def read_start(outputs: list[OutputRuntime], kind: str, resume: Antichain[Any]
               ) -> Antichain[Any]:
    """Where the data plane continues: the meet of the outputs' progress
    (each output drops what it already holds), never before ``resume``."""
    start: Antichain[Any] | None = None
    for out in outputs:
        held = out.state.held(kind)
        p = resume if held is None else held
        start = p if start is None else start.meet(p)
    return resume if start is None else start


def held_by_output(outputs: list[OutputRuntime], kind: str) -> list[Antichain[Any] | None]:
    """What each output holds (in the outputs' order) for the source's open:
    the meet of its sinks' progress; None when one of them holds nothing yet."""
    held: list[Antichain[Any] | None] = []
    for slots in by_output(outputs):
        # (a parked sink reads what it misses once it is back: not held here)
        mine = [o.state.held(kind) for o in slots if o.parked_until is None] or [
            o.state.held(kind) for o in slots]
        meet: Antichain[Any] | None = None
        for h in mine:
            if h is None:
                meet = None
                break
            meet = h if meet is None else meet.meet(h)
        held.append(meet)
    return held


class SourceRunner:
    """The control loop of one source: the run loop and the numbered tick
    (see the module docstring), composed of the rooms that do the rest."""

    def __init__(
        self,
        source: Source[Any],
        outputs: list[OutputRuntime],
        store: RemapStore,
        spark: Any | None,
        clock: Clock,
        settings: Settings,
        events: ProgressLog,
        *,
        as_of: int | None = None,
        requests: Requests | None = None,
        drop_marker: Path | None = None,
        bindings: Bindings[Any] | None = None,
        lock: LockWatch | None = None,
    ) -> None:
        self.source = source
        self.name = source.name
        self.outputs = outputs
        self.clock = clock
        self.settings = settings
        self.events = events
        self.as_of = as_of
        self._stop = threading.Event()
        self._dropped = threading.Event()
        #: the file ``reclock drop`` makes (None: not watched). The run loop
        #: sees it within a second; the runner also looks just before each
        #: commit, so a job that finishes after the request commits nothing.
        self.drop_marker = drop_marker
        self._thread: threading.Thread | None = None
        self.operator: RemapOperator[Any] | None = None
        self.read_from: Antichain[Any] | None = None
        self.last_probe: Antichain[Any] | None = None
        self.ticks = 0
        self.snapshots = SnapshotProgress()
        #: the remap shard as the pipeline read it at start, for the first
        #: open only (:meth:`~reclock.contracts.remap_store.RemapStore.open_shards`)
        self._prefetched = bindings
        #: what the outputs committed, as the driver recorded it (runtime/ledger.py)
        self.ledger = CommitLedger(store, self.name)
        # The rooms (see the module docstring).
        self.site = Site(source, outputs, store, clock, settings, events, self._stop, lock)
        self.jobs = Jobs(self.site, spark, self.snapshots, spill_dir(settings))
        self.keyed = KeyedState(self.site)
        self.resnapshots = Resnapshots(self.site, requests)
        self.shapes = Shapes(self.site)
        self.commits = Committer(self.site, self.keyed, self.resnapshots, self.shapes,
                                 self.ledger, self._drop_requested)
        self.housekeeping = Housekeeping(self.site)
        self.observed = Status(self)

    # -- what the rooms keep, as the runner's ------------------------------------------
    @property
    def resume(self) -> Antichain[Any] | None:
        """The resumption frontier (FromTime) as last computed."""
        return self.commits.resume

    @property
    def records(self) -> int:
        """Records the source's jobs read."""
        return self.jobs.records

    @property
    def health(self) -> Health:
        """The source's health (its outputs have their own)."""
        return self.observed.health

    def status(self) -> dict[str, Any]:
        return self.observed.document()

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"source-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def drop(self) -> None:
        """Stop promptly: cancel the running job, discard its results."""
        self._dropped.set()
        self._stop.set()
        self.jobs.cancel()

    def _drop_requested(self) -> bool:
        """Whether this source is dropped, by :meth:`drop` or by a drop
        marker the run loop has not seen yet (then it drops now)."""
        if self._dropped.is_set():
            return True
        if self.drop_marker is not None and self.drop_marker.exists():
            self.drop()
            return True
        return False

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                if not self.site.opened:
                    self.open()
                done = self.tick()
                self.observed.tick_ms.append((time.monotonic() - started) * 1000.0)
                if self._dropped.is_set():
                    break
                self.observed.set_health(FINISHED if done else RUNNING)
                backoff = 0.5
                if done:
                    break
                self._stop.wait(self._until_next_binding(started))
            except Exception as exc:
                if self._stop.is_set():
                    break  # shutting down: a cancelled job or closed channel is expected
                if not classified(exc):
                    log.error("source %s: unclassified error (a bug: please report it; "
                              "retried as transient)\n%s", self.name, traceback.format_exc())
                msg, hint, definite = described(exc)
                if isinstance(exc, Superseded | LockTaken):
                    # A newer driver of this pipeline owns the output (or its
                    # lock) now: a zombie writes nothing more.
                    log.error("source %s: stopped: %s (%s)", self.name, msg, hint)
                    self.observed.set_health(STOPPED, f"{type(exc).__name__}: {msg}", hint, True)
                    break
                self.shapes.met(exc)  # a shape the next open takes in
                if isinstance(exc, SinkFenced | Reopen | IdentityChanged):
                    self.site.opened = False  # re-read every output's durable state
                self.observed.set_health(STALLED, f"{type(exc).__name__}: {msg}", hint, definite)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.settings.max_retry_backoff_ms / 1000.0)
        if self._dropped.is_set():
            try:
                self.source.drop()  # e.g. a Postgres slot, when configured to
            except Exception as exc:
                log.warning("source %s: releasing upstream resources failed: %s",
                            self.name, exc)
            self.observed.set_health(DROPPED)
        elif self.health.status not in (FINISHED, STOPPED):
            self.observed.set_health(STOPPED)
        if self.site.opened:
            self.commits.close()
        self.jobs.shutdown()
        try:
            self.source.close()
        except Exception:
            log.debug("close failed", exc_info=True)
        self.keyed.close()

    # -- steps -------------------------------------------------------------------
    def open(self) -> None:
        """Read durable state: bindings, every output's state; resume the source."""
        self.operator = RemapOperator(
            self.site.store, self.name, self.source.kind,
            initial_frontier=self.source.initial_frontier(), clock=self.clock,
            timestamp_interval_ms=self.settings.timestamp_interval_ms, as_of=self.as_of,
            snapshot=self._prefetched,
        )
        self._prefetched = None  # a later open (after a fence) reads the store again
        self.shapes.describe()
        self.resnapshots.take()
        taken = self.resnapshots.taken
        self.keyed.clear_spill()
        b = self.operator.bindings  # just read back by the operator
        keys = self.commits.open(b)
        initial = self.source.initial_frontier()
        if b.last is not None:
            resume = b.source_upper_at(resume_into(self.outputs))
            bound = b.last.frontier
        else:
            resume = initial
            bound = initial
        self.commits.resume = resume
        # (parked sinks read again once they are back, from their own progress)
        running = [o for o in self.outputs if o.parked_until is None]
        self.read_from = read_start(running or self.outputs, self.source.kind, resume)
        held = held_by_output(self.outputs, self.source.kind)
        if taken:
            names = [by_output(self.outputs)[i][0].name for i in sorted(taken)]
            log.warning("source %s: re-snapshotting %s (reclock resnapshot)", self.name, names)
            self.events.log(self.name, "resnapshot", outputs=names, state="taken")
        self.source.open(resume, bound, held, resnapshot=[] if self.source.replayable
                         else sorted(taken))
        self.site.opened = True
        self.events.log(self.name, "open", resume=resume.encode(),
                        read_from=self.read_from.encode(), bound=bound.encode(),
                        **({"keys": keys} if keys else {}))

    def _until_next_binding(self, started: float) -> float:
        """:func:`next_tick_in` for this source, its tick begun at ``started``."""
        upper = (self.operator.bindings.upper.as_option()
                 if self.operator is not None else None)
        return next_tick_in(self.settings.timestamp_interval_ms,
                            None if upper is None else int(upper), self.clock.now(),
                            time.monotonic() - started)

    def tick(self) -> bool:
        """One round of mint -> read -> commit -> resume -> acknowledge.

        Returns True when the source has finished and every output is complete.
        """
        assert self.operator is not None and self.read_from is not None
        self.ticks += 1
        tick = self.ticks
        if self.resnapshots.new():
            self.site.opened = False  # a new resnapshot request: re-open (next round)
            return False
        if self.commits.due():
            # a parked sink's retry: re-open, reading its durable state again
            # (the records it missed are read again for it, the others skip them)
            self.site.opened = False
            return False

        def probe() -> Antichain[Any]:
            faults.fail_point("source")
            f = self.source.probe()
            self.last_probe = f
            return f

        before = self.operator.bindings
        minting = time.monotonic()
        if self.site.lock is not None:
            self.site.lock.require()  # no binding is appended without the driver lock
        b = self.operator.mint(probe)  # 1. mint (read back from the store)
        self.commits.upstream_gone()
        if b.upper != before.upper or len(b) != len(before):
            last = b.last
            self.events.log(
                self.name, "binding", upper=upper_value(b.upper),
                time=int(last.time) if last else None,
                frontier=last.frontier.encode() if last else None,
                mint_ms=round((time.monotonic() - minting) * 1000),  # its probe included
            )
        faults.crash_point("after_mint")
        if b.last is None:
            return False
        bound = b.last.frontier
        deadline = time.monotonic() + JOB_TIME_BUDGET_S
        # 2.+3. read what is bound, in bounded jobs, and commit each in order;
        # up to jobs_in_flight jobs read at once (the next ones read while one
        # commits); past the deadline no new job starts (mint again first)
        pending: deque[Job] = deque()
        start = self.read_from

        def fill() -> None:
            """Plan and submit jobs until ``jobs_in_flight`` are under way."""
            nonlocal start
            while (len(pending) < self.jobs.depth() and start != bound
                   and not self._stop.is_set() and time.monotonic() <= deadline):
                job = self.jobs.submit(b, start, bound)
                pending.append(job)
                start = job.reached

        failed: ReclockError | None = None
        try:
            fill()
        except ReclockError as exc:
            if not pending:
                raise
            failed = exc  # planning a later job failed: commit the first one first
        try:
            while pending:
                job = pending.popleft()
                results = self.jobs.wait(job)  # a task's error is raised here
                if self._drop_requested():
                    return False  # late results of a dropped source are discarded
                if failed is None:
                    try:
                        fill()
                    except ReclockError as exc:
                        failed = exc  # planning the next job failed: commit this one first
                faults.crash_point("after_stage")
                self.source.confirm(job.tasks)  # what the tasks read is what was bound
                self.commits.commit(tick, b, results, job.reached,  # 3.
                                    snapshots=job.snapshots)
                if job.progress is not None:  # the outputs hold their snapshots
                    self.snapshots.committed(job.progress, results,
                                             self.source.snapshot_sizes())
                self.read_from = job.reached
                self.events.log(self.name, "read", frontier=job.reached.encode(),
                                records=sum(r.records for r in results), tasks=len(results),
                                largest_task=max((r.records for r in results), default=0),
                                bytes=sum(r.bytes for r in results),
                                shared=max((r.shared for r in results), default=1))
                if failed is not None:
                    raise failed
                self.commits.resume_and_acknowledge(tick, b)  # 4.+5. also while catching up
        finally:
            for job in pending:  # a commit failed or the source stops
                if not job.discard(0 if self.jobs.abandoned else None):
                    self.jobs.abandon()
            self.snapshots.abandoned()  # no job in flight: uncommitted reads are gone
            if not self.jobs.abandoned:
                self.keyed.clear_spill()  # intents of jobs discarded above
        if self.read_from == bound:
            # Nothing left to read: idle outputs still advance to the remap upper.
            self.commits.commit(tick, b, [], bound, only_if_moves=True)
        self.commits.resume_and_acknowledge(tick, b)  # 4.+5.
        self.housekeeping.compact(self.operator, b, tick)  # 6.
        self.housekeeping.vacuum()  # 7.
        self.housekeeping.maintain()
        return b.is_closed and all(o.state.upper is None for o in self.outputs)
