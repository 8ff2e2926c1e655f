"""The sink contract (reclock/contracts/sink.py), once, for every sink: Delta, Postgres
(log and state tables), Kafka (a JSON log, and registry Avro upserts), Iceberg
(log and state tables; SQLite, PostgreSQL, REST and Glue catalogs: the REST
ones the in-process one of tests/icebergrest.py and Apache Iceberg's own
server) and the console.
Each sink's own test module keeps only what is its own (its storage layout, its
concurrency, its types).

Every sink, against a real peer (a Delta table on disk and on a local S3 endpoint, the private
PostgreSQL cluster, the shared Kafka broker, Iceberg's REST catalog server):

* a new output has the initial state, and reads back empty;
* staged rows become visible only on commit, and a new sink object for the
  same output reads back the same state and rows;
* a closed upper stays closed; an upper never goes backwards;
* a commit whose ``expected`` is stale is fenced and writes nothing, and its
  staged files stay for a retry;
* the stager is picklable, restaging the same part replaces it, and
  ``screen`` keeps every row the sink can store;
* an output belongs to the pipeline that committed it: another pipeline's
  read of its state, or commit, is a definite error naming both (an output
  committed before owners were recorded is adopted by the first).
"""

from __future__ import annotations

import io
import pickle
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from reclock.contracts.sink import OutputOwned, Owner, PersistSink, SinkFenced, SinkState
from tests.sinks.rows import USER, updates

NAME = "orders.main"


@dataclass
class Target:
    """One sink kind: how to open its output, and where its staged files are."""

    kind: str
    open_as: Callable[[Owner | None], PersistSink]  # the output, for a pipeline (or none)
    staged_exists: Callable[[PersistSink, dict[str, Any]], bool | None]  # None: keeps none
    keeps_rows: bool = True  # the console keeps only the state
    owned: bool = True  # records the pipeline that committed (not the console)

    def open(self) -> PersistSink:
        return self.open_as(None)


def _delta(tmp_path: Path, request: Any) -> Target:
    from reclock.sinks.delta import DeltaSink

    return Target("delta", lambda owner: DeltaSink(NAME, tmp_path / "out", owner=owner),
                  lambda s, d: (s.path / d["path"]).exists())  # type: ignore[attr-defined]


def _delta_s3(tmp_path: Path, request: Any) -> Target:
    from reclock.sinks._store import S3Access
    from reclock.sinks.delta import DeltaSink

    s3 = request.getfixturevalue("s3")
    access = S3Access.resolve(env=s3.env())
    uri = f"s3://{s3.bucket()}/lake/out"
    return Target("delta-s3", lambda owner: DeltaSink(NAME, uri, storage=access, owner=owner),
                  lambda s, d: s.location.stat(d["path"]) is not None)  # type: ignore[attr-defined]


def _postgres(mode: str) -> Callable[[Path, Any], Target]:
    def make(tmp_path: Path, request: Any) -> Target:
        from reclock.sinks.postgres import PostgresSink

        url = request.getfixturevalue("pg_url")
        return Target(f"postgres-{mode}", lambda owner: PostgresSink(
            NAME, dsn=url, table="orders", staging_dir=tmp_path / "staging", mode=mode,
            key=("k",) if mode == "state" else (), owner=owner),
            lambda s, d: (s.staging_root / d["path"]).exists())  # type: ignore[attr-defined]
    return make


def _kafka(tmp_path: Path, request: Any) -> Target:
    from reclock.sinks.kafka import KafkaSink

    kafka = request.getfixturevalue("kafka")
    topic = f"contract-{uuid.uuid4().hex[:10]}"
    kafka.create_topic(topic, 2)
    return Target("kafka", lambda owner: KafkaSink(
        NAME, bootstrap_servers=kafka.bootstrap, topic=topic, staging_dir=tmp_path / "staging",
        timeout_s=10.0, key_columns=("k",), owner=owner),
        lambda s, d: (s.staging_root / d["path"]).exists())  # type: ignore[attr-defined]


