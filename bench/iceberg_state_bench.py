"""An Iceberg state table's commits (``mode: state``), the way a pipeline
makes them each tick: load ``--keys`` live keys, then ``--commits`` commits
of ``--changes`` updates each (a retraction and an insertion per changed
key, random keys), staged and committed through the sink.

Prints, per commit, the wall time, the bytes of data files the commit
wrote (pyiceberg 0.12 deletes copy-on-write: every data file holding a
changed key is rewritten whole, and the new rows appended) and those bytes
per changed row; then the medians. With ``--compact-files N`` the load is
written as N files (as compaction would leave them), so a commit rewrites
the files its keys fall in::

    python bench/iceberg_state_bench.py                       # 1M keys, 10k changes, 5 commits
    python bench/iceberg_state_bench.py --keys 200000 --load-files 16
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reclock.contracts.rows import output_schema
from reclock.contracts.sink import SinkState
from reclock.sinks.iceberg import CatalogConfig, IcebergSink

USER = pa.schema([("id", pa.int64()), ("name", pa.string()), ("amount", pa.float64()),
                  ("status", pa.string()), ("note", pa.string())])


def rows(ids: list[int], version: int, into: int, diff: int, offset: int) -> pa.Table:
    n = len(ids)
    return pa.table({
        "id": pa.array(ids, pa.int64()),
        "name": [f"customer-{i}" for i in ids],
        "amount": [float(i % 1000) + version for i in ids],
        "status": [("open", "paid", "shipped")[(i + version) % 3] for i in ids],
        # 32 characters that do not compress: a row of a real table is not all ids
        "note": [hashlib.sha256(b"%d:%d" % (i, version)).hexdigest()[:32] for i in ids],
        "_into_time": pa.array([into] * n, pa.int64()),
        "_diff": pa.array([diff] * n, pa.int64()),
        "_src_part": pa.array([0] * n, pa.int32()),
        "_src_offset": pa.array(range(offset, offset + n), pa.int64()),
        "_src_seq": pa.array([0] * n, pa.int32()),
        "_src_ts": pa.nulls(n, pa.int64()),
        "_error": pa.nulls(n, pa.string()),
        "_raw_key": pa.nulls(n, pa.binary()),
        "_raw_value": pa.nulls(n, pa.binary()),
    }, schema=output_schema(USER))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--changes", type=int, default=10_000)
    ap.add_argument("--commits", type=int, default=5)
    ap.add_argument("--load-files", type=int, default=1)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cat = CatalogConfig(type="sql", uri=f"sqlite:///{tmp}/cat.db", warehouse=f"{tmp}/wh")
        sink = IcebergSink("bench.state", cat.access(None), "bench.state", mode="state",
                           key=("id",), rows_per_file=-(-a.keys // a.load_files))
        sink.ensure(USER)
        t0 = time.perf_counter()
        st = sink.stager()
        staged = st.stage("load", 0, rows(list(range(a.keys)), 0, 1, 1, 0))
        state = SinkState(2, '"load"')
        t1 = time.perf_counter()
        sink.commit(staged, SinkState(), state)
        load_commit = time.perf_counter() - t1
        table = sink._load()
        size = int(table.current_snapshot().summary["total-files-size"])
        print(f"load: {a.keys:,} keys in {a.load_files} files, {size / 2**20:.1f} MiB, "
              f"{time.perf_counter() - t0:.1f} s (its commit {load_commit:.1f} s)")
        version = {}
        rng = random.Random(7)
        walls, per_row = [], []
        for c in range(a.commits):
            ids = rng.sample(range(a.keys), a.changes)
            into = 10 + c
            old = [version.get(i, 0) for i in ids]
            batch = []
            by_version: dict[int, list[int]] = {}
            for i, v in zip(ids, old, strict=True):
                by_version.setdefault(v, []).append(i)
            for v, vids in by_version.items():
                batch.append(rows(vids, v, into, -1, 0))
            batch.append(rows(ids, c + 1, into, 1, a.keys + c * a.changes))
            for i in ids:
                version[i] = c + 1
            staged = st.stage(f"c{c}", 0, pa.concat_tables(batch))
            new = SinkState(into + 1, f'"c{c}"')
            t = time.perf_counter()
            sink.commit(staged, state, new)
            wall = time.perf_counter() - t
            state = new
            table = sink._load()
            head = table.current_snapshot()
            written = 0
            snap = head
            while snap is not None and snap.summary.get("reclock.upper") == str(into + 1):
                written += int(snap.summary.get("added-files-size", "0"))
                parent = snap.parent_snapshot_id
                snap = None if parent is None else table.metadata.snapshot_by_id(parent)
            walls.append(wall)
            per_row.append(written / a.changes)
            print(f"commit {c}: {wall:.2f} s, wrote {written / 2**20:.1f} MiB, "
                  f"{written / a.changes:,.0f} bytes per changed row, table "
                  f"{int(head.summary['total-files-size']) / 2**20:.1f} MiB in "
                  f"{head.summary['total-data-files']} files")
        live = sink.read_updates().num_rows
        assert live == a.keys, live
        print(f"median: {statistics.median(walls):.2f} s per commit, "
              f"{statistics.median(per_row):,.0f} bytes written per changed row "
              f"({a.keys:,} keys, {a.changes:,} changes per commit)")


if __name__ == "__main__":
    main()
