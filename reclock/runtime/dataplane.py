"""The data plane: what runs inside Spark tasks.

One job per source per tick (or several bounded jobs when far behind). Each
task reads one range of the source and pushes Arrow batches through::

    SourceReader.read(task) -> (output, batch)
        -> drop positions already durable in that output   (sink progress)
        -> reclock: _into_time from the broadcast Bindings   (pure, vectorized)
        -> decode key/value (raw outputs) | typed rows as is
        -> envelope (none: diff +1)
        -> Stager.stage(...)   parquet/COPY, invisible until the driver commits

Everything a task needs travels in one broadcast :class:`JobContext`:
bindings, decoders, stagers, and each output's progress. Executors never talk
to the remap store, and nothing here depends on files local to the driver.
Tasks are deterministic: a retried task stages the same data under the same
names. Data moves as Arrow batches, never row by row.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from reclock import faults
from reclock.contracts.envelope import Envelope, fit_column, meta_columns, unpicked_values
from reclock.contracts.rows import output_schema, refuse_rows
from reclock.contracts.sink import Stager
from reclock.contracts.source import ReadTask, SourceReader
from reclock.core.bindings import UNBOUND, Bindings, beyond
from reclock.core.columns import (
    DIFF,
    ERROR,
    SRC_DIFF,
    SRC_OFFSET,
    SRC_PART,
    SRC_TS,
    SRC_UNCHANGED,
    TRUNCATED,
)
from reclock.core.errors import DefiniteError, ReclockError, SchemaChanged, classify
from reclock.core.frontier import Antichain
from reclock.core.schema_change import dropped_counts, with_dropped
from reclock.core.secrets import install_log_filter, register
from reclock.runtime.keystate import IntentWriter, KeyedIntents


@dataclass(frozen=True)
class OutputPlan:
    """How one output's rows are made and staged into one of its sinks (a
    slot, :class:`~reclock.runtime.site.OutputRuntime`) in this job. The plans
    of one output's sinks share everything but the stager and the progress:
    a task decodes the output's records once, and each sink gets the rows its
    own progress does not hold yet."""

    index: int  # the slot's position among the source's slots: the key of its results
    name: str
    typed: bool
    user_schema: pa.Schema
    key_decoder: Any | None
    value_decoder: Any | None
    progress: Antichain[Any] | None  # positions not in it are durable already
    stager: Stager
    envelope: Envelope
    key: tuple[str, ...] = ()  # keyed outputs: rows are intents the driver applies
    #: each user column's name upstream (as decoded), where the output renames
    #: it; empty: the same names
    upstream: tuple[str, ...] = ()
    #: the output's index among the source's outputs (the reader's)
    output: int = 0

    @property
    def schema(self) -> pa.Schema:
        return output_schema(self.user_schema)

    def picks(self) -> list[tuple[str, pa.Field]]:
        """(upstream name, output field) of each user column."""
        names = self.upstream or tuple(self.user_schema.names)
        return list(zip(names, self.user_schema, strict=True))

    @property
    def upstream_key(self) -> tuple[str, ...]:
        """The key columns by their upstream names."""
        back = {f.name: up for up, f in self.picks()}
        return tuple(back[k] for k in self.key)

    @property
    def keyed(self) -> bool:
        return bool(self.key)


@dataclass(frozen=True)
class JobContext:
    """Everything a task needs; broadcast once per job."""

    source: str
    kind: str
    batch_id: str
    bindings: Bindings[Any]
    reader: SourceReader
    outputs: tuple[OutputPlan, ...]
    flush_rows: int = 500_000
    #: a task writes an output's decoded rows out once they hold this many bytes
    flush_bytes: int = 64 * 2**20
    #: where tasks write the intents of keyed outputs that exceed
    #: ``spill_bytes`` (a directory of the driver's machine; None: never written,
    #: carried in the task results)
    spill_dir: str | None = None
    spill_bytes: int = 8 * 2**20
    #: the driver's secrets (:mod:`reclock.core.secrets`): a task's worker
    #: registers them and scrubs its log records of them too
    secrets: frozenset[str] = frozenset()


@dataclass
class TaskResult:
    """What a task reports back to the driver (small: no data). Per-output
    maps are keyed by the slot (:attr:`OutputPlan.index`)."""

    task: int
    staged: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    rows: dict[int, int] = field(default_factory=dict)
    errors: dict[int, int] = field(default_factory=dict)
    records: int = 0
    #: bytes of the records read (as the reader hands them over): the driver
    #: sizes later tasks by the bytes per record
    bytes: int = 0
    dropped: int = 0
    max_src_ts: int | None = None
    seconds: float = 0.0
    #: how many sources' jobs ran in the one Spark job this task ran in
    shared: int = 1
    #: upsert outputs: decoded intents by key bucket, applied to the key
    #: state by the driver
    intents: dict[int, KeyedIntents] = field(default_factory=dict)
    #: a reclock error raised by the task, re-raised by the driver as is (its
    #: class decides stall, re-open or retry); Spark does not retry these
    error: ReclockError | None = None
    #: per output, values of upstream columns the output does not take
    #: (``schema_change: freeze``), per column
    dropped_values: dict[int, dict[str, int]] = field(default_factory=dict)


def _reclock(ctx: JobContext, part: npt.NDArray[np.int64], off: npt.NDArray[np.int64]
             ) -> npt.NDArray[np.int64]:
    b = ctx.bindings
    t = b.reclock_positions(part, off)
    if (t == UNBOUND).any():
        i = int(np.argmax(t == UNBOUND))
        raise DefiniteError(
            f"source {ctx.source!r}: record at partition {int(part[i])} offset {int(off[i])} "
            "has no binding; the driver planned beyond the bound frontier"
        )
    return t


#: columns of a source's batch that are not user columns
_BATCH_META = frozenset({SRC_DIFF, SRC_OFFSET, SRC_PART, SRC_TS, SRC_UNCHANGED, "key", "value"})


def build_output_rows(plan: OutputPlan, batch: pa.RecordBatch, into: npt.NDArray[np.int64]
                      ) -> tuple[pa.Table, int]:
    """Decode/shape one output's batch into stored rows; returns (rows, errors).
    Typed rows carry their columns (and CDC diffs); raw records go through the
    output's envelope."""
    if not plan.typed:
        return plan.envelope.rows(plan, batch, into)
    n = batch.num_rows
    names = set(batch.schema.names)
    cols = []
    refused: dict[int, str] = {}
    for up, f in plan.picks():
        if up not in names:  # a column the output keeps that upstream no longer has
            cols.append(pa.nulls(n, f.type))
            continue
        col, bad = fit_column(batch.column(up), f.type, f.name)
        for i, why in bad.items():
            refused.setdefault(i, why)
        cols.append(col)
    meta = meta_columns(batch, into, None)
    if SRC_DIFF in batch.schema.names:  # CDC rows: -1/+1, or keyed intents 1/0
        meta[1] = batch.column(SRC_DIFF).cast(pa.int64())
    arrays = [*cols, *meta, pa.nulls(n, pa.string()), pa.nulls(n, pa.binary()),
              pa.nulls(n, pa.binary())]
    rows = pa.Table.from_arrays(arrays, schema=plan.schema)
    if refused:  # values the output's column cannot hold: error rows naming them
        mask = np.zeros(n, dtype=bool)
        mask[list(refused)] = True
        rows = refuse_rows(rows, mask, refused)
    errors = len(refused)
    if plan.keyed and SRC_UNCHANGED in batch.schema.names:
        rows = rows.append_column(SRC_UNCHANGED, batch.column(SRC_UNCHANGED))
    # columns upstream has and the output does not take (schema_change: freeze)
    dropped = unpicked_values(batch, {up for up, _ in plan.picks()}, _BATCH_META)
    return with_dropped(rows, dropped), errors