def _kafka_avro_upsert(tmp_path: Path, request: Any) -> Target:
    """Registry Avro records of the current row per key (tombstones for deletes)."""
    from reclock.clients.schema_registry import RegistryHandle
    from reclock.sinks.kafka import KafkaSink
    from tests.registry import RegistryServer

    kafka = request.getfixturevalue("kafka")
    registry = RegistryServer()
    request.addfinalizer(registry.close)
    topic = f"contract-{uuid.uuid4().hex[:10]}"
    kafka.create_topic(topic, 2)
    return Target("kafka-avro-upsert", lambda owner: KafkaSink(
        NAME, bootstrap_servers=kafka.bootstrap, topic=topic, staging_dir=tmp_path / "staging",
        timeout_s=10.0, format="avro", registry=RegistryHandle.writer(registry.url),
        envelope="upsert", key=("k",), owner=owner),
        lambda s, d: (s.staging_root / d["path"]).exists())  # type: ignore[attr-defined]


def _console(tmp_path: Path, request: Any) -> Target:
    from reclock.sinks.console import ConsoleSink

    return Target("console", lambda _owner: ConsoleSink(NAME, tmp_path / "console.json",
                                                        out=io.StringIO()),
                  lambda s, d: None, keeps_rows=False, owned=False)


def _iceberg(mode: str, where: str = "local") -> Callable[[Path, Any], Target]:
    """An Iceberg table: a SQLite catalog and a local warehouse, a
    PostgreSQL catalog (psycopg 3) and an S3 warehouse (moto), a REST
    catalog (tests/icebergrest.py's in-process one) with a bearer token,
    Apache Iceberg's own REST catalog server (``rest-java``: the run's, its
    warehouse on disk), or an AWS Glue catalog and an S3 warehouse (both
    moto's, one server; a state table, whose errors table is a second Glue
    table)."""

    def make(tmp_path: Path, request: Any) -> Target:
        from reclock.sinks._store import S3Access
        from reclock.sinks.iceberg import CatalogConfig, IcebergSink

        if where == "local":
            cat = CatalogConfig(type="sql", uri=f"sqlite:///{tmp_path}/catalog.db",
                                warehouse=str(tmp_path / "wh"))
            storage = None
        elif where == "rest":
            from pydantic import SecretStr

            from tests.icebergrest import RestCatalog

            server = RestCatalog(tmp_path, "contract-token-77")
            request.addfinalizer(server.close)
            cat = CatalogConfig(type="rest", uri=server.url,
                                token=SecretStr("contract-token-77"))
            storage = None
        elif where == "glue":
            # moto's Glue and S3 (one server), reached as the storage block says
            s3 = request.getfixturevalue("s3")
            env = s3.env()
            storage = S3Access.resolve(env=env)
            cat = CatalogConfig(type="glue", warehouse=f"s3://{s3.bucket()}/wh")
            given = {"endpoint": env["AWS_ENDPOINT_URL"], "region": env["AWS_REGION"],
                     "access_key_id": env["AWS_ACCESS_KEY_ID"],
                     "secret_access_key": env["AWS_SECRET_ACCESS_KEY"]}
        elif where == "rest-java":
            cat = CatalogConfig(type="rest", uri=request.getfixturevalue("iceberg_rest").url)
            storage = None
        else:
            s3 = request.getfixturevalue("s3")
            url = request.getfixturevalue("pg_url").replace("postgresql://",
                                                            "postgresql+psycopg://", 1)
            cat = CatalogConfig(type="sql", uri=url,
                                warehouse=f"s3://{s3.bucket()}/wh")
            storage = S3Access.resolve(env=s3.env())
        table = f"lake.orders_{uuid.uuid4().hex[:8]}"
        access = cat.access(storage, given if where == "glue" else None)

        def staged_exists(s: PersistSink, d: dict[str, Any]) -> bool:
            sink: IcebergSink = s  # type: ignore[assignment]
            t = sink._load()
            return t is not None and sink._staged_dir(t).stat(d["path"]) is not None

        return Target(f"iceberg-{mode}-{where}", lambda owner: IcebergSink(
            NAME, access, table, storage=storage, mode=mode,  # type: ignore[arg-type]
            key=("k",) if mode == "state" else (), owner=owner), staged_exists)
    return make


