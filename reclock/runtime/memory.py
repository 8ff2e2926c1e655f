"""Handing free memory back to the operating system.

Left alone, a long-running driver's resident set grows in steps at each
compaction pass of its outputs, and not with memory in use: glibc's malloc
keeps the freed chunks of the pass in its arenas (a 12-minute
``bench/soak.py`` without releases: in use +2.4 MiB, free-but-held
+34.6 MiB). :func:`release_free_memory`
asks glibc to return them (``malloc_trim(0)`` walks every arena, not only the
main heap) and Arrow's pool to drop its cached pages. The driver calls it
after a maintenance pass that did something (``Housekeeping.maintain`` in
runtime/housekeeping.py), and otherwise :func:`release_if_idle` once every :data:`IDLE_S`: ordinary
ticks leave freed memory in glibc's arenas too (an hour of ``bench/soak.py``
with releases after compaction passes only: glibc's free-but-held memory
15 -> 73 MiB). A release costs about 5 ms with tens of MiB to hand
back, well under 0.1 ms with nothing. Housekeeping ``release_memory: false``
turns both off.

Process-wide and rate-limited: many sources compacting in one minute trim
at most once every :data:`MIN_GAP_S` (a request within the gap is done at
its end). Where glibc is not the C library (musl, macOS)
only Arrow's pool is asked.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

#: at most one release per this many seconds in the process
MIN_GAP_S = 5.0

#: with nothing else asking, a release at least this often (:func:`release_if_idle`)
IDLE_S = 60.0

_lock = threading.Lock()
_last = -MIN_GAP_S
_timer: threading.Timer | None = None


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def release_free_memory(force: bool = False) -> bool:
    """Return what the allocators hold free, now (True), or, within
    :data:`MIN_GAP_S` of the last release, once that gap has passed (False:
    a timer does it then; requests meanwhile share it). ``force``: now, in
    any case. Never raises: a failure is logged."""
    global _last, _timer
    with _lock:
        now = time.monotonic()
        wait = _last + MIN_GAP_S - now
        if not force and wait > 0:
            # Deferred, not dropped: sources compact one after another, and
            # the last (often the largest) pass would otherwise keep its memory.
            if _timer is None:
                _timer = threading.Timer(wait, _deferred)
                _timer.daemon = True
                _timer.start()
            return False
        _last = now
    _release()
    return True


def release_if_idle(idle_s: float = IDLE_S) -> bool:
    """Return what the allocators hold free if nothing did in the last
    ``idle_s`` seconds (True), else nothing (False). Cheap when not due: one
    lock and a clock read, so every source's tick may ask."""
    global _last
    with _lock:
        now = time.monotonic()
        if now - _last < idle_s:
            return False
        _last = now
    _release()
    return True


def _deferred() -> None:
    global _timer
    with _lock:
        _timer = None
    release_free_memory(force=True)


def _release() -> None:
    try:
        import pyarrow as pa

        pa.default_memory_pool().release_unused()
        trim = _malloc_trim()
        if trim is not None:
            trim(0)
    except Exception as exc:  # an optimisation; never fails the caller
        log.warning("releasing free memory failed: %s", exc)
