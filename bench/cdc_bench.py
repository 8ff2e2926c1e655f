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

4. **Initial snapshot** of a ``--snapshot-rows`` table (5 million rows of
   ``id bigint primary key, v float8, pad text``): reclock (its parallel
   ctid-range COPY) into a Delta table and into a Kafka topic, from the start
   of the pipeline until the resumption frontier passes the snapshot.

5. **MariaDB beside Postgres**: the same catch-up measurement against a
   private ``mariadbd`` (ROW binary log with full images and metadata, as the
   tests start it: ``tests/mariadb.py``) with the ``mysql`` source, into the
   same kind of sink (a Postgres table, update log). The backlogs are written
   by ``mariadb-slap`` (2 clients, autocommit: one transaction per statement;
   100 rows per transaction by ``INSERT ... SELECT ... FROM seq_1_to_100``)
   while the pipeline is stopped; "writers alone" is their rate (the binary
   log is written whatever reads it). Its rows sit in the throughput table
   under Postgres's. ``--skip-mariadb`` leaves it out.

Beside reclock, **Debezium** (3.6, its PostgreSQL connector in Kafka Connect
standalone, 4.3; ``bench/peers/debezium/pom.xml``, resolved once with Maven
into ``--cache-dir``) runs the same workloads against a real Kafka broker
(one KRaft node, the tests' jars): the same backlogs (its own slot, made
before them), the same freshness probes (fresh when the change event can be
read from Kafka; its producer writes with ``acks=all``), and the same table's
snapshot (``snapshot.mode=initial``). It runs at the settings Debezium's
documentation gives for throughput: ``max.batch.size`` 16384,
``max.queue.size`` 65536, ``poll.interval.ms`` 50, ``snapshot.fetch.size``
50000 (one snapshot thread: the fastest on 2 cores), and its worker's
producer batches with ``linger.ms=10``, ``batch.size=256 KiB`` and lz4; it
writes JSON without schemas. ``--skip-debezium`` measures reclock alone.

Targets: at least 40,000 changes/s through the pipeline and p50 freshness
under 1.5 x ``timestamp_interval`` (issue 5); catch-up at least 5x and the
snapshot at least 3x Debezium's (issue 15).

Run: ``python bench/cdc_bench.py`` (about 20 minutes with Debezium) or
``--quick`` (200,000 changes, a 1-million-row snapshot); ``--catch-up-only``
measures the throughput rows alone (no writers-alone rate, freshness,
MariaDB or snapshot), for comparing two builds back to back.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg
from pipeline_bench import table

from reclock.config import load_config
from reclock.core.frontier import Antichain
from reclock.core.time import Lsn
from reclock.pipeline import run
from reclock.sources.mysql import gtid
from tests.mariadb import MariaDB, _bin
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


def catch_up(cfg: Any, spark: Any, state: Path, changes: int, held: Callable[[], float]
             ) -> tuple[float, float | None]:
    """Start the pipeline on a backlog of ``changes`` and stop it once
    ``held()`` returns (the monotonic time the sink held the backlog's end):
    the seconds that took, and the rate after the first job (None when the
    first job read it all)."""
    t0_ms = int(time.time() * 1000)
    t0 = time.monotonic()
    p = Pipeline(cfg, spark)
    t1 = held()
    t1_ms = int(time.time() * 1000)
    p.close()
    fr = first_read(state, t0_ms)
    after_first = ((changes - fr[1]) / ((t1_ms - fr[0]) / 1000)
                   if fr and t1_ms > fr[0] and changes > fr[1] else None)
    return t1 - t0, after_first


def first_read(state: Path, after_ms: int) -> tuple[int, int] | None:
    """(wall time in ms, records) of the first progress-log read event with records."""
    path = state / "progress.jsonl"
    for line in path.read_text().splitlines():
        ev = json.loads(line)
        if ev.get("kind") == "read" and ev.get("records") and ev.get("ts", 0) >= after_ms:
            return int(ev["ts"]), int(ev["records"])
    return None


# -- Debezium (Kafka Connect standalone) ------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
DEBEZIUM_POM = ROOT / "bench" / "peers" / "debezium" / "pom.xml"
LOG4J2 = """status = error
appender.file.type = File
appender.file.name = file
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = %d %p %c{{1}} %m%n
rootLogger.level = info
rootLogger.appenderRef.file.ref = file
"""


