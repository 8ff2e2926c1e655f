"""Planning and running one source's jobs on Spark.

A job reads one planned range ``[start, reached)`` of a source's bound
FromTime range: :meth:`Jobs.submit` plans it on the source's control thread
(as every use of the source and the sinks), sized by :meth:`Jobs.task_sizes`
(records and bytes per task and per job) and spread over every core by
:meth:`Jobs.even_task`, and runs it on a job thread of its own (up to
``jobs_in_flight`` at once: job k+1 reads while job k commits).
:meth:`Jobs.wait` takes its results, cancelling and abandoning a job that
runs past ``spark.job_timeout`` (:class:`JobTimeout`) or outlives the stop
grace (:class:`Abandoned`); what such a job staged is never committed (the
sinks vacuum orphaned staged files).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reclock.contracts.source import ReadTask
from reclock.core.bindings import Bindings
from reclock.core.errors import TransientError
from reclock.core.frontier import Antichain
from reclock.core.secrets import SECRETS
from reclock.runtime.dataplane import (
    JobContext,
    OutputPlan,
    TaskProgress,
    TaskResult,
    cancel_jobs,
    run_job,
    run_local,
)
from reclock.runtime.site import Site
from reclock.runtime.snapshot_progress import SnapshotProgress

log = logging.getLogger("reclock.driver")

#: Tasks per core of a job whose tasks are cut by bytes (see Jobs.task_sizes).
JOB_TASKS_PER_CORE = 4

#: On stop, how long a job in flight may still finish before it is
#: abandoned (its result discarded; the next run reads the range again).
STOP_GRACE_S = 20.0

#: A job whose plan leaves cores idle is planned again with a task a core
#: when each task would still read at least this many records
#: (Jobs.even_task): 200,000 records of a burst were one task on one of two
#: cores.
SPLIT_MIN_RECORDS = 20_000


@dataclass
class Job:
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


class Jobs:
    """The jobs of one source: planned, sized, run, awaited, abandoned.
    Counts what they read (records, bytes per record, seconds)."""

    def __init__(self, site: Site, spark: Any | None, snapshots: SnapshotProgress,
                 spill_dir: Path | None) -> None:
        self.site = site
        self.spark = spark
        self.snapshots = snapshots
        #: where tasks write large intents (None: they return them)
        self.spill_dir = spill_dir
        self.group = f"reclock-{site.name}-{uuid.uuid4().hex[:8]}"
        self._slots: int | None = None
        self._pool: ThreadPoolExecutor | None = None  # the job read while one commits
        #: a job was abandoned (its thread may still run)
        self.abandoned = False
        #: by batch id: the progress of a submitted job that reads snapshot chunks
        self._progress: dict[str, TaskProgress] = {}
        self._count_lock = threading.Lock()
        self.records = 0
        #: bytes per record the source's tasks read (None: none reported yet);
        #: rises at once with larger records, falls slowly
        self.record_bytes: float | None = None
        self.seconds = 0.0

    def submit(self, b: Bindings[Any], start: Antichain[Any], bound: Antichain[Any]) -> Job:
        """Plan the job reading from ``start`` (on this thread, as every use of
        the source and the sinks) and run it on the job thread."""
        source = self.site.source
        max_task, max_job = self.task_sizes()
        tasks, reached = source.plan(start, bound, max_task, max_job)
        even = self.even_task(tasks, max_task)
        if even is not None:  # a burst that fits fewer tasks than cores: one each
            tasks, reached = source.plan(start, bound, even, max_job)
        if not start.less_equal(reached):
            raise AssertionError(f"plan moved backwards: {start} -> {reached}")
        fut: Future[list[TaskResult]] = Future()
        if not tasks:
            fut.set_result([])
            return Job(fut, reached)
        ctx = self.context(b.covering(start))  # only what [start, bound) needs
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.depth(),
                                            thread_name_prefix=f"jobs-{self.site.name}")
        progress = self.snapshots.submitted(tasks)
        if progress is not None:
            self._progress[ctx.batch_id] = progress
        snaps = frozenset(t.snapshot for t in tasks if t.snapshot is not None)
        return Job(self._pool.submit(self.execute, ctx, tasks), reached, progress, snaps,
                   tasks=tasks)

    def even_task(self, tasks: list[Any], max_task: int) -> int | None:
        """Records per task that spread a job over every core, when the plan
        leaves cores idle and the source may plan again (``plan_again``); a
        job of fewer than :data:`SPLIT_MIN_RECORDS` records a core stays as
        it is (a task costs more than it saves then). None: as planned."""
        cores = self.cores()
        if not self.site.source.plan_again or len(tasks) >= cores:
            return None
        total = sum(t.records for t in tasks)
        even = -(-total // cores)
        return even if SPLIT_MIN_RECORDS <= even < max_task else None

    def task_sizes(self) -> tuple[int, int]:
        """Records per task and per job at most: the settings' counts, and
        tasks of at most ``max_bytes_per_task`` by the bytes per record read
        so far (a job then takes :data:`JOB_TASKS_PER_CORE` such tasks per
        core); before any task reported, the source's ``first_task_records``."""
        settings = self.site.settings
        cores = self.cores()
        max_job = settings.spark.max_records_per_job
        # A bounded job (catching up) keeps every core busy: at least one task each.
        max_task = min(settings.spark.max_records_per_task, -(-max_job // cores))
        per = self.record_bytes
        if per is None:
            by_bytes = self.site.source.first_task_records
        else:
            by_bytes = max(1, int(settings.spark.max_bytes_per_task // max(per, 1.0)))
        if by_bytes is not None and by_bytes < max_task:
            max_task = by_bytes
            # (sizes unknown: one task per core, to learn them soon)
            max_job = min(max_job, by_bytes * cores * (1 if per is None else JOB_TASKS_PER_CORE))
        return max_task, max_job

    def wait(self, job: Job) -> list[TaskResult]:
        """The job's results. It is cancelled and abandoned when it runs past
        ``job_timeout_s`` (:class:`JobTimeout`: a job that never finishes
        usually means a task result the driver could not take in, out of
        memory), or when the source stops and it outlives :data:`STOP_GRACE_S`
        (at most the job timeout: :class:`Abandoned`); its staged files
        become orphans, vacuumed."""
        settings, name = self.site.settings, self.site.name
        stopped: float | None = None
        while True:
            done, _ = wait([job.future], 0.25)
            if done:
                return job.future.result()
            now = time.monotonic()
            if self.site.stop.is_set():
                stopped = now if stopped is None else stopped
                grace = min(STOP_GRACE_S, settings.spark.job_timeout / 1000.0)
                if now - stopped >= grace:
                    self.abandon()
                    raise Abandoned(f"source {name!r}: a job still running at the stop "
                                    f"was abandoned after {grace:.0f} s")
            elif now - job.submitted > settings.spark.job_timeout / 1000.0:
                self.abandon()
                raise JobTimeout(
                    f"source {name!r}: a Spark job ran {now - job.submitted:.0f} s without "
                    f"finishing (spark.job_timeout: {settings.spark.job_timeout / 1000:.0f} s); "
                    "it was "
                    "cancelled and is read again",
                    hint="a job that never finishes usually means the driver ran out of memory "
                         "(look for OutOfMemoryError in its log): raise spark.driver.memory, or "
                         "lower spark.max_records_per_job / max_bytes_per_task")

    def abandon(self) -> None:
        """Cancel this source's Spark jobs and leave their threads behind:
        later jobs run on a new pool."""
        self.abandoned = True
        self.cancel(shared=True)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def cancel(self, shared: bool = False) -> None:
        """Cancel this source's Spark jobs (their results are not wanted);
        with ``shared``, a shared job its small job runs in too (abandoning
        a job that runs too long: the other sources in it read again)."""
        if self.spark is not None:
            try:
                if shared:
                    cancel_jobs(self.spark.sparkContext, self.group)
                else:
                    self.spark.sparkContext.cancelJobGroup(self.group)
            except Exception:  # the context may already be down
                log.debug("cancelJobGroup failed", exc_info=True)

    def shutdown(self) -> None:
        """The job threads end (those of an abandoned job are left behind)."""
        if self._pool is not None:
            self._pool.shutdown(wait=not self.abandoned)
            self._pool = None

    def depth(self) -> int:
        """Jobs of this source that read at once (the source may allow fewer)."""
        limit = self.site.source.jobs_in_flight
        depth = self.site.settings.spark.jobs_in_flight
        return max(1, depth if limit is None else min(depth, int(limit)))

    def cores(self) -> int:
        """Task slots of the Spark application (1 when tasks run in this process)."""
        if self._slots is None:
            self._slots = 1 if self.spark is None else max(
                1, int(self.spark.sparkContext.defaultParallelism))
        return self._slots

    def context(self, b: Bindings[Any]) -> JobContext:
        """What the tasks of a job need: the bindings ``b``, and per output
        how to decode, envelope and stage its rows."""
        site = self.site
        source = site.source
        batch_id = f"{site.clock.now()}-{uuid.uuid4().hex[:10]}"
        plans = tuple(
            OutputPlan(
                index=o.slot, name=o.name, typed=o.spec.typed, user_schema=o.user_schema,
                key_decoder=o.key_decoder, value_decoder=o.value_decoder,
                progress=o.state.held(source.kind),
                stager=o.sink.stager(), envelope=o.envelope, key=o.upsert_key or (),
                upstream=o.upstream, output=o.index,
            )
            for o in site.outputs
            if o.parked_until is None  # a parked sink gets nothing until it is back
        )
        spill = self.spill_dir
        return JobContext(site.name, source.kind, batch_id, b, source.reader(), plans,
                          flush_bytes=site.settings.spark.max_bytes_per_stage,
                          spill_dir=None if spill is None else str(spill),
                          spill_bytes=min(site.settings.spark.max_bytes_per_settle, 8 * 2**20),
                          secrets=SECRETS.literals())

    def execute(self, ctx: JobContext, tasks: list[Any]) -> list[TaskResult]:
        """Run a job's tasks (on Spark, or in this process without it) and
        count what they read; a task's error is raised."""
        progress = self._progress.pop(ctx.batch_id, None)
        t0 = time.monotonic()
        if self.spark is None:
            results = run_local(ctx, tasks, progress)
        else:
            results = run_job(self.spark, ctx, tasks, pool=self.site.name, group=self.group,
                              progress=progress,
                              share_up_to=self.site.settings.spark.shared_jobs_max_records)
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
            self.seconds += time.monotonic() - t0
        return results
