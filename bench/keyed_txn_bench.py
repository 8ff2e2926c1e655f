"""One big transaction on a keyed table: memory of the driver, the JVM and
the workers while reclock lands it.

One command. It starts a private PostgreSQL cluster (as the tests do) and a
``reclock run`` of a Postgres CDC source whose table ``kv (id bigint primary
key, v text)`` is settled by key (the table has a primary key) into a Delta
output, then commits ``--rows`` rows in ONE transaction (``INSERT ... SELECT
generate_series``) and waits until the output holds them. While it runs it
samples, every 0.1 s (``big_records_bench.Sampler``, from ``/proc``), the
resident memory of the driver's Python process, of its JVM, and of the
largest Spark Python worker.

It also measures the CPU seconds the driver's Python process spent from the
commit until the rows landed (settling the intents is most of it; the JVM's
and the workers' are not counted).

It then checks the output, read back through its sink: every row once, all at
one ``_into_time`` (a transaction lands as a unit).

Variants (``--variants``), side by side in one run:

* ``now``: this checkout, ``spark.max_bytes_per_settle`` 32MiB: tasks write
  intents out by key bucket, the driver settles a few buckets at a time,
  a slice of intents at a time, against the SQLite key state.
* ``one-round``: this checkout with ``max_bytes_per_settle`` 512GiB: one
  round (all of the transaction's intents as Arrow in the driver at once).
* ``before``: the code of ``--before`` (default bfbb26a, the last revision
  that settled intents in one pass, before the key state moved to SQLite),
  checked out with ``git worktree`` and put first on ``PYTHONPATH``: tasks
  return every intent through Spark's results and the driver settles them in
  one Python pass against a dictionary of every key.

Target (issue 17): a 10M-row keyed transaction completes with driver RSS
under 1 GiB. Run: ``python bench/keyed_txn_bench.py`` (10 million rows, about
15 minutes on 2 cores) or ``--quick`` (1 million rows).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg
from big_records_bench import Sampler
from pipeline_bench import checkout, table

from tests.pgcluster import PgCluster
from tests.running import close_driver, stop_driver, wait_running

PIPELINE = """
state_dir: {state}
timestamp_interval: 1s
spark:
  master: local[2]
  max_bytes_per_settle: {settle}
  conf: {{spark.driver.memory: 1g}}
sources:
  - name: cdc
    postgres: {{dsn: "{url}", tables: [kv], snapshot: false}}
    outputs:
      - name: kv
        sink: file
