"""A Postgres CDC table into a Delta and an Iceberg ``mode: state`` table
(two sinks of one output), killed at each crash point of the Delta state
commit and with SIGKILL while a writer inserts, updates, deletes and changes
primary keys: at quiescence the Delta table, read by delta-rs, by DuckDB and
by the peer Spark (delta-spark), and the Iceberg table, read by pyiceberg
and by the peer Spark (Iceberg's runtime on the sink's SQL catalog), equal
the Postgres table (the upstream itself is the model), with the types Spark
gives the columns."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pyiceberg.catalog import load_catalog

from reclock import faults
from reclock.core.time import Lsn
from reclock.sinks.delta import Compaction, DeltaSink, read_current
from tests.peers import spark_reads
from tests.running import (
    close_driver,
    crash_env,
    start_driver,
    stop_driver,
    wait_exit,
    wait_running,
)
from tests.sinks.test_delta_state import by_duckdb_query
from tests.sources.cdc import flushed_lsn

PIPELINE = """
state_dir: {state}
timestamp_interval: 250ms
spark:
  master: local[2]
  conf:
    spark.driver.extraJavaOptions: "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
sources:
  - name: db
    postgres: {{dsn: "{url}", tables: [people], timeout: 10s}}
    outputs:
      - name: people
        sinks:
          - {{name: lake, type: delta, path: "{out}", mode: state, key: [id]}}
          - {{name: ice, type: iceberg, table: db.people, mode: state, key: [id],
              catalog: {{type: sql, uri: "{catalog}", warehouse: "{warehouse}"}}}}
"""
#: the Delta sink's output, a slot of its output
NAME = "db.people.lake"
COLUMNS = "id, name, score, amount, seen"
KEYS = 400


class Writer:
    """Random transactions on ``people``: inserts, updates, deletes and
    primary-key changes, until stopped."""

    def __init__(self, url: str, seed: int) -> None:
        self.url, self.rnd = url, random.Random(seed)
        self.stopping = threading.Event()
        self.done = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as c:
            while not self.stopping.is_set():
                with c.transaction():
                    for _ in range(self.rnd.randint(1, 6)):
                        self._one(c)
                self.done += 1
                time.sleep(0.01)

    def _one(self, c: psycopg.Connection[Any]) -> None:
        r, k = self.rnd.random(), self.rnd.randrange(KEYS)
        if r < 0.35:
            c.execute("insert into people values (%s, %s, %s, %s, now()) on conflict do nothing",
                      (k, f"n{k}-{self.rnd.randrange(99)}", self.rnd.random(),
                       decimal.Decimal(self.rnd.randrange(10**6)) / 100))
        elif r < 0.7:
            c.execute("update people set name = name || '.', score = %s, seen = now() "
                      "where id = %s", (self.rnd.choice([None, self.rnd.random()]), k))
        elif r < 0.85:
            c.execute("delete from people where id = %s", (k,))
        else:  # a primary key change: the row moves to a free key
            c.execute("update people set id = %s where id = %s and not exists "
                      "(select from people where id = %s)", (k + KEYS, k, k + KEYS))

    def stop(self) -> int:
        self.stopping.set()
        self.thread.join(30)
        return self.done


def _held(out: Path) -> int | None:
    st = DeltaSink(NAME, out).state()
    return None if st.progress is None else int(Lsn.parse(json.loads(st.progress)[0]))


def _iceberg(catalog: str, warehouse: Path) -> Any:
    return load_catalog("reclock", type="sql", uri=catalog, warehouse=str(warehouse))


def _ice_held(catalog: str, warehouse: Path) -> int | None:
    """What the Iceberg table holds, from its current snapshot's summary."""
    try:
        snap = _iceberg(catalog, warehouse).load_table("db.people").current_snapshot()
    except Exception:  # not created yet
        return None
    progress = None if snap is None else snap.summary.additional_properties.get(
        "reclock.progress")
    return None if progress is None else int(Lsn.parse(json.loads(progress)[0]))


