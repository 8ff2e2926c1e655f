"""Postgres CDC benchmark: throughput and freshness, beside pgbench writers.

One command. It starts a private PostgreSQL cluster (``wal_level=logical``,
the Debian binaries, as the tests do), one SparkSession (``local[2]``, warm
before anything is timed) and measures, for transactions of 1 row and of 100
rows (``pgbench`` custom scripts, 2 clients):

1. **Writers alone**: the rate at which ``pgbench`` commits with no pipeline
   running (transactions/s, changes/s), into an unpublished twin table.
2. **Throughput**: a backlog of ``--changes`` changes is committed while the
   pipeline is stopped; then the pipeline starts (Spark already warm) and
   catches up into a Postgres table sink (update-log mode). Changes/s = the
   backlog / the time from start until the sink's upper passes the backlog's
   last commit (start-up of the source and the first interval included);
   "after the first job" is the rate of the changes read after the first data
   job ended (progress log), i.e. without start-up.
3. **Freshness**: ``pgbench --rate`` writers at a fixed rate while the
   pipeline runs; a probe commits one row every 50 ms and records when the
   commit returned and its LSN; a poller reads the sink's durable frontier
   (``reclock_uppers.progress``) every 10 ms. Freshness = first poll that
   holds the probe - commit time; p50 / p99 over the window.

Target (issue 5): at least 40,000 changes/s through the pipeline, and p50
freshness under 1.5 x ``timestamp_interval``.

Run: ``python bench/cdc_bench.py`` (about 3 minutes) or ``--quick``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg
from pipeline_bench import table

from reclock.config import load_config
from reclock.core.time import Lsn
from reclock.pipeline import run
from tests.pgcluster import PgCluster

TARGET_RATE = 40_000
TX1 = "INSERT INTO bench (v) VALUES (random());\n"
TX100 = "INSERT INTO bench (v) SELECT random() FROM generate_series(1, 100);\n"

PIPELINE = """
state_dir: {state}
timestamp_interval: {interval}ms
progress_log: true
spark:
  master: local[2]
sources:
  - name: cdc
    postgres: {{dsn: "{url}", tables: [bench, probe], snapshot: false}}
    outputs:
      - name: bench
        sink: {{type: postgres, dsn: "{url}", table: bench_log}}
      - name: probe
        sink: {{type: postgres, dsn: "{url}", table: probe_log}}
