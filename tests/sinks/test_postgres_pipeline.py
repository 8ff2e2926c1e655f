"""Pipelines into PostgreSQL: the update log and current-state tables, both
committed with their uppers in one transaction per commit; a state table
holds the sum of every IntoTime's updates per key, and only keys that the
output's upstream key makes consistent at every IntoTime are accepted."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Producer

from reclock import faults
from reclock.cli import main
from reclock.config import load_config
from reclock.core.errors import DefiniteError
from reclock.pipeline import run
from reclock.verify import verify_pipeline
from tests.running import running, wait_for
from tests.sources.cdc import flushed_lsn, resumed_past


def test_generator_into_postgres_log_and_state(tmp_path: Path, spark: Any, pg_url: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(f"""
timestamp_interval: 200ms
sources:
  - name: shop
    generator: {{kind: orders, rate: 20000, max_records: 5000}}
    outputs:
      - name: customers
        sink: {{type: postgres, dsn: "{pg_url}", table: customers, mode: state,
               key: [customer_id]}}
      - name: orders
        sink: {{type: postgres, dsn: "{pg_url}", table: "order log"}}
""")
    cfg = load_config(path)
    runners = run(cfg, spark=spark, duration=120, out=None, install_signals=False)
    assert [r.health.status for r in runners] == ["finished"]
    with psycopg.connect(pg_url) as c:
        assert c.execute("select count(*) from customers").fetchone() == (1000,)
        assert c.execute('select count(*), count(distinct order_id) from "order log"'
                         ).fetchone() == (4000, 4000)
        uppers = dict(c.execute("select output, upper from reclock_uppers").fetchall())
    assert uppers == {"shop.customers": None, "shop.orders": None}  # finished: closed
    reports = verify_pipeline(cfg)
    assert all(r.ok for r in reports), [(o.output, o.breaches) for o in reports[0].outputs]
    assert reports[0].complete_checked == 4000  # the log output is audited in full
    orders = reports[0].outputs[1]
    assert orders.checks["values"] == "4000 positions"  # (without the sink's own rules)
    assert "the 0 error rows the output holds are taken as refused" in orders.unchecked["values"]


# -- Kafka: an upsert topic of two partitions ----------------------------------------------

Record = tuple[int, str | None]  # (id, email; None: a tombstone)


def _produce(bootstrap: str, topic: str, records: list[Record]) -> None:
    """Each id's records to partition ``id % 2``, in order."""
    p = Producer({"bootstrap.servers": bootstrap})
    for k, email in records:
        p.produce(topic, key=json.dumps({"id": k}).encode(), partition=k % 2,
                  value=None if email is None else json.dumps({"email": email}).encode())
    assert p.flush(30) == 0


def _users(tmp_path: Path, bootstrap: str, topic: str, pg_url: str,
           tables: dict[str, str]) -> Path:
    """A pipeline file: one source per table, each reading ``topic`` upserted
    by ``id`` into a state table keyed as ``tables`` says."""
    sources = "".join(f"""
  - name: {name}
    kafka: {{bootstrap_servers: "{bootstrap}", topic: {topic}, timeout: 5s}}
    outputs:
      - name: users
        format: {{type: json, schema: {{email: string}}}}
        key_format: {{type: json, schema: {{id: int64}}}}
        envelope: {{type: upsert, key: [id]}}
        sink: {{type: postgres, dsn: "{pg_url}", table: {name}, mode: state, key: {key}}}
""" for name, key in tables.items())
    path = tmp_path / "p.yaml"
    path.write_text(f"state_dir: {tmp_path}/state\ntimestamp_interval: 200ms\nsources:"
                    + sources)
    return path


def _offsets(records: list[Record]) -> dict[int, int]:
    return {p: sum(1 for k, _ in records if k % 2 == p) for p in (0, 1)}


def _durable(runners: list[Any]) -> list[dict[int, int]]:
    from reclock.core.frontier import Antichain
    from reclock.core.time import kafka_offsets

    out = []
    for r in runners:
        p = r.outputs[0].state.progress
        out.append({} if p is None else kafka_offsets(Antichain.decode_json("kafka", p))[0])
    return out


