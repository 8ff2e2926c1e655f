"""Shared fixtures: real peers only.

* ``pg_url`` -- a fresh database, dropped at the end of the test, on the
  private PostgreSQL cluster the run starts (``pg_logical``), or on the server
  whose admin URL ``RECLOCK_TEST_PG`` names.
* ``kafka`` -- a real single-node Apache Kafka broker (KRaft) for the run;
  ``kafka_cluster`` -- a real 3-node cluster for the failover tests
  (see tests/kafkabroker.py; tests/setup.sh fetches the jars).
* ``iceberg_rest`` -- Apache Iceberg's own REST catalog server for the run,
  started on first use (see tests/icebergrest.py; tests/setup.sh fetches the
  jars).
* ``sqlite_url`` -- a SQLite file in a temporary directory.
* ``store_url`` -- parametrized over both.

Every test is marked ``integration`` when it talks to a real peer (one of
:data:`PEERS` among its fixtures, or its module says so with
``pytestmark = pytest.mark.integration``: it starts Spark or ``reclock run``
processes itself), else ``unit``: ``pytest -m unit`` is the fast loop
(seconds, no PostgreSQL, Kafka or Spark).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, settings

from tests import lanes

settings.register_profile(
    "ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=60, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

ADMIN_URL = os.environ.get("RECLOCK_TEST_PG")


@pytest.fixture(scope="session")
def pg_admin_url(request: pytest.FixtureRequest) -> str:
    if not ADMIN_URL:
        return str(request.getfixturevalue("pg_logical").url)
    try:
        with psycopg.connect(ADMIN_URL, connect_timeout=5) as conn:
            conn.execute("select 1")
    except psycopg.OperationalError as exc:  # pragma: no cover - environment
        pytest.fail(f"PostgreSQL at RECLOCK_TEST_PG={ADMIN_URL} is not reachable: {exc}")
    return ADMIN_URL


@pytest.fixture
def pg_url(pg_admin_url: str) -> Iterator[str]:
    """A fresh, empty database for one test."""
    name = f"reclock_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = pg_admin_url.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(pg_admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'remap.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def store_url(request: pytest.FixtureRequest) -> str:
    if request.param == "sqlite":
        return str(request.getfixturevalue("sqlite_url"))
    return str(request.getfixturevalue("pg_url"))


def _kafka_broker() -> Any:
    from tests.kafkabroker import KafkaCluster

    # A killed broker comes back only after its controller gives up on the
    # old incarnation's session (broker.session.timeout.ms, 9 s by default):
    # a restart took 12-13 s, and 5 s with these (tests/sources and sinks
    # take the broker down and up).
    return KafkaCluster(nodes=1, settings={"broker.session.timeout.ms": "3000",
                                           "broker.heartbeat.interval.ms": "500"}).start()


def _pg_cluster() -> Any:
    from tests.pgcluster import PgCluster

    return PgCluster().start()


def _mariadb_server() -> Any:
    from tests.mariadb import MariaDB

    return MariaDB().start()


def _iceberg_rest_server() -> Any:
    from tests.icebergrest import IcebergRestServer

    return IcebergRestServer().start()


def _spark_cds() -> None:
    from tests import spark_cds

    spark_cds.use()


def _bytecode() -> None:
    """The checkout's modules compiled once: every driver, CLI command and
    Spark worker the tests start as a process imports them, and where
    PYTHONDONTWRITEBYTECODE is set (as on the CI machines) each compiled
    them again (0.25 s of its start-up; Python reads bytecode that exists
    whatever the variable says)."""
    import compileall

    root = Path(__file__).resolve().parents[1]
    for pkg in ("reclock", "sinks", "sources", "remap_store", "tests"):
        compileall.compile_dir(root / pkg, quiet=2)


#: What each session fixture's peer is made by, and the method that stops it
#: (None: nothing to stop).
_PEERS: dict[str, tuple[Callable[[], Any], str | None]] = {
    "kafka": (_kafka_broker, "close"),
    "pg_logical": (_pg_cluster, "stop"),
    "mariadb": (_mariadb_server, "stop"),
    "iceberg_rest": (_iceberg_rest_server, "close"),
    "spark_cds": (_spark_cds, None),  # every Spark driver maps the archive
}

#: Peers started in the background while the unit tests run (see
#: :func:`pytest_collection_finish`): fixture name -> the future of the peer.
_WARMING: dict[str, Future[Any]] = {}


def _warm(name: str) -> Any:
    """The peer ``name``, started in the background if it was, else now."""
    fut = _WARMING.pop(name, None)
    return _PEERS[name][0]() if fut is None else fut.result()


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """One Spark session for the whole test run (local[2])."""
    from reclock.runtime.spark import spark_session

    _warm("spark_cds")

    session = spark_session("local[2]", "reclock-tests", {"spark.sql.shuffle.partitions": "2"})
    yield session
    session.stop()


@pytest.fixture(scope="session")
def iceberg_rest() -> Iterator[object]:
    """Apache Iceberg's own REST catalog server (the apache/iceberg-rest-fixture
    image's, over a JDBC catalog on SQLite) for the whole run, on a free port
    with its warehouse in a temporary directory; tests use tables of their
    own names (see tests/icebergrest.py)."""
    server = _warm("iceberg_rest")
    yield server
    server.close()


@pytest.fixture(scope="session")
def s3() -> Iterator[object]:
    """A local S3 endpoint (moto's server) for the whole run; tests make
    their own buckets (see tests/s3server.py)."""
    from tests.s3server import s3_server

    with s3_server() as server:
        yield server


@pytest.fixture(scope="session")
def kafka() -> Iterator[object]:
    """A real single-node Apache Kafka broker (KRaft) for the whole run."""
    cluster = _warm("kafka")
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def kafka_cluster() -> Iterator[object]:
    """A real 3-node Apache Kafka cluster (replication factor 3,
    min.insync.replicas=2) for the failover tests, started on first use."""
    from tests.kafkabroker import KafkaCluster

    # A SIGKILLed broker is fenced, and its partitions move, after the
    # controller misses its heartbeats for broker.session.timeout.ms (9 s by
    # default); 3 s keeps the failover test's waits short.
    cluster = KafkaCluster(nodes=3, settings={"broker.session.timeout.ms": "3000",
                                              "broker.heartbeat.interval.ms": "500"}).start()
    yield cluster
    cluster.close()


@pytest.fixture
def cdc_url(pg_logical: Any) -> Iterator[str]:
    """A fresh database in the logical-replication cluster for one test; its
    replication slots are dropped with it."""
    name = f"cdc_{uuid.uuid4().hex[:12]}"
    admin = pg_logical.url
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield admin.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            for _ in range(50):
                conn.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                             "WHERE database = %s AND active_pid IS NOT NULL", (name,))
                try:
                    conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM "
                                 "pg_replication_slots WHERE database = %s", (name,))
                    break
                except psycopg.errors.ObjectInUse:
                    time.sleep(0.1)
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def pg_logical() -> Iterator[object]:
    """A private PostgreSQL cluster with wal_level=logical (see tests/pgcluster.py)."""
    cluster = _warm("pg_logical")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def mariadb() -> Iterator[object]:
    """A private MariaDB server with a ROW-format binary log, for the whole
    run (see tests/mariadb.py)."""
    server = _warm("mariadb")
    yield server
    server.stop()


@pytest.fixture
def mysql_url(mariadb: Any) -> Iterator[str]:
    """A fresh database on the run's MariaDB server, dropped at the end."""
    name, url = mariadb.database()
    try:
        yield url
    finally:
        mariadb.execute(f"DROP DATABASE IF EXISTS `{name}`")


#: Fixtures that start or reach a real peer (PostgreSQL, Kafka, Spark, MariaDB,
#: Iceberg's REST catalog server).
PEERS = frozenset({"pg_admin_url", "pg_logical", "spark", "kafka", "kafka_cluster", "mariadb",
                   "iceberg_rest"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks each test unit or integration, and runs the unit tests first
    (each group in its order): the peers start meanwhile."""
    for item in items:
        if item.get_closest_marker("integration") is not None:
            continue
        uses = set(getattr(item, "fixturenames", ()))
        item.add_marker(pytest.mark.integration if uses & PEERS else pytest.mark.unit)
    items.sort(key=lambda item: item.get_closest_marker("integration") is not None)


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reports its collection
def pytest_collection_finish(session: pytest.Session) -> None:
    """With tests that start Spark selected, every Spark driver the run starts
    maps a class-data-sharing archive of Spark's classes (tests/spark_cds.py).
    The archive and the peers this process's tests use (a Kafka broker, the
    PostgreSQL cluster, MariaDB, Iceberg's REST catalog server) are made in
    the background while the unit tests run; their fixtures wait for them.
    Under xdist, a worker makes those of its lane (tests/lanes.py)."""
    lanes.publish(session.config, session.items)
    mine = lanes.runs_here(session.config, session.items)
    integration = [i for i in mine if i.get_closest_marker("integration")]
    if not integration:
        return
    used = set().union(*(set(getattr(i, "fixturenames", ())) for i in integration))
    if "pg_admin_url" in used and not ADMIN_URL:
        used.add("pg_logical")
    used.add("spark_cds")
    pool = ThreadPoolExecutor(4, thread_name_prefix="warm")
    if lanes.once_per_run(session.config):
        pool.submit(_bytecode)
    for name in _PEERS.keys() & used:
        _WARMING[name] = pool.submit(_PEERS[name][0])
    pool.shutdown(wait=False)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Peers started in the background that no test asked for are stopped; a
    worker hands its counts (tests/tally.py) to the controller."""
    for name, fut in list(_WARMING.items()):
        try:
            peer = fut.result()
        except Exception:  # it did not start: nothing to stop (no test asked for it)
            continue
        stop = _PEERS[name][1]
        if stop is not None:
            getattr(peer, stop)()
    _WARMING.clear()
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        from tests.tally import TALLY

        out["tally"] = {k: dict(v) for k, v in TALLY.items()}


class _Controller:
    """xdist's controller: the lanes' scheduler, and the workers' counts."""

    def __init__(self) -> None:
        self.lanes_dir = lanes.lanes_dir()

    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput["lanes_dir"] = str(self.lanes_dir)

    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        if config.getvalue("dist") != "load":
            return None
        return lanes.make_scheduler(config, log, self.lanes_dir)

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        from tests.tally import count

        for suite, numbers in getattr(node, "workeroutput", {}).get("tally", {}).items():
            count(suite, **numbers)

    def pytest_unconfigure(self) -> None:
        import shutil

        shutil.rmtree(self.lanes_dir, ignore_errors=True)


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Controller(), "reclock-lanes")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The fault-injection and bad-input counts (see ``tests/tally.py``)."""
    from tests.tally import TALLY

    if not TALLY:
        return
    terminalreporter.section("fault injection and bad input")
    for suite in sorted(TALLY):
        parts = ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in TALLY[suite].items())
        terminalreporter.write_line(f"{suite}: {parts}")