def debezium_libs(cache: Path) -> Path:
    """Debezium's connector and Kafka Connect, resolved once with Maven."""
    import hashlib
    import shutil

    dest = cache / "debezium"
    want = hashlib.sha256(DEBEZIUM_POM.read_bytes()).hexdigest()
    stamp = dest / "pom.sha256"
    if stamp.exists() and stamp.read_text() == want and (dest / "libs").is_dir():
        return dest / "libs"
    print(f"resolving {DEBEZIUM_POM} with Maven into {dest} ...", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix="debezium-", dir=cache))
    done = subprocess.run(["mvn", "-B", "-q", "-Dstyle.color=never", "-f", str(DEBEZIUM_POM),
                           "dependency:copy-dependencies", f"-DoutputDirectory={tmp / 'libs'}",
                           "-Dmdep.useBaseVersion=true"], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"Maven could not resolve Debezium: {done.stdout[-1500:]}")
    (tmp / "pom.sha256").write_text(want)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest / "libs"


class Debezium:
    """Debezium's PostgreSQL connector in Kafka Connect standalone, writing
    JSON change events (no schemas) to ``dbz.public.<table>`` on ``bootstrap``;
    its offsets in a file, flushed every second. ``slot``/``publication``
    exist beforehand (the benchmark makes them), so a run streams from where
    the previous one stopped; ``snapshot`` is Debezium's ``snapshot.mode``."""

    def __init__(self, libs: Path, work: Path, url: str, bootstrap: str, tables: list[str],
                 snapshot: str = "no_data", slot: str = "debezium",
                 publication: str = "dbz_publication") -> None:
        from urllib.parse import urlsplit

        u = urlsplit(url)
        self.libs, self.work = libs, work
        work.mkdir(parents=True, exist_ok=True)
        (work / "worker.properties").write_text("\n".join([
            f"bootstrap.servers={bootstrap}",
            "key.converter=org.apache.kafka.connect.json.JsonConverter",
            "value.converter=org.apache.kafka.connect.json.JsonConverter",
            "key.converter.schemas.enable=false", "value.converter.schemas.enable=false",
            f"offset.storage.file.filename={work / 'offsets'}",
            "offset.flush.interval.ms=1000",
            "producer.linger.ms=10", "producer.batch.size=262144",
            "producer.compression.type=lz4",
            "listeners=http://127.0.0.1:0",
        ]) + "\n")
        (work / "pg.properties").write_text("\n".join([
            "name=dbz", "connector.class=io.debezium.connector.postgresql.PostgresConnector",
            "tasks.max=1", f"database.hostname={u.hostname}", f"database.port={u.port}",
            f"database.user={u.username}", "database.password=x",
            f"database.dbname={u.path.lstrip('/')}", "topic.prefix=dbz",
            "plugin.name=pgoutput", f"slot.name={slot}", f"publication.name={publication}",
            "publication.autocreate.mode=disabled",
            "table.include.list=" + ",".join(f"public.{t}" for t in tables),
            f"snapshot.mode={snapshot}",
            # Debezium's documented settings for throughput, not its defaults
            # (2,048 records a batch, a 500 ms poll): catch-up and snapshots
            # as its users tune them
            "max.batch.size=16384", "max.queue.size=65536", "poll.interval.ms=50",
            "snapshot.fetch.size=50000",
        ]) + "\n")
        (work / "log4j2.properties").write_text(LOG4J2.format(log=work / "connect.log"))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        self.proc = subprocess.Popen(
            ["java", "-Xms512m", "-Xmx1g",
             f"-Dlog4j2.configurationFile={self.work / 'log4j2.properties'}",
             "-cp", f"{self.libs}/*", "org.apache.kafka.connect.cli.ConnectStandalone",
             str(self.work / "worker.properties"), str(self.work / "pg.properties")],
            stdout=(self.work / "stdout.log").open("ab"), stderr=subprocess.STDOUT,
            start_new_session=True)
        return time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self) -> str:
        text = (self.work / "connect.log").read_text(errors="replace").splitlines()
        return " | ".join(t for t in text if " ERROR " in t or "Exception" in t)[-1500:]

    def stop(self) -> None:
        import signal

        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None


