"""kill -9 a Postgres-to-Postgres pipeline at random moments (some during the
initial snapshot) while a writer keeps committing transactions: after every
restart the replica equals the source, no change is lost or doubled, no
transaction is split across IntoTimes, ``confirmed_flush_lsn`` never passes
what the outputs hold, and the slot's retained WAL stays small."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

from reclock import faults
from reclock.core.time import Lsn
from tests.running import (
    close_driver,
    crash_env,
    start_driver,
    stop_driver,
    wait_exit,
    wait_running,
)
from tests.sources.cdc import Writer, create_schema, flushed_lsn
from tests.sources.test_pg_source import _norm
from tests.tally import count

LEDGER = "id, txn, acct, amount, tags, at"

#: The crash points this pipeline passes: a Delta state table's commit points
#: need a state output (tests/sinks/test_delta_state_pipeline.py and the
#: generative harness's killed drivers draw them).
_POINTS = [p for p in faults.POINTS if p not in faults.STATE_POINTS]

PIPELINE = """
state_dir: {state}
timestamp_interval: 250ms
spark:
  master: local[2]
  max_records_per_task: 4000
  conf:
    spark.driver.extraJavaOptions: "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
sources:
  - name: bank
    postgres: {{dsn: "{url}", tables: [acct, ledger], timeout: 10s}}
    outputs:
      - name: acct
        sink: {{type: postgres, dsn: "{url}", table: acct_replica, mode: state, key: [id]}}
      - name: ledger
        sink: {{type: postgres, dsn: "{url}", table: ledger_log}}
