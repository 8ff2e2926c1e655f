"""kill -9 a MariaDB pipeline twice (the first kill during the initial snapshot)
while a writer commits random transactions: after the restarts, the outputs
equal the writer's own model of the tables and the tables themselves, nothing
is lost or doubled, and ``reclock verify`` is clean."""

from __future__ import annotations

import os
import random
import signal
import time
from decimal import Decimal
from pathlib import Path

import pytest

from reclock.config import load_config
from reclock.verify import verify_pipeline
from tests.running import (
    close_driver,
    read_updates,
    start_driver,
    status_sources,
    stop_driver,
    wait_exit,
    wait_running,
)
from tests.sources.cdc import output_rows
from tests.sources.mycdc import Writer, binlog_pos, create_schema, passed, source_rows
from tests.tally import count

PIPELINE = """
state_dir: {state}
timestamp_interval: 250ms
spark:
  master: local[2]
  max_records_per_task: 400
  conf:
    spark.driver.extraJavaOptions: "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
sources:
  - name: bank
    mysql: {{url: "{url}", tables: [acct, ledger], timeout: 10s}}
    outputs:
      - {{name: acct, sink: file}}
      - {{name: ledger, sink: file}}
"""


@pytest.mark.timeout(300)
def test_sigkill_mariadb_pipeline(tmp_path: Path, mariadb: object, mysql_url: str) -> None:
    model = create_schema(mysql_url, accounts=1000, ledger=3000)
    state = tmp_path / "state"
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(state=state, url=mysql_url))
    rng = random.Random(18)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    writer = Writer(mysql_url, model, seed=7, pause=0.004)
    kills = 0
    for i in range(2):
        proc = start_driver(path, env)
        try:
            if wait_running(state, proc):
                # the first kill lands while the snapshot is read (before it is durable)
                time.sleep(0.2 if i == 0 else rng.uniform(0.5, 1.5))
                proc.send_signal(signal.SIGKILL)
                kills += 1
            wait_exit(proc, 60)
        finally:
            close_driver(proc)
    txns = writer.stop()
    target = binlog_pos(mysql_url)
    proc = start_driver(path, env)
    try:
        wait_running(state, proc)
        deadline = time.monotonic() + 90
        while not passed(status_sources(state).get("bank", {}).get("resume"), target):
            assert proc.poll() is None, "the pipeline exited"
            assert time.monotonic() < deadline, status_sources(state)
            time.sleep(0.2)
    finally:
        rc, err = stop_driver(proc)
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert kills == 2 and txns > 100
    cfg = load_config(path)

    def acct(rows: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
        return sorted(((int(str(r[0])), r[1], Decimal(str(r[2])), r[3]) for r in rows),
                      key=repr)

    held = acct(output_rows(read_updates(cfg, "bank", "acct"), ["id", "owner", "bal", "note"]))
    assert held == acct(list(model.acct.values()))
    assert held == acct(source_rows(mysql_url, "select id, owner, bal, note from acct"))
    cols = ["txn", "acct", "amount", "tag"]
    state = read_updates(cfg, "bank", "ledger").group_by(cols).aggregate([("_diff", "sum")])
    have = sorted((tuple(r[c] for c in cols), r["_diff_sum"]) for r in state.to_pylist()
                  if r["_diff_sum"])
    want: dict[tuple[object, ...], int] = {}
    for r in model.ledger:
        want[r] = want.get(r, 0) + 1
    assert have == sorted(want.items(), key=repr) or sorted(have, key=repr) == sorted(
        want.items(), key=repr)
    [report] = verify_pipeline(cfg)
    assert report.ok, [(o.output, o.breaches, o.samples) for o in report.outputs]
    count("kill: mariadb cdc -> delta", sigkills=kills, transactions_checked=txns)
