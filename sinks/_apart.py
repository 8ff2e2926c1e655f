"""Heavy, occasional work in a short-lived child process, so that the memory
it needed goes back to the system when the child ends.

A compaction pass merges hundreds of small Parquet files through Arrow, and
a checkpoint, an expiry or the choice of files to compact loads a whole
Delta table with delta-rs. Run in the driver, such work leaves the driver's
allocators holding what it freed: Arrow's mimalloc heaps of the I/O and
CPU pool threads that decoded the batches (a page freed by another thread
waits for its owner's next allocation), glibc's arenas, delta-rs's
jemalloc and its blocking threads. With this work in the driver,
``bench/soak.py`` shows the driver's resident set rise by 5-10 MiB at each
pass and only partly come back, hour after hour, delta-rs's memory grow with
its loads (+6 MiB/h) and its threads swing from 16 to 44. Handing memory back
(``reclock.runtime.memory``) reaches only part of it.

:func:`run_apart` calls a module-level function in a fresh child and returns
its result (or raises its exception, which pickles with its class and hint)::

    driver thread --Process.start--> forkserver --fork--> child: fn(*args)
          ^                         (started once,           |
          +------ result or exception, over a pipe ----------+  then exits
                                     reclock.sinks.delta preloaded: a fork costs milliseconds)

Children come from a fork server started at the first call (a clean
process, not a fork of the threaded driver), at most :data:`WORKERS` at a
time; each runs one call and exits, and none waits idle between calls (the
fork server itself stays: about 23 MiB of proportional set, 5 MiB of it
private, measured beside a soak). A child that dies (killed, out of memory)
fails the call with a :class:`~reclock.core.errors.TransientError`: the
caller's pass fails and is retried on its schedule, and the driver lives
on. If the driver dies first, the fork server sees its pipe close and
exits, and a child is ended with the driver (daemonic); what a child wrote
then is an orphaned file the sink's vacuum removes.

Where the platform has no ``fork`` (or ``RECLOCK_IN_PROCESS=1`` is set)
the call runs in the caller's process.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from reclock.core.errors import ReclockError, TransientError

_R = TypeVar("_R")

#: children running at once (maintenance of different outputs)
WORKERS = 2

#: modules the fork server imports once, so that each child starts with
#: them. (Before the call a child also imports the main script again, as
#: multiprocessing's spawn does -- the ``reclock`` command's script costs
#: 3 ms, ``python -m`` mains none; a script importing pytest took 150 ms.
#: Preloading ``__main__`` does not help on Python 3.11: its fork server
#: is never given the main script's path.)
PRELOAD = ["reclock.sinks.delta"]

_lock = threading.Lock()
_slots = threading.BoundedSemaphore(WORKERS)
_context: Any = None


def available() -> bool:
    """Whether calls run in a child (see the module docstring)."""
    return (os.environ.get("RECLOCK_IN_PROCESS") != "1"
            and "forkserver" in multiprocessing.get_all_start_methods())


def _ctx() -> Any:
    global _context
    with _lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            _context = ctx
        return _context


def _child(send: Connection, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """In the child: run the call and send ``(True, result)`` or ``(False,
    exception)``. Ctrl-C in a terminal signals the whole process group, and
    stopping is the driver's to decide, so the child ignores SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        out: tuple[bool, Any] = (True, fn(*args))
    except BaseException as exc:  # sent back whole, raised in the caller
        out = (False, exc)
    try:
        send.send(out)
    except Exception as exc:  # an unpicklable result or exception
        send.send((False, ReclockError(f"{type(exc).__name__}: {exc} (from {out[1]!r})")))
    finally:
        send.close()


def run_apart(fn: Callable[..., _R], /, *args: Any, what: str = "work") -> _R:
    """``fn(*args)`` in a child process (``fn`` and the arguments pickled,
    so ``fn`` is a module-level function); its result, or its exception.
    ``what`` names the work in the error a dead child gives."""
    if not available():
        return fn(*args)
    ctx = _ctx()
    with _slots:
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(send, fn, args), daemon=True,
                           name="reclock-apart")
        try:
            proc.start()
        finally:
            send.close()
        try:
            ok, value = recv.recv()
        except EOFError:
            proc.join()
            raise TransientError(
                f"{what}: the child process running it ended abruptly "
                f"(exit code {proc.exitcode})",
                hint="it is retried later; if it keeps failing, check the machine's memory "
                     "(a child killed for memory) and the driver's log") from None
        finally:
            recv.close()
        proc.join()
    if ok:
        return value  # type: ignore[no-any-return]
    raise value