"""


def _held(url: str) -> dict[str, int | None]:
    """Per output: the LSN frontier it holds (None: nothing committed yet)."""
    with psycopg.connect(url) as c:
        try:
            rows = c.execute("select output, progress from reclock_uppers").fetchall()
        except psycopg.errors.UndefinedTable:
            return {}
    return {o: None if p is None else int(Lsn.parse(json.loads(p)[0])) for o, p in rows}


def _slot(url: str) -> tuple[int, int, int] | None:
    with psycopg.connect(url) as c:
        row = c.execute("select confirmed_flush_lsn::text, restart_lsn::text, "
                        "pg_current_wal_insert_lsn()::text from pg_replication_slots "
                        "where database = current_database() and slot_name like 'reclock%bank'"
                        ).fetchone()
    return None if row is None else (int(Lsn.parse(row[0])), int(Lsn.parse(row[1])),
                                     int(Lsn.parse(row[2])))


def _caught_up(url: str, target: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = _held(url)
        if len(held) == 2 and all(v is not None and v >= target for v in held.values()):
            return
        assert proc.poll() is None, "the pipeline exited"
        time.sleep(0.2)
    raise AssertionError(f"outputs did not catch up to {target}: {_held(url)}")


def _bag(url: str, query: str) -> Counter[tuple[Any, ...]]:
    """The rows of ``query``, normalized, as a multiset (compared without
    sorting 130,000 rows by their repr)."""
    with psycopg.connect(url) as c:
        return Counter(tuple(_norm(v) for v in r) for r in c.execute(query))


def _check_outputs(url: str) -> int:
    """Replica and log equal the source; no transaction split. Returns the
    number of transactions checked."""
    assert _bag(url, "select id, owner, bal, note from acct") == \
        _bag(url, "select id, owner, bal, note from acct_replica")
    with psycopg.connect(url) as c:
        counts = c.execute(f"select n, count(*) from (select {LEDGER}, sum(_diff) n from "
                           f"ledger_log group by {LEDGER}) x group by n").fetchall()
        assert {n for n, _ in counts} <= {0, 1}, counts  # nothing doubled
        split = c.execute(
            "select txn, count(distinct t) from (select id, txn, min(_into_time) t from "
            "ledger_log where _diff > 0 group by id, txn) x where txn > 0 group by txn "
            "having count(distinct t) > 1").fetchall()
        assert not split, split[:5]
        (txns,) = c.execute("select count(distinct txn) from ledger_log").fetchone() or (0,)
    held = _bag(url, f"select {LEDGER} from (select {LEDGER}, sum(_diff) n from "
                     f"ledger_log group by {LEDGER}) x where n = 1")
    assert held == _bag(url, f"select {LEDGER} from ledger")
    return int(txns)


@pytest.mark.timeout(900)
def test_sigkill_postgres_to_postgres(tmp_path: Path, cdc_url: str) -> None:
    create_schema(cdc_url, accounts=3000, ledger=120_000)
    state = tmp_path / "state"
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(state=state, url=cdc_url))
    rng = random.Random(511)
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    writer = Writer(cdc_url, seed=3, accounts=3000, pause=0.004)
    plan: list[str | None] = [None] * 3 + _POINTS + [None]
    kills = during_snapshot = crash_exits = equal_checks = ack_checks = 0
    for i, point in enumerate(plan):
        proc = start_driver(path, crash_env(base_env, point, 0.3, i))
        try:
            up = wait_running(state, proc)
            if i == len(plan) - 1 and up:
                # pause the writer: the restarted pipeline catches up to a
                # replica equal to the source, then dies anyway
                txns = writer.stop()
                _caught_up(cdc_url, flushed_lsn(cdc_url), proc, 120)
                _check_outputs(cdc_url)
                equal_checks += 1
                writer = Writer(cdc_url, seed=100 + i, accounts=3000, pause=0.004, start=txns)
            if point is None and up:
                time.sleep(rng.uniform(0.3, 1.5) if i < 4 else rng.uniform(0.3, 4.0))
                if not all(_held(cdc_url).values()) or len(_held(cdc_url)) < 2:
                    during_snapshot += 1
                proc.send_signal(signal.SIGKILL)
                kills += 1
            rc = wait_exit(proc, 60)
            if rc is None:
                kills += 1
            elif point is not None and rc == -signal.SIGKILL:
                crash_exits += 1
        finally:
            close_driver(proc)
        # nothing is confirmed upstream that an output does not hold
        slot, held = _slot(cdc_url), _held(cdc_url)
        if slot is not None and len(held) == 2 and all(held.values()):
            assert slot[0] <= min(v or 0 for v in held.values()), (slot, held)
            ack_checks += 1
    assert kills + crash_exits >= 7, (kills, crash_exits)
    assert during_snapshot >= 2, during_snapshot
    assert equal_checks == 1, equal_checks
    assert ack_checks >= 4, ack_checks
    txns = writer.stop()
    # a clean run catches up; the replica equals the source
    proc = start_driver(path, base_env)
    try:
        wait_running(state, proc)
        _caught_up(cdc_url, flushed_lsn(cdc_url), proc, 180)
        checked = _check_outputs(cdc_url)
        time.sleep(2)  # a few idle ticks: the slot follows the outputs
        confirmed, restart, now = _slot(cdc_url) or (0, 0, 0)
        assert confirmed <= min(v or 0 for v in _held(cdc_url).values())
        assert now - restart < 16 * 1024 * 1024, (now, restart)
    finally:
        rc, err = stop_driver(proc)
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert checked >= txns * 0.99  # every writer transaction's rows (bar updates) held
    count("kill: postgres cdc -> postgres sinks", kill_points_tried=len(plan) + 1,
          sigkills=kills, during_snapshot=during_snapshot, crash_point_exits=crash_exits,
          transactions_checked=txns, acknowledgement_checks=ack_checks)
    print(f"postgres kill test: {kills} SIGKILLs ({during_snapshot} during the snapshot), "
          f"{crash_exits} crash-point exits, {equal_checks} mid-run replica checks, "
          f"{ack_checks} acknowledgement checks, "
          f"{txns} transactions, retained WAL {now - restart} bytes")

