"""Compaction benchmark: reading and committing to a day-old file output, before
and after its small files are compacted.

An output commits every ``timestamp_interval`` (1 s by default), one small
Parquet file per commit. This synthesizes such a table quickly: ``--files``
small files (86,400 by default: a day of 1 s intervals), each holding
``--rows`` rows of one second's IntoTime, staged through the Delta sink's own
stager (in ``--stagers`` threads) and committed through ``DeltaSink.commit``
``--files-per-commit`` at a time (a commit per file would take hours to
synthesize; what readers pay for is the number of files, and the log is
checkpointed every 100 versions either way). Then, on the same table:

* **before**: a full read (``DeltaSink.read_updates()``, what ``reclock read``,
  ``verify`` and an upsert output's restart read), two as-of reads
  (``read_updates(as_of)``: the first hour, and up to noon), the state read
  of a driver's start (``state()``), and the commit time of one more small
  file (``DeltaSink.commit``: load, state check, commit, housekeeping);
* **compaction**: ``DeltaSink.compact`` passes as the driver runs them (at most
  5,000 files each) until nothing is left to merge: passes, total and
  longest pass (the source's tick waits that long), bytes in and out;
* **after**: the same reads and commits (the merged files' remove actions are
  still in the log until the retention passes), and again after
  ``expire_removed`` deleted the merged files and a checkpoint.

Reads and the state are the best of ``--repeat`` runs, each with a new sink
(every call loads the table, as every ``reclock read`` does); commit times are
the median of ``--commits`` commits. The rows read back are checked to be the
same before and after (count and sum of offsets); a mismatch exits 1.

Run: ``python bench/compaction_bench.py`` (about 20 minutes on 2 cores: 7 to
synthesize the table, most of the rest reading it before compaction) or
``--files 20000`` (about 3 minutes).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_bench import table

from reclock.contracts.rows import output_schema
from reclock.contracts.sink import SinkState
from reclock.sinks.delta import COMPACT_MAX_FILES, COMPACT_TARGET_SIZE, DeltaSink

NAME = "bench.day"
T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z: the day's first IntoTime
USER = pa.schema([("id", pa.int64()), ("customer", pa.string()), ("amount", pa.float64()),
                  ("note", pa.string())])


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def second(i: int, rows: int) -> pa.Table:
    """The rows one commit of second ``i`` writes: IntoTime ``T0 + i s``."""
    n0 = i * rows
    ids = list(range(n0, n0 + rows))
    schema = output_schema(USER)
    cols: dict[str, Any] = {
        "id": ids, "customer": [f"c{n % 997}" for n in ids],
        "amount": [(n % 10_000) / 100 for n in ids], "note": [f"order {n} of the day" for n in ids],
        "_into_time": [T0 + 1000 * i] * rows, "_diff": [1] * rows, "_src_part": [0] * rows,
        "_src_offset": ids, "_src_seq": [0] * rows, "_src_ts": [T0 + 1000 * i] * rows,
        "_error": [None] * rows, "_raw_key": [None] * rows, "_raw_value": [None] * rows,
    }
    return pa.table({f.name: pa.array(cols[f.name], f.type) for f in schema}, schema=schema)


def synthesize(path: Path, files: int, rows: int, per_commit: int, stagers: int) -> DeltaSink:
    sink = DeltaSink(NAME, path, compaction=None)
    sink.ensure(USER)
    stager = sink.stager()
    state = SinkState()
    t0 = time.monotonic()
    with ThreadPoolExecutor(stagers) as pool:
        for start in range(0, files, per_commit):
            seconds = range(start, min(files, start + per_commit))
            staged = [d for ds in pool.map(
                lambda i: stager.stage(f"s{i}", 0, second(i, rows)), seconds) for d in ds]
            new = SinkState(T0 + 1000 * seconds[-1] + 1000,
                            f'[{{"o":{rows * seconds[-1] + rows}}}]')
            sink.commit(staged, state, new)
            state = new
            if (start // per_commit) % 50 == 49:
                done = start + per_commit
                log(f"  {done:,} files committed, {time.monotonic() - t0:.0f} s")
    log(f"synthesized {files:,} files of {rows} rows in {time.monotonic() - t0:.0f} s")
    return sink


def best(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """The least time of ``repeat`` runs of ``fn`` (one run when it takes
    over 10 s: the many-files reads), and what it returned."""
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
        if times[-1] > 10:
            break
    return min(times), out


def measure(path: Path, label: str, rows: int, repeat: int, commits: int,
            nth: int) -> tuple[list[Any], tuple[int, int, int]]:
    """One row of the table: reads, state and commits on the table as it is."""
    def fresh() -> DeltaSink:
        return DeltaSink(NAME, path)

    full_s, full = best(lambda: fresh().read_updates(), repeat)
    hour_s, hour = best(lambda: fresh().read_updates(T0 + 3_599_999), repeat)
    noon_s, noon = best(lambda: fresh().read_updates(T0 + 43_199_999), repeat)
    state_s, _ = best(lambda: fresh().state(), repeat)
    sink = fresh()
    st = sink.state()
    took = []
    for k in range(commits):
        i = nth + k
        staged = sink.stager().stage(f"x{i}", 0, second(i, rows))
        new = SinkState((st.upper or 0) + 1000, st.progress)
        t = time.perf_counter()
        sink.commit(staged, st, new)
        took.append(time.perf_counter() - t)
        st = new
    files = len(sink._load().file_uris())
    check = (full.num_rows, hour.num_rows, noon.num_rows)
    return ([label, f"{files:,}", f"{full.num_rows:,}", f"{full_s:.2f}", f"{hour_s:.2f}",
             f"{noon_s:.2f}", f"{state_s * 1000:,.0f}", f"{statistics.median(took) * 1000:,.0f}"],
            check)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=86_400, help="small files (one per second)")
    ap.add_argument("--rows", type=int, default=10, help="rows per small file")
    ap.add_argument("--files-per-commit", type=int, default=100)
    ap.add_argument("--stagers", type=int, default=4, help="threads staging the small files")
    ap.add_argument("--target-size", type=int, default=COMPACT_TARGET_SIZE)
    ap.add_argument("--repeat", type=int, default=3, help="runs per read (best is shown)")
    ap.add_argument("--commits", type=int, default=9, help="commits timed per row (median)")
    ap.add_argument("--dir", default=None, help="where the table goes (default: a temp dir)")
    args = ap.parse_args(argv)

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="compaction-bench-"))
    path = base / "day"
    shutil.rmtree(path, ignore_errors=True)
    rc = 0
    try:
        sink = synthesize(path, args.files, args.rows, args.files_per_commit, args.stagers)
        rows = []
        # The timed commits write seconds long after the day: the as-of reads
        # (first hour, up to noon) read the same rows every time.
        row, before = measure(path, "before compaction", args.rows, args.repeat, args.commits,
                              10**6)
        rows.append(row)
        log("measured before; compacting")
        passes, longest, removed, added, bytes_in, bytes_out = 0, 0.0, 0, 0, 0, 0
        t0 = time.perf_counter()
        while True:
            t = time.perf_counter()
            done = sink.compact(args.target_size, 2, COMPACT_MAX_FILES)
            if not done:
                break
            longest = max(longest, time.perf_counter() - t)
            passes += 1
            removed += done["files_removed"]
            added += done["files_added"]
            bytes_in += done["bytes_removed"]
            bytes_out += done["bytes_added"]
            log(f"  pass {passes}: {done['files_removed']:,} files -> {done['files_added']}, "
                f"{time.perf_counter() - t:.1f} s")
        total = time.perf_counter() - t0
        row, after = measure(path, "after compaction", args.rows, args.repeat, args.commits,
                             10**6 + args.commits)
        rows.append(row)
        t = time.perf_counter()
        expired = DeltaSink(NAME, path).expire_removed(0)
        DeltaSink(NAME, path)._housekeep(DeltaSink(NAME, path)._load(), checkpoint=True)
        expire_s = time.perf_counter() - t
        row, expired_check = measure(path, "after expiry", args.rows, args.repeat,
                                     args.commits, 10**6 + 2 * args.commits)
        rows.append(row)
        header = ["table", "files", "rows", "full read s", "as of 1st hour s", "as of noon s",
                  "state ms", "commit ms"]
        print(table(f"Day-old output: {args.files:,} files of {args.rows} rows "
                    f"({args.files_per_commit} per commit)", header, rows))
        print()
        print(table("Compaction", ["passes", "files in", "files out", "MB in", "MB out",
                                   "total s", "longest pass s", "expiry s (files)"],
                    [[passes, f"{removed:,}", added, f"{bytes_in / 1e6:,.1f}",
                      f"{bytes_out / 1e6:,.1f}", f"{total:.1f}", f"{longest:.1f}",
                      f"{expire_s:.1f} ({len(expired):,})"]], left=()))
        print()
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, "
              f"{platform.python_implementation()} {platform.python_version()}, {base}")
        extra = args.commits * args.rows  # rows committed by the "before" measurement
        hour, noon = (min(n, args.files) * args.rows for n in (3600, 43_200))
        if (before != (args.files * args.rows, hour, noon)
                or after != (before[0] + extra, hour, noon)
                or expired_check != (after[0] + extra, hour, noon)):
            print(f"MISMATCH: rows before {before}, after {after}, after expiry {expired_check}")
            rc = 1
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