def run_task(ctx: JobContext, task: ReadTask) -> TaskResult:
    """Read, reclock, decode and stage one task's range."""
    if ctx.secrets:  # (executors log to the driver's stderr in local mode)
        register(ctx.secrets)
        install_log_filter()
    faults.hang_point("hang")
    started = time.perf_counter()
    res = TaskResult(task.index)
    pending: dict[int, list[pa.Table]] = {}
    pending_rows: dict[int, int] = {}
    pending_bytes: dict[int, int] = {}
    flushes: dict[int, int] = {}
    spill = None if ctx.spill_dir is None else Path(ctx.spill_dir) / ctx.batch_id
    intents: dict[int, IntentWriter] = {}  # upsert outputs: applied by the driver
    # the plans (slots) of each output the reader yields records of
    slots_of: dict[int, list[OutputPlan]] = {}
    for p in ctx.outputs:
        slots_of.setdefault(p.output, []).append(p)

    def flush(i: int) -> None:
        tables = pending.pop(i, [])
        pending_rows.pop(i, None)
        pending_bytes.pop(i, None)
        if not tables:
            return
        table = _injected_refusal(pa.concat_tables(tables))
        k = flushes.get(i, 0)
        flushes[i] = k + 1
        staged = slot_plan[i].stager.stage(ctx.batch_id, task.index * 10_000 + k, table)
        res.staged.setdefault(i, []).extend(staged)
        # Rows the sink refused became error rows when staged: count them so.
        before = table.num_rows - table.column(ERROR).null_count
        after = sum(int(d["errors"]) for d in staged if "errors" in d)
        if any("errors" in d for d in staged) and after > before:
            res.rows[i] = res.rows.get(i, 0) - (after - before)
            res.errors[i] = res.errors.get(i, 0) + (after - before)

    slot_plan = {p.index: p for p in ctx.outputs}
    for o, batch in ctx.reader.read(task):
        n = batch.num_rows
        if n == 0:
            continue
        res.records += n
        res.bytes += batch.nbytes
        slots = slots_of.get(o)
        if not slots:
            continue  # every sink of the output is parked (runtime/commit.py)
        plan = slots[0]
        part = batch.column(SRC_PART).to_numpy(zero_copy_only=False).astype(np.int64)
        off = batch.column(SRC_OFFSET).to_numpy(zero_copy_only=False).astype(np.int64)
        # what each sink does not hold yet; the records any of them needs are decoded once
        keeps = [None if p.progress is None else beyond(ctx.kind, p.progress, part, off)
                 for p in slots]
        if all(k is not None for k in keeps):
            keep = np.logical_or.reduce([k for k in keeps if k is not None])
            if not keep.all():
                res.dropped += int((~keep).sum())
                batch = batch.filter(pa.array(keep))
                if batch.num_rows == 0:
                    continue
                part, off = part[keep], off[keep]
                keeps = [None if k is None else k[keep] for k in keeps]
        # sinks whose progress holds some of the records decoded: they filter the rows
        partial = {p.index for p, k in zip(slots, keeps, strict=True)
                   if k is not None and not k.all()}
        into = _reclock(ctx, part, off)
        ts = batch.column(SRC_TS)
        if ts.null_count < len(ts):
            mx = pc.max(ts).as_py()
            if mx is not None:
                res.max_src_ts = mx if res.max_src_ts is None else max(res.max_src_ts, mx)
        try:
            decoded, decoded_err = build_output_rows(plan, batch, into)
        except SchemaChanged as exc:
            exc.output = o  # which output's union the driver widens
            raise
        gone = dropped_counts(decoded.schema.metadata)
        if gone:
            decoded = decoded.replace_schema_metadata(None)
        for plan in slots:
            _slot_rows(ctx, res, plan, decoded, decoded_err, plan.index in partial, gone,
                       intents, spill, task.index, pending, pending_rows, pending_bytes, flush)
    for i in list(pending):
        flush(i)
    res.intents = {i: w.done() for i, w in intents.items()}
    res.seconds = time.perf_counter() - started
    return res


