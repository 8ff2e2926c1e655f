"""Kafka frontiers and bindings at many partitions: the fast paths against the
pairwise definitions, side by side in one run.

For each partition count (``--partitions``, default 64, 512, 2048) it builds a
Kafka frontier as the driver does (one point per partition plus "every higher
partition"), and a second one where a tenth of the partitions moved, then
times on one core:

* **build** -- ``Antichain(elements)`` (minimal elements) vs the pairwise
  definition ``_minimal_pairwise``;
* **less_equal** -- ``a.less_equal(b)`` on fresh antichains (index built
  inside the timing) vs every element of ``b`` against every element of ``a``;
* **join** -- ``a.join(b)`` vs the minimal pairwise joins;
* **append** -- ``Bindings.extended`` adding one binding to ``--bindings``
  retained ones (validates the new one only) vs building the whole snapshot
  validated from scratch (what every append cost before);
* **unpickle** -- a broadcast snapshot of those bindings unpickled, as each
  Spark task does (validation skipped) vs validated again;
* **ship job** -- pickling and unpickling what a job in the steady state
  ships (``Bindings.covering`` its start: the last binding) vs the whole
  retained history.

"before" is the plain way, the reference the fast paths are checked
against: pairwise comparisons, the whole snapshot validated, the whole
history shipped. Each timing is the best of
``--repeat``. Results are checked against the pairwise answers; a mismatch
exits 1. The last column is the speed-up.

Run: ``python bench/frontier_bench.py`` (``--help`` for the options).
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reclock.core.bindings import Binding, Bindings
from reclock.core.frontier import Antichain, _minimal_pairwise, kafka_frontier
from reclock.core.time import IntoTime, Partitioned


def best(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    out, low = None, float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        low = min(low, time.perf_counter() - t0)
    return low, out


def pairwise_less_equal(a: Antichain[Any], b: Antichain[Any]) -> bool:
    return all(any(e.less_equal(o) for e in a.elements) for o in b.elements)


def pairwise_join(a: Antichain[Any], b: Antichain[Any]) -> tuple[Any, ...]:
    return _minimal_pairwise(j for e in a.elements for f in b.elements
                             if (j := e.join(f)) is not None)


def frontiers(n: int, step: int) -> list[Antichain[Partitioned]]:
    """``step`` frontiers of ``n`` partitions; each moves a tenth of them."""
    offsets = {p: 1000 for p in range(n)}
    out = []
    for k in range(step):
        for p in range(k % 10, n, 10):
            offsets[p] += 7
        out.append(kafka_frontier(offsets, partitions=n))
    return out


def measure(n: int, kept: int, repeat: int) -> tuple[list[tuple[str, int, float, float]], bool]:
    """The rows of one partition count, and whether every answer matched."""
    rows: list[tuple[str, int, float, float]] = []
    fs = frontiers(n, kept + 1)
    a, b = fs[-2], fs[-1]
    elems = list(a.elements) + list(b.elements)  # dominated ones among them
    t_new, built = best(lambda: Antichain(elems), repeat)
    t_old, ref = best(lambda: _minimal_pairwise(elems), repeat)
    ok = built.elements == ref
    rows.append(("build", n, t_new, t_old))
    t_new, le = best(lambda: Antichain(a.elements).less_equal(b), repeat)
    t_old, le_ref = best(lambda: pairwise_less_equal(a, b), repeat)
    ok &= le == le_ref is True
    rows.append(("less_equal", n, t_new, t_old))
    t_new, j = best(lambda: Antichain(a.elements).join(Antichain(b.elements)), repeat)
    t_old, j_ref = best(lambda: pairwise_join(a, b), 1)
    ok &= j.elements == j_ref
    rows.append(("join", n, t_new, t_old))
    bs = [Binding(IntoTime(1000 * (i + 1)), f) for i, f in enumerate(fs[:-1])]
    snap = Bindings("kafka", bs, upper=1000 * len(bs) + 1)
    nxt = [Binding(IntoTime(1000 * (len(bs) + 1)), fs[-1])]
    up = Antichain.from_elem(IntoTime(1000 * (len(bs) + 1) + 1))
    t_new, ext = best(lambda: snap.extended(nxt, up), repeat)
    t_old, full = best(lambda: Bindings("kafka", bs + nxt, upper=up), 1)
    ok &= ext == full
    rows.append((f"append ({len(bs)} kept)", n, t_new, t_old))
    blob = pickle.dumps(snap)
    t_new, back = best(lambda: pickle.loads(blob), repeat)
    t_old, _ = best(lambda: Bindings("kafka", back.bindings, upper=back.upper), 1)
    t_old += t_new  # unpickling, then validating again
    ok &= back == snap
    rows.append((f"unpickle ({len(blob) // 1024} KiB)", n, t_new, t_old))
    # What a job ships in the steady state (reading from the last bound
    # frontier): the bindings its range needs, not the whole history.
    lower = bs[-2].frontier
    t_new, part = best(lambda: pickle.loads(pickle.dumps(snap.covering(lower))), repeat)
    t_old, _ = best(lambda: pickle.loads(pickle.dumps(snap)), 1)
    ok &= len(part.bindings) == 1
    rows.append((f"ship job ({len(pickle.dumps(snap.covering(lower))) // 1024} KiB)",
                 n, t_new, t_old))
    return rows, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--partitions", type=int, nargs="+", default=[64, 512, 2048])
    ap.add_argument("--bindings", type=int, default=200,
                    help="bindings retained when one is appended (default 200)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows: list[tuple[str, int, float, float]] = []
    ok = True
    for n in args.partitions:
        more, same = measure(n, args.bindings, args.repeat)
        rows += more
        ok &= same
    print(f"{'operation':<24} {'partitions':>10} {'now (ms)':>10} {'before (ms)':>14} "
          f"{'speed-up':>9}")
    for name, n, new, old in rows:
        print(f"{name:<24} {n:>10} {new * 1e3:>10.2f} {old * 1e3:>14.2f} {old / new:>8.1f}x")
    print("results equal to the pairwise definitions:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
