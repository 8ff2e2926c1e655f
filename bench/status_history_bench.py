"""The status page's history (``reclock.statuspage.History``) of many
sources: the memory it holds and the driver CPU a second's record costs,
this tree against an earlier commit's, side by side in one process.

    python bench/status_history_bench.py                      # against HEAD~1
    python bench/status_history_bench.py --before REV --seconds 300

Each source is a counter of one output, as in the many-sources targets;
the driver records one status document a second (``--seconds`` of them).
Columns: points kept per source, MiB held (tracemalloc), bytes a point,
what an hour of documents holds (points kept after an hour x bytes a
point), CPU ms per record of all sources.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MIB = 1 << 20


def history_class(commit: str | None) -> Any:
    """``History`` of this tree, or of ``commit`` (its statuspage.py loaded
    as a module of its own)."""
    if commit is None:
        from reclock.statuspage import History

        return History
    text = subprocess.run(["git", "show", f"{commit}:reclock/statuspage.py"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "statuspage_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("statuspage_before", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.History


def document(n: int, t: int) -> dict[str, Any]:
    health = {"status": "running", "error": None, "hint": None, "since_ms": 5,
              "definite": False}
    return {"updated_ms": t, "sources": [
        {"source": f"c{i}", "kind": "counter", "health": health, "probe": [t // 1000 + i],
         "bound": [t // 1000 + i], "remap_upper": t + 1, "bindings": 6,
         "read_from": [t // 1000 - 3 + i], "resume": [t // 1000 - 3 + i],
         "records": 20 * (t // 1000), "records_per_s": 20.0, "lag_records": 3 + i,
         "job_seconds": 0.1, "tick_ms": 12.5,
         "outputs": [{"name": "value", "upper": t - 999, "lag_ms": 900,
                      "rows": 20 * (t // 1000), "errors": 0, "health": health,
                      "snapshot": None}]}
        for i in range(n)]}


def measure(cls: Any, n: int, seconds: int) -> dict[str, float]:
    docs_t0 = 1_800_000_000_000
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    h = cls()
    for s in range(seconds):
        h.record(document(n, docs_t0 + 1000 * s))  # (what it keeps is counted)
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del h
    h = cls()  # the CPU without tracemalloc's cost
    cpu = 0.0
    for s in range(seconds):
        doc = document(n, docs_t0 + 1000 * s)
        c0 = time.process_time()
        h.record(doc)
        cpu += time.process_time() - c0
    kept = len(h)
    per_point = held / max(1, kept * n)
    hour = min(3600, h.capacity(n) if hasattr(h, "capacity") else h.maxlen) * n * per_point
    return {"kept": kept, "held": held / MIB, "per_point": per_point, "hour": hour / MIB,
            "cpu_ms": 1000 * cpu / seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="HEAD~1", help="the commit to compare with")
    ap.add_argument("--seconds", type=int, default=120, help="documents recorded")
    ap.add_argument("--sources", default="2,100,1000")
    args = ap.parse_args()
    variants = {"this tree": history_class(None), args.before: history_class(args.before)}
    print(f"{args.seconds} documents, one a second; memory by tracemalloc, "
          "CPU in a second pass without it")
    print(f"{'sources':>8} {'variant':>12} {'points':>7} {'MiB held':>9} {'B/point':>8} "
          f"{'MiB at 1 h':>11} {'record ms':>10}")
    for n in (int(x) for x in args.sources.split(",")):
        for label, cls in variants.items():
            r = measure(cls, n, args.seconds)
            print(f"{n:8,d} {label[:12]:>12} {r['kept']:7.0f} {r['held']:9.1f} "
                  f"{r['per_point']:8.0f} {r['hour']:11,.0f} {r['cpu_ms']:10.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
