"""An Iceberg state table's commits (``mode: state``), the way a pipeline
makes them each tick, copy-on-write against merge-on-read in one run: load
``--keys`` live keys (commits of a million), then ``--commits`` commits of
``--changes`` updates each (a retraction and an insertion per changed key,
random keys), staged and committed through the sink; then one compaction
pass, and the table checked against its model on a sample of keys.

Prints, per mode, the first commits' wall time, the bytes of files the
commit wrote (data and delete files) and those bytes per changed row; then
a table of both, and PASS/FAIL lines for the state-table targets:
freshness p99 at most 3 intervals (modelled: a change waits at most one
interval for its tick, then the tick stages and commits it; ticks must keep
up on average), and bytes written per changed row bounded (at most 4 times
the stored bytes of a row, whatever the table's size)::

    python bench/iceberg_state_bench.py                       # 1M keys, 10k changes, 10 commits
    python bench/iceberg_state_bench.py --keys 10000000 --modes merge-on-read
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

#: Bytes a commit may write per changed row, in stored bytes per live row of
#: the table: its new row and its position delete (a few bytes), with room
#: for a small file's Parquet overhead; rewriting unchanged rows grows past
#: it with the table.
BOUND_ROWS_PER_ROW = 4

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


def run(mode: str, a: argparse.Namespace, tmp: str) -> dict[str, float]:
    """Load and commit as the module docstring says, with ``write_mode`` ``mode``."""
    cat = CatalogConfig(type="sql", uri=f"sqlite:///{tmp}/cat.db", warehouse=f"{tmp}/wh")
    sink = IcebergSink("bench.state", cat.access(None), f"bench.{mode.replace('-', '_')}",
                       mode="state", key=("id",), rows_per_file=-(-a.keys // a.load_files),
                       write_mode=mode, index_path=f"{tmp}/{mode}-keys.sqlite")
    sink.ensure(USER)
    t0 = time.perf_counter()
    st = sink.stager()
    state = SinkState(2, '"load"')
    for n, lo in enumerate(range(0, a.keys, 1_000_000)):  # staged in parts of a million
        ids = list(range(lo, min(lo + 1_000_000, a.keys)))
        staged = st.stage("load", n, rows(ids, 0, 1, 1, lo))
        t1 = time.perf_counter()
        new = SinkState(2 + n, f'"load{n}"')
        sink.commit(staged, SinkState() if n == 0 else state, new)
        state = new
    load_commit = time.perf_counter() - t1
    table = sink._load()
    size = int(table.current_snapshot().summary["total-files-size"])
    print(f"[{mode}] load: {a.keys:,} keys, {size / 2**20:.1f} MiB, "
          f"{time.perf_counter() - t0:.1f} s (its last commit {load_commit:.1f} s)")
    version: dict[int, int] = {}
    rng = random.Random(7)
    walls, stages, per_row = [], [], []
    into = 2 + (a.keys - 1) // 1_000_000
    for c in range(a.commits):
        ids = rng.sample(range(a.keys), a.changes)
        into += 1
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
        t = time.perf_counter()
        staged = st.stage(f"c{c}", 0, pa.concat_tables(batch))
        stage = time.perf_counter() - t
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
        stages.append(stage)
        per_row.append(written / a.changes)
        if c < 3 or c == a.commits - 1:
            print(f"[{mode}] commit {c}: {wall:.2f} s (staging {stage:.2f} s), wrote "
                  f"{written / 2**20:.2f} MiB, {written / a.changes:,.0f} bytes per changed "
                  f"row, table {int(head.summary['total-files-size']) / 2**20:.1f} MiB in "
                  f"{head.summary['total-data-files']} data files, "
                  f"{head.summary.get('total-delete-files', '0')} delete files")
    t = time.perf_counter()
    done = sink.compact(min_files=a.compact_min_files)
    compact_s = time.perf_counter() - t
    print(f"[{mode}] compaction: {done} in {compact_s:.1f} s")
    got = sink.read_updates()
    assert got.num_rows == a.keys, got.num_rows
    want = {i: version.get(i, 0) for i in range(a.keys)}
    sample = rng.sample(range(a.keys), 1000)
    by_id = dict(zip(got.column("id").to_pylist(), got.column("note").to_pylist(), strict=True))
    for i in sample:  # the table against its model, on a sample
        assert by_id[i] == hashlib.sha256(b"%d:%d" % (i, want[i])).hexdigest()[:32], i
    sink.close()
    tick = sorted(w + st_ for w, st_ in zip(walls, stages, strict=True))
    walls.sort()
    p99 = min(len(walls) - 1, int(len(walls) * 0.99))
    return {"row_bytes": size / a.keys, "median": statistics.median(walls), "p99": walls[p99],
            "tick_p99": tick[p99],
            "mean_tick": statistics.mean(tick),
            "bytes_per_row": statistics.median(per_row), "compact_s": compact_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--changes", type=int, default=10_000)
    ap.add_argument("--commits", type=int, default=10)
    ap.add_argument("--load-files", type=int, default=1)
    ap.add_argument("--interval", type=float, default=1.0, help="the output's interval (s)")
    ap.add_argument("--compact-min-files", type=int, default=2)
    ap.add_argument("--modes", default="copy-on-write,merge-on-read")
    a = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in a.modes.split(","):
            results[mode] = run(mode, a, tmp)
    print(f"\n{a.keys:,} keys, {a.changes:,} changes per commit, {a.commits} commits, "
          f"interval {a.interval:g} s")
    print(f"{'mode':<15}{'median s':>10}{'p99 s':>8}{'B/row':>9}{'fresh p99':>11}")
    for mode, r in results.items():
        # freshness: a change waits at most one interval for its tick, then
        # the tick stages and commits it (when ticks keep up: commit < interval)
        fresh = a.interval + r["tick_p99"]
        print(f"{mode:<15}{r['median']:>10.2f}{r['p99']:>8.2f}{r['bytes_per_row']:>9,.0f}"
              f"{fresh / a.interval:>10.1f}i")
    for mode, r in results.items():
        fresh = a.interval + r["tick_p99"]
        keeps_up = r["mean_tick"] < a.interval
        print(f"{'PASS' if fresh <= 3 * a.interval and keeps_up else 'FAIL'} [{mode}] "
              f"freshness p99 {fresh:.2f} s <= 3 intervals (modelled: an interval of "
              f"batching + the p99 of stage and commit), ticks keep up (stage + commit "
              f"{r['mean_tick']:.2f} s on average < {a.interval:g} s)")
        bound = BOUND_ROWS_PER_ROW * r["row_bytes"]
        print(f"{'PASS' if r['bytes_per_row'] <= bound else 'FAIL'} [{mode}] "
              f"{r['bytes_per_row']:,.0f} bytes written per changed row <= {bound:,.0f} "
              f"({BOUND_ROWS_PER_ROW} x the {r['row_bytes']:.0f} stored bytes of a row: "
              "no rewrite of unchanged rows)")
    if len(results) == 2:
        cow, mor = results["copy-on-write"], results["merge-on-read"]
        print(f"merge-on-read vs copy-on-write: commit {cow['median'] / mor['median']:.1f}x "
              f"faster, {cow['bytes_per_row'] / mor['bytes_per_row']:.0f}x fewer bytes per "
              "changed row")


if __name__ == "__main__":
    main()
