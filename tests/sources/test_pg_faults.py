"""Faults and bad states of the Postgres CDC source: each is a clear health
status with a hint, and nothing already accepted is lost."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from reclock.config import load_config
from reclock.contracts.consolidate import consolidate
from reclock.verify import verify_pipeline
from tests.running import read_updates, running, snapshot_durable, stalled_with, wait_for
from tests.sources.cdc import Writer, create_schema, flushed_lsn, resumed_past, source_rows
from tests.sources.test_pg_source import _rows
from tests.tally import count


def _cfg(tmp: Path, url: str, tables: str, outputs: str, extra: str = "") -> Any:
    path = tmp / "p.yaml"
    path.write_text(f"""
state_dir: {tmp}/state
timestamp_interval: 200ms
sources:
  - name: db
    postgres: {{dsn: "{url}", tables: [{tables}] {extra}}}
    outputs:
{outputs}
""")
    return load_config(path)


def test_wal_level_not_logical_is_named_with_the_fix(tmp_path: Path, spark: Any) -> None:
    from tests.pgcluster import PgCluster

    replica = PgCluster(wal_level="replica").start()  # PostgreSQL's default
    try:
        with psycopg.connect(replica.url, autocommit=True) as c:
            c.execute("create table t (id int primary key)")
        cfg = _cfg(tmp_path, replica.url, "t", "      - {name: t, sink: file}")
        with running(cfg, spark) as runners:
            h = stalled_with(runners, "wal_level", "logical", "postgresql.conf")
            assert h.definite
    finally:
        replica.stop()


def test_role_without_replication_is_named(tmp_path: Path, spark: Any, cdc_url: str) -> None:
    role = f"plain_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table t (id int primary key)")
        c.execute(f"create role {role} login")
        c.execute(f"grant select on t to {role}")
    url = cdc_url.replace("postgres@", f"{role}@")
    cfg = _cfg(tmp_path, url, "t", "      - {name: t, sink: file}")
    try:
        with running(cfg, spark) as runners:
            stalled_with(runners, role, "may not use replication", "REPLICATION")
    finally:
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute(f"drop owned by {role}")
            c.execute(f"drop role {role}")


def test_missing_replica_identity_and_missing_tables(tmp_path: Path, spark: Any,
                                                     cdc_url: str) -> None:
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table nokey (x int)")
    cfg = _cfg(tmp_path, cdc_url, "nokey", "      - {name: nokey, sink: file}")
    with running(cfg, spark) as runners:
        stalled_with(runners, '"public"."nokey"', "no replica identity",
                     "REPLICA IDENTITY FULL")
    cfg = _cfg(tmp_path, cdc_url, "nokey, ghost",
               "      - {name: nokey, sink: file}\n      - {name: ghost, sink: file}")
    with running(cfg, spark) as runners:
        stalled_with(runners, '"public"."ghost"', "do not exist")


def test_toasted_values_an_update_did_not_send(tmp_path: Path, spark: Any, cdc_url: str
                                               ) -> None:
    """An update that leaves a TOASTed value alone does not send it: FULL
    tables take it from the old row, keyed tables from the key state (also
    when the update moves the key); without a snapshot the state may not
    hold the key, which is a definite error naming the column."""
    big, other = "x" * 50_000, "y" * 40_000
    with psycopg.connect(cdc_url, autocommit=True) as c:
        for t in ("docs", "docs_full"):
            c.execute(f"create table {t} (id int primary key, flag int, body text, note text)")
            c.execute(f"alter table {t} alter column body set storage external")
            c.execute(f"alter table {t} alter column note set storage external")
            c.execute(f"insert into {t} values (1, 0, %s, %s), (2, 0, %s, null)",
                      (big, other, big))
        c.execute("alter table docs_full replica identity full")
    cfg = _cfg(tmp_path, cdc_url, "docs, docs_full",
               "      - {name: docs, sink: file}\n      - {name: docs_full, sink: file}")
    with running(cfg, spark) as runners:
        snapshot_durable(runners)
        with psycopg.connect(cdc_url, autocommit=True) as c:
            for t in ("docs", "docs_full"):
                c.execute(f"update {t} set flag = 1")  # body and note are not sent
                c.execute(f"update {t} set flag = 2, note = 'short' where id = 2")
                c.execute(f"update {t} set id = 3, flag = 3 where id = 1")  # the key moves
        wait_for(resumed_past(runners, flushed_lsn(cdc_url)), 60, "the updates")
        assert runners[0].health.status == "running", runners[0].health
    for output in ("docs", "docs_full"):
        got = consolidate(read_updates(cfg, "db", output), None, ["id", "flag", "body", "note"])
        rows = {(r["id"], r["flag"], len(r["body"]), len(r["note"]) if r["note"] else None)
                for r in got.to_pylist()}
        assert rows == {(2, 2, 50_000, 5), (3, 3, 50_000, 40_000)}, (output, rows)
        assert {r["body"] for r in got.to_pylist()} == {big}
    # Changes only, no snapshot: the key state does not hold row 2.
    path = tmp_path / "nosnap.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state2
timestamp_interval: 200ms
sources:
  - name: db2
    postgres: {{dsn: "{cdc_url}", tables: [docs], snapshot: false, slot: nosnap}}
    outputs:
      - {{name: docs, sink: file}}
""")
    with running(load_config(path), spark) as runners:
        wait_for(lambda: runners[0].health.status == "running", 60, "the source")
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("update docs set flag = 4 where id = 2")
        h = stalled_with(runners, "(2,)", "['body']", "unchanged", "snapshot")
        assert h.definite


