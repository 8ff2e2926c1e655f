"""What one mint costs the driver: ``N`` remap operators on one store, each
minting a binding per tick (a counter source that moves every interval), as
a driver of ``N`` sources does every ``timestamp_interval``.

Variants, side by side in one run (each in its own process):

* ``now``: this checkout;
* ``before``: the code of ``--before`` (default fbbeac6: every tick read the
  shard back from its last whole row, asked for ``since`` on its own, and
  built its statements anew), checked out with ``git worktree``.

Stores: SQLite (a file, the embedded default) and, when ``--pg-url`` is
given or a private cluster can be started, PostgreSQL. Columns: CPU and wall
milliseconds per tick, over ``--ticks`` ticks of every operator, after one
warm-up tick. The target (issue 17: 100 sources at a 1 s interval on 2
cores) needs minting well under 5 ms of CPU a tick.

Run: ``python bench/mint_bench.py`` (about a minute).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (a variant's process measures the code it is given, not this checkout's)
sys.path.insert(0, os.environ.get("MINT_BENCH_CODE") or str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_bench import checkout, table


def ticks(url: str, n: int, count: int) -> dict[str, float]:
    """In this process: ``n`` operators on ``url``, ``count`` ticks each."""
    from reclock.core.clock import ManualClock
    from reclock.core.frontier import Antichain
    from reclock.core.mint import RemapOperator
    from reclock.core.time import Counter
    from remap_store import open_store

    store = open_store(url)
    clock = ManualClock(1_000_000)
    prefix = f"m{os.getpid()}-"
    ops = []
    for i in range(n):
        ops.append(RemapOperator(store, f"{prefix}{i}", "counter",
                                 initial_frontier=Antichain.from_elem(Counter(0)), clock=clock))
    for op in ops:  # the first binding and one tick
        op.mint(Antichain.from_elem(Counter(0)))
    cpu, wall = time.process_time(), time.perf_counter()
    for k in range(count):
        clock.advance(1000)
        for op in ops:
            op.mint(Antichain.from_elem(Counter(10 * (k + 1))))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    store.close()
    return {"cpu_ms": 1000 * cpu / (n * count), "wall_ms": 1000 * wall / (n * count)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sources", type=int, default=100)
    ap.add_argument("--ticks", type=int, default=20)
    ap.add_argument("--variants", default="now,before")
    ap.add_argument("--before", default="fbbeac6")
    ap.add_argument("--pg-url", help="a PostgreSQL database for the remap store")
    ap.add_argument("--child", nargs=3, metavar=("URL", "N", "TICKS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        url, n, count = args.child
        import remap_store

        print(json.dumps({**ticks(url, int(n), int(count)), "code": remap_store.__file__}))
        return 0
    with contextlib.ExitStack() as stack:
        d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="reclock-mint-")))
        urls = {"sqlite": None, "postgresql": args.pg_url}
        if args.pg_url is None:
            from tests.pgcluster import PgCluster

            cluster = PgCluster().start()
            stack.callback(cluster.stop)
            urls["postgresql"] = cluster.url
        code = {v: (stack.enter_context(checkout(args.before, d / "before"))
                    if v == "before" else Path(__file__).resolve().parents[1])
                for v in args.variants.split(",")}
        rows, cpu = [], {}
        for store, url in urls.items():
            for v, path in code.items():
                target = url or str(d / f"{v}.sqlite")
                out = subprocess.run(
                    [sys.executable, __file__, "--child", target, str(args.sources),
                     str(args.ticks)],
                    env={**os.environ, "PYTHONPATH": str(path), "MINT_BENCH_CODE": str(path)},
                    cwd=str(path),
                    capture_output=True, text=True, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                assert r["code"].startswith(str(path)), (v, r["code"])  # the variant's code
                cpu[store, v] = r["cpu_ms"]
                rows.append([store, v, f"{r['cpu_ms']:.2f}", f"{r['wall_ms']:.2f}",
                             f"{r['cpu_ms'] / cpu[store, 'now']:.2f}" if (store, "now") in cpu
                             else "-"])
    print(table(f"minting: {args.sources} sources x {args.ticks} ticks",
                ["store", "variant", "CPU ms/tick", "wall ms/tick", "CPU / now's"], rows,
                left=(0, 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
