"""Iceberg state-table benchmark: the Iceberg sink's ``mode: state``
(merge-on-read) under the Delta state-table bench's load, its freshness
measured end to end, against Spark Structured Streaming ``foreachBatch`` +
``MERGE INTO`` an Iceberg table on the same changes.

One command::

    python bench/iceberg_state_bench.py            # 10 million keys, 10,000 changes/s, 120 s
    python bench/iceberg_state_bench.py --quick    # 200,000 keys, 2,000 changes/s, 30 s
    python bench/iceberg_state_bench.py --keys 1000000 --write-mode copy-on-write --no-spark

1. **Load**: ``--keys`` live keys (``k, v, n, _into_time``) committed through
   the sink in commits of a million new keys (a SQLite catalog, a local
   warehouse), as a first snapshot leaves a state table; then the sink's
   key index (key -> data file and position) is deleted and rebuilt from
   the table (timed: what a lost index costs).
2. **reclock**: the tick loop of ``bench/state_ticks.py``, the one
   ``bench/state_table_bench.py`` runs on Delta: every ``--interval`` (1 s)
   ``--rate`` changes (80 % updates, 10 % deletes, 10 % inserts) stamped
   with the tick's due time as IntoTime, staged and committed by the sink in
   this process, its maintenance (compaction on the driver's default
   schedule: a first pass after 60 s) between ticks. Freshness of a change =
   the time its catalog commit returned - its due time (the sink's key
   index is updated after that, before the next tick: that work, and any
   overrun, delays the next ticks and shows in their freshness). Bytes
   written per changed row: the commit's data and delete files; and
   everything it wrote (those, its manifests, manifest list and the
   table's new metadata file, which lists every snapshot kept).
3. **Spark**: the peer Spark (``$RECLOCK_CACHE/spark-peer``, PySpark 4.1.4,
   iceberg-spark-runtime-4.1_2.13 1.12.0) loads the same keys into an
   Iceberg table of a Hadoop catalog on local disk, then streams the first
   ``--spark-batches`` ticks' changes (one Parquet file each) through
   ``foreachBatch`` + ``MERGE INTO`` at Iceberg's documented settings for
   row-level changes in streaming (``bench/peers/spark_merge.py --format
   iceberg``: merge-on-read, no write distribution). Its sustained rate =
   changes / MERGE time (the first batch, a warm-up, left out).

Targets (PASS/FAIL), the Delta bench's: freshness p99 <= 3 intervals; data
and delete bytes written per changed row bounded (<= 1 KiB: no file
rewrite per commit); reclock's sustained rate (changes / busy time)
>= 2x Spark's. The end state is checked against the model of the changes
(every live key, a sample of values), Spark's row count too (exit 1 on a
mismatch).
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
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.state_ticks import (
    SCHEMA,
    USER,
    Changes,
    add_load_args,
    load_rows,
    pct,
    peer_dir,
    run_ticks,
)
from reclock.contracts.sink import SinkState
from reclock.sinks.iceberg import CatalogConfig, Compaction, IcebergSink

#: Data and delete bytes a commit may write per changed row: the Delta
#: bench's target (no file rewrite per commit: at 10M keys a rewrite of the
#: files a tick's random keys touch is the whole table, 3 KiB per changed
#: row). Not the stored bytes of a row times a factor: the loaded rows
#: (sequential keys) compress to a few bytes, the changed rows (random keys)
#: do not.
BOUND_BYTES = 1024
LOAD_ROWS = 1_000_000

RECLOCK_SETTINGS = ("mode: state, write_mode: merge-on-read (one data + one position-delete "
                    "file a commit), SQLite catalog, local warehouse, compaction on the "
                    "driver's default schedule (first pass after 60 s)")
SPARK_SETTINGS = ("format-version 2, write.{merge,update,delete}.mode merge-on-read, "
                  "write.delete.granularity file, write.{,merge.,update.,delete.}"
                  "distribution-mode none, Hadoop catalog, local disk, local[2], "
                  "2 shuffle partitions, AQE on, availableNow + maxFilesPerTrigger 1")


def as_updates(user: pa.Table, into: int) -> pa.Table:
    """Insertions of ``user``'s rows at IntoTime ``into``."""
    m = user.num_rows
    return pa.table({
        **{f.name: user.column(f.name) for f in user.schema},
        "_into_time": np.full(m, into, dtype=np.int64), "_diff": np.ones(m, dtype=np.int64),
        "_src_part": pa.array(np.zeros(m, dtype=np.int32)),
        "_src_offset": np.arange(m, dtype=np.int64),
        "_src_seq": pa.array(np.zeros(m, dtype=np.int32)),
        "_src_ts": pa.nulls(m, pa.int64()), "_error": pa.nulls(m, pa.string()),
        "_raw_key": pa.nulls(m, pa.binary()), "_raw_value": pa.nulls(m, pa.binary())},
        schema=SCHEMA)


