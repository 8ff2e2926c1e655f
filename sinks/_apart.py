"""Heavy, occasional work in a short-lived child process, so that the memory
it needed goes back to the system when the child ends.

A compaction pass merges hundreds of small Parquet files through Arrow. Run
in the driver, it leaves the driver's allocators holding what the pass
freed: Arrow's mimalloc heaps of the I/O and CPU pool threads that decoded
the batches (a page freed by another thread waits for its owner's next
allocation), glibc's arenas, delta-rs's jemalloc. ``bench/soak.py`` saw the
driver's resident set rise by 5-10 MiB at each pass and only partly come
back, hour after hour. Handing memory back (``reclock.runtime.memory``)
reaches only part of it.

:func:`run_apart` calls a module-level function in a fresh child and returns
its result (or raises its exception, which pickles with its class and hint)::

    driver thread --submit--> pool (forkserver context, one task a child)
                                 |
                 forkserver  --fork-->  child: fn(*args) -> result, exits
    (started once; sinks.delta preloaded, so a fork costs milliseconds)

Children come from a fork server started once (a clean process, not a fork
of the threaded driver), at most :data:`WORKERS` at a time; each runs one
call and exits. A child that dies (killed, out of memory) fails the call
with a :class:`~reclock.core.errors.TransientError` and the pool is made
anew: the caller's pass fails and is retried on its schedule, and the
driver lives on. If the driver dies first, the fork server sees its pipe
close and exits; what a child wrote then is an orphaned file the sink's
vacuum removes.

Where the platform has no ``fork`` (or ``RECLOCK_IN_PROCESS=1`` is set)
the call runs in the caller's process.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from reclock.core.errors import TransientError

_R = TypeVar("_R")

#: children running at once (merges of different outputs)
WORKERS = 2

#: modules the fork server imports once, so that each child starts with them
PRELOAD = ["sinks.delta"]

_lock = threading.Lock()
_pool: ProcessPoolExecutor | None = None


def available() -> bool:
    """Whether calls run in a child (see the module docstring)."""
    return (os.environ.get("RECLOCK_IN_PROCESS") != "1"
            and "forkserver" in multiprocessing.get_all_start_methods())


def _get_pool() -> ProcessPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            _pool = ProcessPoolExecutor(max_workers=WORKERS, mp_context=ctx,
                                        initializer=_child_start, max_tasks_per_child=1)
        return _pool


def _child_start() -> None:
    """In each child: Ctrl-C in a terminal signals the whole process group,
    and stopping is the driver's to decide (it lets work in flight finish
    or abandons it), so a child ignores SIGINT rather than raising
    KeyboardInterrupt into the driver's thread that waits for it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _discard(pool: ProcessPoolExecutor) -> None:
    global _pool
    with _lock:
        if _pool is pool:
            _pool = None
    pool.shutdown(wait=False, cancel_futures=True)


def run_apart(fn: Callable[..., _R], /, *args: Any, what: str = "work") -> _R:
    """``fn(*args)`` in a child process (``fn`` and the arguments pickled,
    so ``fn`` is a module-level function); its result, or its exception.
    ``what`` names the work in the error a dead child gives."""
    if not available():
        return fn(*args)
    pool = _get_pool()
    try:
        return pool.submit(fn, *args).result()
    except BrokenProcessPool as exc:
        _discard(pool)
        raise TransientError(
            f"{what}: the child process running it ended abruptly ({exc})",
            hint="it is retried later; if it keeps failing, check the machine's memory "
                 "(a child killed for memory) and the driver's log") from exc


def shutdown() -> None:
    """Stop the pool (children in flight finish first). A later call starts
    a new one."""
    global _pool
    with _lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True)
