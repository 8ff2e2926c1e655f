"""``reclock resnapshot``: Postgres outputs damaged behind reclock's back (rows
deleted and changed in their Delta tables by another writer) are read again
under a new snapshot while a writer keeps changing the tables, and end equal
to them; ``verify`` is clean, and the update logs stay valid histories (every
row held once, the replacement at one IntoTime)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from reclock.config import load_config
from reclock.core.columns import RESNAPSHOT_PART
from reclock.pipeline import Pipeline
from reclock.runtime.resnapshot import Requests
from reclock.verify import verify_pipeline
from tests.running import read_updates, running, wait_for
from tests.sources.cdc import (
    Writer,
    create_schema,
    flushed_lsn,
    output_rows,
    resumed_past,
    source_rows,
)

pytestmark = pytest.mark.integration

PIPELINE = """
state_dir: {tmp}/state
timestamp_interval: 300ms
spark: {{max_records_per_task: 3000}}
sources:
  - name: bank
    postgres: {{dsn: "{url}", tables: [acct, ledger]}}
    outputs:
      - {{name: acct, sink: file}}
      - {{name: ledger, sink: file}}
  - name: gen
    generator: {{kind: counter}}
    outputs: [{{name: n, sink: file}}]
"""

ACCT = ["id", "owner", "bal", "note"]
LEDGER = ["id", "txn", "acct", "amount", "tags", "at"]


def _held(cfg: Any, output: str, cols: list[str]) -> list[tuple[Any, ...]] | None:
    """The output's rows; None while its table does not exist yet (a driver
    that has not opened the output has created nothing)."""
    t = read_updates(cfg, "bank", output)
    return None if cols[0] not in t.column_names else output_rows(t, cols)


def _table(url: str, name: str, cols: list[str]) -> list[tuple[Any, ...]]:
    return sorted(source_rows(url, f"select {', '.join(cols)} from {name}"), key=repr)


def test_resnapshot_heals_damaged_outputs_under_concurrent_writes(
        tmp_path: Path, spark: Any, cdc_url: str) -> None:
    create_schema(cdc_url, accounts=600, ledger=3000)
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(tmp=tmp_path, url=cdc_url))
    cfg = load_config(path)
    outputs = tmp_path / "state" / "outputs" / "bank"
    with running(cfg, spark) as runners:
        writer = Writer(cdc_url, seed=11, accounts=600)
        wait_for(lambda: runners[0].status().get("resume") not in (None, ["0/0"]), 90,
                 "the first snapshot to be durable")
        time.sleep(1)
        writer.stop()
        wait_for(resumed_past(runners, flushed_lsn(cdc_url)), 90, "the outputs to catch up")
        assert _held(cfg, "acct", ACCT) == _table(cdc_url, "acct", ACCT)

        # Damage behind reclock's back: another Delta writer deletes and changes rows.
        acct = DeltaTable(str(outputs / "acct"))
        acct.delete("id % 7 = 0")
        acct.update(predicate="id = 3", updates={"owner": "'damaged'"})
        DeltaTable(str(outputs / "ledger")).delete("id % 5 = 0")
        assert _held(cfg, "acct", ACCT) != _table(cdc_url, "acct", ACCT)
        assert _held(cfg, "ledger", LEDGER) != _table(cdc_url, "ledger", LEDGER)

        # Ask for both while a writer changes the tables; the CLI for one of them.
        writer = Writer(cdc_url, seed=12, accounts=600, start=10_000)
        cli = subprocess.run([sys.executable, "-m", "reclock.cli", "resnapshot", str(path),
                              "bank", "acct"], capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0 and "re-snapshot requested" in cli.stdout, cli.stderr
        pipe = Pipeline(cfg)
        try:
            pipe.request_resnapshot("bank", "ledger")
        finally:
            pipe.close()
        requests = Requests(tmp_path / "state", "bank")
        wait_for(lambda: not requests.pending(), 90,
                 lambda: f"the resnapshots {requests.pending()}: {runners[0].health}")
        time.sleep(1)
        writer.stop()
        wait_for(resumed_past(runners, flushed_lsn(cdc_url)), 90, "the outputs to catch up")
        assert runners[0].health.status == "running", runners[0].health

    # The outputs equal their tables again: every row once.
    assert _held(cfg, "acct", ACCT) == _table(cdc_url, "acct", ACCT)
    assert _held(cfg, "ledger", LEDGER) == _table(cdc_url, "ledger", LEDGER)
    # The replacement sits at one IntoTime per output, after everything before it.
    for output in ("acct", "ledger"):
        t = read_updates(cfg, "bank", output)
        repl = t.filter(pc.equal(t.column("_src_part"), RESNAPSHOT_PART))
        assert repl.num_rows > 0, output
        assert len(set(repl.column("_into_time").to_pylist())) == 1
        # retracted once each; a row the damaged log held -1 times is put back
        assert set(repl.column("_diff").to_pylist()) <= {-1, 1}
        assert -1 in set(repl.column("_diff").to_pylist())
        at = repl.column("_into_time")[0].as_py()
        earlier = t.filter(pc.less(t.column("_src_part"), 0))  # the snapshots' rows
        assert at in set(earlier.column("_into_time").to_pylist())
    # The audit: every row at its bindings' IntoTime, no (position, key) twice.
    reports = {r.source: r for r in verify_pipeline(cfg)}
    assert reports["bank"].ok, [(o.output, o.breaches, o.samples)
                                for o in reports["bank"].outputs]


def test_resnapshot_requests_are_checked(tmp_path: Path, cdc_url: str) -> None:
    create_schema(cdc_url, accounts=10, ledger=10)
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(tmp=tmp_path, url=cdc_url))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "reclock.cli", "resnapshot", str(path),
                               *args], capture_output=True, text=True, timeout=60)

    r = cli("bank", "nope")
    assert r.returncode == 2 and "has no output 'nope'" in r.stderr, r.stderr
    r = cli("nope", "n")
    assert r.returncode == 2 and "nope" in r.stderr, r.stderr
    pipe = Pipeline(load_config(path))
    try:
        pipe.request_drop("gen")
    finally:
        pipe.close()
    r = cli("gen", "n")
    assert r.returncode == 2 and "is dropped" in r.stderr, r.stderr
    assert Requests(tmp_path / "state", "bank").pending() == {}
    assert Requests(tmp_path / "state", "gen").pending() == {}


KILLED = """
state_dir: {tmp}/state
timestamp_interval: 300ms
spark:
  master: local[2]
  max_records_per_task: 2000
  conf:
    spark.driver.extraJavaOptions: "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