class TopicCount:
    """Records in a topic (the sum of its partitions' high watermarks)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        from confluent_kafka import Consumer

        self.topic = topic
        self.c = Consumer({"bootstrap.servers": bootstrap, "group.id": "cdc-bench-count",
                           "log_level": 3})

    def __call__(self) -> int:
        from confluent_kafka import KafkaException, TopicPartition

        try:
            meta = self.c.list_topics(self.topic, timeout=5).topics.get(self.topic)
            if meta is None or meta.error is not None:
                return 0
            return sum(self.c.get_watermark_offsets(TopicPartition(self.topic, p), timeout=5,
                                                    cached=False)[1]
                       for p in meta.partitions)
        except KafkaException:
            return 0

    def close(self) -> None:
        self.c.close()


def wait_count(count: TopicCount, base: int, n: int, dbz: Debezium, timeout: float
               ) -> tuple[float, float | None]:
    """Wait until ``n`` records beyond ``base`` are in the topic: (the time it
    got there, the time the first of them appeared)."""
    t0 = time.monotonic()
    first = None
    while True:
        got = count() - base
        now = time.monotonic()
        if first is None and got > 0:
            first = now
        if got >= n:
            return now, first
        if not dbz.alive():
            raise RuntimeError(f"Debezium exited: {dbz.tail()}")
        if now - t0 > timeout:
            raise TimeoutError(f"Debezium: {got:,} of {n:,} records after {timeout:.0f} s")
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--changes", type=int, default=600_000, help="backlog size per shape")
    ap.add_argument("--interval", type=int, default=1000, help="timestamp_interval in ms")
    ap.add_argument("--fresh-seconds", type=float, default=15.0)
    ap.add_argument("--quick", action="store_true", help="smaller backlog and window")
    ap.add_argument("--snapshot-rows", type=int, default=5_000_000,
                    help="rows of the table whose initial snapshot is timed")
    ap.add_argument("--skip-debezium", action="store_true", help="reclock only")
    ap.add_argument("--skip-mariadb", action="store_true", help="Postgres only")
    ap.add_argument("--catch-up-only", action="store_true",
                    help="the catch-up rows only (implies --skip-mariadb)")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "reclock-peer-bench",
                    help="where Debezium's jars are kept")
    args = ap.parse_args()
    if args.quick:
        args.changes, args.fresh_seconds, args.snapshot_rows = 200_000, 8.0, 1_000_000
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from reclock.runtime.spark import spark_session

    cluster = PgCluster().start()
    url = cluster.url
    rows: list[list[str]] = []
    fresh: list[tuple[str, ...]] = []
    snaps: list[list[str]] = []
    dbz_err = None
    broker = None
    libs = None
    try:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("create table bench (id bigserial primary key, v float8, "
                      "at timestamptz default clock_timestamp())")
            c.execute("alter table bench replica identity full")
            c.execute("create table solo (id bigserial primary key, v float8, "
                      "at timestamptz default clock_timestamp())")
            c.execute("create table probe (id bigserial primary key, at timestamptz)")
            c.execute("alter table probe replica identity full")
        if not args.skip_debezium:
            try:
                args.cache_dir.mkdir(parents=True, exist_ok=True)
                libs = debezium_libs(args.cache_dir)
                from tests.kafkabroker import KafkaCluster

                broker = KafkaCluster(1, partitions=1, jvm=(
                    "-Xms1g", "-Xmx1g", "-XX:+UseG1GC")).start()
                with psycopg.connect(url, autocommit=True) as c:
                    c.execute("create publication dbz_publication for table bench, probe")
                    c.execute("select pg_create_logical_replication_slot('debezium', "
                              "'pgoutput')")
            except Exception as exc:
                dbz_err = f"{type(exc).__name__}: {exc}"
                print(f"Debezium: {dbz_err}", file=sys.stderr)
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
        use_dbz = broker is not None and libs is not None
        dbz = Debezium(libs, tmp / "debezium", url, broker.bootstrap,  # type: ignore[arg-type]
                       ["bench", "probe"]) if use_dbz else None
        bench_count = TopicCount(broker.bootstrap, "dbz.public.bench") if use_dbz else None
        shapes = (("tx of 1 row", TX1, 1), ("tx of 100 rows", TX100, 100))
        for shape, script, per_tx in shapes:
            n_tx = args.changes // per_tx // 2
            pgbench(url, script, 2, transactions=n_tx)  # the backlog
            target = lsn_now(url)
            changes = n_tx * 2 * per_tx
            took, read_rate = catch_up(cfg, spark, tmp / "state", changes,
                                       lambda t=target: wait_held(url, "cdc.bench", t, 900))
            rate = changes / took
            row = ["Postgres", shape, "", f"{rate:,.0f} changes/s ({changes:,} in {took:.1f} s)",
                   f"{read_rate if read_rate is not None else float('nan'):,.0f}",
                   "PASS" if rate >= TARGET_RATE else "MISS", "-", "-", "-"]
            if dbz is not None and bench_count is not None and dbz_err is None:
                try:
                    base = bench_count()
                    d0 = dbz.start()
                    d1, first = wait_count(bench_count, base, changes, dbz, 1800)
                    dbz.stop()
                    d_rate = changes / (d1 - d0)
                    row[6] = f"{d_rate:,.0f} changes/s ({d1 - d0:.1f} s)"
                    row[7] = (f"{changes / (d1 - first):,.0f}" if first is not None and d1 > first
                              else "-")
                    row[8] = f"{rate / d_rate:.1f}x"
                except Exception as exc:
                    dbz.stop()
                    dbz_err = f"{type(exc).__name__}: {exc}"
                    print(f"Debezium: {dbz_err}", file=sys.stderr)
            rows.append(row)
        if args.catch_up_only:
            raise _CatchUpDone
        # the writers alone, into an unpublished twin table, after the catch-up
        # runs (the pipeline decodes this WAL too, but only in the freshness part)
        for row, (_, script, per_tx) in zip(rows, shapes, strict=True):
            tps = pgbench(url, script.replace("bench", "solo"), 2, seconds=5)
            row[2] = f"{tps:,.0f} tx/s = {tps * per_tx:,.0f} changes/s (pgbench)"
        # freshness
        loads = (("10k changes/s in tx of 100", TX100, 100), ("2k changes/s in tx of 1", TX1, 2000))
        for shape, script, tps in loads:
            p = Pipeline(cfg, spark)
            wait_held(url, "cdc.probe", lsn_now(url), 120)
            lat = probe_freshness(url, script, tps, args.fresh_seconds,
                                  lambda c: held(c, "cdc.probe"))
            p.close()
            fresh.append(fresh_row("reclock", shape, lat, args.interval))
        if dbz is not None and dbz_err is None:
            for shape, script, tps in loads:
                try:
                    fresh.append(fresh_row("Debezium", shape, debezium_freshness(
                        dbz, broker.bootstrap, url, script, tps,  # type: ignore[union-attr]
                        args.fresh_seconds), None))
                except Exception as exc:
                    dbz.stop()
                    dbz_err = f"{type(exc).__name__}: {exc}"
                    print(f"Debezium: {dbz_err}", file=sys.stderr)
        if bench_count is not None:
            bench_count.close()
        if not args.skip_mariadb:
            rows += mariadb_rows(args, url, spark, tmp)
        # the initial snapshot of a large table
        snaps = snapshot_rows(args, url, spark, tmp, libs, broker, dbz_err)
    except _CatchUpDone:
        pass
    finally:
        if broker is not None:
            broker.close()
        cluster.stop()
    print()
    print(table(f"CDC throughput (target >= {TARGET_RATE:,} changes/s), 2 pgbench clients; "
                "reclock: Postgres table sink (update log); Debezium 3.6 (Kafka Connect "
                "standalone): JSON change events to a real Kafka broker",
                ("source", "shape", "writers alone", "reclock catch-up", "after the first job",
                 "target", "Debezium catch-up", "after its first record", "reclock / Debezium"),
                rows, left=(0, 1, 2, 3, 6)))
    print()
    print(table(f"Freshness, commit -> durable (reclock: in the sink, timestamp_interval "
                f"{args.interval} ms; Debezium: in Kafka, its throughput settings)",
                ("contender", "writers", "probes", "p50 ms", "p99 ms", "target p50 <", ""),
                fresh))
    if snaps:
        print()
        print(table(f"Initial snapshot of a {args.snapshot_rows:,}-row table (id bigint primary "
                    "key, v float8, pad text), from the start of the pipeline",
                    ("contender", "sink", "time s", "rows/s", "from the first row, rows/s",
                     "reclock / Debezium"), snaps, left=(0, 1)))
    if dbz_err:
        print(f"\nDebezium: DID NOT COMPLETE: {dbz_err}")
    return 0  # a missed target is reported in the table, not the exit status


class _CatchUpDone(Exception):
    """--catch-up-only: the throughput rows are measured."""


MY_PIPELINE = """
state_dir: {state}
timestamp_interval: {interval}ms
progress_log: true
spark:
  master: local[2]