def bulk_load(sink: IcebergSink, keys: int) -> SinkState:
    """``keys`` live keys, committed in commits of :data:`LOAD_ROWS`."""
    st = sink.stager()
    state = SinkState()
    for n, lo in enumerate(range(0, keys, LOAD_ROWS)):
        staged = st.stage("load", n, as_updates(load_rows(lo, min(keys, lo + LOAD_ROWS)), n + 1))
        new = SinkState(n + 2, f'"load{n}"')
        sink.commit(staged, state, new)
        state = new
    return state


def local(uri: str) -> str:
    return uri[len("file://"):] if uri.startswith("file://") else uri


def commit_bytes(sink: IcebergSink) -> tuple[int, int]:
    """The bytes the commit just made wrote: (its data and delete files,
    everything: those, its new manifests, its manifest lists, the table's
    new metadata file). A copy-on-write commit makes two snapshots (a
    delete and an append), both carrying its upper."""
    table = sink._table
    head = table.current_snapshot()
    upper = head.summary["reclock.upper"]
    files = total = 0
    snap = head
    while snap is not None and snap.summary.get("reclock.upper") == upper:
        files += int(snap.summary.get("added-files-size", "0"))
        total += os.path.getsize(local(snap.manifest_list))
        for m in snap.manifests(table.io):
            if m.added_snapshot_id == snap.snapshot_id:
                total += m.manifest_length
        parent = snap.parent_snapshot_id
        snap = None if parent is None else table.metadata.snapshot_by_id(parent)
    return files, files + total + os.path.getsize(local(table.metadata_location))


def run_reclock(root: Path, args: argparse.Namespace, changes_dir: Path) -> dict[str, Any]:
    cat = CatalogConfig(type="sql", uri=f"sqlite:///{root}/cat.db", warehouse=f"{root}/wh")
    index_path = str(root / "keys.sqlite")
    sink = IcebergSink("bench.state", cat.access(None), "bench.state", mode="state", key=("k",),
                       write_mode=args.write_mode, index_path=index_path,
                       compaction=None if args.no_compact else Compaction())
    sink.ensure(USER)
    t0 = time.monotonic()
    state = bulk_load(sink, args.keys)
    load_s = time.monotonic() - t0
    table = sink._load()
    size = int(table.current_snapshot().summary["total-files-size"])
    index_s = float("nan")
    if args.write_mode == "merge-on-read":
        assert sink._index is not None
        sink._index.close()
        sink._index = None
        os.remove(index_path)
        t0 = time.monotonic()
        sink._index_at(sink._load())
        index_s = time.monotonic() - t0
    print(f"  loaded {args.keys:,} keys ({size / 2**20:.1f} MiB) in {load_s:.1f} s, "
          f"index rebuilt in {index_s:.1f} s", file=sys.stderr, flush=True)

    marks: list[float] = []
    commit_tx = sink._commit_tx

    def timed_commit_tx(*a: Any, **kw: Any) -> None:
        commit_tx(*a, **kw)
        marks.append(time.time())  # the catalog commit returned: durable

    sink._commit_tx = timed_commit_tx  # type: ignore[method-assign]
    files_bytes: list[int] = []

    def written() -> int:
        files, total = commit_bytes(sink)
        files_bytes.append(files)
        return total

    gen = Changes(args.keys, seed=1)
    t = run_ticks(sink, state, gen, args, changes_dir, written=written,
                  durable=lambda: marks[-1], compacted="files_compacted")
    head = sink._load().current_snapshot().summary
    check(sink, gen)
    sink.close()
    return {"load_s": load_s, "index_s": index_s, "row_bytes": size / args.keys, "ticks": t,
            "files_bytes": files_bytes, "data_files": int(head["total-data-files"]),
            "delete_files": int(head.get("total-delete-files", "0"))}