sources:
  - name: bank
    postgres: {{dsn: "{url}", tables: [acct, ledger]}}
    outputs:
      - name: acct
        sink: {{type: postgres, dsn: "{url}", table: acct_replica, mode: state, key: [id]}}
      - {{name: ledger, sink: file}}
"""


def test_a_resnapshot_killed_midway_is_taken_again_by_the_next_run(
        tmp_path: Path, cdc_url: str) -> None:
    """kill -9 while re-snapshotting (a Postgres current-state replica and a
    Delta log, both damaged): the request survives, the next run re-reads,
    and both end equal to their tables."""
    import os
    import random
    import signal

    import psycopg

    from tests.running import close_driver, start_driver, stop_driver, wait_exit, wait_running

    create_schema(cdc_url, accounts=2000, ledger=8000)
    path = tmp_path / "p.yaml"
    path.write_text(KILLED.format(tmp=tmp_path, url=cdc_url))
    cfg = load_config(path)
    state = tmp_path / "state"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    requests = Requests(state, "bank")
    proc = start_driver(path, env)
    try:
        assert wait_running(state, proc)
        wait_for(lambda: _held(cfg, "ledger", LEDGER) == _table(cdc_url, "ledger", LEDGER), 90,
                 "the first snapshot")
    finally:
        proc.send_signal(signal.SIGKILL)
        wait_exit(proc, 30)
        close_driver(proc)
    rng = random.Random(7)
    killed = 0
    for _ in range(2):  # the second round damages what the first left half-healed
        with psycopg.connect(cdc_url, autocommit=True) as c:  # damage the replica
            c.execute("delete from acct_replica where id % 3 = 0")
            c.execute("update acct_replica set owner = 'damaged' where id % 5 = 0")
        DeltaTable(str(state / "outputs" / "bank" / "ledger")).delete("id % 4 = 0")
        for output in ("acct", "ledger"):
            requests.request(output, int(time.time() * 1000))
        proc = start_driver(path, env)
        try:
            assert wait_running(state, proc)
            time.sleep(rng.uniform(0.5, 2.5))
            if requests.pending():
                killed += 1
            proc.send_signal(signal.SIGKILL)
            wait_exit(proc, 30)
        finally:
            close_driver(proc)
    assert killed >= 1  # at least one kill landed before the replacement was durable
    proc = start_driver(path, env)
    try:
        assert wait_running(state, proc)
        wait_for(lambda: not requests.pending(), 90, "the resnapshots to be committed")
        wait_for(lambda: _held(cfg, "ledger", LEDGER) == _table(cdc_url, "ledger", LEDGER), 60,
                 "the ledger to catch up")
    finally:
        rc, err = stop_driver(proc)
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert (_table(cdc_url, "acct_replica", ACCT) == _table(cdc_url, "acct", ACCT))
    assert _held(cfg, "ledger", LEDGER) == _table(cdc_url, "ledger", LEDGER)
    [report] = verify_pipeline(cfg)
    assert report.ok, [(o.output, o.breaches, o.samples) for o in report.outputs]