sources:
  - name: my
    mysql: {{url: "{my_url}", tables: [bench], snapshot: false}}
    outputs:
      - name: bench
        sink: {{type: postgres, dsn: "{url}", table: my_bench_log}}
"""
MY_TX1 = "INSERT INTO bench (v) VALUES (rand())"
MY_TX100 = "INSERT INTO bench (v) SELECT rand() FROM seq_1_to_100"


def mariadb_slap(server: MariaDB, query: str, transactions: int) -> None:
    """``transactions`` statements (autocommit) from 2 ``mariadb-slap`` clients."""
    subprocess.run([_bin("mariadb-slap"), "--host=127.0.0.1", f"--port={server.port}",
                    "--user=root", "--concurrency=2", "--iterations=1",
                    f"--number-of-queries={transactions}", "--create-schema=bench",
                    "--no-drop", f"--query={query}"], check=True, capture_output=True)


def my_held(conn: psycopg.Connection[Any], output: str) -> gtid.Pos:
    """The GTID position an output of the MariaDB pipeline holds (its sink's upper)."""
    from reclock.sources.mysql.source import MySqlSource

    try:
        row = conn.execute("select progress from reclock_uppers where output = %s",
                           (output,)).fetchone()
    except psycopg.errors.UndefinedTable:
        return {}
    if row is None or row[0] is None:
        return {}
    return gtid.of(Antichain.decode(MySqlSource.kind, json.loads(row[0])))


def my_wait_held(url: str, output: str, target: gtid.Pos, timeout: float) -> float:
    t0 = time.monotonic()
    with psycopg.connect(url, autocommit=True) as c:
        while not gtid.le(target, my_held(c, output)):
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{output} did not reach {gtid.text(target)}")
            time.sleep(0.01)
    return time.monotonic()


def mariadb_rows(args: argparse.Namespace, url: str, spark: Any, tmp: Path) -> list[list[str]]:
    """The catch-up of MariaDB backlogs (``--changes`` per shape), measured as
    Postgres's: from starting the pipeline until the sink's upper passes the
    backlog's last GTID."""
    server = MariaDB().start()
    out: list[list[str]] = []
    try:
        server.execute("CREATE DATABASE bench",
                       "CREATE TABLE bench.bench (id bigint auto_increment primary key, "
                       "v double, at timestamp(6) default current_timestamp(6))")
        my_url = f"{server.url}bench"
        path = tmp / "my.yaml"
        path.write_text(MY_PIPELINE.format(state=tmp / "my-state", interval=args.interval,
                                           my_url=my_url, url=url))
        cfg = load_config(path)
        [(pos,)] = server.execute("SELECT @@gtid_binlog_pos")  # after the DDL: not empty
        p = Pipeline(cfg, spark)  # its start position (no snapshot), then stop
        my_wait_held(url, "my.bench", gtid.position(pos), 120)
        p.close()
        for shape, query, per_tx in (("tx of 1 row", MY_TX1, 1),
                                     ("tx of 100 rows", MY_TX100, 100)):
            n_tx = args.changes // per_tx
            w0 = time.monotonic()
            mariadb_slap(server, query, n_tx)  # the backlog
            w1 = time.monotonic()
            [(pos,)] = server.execute("SELECT @@gtid_binlog_pos")
            target = gtid.position(pos)
            changes = n_tx * per_tx
            took, read_rate = catch_up(cfg, spark, tmp / "my-state", changes,
                                       lambda t=target: my_wait_held(url, "my.bench", t, 900))
            rate = changes / took
            tps = n_tx / (w1 - w0)
            # "-": the whole backlog was one job (one binlog task)
            out.append(["MariaDB", shape,
                        f"{tps:,.0f} tx/s = {tps * per_tx:,.0f} changes/s (mariadb-slap)",
                        f"{rate:,.0f} changes/s ({changes:,} in {took:.1f} s)",
                        "-" if read_rate is None else f"{read_rate:,.0f}", "-", "-", "-", "-"])
    finally:
        server.stop()
    return out


def fresh_row(who: str, shape: str, lat: list[float], interval: int | None) -> tuple[str, ...]:
    lat = sorted(lat)
    if not lat:
        return (who, shape, "0", "-", "-", "-", "")
    p50 = statistics.median(lat) * 1000
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000
    if interval is None:
        return (who, shape, str(len(lat)), f"{p50:,.0f}", f"{p99:,.0f}", "-", "")
    good = p50 < 1.5 * interval
    return (who, shape, str(len(lat)), f"{p50:,.0f}", f"{p99:,.0f}", f"{1.5 * interval:,.0f}",
            "PASS" if good else "MISS")


def probe_freshness(url: str, script: str, tps: float, seconds: float,
                    durable_lsn: Any) -> list[float]:
    """Probes every 50 ms under ``pgbench`` writers; a probe is fresh when
    ``durable_lsn(conn)`` passes its commit LSN."""
    probes: list[tuple[float, int]] = []
    lat: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with psycopg.connect(url, autocommit=True) as c:
            while not stop.is_set():
                c.execute("insert into probe (at) values (now())")
                done = time.time()
                (t,) = c.execute("select pg_current_wal_insert_lsn()::text").fetchone() or ("",)
                probes.append((done, int(Lsn.parse(t))))
                time.sleep(0.05)

    def poll() -> None:
        pending = 0
        with psycopg.connect(url, autocommit=True) as c:
            while not stop.is_set() or pending < len(probes):
                h = durable_lsn(c)
                now = time.time()
                while pending < len(probes) and probes[pending][1] <= h:
                    lat.append(now - probes[pending][0])
                    pending += 1
                time.sleep(0.01)

    under_writers([probe, poll], stop, url, script, tps, seconds)
    return lat


def under_writers(work: list[Any], stop: threading.Event, url: str, script: str, tps: float,
                  seconds: float) -> None:
    """Run ``work`` in threads while ``pgbench`` writes at ``tps``; then set
    ``stop`` and wait for them."""
    threads = [threading.Thread(target=w) for w in work]
    for t in threads:
        t.start()
    pgbench(url, script, 2, seconds=seconds, rate=tps)
    stop.set()
    for t in threads:
        t.join(120)


def debezium_freshness(dbz: Debezium, bootstrap: str, url: str, script: str, tps: float,
                       seconds: float) -> list[float]:
    """Probes every 50 ms under ``pgbench`` writers; a probe is fresh when its
    change event can be read from ``dbz.public.probe`` (Debezium's producer
    uses acks=all: written is durable)."""
    from confluent_kafka import Consumer

    dbz.start()
    committed: dict[int, float] = {}
    lat: list[float] = []
    stop = threading.Event()
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"fresh-{time.time()}",
                         "auto.offset.reset": "latest", "enable.auto.commit": False,
                         "fetch.wait.max.ms": 10, "log_level": 3})
    consumer.subscribe(["dbz.public.probe"])
    # streaming once a first probe arrives
    with psycopg.connect(url, autocommit=True) as c:
        deadline = time.monotonic() + 180
        while True:
            c.execute("insert into probe (at) values (now())")
            msg = consumer.poll(1.0)
            if msg is not None and not msg.error():
                break
            if not dbz.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"Debezium did not stream probes: {dbz.tail()}")

    def probe() -> None:
        with psycopg.connect(url, autocommit=True) as c:
            while not stop.is_set():
                (pid,) = c.execute("insert into probe (at) values (now()) returning id"
                                   ).fetchone() or (0,)
                committed[int(pid)] = time.time()
                time.sleep(0.05)

    def read() -> None:
        quiet = 0.0
        while not stop.is_set() or (len(lat) < len(committed) and quiet < 10):
            msg = consumer.poll(0.05)
            now = time.time()
            if msg is None or msg.error() or msg.value() is None:
                quiet += 0.05
                continue
            quiet = 0.0
            after = json.loads(msg.value()).get("after") or {}
            at = committed.get(int(after.get("id", -1)))
            if at is not None:
                lat.append(now - at)

    under_writers([probe, read], stop, url, script, tps, seconds)
    consumer.close()
    dbz.stop()
    return lat


