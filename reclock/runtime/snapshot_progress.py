"""Snapshot progress: per output, how many rows of its initial snapshot were
read so far, and how many it holds (as Materialize's
``snapshot_records_staged`` and ``snapshot_records_known``).

Where the numbers come from::

    source.open()        decides to take a snapshot for outputs that hold nothing
    source.snapshot_sizes()   rows per output: an estimate, then an exact count
    source.plan()        the job reaching the snapshot's point: chunk tasks,
                         each marked ReadTask.snapshot = its output
    Spark                each finished chunk task adds its records to the
                         job's TaskProgress (an accumulator), while the job runs
    Committer.commit()   the job committed: the outputs hold their snapshots;
                         the rows read are final, and they are the total

The status entry of an output (``outputs[].snapshot`` in the status
document; ``null`` when the output takes no snapshot in this run)::

    {"table": "public.orders", "rows_read": 120000, "rows_total": 1000000,
     "exact": true, "done": false}

``rows_total`` is ``null`` while unknown; ``exact`` is false while it is an
estimate (it then never shows less than ``rows_read``). Rows read only count
tasks that finished: a chunk being read counts once it is done, and a job
that fails (and is read again) starts from 0 again. Once ``done``,
``rows_read == rows_total`` for the rest of the run.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from reclock.contracts.source import ReadTask, SnapshotSize

if TYPE_CHECKING:  # (the data plane's imports are heavy: reclock status needs none)
    from reclock.runtime.dataplane import TaskProgress, TaskResult


class SnapshotProgress:
    """One source's snapshot progress (see the module docstring). The driver
    calls :meth:`submitted`, :meth:`committed` and :meth:`abandoned` from the
    source's loop; :meth:`status` may be called from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: jobs in flight that read snapshot chunks: ((task index, output), ...)
        self._running: list[tuple[tuple[tuple[int, int], ...], TaskProgress]] = []
        #: outputs whose snapshot was committed: (rows, table)
        self._done: dict[int, tuple[int, str]] = {}

    def submitted(self, tasks: Sequence[ReadTask]) -> TaskProgress | None:
        """A job of ``tasks`` is about to run: its progress to follow, when
        it reads snapshot chunks (None: it does not)."""
        chunks = tuple((t.index, t.snapshot) for t in tasks if t.snapshot is not None)
        if not chunks:
            return None
        from reclock.runtime.dataplane import TaskProgress

        progress = TaskProgress()
        with self._lock:
            self._running.append((chunks, progress))
        return progress

    def committed(self, progress: TaskProgress | None, results: Sequence[TaskResult],
                  sizes: Mapping[int, SnapshotSize]) -> None:
        """The job followed by ``progress`` committed: its outputs hold their
        snapshots, of the rows its chunk tasks read (``results``)."""
        if progress is None:
            return
        with self._lock:
            job = next((j for j in self._running if j[1] is progress), None)
            if job is None:
                return
            self._running.remove(job)
            records = {r.task: r.records for r in results}
            for out, rows in _per_output(job[0], records).items():
                size = sizes.get(out)
                self._done[out] = (rows, size.table if size is not None else "")

    def abandoned(self) -> None:
        """No job is in flight any more (a job failed, or was discarded):
        what uncommitted jobs read no longer counts."""
        with self._lock:
            self._running.clear()

    def status(self, sizes: Mapping[int, SnapshotSize]) -> dict[int, dict[str, Any]]:
        """Per output with a snapshot in this run, its status entry;
        ``sizes``: the source's :meth:`~reclock.contracts.source.Source.snapshot_sizes`."""
        with self._lock:
            done = dict(self._done)
            running = [(chunks, p.done()) for chunks, p in self._running]
        read: dict[int, int] = {}
        for chunks, finished in running:
            for i, rows in _per_output(chunks, finished).items():
                read[i] = read.get(i, 0) + rows
        out: dict[int, dict[str, Any]] = {}
        for i, (rows, table) in done.items():
            out[i] = entry(table, rows, rows, True, True)
        for i in sorted((set(sizes) | set(read)) - set(done)):
            size = sizes.get(i, SnapshotSize(None, False))
            n = read.get(i, 0)
            total = size.rows
            if total is not None and not size.exact:
                total = max(total, n)  # an estimate below what was read says little
            out[i] = entry(size.table, n, total, size.exact and total is not None, False)
        return out


def _per_output(chunks: Sequence[tuple[int, int]], records: Mapping[int, int]
                ) -> dict[int, int]:
    """Records of the finished chunk tasks, summed per output (every output
    with a chunk appears, with 0 when none finished)."""
    out: dict[int, int] = {}
    for task, output in chunks:
        out[output] = out.get(output, 0) + int(records.get(task, 0))
    return out


def entry(table: str, read: int, total: int | None, exact: bool, done: bool
          ) -> dict[str, Any]:
    """One output's snapshot status entry (see the module docstring)."""
    return {"table": table, "rows_read": read, "rows_total": total, "exact": exact,
            "done": done}


def describe(output: str, snap: Mapping[str, Any] | None) -> str | None:
    """The line ``reclock status`` prints for an output's snapshot while it is
    read (None: no snapshot, or done): ``snapshot orders: 120,000 of
    1,000,000 rows (12%)``; an estimated total reads ``of ~1,000,000``."""
    if not snap or snap.get("done"):
        return None
    read = int(snap.get("rows_read") or 0)
    total = snap.get("rows_total")
    if total is None:
        return f"snapshot {output}: {read:,} rows read (total not known yet)"
    total = int(total)
    pct = 100 if total <= 0 else min(100, read * 100 // total)
    approx = "" if snap.get("exact") else "~"
    return f"snapshot {output}: {read:,} of {approx}{total:,} rows ({pct}%)"