def _caught_up(out: Path, catalog: str, warehouse: Path, target: int, proc: Any,
               timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = _held(out) if (out / "_delta_log").exists() else None
        ice = _ice_held(catalog, warehouse)
        if held is not None and held >= target and ice is not None and ice >= target:
            return
        assert proc.poll() is None, "the pipeline exited"
        time.sleep(0.3)
    raise AssertionError(f"the output did not catch up to {target}")


def _plain(v: Any) -> Any:
    if isinstance(v, dt.datetime):
        return int(v.timestamp() * 1_000_000)
    if isinstance(v, decimal.Decimal):
        return str(v)
    return v


@pytest.mark.timeout(900)
def test_cdc_into_a_delta_state_table_survives_sigkill_and_reads_alike_everywhere(
        tmp_path: Path, cdc_url: str) -> None:
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table people (id int primary key, name text not null, "
                  "score double precision, amount numeric(10,2), seen timestamptz)")
        c.execute("insert into people select i, 'n' || i, i / 7.0, i * 1.25, now() "
                  "from generate_series(0, 199) i")
    state, out = tmp_path / "state", tmp_path / "people"
    catalog, warehouse = f"sqlite:///{tmp_path}/catalog.db", tmp_path / "wh"
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(state=state, url=cdc_url, out=out, catalog=catalog,
                                    warehouse=warehouse))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    writer = Writer(cdc_url, seed=42)
    rnd = random.Random(9)
    kills = crash_exits = 0
    # each crash point of the state commit (RECLOCK_CRASH_AT, it fires at 30%
    # each time it is passed), then a SIGKILL from outside at a random moment
    for i, point in enumerate([*faults.STATE_POINTS, None]):
        proc = start_driver(path, crash_env(env, point, 0.3, i))
        try:
            assert wait_running(state, proc), "the driver did not start"
            if point is None:
                t0 = time.monotonic()
                before = (_held(out) if (out / "_delta_log").exists() else None,
                          _ice_held(catalog, warehouse))
                # killed once both sinks committed something new (not only
                # during the initial snapshot), at a random moment after
                while time.monotonic() - t0 < 120:
                    now = (_held(out) if (out / "_delta_log").exists() else None,
                           _ice_held(catalog, warehouse))
                    if all(n is not None and (b is None or n > b)
                           for n, b in zip(now, before, strict=True)):
                        break
                    time.sleep(0.2)
                time.sleep(rnd.uniform(0.5, 3.0))
                proc.send_signal(signal.SIGKILL)
                kills += wait_exit(proc, 60) == -signal.SIGKILL
            else:
                crash_exits += wait_exit(proc, 60) == -signal.SIGKILL
        finally:
            close_driver(proc)
    txns = writer.stop()
    proc = start_driver(path, env)
    try:
        assert wait_running(state, proc)
        _caught_up(out, catalog, warehouse, flushed_lsn(cdc_url), proc, 240)
    except AssertionError as exc:
        rc, err = stop_driver(proc)
        raise AssertionError(f"{exc}; held {_held(out)}, {_ice_held(catalog, warehouse)}; "
                             f"driver: {err[-4000:]}") from None
    rc, err = stop_driver(proc)
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert (kills, crash_exits) == (1, 2) and txns > 50, (kills, crash_exits, txns)
    with psycopg.connect(cdc_url) as c:
        upstream = sorted(tuple(_plain(v) for v in r)
                          for r in c.execute(f"select {COLUMNS} from people"))
    assert len(upstream) > 100
    # compaction, a checkpoint and the expiry of what they replaced keep the
    # rows, for every reader below
    sink = DeltaSink(NAME, out, mode="state", key=["id"],
                     compaction=Compaction(in_child=False))
    st = sink.state()
    assert sink.compact(min_files=2)["files_removed"] >= 2
    sink._checkpoint()
    assert any(p.startswith("deletion_vector_") for p in sink.expire_removed(0))
    sink.vacuum_orphans(0)
    assert sink.state() == st
    table = read_current(sink.location)
    d = table.to_pydict()
    rs = sorted(tuple(_plain(v) for v in r) for r in zip(
        *(d[c] for c in COLUMNS.split(", ")), strict=True))
    assert rs == upstream  # delta-rs
    duck = sorted(tuple(_plain(v) for v in r) for r in by_duckdb_query(
        out, f"SELECT id, name, score, amount, epoch_us(seen) FROM delta_scan('{out}')"))
    assert duck == upstream
    ice = _iceberg(catalog, warehouse).load_table("db.people").scan(
        selected_fields=tuple(COLUMNS.split(", "))).to_arrow().to_pydict()
    assert sorted(tuple(_plain(v) for v in r) for r in zip(
        *(ice[c] for c in COLUMNS.split(", ")), strict=True)) == upstream  # pyiceberg
    ice_sql = f"sql:SELECT {COLUMNS} FROM reclock.db.people"
    both = spark_reads([str(out), ice_sql], (f"reclock=jdbc:sqlite:{tmp_path}/catalog.db,"
                                             f"file://{warehouse}",))
    spark = both[str(out)]
    assert spark["types"] == {"id": "int", "name": "string", "score": "double",
                              "amount": "decimal(10,2)", "seen": "timestamp",
                              "_into_time": "bigint"}
    assert sorted(tuple(r[:5]) for r in spark["rows"]) == [
        (i, n, repr(s) if s is not None else None, a, t) for i, n, s, a, t in upstream]
    assert spark["txns"][f"reclock:{NAME}"] == DeltaSink(NAME, out).state().upper
    assert both[ice_sql]["types"] == {k: v for k, v in spark["types"].items()
                                      if k != "_into_time"}
    assert sorted(tuple(r) for r in both[ice_sql]["rows"]) == sorted(
        tuple(r[:5]) for r in spark["rows"])