SNAPSHOT_PIPELINE = """
state_dir: {state}
timestamp_interval: 1s
spark:
  master: local[2]
sources:
  - name: snap
    postgres: {{dsn: "{url}", tables: [big], slot: reclock_snap}}
    outputs:
      - name: big
        sink: {sink}
"""


def snapshot_rows(args: argparse.Namespace, url: str, spark: Any, tmp: Path, libs: Path | None,
                  broker: Any, dbz_err: str | None) -> list[list[str]]:
    """The initial snapshot of ``--snapshot-rows`` rows: reclock into a Delta
    table and into a Kafka topic, Debezium into Kafka."""
    n = args.snapshot_rows
    print(f"loading {n:,} rows for the snapshot ...", file=sys.stderr)
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("create table big (id bigint primary key, v float8, pad text)")
        c.execute("insert into big select g, random(), md5(g::text) "
                  "from generate_series(1, %s) g", (n,))
        c.execute("vacuum analyze big")
    target = lsn_now(url)
    out: list[list[str]] = []
    sinks = [("Delta (file)", "file")]
    if broker is not None:
        sinks.append(("Kafka", f'{{type: kafka, bootstrap_servers: "{broker.bootstrap}", '
                               f"topic: reclock-big}}"))
        broker.create_topic("reclock-big", 1)
    for i, (label, sink) in enumerate(sinks):
        path = tmp / f"snap{i}.yaml"
        path.write_text(SNAPSHOT_PIPELINE.format(state=tmp / f"snap{i}", url=url, sink=sink))
        cfg = load_config(path)
        t0 = time.monotonic()
        p = Pipeline(cfg, spark)
        deadline = t0 + 1800
        while True:
            st = p.runners[0].status() if p.runners else {}
            resume = st.get("resume")
            if resume and int(Lsn.parse(resume[0])) >= target:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("reclock's snapshot did not finish")
            time.sleep(0.05)
        t1 = time.monotonic()
        p.close()
        # "-": the snapshot is one job, whose first rows become durable with
        # its last (reclock commits a binding's rows at once)
        out.append(["reclock", label, f"{t1 - t0:.1f}", f"{n / (t1 - t0):,.0f}", "-", ""])
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("select pg_drop_replication_slot(slot_name) from pg_replication_slots "
                      "where slot_name like '%%snap%%' and not active")
    if broker is not None and libs is not None and dbz_err is None:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("create publication dbz_snap for table big")
            c.execute("select pg_create_logical_replication_slot('dbz_snap', 'pgoutput')")
        dbz = Debezium(libs, tmp / "debezium-snap", url, broker.bootstrap, ["big"],
                       snapshot="initial", slot="dbz_snap", publication="dbz_snap")
        count = TopicCount(broker.bootstrap, "dbz.public.big")
        try:
            d0 = dbz.start()
            d1, first_at = wait_count(count, 0, n, dbz, 3600)
            rate = n / (d1 - d0)
            out.append(["Debezium", "Kafka", f"{d1 - d0:.1f}", f"{rate:,.0f}",
                        f"{n / (d1 - first_at):,.0f}" if first_at and d1 > first_at else "-",
                        ""])
            for row in out[:-1]:
                row[5] = f"{float(row[3].replace(',', '')) / rate:.1f}x"
        except Exception as exc:
            out.append(["Debezium", "Kafka", "-", "-", "-", f"failed: {exc}"[:200]])
        finally:
            dbz.stop()
            count.close()
    return out


if __name__ == "__main__":
    sys.exit(main())