"""

GIB = 2**30
MIB = 2**20


def output_check(state: Path, rows: int) -> tuple[int, int]:
    """(rows held, distinct _into_time values) of the output."""
    from deltalake import DeltaTable

    t = DeltaTable(str(state / "outputs" / "cdc" / "kv")).to_pyarrow_table(
        columns=["id", "_diff", "_into_time", "_error"])
    import pyarrow.compute as pc

    ok = t.filter(pc.is_null(t.column("_error")))
    held = int(pc.sum(ok.column("_diff")).as_py() or 0)
    ids = pc.count_distinct(ok.column("id")).as_py()
    if ids != rows or held != rows:
        raise AssertionError(f"output holds {held} rows of {ids} ids, expected {rows}")
    return held, len(pc.unique(ok.column("_into_time")))


def measure(url: str, rows: int, variant: str, settle: str, tmp: Path, timeout: float,
            code: Path | None = None) -> dict[str, Any]:
    state = tmp / f"state-{variant}"
    path = tmp / f"p-{variant}.yaml"
    text = PIPELINE.format(state=state, url=url, settle=settle)
    if code is not None:  # (older code may not know the setting)
        text = text.replace(f"  max_bytes_per_settle: {settle}\n", "")
    path.write_text(text)
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("drop table if exists kv")
        c.execute("create table kv (id bigint primary key, v text)")
        for (slot,) in c.execute("select slot_name from pg_replication_slots").fetchall():
            c.execute("select pg_drop_replication_slot(%s)", (slot,))
        for (pub,) in c.execute("select pubname from pg_publication").fetchall():
            c.execute(f'drop publication "{pub}"')
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYSPARK_PYTHON": sys.executable}
    if code is not None:
        env["PYTHONPATH"] = str(code)
    # (`python -m` puts the working directory first on sys.path: run it from
    # the code measured, or from elsewhere than this checkout's root)
    proc = subprocess.Popen([sys.executable, "-m", "reclock.cli", "run", str(path)], env=env,
                            cwd=str(code or tmp), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        if not wait_running(state, proc, 180):
            raise RuntimeError(f"reclock run exited: {stop_driver(proc)[1][-3000:]}")
        time.sleep(2)  # the empty table's first bindings
        with Sampler(proc.pid) as sampler:
            t0 = time.monotonic()
            with psycopg.connect(url) as c:
                c.execute("insert into kv select g, md5(g::text) from generate_series(1, %s) g",
                          (rows,))
            committed = time.monotonic()
            cpu0 = _cpu(proc.pid)
            landed = None
            while time.monotonic() - t0 < timeout:
                if proc.poll() is not None:
                    break
                if _landed(state, rows):
                    landed = time.monotonic()
                    cpu = _cpu(proc.pid) - cpu0
                    break
                time.sleep(0.5)
        rc, err = stop_driver(proc)
        if landed is None:
            raise RuntimeError(f"not landed in {timeout:.0f} s (driver exit {rc}): "
                               f"{err[-3000:]}")
        held, times = output_check(state, rows)
        return {"rows": held, "times": times, "insert_s": committed - t0,
                "land_s": landed - committed, "driver_cpu_s": cpu, **sampler.peak}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        close_driver(proc)


def _cpu(pid: int) -> float:
    """CPU seconds (user and system) the process ``pid`` has used (its own
    threads: the driver's Python, settling included; not the JVM's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _landed(state: Path, rows: int) -> bool:
    """The output has committed the transaction's rows (status.json)."""
    import json

    try:
        doc = json.loads((state / "status.json").read_text())
    except (OSError, ValueError):
        return False
    return any(out.get("rows", 0) >= rows
               for src in doc.get("sources", []) for out in src.get("outputs", []))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--quick", action="store_true", help="1 million rows")
    ap.add_argument("--variants", default="now,one-round,before")
    ap.add_argument("--before", default="bfbb26a", help="the commit of the 'before' variant")
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args()
    if args.quick:
        args.rows = 1_000_000
    settles = {"now": "32MiB", "one-round": "512GiB", "before": "32MiB"}
    cluster = PgCluster().start()
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="reclock-keyed-") as d:
            for v in args.variants.split(","):
                with contextlib.ExitStack() as stack:
                    code = (stack.enter_context(checkout(args.before, Path(d) / "before"))
                            if v == "before" else None)
                    try:
                        r = measure(cluster.url, args.rows, v, settles[v], Path(d),
                                    args.timeout, code)
                        results.append((v, r, None))
                    except Exception as exc:  # a variant that fails (out of memory) is a row
                        results.append((v, None, str(exc)[-300:]))
    finally:
        cluster.stop()
    rows = []
    for v, r, err in results:
        if r is None:
            rows.append([v, "-", "-", "-", "-", "-", "-", "-", f"failed: {err}"])
            continue
        ok = r["driver"] + r["jvm"] < GIB
        rows.append([v, f"{r['rows']:,}", f"{r['land_s']:.1f}",
                     f"{r['rows'] / max(r['land_s'], 1e-9):,.0f}", f"{r['driver_cpu_s']:.1f}",
                     f"{r['driver'] / MIB:,.0f}", f"{r['jvm'] / MIB:,.0f}",
                     f"{r['worker'] / MIB:,.0f}",
                     f"{'PASS' if ok else 'FAIL'} (one _into_time: {r['times'] == 1})"])
    print(table(f"One transaction of {args.rows:,} rows on a keyed table "
                "(Postgres CDC -> Delta, local[2])",
                ["variant", "rows", "land s", "rows/s", "driver CPU s", "driver MiB", "JVM MiB",
                 "worker MiB", "driver+JVM < 1 GiB"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