def _slot_rows(ctx: JobContext, res: TaskResult, plan: OutputPlan, rows: pa.Table, nerr: int,
               partial: bool, gone: dict[str, int], intents: dict[int, IntentWriter],
               spill: Path | None, task: int, pending: dict[int, list[pa.Table]],
               pending_rows: dict[int, int], pending_bytes: dict[int, int],
               flush: Callable[[int], None]) -> None:
    """The decoded ``rows`` of an output (``nerr`` of them error rows) into
    its sink ``plan``: those its progress does not hold (``partial``: it
    holds some of them), staged (flushed when large) or, for a keyed output,
    written as intents."""
    i = plan.index
    if partial:
        assert plan.progress is not None
        part = rows.column(SRC_PART).to_numpy(zero_copy_only=False).astype(np.int64)
        off = rows.column(SRC_OFFSET).to_numpy(zero_copy_only=False).astype(np.int64)
        rows = rows.filter(pa.array(beyond(ctx.kind, plan.progress, part, off)))
        if rows.num_rows == 0:
            return
        nerr = rows.num_rows - rows.column(ERROR).null_count
    if gone:
        mine = res.dropped_values.setdefault(i, {})
        for c, v in gone.items():
            mine[c] = mine.get(c, 0) + v
    if plan.keyed:
        # Values the sink cannot store are refused here, before the
        # driver's key state sees them: the key keeps its current row.
        rows = screen_intents(plan.stager, _injected_refusal(rows))
        nerr = rows.num_rows - rows.column(ERROR).null_count
        res.rows[i] = res.rows.get(i, 0) + rows.num_rows - nerr
        res.errors[i] = res.errors.get(i, 0) + nerr
        if i not in intents:
            intents[i] = IntentWriter(plan.key, spill, ctx.spill_bytes, f"o{i}-t{task}")
        intents[i].add(rows)
        return
    res.rows[i] = res.rows.get(i, 0) + rows.num_rows - nerr
    res.errors[i] = res.errors.get(i, 0) + nerr
    pending.setdefault(i, []).append(rows)
    pending_rows[i] = pending_rows.get(i, 0) + rows.num_rows
    pending_bytes[i] = pending_bytes.get(i, 0) + rows.nbytes
    if pending_rows[i] >= ctx.flush_rows or pending_bytes[i] >= ctx.flush_bytes:
        flush(i)


