"""Soak of the generative harnesses (tests/generative.py, tests/world.py): run
after run, each with a new seed, for ``--minutes``, against a real Kafka
broker and a private PostgreSQL cluster (``wal_level=logical``) it starts
itself.

Runs take turns between three modes:

* ``in-process``: the pipeline in a thread, on one Spark session (local[2]),
  over every lane (Kafka append/upsert/debezium, Postgres CDC, generator),
  with stage, commit and source failures armed at random moments;
* ``killed``: ``reclock run`` processes started with random crash points and
  failures (rows the sink refuses too) and SIGKILLed at random moments, over
  every lane but the Postgres one;
* ``world``: changes of the world around the pipeline (tests/world.py):
  topics deleted and re-created (named, answered with ``reclock
  accept-recreated``, and by pattern), partitions added, a Kafka sink's
  progress topic deleted (answered with ``reclock resnapshot``), key-state
  files damaged, values moving between keys, new registry schema versions
  of an Avro topic (an optional field added, int promoted to long), and DDL
  on Postgres CDC tables into Delta (a column added with or without a
  default, dropped, renamed, widened int -> bigint; keyed by a primary key,
  and REPLICA IDENTITY FULL, whose refused changes are answered by dropping
  the output and the source's state); each with the driver running or
  stopped.

A schema registry (tests/registry.py) is started once for the soak.

Prints one line per run (mode, seed, sequences, records, faults, rows the
sinks refused as the model said, injected refusals, lost, doubled, wrong,
seconds), the faults and changes by kind, and a total; exits 1 if anything
was lost, doubled or wrong, with the first samples.

    python bench/generative_soak.py                    # 30 minutes, 200 sequences a run
    python bench/generative_soak.py --minutes 5 --sequences 400 --seed 7
    python bench/generative_soak.py --modes world      # world changes only
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--sequences", type=int, default=200)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    ap.add_argument("--modes", default="in-process,killed,world",
                    help="comma-separated, taken in turn")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]

    import psycopg

    from reclock.runtime.spark import spark_session
    from tests.generative import run, run_killed
    from tests.kafkabroker import KafkaCluster
    from tests.pgcluster import PgCluster
    from tests.registry import RegistryServer
    from tests.world import run as run_world

    kafka = KafkaCluster(nodes=1).start()
    pg = PgCluster(wal_level="logical").start()
    registry = RegistryServer()
    spark = spark_session("local[2]", "reclock-soak", {"spark.sql.shuffle.partitions": "2"})
    total: Counter[str] = Counter()
    by_kind: Counter[str] = Counter()
    samples: list[str] = []
    header = (f"{'mode':>10} {'seed':>8} {'sequences':>9} {'records':>8} {'faults':>6} "
              f"{'refused':>7} {'injected':>8} {'lost':>5} {'doubled':>7} {'wrong':>5} "
              f"{'seconds':>8}")
    print(header)
    print("-" * len(header))
    deadline = time.monotonic() + args.minutes * 60
    seed = args.seed
    runs = 0
    try:
        while time.monotonic() < deadline or runs == 0:
            mode = modes[runs % len(modes)]
            db = f"soak_{uuid.uuid4().hex[:8]}"
            with psycopg.connect(pg.url, autocommit=True) as c:
                c.execute(f'CREATE DATABASE "{db}"')
            url = pg.url.rsplit("/", 1)[0] + f"/{db}"
            started = time.monotonic()
            try:
                with tempfile.TemporaryDirectory(prefix="reclock-soak-") as tmp:
                    if mode == "killed":
                        out = run_killed(Path(tmp), kafka, url, seed, args.sequences // 2)
                    elif mode == "world":
                        out = run_world(Path(tmp), spark, kafka, url, registry.url, seed,
                                        args.sequences)
                    else:
                        out = run(Path(tmp), spark, kafka, url, seed, args.sequences)
            finally:
                _drop(pg.url, db)
            took = time.monotonic() - started
            nf = sum(out.faults.values())
            print(f"{mode:>10} {seed:>8} {out.sequences:>9} "
                  f"{out.records:>8} {nf:>6} {out.refused:>7} {out.excused:>8} {out.lost:>5} "
                  f"{out.doubled:>7} {out.wrong:>5} {took:>8.1f}", flush=True)
            total.update(sequences=out.sequences, records=out.records, lost=out.lost,
                         doubled=out.doubled, wrong=out.wrong, faults=nf,
                         refused=out.refused, injected=out.excused)
            by_kind.update(out.faults)
            samples.extend(out.samples)
            runs += 1
            seed += 1
    finally:
        spark.stop()
        kafka.close()
        pg.stop()
        registry.close()
    print("-" * len(header))
    print(f"{runs} runs: {total['sequences']:,} sequences, {total['records']:,} records, "
          f"{total['faults']:,} faults, {total['refused']:,} refused rows, "
          f"{total['injected']:,} injected refusals; lost {total['lost']}, doubled "
          f"{total['doubled']}, wrong {total['wrong']}")
    print("faults and changes by kind: " + ", ".join(
        f"{k} {n}" for k, n in sorted(by_kind.items())))
    for s in samples[:10]:
        print("  " + s)
    return 1 if total["lost"] or total["doubled"] or total["wrong"] else 0


def _drop(admin: str, db: str) -> None:
    """Drop a run's database and its replication slots."""
    import psycopg

    with psycopg.connect(admin, autocommit=True) as c:
        for _ in range(50):
            c.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                      "WHERE database = %s AND active_pid IS NOT NULL", (db,))
            left = c.execute("SELECT slot_name FROM pg_replication_slots WHERE database = %s "
                             "AND NOT active", (db,)).fetchall()
            for (slot,) in left:
                c.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            if not c.execute("SELECT 1 FROM pg_replication_slots WHERE database = %s",
                             (db,)).fetchall():
                break
            time.sleep(0.2)
        c.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


if __name__ == "__main__":
    sys.exit(main())
