"""One-shot load of a large Parquet file set (issue 18: 10 million rows).

Writes ``--files`` Parquet files of ``--rows`` rows in all (``id`` int64,
``v`` float64, ``tag`` string, ``ts`` timestamp; row groups of
``--row-group`` rows), starts a pipeline in this process (Spark
``--master``, a ``oneshot`` source with a Delta output, tasks of
``--split-size``), and times ``reclock load`` from the request to the
load's commit: rows per second, tasks, and the check that the output holds
every row once at one IntoTime (the row count and the sum of ``id``). A
second, identical request is timed too (it must be a no-op).

    python bench/oneshot_bench.py                 # 10M rows, 20 files, local[2]
    python bench/oneshot_bench.py --rows 2000000  # quicker
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PIPELINE = """
state_dir: {state}
timestamp_interval: 500ms
spark: {{master: "{master}"}}
sources:
  - name: big
    oneshot: {{format: parquet, split_size: {split}, columns: {{id: int64, v: float64, tag: string,
              ts: timestamp}}}}
    outputs:
      - name: big
        sink: file
"""


def write_files(d: Path, rows: int, files: int, row_group: int) -> float:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    t0 = time.monotonic()
    d.mkdir(parents=True)
    per = rows // files
    for f in range(files):
        n = per if f < files - 1 else rows - per * (files - 1)
        ids = np.arange(f * per, f * per + n, dtype=np.int64)
        tags = pa.array(np.array([f"tag-{i}" for i in range(64)], dtype=object)[ids % 64])
        t = pa.table({"id": ids, "v": ids * 0.25, "tag": tags,
                      "ts": pa.array(1_700_000_000_000_000 + ids, pa.timestamp("us", "UTC"))})
        pq.write_table(t, d / f"part-{f:04d}.parquet", row_group_size=row_group)
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--files", type=int, default=20)
    ap.add_argument("--row-group", type=int, default=250_000)
    ap.add_argument("--split-size", default="64MiB")
    ap.add_argument("--master", default="local[2]")
    args = ap.parse_args()

    import pyarrow.compute as pc

    from reclock.config import load_config
    from reclock.load import load
    from reclock.runtime.spark import spark_session
    from tests.running import read_updates, running

    tmp = Path(tempfile.mkdtemp(prefix="oneshot-bench-"))
    wrote = write_files(tmp / "in", args.rows, args.files, args.row_group)
    size = sum(p.stat().st_size for p in (tmp / "in").iterdir())
    print(f"wrote {args.rows:,} rows in {args.files} Parquet files ({size / 2**20:.0f} MiB) "
          f"in {wrote:.1f} s")
    path = tmp / "pipeline.yaml"
    path.write_text(PIPELINE.format(state=tmp / "state", master=args.master,
                                    split=args.split_size))
    cfg = load_config(path)
    spark = spark_session(args.master, "oneshot-bench", {"spark.sql.shuffle.partitions": "2"})
    try:
        with running(cfg, spark):
            t0 = time.monotonic()
            r = load(cfg, "big", "big", str(tmp / "in"), wait=True, timeout_s=3600)
            took = time.monotonic() - t0
            t1 = time.monotonic()
            again = load(cfg, "big", "big", str(tmp / "in"), wait=True)
            noop = time.monotonic() - t1
    finally:
        spark.stop()
    tasks = [json.loads(line).get("tasks") for line in
             (tmp / "state" / "progress.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "read"]
    held = read_updates(cfg, "big", "big")
    ok = (held.num_rows == args.rows and r.rows == args.rows and r.errors == 0
          and pc.sum(held.column("id")).as_py() == args.rows * (args.rows - 1) // 2
          and len(set(held.column("_into_time").to_pylist())) == 1
          and again.state == "already loaded")
    print(f"load: {r.rows:,} rows, {r.errors} error rows, {r.files} files, "
          f"{max(t for t in tasks if t)} tasks, {took:.1f} s from request to commit: "
          f"{r.rows / took:,.0f} rows/s ({size / 2**20 / took:.1f} MiB/s of Parquet)")
    print(f"repeat: {again.state} in {noop:.2f} s")
    print(f"check: {'PASS' if ok else 'FAIL'} (every row once, at IntoTime {r.into_time})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