def screen_intents(stager: Stager, intents: pa.Table) -> pa.Table:
    """Upsert intents with the values ``stager`` cannot store refused (a
    truncation marker holds no value: it passes)."""
    marks = pc.equal(intents.column(DIFF), TRUNCATED)
    if not pc.any(marks).as_py():
        return stager.screen(intents)
    return pa.concat_tables([stager.screen(intents.filter(pc.invert(marks))),
                             intents.filter(marks)])


#: The reason of a row refused by ``RECLOCK_FAIL_AT=refuse`` (``reclock
#: verify`` takes a row the output holds with it as refused by the run).
INJECTED_REFUSAL = "injected refusal (RECLOCK_FAIL_AT=refuse)"


def _injected_refusal(table: pa.Table) -> pa.Table:
    """``RECLOCK_FAIL_AT=refuse``: the sink refuses the table's first row."""
    if table.num_rows == 0 or not faults.take("refuse"):
        return table
    first = np.zeros(table.num_rows, dtype=bool)
    first[0] = True
    return refuse_rows(table, first, INJECTED_REFUSAL)


_tasks_in_worker = 0


def _freeze_worker_heap() -> None:
    """At a Python worker's second task: move what the worker holds out of
    the cyclic collector's reach (``gc.freeze``).

    PySpark's daemon runs ``gc.collect()`` after every task of a reused
    worker. That full collection walks every object the worker holds --
    PySpark, pyarrow, numpy, deltalake and reclock's modules: about 100k --
    and takes 80-200 ms after each 0.2 s task of the real-broker benchmark
    (a profile of ``bench/peer_bench.py``: a quarter of the workers' time;
    bench/README.md, "peer_bench.py"). The first
    task imports what the sources and sinks need, and the daemon's collection
    after it leaves only live objects, so the second task freezes them.
    Frozen objects are still freed by reference counting; only a reference
    cycle among them would never be collected, and they are the modules and
    the first job's context, held once per worker."""
    global _tasks_in_worker
    _tasks_in_worker += 1
    if _tasks_in_worker == 2:
        gc.freeze()