KINDS = {"delta": _delta, "delta-s3": _delta_s3, "postgres-log": _postgres("log"),
         "postgres-state": _postgres("state"), "kafka": _kafka,
         "kafka-avro-upsert": _kafka_avro_upsert, "console": _console,
         "iceberg-log": _iceberg("log"), "iceberg-state": _iceberg("state"),
         "iceberg-s3-pg": _iceberg("log", "s3-pg"),
         "iceberg-state-s3-pg": _iceberg("state", "s3-pg"),
         "iceberg-rest": _iceberg("state", "rest"),
         "iceberg-glue": _iceberg("state", "glue"),
         "iceberg-rest-java": _iceberg("state", "rest-java")}


#: The kinds that need a real peer (PostgreSQL, Kafka, moto's server, Iceberg's
#: REST catalog server).
PEER_KINDS = {"delta-s3", "postgres-log", "postgres-state", "kafka", "kafka-avro-upsert",
              "iceberg-s3-pg", "iceberg-state-s3-pg", "iceberg-glue", "iceberg-rest-java"}


def _params(kinds: Iterable[str]) -> list[Any]:
    return [pytest.param(k, marks=pytest.mark.integration) if k in PEER_KINDS else k
            for k in kinds]


@pytest.fixture(params=_params(KINDS))
def target(request: Any, tmp_path: Path) -> Target:
    return KINDS[request.param](tmp_path, request)


#: The kinds whose output lives outside the pipeline's state, where another
#: pipeline could write it (not the console: its state is the pipeline's own).
OWNED_KINDS = [k for k in KINDS if k != "console"]


@pytest.fixture(params=_params(OWNED_KINDS))
def owned_target(request: Any, tmp_path: Path) -> Target:
    return KINDS[request.param](tmp_path, request)


@pytest.fixture
def sink(target: Target) -> Iterator[PersistSink]:
    s = target.open()
    s.ensure(USER)
    yield s
    s.close()


def held(s: PersistSink) -> list[str]:
    t = s.read_updates()
    ok = t.filter(pa.compute.is_null(t.column("_error")))
    return sorted(ok.column("k").to_pylist())


def test_a_new_output_has_the_initial_state(target: Target, sink: PersistSink) -> None:
    assert sink.state() == SinkState()
    if target.keeps_rows:
        assert sink.read_updates().num_rows == 0


def test_staged_rows_show_on_commit_and_read_back_in_a_new_sink(
    target: Target, sink: PersistSink
) -> None:
    st = sink.stager()
    staged = st.stage("b1", 0, updates(["a", "b"], 10)) + st.stage("b1", 1, updates(
        ["c"], 10, offset=2, part=1))
    assert sink.state() == SinkState()
    if target.keeps_rows:
        assert held(sink) == []  # staged is not visible
    sink.commit(staged, SinkState(), SinkState(11, '"p11"'))
    again = target.open()
    assert again.state() == SinkState(11, '"p11"')
    if target.keeps_rows:
        assert held(again) == ["a", "b", "c"]
        assert held(sink) == ["a", "b", "c"]


def test_a_closed_upper_stays_closed(target: Target, sink: PersistSink) -> None:
    sink.commit([], SinkState(), SinkState(100, '"p"'))
    sink.commit([], SinkState(100, '"p"'), SinkState(None, "[]"))
    assert sink.state() == SinkState(None, "[]")
    assert target.open().state() == SinkState(None, "[]")
    sink.commit([], SinkState(None, "[]"), SinkState(None, "[]"))  # closed stays closed
    assert sink.state() == SinkState(None, "[]")


