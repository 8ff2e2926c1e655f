"""State-table benchmark: the Delta sink's ``mode: state`` against the
issue's targets, and against Spark Structured Streaming ``foreachBatch`` +
Delta ``MERGE`` on the same changes.

One command::

    python bench/state_table_bench.py            # 10 million keys, 10,000 changes/s
    python bench/state_table_bench.py --quick    # 200,000 keys, 2,000 changes/s, short

1. **Load**: the table's first version is written in bulk (files of a
   million rows ``k, v, n, _into_time``, one log entry with the output's
   txn), as a first snapshot would leave it; then the key index is built
   from the table (timed: it is what a lost index costs).
2. **reclock**: every ``--interval`` (1 s) a batch of ``--rate`` changes on
   random keys (80 % updates, 10 % deletes, 10 % inserts of new keys; each
   key at most once per batch) with IntoTime = the tick's scheduled time,
   staged and committed by the sink in this process (staging stands for the
   executors' work), the sink's maintenance (compaction) between ticks as
   the driver runs it (the loop of ``bench/state_ticks.py``, which
   ``bench/iceberg_state_bench.py`` shares). Freshness of a change = its
   commit's end - its IntoTime; a tick that overruns (its commit or the
   maintenance after it) delays the next ones, so it shows up.
   Bytes rewritten per changed row = (the new data file + the commit's
   deletion vector file + its log entry) / changes.
3. **Spark**: the peer Spark (``$RECLOCK_CACHE/spark-peer``, PySpark 4.1.4, delta-spark
   4.3.1) loads the same keys, then streams the first ``--spark-batches``
   batches (the same changes, one Parquet file each) through
   ``foreachBatch`` + ``MERGE`` at Delta's documented settings for small
   batches (``bench/peers/spark_merge.py``). Its sustained rate = changes /
   MERGE time (the first batch, a warm-up, left out).

Targets (PASS/FAIL): freshness p99 <= 3 intervals; bytes rewritten per
changed row bounded (<= 1 KiB: no file rewrite per commit); reclock's
sustained rate >= 2x Spark's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.state_ticks import USER, Changes, add_load_args, pct, peer_dir, run_ticks
from reclock.sinks import delta as delta_mod
from reclock.sinks import delta_state
from reclock.sinks.delta import Compaction, DeltaSink
from reclock.sinks.delta_state import dv_path, state_stats

FILE_ROWS = 1_000_000


def bulk_load(sink: DeltaSink, keys: int) -> float:
    """Version 1 of the table: ``keys`` rows in files of :data:`FILE_ROWS`."""
    t0 = time.monotonic()
    sink.ensure(USER)
    actions = []
    table_schema = pa.schema(delta_state._state_delta_schema(USER).to_arrow())
    for i, start in enumerate(range(0, keys, FILE_ROWS)):
        k = np.arange(start, min(keys, start + FILE_ROWS), dtype=np.int64)
        t = pa.table({"k": k, "v": pa.array([f"v0-{x}" for x in k.tolist()]),
                      "n": k / 3.0, "_into_time": np.zeros(len(k), dtype=np.int64)},
                     schema=table_schema)
        path = f"part-0-load-{i:05d}-000.parquet"
        size = sink.location.write(path, partial(delta_mod._write_parquet, t))
        st = sink.location.stat(path)
        actions.append({"add": {"path": path, "partitionValues": {}, "size": size,
                                "modificationTime": st[1] if st else 0, "dataChange": True,
                                "stats": state_stats(t)}})
    custom = {delta_mod.KEY_OUTPUT: sink.name, delta_mod.KEY_UPPER: 1,
              delta_mod.KEY_PROGRESS: '"load"'}
    assert sink._put_entry(1, delta_state._state_entry(actions, sink.app_id, 1, custom, 0))
    return time.monotonic() - t0


def commit_bytes(sink: DeltaSink, version: int, seen_dvs: set[str]) -> int:
    """The bytes a commit wrote into the table: its log entry, the data
    files it added that are new, its deletion vector file."""
    text = sink.location.read_text(f"_delta_log/{version:020d}.json") or ""
    total = len(text.encode())
    for line in text.splitlines():
        doc = json.loads(line)
        add = doc.get("add")
        if not add:
            continue
        if "-state-" in add["path"] and not add.get("deletionVector"):
            total += int(add["size"])
        dv = add.get("deletionVector")
        if dv:
            p = dv_path(dv)
            if p not in seen_dvs:
                seen_dvs.add(p)
                st = sink.location.stat(p)
                total += st[0] if st else 0
    return total


def run_reclock(root: Path, args: argparse.Namespace, changes_dir: Path) -> dict[str, Any]:
    sink = DeltaSink("bench.state", root / "reclock", mode="state", key=["k"],
                     compaction=Compaction(), checkpoint_aside=True)
    load_s = bulk_load(sink, args.keys)
    t0 = time.monotonic()
    with sink._locked():
        assert sink._index_at(1) is not None
    index_s = time.monotonic() - t0
    gen = Changes(args.keys, seed=1)
    seen: set[str] = set()

    def written() -> int:
        assert sink._head is not None
        return commit_bytes(sink, sink._head.version, seen)

    t = run_ticks(sink, sink.state(), gen, args, changes_dir, written=written)
    files = len(list((root / "reclock").glob("*.parquet")))
    check(sink, gen)
    return {"spark_live": t.spark_live, "load_s": load_s, "index_s": index_s,
            "fresh": t.fresh, "busy": t.busy, "bytes": t.written, "changed": t.changed,
            "stage": t.stage, "commit": t.commit, "files": files, "passes": t.passes}


def check(sink: DeltaSink, gen: Changes) -> None:
    """The table holds exactly the live keys, each with its last change's
    value (exit 1 otherwise)."""
    table = delta_mod.read_current(sink.location)
    keys = table.column("k").to_numpy()
    want = np.flatnonzero(gen.live)
    if len(keys) != len(want) or not np.array_equal(np.sort(keys), want):
        print(f"MISMATCH: the table holds {len(keys)} keys, the model {len(want)}")
        raise SystemExit(1)
    rng = np.random.default_rng(5)
    sample = rng.choice(len(keys), min(2000, len(keys)), replace=False)
    for k, v in zip(keys[sample].tolist(), table.column("v").take(pa.array(sample))
                    .to_pylist(), strict=True):
        if v != gen.value(k):
            print(f"MISMATCH: key {k} holds {v!r}, the model {gen.value(k)!r}")
            raise SystemExit(1)


def run_spark(root: Path, args: argparse.Namespace, changes_dir: Path) -> dict[str, Any]:
    peer = peer_dir()
    py = peer / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPARK_HOME")}
    env.update(PYSPARK_PYTHON=str(py), PYSPARK_DRIVER_PYTHON=str(py))
    script = Path(__file__).parent / "peers" / "spark_merge.py"
    table = root / "spark"
    common = [str(py), str(script), "--ivy", str(peer / "ivy"), "--table", str(table)]

    def call(*extra: str) -> dict[str, Any]:
        done = subprocess.run([*common, *extra], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"spark failed: {done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    loaded = call("load", "--keys", str(args.keys))
    merged = call("merge", "--changes", str(changes_dir), "--checkpoint", str(root / "ckpt"))
    return {"load_s": loaded["load_s"], "batches": merged["batches"], "rows": merged["rows"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="200k keys, 2,000 changes/s, 30 ticks")
    add_load_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.keys, args.rate, args.ticks, args.spark_batches = 200_000, 2_000, 30, 4
    root = Path(args.dir or tempfile.mkdtemp(prefix="state-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    changes_dir = root / "changes"
    changes_dir.mkdir(exist_ok=True)
    try:
        r = run_reclock(root, args, changes_dir)
        s = None if args.no_spark else run_spark(root, args, changes_dir)
        if s is not None and s["rows"] != r["spark_live"]:
            print(f"MISMATCH: Spark's table holds {s['rows']} rows, the model "
                  f"{r['spark_live']}")
            return 1
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    p99 = pct(r["fresh"], 99)
    per_row = sum(r["bytes"]) / max(1, sum(r["changed"]))
    rate = sum(r["changed"]) / sum(r["busy"])
    rows = [
        ("keys / changes per interval / interval", f"{args.keys:,} / {args.rate:,} / "
                                                   f"{args.interval:g} s", ""),
        ("bulk load (first version)", f"{r['load_s']:.1f} s", ""),
        ("key index built from the table", f"{r['index_s']:.1f} s", ""),
        ("stage p50 / commit p50 / commit p99",
         f"{pct(r['stage'], 50):.3f} / {pct(r['commit'], 50):.3f} / "
         f"{pct(r['commit'], 99):.3f} s", ""),
        ("freshness p50 / p99 (target p99 <= 3 intervals)",
         f"{pct(r['fresh'], 50):.2f} / {p99:.2f} s",
         "PASS" if p99 <= 3 * args.interval else "FAIL"),
        ("bytes rewritten per changed row (target <= 1 KiB)", f"{per_row:.0f} B",
         "PASS" if per_row <= 1024 else "FAIL"),
        ("reclock sustained rate (changes / busy time)", f"{rate:,.0f}/s", ""),
        ("compaction passes / files they merged",
         f"{len(r['passes'])} / {sum(r['passes'])}", ""),
    ]
    if s is not None:
        batches = s["batches"][1:] or s["batches"]
        spark_rate = sum(n for _, n in batches) / sum(t for t, _ in batches)
        ratio = rate / spark_rate
        rows += [
            ("Spark bulk load", f"{s['load_s']:.1f} s", ""),
            ("Spark foreachBatch + MERGE per batch p50",
             f"{pct([t for t, _ in batches], 50):.2f} s", ""),
            ("Spark sustained rate", f"{spark_rate:,.0f}/s", ""),
            ("reclock / Spark (target >= 2x)", f"{ratio:.1f}x", "PASS" if ratio >= 2 else "FAIL"),
        ]
    width = max(len(a) for a, _, _ in rows)
    for a, b, c in rows:
        print(f"{a:<{width}}  {b:>28}  {c}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
