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


def test_an_idle_release_runs_once_per_period_across_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    done: list[float] = []
    monkeypatch.setattr(memory, "_release", lambda: done.append(time.monotonic()))
    monkeypatch.setattr(memory, "_last", time.monotonic() - 10)
    assert memory.release_if_idle(5.0)
    assert not memory.release_if_idle(5.0)  # just done: not due
    import threading

    outcomes: list[bool] = []
    monkeypatch.setattr(memory, "_last", time.monotonic() - 10)
    threads = [threading.Thread(target=lambda: outcomes.append(memory.release_if_idle(5.0)))
               for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == [False] * 15 + [True] and len(done) == 2
    # A release after a compaction pass counts: the idle one waits its period.
    monkeypatch.setattr(memory, "_last", time.monotonic() - 10)
    assert memory.release_free_memory()
    assert not memory.release_if_idle(5.0) and len(done) == 3


def _mimalloc_options(env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Import reclock in a fresh interpreter with ``env``: the options Arrow's
    mimalloc printed when it loaded (MIMALLOC_VERBOSE), and the MIMALLOC_
    variables left for child processes."""
    import json
    import os
    import subprocess
    import sys

    code = ("import os, json, reclock, pyarrow as pa\n"
            "assert pa.default_memory_pool().backend_name == 'mimalloc'\n"
            "print(json.dumps(sorted(k for k in os.environ if k.startswith('MIMALLOC_'))))")
    full = {k: v for k, v in os.environ.items()
            if not k.startswith("MIMALLOC_") and k not in ("PYTHON_WORKER_FACTORY_SECRET",
                                                           "RECLOCK_ARROW_ALLOCATOR")}
    full.update(env, MIMALLOC_VERBOSE="1")
    r = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                       text=True, timeout=120, check=True)
    opts = {}
    for line in r.stderr.splitlines():
        if line.startswith("option '"):
            name, _, value = line[len("option '"):].partition("':")
            opts[name] = value.strip()
    return opts, json.loads(r.stdout.strip().splitlines()[-1])


def test_the_driver_sets_arrows_pool_to_hand_freed_pages_back_and_children_do_not_inherit() -> None:
    opts, left = _mimalloc_options({})
    assert opts["purge_delay"] == "0" and opts["arena_eager_commit"] == "0", opts
    assert left == ["MIMALLOC_VERBOSE"]  # ours were removed once pyarrow loaded


def test_spark_workers_and_users_settings_keep_their_allocator_options() -> None:
    worker, _ = _mimalloc_options({"PYTHON_WORKER_FACTORY_SECRET": "x"})
    assert worker["purge_delay"] == "1000" and worker["arena_eager_commit"] != "0", worker
    opted_out, _ = _mimalloc_options({"RECLOCK_ARROW_ALLOCATOR": "default"})
    assert opted_out["purge_delay"] == "1000", opted_out
    user, left = _mimalloc_options({"MIMALLOC_PURGE_DELAY": "250"})
    assert user["purge_delay"] == "250" and user["arena_eager_commit"] == "0", user
    assert left == ["MIMALLOC_PURGE_DELAY", "MIMALLOC_VERBOSE"]  # the user's stays