def _run_partition(bc: Any, acc: Any, tasks: Iterable[ReadTask]) -> Iterator[TaskResult]:
    _freeze_worker_heap()
    ctx: JobContext = bc.value
    for task in tasks:
        try:
            res = run_task(ctx, task)
        except ReclockError as exc:
            yield TaskResult(task.index, error=exc)
            continue
        faults.kill_worker_point(1)  # (a rehearsed worker death: files staged, no result)
        if acc is not None:
            acc.add({task.index: res.records})
        yield res


class _RecordsByTask:
    """The ``AccumulatorParam`` of ``{task index: records read}`` (PySpark
    needs only these two methods; not importing PySpark here keeps the
    driver's import light). Each merge makes a new dict, so a reader on
    another thread never sees one being changed."""

    def zero(self, value: dict[int, int]) -> dict[int, int]:
        return {}

    def addInPlace(self, value1: dict[int, int], value2: dict[int, int]) -> dict[int, int]:
        out = dict(value1)
        for k, v in value2.items():
            out[k] = out.get(k, 0) + v
        return out


class TaskProgress:
    """The records read by each task of a running job that has finished, by
    task index, while the job still runs (its results only arrive when every
    task is done). On Spark, a job's tasks add to an accumulator, which
    Spark merges into the driver as each task succeeds (once per task, also
    when a task is retried); :meth:`done` may be called from any thread.

    An accumulator stays registered in PySpark for the life of the
    SparkContext, so only jobs whose progress is shown get one (those
    reading a snapshot)."""

    def __init__(self) -> None:
        self._acc: Any = None
        self._local: dict[int, int] = {}

    def accumulator(self, sc: Any) -> Any:
        if self._acc is None:
            self._acc = sc.accumulator({}, _RecordsByTask())
        return self._acc

    def finished(self, task: int, records: int) -> None:
        """A task that ran in this process (:func:`run_local`)."""
        self._local = {**self._local, task: records}

    def done(self) -> dict[int, int]:
        if self._acc is not None:
            return dict(self._acc.value)
        return self._local


