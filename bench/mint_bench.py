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
milliseconds per tick, over ``--ticks`` ticks of every operator one after
another, after one warm-up tick; then the wall time of a mint when every
operator mints on a thread of its own about once a second for
``--seconds`` (p50, p99, max: waits for the store's writer included).
The target (issue 17: 100 sources at a 1 s interval on 2 cores) needs
minting well under 5 ms of CPU a tick.

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
    from reclock.registry import open_store

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


def threaded(url: str, n: int, seconds: float) -> dict[str, float]:
    """In this process: ``n`` operators, each minting on a thread of its own
    just past every whole second (as ``n`` sources do) for ``seconds``: the
    wall time of each mint after the first two, waits for the store's writer
    included."""
    import threading

    from reclock.core.clock import SystemClock
    from reclock.core.frontier import Antichain
    from reclock.core.mint import RemapOperator
    from reclock.core.time import Counter
    from reclock.registry import open_store

    store = open_store(url)
    prefix = f"t{os.getpid()}-"
    took: list[float] = []

    def run(i: int) -> None:
        op = RemapOperator(store, f"{prefix}{i}", "counter",
                           initial_frontier=Antichain.from_elem(Counter(0)), clock=SystemClock())
        end, k = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            k += 1
            t = time.monotonic()
            op.mint(Antichain.from_elem(Counter(k)))
            if k > 2:  # past the start (creating the shard, the first binding)
                took.append(time.monotonic() - t)
            # as sources tick: just past the next whole second (the interval boundary)
            time.sleep(1.005 - time.time() % 1.0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.close()
    took.sort()
    return {"p50_ms": 1000 * took[len(took) // 2], "p99_ms": 1000 * took[int(len(took) * 0.99)],
            "max_ms": 1000 * took[-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sources", type=int, default=100)
    ap.add_argument("--ticks", type=int, default=20)
    ap.add_argument("--variants", default="now,before")
    ap.add_argument("--before", default="fbbeac6")
    ap.add_argument("--pg-url", help="a PostgreSQL database for the remap store")
    ap.add_argument("--seconds", type=float, default=15.0,
                    help="how long the threaded run mints (one thread per source)")
    ap.add_argument("--fsync-ms", type=float, default=0.0,
                    help="make every fsync of the minting processes this much slower, as "
                         "on a slower disk (bench/slow_fsync.c, preloaded; SQLite only: "
                         "the PostgreSQL server is not slowed)")
    ap.add_argument("--child", nargs=4, metavar=("URL", "N", "TICKS", "SECONDS"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        url, n, count, seconds = args.child
        import reclock.remap_store

        print(json.dumps({**ticks(url, int(n), int(count)),
                          **threaded(url, int(n), float(seconds)),
                          "code": reclock.remap_store.__file__}))
        return 0
    with contextlib.ExitStack() as stack:
        d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="reclock-mint-")))
        urls = {"sqlite": None, "postgresql": args.pg_url}
        if args.pg_url is None:
            from tests.pgcluster import PgCluster

            cluster = PgCluster().start()
            stack.callback(cluster.stop)
            urls["postgresql"] = cluster.url
        slow: dict[str, str] = {}
        if args.fsync_ms > 0:
            shim = d / "slow_fsync.so"
            subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(shim),
                            str(Path(__file__).with_name("slow_fsync.c")), "-ldl"], check=True)
            slow = {"LD_PRELOAD": str(shim), "SLOW_FSYNC_US": str(int(args.fsync_ms * 1000))}
        code = {v: (stack.enter_context(checkout(args.before, d / "before"))
                    if v == "before" else Path(__file__).resolve().parents[1])
                for v in args.variants.split(",")}
        rows, cpu = [], {}
        for store, url in urls.items():
            for v, path in code.items():
                target = url or str(d / f"{v}.sqlite")
                out = subprocess.run(
                    [sys.executable, __file__, "--child", target, str(args.sources),
                     str(args.ticks), str(args.seconds)],
                    env={**os.environ, "PYTHONPATH": str(path), "MINT_BENCH_CODE": str(path),
                         **slow},
                    cwd=str(path),
                    capture_output=True, text=True, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                assert r["code"].startswith(str(path)), (v, r["code"])  # the variant's code
                cpu[store, v] = r["cpu_ms"]
                rows.append([store, v, f"{r['cpu_ms']:.2f}", f"{r['wall_ms']:.2f}",
                             f"{r['cpu_ms'] / cpu[store, 'now']:.2f}" if (store, "now") in cpu
                             else "-", f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}",
                             f"{r['max_ms']:.1f}"])
    print(table(f"minting: {args.sources} sources x {args.ticks} ticks"
                + (f", every fsync {args.fsync_ms:g} ms slower" if args.fsync_ms else ""),
                ["store", "variant", "CPU ms/tick", "wall ms/tick", "CPU / now's",
                 "threaded p50 ms", "p99 ms", "max ms"], rows,
                left=(0, 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
