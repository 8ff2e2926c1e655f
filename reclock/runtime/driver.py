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

Faults: a :class:`~reclock.core.errors.TransientError` stalls the source (health
``stalled`` with the error) and retries with exponential backoff; a
:class:`~reclock.core.errors.DefiniteError` also stalls it, with the hint, and
retries slowly (the operator fixes the cause). Neither closes a frontier.
Shutdown and drop stop a source between steps or cancel its Spark job; a job
that finishes after its source was dropped is discarded, never committed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from reclock import faults
from reclock.config.base import KEYED_ENVELOPE, state_key_problem
from reclock.core.bindings import Bindings
from reclock.core.clock import Clock
from reclock.core.columns import (
    DIFF,
    INTO_TIME,
    RESNAPSHOT_PART,
    SRC_OFFSET,
    SRC_PART,
    SRC_SEQ,
    rename_columns,
)
from reclock.core.errors import (
    DefiniteError,
    IdentityChanged,
    LockTaken,
    ReclockError,
    Reopen,
    SchemaChanged,
    ShapeSeen,
    TransientError,
    classified,
    classify,
)
from reclock.core.frontier import Antichain, frontier_distance
from reclock.core.mint import RemapOperator
from reclock.core.schema_change import (
    Change,
    Decision,
    decide,
)
from reclock.core.secrets import SECRETS
from reclock.core.time import IntoTime
from reclock.envelopes import UpsertState, envelope_for
from reclock.envelopes.keystate import (
    KeyedIntents,
    KeyStateDamaged,
    KeyStore,
    MemoryKeys,
    SqliteKeys,
)
from reclock.remap_store.base import RemapStore
from reclock.runtime.dataplane import (
    JobContext,
    OutputPlan,
    TaskProgress,
    TaskResult,
    cancel_jobs,
    run_job,
    run_local,
)
from reclock.runtime.health import DROPPED, FINISHED, RUNNING, STALLED, STOPPED, Health
from reclock.runtime.ledger import CommitLedger
from reclock.runtime.lock import LockWatch
from reclock.runtime.memory import release_free_memory, release_if_idle
from reclock.runtime.progress_log import ProgressLog
from reclock.runtime.replay import heal
from reclock.runtime.resnapshot import Requests
from reclock.runtime.shapes import Facts, raw_user_schema
from reclock.runtime.site import OutputRuntime, Settings, min_upper, upper_value
from reclock.runtime.snapshot_progress import SnapshotProgress
from reclock.sinks.base import (
    SinkFenced,
    SinkState,
    Superseded,
    check_output_names,
    output_schema,
)
from reclock.sinks.consolidate import COUNT, consolidate
from reclock.sources.base import ReadTask, Source

log = logging.getLogger("reclock.driver")

#: a tick starts this long after an IntoTime a binding can take (timers wake late, not early)
TICK_AFTER_BOUNDARY_MS = 5

__all__ = ["TICK_AFTER_BOUNDARY_MS", "OutputRuntime", "Settings", "SourceRunner",
           "check_state_key", "next_tick_in"]


#: Tasks per core of a job whose tasks are cut by bytes (see SourceRunner._task_sizes).
JOB_TASKS_PER_CORE = 4

#: A job whose plan leaves cores idle is planned again with a task a core
#: when each task would still read at least this many records
#: (SourceRunner._even_task): 200,000 records of a burst were one task on
#: one of two cores.
SPLIT_MIN_RECORDS = 20_000


def check_state_key(what: str, out: OutputRuntime) -> None:
    """An output's state table must be keyed by a key that contains the
    output's upstream key (:func:`~reclock.config.base.state_key_problem`):
    its envelope's key, else the key its source declares for typed rows (a
    CDC table's primary key or replica identity index, a generator table's
    id). Checked once the output's columns are known: when the pipeline is
    built, or when the source describes its typed outputs. A
    :class:`DefiniteError` naming ``what`` otherwise."""
    if not out.state_key:
        return
    upstream: tuple[str, ...] | None = None
    fix = KEYED_ENVELOPE
    declared = ("the key the source declares for it: a CDC table's primary key or replica "
                "identity index, a generator table's id")
    if out.upsert_key:
        upstream = out.upsert_key
        origin = declared if out.spec.envelope is not None else (
            f"the {out.envelope.type} envelope's key")
    elif out.spec.typed and out.spec.key:
        upstream = tuple(out.rename.get(k, k) for k in out.spec.key)
        origin = declared
    elif out.spec.typed:
        origin = ("the source declares no key for it: a CDC table without a primary key or "
                  "replica identity index, or a file load")
        fix = "give the table a primary key upstream and key the state table by it"
    else:
        origin = "envelope none: every record is an insertion, and none retracts an earlier one"
    problem = state_key_problem(out.state_key, upstream, origin, fix)
    if problem is not None:
        raise DefiniteError(f"{what}: sink key {list(out.state_key)}: {problem}",
                            hint="change the sink's key or mode in the pipeline file")


def _key_marker(out: OutputRuntime, state: SinkState) -> str:
    """What a keyed output's key store is the state of: the output's
    committed version (its upper and progress) and the shape of its rows."""
    return json.dumps({"upper": state.upper, "progress": state.progress,
                       "columns": [f"{f.name}:{f.type}" for f in out.user_schema],
                       "key": list(out.upsert_key or ())}, sort_keys=True)


def _remove_spilled(intents: list[KeyedIntents]) -> None:
    """Remove the files tasks wrote for a job's intents (settled or not)."""
    for k in intents:
        for path in k.files():
            with contextlib.suppress(OSError):
                os.unlink(path)


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


@dataclass
class _Job:
    """A submitted job and the frontier its data reaches."""

    future: Future[list[TaskResult]]
    reached: Antichain[Any]
    #: followed as its tasks finish: the job reads snapshot chunks
    progress: TaskProgress | None = None
    #: the outputs whose snapshot chunks the job reads
    snapshots: frozenset[int] = frozenset()
    submitted: float = field(default_factory=time.monotonic)
    #: its read tasks (the source confirms what they read before the commit)
    tasks: list[ReadTask] = field(default_factory=list)

    def discard(self, timeout: float | None = None) -> bool:
        """Wait for it (up to ``timeout``) and drop its results: what it
        staged is never committed (the sinks vacuum orphaned staged files).
        False when it is still running."""
        done, _ = wait([self.future], timeout)
        if not done:
            return False
        try:
            self.future.result()
        except Exception:
            log.debug("discarded job failed", exc_info=True)
        return True