def test_an_upper_never_goes_backwards(sink: PersistSink) -> None:
    sink.commit([], SinkState(), SinkState(100))
    with pytest.raises(ValueError, match="backwards"):
        sink.commit([], SinkState(100), SinkState(50))
    with pytest.raises(ValueError, match="backwards"):
        sink.commit([], SinkState(None), SinkState(50))
    assert sink.state() == SinkState(100)


def test_a_stale_expected_is_fenced_and_writes_nothing(target: Target, sink: PersistSink) -> None:
    sink.commit(sink.stager().stage("b1", 0, updates(["a"], 50)), SinkState(),
                SinkState(100, '"p100"'))
    staged = sink.stager().stage("zombie", 0, updates(["z"], 150, offset=1))
    for stale in (SinkState(), SinkState(100, '"other"'), SinkState(100),
                  SinkState(50, '"p100"')):
        with pytest.raises(SinkFenced) as info:
            sink.commit(staged, stale, SinkState(200, '"p200"'))
        assert NAME in str(info.value)
    assert sink.state() == SinkState(100, '"p100"')
    assert target.open().state() == SinkState(100, '"p100"')
    if target.keeps_rows:
        assert held(sink) == ["a"]
    assert target.staged_exists(sink, staged[0]) in (None, True)  # kept for a retry


def test_the_stager_is_picklable_restaging_replaces_and_screen_keeps_good_rows(
    target: Target, sink: PersistSink
) -> None:
    st = pickle.loads(pickle.dumps(sink.stager()))
    good = updates(["a", "b"], 10)
    screened = st.screen(good)
    assert screened.num_rows == 2 and screened.column("_error").null_count == 2
    st.stage("b", 0, updates(["x", "y", "z"], 10))
    staged = st.stage("b", 0, good)  # the same part again: replaces it
    sink.commit(staged, SinkState(), SinkState(11))
    if target.keeps_rows:
        assert held(sink) == ["a", "b"]


def test_an_output_belongs_to_the_pipeline_that_committed_it(owned_target: Target) -> None:
    """Two pipelines (two identities) on one target: the first to commit
    owns it, recorded with its state; the other's read of the state and its
    commit are :class:`OutputOwned`, naming the output, both pipelines and
    the owner's state location, and write nothing; the owner goes on. An
    output committed before owners were recorded (``sink``: no owner) is
    adopted by the first pipeline that commits."""
    target = owned_target
    assert target.owned
    sink = target.open()
    sink.ensure(USER)
    s1 = SinkState(100, '"p100"')
    sink.commit(sink.stager().stage("old", 0, updates(["a"], 50)), SinkState(), s1)
    a = target.open_as(Owner("pipe-a", "/state/a"))
    a.ensure(USER)
    assert a.state() == s1  # no owner recorded: adopted
    s2 = SinkState(200, '"p200"')
    a.commit(a.stager().stage("a1", 0, updates(["b"], 150, offset=1)), s1, s2)
    b = target.open_as(Owner("pipe-b", "/state/b"))
    b.ensure(USER)
    with pytest.raises(OutputOwned) as err:
        b.state()
    text = str(err.value)
    assert f"output {NAME!r}" in text and "'pipe-a' (state in /state/a)" in text, text
    assert "this pipeline is 'pipe-b' (state in /state/b)" in text, text
    assert "two pipelines must not write one output" in (err.value.hint or "")
    staged = b.stager().stage("b1", 0, updates(["z"], 250, offset=9))
    with pytest.raises(OutputOwned):
        b.commit(staged, s2, SinkState(300, '"p300"'))
    again = target.open_as(Owner("pipe-a", "/state/a"))
    assert again.state() == s2
    if target.keeps_rows:
        assert held(again) == ["a", "b"]
    s3 = SinkState(300, '"p300"')
    a.commit(a.stager().stage("a2", 0, updates(["c"], 250, offset=2)), s2, s3)
    assert target.open_as(Owner("pipe-a")).state() == s3
    # A reader that names no pipeline (verify of an old build, a tool) is not refused.
    assert target.open().state() == s3
    for s in (a, b, again, sink):
        s.close()