"""


def pgbench(url: str, script: str, clients: int, *, seconds: float | None = None,
            transactions: int | None = None, rate: float | None = None) -> float:
    """Run pgbench with ``script``; returns transactions/s (excluding connecting)."""
    binary = sorted(glob.glob("/usr/lib/postgresql/*/bin/pgbench"))[-1]
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
        f.write(script)
    args = [binary, "-n", "-f", f.name, "-c", str(clients), "-j", str(clients)]
    if seconds is not None:
        args += ["-T", str(int(seconds))]
    if transactions is not None:
        args += ["-t", str(transactions)]
    if rate is not None:
        args += ["-R", str(rate)]
    out = subprocess.run([*args, url], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    for line in out.splitlines():
        if line.startswith("tps =") and "without" in line:
            return float(line.split()[2])
        if line.startswith("tps ="):
            tps = float(line.split()[2])
    return tps


def lsn_now(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as c:
        (text,) = c.execute("select pg_current_wal_insert_lsn()::text").fetchone() or ("",)
    return int(Lsn.parse(text))


def held(conn: psycopg.Connection[Any], output: str) -> int:
    try:
        row = conn.execute("select progress from reclock_uppers where output = %s",
                           (output,)).fetchone()
    except psycopg.errors.UndefinedTable:
        return 0
    if row is None or row[0] is None:
        return 0
    return int(Lsn.parse(json.loads(row[0])[0]))


class Pipeline:
    """The pipeline in a background thread of this process."""

    def __init__(self, cfg: Any, spark: Any) -> None:
        self.stop = threading.Event()
        self.runners: list[Any] = []
        self.thread = threading.Thread(target=run, kwargs=dict(
            cfg=cfg, spark=spark, stop=self.stop, out=None, install_signals=False,
            on_ready=self.runners.extend), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)


def wait_held(url: str, output: str, lsn: int, timeout: float) -> float:
    t0 = time.monotonic()
    with psycopg.connect(url, autocommit=True) as c:
        while held(c, output) < lsn:
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{output} did not reach {lsn}")
            time.sleep(0.01)
    return time.monotonic()


def first_read(state: Path, after_ms: int) -> tuple[int, int] | None:
    """(wall time in ms, records) of the first progress-log read event with records."""
    path = state / "progress.jsonl"
    for line in path.read_text().splitlines():
        ev = json.loads(line)
        if ev.get("kind") == "read" and ev.get("records") and ev.get("ts", 0) >= after_ms:
            return int(ev["ts"]), int(ev["records"])
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--changes", type=int, default=600_000, help="backlog size per shape")
    ap.add_argument("--interval", type=int, default=1000, help="timestamp_interval in ms")
    ap.add_argument("--fresh-seconds", type=float, default=15.0)
    ap.add_argument("--quick", action="store_true", help="smaller backlog and window")
    args = ap.parse_args()
    if args.quick:
        args.changes, args.fresh_seconds = 200_000, 8.0
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from reclock.runtime.spark import spark_session

    cluster = PgCluster().start()
    url = cluster.url
    rows: list[list[str]] = []
    ok = True
    try:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("create table bench (id bigserial primary key, v float8, "
                      "at timestamptz default clock_timestamp())")
            c.execute("alter table bench replica identity full")
            c.execute("create table solo (id bigserial primary key, v float8, "
                      "at timestamptz default clock_timestamp())")
            c.execute("create table probe (id bigserial primary key, at timestamptz)")
            c.execute("alter table probe replica identity full")
        spark = spark_session("local[2]", "cdc-bench", {})
        spark.sparkContext.parallelize(range(4), 2).count()  # warm
        tmp = Path(tempfile.mkdtemp(prefix="cdc-bench-"))
        cfg_path = tmp / "p.yaml"
        cfg_path.write_text(PIPELINE.format(state=tmp / "state", url=url,
                                            interval=args.interval))
        cfg = load_config(cfg_path)
        # create slot and publication (no snapshot), then stop
        p = Pipeline(cfg, spark)
        wait_held(url, "cdc.bench", 1, 120)
        p.close()
        shapes = (("tx of 1 row", TX1, 1), ("tx of 100 rows", TX100, 100))
        for shape, script, per_tx in shapes:
            n_tx = args.changes // per_tx // 2
            pgbench(url, script, 2, transactions=n_tx)  # the backlog
            target = lsn_now(url)
            changes = n_tx * 2 * per_tx
            t0_ms = int(time.time() * 1000)
            t0 = time.monotonic()
            p = Pipeline(cfg, spark)
            t1 = wait_held(url, "cdc.bench", target, 900)
            t1_ms = int(time.time() * 1000)
            p.close()
            rate = changes / (t1 - t0)
            fr = first_read(tmp / "state", t0_ms)
            read_rate = ((changes - fr[1]) / ((t1_ms - fr[0]) / 1000)
                         if fr and t1_ms > fr[0] and changes > fr[1] else float("nan"))
            ok &= rate >= TARGET_RATE
            rows.append([shape, "", f"{rate:,.0f} changes/s ({changes:,} in {t1 - t0:.1f} s)",
                         f"{read_rate:,.0f}", "PASS" if rate >= TARGET_RATE else "MISS"])
        # the writers alone, into an unpublished twin table, after the catch-up
        # runs (the pipeline decodes this WAL too, but only in the freshness part)
        for row, (_, script, per_tx) in zip(rows, shapes, strict=True):
            tps = pgbench(url, script.replace("bench", "solo"), 2, seconds=5)
            row[1] = f"{tps:,.0f} tx/s = {tps * per_tx:,.0f} changes/s"
        # freshness
        fresh: list[tuple[str, ...]] = []
        for shape, script, tps in (("10k changes/s in tx of 100", TX100, 100),
                                   ("2k changes/s in tx of 1", TX1, 2000)):
            p = Pipeline(cfg, spark)
            wait_held(url, "cdc.probe", lsn_now(url), 120)
            probes: list[tuple[float, int]] = []
            lat: list[float] = []
            stop = threading.Event()

            def probe(stop: threading.Event = stop,
                      probes: list[tuple[float, int]] = probes) -> None:
                with psycopg.connect(url, autocommit=True) as c:
                    while not stop.is_set():
                        c.execute("insert into probe (at) values (now())")
                        done = time.time()
                        (t,) = c.execute("select pg_current_wal_insert_lsn()::text"
                                         ).fetchone() or ("",)
                        probes.append((done, int(Lsn.parse(t))))
                        time.sleep(0.05)

            def poll(stop: threading.Event = stop, probes: list[tuple[float, int]] = probes,
                     lat: list[float] = lat) -> None:
                pending = 0
                with psycopg.connect(url, autocommit=True) as c:
                    while not stop.is_set() or pending < len(probes):
                        h = held(c, "cdc.probe")
                        now = time.time()
                        while pending < len(probes) and probes[pending][1] <= h:
                            lat.append(now - probes[pending][0])
                            pending += 1
                        time.sleep(0.01)

            threads = [threading.Thread(target=probe), threading.Thread(target=poll)]
            for t in threads:
                t.start()
            pgbench(url, script, 2, seconds=args.fresh_seconds, rate=tps)
            stop.set()
            for t in threads:
                t.join(120)
            p.close()
            lat.sort()
            p50 = statistics.median(lat) * 1000
            p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000
            good = p50 < 1.5 * args.interval
            ok &= good
            fresh.append((shape, str(len(lat)), f"{p50:,.0f}", f"{p99:,.0f}",
                          f"{1.5 * args.interval:,.0f}", "PASS" if good else "MISS"))
    finally:
        cluster.stop()
    print()
    print(table(f"CDC throughput (target >= {TARGET_RATE:,} changes/s), 2 pgbench clients, "
                "Postgres table sink (update log)",
                ("shape", "pgbench writers alone", "pipeline catch-up", "after the first job",
                 "target"), rows, left=(0, 1, 2)))
    print()
    print(table(f"Freshness, commit -> durable in the sink (timestamp_interval "
                f"{args.interval} ms)",
                ("writers", "probes", "p50 ms", "p99 ms", "target p50 <", ""), fresh))
    return 0  # a missed target is reported in the table, not the exit status


if __name__ == "__main__":
    sys.exit(main())
