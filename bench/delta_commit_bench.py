"""One output's Delta commits, the way a pipeline makes them each tick: stage
a small batch (what an executor does), then commit it with the new state.
Side by side, alternating in rounds on tables of their own:

* ``reclock log entry`` -- the sink writes the append's log entry itself
  (put-if-absent on the version after the one it committed last; see
  ``sinks/delta.py``);
* ``delta-rs`` -- delta-rs loads the table and commits (what a table with
  writer features reclock's own entries do not honour gets), forced here by
  treating every table as such.

Prints the commit's wall and CPU time (the process's, every thread, delta-rs's
own included) per commit, and the threads at the end::

    python bench/delta_commit_bench.py                 # 4 rounds of 100 commits
    python bench/delta_commit_bench.py --commits 500 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import reclock.sinks.delta as delta_mod
from reclock.contracts.sink import SinkState
from reclock.sinks.delta import DeltaSink
from tests.sinks.rows import USER, updates


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(root: Path, label: str, commits: int, rows: int) -> tuple[float, float]:
    """``commits`` stage-and-commit rounds on a new table: (wall, CPU) ms per commit."""
    sink = DeltaSink("bench", root / label.replace(" ", "-") / str(time.monotonic_ns()))
    sink.ensure(USER)
    state = sink.state()
    wall = cpu = 0.0
    for i in range(commits):
        keys = [f"key-{i}-{j}" for j in range(rows)]
        staged = sink.stager().stage(f"b{i}", 0, updates(keys, i, offset=i * rows))
        new = SinkState(i + 1, f"p{i}")
        w0, c0 = time.perf_counter(), cpu_s()
        sink.commit(staged, state, new)
        wall += time.perf_counter() - w0
        cpu += cpu_s() - c0
        state = new
    assert DeltaSink("bench", sink.path).state() == state
    return wall / commits * 1000, cpu / commits * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commits", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--rows", type=int, default=20, help="rows per commit")
    args = ap.parse_args()
    real = delta_mod._direct_ok
    results: dict[str, list[tuple[float, float]]] = {"reclock log entry": [], "delta-rs": []}
    with tempfile.TemporaryDirectory(prefix="delta-commit-") as tmp:
        for _ in range(args.rounds):
            for label in results:
                delta_mod._direct_ok = real if label == "reclock log entry" else (
                    lambda dt: False)
                results[label].append(run(Path(tmp), label, args.commits, args.rows))
        delta_mod._direct_ok = real
    print(f"\n{args.rounds} rounds of {args.commits} commits of {args.rows} rows each "
          f"(checkpoint every {delta_mod.CHECKPOINT_INTERVAL}), alternating; "
          f"{os.cpu_count()} CPUs")
    print("| commit | wall ms/commit (median round) | CPU ms/commit, all threads | ratio |")
    print("|---|---|---|---|")
    med = {k: sorted(v)[len(v) // 2] for k, v in results.items()}
    base = med["delta-rs"][1]
    for label, (wall, cpu) in med.items():
        print(f"| {label} | {wall:.1f} | {cpu:.1f} | {cpu / base:.2f}x |")
    print(f"threads at the end: {threading.active_count()} Python, "
          f"{len(os.listdir('/proc/self/task'))} in the process")
    return 0


if __name__ == "__main__":
    sys.exit(main())