class JobGate:
    """At most ``slots`` jobs in Spark at once, admitted in arrival order.

    Spark's FAIR scheduler breaks ties between pools by pool name, so with
    more sources than cores the sources whose names sort first would win
    every free slot and the others would starve. Admitting jobs first come,
    first served (one waiting ticket per source at a time) gives every source
    its turn; within Spark, FAIR pools still share cores between the admitted
    jobs, so a heavy job does not hold a light one back.

    Each waiter sleeps on an event of its own, set when its turn comes: with
    one condition notified on every change, each arrival and each finished
    job woke every waiting source's thread to look (a thousand sources:
    hundreds of thousands of wake-ups a second, the driver's GIL busy with
    them).
    """

    def __init__(self, slots: int) -> None:
        self.slots = max(1, slots)
        self._lock = threading.Lock()
        self._queue: deque[_Ticket | _Shared] = deque()
        self._running = 0

    def __enter__(self) -> JobGate:
        me = _Ticket()
        self._wait_turn(me)
        return self

    def __exit__(self, *exc: object) -> None:
        self._release()

    def _wait_turn(self, item: _Ticket | _Shared) -> None:
        with self._lock:
            self._queue.append(item)
            self._admit()
        item.wake.wait()

    def _release(self) -> None:
        with self._lock:
            self._running -= 1
            self._admit()

    def _admit(self) -> None:
        """Give free slots to the first in line (the lock held). A small job
        first in line takes every small job waiting, up to
        :data:`SHARED_MAX`, into its shared job."""
        while self._queue and self._running < self.slots:
            head = self._queue.popleft()
            self._running += 1
            if isinstance(head, _Shared):
                batch = [head]
                rest: deque[_Ticket | _Shared] = deque()
                for item in self._queue:
                    if isinstance(item, _Shared) and len(batch) < SHARED_MAX:
                        batch.append(item)
                    else:
                        rest.append(item)
                self._queue = rest
                head.batch = batch
            head.wake.set()

    def shared(self, req: _Shared, execute: Callable[[list[_Shared]], None]) -> None:
        """Run ``req`` in a job shared with the small jobs of other sources:
        the first of them admitted (in arrival order, as any job) takes
        every small job waiting, up to :data:`SHARED_MAX`, into one Spark job
        (``execute``); the others only wait for their results."""
        self._wait_turn(req)
        batch = req.batch
        if batch is None:
            return  # it ran in another's job, which woke it when done
        try:
            execute(batch)
        finally:
            self._release()
            for r in batch:
                r.wake.set()


@dataclass(eq=False)
class _Ticket:
    """A job waiting for its turn at the gate."""

    wake: threading.Event = field(default_factory=threading.Event)


#: Small jobs run in one shared Spark job at most (see :meth:`JobGate.shared`).
SHARED_MAX = 256


@dataclass(eq=False)
class _Shared:
    """One source's small job, waiting to run in a shared Spark job."""

    ctx: JobContext
    tasks: Sequence[ReadTask]
    group: str  # the source's job group
    #: set when its turn comes (``batch`` then says which job it leads) or
    #: when the job it ran in is done
    wake: threading.Event = field(default_factory=threading.Event)
    batch: list[_Shared] | None = None
    results: list[TaskResult] = field(default_factory=list)
    error: BaseException | None = None


_gates: dict[int, JobGate] = {}
_gates_lock = threading.Lock()


def _gate(sc: Any) -> JobGate:
    with _gates_lock:
        g = _gates.get(id(sc))
        if g is None:
            g = _gates[id(sc)] = JobGate(max(2, int(sc.defaultParallelism)))
        return g


def run_job(
    spark: Any, ctx: JobContext, tasks: Sequence[ReadTask], *, pool: str, group: str,
    progress: TaskProgress | None = None, share_up_to: int = 0,
) -> list[TaskResult]:
    """Run ``tasks`` as one Spark job in the FAIR pool ``pool``; one task per
    Spark partition; admitted through the session's :class:`JobGate`.
    Cancellable with ``sc.cancelJobGroup(group)``. ``progress`` learns of each
    task as it finishes.

    A small job (at most ``share_up_to`` records, no progress to show) runs
    instead in one Spark job with the small jobs of other sources waiting at
    the same time (:meth:`JobGate.shared`), in the pool ``reclock-shared``:
    a Spark job costs about as much to start as a small one takes to run, so
    a hundred sources at one interval would otherwise queue for Spark. Each
    source still gets its own tasks' results and commits them itself.
    :func:`cancel_jobs` cancels a source's jobs, a shared one too (the others
    in it read again, as they do when a task's Python worker dies)."""
    if not tasks:
        return []
    sc = spark.sparkContext
    gate = _gate(sc)
    if progress is None and 0 < sum(t.records for t in tasks) <= share_up_to:
        req = _Shared(ctx, tasks, group)
        gate.shared(req, partial(_run_shared_job, sc))
        if req.error is not None:
            raise req.error
        return req.results
    with gate:
        return _run_job(sc, ctx, tasks, pool, group, progress)


SHARED_POOL = "reclock-shared"

#: running shared jobs: the job group of each source in one -> the job's group
_in_shared: dict[str, str] = {}
_in_shared_lock = threading.Lock()