def test_an_upsert_topic_of_two_partitions_into_state_tables_matches_the_upstream(
    tmp_path: Path, spark: Any, kafka: Any, pg_url: str
) -> None:
    """A topic of 2 partitions, upserted by ``id``, into state tables keyed by
    ``[id]`` and by ``[email, id]`` (a key containing the upstream key):
    emails move between ids of the two partitions, a key is updated several
    times, deleted and inserted again, inserted and deleted, all within a
    burst, while a stage and a commit each fail once. Both tables end equal
    to the upstream's final state by key (a dict of the records), and verify
    is clean. (Regression guard for the consolidating apply on the path of
    the reported failure; with keys containing the upstream key the key
    state already orders each key's updates, so the previous apply got
    these right too: its failures are in test_postgres_sink.py and in the
    CDC swap below.)"""
    topic = f"users-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 2)
    path = _users(tmp_path, kafka.bootstrap, topic, pg_url,
                  {"by_id": "[id]", "by_email_id": "[email, id]"})
    records: list[Record] = [(i, f"a{i}@") for i in range(20)]
    _produce(kafka.bootstrap, topic, records)
    burst: list[Record] = []
    for i in range(0, 20, 2):  # id i+1 (partition 1) gives its email to id i (partition 0)
        burst += [(i + 1, f"b{i + 1}@"), (i, f"a{i + 1}@")]
    burst += [(3, "c1@"), (3, "c2@"), (3, "c3@"),  # several updates of one key
              (5, None), (5, "d5@"),                # deleted, then inserted again
              (20, "e20@"), (20, None),             # inserted, then deleted
              (7, None)]                            # deleted
    later: list[Record] = [(0, "z0@"), (7, "a7@"), (21, "f21@"), (8, None)]
    cfg = load_config(path)
    faults.arm("stage")
    try:
        with running(cfg, spark) as runners:
            wait_for(lambda: _durable(runners) == [_offsets(records)] * 2, 90,
                     lambda: f"the first records durable: {_durable(runners)}")
            faults.arm("commit")
            _produce(kafka.bootstrap, topic, burst)
            records += burst
            wait_for(lambda: _durable(runners) == [_offsets(records)] * 2, 90,
                     lambda: f"the burst durable: {_durable(runners)}")
            faults.arm("stage,commit")
            _produce(kafka.bootstrap, topic, later)
            records += later
            # (a retried tick says "running" once it is over: after its commit)
            wait_for(lambda: _durable(runners) == [_offsets(records)] * 2
                     and all(r.health.status == "running" for r in runners), 90,
                     lambda: f"the last records durable: {_durable(runners)}, "
                             f"{[r.health for r in runners]}")
            assert [o.errors for r in runners for o in r.outputs] == [0, 0]
    finally:
        faults.disarm()
    model: dict[int, str] = {}  # the upstream's final state: the latest email per id
    for k, email in records:
        if email is None:
            model.pop(k, None)
        else:
            model[k] = email
    assert len(model) == 20
    want = sorted((k, email) for k, email in model.items())
    with psycopg.connect(pg_url) as c:
        for table in ("by_id", "by_email_id"):
            assert sorted(c.execute(f"select id, email from {table}").fetchall()) == want
            assert c.execute(f"select count(*) from {table}_errors").fetchone() == (0,)
    reports = verify_pipeline(cfg)
    assert all(r.ok for r in reports), [(o.output, o.breaches) for r in reports
                                        for o in r.outputs]


def test_a_state_table_keyed_by_a_value_that_moves_between_upstream_keys_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue: an upsert topic keyed by ``id`` (2 partitions) fed a state table
    keyed by ``email``, unique upstream at every moment; an email passing
    from an id of one partition to an id of the other within one tick was
    deleted (10 of 20 rows left). Summing an IntoTime's updates fixes that
    tick, but an IntoTime need not hold both ids' updates at all (each
    partition is read up to its own offset; a binding may be written in
    several jobs), so the table could still be asked to hold two rows for an
    email, or none. ``reclock run`` refuses the file before Spark starts,
    naming the line, the key, the upstream key and what to do."""
    path = _users(tmp_path, "127.0.0.1:1", "users", "postgresql://u@127.0.0.1:1/db",
                  {"by_email": "[email]"})
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    line = path.read_text().splitlines().index(next(
        x for x in path.read_text().splitlines() if "key: [email]" in x)) + 1
    assert f"{path}:{line}:" in err and "sources[0].outputs[0].sink.key" in err
    assert ("a state table's key must contain the output's upstream key ['id'] (the upsert "
            "envelope's key), and ['email'] does not") in err
    assert "key the table by ['id', 'email'], or keep the update log (mode: log)" in err
    assert not (tmp_path / "state").exists()  # refused before anything ran


# -- typed outputs: the key the source declares ----------------------------------------------


@pytest.fixture
def no_spark(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting Spark fails the test: what is refused must be refused before."""
    import reclock.runtime.spark

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("Spark was started")

    monkeypatch.setattr(reclock.runtime.spark, "spark_session", refuse)


@pytest.mark.parametrize(("key", "refused"), [
    ("[customer_id]", False), ("[name, customer_id]", False), ("[name]", True)])
def test_a_generator_table_into_state_needs_its_declared_key(
    tmp_path: Path, pg_url: str, no_spark: None, key: str, refused: bool
) -> None:
    """Typed outputs carry the key their source declares (a generator's
    ``customer_id``, a CDC table's primary key): a state key containing it
    runs, another is refused when the pipeline is built, before Spark."""
    path = tmp_path / "p.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
sources:
  - name: shop
    generator: {{kind: orders, rate: 100, max_records: 50}}
    outputs:
      - name: customers
        sink: {{type: postgres, dsn: "{pg_url}", table: customers, mode: state, key: {key}}}
      - name: orders
        sink: {{type: postgres, dsn: "{pg_url}", table: orders}}
