"""What a driver pays when its outputs resume behind many bindings of a
partitioned source: a SQLite remap store is seeded with ``--bindings``
bindings of ``--partitions`` Kafka partitions (one partition moves a
binding, as a steady source's do), then each step a driver's first tick
takes is timed and its Python memory traced: reading the shard back, the
compiled reclocking search, the last frontier, the bindings a job from the
first frontier ships and their pickle, and the bindings held once the
outputs are halfway. Issue 17's "24 h of bindings, 512 partitions" target seeds
86,400 such bindings behind outputs that never committed.

    python bench/binding_backlog_bench.py                 # 4,320 bindings, 512 partitions
    python bench/binding_backlog_bench.py --bindings 8640
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reclock.core.bindings import Binding
from reclock.core.frontier import Antichain, kafka_frontier
from reclock.core.time import IntoTime
from reclock.remap_store.sql import SqlRemapStore

MIB = 2**20


def seed(store: SqlRemapStore, n: int, parts: int) -> None:
    offsets = dict.fromkeys(range(parts), 0)
    upper = Antichain.from_elem(IntoTime(0))
    start = 10**12
    for lo in range(0, n, 2000):
        batch = []
        for i in range(lo, min(n, lo + 2000)):
            offsets[i % parts] += 1
            batch.append(Binding(IntoTime(start + i * 1000),
                                 kafka_frontier(offsets, partitions=parts)))
        new = Antichain.from_elem(IntoTime(int(batch[-1].time) + 1))
        store.compare_and_append("k", batch, upper, new)
        upper = new


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bindings", type=int, default=4320)
    ap.add_argument("--partitions", type=int, default=512)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        store = SqlRemapStore(f"sqlite:///{d}/remap.db")
        store.create_shard("k", "kafka")
        seed(store, args.bindings, args.partitions)
        tracemalloc.start()
        rows: list[tuple[str, float, float, str]] = []

        def step(label: str, f: Callable[[], Any], note: Callable[[Any], str] = lambda _: ""
                 ) -> Any:
            before = tracemalloc.get_traced_memory()[0]
            t0 = time.perf_counter()
            out = f()
            rows.append((label, (tracemalloc.get_traced_memory()[0] - before) / MIB,
                         time.perf_counter() - t0, note(out)))
            return out

        b = step("read the shard back", lambda: store.read("k"))
        step("compile the reclocking search", lambda: b._compiled,
             lambda c: f"{len(c.at):,} moves of {len(c.start):,} rows, "
                       f"{(c.at.nbytes + c.bound.nbytes) / MIB:.1f} MiB")
        step("the last frontier", lambda: b.last)
        first = b.frontier_at(int(b._times[0]))
        step("a job from the first frontier (covering)", lambda: b.covering(first),
             lambda c: f"{len(c):,} bindings")
        step("pickle it for a job", lambda: pickle.dumps(b.covering(first)),
             lambda p: f"{len(p) / MIB:.1f} MiB pickled")
        step("hold from the middle (held_from)",
             lambda: b.held_from(int(b._times[len(b) // 2])), lambda h: f"{len(h):,} bindings")
        store.close()
    print(f"\n{args.bindings:,} bindings of {args.partitions} partitions "
          "(Python memory by tracemalloc)")
    print("| step | MiB | s | |\n|---|---|---|---|")
    for label, mib, secs, note in rows:
        print(f"| {label} | {mib:+.1f} | {secs:.2f} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