def cancel_jobs(sc: Any, group: str) -> None:
    """Cancel the jobs of the source whose job group is ``group``: its own,
    and a shared job its small job runs in (the other sources in that one
    read again)."""
    with _in_shared_lock:
        shared = _in_shared.get(group)
    sc.cancelJobGroup(group)
    if shared is not None:
        sc.cancelJobGroup(shared)


def _run_shared_job(sc: Any, batch: list[_Shared]) -> None:
    """The tasks of several sources' small jobs as one Spark job; each
    request gets its own tasks' results (or the job's error)."""
    group = f"{SHARED_POOL}-{uuid.uuid4().hex[:8]}"
    with _in_shared_lock:
        _in_shared.update({r.group: group for r in batch})
    try:
        items = [(i, t) for i, r in enumerate(batch) for t in r.tasks]
        out: list[tuple[int, TaskResult]] = _spark_job(
            sc, SHARED_POOL, group, "reclock " + ", ".join(r.ctx.source for r in batch),
            tuple(r.ctx for r in batch), items,
            min(len(items), max(2, 2 * int(sc.defaultParallelism))),
            lambda bc: partial(_run_shared_partition, bc))
        for i, res in out:
            res.shared = len(batch)
            batch[i].results.append(res)
        for r in batch:
            r.results.sort(key=lambda res: res.task)
    except BaseException as exc:  # the job failed: every source in it reads again
        for r in batch:
            r.error = exc
    finally:
        with _in_shared_lock:
            for r in batch:
                if _in_shared.get(r.group) == group:
                    del _in_shared[r.group]


def _run_shared_partition(bc: Any, items: Iterable[tuple[int, ReadTask]]
                          ) -> Iterator[tuple[int, TaskResult]]:
    """Tasks of several sources: an error of one source's task is its own
    result, never the job's (the other sources' tasks go on)."""
    _freeze_worker_heap()
    ctxs: tuple[JobContext, ...] = bc.value
    for i, task in items:
        try:
            res = run_task(ctxs[i], task)
        except Exception as exc:
            res = TaskResult(task.index, error=classify(exc))
        faults.kill_worker_point(len(ctxs))  # (a rehearsed worker death, see faults)
        yield i, res


def _run_job(sc: Any, ctx: JobContext, tasks: Sequence[ReadTask], pool: str, group: str,
             progress: TaskProgress | None) -> list[TaskResult]:
    acc = None if progress is None else progress.accumulator(sc)
    results: list[TaskResult] = _spark_job(
        sc, pool, group, f"reclock {ctx.source} {ctx.batch_id}", ctx, list(tasks), len(tasks),
        lambda bc: partial(_run_partition, bc, acc))
    return sorted(results, key=lambda r: r.task)


def _spark_job(sc: Any, pool: str, group: str, description: str, shared: Any,
               items: list[Any], slices: int, run: Callable[[Any], Any]) -> list[Any]:
    """One Spark job in the FAIR pool ``pool`` under the job group ``group``:
    ``shared`` broadcast once (destroyed after), ``items`` in ``slices``
    partitions, each partition run by ``run(broadcast)``; what they yield."""
    sc.setLocalProperty("spark.scheduler.pool", pool)
    sc.setJobGroup(group, description, True)
    bc = sc.broadcast(shared)
    try:
        return list(sc.parallelize(items, slices).mapPartitions(run(bc)).collect())
    finally:
        with contextlib.suppress(Exception):  # best effort, also on shutdown
            bc.destroy()


def run_local(ctx: JobContext, tasks: Sequence[ReadTask],
              progress: TaskProgress | None = None) -> list[TaskResult]:
    """The same tasks in this process (tests of the task logic, `reclock verify`)."""
    results = []
    for t in tasks:
        res = run_task(ctx, t)
        results.append(res)
        if progress is not None:
            progress.finished(t.index, res.records)
    return results