def test_truncate_retracts_a_keyed_table_and_names_a_diff_log(tmp_path: Path, spark: Any,
                                                              cdc_url: str) -> None:
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table kept (id int primary key, v text)")
        c.execute("insert into kept select i, 'v' || i from generate_series(1, 10) i")
        c.execute("create table logged (id int, v text)")
        c.execute("alter table logged replica identity full")
        c.execute("insert into logged select i, 'v' || i from generate_series(1, 10) i")
    cfg = _cfg(tmp_path, cdc_url, "kept",
               f"      - {{name: kept, sink: {{type: postgres, dsn: '{cdc_url}', "
               "table: kept_replica, mode: state, key: [id]}}")
    with running(cfg, spark) as runners:
        snapshot_durable(runners)
        with psycopg.connect(cdc_url) as c:  # one transaction: the order inside it counts
            c.execute("insert into kept values (11, 'a'), (12, 'b')")
            c.execute("truncate kept")
            c.execute("insert into kept values (1, 'again')")
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("insert into kept values (20, 'after')")
        wait_for(resumed_past(runners, flushed_lsn(cdc_url)), 60, "the truncate")
        assert runners[0].health.status == "running", runners[0].health
    with psycopg.connect(cdc_url) as c:
        assert c.execute("select id, v from kept_replica order by id").fetchall() == [
            (1, "again"), (20, "after")]
    (tmp_path / "log").mkdir()
    (tmp_path / "full").mkdir()
    log_cfg = _cfg(tmp_path / "log", cdc_url, "kept", "      - {name: kept, sink: file}",
                   extra=", slot: kept_log")
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("insert into kept select i, 'w' || i from generate_series(30, 34) i")
    with running(log_cfg, spark) as runners:
        snapshot_durable(runners)
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("truncate kept")
            c.execute("insert into kept values (1, 'last')")
        wait_for(resumed_past(runners, flushed_lsn(cdc_url)), 60, "the second truncate")
    log = read_updates(log_cfg, "db", "kept")
    assert [(r["id"], r["v"], r["_count"]) for r in consolidate(log, None, ["id", "v"])
            .to_pylist()] == [(1, "last", 1)]
    retracted = [r["id"] for r in log.to_pylist() if r["_diff"] == -1]
    assert sorted(retracted) == [1, 20, 30, 31, 32, 33, 34]  # each key once
    reports = verify_pipeline(log_cfg)
    assert all(r.ok for r in reports), [(o.output, o.breaches) for r in reports
                                        for o in r.outputs]
    # A diff log (REPLICA IDENTITY FULL) cannot retract what it was never sent.
    full_cfg = _cfg(tmp_path / "full", cdc_url, "logged", "      - {name: logged, sink: file}",
                    extra=", slot: logged, publication: logged")
    with running(full_cfg, spark) as runners:
        snapshot_durable(runners)
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("truncate logged")
        stalled_with(runners, '"public"."logged"', "truncated", "primary key", "publish")
    assert read_updates(full_cfg, "db", "logged").num_rows == 10  # what was accepted stays


