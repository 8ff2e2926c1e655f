"""Soak of the generative fault harness (tests/generative.py): run after run,
each with a new seed, for ``--minutes``, against a real Kafka broker and a
private PostgreSQL cluster it starts itself, on one Spark session (local[2]).

Prints one line per run (seed, sequences, records, faults armed by kind,
lost, doubled, wrong, seconds) and a total; exits 1 if anything was lost,
doubled or wrong, with the first samples.

    python bench/generative_soak.py                    # 30 minutes, 200 sequences a run
    python bench/generative_soak.py --minutes 5 --sequences 400 --seed 7
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
    args = ap.parse_args()

    import psycopg

    from reclock.spark import spark_session
    from tests.generative import run
    from tests.kafkabroker import KafkaCluster
    from tests.pgcluster import PgCluster

    kafka = KafkaCluster(nodes=1).start()
    pg = PgCluster().start()
    spark = spark_session("local[2]", "reclock-soak", {"spark.sql.shuffle.partitions": "2"})
    total: Counter[str] = Counter()
    samples: list[str] = []
    header = (f"{'seed':>8} {'sequences':>9} {'records':>8} {'faults (stage/commit/source)':>29}"
              f" {'lost':>5} {'doubled':>7} {'wrong':>5} {'seconds':>8}")
    print(header)
    print("-" * len(header))
    deadline = time.monotonic() + args.minutes * 60
    seed = args.seed
    runs = 0
    try:
        while time.monotonic() < deadline or runs == 0:
            db = f"soak_{uuid.uuid4().hex[:8]}"
            with psycopg.connect(pg.url, autocommit=True) as c:
                c.execute(f'CREATE DATABASE "{db}"')
            url = pg.url.rsplit("/", 1)[0] + f"/{db}"
            started = time.monotonic()
            with tempfile.TemporaryDirectory(prefix="reclock-soak-") as tmp:
                out = run(Path(tmp), spark, kafka, url, seed, args.sequences)
            took = time.monotonic() - started
            f = out.faults
            print(f"{seed:>8} {out.sequences:>9} {out.records:>8} "
                  f"{f['stage']:>9}/{f['commit']}/{f['source']:<13} {out.lost:>5} "
                  f"{out.doubled:>7} {out.wrong:>5} {took:>8.1f}", flush=True)
            total.update(sequences=out.sequences, records=out.records, lost=out.lost,
                         doubled=out.doubled, wrong=out.wrong, faults=sum(f.values()))
            samples.extend(out.samples)
            runs += 1
            seed += 1
    finally:
        spark.stop()
        kafka.close()
        pg.stop()
    print("-" * len(header))
    print(f"{runs} runs: {total['sequences']:,} sequences, {total['records']:,} records, "
          f"{total['faults']:,} faults armed; lost {total['lost']}, doubled "
          f"{total['doubled']}, wrong {total['wrong']}")
    for s in samples[:10]:
        print("  " + s)
    return 1 if total["lost"] or total["doubled"] or total["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
