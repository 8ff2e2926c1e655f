"""Fair sharing: a light source's freshness while a heavy source saturates Spark.

One command, one SparkSession (``local[2]``, warm before anything is timed).
Two runs of the same light source (a counter at ``--light-rate`` records/s,
file sink) on one pipeline:

* **alone** -- the light source by itself;
* **beside a heavy source** -- plus a counter whose rate (``--heavy-rate``)
  is far above what two cores ingest, so it is behind for the whole run and
  every tick of it runs bounded jobs back to back.

For each run: the light source's freshness per record (generation time
``_src_ts`` to the progress-log ``sink_upper`` event whose progress frontier
first passes it, i.e. durable), p50 / p99 over the measured window, and the
heavy source's ingestion rate and backlog at the end (to show it was
saturated). Target (issue 6): the light source's p99 within 2 x
``timestamp_interval`` while the heavy one is saturated. Sources share Spark
through one FAIR pool each and a first-come job gate (see
``reclock/runtime/dataplane.py``).

Run: ``python bench/fairness_bench.py`` (about 2 minutes) or ``--quick``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_bench import counter_source, pipeline_yaml, read_events, table

from reclock.config import parse_config
from reclock.pipeline import run
from reclock.sinks.delta import DeltaSink


def light_freshness(state: Path, w0: int, w1: int) -> tuple[float, float, int]:
    """(p50 ms, p99 ms, records) of the light source over the window [w0, w1] ms."""
    ups = [e for e in read_events(state, "light") if e["kind"] == "sink_upper"]
    ev_ts = np.array([e["ts"] for e in ups], dtype=np.int64)
    ev_prog = np.array([e["progress"][0] if e["progress"] else np.iinfo(np.int64).max
                        for e in ups], dtype=np.int64)
    t = DeltaSink("light.value", state / "outputs" / "light" / "value").read_updates()
    off = t.column("_src_offset").to_numpy()
    src = t.column("_src_ts").to_numpy()
    sel = (src >= w0) & (src <= w1)
    idx = np.searchsorted(ev_prog, off[sel], side="right")
    ok = idx < len(ev_ts)
    fresh = (ev_ts[idx[ok]] - src[sel][ok]).astype(np.float64)
    p50, p99 = np.percentile(fresh, [50, 99])
    return float(p50), float(p99), int(sel.sum())


def one_run(spark: Any, tmp: Path, args: argparse.Namespace, heavy: bool) -> dict[str, Any]:
    d = Path(tempfile.mkdtemp(prefix="fair-", dir=tmp))
    sources = [counter_source("light", args.light_rate)]
    if heavy:
        sources.append(counter_source("heavy", args.heavy_rate))
    cfg = parse_config(pipeline_yaml(d / "state", sources, interval=f"{args.interval}ms"),
                       "p.yaml", base_dir=d)
    start = time.time_ns() // 1_000_000
    runners = run(cfg, spark=spark, duration=args.warmup + args.window + 3, out=None,
                  install_signals=False)
    w0 = start + int(args.warmup * 1000)
    w1 = w0 + int(args.window * 1000)
    p50, p99, n = light_freshness(d / "state", w0, w1)
    out: dict[str, Any] = {"p50": p50, "p99": p99, "records": n}
    for r in runners:
        if r.name == "heavy":
            st = r.status()
            out["heavy_records"] = st["records"]
            out["heavy_rate"] = st["records"] / (args.warmup + args.window + 3)
            out["heavy_backlog"] = st["lag_records"]
    shutil.rmtree(d, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=int, default=1000, help="timestamp_interval, ms")
    ap.add_argument("--light-rate", type=float, default=1000.0)
    ap.add_argument("--heavy-rate", type=float, default=20_000_000.0)
    ap.add_argument("--warmup", type=float, default=8.0)
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--quick", action="store_true", help="a 15 s window")
    args = ap.parse_args()
    if args.quick:
        args.window = 15.0
    logging.getLogger("py4j").setLevel(logging.WARNING)
    from reclock.runtime.spark import spark_session

    spark = spark_session("local[2]", "fairness-bench", {})
    spark.sparkContext.parallelize(range(4), 2).count()
    tmp = Path(tempfile.mkdtemp(prefix="fairness-bench-"))
    try:
        alone = one_run(spark, tmp, args, heavy=False)
        both = one_run(spark, tmp, args, heavy=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    target = 2 * args.interval
    rows = [
        ["light alone", f"{alone['records']:,}", f"{alone['p50']:,.0f}", f"{alone['p99']:,.0f}",
         "-", "-", "PASS" if alone["p99"] <= target else "MISS"],
        ["light beside heavy", f"{both['records']:,}", f"{both['p50']:,.0f}",
         f"{both['p99']:,.0f}", f"{both['heavy_rate']:,.0f}/s",
         f"{both['heavy_backlog']:,}", "PASS" if both["p99"] <= target else "MISS"],
    ]
    print(table(f"Fair sharing, local[2], timestamp_interval {args.interval} ms, light source "
          f"{args.light_rate:,.0f} records/s; target p99 <= {target:,} ms",
          ["run", "light records", "p50 ms", "p99 ms", "heavy ingested", "heavy backlog",
           "target"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