def test_schema_changes_evolve_the_output_or_name_the_column(tmp_path: Path, spark: Any,
                                                             cdc_url: str) -> None:
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table evo (id int primary key, a int, b text, c int)")
        c.execute("alter table evo replica identity full")
        c.execute("insert into evo values (1, 1, 'one', 1)")
    cfg = _cfg(tmp_path, cdc_url, "evo", "      - {name: evo, sink: file}")
    with running(cfg, spark) as runners:
        snapshot_durable(runners)
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("insert into evo values (2, 2, 'two', 2)")
            c.execute("alter table evo add column d text")
            c.execute("insert into evo values (3, 3, 'three', 3, 'dee')")
            c.execute("alter table evo alter column c type bigint")  # widens the output
            c.execute("insert into evo (id, a, b, c) values (4, 4, 'four', 2 ^ 40)")
        wait_for(resumed_past(runners, flushed_lsn(cdc_url)), 90, "the evolved output")
        assert runners[0].health.status == "running"
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("alter table evo alter column a type text")  # no type holds both
            c.execute("insert into evo (id, a, c) values (5, 'five', 5)")
        h = stalled_with(runners, "'evo'", "'a'", "changed type")
        assert h.definite
    rows = sorted((r["id"], r["a"], r["b"], r["c"], r["d"])
                  for r in read_updates(cfg, "db", "evo").to_pylist())
    assert rows == [(1, 1, "one", 1, None), (2, 2, "two", 2, None),
                    (3, 3, "three", 3, "dee"), (4, 4, "four", 2**40, None)]
    assert str(read_updates(cfg, "db", "evo").schema.field("c").type) == "int64"