def check(sink: IcebergSink, gen: Changes) -> None:
    """The table holds exactly the live keys, each with its last change's
    value (exit 1 otherwise)."""
    table = sink.read_updates()
    table = table.filter(pc.is_null(table.column("_error")))
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
    common = [str(py), str(script), "--ivy", str(peer / "ivy"), "--format", "iceberg",
              "--table", str(root / "spark")]

    def call(*extra: str) -> dict[str, Any]:
        done = subprocess.run([*common, *extra], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"spark failed: {done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    loaded = call("load", "--keys", str(args.keys))
    merged = call("merge", "--changes", str(changes_dir), "--checkpoint", str(root / "ckpt"))
    return {"load_s": loaded["load_s"], "batches": merged["batches"], "rows": merged["rows"],
            "wall_s": merged["wall_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="200k keys, 2,000 changes/s, 30 ticks")
    add_load_args(ap)
    ap.add_argument("--write-mode", choices=["merge-on-read", "copy-on-write"],
                    default="merge-on-read")
    ap.add_argument("--no-compact", action="store_true",
                    help="no compaction or expiry between ticks (a diagnostic: the commit "
                         "path alone; the driver compacts by default)")
    args = ap.parse_args()
    if args.quick:
        args.keys, args.rate, args.ticks, args.spark_batches = 200_000, 2_000, 30, 4
    root = Path(args.dir or tempfile.mkdtemp(prefix="iceberg-state-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    changes_dir = root / "changes"
    changes_dir.mkdir(exist_ok=True)
    try:
        r = run_reclock(root, args, changes_dir)
        t = r["ticks"]
        s = None if args.no_spark else run_spark(root, args, changes_dir)
        if s is not None and s["rows"] != t.spark_live:
            print(f"MISMATCH: Spark's table holds {s['rows']} rows, the model {t.spark_live}")
            return 1
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    p99 = pct(t.fresh, 99)
    changed = max(1, sum(t.changed))
    per_row = sum(r["files_bytes"]) / changed
    per_row_all = sum(t.written) / changed
    maint = [b - x - c for b, x, c in zip(t.busy, t.stage, t.commit, strict=True)]
    durable = [c - a for c, a in zip(t.commit, t.after, strict=True)]
    rate = sum(t.changed) / sum(t.busy)
    n = min(args.spark_batches, args.ticks)
    rows = [
        ("keys / changes per interval / interval / ticks",
         f"{args.keys:,} / {args.rate:,} / {args.interval:g} s / {args.ticks}", ""),
        ("reclock write mode", args.write_mode, ""),
        ("load (commits of a million keys)", f"{r['load_s']:.1f} s", ""),
        ("key index rebuilt from the table", f"{r['index_s']:.1f} s", ""),
        ("stage p50 / commit p50 / commit p99",
         f"{pct(t.stage, 50):.3f} / {pct(t.commit, 50):.3f} / {pct(t.commit, 99):.3f} s", ""),
        ("commit: until durable p50 / after (key index) p50",
         f"{pct(durable, 50):.3f} / {pct(t.after, 50):.3f} s", ""),
        ("freshness p50 / p99 (target p99 <= 3 intervals)",
         f"{pct(t.fresh, 50):.2f} / {p99:.2f} s", "PASS" if p99 <= 3 * args.interval else "FAIL"),
        ("freshness max", f"{max(t.fresh):.2f} s", ""),
        ("data + delete bytes per changed row (target <= 1 KiB)",
         f"{per_row:.0f} B", "PASS" if per_row <= BOUND_BYTES else "FAIL"),
        ("all bytes per changed row (+ manifests, metadata file)", f"{per_row_all:.0f} B", ""),
        ("reclock sustained rate (changes / busy time)", f"{rate:,.0f}/s", ""),
        ("stored bytes per row after the load", f"{r['row_bytes']:.1f} B", ""),
        ("compaction passes / files they merged", f"{len(t.passes)} / {sum(t.passes)}", ""),
        ("longest maintenance between two ticks", f"{max(maint):.2f} s", ""),
        ("data files / delete files at the end", f"{r['data_files']} / {r['delete_files']}",
         ""),
    ]
    if s is not None:
        batches = s["batches"][1:] or s["batches"]
        spark_rate = sum(m for _, m in batches) / sum(x for x, _ in batches)
        ratio = rate / spark_rate
        rows += [
            ("Spark bulk load", f"{s['load_s']:.1f} s", ""),
            ("Spark foreachBatch + MERGE INTO per batch p50",
             f"{pct([x for x, _ in batches], 50):.2f} s", ""),
            ("Spark sustained rate (changes / MERGE time)", f"{spark_rate:,.0f}/s", ""),
            (f"wall time to the first {n} ticks durable: reclock / Spark",
             f"{t.spark_wall:.1f} / {s['wall_s']:.1f} s", ""),
            ("reclock / Spark (target >= 2x)", f"{ratio:.1f}x", "PASS" if ratio >= 2 else "FAIL"),
        ]
    width = max(len(a) for a, _, _ in rows)
    for a, b, c in rows:
        print(f"{a:<{width}}  {b:>34}  {c}")
    settings = RECLOCK_SETTINGS
    if args.write_mode != "merge-on-read":
        settings = settings.replace("merge-on-read (one data + one position-delete file a "
                                    "commit)", args.write_mode)
    if args.no_compact:
        settings = settings.replace("on the driver's default schedule (first pass after 60 s)",
                                    "OFF (--no-compact)")
    print(f"reclock: {settings}")
    if s is not None:
        print(f"Spark:   {SPARK_SETTINGS}")
        print(f"(reclock's wall time runs on the {args.interval:g} s schedule from the first "
              "due time; Spark's from its query's start with every change file already "
              "there, so it never waits for an interval)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
