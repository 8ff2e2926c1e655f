"""Handing free memory back (reclock/runtime/memory.py): the resident set
really shrinks, and the process-wide rate limit holds."""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import pytest

from reclock.runtime import memory

pytestmark = pytest.mark.unit


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_free_memory_held_by_malloc_goes_back_to_the_system() -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # 160 MiB in chunks below the mmap threshold, touched, then freed but
    # the last: the chunk on top keeps glibc from shrinking the heap itself
    chunks = [libc.malloc(16 << 10) for _ in range(10_240)]
    assert all(chunks)
    for c in chunks:
        ctypes.memset(c, 1, 16 << 10)
    for c in chunks[:-1]:
        libc.free(c)
    held = rss_mib()
    try:
        assert memory.release_free_memory(force=True)
        after = rss_mib()
        assert held - after > 100, (held, after)
    finally:
        libc.free(chunks[-1])


def test_releases_are_rate_limited_per_process_and_deferred_not_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    done: list[float] = []
    monkeypatch.setattr(memory, "_release", lambda: done.append(time.monotonic()))
    monkeypatch.setattr(memory, "MIN_GAP_S", 0.5)
    assert memory.release_free_memory(force=True)
    t0 = time.monotonic()
    assert not memory.release_free_memory()  # within the gap: deferred
    assert not memory.release_free_memory()  # ... and shared with the first
    assert len(done) == 1
    deadline = time.monotonic() + 5
    while len(done) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert len(done) == 2 and done[1] - t0 >= 0.4  # once, at the gap's end
    assert memory._timer is None
