"""What the driver holds of a day of bindings, and what a tick costs then.

A SQLite remap store (a file) is seeded with ``--bindings`` counter bindings
one second apart (default 86,400: a day of a 1 s source, which the default
``remap_retention`` keeps), as a driver finds it when it restarts. A remap
operator opens the shard and ticks ``--ticks`` times, a binding per tick, on
a clock one second further each time. Two variants, each in processes of
its own:

* ``holds what it reads``: after each tick the operator forgets the bindings
  before where the outputs resume (here: they have caught up), as the driver
  does (``RemapOperator.hold_from``);
* ``holds the retained history``: it does not (for comparison).

Columns: the Python memory the operator's bindings take after the ticks
(``tracemalloc`` from before the open, after a collection; a run of its own,
as tracing slows every allocation), the bindings it holds, and the CPU
milliseconds per tick (untraced).

Run: ``python bench/held_bindings_bench.py`` (about a minute).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_bench import table

VARIANTS = {"holds what it reads": True, "holds the retained history": False}


def measure(hold: bool, count: int, ticks: int, traced: bool) -> dict[str, float]:
    """In this process: seed ``count`` bindings, open, tick ``ticks`` times."""
    from reclock.core.bindings import Binding
    from reclock.core.clock import ManualClock
    from reclock.core.frontier import Antichain
    from reclock.core.mint import RemapOperator
    from reclock.core.time import Counter, IntoTime
    from reclock.registry import open_store

    with tempfile.TemporaryDirectory() as d:
        store = open_store(f"sqlite:///{d}/remap.db")
        store.create_shard("c", "counter")
        t0 = 1_000_000_000
        upper = Antichain.from_elem(IntoTime(0))
        for lo in range(0, count, 5000):
            batch = [Binding(IntoTime(t0 + 1000 * i), Antichain.from_elem(Counter(i)))
                     for i in range(lo, min(count, lo + 5000))]
            new = Antichain.from_elem(IntoTime(int(batch[-1].time) + 1))
            store.compare_and_append("c", batch, upper, new)
            upper = new
        clock = ManualClock(t0 + 1000 * count)
        gc.collect()
        if traced:
            tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0] if traced else 0
        op = RemapOperator(store, "c", "counter", initial_frontier=Antichain.from_elem(Counter(0)),
                           clock=clock)
        cpu = 0.0
        for i in range(ticks):
            clock.advance(1000)
            c0 = time.process_time()
            b = op.mint(Antichain.from_elem(Counter(count + i)))
            if hold:  # the outputs caught up: they resume at the remap upper
                op.hold_from(int(b.upper.elements[0]))
            cpu += time.process_time() - c0
        gc.collect()
        out = {"bindings": len(op.bindings), "retained": op.retained,
               "ms_per_tick": 1000 * cpu / ticks}
        if traced:
            out["held_mib"] = (tracemalloc.get_traced_memory()[0] - base) / 2**20
            tracemalloc.stop()
        store.close()
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bindings", type=int, default=86_400)
    ap.add_argument("--ticks", type=int, default=300)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant is not None:
        ticks = min(args.ticks, 30) if args.traced else args.ticks
        print(json.dumps(measure(VARIANTS[args.variant], args.bindings, ticks, args.traced)))
        return 0
    rows = []
    for name in VARIANTS:
        m: dict[str, float] = {}
        for traced in (True, False):
            res = subprocess.run([sys.executable, __file__, "--variant", name, "--bindings",
                                  str(args.bindings), "--ticks", str(args.ticks),
                                  *(["--traced"] if traced else [])],
                                 check=True, capture_output=True, text=True, env=os.environ)
            m.update(json.loads(res.stdout.strip().splitlines()[-1]))
        rows.append([name, f"{m['held_mib']:.1f}", f"{m['bindings']:,.0f} of {m['retained']:,.0f}",
                     f"{m['ms_per_tick']:.2f}"])
    print(table(f"{args.bindings:,} retained counter bindings (SQLite store), then "
                f"{args.ticks:,} ticks", ["variant", "Python MiB held", "bindings held",
                                          "CPU ms/tick"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