class JobTimeout(TransientError):
    """A Spark job ran past ``spark.job_timeout``; it was cancelled."""


class Abandoned(Exception):
    """The source stops and a job in flight outlived the stop grace."""


class SourceRunner:
    """The control loop of one source (see the module docstring)."""

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
        self.store = store
        self.spark = spark
        self._slots: int | None = None
        self.clock = clock
        #: When this runner was made: an output that has committed nothing
        #: yet lags from here (so a lag alert fires for it too).
        self.started_ms = clock.now()
        self.settings = settings
        self.events = events
        self.as_of = as_of
        self.health = Health(since_ms=clock.now())
        self._stop = threading.Event()
        self._dropped = threading.Event()
        #: the file ``reclock drop`` makes (None: not watched). The run loop
        #: sees it within a second; the runner also looks just before each
        #: commit, so a job that finishes after the request commits nothing.
        self.drop_marker = drop_marker
        self._thread: threading.Thread | None = None
        self.operator: RemapOperator[Any] | None = None
        self.read_from: Antichain[Any] | None = None
        self.resume: Antichain[Any] | None = None
        self.acknowledged: Antichain[Any] | None = None
        self.ticks = 0
        self._gone: set[int] = set()  # outputs whose upstream is gone (output_errors)
        self._keys: dict[int, KeyStore] = {}  # keyed outputs' key stores, by output
        #: keyed outputs whose key store met damage and was thrown away: why
        #: (reported by the rebuild at the next open)
        self._key_damage: dict[int, str] = {}
        #: keyed outputs whose key state was rebuilt for damage and has not
        #: been committed since (damage again: the disk is suspect)
        self._key_healing: set[int] = set()
        # The first vacuum one to two periods after start, at a random point:
        # a thousand sources started together otherwise vacuumed together,
        # every period (each vacuum's first pass reads its table, in a child).
        self._vacuumed_at = time.monotonic() + random.uniform(0.0, self.settings.vacuum_every_s)
        self.records = 0
        #: bytes per record the source's tasks read (None: none reported yet);
        #: rises at once with larger records, falls slowly
        self.record_bytes: float | None = None
        self._samples: deque[tuple[float, int]] = deque(maxlen=64)
        #: how long the last ticks took (ms; opening the source included)
        self._tick_ms: deque[float] = deque(maxlen=64)
        self._memos: dict[str, tuple[tuple[Any, ...], Any]] = {}  # see _memo
        self._memo_lock = threading.Lock()
        self.last_probe: Antichain[Any] | None = None
        self.job_seconds = 0.0
        self.job_group = f"reclock-{self.name}-{uuid.uuid4().hex[:8]}"
        self._opened = False
        self._count_lock = threading.Lock()
        self._jobs: ThreadPoolExecutor | None = None  # the job read while one commits
        self._abandoned = False  # a job was abandoned (its thread may still run)
        self.snapshots = SnapshotProgress()
        #: ``reclock resnapshot`` requests (None: not taken), and those taken
        #: up by the last open: output index -> when it was requested
        self.requests = requests
        self._resnap: dict[int, int] = {}
        #: by batch id: the progress of a submitted job that reads snapshot chunks
        self._progress: dict[str, TaskProgress] = {}
        #: the remap shard as the pipeline read it at start, for the first
        #: open only (:meth:`~reclock.remap_store.base.RemapStore.open_shards`)
        self._prefetched = bindings
        #: what the outputs committed, as the driver recorded it (runtime/ledger.py)
        self.ledger = CommitLedger(store, self.name)
        #: the pipeline's driver lock, which every mint and sink commit
        #: requires (None: no store lock, or a rehearsed zombie)
        self.lock = lock

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
        self._cancel_jobs()

    def _drop_requested(self) -> bool:
        """Whether this source is dropped, by :meth:`drop` or by a drop
        marker the run loop has not seen yet (then it drops now)."""
        if self._dropped.is_set():
            return True
        if self.drop_marker is not None and self.drop_marker.exists():
            self.drop()
            return True
        return False

    def _cancel_jobs(self, shared: bool = False) -> None:
        """Cancel this source's Spark jobs (their results are not wanted);
        with ``shared``, a shared job its small job runs in too (abandoning
        a job that runs too long: the other sources in it read again)."""
        if self.spark is not None:
            try:
                if shared:
                    cancel_jobs(self.spark.sparkContext, self.job_group)
                else:
                    self.spark.sparkContext.cancelJobGroup(self.job_group)
            except Exception:  # the context may already be down
                log.debug("cancelJobGroup failed", exc_info=True)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _set_health(self, status: str, error: str | None = None, hint: str | None = None,
                    definite: bool = False) -> None:
        h = self.health
        if (h.status, h.error) != (status, error):
            self.health = Health(status, error, hint, self.clock.now(), definite)
            self.events.log(self.name, "health", status=status, error=error, hint=hint)
            if status == STALLED:  # (said once per change of the error, as it happens)
                log.warning("source %s: stalled (%s): %s%s", self.name,
                            "definite" if definite else "retried", error,
                            f" (hint: {hint})" if hint else "")

    def run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                if not self._opened:
                    self.open()
                done = self.tick()
                self._tick_ms.append((time.monotonic() - started) * 1000.0)
                if self._dropped.is_set():
                    break
                self._set_health(FINISHED if done else RUNNING)
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
                definite = isinstance(classify(exc), DefiniteError)
                hint = exc.hint if isinstance(exc, ReclockError) else None
                msg = (exc.args[0] if exc.args else str(exc)) if isinstance(
                    exc, ReclockError) else f"{exc} ({'definite' if definite else 'transient'})"
                if isinstance(exc, Superseded | LockTaken):
                    # A newer driver of this pipeline owns the output (or its
                    # lock) now: a zombie writes nothing more.
                    log.error("source %s: stopped: %s (%s)", self.name, msg, hint)
                    self._set_health(STOPPED, f"{type(exc).__name__}: {msg}", hint, True)
                    break
                if isinstance(exc, SchemaChanged) and 0 <= exc.output < len(self.outputs):
                    # the next open takes the writer schema into the output's union
                    self.outputs[exc.output].seen.setdefault(exc.part, []).append(
                        exc.schema_id)
                if isinstance(exc, ShapeSeen):
                    # the next open's describe takes the shape the task met in
                    self.source.shape_seen(exc.output, exc.shape)
                if isinstance(exc, SinkFenced | Reopen | IdentityChanged):
                    self._opened = False  # re-read every output's durable state
                self._set_health(STALLED, f"{type(exc).__name__}: {msg}", hint, definite)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.settings.max_backoff_s)
        if self._dropped.is_set():
            try:
                self.source.drop()  # e.g. a Postgres slot, when configured to
            except Exception as exc:
                log.warning("source %s: releasing upstream resources failed: %s",
                            self.name, exc)
            self._set_health(DROPPED)
        elif self.health.status not in (FINISHED, STOPPED):
            self._set_health(STOPPED)
        if self._opened:
            try:
                self.ledger.record(((o.name, o.state) for o in self.outputs), force=True)
            except Exception as exc:  # the store may be away; the next open compares anyway
                log.warning("source %s: recording the outputs' uppers failed: %s",
                            self.name, exc)
        if self._jobs is not None:
            self._jobs.shutdown(wait=not self._abandoned)
            self._jobs = None
        try:
            self.source.close()
        except Exception:
            log.debug("close failed", exc_info=True)
        for store in self._keys.values():
            try:
                store.close()
            except Exception:
                log.debug("closing a key store failed", exc_info=True)
        self._keys = {}

    # -- steps -------------------------------------------------------------------
    def open(self) -> None:
        """Read durable state: bindings, every output's state; resume the source."""
        self.operator = RemapOperator(
            self.store, self.name, self.source.kind,
            initial_frontier=self.source.initial_frontier(), clock=self.clock,
            timestamp_interval_ms=self.settings.timestamp_interval_ms, as_of=self.as_of,
            snapshot=self._prefetched,
        )
        self._prefetched = None  # a later open (after a fence) reads the store again
        self._describe_outputs()
        self._resnap = self._requested()
        self._clear_spill()
        self.ledger.read()
        keys: dict[str, str] = {}
        for out in self.outputs:
            out.sink.ensure(out.user_schema)
            out.state = out.sink.state()
            if out.index not in self._resnap:  # a re-snapshot rebuilds a lost output
                self.ledger.check(out.name, out.sink, out.state)
            out.upsert = None
            if out.upsert_key is None:
                continue
            keys[out.name] = self._open_keys(out)
        b = self.operator.bindings  # just read back by the operator
        initial = self.source.initial_frontier()
        if b.last is not None:
            self.resume = b.source_upper_at(self._resume_into())
            bound = b.last.frontier
        else:
            self.resume = initial
            bound = initial
        self.read_from = self._read_start(b, self.resume)
        held = [o.state.held(self.source.kind) for o in self.outputs]
        if self._resnap:
            names = [self.outputs[i].name for i in sorted(self._resnap)]
            log.warning("source %s: re-snapshotting %s (reclock resnapshot)", self.name, names)
            self.events.log(self.name, "resnapshot", outputs=names, state="taken")
        self.source.open(self.resume, bound, held, resnapshot=[] if self.source.replayable
                         else sorted(self._resnap))
        self._opened = True
        self.events.log(self.name, "open", resume=self.resume.encode(),
                        read_from=self.read_from.encode(), bound=bound.encode(),
                        **({"keys": keys} if keys else {}))

    def _open_keys(self, out: OutputRuntime) -> str:
        """Set up a keyed output's key state for its committed version:
        ``reset``, ``reused`` or ``rebuilt`` (from the output, with an event
        saying why). A store found damaged (when its file was opened, which
        checks it, or while the driver ran) is rebuilt, never reused."""
        key = out.upsert_key
        assert key is not None
        store = self._key_store(out)
        damage = self._key_damage.pop(out.index, None) or store.discarded
        store.discarded = None
        columns = [f.name for f in out.user_schema]
        marker = _key_marker(out, out.state)
        if out.index in self._resnap:
            # Read again from scratch: the snapshot's rows start from no
            # keys (what the output holds now is retracted as a whole,
            # however damaged: see _replaced); a replay's correction
            # brings its own key state (see _commit). A damaged output's
            # key state cannot be rebuilt: it is not needed.
            if damage is not None:
                log.warning("source %s: output %s: key state file %s was damaged (%s): "
                            "emptied for the re-snapshot", self.name, out.name,
                            store.location, damage)
            store.reset()
            out.upsert = UpsertState(columns, key, store)
            return "reset"
        if damage is None:
            store.rollback()
            if store.marker == marker:
                # the stored state is that of the output's committed version
                out.upsert = UpsertState(columns, key, store)
                return "reused"
        if damage is not None:
            why = f"damaged: {damage}"
        elif store.location is None:
            why = "the key state is kept in memory"
        elif store.marker is None:
            why = "no key state saved yet"
        else:  # a crash between the output's commit and the key state's, ...
            why = "the saved key state is not that of the output's committed version"
        # the key state is exactly that of the committed output
        updates = out.sink.read_updates()
        out.upsert = UpsertState.rebuild(updates, columns, key, store, marker)
        if damage is not None:
            self._key_healing.add(out.index)
        (log.warning if damage is not None else log.info)(
            "source %s: output %s: key state rebuilt from %d rows of the output (%s)%s",
            self.name, out.name, updates.num_rows, why,
            "" if store.location is None else f" in {store.location}")
        self.events.log(self.name, "keys_rebuilt", output=out.name, file=store.location,
                        reason=why, rows=updates.num_rows)
        return "rebuilt"

    def _lost_keys(self, out: OutputRuntime, exc: KeyStateDamaged, during: str
                   ) -> ReclockError:
        """A keyed output's key store met damage ``during`` a step: the store
        is thrown away (its file deleted), and the source re-opens, which
        rebuilds the key state from the output and reads the job again
        (key state changes only after the sink commit: a job that was not
        committed is settled again against the rebuilt state, one that was
        is in the output it is rebuilt from). The error to raise: a
        :class:`~reclock.core.errors.Reopen`, or a definite error when the
        state rebuilt for damage is damaged again before any commit."""
        store = self._keys.pop(out.index, None)
        if store is not None:
            store.remove()
        self._opened = False  # whatever is raised: the next round re-opens
        self._key_damage[out.index] = f"{exc.reason} (met while {during})"
        log.error("source %s: output %s: key state file %s is damaged (%s, met while %s): "
                  "deleted; the source re-opens and rebuilds it from the output",
                  self.name, out.name, exc.path, exc.reason, during)
        if out.index in self._key_healing:
            return DefiniteError(
                f"source {self.name!r}: output {out.name!r}: its key state file {exc.path} "
                f"is damaged again ({exc.reason}), before any commit since it was rebuilt "
                "for damage", hint="check the disk under state_dir (or move state_dir to "
                "another disk); the key state is rebuilt from the output at each retry")
        return Reopen(f"source {self.name!r}: output {out.name!r}: key state file "
                      f"{exc.path} is damaged ({exc.reason}): it is rebuilt from the output",
                      hint="nothing to do: the job in progress is read again")

    def _key_store(self, out: OutputRuntime) -> KeyStore:
        """The key store of a keyed output (made once per runner)."""
        store = self._keys.get(out.index)
        if store is None:
            d = self.settings.keys_dir
            store = MemoryKeys() if d is None else SqliteKeys(d / f"{out.name}.sqlite",
                                                                 self.settings.key_cache)
            self._keys[out.index] = store
        return store

    def _spill_dir(self) -> Path | None:
        d = self.settings.keys_dir
        return None if d is None or not self.settings.spill_intents else d / "spill"

    def _clear_spill(self) -> None:
        """Remove intents that tasks wrote for jobs no longer wanted (a
        crash, an abandoned job): only jobs in flight write there."""
        d = self._spill_dir()
        if d is not None and d.exists():
            shutil.rmtree(d, ignore_errors=True)

    def _requested(self) -> dict[int, int]:
        """The pending resnapshot requests of this source's outputs."""
        if self.requests is None or not self.source.can_resnapshot:
            return {}
        self.requests.changed()  # what is listed now is seen
        index = {o.name: o.index for o in self.outputs}
        return {index[n]: t for n, t in self.requests.pending().items() if n in index}

    def _describe_outputs(self) -> None:
        """Each output's columns as upstream is now, met by the output's
        ``schema_change`` policy (runtime/shapes.py): typed outputs take the
        source's description (an upstream table may have changed), raw
        outputs whose decoders follow a schema registry rebuild them. What
        the policy decides is kept as a fact before any commit uses it."""
        specs = self.source.current_outputs()
        if [s.name for s in specs] != [o.name for o in self.outputs]:
            raise DefiniteError(
                f"source {self.name!r}: its outputs changed from {[o.name for o in self.outputs]}"
                f" to {[s.name for s in specs]}", hint="restart the pipeline")
        facts = Facts(self.store.facts(self.name))
        for out, spec in zip(self.outputs, specs, strict=True):
            what = f"source {self.name!r} output {out.name!r}"
            changes: tuple[Change, ...] = ()
            if spec.typed:
                if spec.schema is None:
                    continue
                out.spec = spec
                if spec.envelope is not None:
                    out.envelope = envelope_for(spec.envelope, tuple(spec.key))
                upstream, key_columns = spec.schema, None
                changes = tuple(spec.changes)
            elif self._evolving(out):
                upstream, key_columns = self._redecode(out, what, facts)
            elif out.user_schema is None:
                continue
            else:
                assert out.value_decoder is not None
                upstream = pa.schema(
                    ([*out.key_decoder.schema] if out.key_decoder is not None else [])
                    + [*out.value_decoder.schema] + list(out.spec.extra or []))
                key_columns = ([f.name for f in out.key_decoder.schema]
                               if out.key_decoder is not None else [])
            key = out.envelope.resolve(what, list(upstream.names), key_columns)
            if out.rename:
                upstream, _, key = rename_columns(what, upstream, out.rename, key)
            decision = decide(what, out.name, out.policy, facts.today(out.name), upstream,
                              changes)
            self._log_changes(out, decision)
            out.user_schema, out.upsert_key = decision.schema, key
            if out.rename:
                back = {v: k for k, v in out.rename.items()}
                out.upstream = tuple(back.get(n, n) for n in decision.schema.names)
            check_output_names(what, out.user_schema)
            check_state_key(what, out)
            facts.set_today(out.name, out.user_schema)
        if facts.updates:
            self.store.put_facts(self.name, facts.updates)
        missing = [o.name for o in self.outputs if o.user_schema is None]
        if missing:
            raise DefiniteError(f"source {self.name!r}: outputs {missing} have no schema")

    @staticmethod
    def _evolving(out: OutputRuntime) -> bool:
        return any(getattr(d, "evolving", False) for d in (out.key_decoder, out.value_decoder))

    def _redecode(self, out: OutputRuntime, what: str, facts: Facts
                  ) -> tuple[pa.Schema, list[str]]:
        """Rebuild a raw output's decoders that follow a schema registry (the
        union of what they took before, the subject's versions now and the
        ids records named); record their unions; the upstream columns."""
        from reclock.formats import make_decoder

        key_spec, value_spec = out.formats
        decs: dict[str, Any] = {}
        for part, spec in (("key", key_spec), ("value", value_spec)):
            old = out.key_decoder if part == "key" else out.value_decoder
            if spec is None or not getattr(old, "evolving", False):
                decs[part] = old
                continue
            dec = make_decoder(spec, allow_null=part == "value" and out.envelope.allow_null,
                               policy=out.policy, known=facts.avro(out.name, part),
                               seen=out.seen.get(part, ()), part=part)
            for note in getattr(dec, "notes", ()):
                log.warning("%s: %s", what, note)
                self.events.log(self.name, "schema", output=out.name, note=note)
            facts.set_avro(out.name, part, dec.fact())  # type: ignore[attr-defined]
            decs[part] = dec
        out.key_decoder, out.value_decoder = decs["key"], decs["value"]
        out.seen = {}
        schema, key_columns = raw_user_schema(what, out.key_decoder, out.value_decoder,
                                              list(out.spec.extra or []), out.envelope.type)
        return schema, key_columns

    def _count_dropped(self, out: OutputRuntime, results: list[TaskResult]) -> None:
        """Values of upstream columns the output does not take (freeze),
        committed with this batch: counted, and each column named in the
        progress log the first time (in this run) its values are dropped."""
        counts: dict[str, int] = {}
        for r in results:
            for c, v in r.dropped_values.get(out.index, {}).items():
                counts[c] = counts.get(c, 0) + v
        if not counts:
            return
        for c in out.dropped.add(counts):
            log.warning("source %s output %s: dropping the values of upstream column %r "
                        "(schema_change: %s; the output does not have it)", self.name, out.name,
                        c, out.policy)
            self.events.log(self.name, "schema", output=out.name, policy=out.policy,
                            dropping_values_of=c)

    def _log_changes(self, out: OutputRuntime, decision: Decision) -> None:
        """Name what the policy did with upstream's changes in the progress log."""
        if not decision.changes:
            return
        said = [c.describe() for c in decision.changes]
        log.info("source %s output %s: schema_change %s: %s", self.name, out.name, out.policy,
                 "; ".join(said))
        self.events.log(self.name, "schema", output=out.name, policy=out.policy,
                        changes=said, dropping=list(decision.dropped),
                        keeping_types=list(decision.kept_types))

    def _resume_into(self) -> Antichain[IntoTime]:
        u = min_upper([o.state for o in self.outputs])
        return Antichain.empty() if u is None else Antichain.from_elem(IntoTime(u))

    def _read_start(self, b: Bindings[Any], resume: Antichain[Any]) -> Antichain[Any]:
        """Where the data plane continues: the meet of the outputs' progress
        (each output drops what it already holds), never before ``resume``."""
        start: Antichain[Any] | None = None
        for out in self.outputs:
            held = out.state.held(self.source.kind)
            p = resume if held is None else held
            start = p if start is None else start.meet(p)
        return resume if start is None else start

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
        if (self.requests is not None and self.requests.changed()
                and self._requested().items() - self._resnap.items()):
            self._opened = False  # a new resnapshot request: re-open (next round)
            return False

        def probe() -> Antichain[Any]:
            faults.fail_point("source")
            f = self.source.probe()
            self.last_probe = f
            return f

        before = self.operator.bindings
        minting = time.monotonic()
        if self.lock is not None:
            self.lock.require()  # no binding is appended without the driver lock
        b = self.operator.mint(probe)  # 1. mint (read back from the store)
        self._upstream_gone()
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
        deadline = time.monotonic() + self.settings.job_time_budget_s
        # 2.+3. read what is bound, in bounded jobs, and commit each in order;
        # up to jobs_in_flight jobs read at once (the next ones read while one
        # commits); past the deadline no new job starts (mint again first)
        pending: deque[_Job] = deque()
        start = self.read_from

        def fill() -> None:
            """Plan and submit jobs until ``jobs_in_flight`` are under way."""
            nonlocal start
            while (len(pending) < self._depth() and start != bound
                   and not self._stop.is_set() and time.monotonic() <= deadline):
                job = self._submit(b, start, bound)
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
                results = self._await(job)  # a task's error is raised here
                if self._drop_requested():
                    return False  # late results of a dropped source are discarded
                if failed is None:
                    try:
                        fill()
                    except ReclockError as exc:
                        failed = exc  # planning the next job failed: commit this one first
                faults.crash_point("after_stage")
                self.source.confirm(job.tasks)  # what the tasks read is what was bound
                self._commit(b, results, job.reached, snapshots=job.snapshots)
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
                self._resume_and_acknowledge(b)  # 4.+5. also while catching up
        finally:
            for job in pending:  # a commit failed or the source stops
                if not job.discard(0 if self._abandoned else None):
                    self._abandon()
            self.snapshots.abandoned()  # no job in flight: uncommitted reads are gone
            if not self._abandoned:
                self._clear_spill()  # intents of jobs discarded above
        if self.read_from == bound:
            # Nothing left to read: idle outputs still advance to the remap upper.
            self._commit(b, [], bound, only_if_moves=True)
        self._resume_and_acknowledge(b)  # 4.+5.
        self._compact(b)  # 6.
        self._vacuum()
        self._maintain()
        return b.is_closed and all(o.state.upper is None for o in self.outputs)

    def _submit(self, b: Bindings[Any], start: Antichain[Any], bound: Antichain[Any]) -> _Job:
        """Plan the job reading from ``start`` (on this thread, as every use of
        the source and the sinks) and run it on the job thread."""
        max_task, max_job = self._task_sizes()
        tasks, reached = self.source.plan(start, bound, max_task, max_job)
        even = self._even_task(tasks, max_task)
        if even is not None:  # a burst that fits fewer tasks than cores: one each
            tasks, reached = self.source.plan(start, bound, even, max_job)
        if not start.less_equal(reached):
            raise AssertionError(f"plan moved backwards: {start} -> {reached}")
        fut: Future[list[TaskResult]] = Future()
        if not tasks:
            fut.set_result([])
            return _Job(fut, reached)
        ctx = self._context(b.covering(start))  # only what [start, bound) needs
        if self._jobs is None:
            self._jobs = ThreadPoolExecutor(self._depth(), thread_name_prefix=f"jobs-{self.name}")
        progress = self.snapshots.submitted(tasks)
        if progress is not None:
            self._progress[ctx.batch_id] = progress
        snaps = frozenset(t.snapshot for t in tasks if t.snapshot is not None)
        return _Job(self._jobs.submit(self._execute, ctx, tasks), reached, progress, snaps,
                    tasks=tasks)

    def _even_task(self, tasks: list[Any], max_task: int) -> int | None:
        """Records per task that spread a job over every core, when the plan
        leaves cores idle and the source may plan again (``plan_again``); a
        job of fewer than :data:`SPLIT_MIN_RECORDS` records a core stays as
        it is (a task costs more than it saves then). None: as planned."""
        cores = self._cores()
        if not self.source.plan_again or len(tasks) >= cores:
            return None
        total = sum(t.records for t in tasks)
        even = -(-total // cores)
        return even if SPLIT_MIN_RECORDS <= even < max_task else None

    def _task_sizes(self) -> tuple[int, int]:
        """Records per task and per job at most: the settings' counts, and
        tasks of at most ``max_bytes_per_task`` by the bytes per record read
        so far (a job then takes :data:`JOB_TASKS_PER_CORE` such tasks per
        core); before any task reported, the source's ``first_task_records``."""
        cores = self._cores()
        max_job = self.settings.max_records_per_job
        # A bounded job (catching up) keeps every core busy: at least one task each.
        max_task = min(self.settings.max_records_per_task, -(-max_job // cores))
        per = self.record_bytes
        if per is None:
            by_bytes = self.source.first_task_records
        else:
            by_bytes = max(1, int(self.settings.max_bytes_per_task // max(per, 1.0)))
        if by_bytes is not None and by_bytes < max_task:
            max_task = by_bytes
            # (sizes unknown: one task per core, to learn them soon)
            max_job = min(max_job, by_bytes * cores * (1 if per is None else JOB_TASKS_PER_CORE))
        return max_task, max_job

    def _await(self, job: _Job) -> list[TaskResult]:
        """The job's results. It is cancelled and abandoned when it runs past
        ``job_timeout_s`` (:class:`JobTimeout`: a job that never finishes
        usually means a task result the driver could not take in, out of
        memory), or when the source stops and it outlives ``stop_grace_s``
        (at most the job timeout: :class:`Abandoned`); its staged files
        become orphans, vacuumed."""
        stopped: float | None = None
        while True:
            done, _ = wait([job.future], 0.25)
            if done:
                return job.future.result()
            now = time.monotonic()
            if self._stop.is_set():
                stopped = now if stopped is None else stopped
                grace = min(self.settings.stop_grace_s, self.settings.job_timeout_s)
                if now - stopped >= grace:
                    self._abandon()
                    raise Abandoned(f"source {self.name!r}: a job still running at the stop "
                                    f"was abandoned after {grace:.0f} s")
            elif now - job.submitted > self.settings.job_timeout_s:
                self._abandon()
                raise JobTimeout(
                    f"source {self.name!r}: a Spark job ran {now - job.submitted:.0f} s without "
                    f"finishing (spark.job_timeout: {self.settings.job_timeout_s:.0f} s); it was "
                    "cancelled and is read again",
                    hint="a job that never finishes usually means the driver ran out of memory "
                         "(look for OutOfMemoryError in its log): raise spark.driver.memory, or "
                         "lower spark.max_records_per_job / max_bytes_per_task")

    def _abandon(self) -> None:
        """Cancel this source's Spark jobs and leave their threads behind:
        later jobs run on a new pool."""
        self._abandoned = True
        self._cancel_jobs(shared=True)
        if self._jobs is not None:
            self._jobs.shutdown(wait=False, cancel_futures=True)
            self._jobs = None

    def _depth(self) -> int:
        """Jobs of this source that read at once (the source may allow fewer)."""
        limit = self.source.jobs_in_flight
        depth = self.settings.jobs_in_flight
        return max(1, depth if limit is None else min(depth, int(limit)))

    def _cores(self) -> int:
        """Task slots of the Spark application (1 when tasks run in this process)."""
        if self._slots is None:
            self._slots = 1 if self.spark is None else max(
                1, int(self.spark.sparkContext.defaultParallelism))
        return self._slots

    def _context(self, b: Bindings[Any]) -> JobContext:
        batch_id = f"{self.clock.now()}-{uuid.uuid4().hex[:10]}"
        plans = tuple(
            OutputPlan(
                index=o.index, name=o.name, typed=o.spec.typed, user_schema=o.user_schema,
                key_decoder=o.key_decoder, value_decoder=o.value_decoder,
                progress=o.state.held(self.source.kind),
                stager=o.sink.stager(), envelope=o.envelope, key=o.upsert_key or (),
                upstream=o.upstream,
            )
            for o in self.outputs
        )
        spill = self._spill_dir()
        return JobContext(self.name, self.source.kind, batch_id, b, self.source.reader(), plans,
                          flush_bytes=self.settings.max_bytes_per_task,
                          spill_dir=None if spill is None else str(spill),
                          spill_bytes=min(self.settings.settle_bytes, 8 * 2**20),
                          secrets=SECRETS.literals())

    def _execute(self, ctx: JobContext, tasks: list[Any]) -> list[TaskResult]:
        progress = self._progress.pop(ctx.batch_id, None)
        t0 = time.monotonic()
        if self.spark is None:
            results = run_local(ctx, tasks, progress)
        else:
            results = run_job(self.spark, ctx, tasks, pool=self.name, group=self.job_group,
                              progress=progress, share_up_to=self.settings.share_jobs_up_to)
        failed = next((r.error for r in results if r.error is not None), None)
        if failed is not None:
            raise failed
        with self._count_lock:  # jobs_in_flight job threads
            records = sum(r.records for r in results)
            self.records += records
            if records:
                per = sum(r.bytes for r in results) / records
                was = self.record_bytes
                self.record_bytes = per if was is None or per > was else 0.9 * was + 0.1 * per
            self.job_seconds += time.monotonic() - t0
        return results

    @property
    def rate(self) -> float:
        """Records per second over the last ~10 s of wall time."""
        now = time.monotonic()
        self._samples.append((now, self.records))
        while len(self._samples) > 2 and now - self._samples[0][0] > 10:
            self._samples.popleft()
        t0, r0 = self._samples[0]
        return (self.records - r0) / (now - t0) if now - t0 > 0.5 else 0.0

    def _commit(
        self, b: Bindings[Any], results: list[TaskResult], reached: Antichain[Any],
        only_if_moves: bool = False, snapshots: frozenset[int] = frozenset(),
    ) -> None:
        """Per output: staged data + (upper, progress) in one atomic, fenced step.
        ``snapshots``: outputs whose snapshot chunks ``results`` hold; one being
        re-snapshotted retracts what it held in the same step (:meth:`_replaced`)."""
        new_upper = upper_value(b.reclock_frontier(reached))
        progress = reached.encode_json()
        for out in self.outputs:
            new = SinkState(new_upper, progress)
            cur = out.state
            if only_if_moves and cur == new:
                continue
            past = cur.held(self.source.kind)
            if past is not None and cur.progress != progress and reached.less_equal(past):
                # This output is already past `reached` (it committed further
                # before a crash); it dropped every record of this job.
                if any(r.staged.get(out.index) for r in results):
                    raise AssertionError(f"output {out.name!r}: staged data behind its progress")
                continue
            if not cur.less_equal(new):
                raise AssertionError(
                    f"output {out.name!r}: upper would move backwards {cur.upper} -> {new_upper}"
                )
            staged = [s for r in results for s in r.staged.get(out.index, [])]
            if self._drop_requested():
                return
            # Key state derived from the output changes only once the commit
            # that carries its updates succeeded: settling writes its changes
            # in the key store's open transaction, committed after the sink
            # commit, so a failed stage or commit leaves it as it was.
            intents = [r.intents[out.index] for r in results if out.index in r.intents]
            replacing = out.index in self._resnap and (
                out.index in snapshots or (self.source.replayable and cur.upper is not None))
            keys = out.upsert
            try:
                if replacing:
                    if self.source.replayable:
                        # the correction at the output's upper, before this job's rows
                        assert cur.upper is not None
                        try:
                            extra, healed = heal(self.source, out, b, cur.upper)
                        except DefiniteError as exc:
                            # It cannot be done (retention removed what it needs
                            # meanwhile, ...): the request goes, and the output
                            # goes on from its durable state (its key state too).
                            self._refused(out, exc)
                            raise Reopen(f"source {self.name!r}: output {out.name!r} was not "
                                         "re-snapshotted", hint=exc.hint) from exc
                        if healed is not None and keys is not None:
                            keys.take(healed)
                    else:
                        extra = self._replaced(b, out)
                    staged += self._stage(out, "resnap", extra)
                if intents and keys is not None:
                    if faults.take("damage_keys"):
                        keys.store.damage()
                    staged += self._settle(out, keys, KeyedIntents.merged(intents))
                faults.fail_point("commit")
                if self.lock is not None:
                    self.lock.require()  # no sink commits without the driver lock
                out.sink.commit(staged, cur, new)
            except BaseException as exc:
                if keys is not None:
                    damage, during = (exc, "settling a job") if isinstance(
                        exc, KeyStateDamaged) else (None, "rolling back a failed commit")
                    try:
                        keys.rollback()
                    except KeyStateDamaged as found:
                        damage = damage or found
                    if damage is not None:
                        raise self._lost_keys(out, damage, during) from exc
                raise
            finally:
                _remove_spilled(intents)
            # (a crash here leaves a key store behind its output: rebuilt on open)
            faults.crash_point("after_sink_commit")
            if keys is not None:
                try:
                    keys.commit(_key_marker(out, new))
                except KeyStateDamaged as exc:
                    raise self._lost_keys(out, exc, "saving the key state") from exc
                except Exception as exc:  # the output moved: its key state is read again
                    raise Reopen(f"source {self.name!r}: output {out.name!r}: the key state "
                                 f"could not be saved ({exc})") from exc
                self._key_healing.discard(out.index)
            out.state = new
            if replacing:
                self.ledger.replace(out.name, new)
            if replacing and self.requests is not None:
                self.requests.done(out.name, self._resnap.pop(out.index))
                self.events.log(self.name, "resnapshot", outputs=[out.name], state="committed")
                log.warning("source %s: output %s re-snapshotted", self.name, out.name)
            out.rows += sum(r.rows.get(out.index, 0) for r in results)
            out.errors += sum(r.errors.get(out.index, 0) for r in results)
            self._count_dropped(out, results)
            if out.index not in self._gone:
                out.health = Health(RUNNING, since_ms=self.clock.now())
            self.events.log(self.name, "sink_upper", output=out.name, upper=new_upper,
                            progress=reached.encode(),
                            rows=sum(r.rows.get(out.index, 0) for r in results),
                            errors=sum(r.errors.get(out.index, 0) for r in results))
        faults.crash_point("after_upper_advance")

    def _settle(self, out: OutputRuntime, keys: UpsertState, intents: KeyedIntents
                ) -> list[dict[str, Any]]:
        """Stage the updates of a job's intents for a keyed output, a few key
        buckets at a time, writing the key changes into the key store's
        open transaction (staged in pieces of up to ``max_bytes_per_task``)."""
        staged: list[dict[str, Any]] = []
        held: list[pa.Table] = []
        for updates in keys.settle(intents, output_schema(out.user_schema),
                                   self.settings.settle_bytes):
            held.append(updates)
            if sum(t.nbytes for t in held) >= self.settings.max_bytes_per_task:
                staged += self._stage(out, "upsert", pa.concat_tables(held))
                held = []
        if held:
            staged += self._stage(out, "upsert", pa.concat_tables(held))
        return staged

    def _stage(self, out: OutputRuntime, what: str, table: pa.Table) -> list[dict[str, Any]]:
        """Stage rows the driver made for ``out`` (``what``: upsert updates, a
        re-snapshot's correction), at the ``stage`` failure point; nothing for
        no rows."""
        if not table.num_rows:
            return []
        faults.fail_point("stage")
        return out.sink.stager().stage(f"{self.clock.now()}-{what}-{uuid.uuid4().hex[:10]}",
                                       0, table)

    def _upstream_gone(self) -> None:
        """Outputs whose upstream the source says is gone for good stall with
        its definite error (once each, with an event); the others go on."""
        gone = self.source.output_errors()
        for out in self.outputs:
            exc = gone.get(out.index)
            if exc is None:
                continue
            if out.index not in self._gone:
                log.error("source %s: output %s: %s", self.name, out.name, exc)
                self.events.log(self.name, "output_error", output=out.name, error=str(exc),
                                hint=exc.hint)
                out.health = Health(STALLED, str(exc.args[0] if exc.args else exc), exc.hint,
                                    self.clock.now(), True)
        self._gone = set(gone)

    def _refused(self, out: OutputRuntime, exc: DefiniteError) -> None:
        """A re-snapshot that cannot be done: its request is removed, said why."""
        log.error("source %s: output %s cannot be re-snapshotted: %s (%s); the request is "
                  "dropped", self.name, out.name, exc, exc.hint)
        self.events.log(self.name, "resnapshot", outputs=[out.name], state="failed",
                        error=str(exc.args[0] if exc.args else exc), hint=exc.hint)
        if self.requests is not None:
            self.requests.done(out.name, self._resnap.pop(out.index))

    def _replaced(self, b: Bindings[Any], out: OutputRuntime) -> pa.Table:
        """What a re-snapshotted output retracts, at its snapshot's position
        and IntoTime: everything it holds, read back and consolidated (a row
        held ``n`` times is retracted ``n`` times; a row a damaged log holds
        ``-1`` times is put back once). Its snapshot's rows then insert the
        table's contents (a keyed output's key state starts empty for them:
        see :meth:`open`), so the output holds exactly the snapshot and its
        log stays a valid history whatever was done to it behind our back."""
        pos = self.source.snapshot_position(out.index)
        if pos is None:
            raise AssertionError(f"output {out.name!r}: a snapshot job without its snapshot")
        into = int(b.reclock_positions(np.array([pos[0]]), np.array([pos[1]]))[0])
        schema = output_schema(out.user_schema)
        held = out.sink.read_updates()
        # (a column the output gained since its last commit is not in the
        # sink yet: the rows it holds hold it null)
        names = [n for n in out.user_schema.names if n in held.column_names]
        counts = consolidate(held, None, names)
        n = counts.num_rows
        cols: dict[str, Any] = {c: counts.column(c) for c in names}
        cols.update({
            INTO_TIME: pa.array(np.full(n, into, np.int64)),
            DIFF: pc.negate(counts.column(COUNT)),
            SRC_PART: pa.array(np.full(n, RESNAPSHOT_PART, np.int32)),
            SRC_OFFSET: pa.array(np.full(n, pos[1], np.int64)),
            SRC_SEQ: pa.array(np.arange(n, dtype=np.int32)),
        })
        return pa.table({f.name: cols[f.name] if f.name in cols else pa.nulls(n, f.type)
                         for f in schema}).cast(schema)

    def _resume_and_acknowledge(self, b: Bindings[Any]) -> None:
        self.ledger.record((o.name, o.state) for o in self.outputs)
        resume = b.source_upper_at(self._resume_into())
        if self.resume is not None and not self.resume.less_equal(resume):
            raise AssertionError(f"resumption frontier moved backwards: {self.resume} -> {resume}")
        if resume != self.acknowledged and self.source.acknowledge(resume) is not False:
            self.acknowledged = resume
            self.events.log(self.name, "resume", frontier=resume.encode())
            faults.crash_point("after_acknowledge")
        self.resume = resume

    def _vacuum(self) -> None:
        """Every ``vacuum_every_s``, delete the outputs' orphaned staged files
        (failed commits, discarded jobs). Here, between ticks, none of this
        source's jobs is in flight, so an unreferenced file older than
        ``orphan_grace_s`` can no longer be committed by this driver; a zombie
        driver's commit of a deleted file fails cleanly and is retried."""
        now = time.monotonic()
        if now - self._vacuumed_at < self.settings.vacuum_every_s:
            return
        self._vacuumed_at = now
        for out in self.outputs:
            try:
                removed = out.sink.vacuum_orphans(self.settings.orphan_grace_s)
            except Exception as exc:  # housekeeping never stalls the source
                log.warning("source %s output %s: vacuuming staged files failed: %s",
                            self.name, out.name, exc)
                continue
            if removed:
                log.info("source %s output %s: removed %d orphaned staged files",
                         self.name, out.name, len(removed))
                self.events.log(self.name, "vacuum", output=out.name, files=len(removed))

    def _maintain(self) -> None:
        """Each output's own upkeep (:meth:`~reclock.sinks.base.PersistSink.maintain`:
        the sink decides when it is due), here between ticks where none of
        this source's jobs is in flight and none of its commits under way, so
        a compaction never races this driver's commits."""
        now = self.clock.now()
        did = False
        for out in self.outputs:
            try:
                done = out.sink.maintain(now)
            except Exception as exc:  # housekeeping never stalls the source
                log.warning("source %s output %s: maintenance failed: %s",
                            self.name, out.name, exc)
                continue
            if done:
                self.events.log(self.name, "maintain", output=out.name, **done)
                did = True
        if self.settings.release_memory:
            if did:
                release_free_memory()
            else:
                release_if_idle()

    def _compact(self, b: Bindings[Any]) -> None:
        """Compact the stored bindings every ``compact_every_ticks``; hold in
        memory only those from where the outputs resume on, every tick (the
        store keeps ``remap_retention`` of history for ``reclock verify``)."""
        assert self.operator is not None
        u = min_upper([o.state for o in self.outputs])
        if u is None or not len(b):
            return
        self.operator.hold_from(u)
        if self.ticks % self.settings.compact_every_ticks:
            return
        # At most the resumption frontier minus one step, and keep the
        # retention window of history.
        target = min(u - 1, self.clock.now() - self.settings.remap_retention_ms)
        store_upper = upper_value(b.upper)
        if target > self.operator.store_since and (store_upper is None or target < store_upper):
            self.operator.compact(target)

    # -- observation ---------------------------------------------------------------
    def _memo(self, key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
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

    def _encoded(self, name: str, f: Antichain[Any] | None) -> Any:
        """``f.encode()``; the status field ``name`` remembers its last one."""
        return None if f is None else self._memo((f"encode:{name}", f), f.encode)

    def status(self) -> dict[str, Any]:
        b = self.operator.bindings if self.operator is not None else None
        now = self.clock.now()
        snapshots = self.snapshots.status(self.source.snapshot_sizes())
        outs = []
        for o in self.outputs:
            outs.append({
                "name": o.name, "upper": o.state.upper,
                # None: closed (complete, no lag); 0: nothing committed yet
                "lag_ms": (None if o.state.upper is None
                           else max(0, now - (o.state.upper or self.started_ms))),
                "rows": o.rows, "errors": o.errors, "health": o.health.as_dict(),
                **({"dropped_values": dict(o.dropped.counts)} if o.dropped.counts else {}),
                # the initial snapshot's rows read and in all (None: none in this run)
                "snapshot": snapshots.get(o.index),
            })
        enc = self._encoded
        return {
            "source": self.name,
            "kind": self.source.kind,
            "health": self.health.as_dict(),
            "probe": enc("probe", self.last_probe),
            "bound": (None if b is None or b.last is None
                      else enc("bound", b.last.frontier)),
            "remap_upper": None if b is None else upper_value(b.upper),
            "bindings": 0 if self.operator is None else self.operator.retained,
            "read_from": enc("read_from", self.read_from),
            "resume": enc("resume", self.resume),
            "records": self.records,
            "records_per_s": round(self.rate, 1),
            "lag_records": self._memo(("distance", self.read_from, self.last_probe),
                                      lambda: frontier_distance(
                                          self.source.kind, self.read_from, self.last_probe)),
            "job_seconds": round(self.job_seconds, 3),
            # the median of the last 64 ticks (mint, read, commit, acknowledge)
            "tick_ms": (round(sorted(self._tick_ms)[len(self._tick_ms) // 2], 1)
                        if self._tick_ms else None),
            "outputs": outs,
        }