def test_slot_dropped_behind_the_back_and_reclock_drop(tmp_path: Path, spark: Any,
                                                      cdc_url: str) -> None:
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table t (id int primary key)")
    cfg = _cfg(tmp_path, cdc_url, "t", "      - {name: t, sink: file}",
               extra=", slot: victim, drop_slot: true")
    with running(cfg, spark) as runners:
        snapshot_durable(runners)
        with psycopg.connect(cdc_url, autocommit=True) as c:
            for _ in range(100):
                c.execute("select pg_terminate_backend(active_pid) from pg_replication_slots "
                          "where slot_name = 'victim' and active_pid is not null")
                try:
                    c.execute("select pg_drop_replication_slot('victim')")
                    break
                except psycopg.errors.ObjectInUse:
                    time.sleep(0.05)
        h = stalled_with(runners, "'victim'", "dropped behind reclock's back", "snapshot")
        assert h.definite
    # `reclock drop` with drop_slot: true drops the slot (here: a new one)
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("select pg_create_logical_replication_slot('victim', 'pgoutput')")
    out = subprocess.run([sys.executable, "-m", "reclock", "drop",
                          str(tmp_path / "p.yaml"), "db"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "replication slot 'victim' dropped" in out.stdout
    with psycopg.connect(cdc_url) as c:
        assert c.execute("select count(*) from pg_replication_slots where slot_name = 'victim'"
                         ).fetchone() == (0,)
    # ... and the source cannot come back: resuming without its slot would skip changes
    out = subprocess.run([sys.executable, "-m", "reclock", "undrop",
                          str(tmp_path / "p.yaml"), "db"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("reclock: source 'db' cannot be undropped: its drop released "
                                 "what it held upstream (replication slot 'victim' dropped"), \
        out.stderr


@pytest.mark.timeout(300)
def test_database_restart_stalls_then_recovers(tmp_path: Path, spark: Any, cdc_url: str,
                                               pg_logical: Any) -> None:
    create_schema(cdc_url, accounts=500, ledger=1000)
    cfg = _cfg(tmp_path, cdc_url, "acct",
               f'      - name: acct\n        sink: {{type: postgres, dsn: "{cdc_url}", '
               "table: replica, mode: state, key: [id]}")
    with running(cfg, spark) as runners:
        snapshot_durable(runners)
        seen: set[str] = set()
        pg_logical.restart()
        wait_for(lambda: seen.add(runners[0].health.status) or "stalled" in seen, 60,
                 "the stall")
        writer = Writer(cdc_url, seed=9, accounts=500)
        time.sleep(2)
        writer.stop()
        wait_for(resumed_past(runners, flushed_lsn(cdc_url)), 120, "recovery")
        # health is set when the tick that moved the resumption frontier ends
        wait_for(lambda: runners[0].health.status == "running", 30, "running again")
    assert _rows(source_rows(cdc_url, "select id, owner, bal, note from acct")) == \
        _rows(source_rows(cdc_url, "select id, owner, bal, note from replica"))


def test_tables_of_an_existing_publication(tmp_path: Path, spark: Any, cdc_url: str) -> None:
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table a (id int primary key, v text)")
        c.execute("create table b (id int primary key, v text)")
        c.execute("create table c (id int primary key)")
        c.execute("insert into a values (1, 'x')")
        c.execute("create publication mine for table a, b")
    cfg = _cfg(tmp_path, cdc_url, "a, c",
               "      - {name: a, sink: file}\n      - {name: c, sink: file}",
               extra=", publication: mine")
    with running(cfg, spark) as runners:  # c is not published: named, with the fix
        stalled_with(runners, "'mine'", '"public"."c"', "ALTER PUBLICATION mine ADD TABLE")
    path = tmp_path / "pub.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state2
timestamp_interval: 200ms
sources:
  - name: db
    postgres: {{dsn: "{cdc_url}", publication: mine}}
    outputs:
      - {{name: a, sink: file}}
      - {{name: b, sink: file}}
""")
    cfg = load_config(path)
    with running(cfg, spark) as runners:  # no tables listed: the publication's
        snapshot_durable(runners)
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("insert into b values (2, 'y')")
        wait_for(resumed_past(runners, flushed_lsn(cdc_url)), 60, "the stream")
    assert [r["v"] for r in read_updates(cfg, "db", "a").to_pylist()] == ["x"]
    assert [r["v"] for r in read_updates(cfg, "db", "b").to_pylist()] == ["y"]


def test_hostile_table_names_feed_the_outputs_they_are_given(tmp_path: Path, spark: Any,
                                                            cdc_url: str) -> None:
    """Quotes, spaces, a dot and unicode in schema and table names, and one
    table name in two schemas: each table feeds the output it is given."""
    odd_schema, odd_table = "Shop Ünï", 'Order "Items".v2'
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute(psycopg.sql.SQL("create schema {}").format(psycopg.sql.Identifier(odd_schema)))
        for s, t in ((odd_schema, odd_table), (odd_schema, "orders"), ("public", "orders")):
            c.execute(psycopg.sql.SQL("create table {} (id int primary key, v text)").format(
                psycopg.sql.Identifier(s, t)))
            c.execute(psycopg.sql.SQL("insert into {} values (1, %s)").format(
                psycopg.sql.Identifier(s, t)), (f"{s}/{t} before",))
    path = tmp_path / "p.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
sources:
  - name: db
    postgres:
      dsn: "{cdc_url}"
      tables:
        - {{table: '{odd_table}', schema: {odd_schema}, output: items}}
        - {{table: orders, schema: {odd_schema}, output: shop_orders}}
        - orders
    outputs:
      - {{name: items, sink: file}}
      - {{name: shop_orders, sink: file}}
      - {{name: orders, sink: file}}
""")
    cfg = load_config(path)
    with running(cfg, spark) as runners:
        snapshot_durable(runners)
        with psycopg.connect(cdc_url, autocommit=True) as c:
            for s, t in ((odd_schema, odd_table), (odd_schema, "orders"), ("public", "orders")):
                c.execute(psycopg.sql.SQL("update {} set v = %s where id = 1").format(
                    psycopg.sql.Identifier(s, t)), (f"{s}/{t} after",))
        wait_for(resumed_past(runners, flushed_lsn(cdc_url)), 60, "the stream")
        assert runners[0].health.status == "running", runners[0].health
    for output, (s, t) in {"items": (odd_schema, odd_table), "shop_orders": (odd_schema, "orders"),
                           "orders": ("public", "orders")}.items():
        got = [(r["v"], r["_diff"]) for r in read_updates(cfg, "db", output).to_pylist()]
        assert sorted(got) == sorted([(f"{s}/{t} before", 1), (f"{s}/{t} before", -1),
                                      (f"{s}/{t} after", 1)]), (output, got)
    # Publications whose tables cannot name outputs by themselves: named, with the fix.
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute(psycopg.sql.SQL("create publication odd for table {}").format(
            psycopg.sql.Identifier(odd_schema, odd_table)))
        c.execute(psycopg.sql.SQL("create publication twice for table {}, {}").format(
            psycopg.sql.Identifier(odd_schema, "orders"), psycopg.sql.Identifier("orders")))
    for pub, words in (("odd", ("cannot name their outputs", "Ünï", "output: a_name")),
                       ("twice", ("['orders']", f'"{odd_schema}"."orders"', "output: name"))):
        path = tmp_path / f"{pub}.yaml"
        path.write_text(f"""
state_dir: {tmp_path}/state-{pub}
sources:
  - name: db2
    postgres: {{dsn: "{cdc_url}", publication: {pub}}}
    outputs:
      - {{name: orders, sink: file}}
""")
        with running(load_config(path), spark) as runners:
            health = stalled_with(runners, *words)
            assert health.definite and f"publication {pub!r}" in (health.error or "")
    count("bad input: hostile table names (Postgres CDC)", inputs_tried=5, records_checked=9)


def _ids(cfg: Any, output: str = "t") -> list[int]:
    t = read_updates(cfg, "db", output)
    import pyarrow.compute as pc

    rows = consolidate(t.filter(pc.is_null(t.column("_error"))), None, ["id"])
    return sorted(r["id"] for r in rows.to_pylist() for _ in range(r["_count"]))


def test_two_pipelines_with_one_source_name_on_one_database(
    tmp_path: Path, spark: Any, cdc_url: str
) -> None:
    """Issue: slots were named from the source name alone, so two pipelines
    with a source 'db' shared one slot, each advanced it, and each output
    silently missed what the other confirmed. Now each pipeline's slot and
    publication carry its identity, and both outputs hold every row."""
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table t (id int primary key)")
        c.execute("insert into t select generate_series(1, 10)")
    cfgs = []
    for i in range(2):
        d = tmp_path / f"p{i}"
        d.mkdir()
        cfgs.append(_cfg(d, cdc_url, "t", "      - {name: t, sink: file}"))
    with running(cfgs[0], spark) as a, running(cfgs[1], spark) as b:
        for k in range(11, 41):
            with psycopg.connect(cdc_url, autocommit=True) as c:
                c.execute("insert into t values (%s)", (k,))
            time.sleep(0.05)
        end = flushed_lsn(cdc_url)
        for runners in (a, b):
            wait_for(resumed_past(runners, end), 90,
                     lambda r=runners: f"caught up: {r[0].health}")
        slots = {x[0].source.slot for x in (a, b)}  # type: ignore[attr-defined]
    assert len(slots) == 2, slots
    for cfg in cfgs:  # the model: the table holds 1..40
        assert _ids(cfg) == list(range(1, 41))


def test_a_slot_advanced_by_something_else_is_a_definite_error(
    tmp_path: Path, spark: Any, cdc_url: str
) -> None:
    """A slot confirmed past what the outputs hold was advanced by someone
    else (say, another pipeline told to use the same slot): the changes
    between were never read here, so the source stops with a definite error."""
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table t (id int primary key)")
        c.execute("insert into t values (1), (2)")
    cfg = _cfg(tmp_path, cdc_url, "t", "      - {name: t, sink: file}", ", slot: shared")
    with running(cfg, spark) as runners:
        wait_for(resumed_past(runners, flushed_lsn(cdc_url)), 90, "the snapshot")
    from reclock.sources.postgres.catalog import lsn_text

    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("insert into t values (3)")  # never read by this pipeline ...
    past = flushed_lsn(cdc_url)  # (the cluster commits asynchronously: wait for the flush)
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("select pg_replication_slot_advance('shared', %s::pg_lsn)", (lsn_text(past),))
    with running(cfg, spark) as runners:  # ... because another reader confirmed it
        h = stalled_with(runners, "shared", "advanced it", "postgres.slot")
        assert h.definite
