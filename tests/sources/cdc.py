"""Helpers of the Postgres CDC tests: a writer of random transactions, catching
up, and comparing outputs with the source tables."""

from __future__ import annotations

import random
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa

from reclock.contracts.consolidate import consolidate
from reclock.core.time import Lsn

SCHEMA = """
create table acct (id int primary key, owner text not null, bal numeric(12,2), note text);
create table ledger (id bigserial primary key, txn bigint not null, acct int, amount numeric(12,2),
                     tags text[], at timestamptz default now());
alter table ledger replica identity full;
insert into acct select g, 'owner ' || g, g * 10, null from generate_series(1, {accounts}) g;
insert into ledger (txn, acct, amount, tags)
  select 0, g % {accounts} + 1, g, array['seed'] from generate_series(1, {ledger}) g;
"""

#: A table of every PostgreSQL type the source maps, and a row of it (``ROW % id``).
ALL_TYPES = """
create table kinds (
  id int primary key, b bool, i2 int2, i4 int4, i8 int8, f4 float4, f8 float8,
  n numeric(12,3), nu numeric, t text, vc varchar(20), ch char(3), j json, jb jsonb,
  ts timestamp, tz timestamptz, d date, tm time, ba bytea, u uuid, ia int[], ta text[],
  iv interval, ip inet);
alter table kinds replica identity full;
"""

ROW = ("(%s, true, 32767, -2147483648, 9223372036854775807, 1.5, 'NaN', 123456789.125, "
       "'1e-40', 'a \"quoted\" \\ and ''x''', 'vc', 'ab', '{\"a\": [1, 2]}', "
       "'{\"b\": null}', '2024-02-29 12:34:56.789012', '2024-01-01 00:00:00+05:30', "
       "'2024-03-01', '23:59:59.999999', '\\x00ff10', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', "
       "'{1,NULL,3}', '{\"x,y\",\"\",NULL,\"q\\\"\"}', '1 day 02:00:00', '10.0.0.1/8')")


def create_schema(url: str, accounts: int = 2000, ledger: int = 5000) -> None:
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(SCHEMA.format(accounts=accounts, ledger=ledger))


class Writer:
    """Random transactions until stopped: each inserts 1-5 ledger rows that
    carry its transaction number, and moves, opens or closes accounts."""

    def __init__(self, url: str, seed: int = 1, pause: float = 0.002,
                 accounts: int = 2000, start: int = 0) -> None:
        self.url, self.pause, self.accounts = url, pause, accounts
        self.rng = random.Random(seed)
        self.txns = start
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=False) as c:
                while not self._stop.is_set():
                    self._one(c)
                    time.sleep(self.pause)
        except BaseException as exc:  # surfaced by stop()
            self.errors.append(exc)

    def _one(self, c: psycopg.Connection[Any]) -> None:
        r = self.rng
        self.txns += 1
        n = self.txns
        with c.transaction():
            for _ in range(r.randint(1, 5)):
                c.execute("insert into ledger (txn, acct, amount, tags) values (%s, %s, %s, %s)",
                          (n, r.randint(1, self.accounts), r.randint(-500, 500) / 4,
                           [f"t{n}", None] if r.random() < 0.2 else [f"t{n}"]))
            a = r.randint(1, self.accounts * 2)
            op = r.random()
            if op < 0.5:
                c.execute("update acct set bal = bal + 1, note = %s where id = %s",
                          (f"txn {n}", a))
            elif op < 0.75:
                c.execute("insert into acct values (%s, %s, 0, 'new') on conflict (id) do "
                          "update set owner = excluded.owner", (a, f"owner {a} v{n}"))
            elif op < 0.9:
                c.execute("delete from acct where id = %s", (a,))
            else:
                c.execute("update ledger set amount = amount + 1 where id = "
                          "(select max(id) from ledger where txn < %s)", (n,))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(60)
        if self.errors:
            raise self.errors[0]
        return self.txns


def flushed_lsn(url: str) -> int:
    """An LSN at or past every commit so far, once it is flushed."""
    with psycopg.connect(url, autocommit=True) as c:
        (insert,) = c.execute("select pg_current_wal_insert_lsn()::text").fetchone() or ("",)
        target = int(Lsn.parse(insert))
        for _ in range(200):
            (flush,) = c.execute("select pg_current_wal_flush_lsn()::text").fetchone() or ("",)
            if int(Lsn.parse(flush)) >= target:
                return target
            time.sleep(0.05)
    raise AssertionError("WAL not flushed")


def resumed_past(runners: list[Any], lsn: int) -> Callable[[], bool]:
    def check() -> bool:
        st = runners[0].status()
        resume = st.get("resume")
        return bool(resume) and int(Lsn.parse(resume[0])) >= lsn

    return check


def execute(url: str, *statements: str) -> None:
    """Runs ``statements`` upstream, each in a transaction of its own."""
    with psycopg.connect(url, autocommit=True) as c:
        for statement in statements:
            c.execute(statement)


def source_rows(url: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as c:
        return sorted(c.execute(query).fetchall(), key=repr)


def output_rows(updates: pa.Table, columns: list[str]) -> list[tuple[Any, ...]]:
    """The collection an update log means now (every row once; asserts no
    row is held twice or retracted more than inserted)."""
    state = consolidate(updates, None, columns)
    counts = state.column("_count").to_pylist()
    assert set(counts) <= {1}, f"rows held {sorted(set(counts))} times"
    cols = [state.column(c).to_pylist() for c in columns]
    return sorted(zip(*cols, strict=True), key=repr)


def drop_source_state(cfg: Any, source: str) -> None:
    """The way out that a CDC source's errors name for a table whose
    history no longer fits its output: drop the output and the source's
    state (its remap shard: bindings, facts, the tables' column histories;
    its key state; its file outputs at their default places), so that the
    next start takes a new snapshot in the tables' shape now. The
    replication slot stays (the new snapshot starts from it)."""
    from reclock.pipeline import Pipeline

    pipe = Pipeline(cfg)
    try:
        if source in pipe.store.shards():
            pipe.store.drop_shard(source)
    finally:
        pipe.close()
    state = Path(cfg.state_dir)
    for d in ("outputs", "keys", "resnapshot"):
        shutil.rmtree(state / d / source, ignore_errors=True)