""")
    cfg = load_config(path)
    if not refused:
        with pytest.raises(AssertionError, match="Spark was started"):
            run(cfg, out=None, install_signals=False)
        return
    with pytest.raises(DefiniteError) as info:
        run(cfg, out=None, install_signals=False)
    assert str(info.value).startswith(
        "source 'shop' output 'customers': sink key ['name']: a state table's key must contain "
        "the output's upstream key ['customer_id'] (the key the source declares for it: a CDC "
        "table's primary key or replica identity index, a generator table's id), and "
        "['name'] does not")
    assert info.value.hint and "key or mode" in info.value.hint


def test_a_raw_output_without_a_keyed_envelope_into_state_is_refused(
    tmp_path: Path, pg_url: str, no_spark: None
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
sources:
  - name: counter
    generator: {{kind: counter, max_records: 10}}
    outputs:
      - name: value
        format: {{type: json, schema: {{n: int64}}}}
        sink: {{type: postgres, dsn: "{pg_url}", table: counts, mode: state, key: [n]}}
""")
    with pytest.raises(DefiniteError, match=r"output 'value': sink key \['n'\]: a state table "
                       r"keeps one row per key, and nothing keeps this output at one row per "
                       r"\['n'\] \(envelope none: every record is an insertion"):
        run(load_config(path), out=None, install_signals=False)


# -- Postgres CDC: the table's primary key ---------------------------------------------------


def _cdc(tmp_path: Path, url: str, table: str, key: str) -> Any:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "p.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
sources:
  - name: db
    postgres: {{dsn: "{url}", tables: [{table}]}}
    outputs:
      - name: {table}
        sink: {{type: postgres, dsn: "{url}", table: {table}_replica, mode: state, key: {key}}}
""")
    return load_config(path)


def test_a_primary_key_swap_within_a_transaction_keeps_both_rows(
    tmp_path: Path, spark: Any, cdc_url: str
) -> None:
    """A table with REPLICA IDENTITY FULL and a deferrable primary key (a
    diff log keyed by the primary key: proven) swaps two keys in one
    statement. Its updates, in WAL order, insert the row for key 2 before
    they retract the one it had; the previous apply took the last update of
    key 2 (the retraction) and deleted it. Their sum holds both rows. The
    replica ends equal to the source table (the upstream itself is the
    model), a failed commit on the way included."""
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table acc (id int, v text, "
                  "constraint acc_pk primary key (id) deferrable initially immediate)")
        c.execute("alter table acc replica identity full")
        c.execute("insert into acc select i, 'v' || i from generate_series(1, 10) i")
    cfg = _cdc(tmp_path, cdc_url, "acc", "[id]")
    try:
        with running(cfg, spark) as runners:
            wait_for(lambda: runners[0].status().get("resume") not in (None, ["0/0"]), 90,
                     "the snapshot to be durable")
            faults.arm("commit")
            with psycopg.connect(cdc_url, autocommit=True) as c:
                c.execute("update acc set id = 3 - id where id in (1, 2)")
                c.execute("update acc set id = 13 - id, v = v || '!' where id in (3, 10)")
            done = resumed_past(runners, flushed_lsn(cdc_url))
            wait_for(lambda: done() and runners[0].health.status == "running", 60,
                     lambda: f"the swaps: {runners[0].health}")
    finally:
        faults.disarm()
    with psycopg.connect(cdc_url) as c:
        upstream = c.execute("select id, v from acc order by id").fetchall()
        replica = c.execute("select id, v from acc_replica order by id").fetchall()
    assert [r[0] for r in upstream] == list(range(1, 11))
    assert replica == upstream


def test_a_cdc_table_feeds_a_state_table_keyed_by_its_primary_key_only(
    tmp_path: Path, cdc_url: str, no_spark: None
) -> None:
    """The key of a CDC table's output is its primary key (or replica
    identity index), read from the catalog when the source describes it: a
    state key that does not contain it, or a table without one, is refused
    then, before Spark starts."""
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table people (id int primary key, email text unique)")
        c.execute("create table loose (id int, email text)")
        c.execute("alter table loose replica identity full")
    with pytest.raises(AssertionError, match="Spark was started"):
        run(_cdc(tmp_path / "a", cdc_url, "people", "[email, id]"), out=None,
            install_signals=False)
    with pytest.raises(DefiniteError, match=r"output 'people': sink key \['email'\]: a state "
                       r"table's key must contain the output's upstream key \['id'\]"):
        run(_cdc(tmp_path / "b", cdc_url, "people", "[email]"), out=None, install_signals=False)
    with pytest.raises(DefiniteError, match=r"output 'loose': sink key \['id'\]: .*the source "
                       r"declares no key for it: a CDC table without a primary key.*\); give "
                       r"the table a primary key upstream and key the state table by it"):
        run(_cdc(tmp_path / "c", cdc_url, "loose", "[id]"), out=None, install_signals=False)
