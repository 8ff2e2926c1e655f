"""What checking a key-state file at open costs.

A keyed output's key state (``state_dir/keys/SOURCE/OUTPUT.sqlite``) is
checked when a driver opens it, before it is reused: ``PRAGMA quick_check``
(see ``reclock/runtime/keystate.py``, ``SqliteKeys``). This builds a key
file of ``--keys`` keys (default 1 million; rows of an int, a text of
``--value-bytes`` characters and an int, pickled as the driver stores them),
closes it, and times, each ``--repeat`` times with the file in the
operating system's page cache (warm) and once after evicting it (cold:
fsync, then ``posix_fadvise(DONTNEED)``):

* ``open, checksum``: ``SqliteKeys(path)`` as the driver opens a file its
  last clean close left with a checksum (the CRC-32 compared, the -wal
  check, the marker read, the open mark written and checkpointed);
* ``close, checksum``: closing it (the -wal file folded in, the checksum of
  the closed file written);
* ``open, quick_check``: opening a file without a checksum (after a crash,
  or of an older version): quick_check, after reading the file ahead;
* ``open, unchecked``: opening without either check (what it cost before);
* ``quick_check``, ``integrity_check`` and ``crc32 of the file`` alone.

Run: ``python bench/keystate_check_bench.py`` (1M keys, about a minute) or
``--keys 10000000``.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reclock.runtime.keystate import SqliteKeys, canonical


def build(path: Path, keys: int, value_bytes: int) -> float:
    t0 = time.perf_counter()
    store = SqliteKeys(path)
    pad = "v" * value_bytes
    for lo in range(0, keys, 50_000):
        store.write({canonical((k,)): (k, f"{k}:{pad}"[:value_bytes], k * 7)
                     for k in range(lo, min(keys, lo + 50_000))})
        store.commit(f"m{lo}")
    store.close()
    return time.perf_counter() - t0


def evict(path: Path) -> None:
    """Drop the file's pages from the operating system's cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(path: Path, cold: bool, step: Callable[[], object]) -> float:
    if cold:
        evict(path)
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def open_summed(path: Path, cold: bool) -> float:
    store: list[SqliteKeys] = []
    took = timed(path, cold, lambda: store.append(SqliteKeys(path)))
    assert store[0].discarded is None and store[0].marker is not None
    store[0].close()
    return took


def close_summed(path: Path, cold: bool) -> float:
    store = SqliteKeys(path)
    return timed(path, cold, store.close)


def open_quick_check(path: Path, cold: bool) -> float:
    Path(f"{path}.sum").unlink()
    return open_summed(path, cold)


def open_unchecked(path: Path, cold: bool) -> float:
    check, summed = SqliteKeys._check, SqliteKeys._summed
    SqliteKeys._check = lambda self: None  # type: ignore[method-assign]
    SqliteKeys._summed = lambda self: False  # type: ignore[method-assign]
    try:
        return open_summed(path, cold)
    finally:
        SqliteKeys._check, SqliteKeys._summed = check, summed  # type: ignore[method-assign]


def alone(fn: Callable[[Path], None]) -> Callable[[Path, bool], float]:
    return lambda path, cold: timed(path, cold, lambda: fn(path))


def pragma(what: str) -> Callable[[Path], None]:
    def run(path: Path) -> None:
        conn = sqlite3.connect(path)
        try:
            assert conn.execute(f"PRAGMA {what}").fetchall() == [("ok",)]
        finally:
            conn.close()
    return run


def crc(path: Path) -> None:
    h = 0
    with path.open("rb") as f:
        while b := f.read(1 << 20):
            h = zlib.crc32(b, h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--value-bytes", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None, help="where to build the file")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = Path(d) / "state.sqlite"
        built = build(path, args.keys, args.value_bytes)
        size = path.stat().st_size
        print(f"{args.keys:,} keys, {size / 2**20:.1f} MiB, built in {built:.1f} s "
              f"(sqlite {sqlite3.sqlite_version})")
        print(f"| {'what':<22} | warm median (min-max) | cold |")
        print("|---|---|---|")
        for name, fn in [("open, checksum", open_summed), ("close, checksum", close_summed),
                         ("open, quick_check", open_quick_check),
                         ("open, unchecked", open_unchecked),
                         ("quick_check", alone(pragma("quick_check"))),
                         ("integrity_check", alone(pragma("integrity_check"))),
                         ("crc32 of the file", alone(crc))]:
            fn(path, False)  # warm the cache
            warm = [fn(path, False) for _ in range(args.repeat)]
            cold = fn(path, True)
            print(f"| {name:<22} | {statistics.median(warm) * 1000:.0f} ms "
                  f"({min(warm) * 1000:.0f}-{max(warm) * 1000:.0f}) | {cold * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
