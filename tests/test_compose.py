"""The docker compose deployment (compose.yaml, Dockerfile, examples/compose/).

There is no Docker engine here, so the deployment is checked in two ways:

* statically: the services, pinned images, ports, volumes, dependencies and
  healthchecks of compose.yaml, the files it refers to, the Dockerfile and
  .dockerignore, and the pipeline YAML as compose runs it;
* by running what every service runs, outside containers: the demo producer
  against the test run's Apache Kafka broker and PostgreSQL databases made with the init
  SQL, the pipeline file itself (hosts pointed at those by its environment
  variables) on the test Spark session, the ``reclock run`` command line, and
  the Spark master and worker classes through the installed PySpark's
  ``spark-class`` with the options compose passes.
"""

from __future__ import annotations

import base64
import fnmatch
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tomllib
import urllib.request
import uuid
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import psycopg
import pyspark
import pytest
import yaml
from confluent_kafka import Consumer, TopicPartition

from reclock.cli import build_parser, cmd_run
from reclock.config import FileSinkConfig, PostgresSinkConfig, load_config
from tests.running import read_updates, running, wait_for
from tests.sources.cdc import flushed_lsn, resumed_past

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "compose.yaml"
DOCKERFILE = REPO / "Dockerfile"
EXAMPLES = REPO / "examples" / "compose"
PRODUCER = EXAMPLES / "producer.py"
SPARK_HOME = Path(pyspark.__file__).resolve().parent

SERVICES = {"kafka", "postgres", "spark-master", "spark-worker", "pipeline", "producer",
            "prometheus", "grafana"}
BUILT = {"spark-master", "spark-worker", "pipeline", "producer"}
#: Where the Dockerfile puts the repository (``WORKDIR`` + ``COPY . .``).
APP_DIR = PurePosixPath("/app")

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def expand(value: Any, env: Mapping[str, str] | None = None) -> str:
    """Compose's interpolation of ``${VAR}`` / ``${VAR:-default}``: the
    variable from ``env`` (default: none set), else its default."""
    env = env or {}

    def sub(m: re.Match[str]) -> str:
        if m[1] in env:
            return env[m[1]]
        assert m[2] is not None, f"${{{m[1]}}} has no default in compose.yaml"
        return m[2]

    return _VAR.sub(sub, str(value))


def command_args(service: Mapping[str, Any]) -> list[str]:
    """A service's command as an argument list (compose splits strings like a shell)."""
    cmd = service.get("command") or []
    return [expand(a) for a in cmd] if isinstance(cmd, list) else shlex.split(expand(cmd))


def service_env(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: expand(v) for k, v in env.items()}


def mounts(service: Mapping[str, Any]) -> list[tuple[str, str, bool]]:
    """``(source, target, read_only)`` of each volume entry (short or long syntax)."""
    out = []
    for v in service.get("volumes") or []:
        if isinstance(v, str):
            parts = v.split(":")
            out.append((parts[0], parts[1], len(parts) > 2 and "ro" in parts[2].split(",")))
        else:
            out.append((v["source"], v["target"], bool(v.get("read_only"))))
    return out


def is_bind(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def host_file(service: Mapping[str, Any], container_path: str) -> Path:
    """The repository file behind ``container_path`` in a service: a bind
    mount's source, or the image's copy of the repository under /app."""
    for src, target, _ in mounts(service):
        if is_bind(src) and container_path == target:
            return (REPO / src).resolve()
    p = PurePosixPath(container_path)
    assert p.is_relative_to(APP_DIR) and "build" in service, \
        f"{container_path} is neither mounted nor in the image"
    return REPO / p.relative_to(APP_DIR)


def healthcheck_code(service: Mapping[str, Any]) -> str | None:
    """The Python code of a ``python3 -c`` healthcheck, if it is one."""
    test = service["healthcheck"]["test"]
    if isinstance(test, list) and test[:3] in (["CMD", "python3", "-c"], ["CMD", "python", "-c"]):
        return str(test[3])
    return None


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(compose["services"])


def _image_env_to_properties(env: dict[str, Any]) -> dict[str, str]:
    """What the apache/kafka image does with its environment: ``KAFKA_FOO_BAR``
    becomes ``foo.bar`` (``__`` is ``_``, ``___`` is ``-``); ``CLUSTER_ID``
    formats the storage; ``KAFKA_HEAP_OPTS`` and friends go to the JVM."""
    jvm = {"KAFKA_HEAP_OPTS", "KAFKA_OPTS", "KAFKA_JVM_PERFORMANCE_OPTS", "KAFKA_LOG4J_OPTS"}
    props = {}
    for key, value in env.items():
        if not key.startswith("KAFKA_") or key in jvm:
            continue
        name = key[len("KAFKA_"):].lower().replace("___", "-").replace("__", "\0")
        props[name.replace("_", ".").replace("\0", "_")] = str(value)
    return props


@pytest.fixture(scope="module")
def compose_kafka(services: dict[str, dict[str, Any]]) -> Iterator[Any]:
    """The compose file's kafka service, for real: its environment turned into
    server.properties as the apache/kafka image does, on this machine's Kafka
    jars (the image's version, see test_images_are_pinned), with only its
    host names and ports rewritten to free loopback ports."""
    from tests.kafkabroker import KafkaCluster

    env = services["kafka"]["environment"]
    cluster = KafkaCluster(nodes=1)
    node = cluster.nodes[0]
    ports = {"9092": str(node.port), "9093": str(node.controller_port),
             "29092": str(_free_port())}
    props = {}
    for key, value in _image_env_to_properties(env).items():
        value = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)  # compose's defaults
        value = re.sub(r"(//|@)(kafka|localhost)?:(\d+)",
                       lambda m: f"{m.group(1)}127.0.0.1:{ports.get(m.group(3), m.group(3))}",
                       value)
        props[key] = value
    props["log.dirs"] = str(node.dir / "data")  # the image's volume
    assert props["controller.quorum.voters"] == f"1@127.0.0.1:{node.controller_port}"
    cluster.settings = props
    cluster.cluster_id = str(env["CLUSTER_ID"])
    # The INTERNAL listener is what the other services use: bootstrap through it.
    assert f"INTERNAL://127.0.0.1:{node.port}" in props["advertised.listeners"]
    cluster.start()
    yield cluster
    cluster.close()


# -- compose.yaml -----------------------------------------------------------------------


def test_services_and_images(services: dict[str, dict[str, Any]]) -> None:
    assert set(services) == SERVICES
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for name, svc in services.items():
        image = svc.get("image")
        assert image, f"{name}: no image"
        repo, _, tag = image.rpartition(":")
        assert repo and "/" not in tag, f"{name}: image {image!r} has no tag"
        # major.minor.patch (Prometheus tags them vX.Y.Z); PostgreSQL (since 10)
        # numbers its releases major.minor
        assert tag != "latest" and re.fullmatch(r"v?\d+\.\d+(\.\d+)?(-[a-z0-9.]+)?", tag), \
            f"{name}: image {image!r} is not pinned to an exact version"
        if name in BUILT:
            build = svc.get("build")
            context = build if isinstance(build, str) else (build or {}).get("context")
            assert context == ".", f"{name}: not built from the repository's Dockerfile"
            dockerfile = (build or {}).get("dockerfile", "Dockerfile") \
                if isinstance(build, dict) else "Dockerfile"
            assert (REPO / context / dockerfile).is_file()
            assert image == f"reclock:{version}"  # one image, tagged with the project version
        else:
            assert "build" not in svc
    # The broker version the tests run (tests/broker/pom.xml).
    from tests.kafkabroker import kafka_version

    assert services["kafka"]["image"] == f"apache/kafka:{kafka_version()}"
    assert re.fullmatch(r"postgres:16\.\d+(-\w+)?", services["postgres"]["image"])


def test_referenced_files_exist(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        for src, _target, _ in mounts(svc):
            if is_bind(src):
                assert (REPO / src).exists(), f"{name}: bind mount source {src} is missing"
        for arg in command_args(svc):
            if arg.startswith("/") and Path(arg).suffix in (".py", ".yaml", ".yml", ".sql"):
                assert host_file(svc, arg).is_file(), f"{name}: {arg} is missing"
    init = [(src, t) for src, t, _ in mounts(services["postgres"])
            if t.startswith("/docker-entrypoint-initdb.d/")]
    assert [Path(src).name for src, _ in sorted(init, key=lambda x: x[1])] == \
        ["databases.sql", "init.sql"]  # the reclock database first, then the shop tables
    assert all((REPO / src).is_file() and t.endswith(".sql") for src, t in init)
    assert host_file(services["producer"], command_args(services["producer"])[-1]) == PRODUCER
    ready = service_env(services["producer"])["PRODUCER_READY_FILE"]
    assert f"'{ready}'" in (healthcheck_code(services["producer"]) or "")


def test_ports_are_unique(services: dict[str, dict[str, Any]]) -> None:
    seen: dict[int, str] = {}  # host port -> service (on any address: the strict reading)
    for name, svc in services.items():
        for p in svc.get("ports") or []:
            spec = expand(p)
            parts = spec.split(":")
            assert len(parts) in (2, 3), f"{name}: publish {spec!r} with a fixed host port"
            host, container = int(parts[-2]), int(parts[-1])
            assert 0 < host < 65536 and 0 < container < 65536
            assert host not in seen, f"host port {host} used by {seen[host]} and {name}"
            seen[host] = name
            if len(parts) == 3:
                assert parts[0] == "127.0.0.1"  # by default, this machine only
    assert set(seen.values()) == {"kafka", "postgres", "spark-master", "pipeline",
                                  "prometheus", "grafana"}


def test_named_volumes(compose: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    declared = set(compose.get("volumes") or {})
    used = {src for svc in services.values() for src, _, _ in mounts(svc) if not is_bind(src)}
    assert used == declared == {"kafka-data", "postgres-data", "pipeline-state",
                                "prometheus-data"}
    targets = {name: {t for s, t, _ in mounts(svc) if s == "pipeline-state"}
               for name, svc in services.items()}
    # The state dir is shared by the driver and the executors (file outputs stage there).
    assert targets["pipeline"] == targets["spark-worker"] == {"/state"}


def test_dependencies_and_healthchecks(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        hc = svc.get("healthcheck")
        assert hc and hc.get("test"), f"{name}: no healthcheck"
        code = healthcheck_code(svc)
        if code is not None:
            compile(code, f"{name} healthcheck", "exec")
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        for dep, how in deps.items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            if how.get("condition") == "service_healthy":
                assert services[dep].get("healthcheck"), f"{dep} has no healthcheck"
    # No cycles: a topological order exists.
    order: list[str] = []
    while len(order) < len(services):
        ready = [n for n, s in services.items() if n not in order
                 and all(d in order for d in (s.get("depends_on") or {}))]
        assert ready, f"dependency cycle among {set(services) - set(order)}"
        order.extend(sorted(ready))
    healthy = {d for d, how in services["pipeline"]["depends_on"].items()
               if how["condition"] == "service_healthy"}
    assert {"kafka", "postgres", "spark-master"} <= healthy
    assert services["spark-worker"]["depends_on"]["spark-master"]["condition"] == \
        "service_healthy"
    assert {"kafka", "postgres"} <= set(services["producer"]["depends_on"])
    assert services["pipeline"]["restart"] in ("on-failure", "unless-stopped", "always")
    assert services["producer"]["restart"] in ("on-failure", "unless-stopped", "always")


def test_kafka_and_postgres_settings(services: dict[str, dict[str, Any]]) -> None:
    kafka = service_env(services["kafka"])
    assert "broker" in kafka["KAFKA_PROCESS_ROLES"] and "controller" in kafka[
        "KAFKA_PROCESS_ROLES"]  # KRaft, one node
    assert len(base64.urlsafe_b64decode(kafka["CLUSTER_ID"] + "==")) == 16  # a base64 UUID
    advertised = {name: address for name, address in
                  (a.split("://", 1) for a in kafka["KAFKA_ADVERTISED_LISTENERS"].split(","))}
    listening = {name: address for name, address in
                 (a.split("://", 1) for a in kafka["KAFKA_LISTENERS"].split(","))}
    internal = next(n for n, a in advertised.items() if a == "kafka:9092")  # compose network
    assert listening[internal] == ":9092"
    host_listener, host_address = next((n, a) for n, a in advertised.items()
                                       if a.startswith("localhost:"))
    # The host listener's container port is published at the advertised host port.
    published = f"127.0.0.1:{host_address.split(':')[1]}:{listening[host_listener][1:]}"
    assert published in [expand(p) for p in services["kafka"]["ports"]]
    moved = {"KAFKA_HOST_PORT": "39092"}
    assert expand(services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"], moved) \
        .endswith("localhost:39092")
    assert [expand(p, moved) for p in services["kafka"]["ports"]] == \
        [f"127.0.0.1:39092:{listening[host_listener][1:]}"]
    assert host_listener in kafka["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"]
    assert any(t == kafka["KAFKA_LOG_DIRS"] for s, t, _ in mounts(services["kafka"])
               if s == "kafka-data")
    pg = services["postgres"]
    args = command_args(pg)
    settings = {args[i + 1] for i, a in enumerate(args) if a == "-c"}
    assert {"wal_level=logical", "max_replication_slots=10", "max_wal_senders=10"} <= settings
    env = service_env(pg)
    assert env["POSTGRES_PASSWORD"] and "${POSTGRES_PASSWORD:-" in json.dumps(
        pg["environment"])  # from the environment, with a default
    assert "pg_isready" in pg["healthcheck"]["test"]


# -- Dockerfile -------------------------------------------------------------------------


def _dockerfile() -> tuple[list[str], str]:
    text = DOCKERFILE.read_text()
    joined = re.sub(r"\\\n", " ", text)
    lines = [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.startswith("#")]
    return lines, joined


def test_dockerfile() -> None:
    lines, text = _dockerfile()
    froms = [ln.split()[1] for ln in lines if ln.upper().startswith("FROM ")]
    assert len(froms) == 1
    m = re.fullmatch(r"python:(3\.11)\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?", froms[0])
    assert m, f"base image {froms[0]!r} is not a pinned python:3.11.x-slim-bookworm"
    runs = " ".join(ln for ln in lines if ln.startswith("RUN "))
    assert re.search(r"apt-get install .*openjdk-17-jre-headless", runs)
    assert "procps" in runs
    assert re.search(r"pip install (--no-deps )?\.(;|\s|$)", runs)  # the repository itself
    # The native Kafka reader is compiled there, and the build checks that it loads.
    assert re.search(r"apt-get install .*\bgcc\b.*pip install (--no-deps )?\.", runs)
    assert "native_reader() is not None" in runs
    env = dict(re.findall(r"\b([A-Z_]+)=(\"[^\"]*\"|\S+)", " ".join(
        ln[4:] for ln in lines if ln.startswith("ENV "))))
    # SPARK_HOME is where pip puts PySpark for the base image's Python.
    assert env["SPARK_HOME"] == f"/usr/local/lib/python{m[1]}/site-packages/pyspark"
    assert SPARK_HOME.name == "pyspark" and SPARK_HOME.parent.name == "site-packages"
    assert "${SPARK_HOME}/bin" in env["PATH"]
    assert env["PYSPARK_PYTHON"] == "python3"
    assert env["JAVA_HOME"].startswith("/usr/lib/jvm/")
    assert f"ln -s \"/usr/lib/jvm/java-17-openjdk-$(dpkg --print-architecture)\" " \
           f"{env['JAVA_HOME']}" in text
    assert any(ln.startswith("WORKDIR ") and ln.split()[1] == str(APP_DIR) for ln in lines)
    assert "COPY . ." in lines


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Whether ``rel`` (or a directory above it) matches a .dockerignore pattern."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        hit = any(fnmatch.fnmatch(p, pat) or (pat.startswith("**/")
                  and fnmatch.fnmatch(p.rsplit("/", 1)[-1], pat[3:])) for p in prefixes)
        if hit:
            ignored = not neg
    return ignored


def test_dockerignore_keeps_what_the_image_needs() -> None:
    patterns = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.lstrip().startswith("#")]
    needed = ["pyproject.toml", "README.md", "reclock/cli.py", "reclock/conf/log4j2.properties",
              "sources/kafka.py", "sources/_kafka_native.c", "reclock/_buffers.h", "setup.py",
              "sinks/postgres.py", "remap_store/sql.py", "examples/compose/producer.py"]
    for rel in needed:
        assert (REPO / rel).exists(), rel
        assert not _ignored(rel, patterns), f".dockerignore excludes {rel}"
    for rel in [".git/HEAD", "tests/conftest.py", ".mypy_cache/x", "state/remap.db",
                "reclock/__pycache__/cli.cpython-311.pyc",
                "sources/_kafka_native.cpython-311-x86_64-linux-gnu.so"]:
        assert _ignored(rel, patterns), f".dockerignore keeps {rel}"


# -- the pipeline service ---------------------------------------------------------------


def _pipeline_file(services: dict[str, dict[str, Any]]) -> tuple[Path, list[str]]:
    args = command_args(services["pipeline"])
    return host_file(services["pipeline"], args[-1]), args


def test_pipeline_yaml_as_compose_runs_it(services: dict[str, dict[str, Any]]) -> None:
    path, args = _pipeline_file(services)
    assert path == EXAMPLES / "pipeline.yaml"
    assert any(t == args[-1] and ro for _, t, ro in mounts(services["pipeline"]))  # read-only
    cfg = load_config(path, env=service_env(services["pipeline"]))
    # The addresses in the file are those of the compose services.
    master = command_args(services["spark-master"])
    opt = {master[i]: master[i + 1] for i in range(2, len(master) - 1, 2)}
    assert cfg.spark.master == f"spark://{opt['--host']}:{opt['--port']}"
    worker = command_args(services["spark-worker"])
    assert worker[2] == cfg.spark.master
    kafka = cfg.source("events").kafka
    assert kafka is not None and kafka.bootstrap_servers == "kafka:9092"
    assert kafka.topic == service_env(services["producer"])["DEMO_TOPIC"]
    shop = cfg.source("shop").postgres
    assert shop is not None and shop.table_outputs() == [
        ("public", "customers", "customers"), ("public", "orders", "orders")]
    pg_env = service_env(services["postgres"])
    password = pg_env["POSTGRES_PASSWORD"]
    assert shop.dsn == f"postgresql://postgres:{password}@postgres:5432/{pg_env['POSTGRES_DB']}"
    assert cfg.remap_store == f"postgresql://postgres:{password}@postgres:5432/reclock"
    assert "CREATE DATABASE reclock;" in (EXAMPLES / "databases.sql").read_text()
    sinks = [o.sink for s in cfg.sources for o in s.outputs]
    assert {type(s) for s in sinks} == {PostgresSinkConfig, FileSinkConfig}
    assert [s.mode for s in sinks if isinstance(s, PostgresSinkConfig)] == ["log", "state"]
    assert str(cfg.state_dir) == "/state"
    assert all(str(s.path).startswith("/state/") for s in sinks if isinstance(s, FileSinkConfig))
    # The password is the one compose gives postgres, also when it is changed.
    env = {k: expand(v, {"POSTGRES_PASSWORD": "s3cret"}) for k, v in
           services["pipeline"]["environment"].items()}
    assert "s3cret@" in load_config(path, env=env).remap_store_url
    # The HTTP endpoint on every interface of the container, at the published
    # port, which the healthcheck reads.
    assert cfg.http is not None and cfg.http.host == "0.0.0.0"
    assert [expand(p).rsplit(":", 1)[1] for p in services["pipeline"]["ports"]] == \
        [str(cfg.http.port)]
    assert f"127.0.0.1:{cfg.http.port}/readyz" in (healthcheck_code(services["pipeline"])
                                                   or "")


def test_producer_and_pipeline_agree(services: dict[str, dict[str, Any]],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The producer, configured by its compose environment, writes where the
    pipeline, configured by its own, reads."""
    spec = importlib.util.spec_from_file_location("compose_producer", PRODUCER)
    assert spec is not None and spec.loader is not None
    producer = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, producer)  # dataclasses look it up
    spec.loader.exec_module(producer)
    settings = producer.parse_args([], env=service_env(services["producer"]))
    path, _ = _pipeline_file(services)
    cfg = load_config(path, env=service_env(services["pipeline"]))
    kafka, shop = cfg.source("events").kafka, cfg.source("shop").postgres
    assert kafka is not None and shop is not None
    assert (settings.bootstrap_servers, settings.topic) == (kafka.bootstrap_servers, kafka.topic)
    assert settings.dsn == shop.dsn
    assert settings.duration is None  # runs until stopped
    assert str(settings.ready_file) == service_env(services["producer"])["PRODUCER_READY_FILE"]


def test_pipeline_command_line(services: dict[str, dict[str, Any]]) -> None:
    _, args = _pipeline_file(services)
    assert args[0] == "reclock"
    parsed = build_parser().parse_args(args[1:])
    assert parsed.fn is cmd_run and parsed.file == "/config/pipeline.yaml"
    out = subprocess.run([sys.executable, "-m", "reclock", *args[1:-1], "--help"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert "usage: reclock run" in out.stdout
    out = subprocess.run([sys.executable, "-m", "reclock", "status", "--help"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert "--json" in out.stdout


# -- the Spark services -----------------------------------------------------------------


@pytest.mark.parametrize("service", ["spark-master", "spark-worker"])
def test_spark_service_commands(services: dict[str, dict[str, Any]], service: str) -> None:
    args = command_args(services[service])
    assert args[0] == "spark-class"
    spark_class = SPARK_HOME / "bin" / "spark-class"
    assert spark_class.is_file() and os.access(spark_class, os.X_OK)
    core = sorted((SPARK_HOME / "jars").glob("spark-core_*.jar"))
    assert core, "PySpark ships no spark-core jar"
    with zipfile.ZipFile(core[-1]) as z:
        assert args[1].replace(".", "/") + ".class" in z.namelist()
    # The class's own usage knows every option compose passes.
    env = {**os.environ, "SPARK_HOME": str(SPARK_HOME)}
    out = subprocess.run([str(spark_class), args[1], "--help"], capture_output=True, text=True,
                         timeout=60, env=env)
    usage = out.stdout + out.stderr
    assert out.returncode == 0 and "Usage:" in usage, usage
    for opt in (a for a in args[2:] if a.startswith("--")):
        assert re.search(rf"(^|\s){re.escape(opt)}\s", usage), f"{service}: {opt} not in usage"
    if service == "spark-master":
        ui = args[args.index("--webui-port") + 1]
        assert f"localhost:{ui}/json/" in (healthcheck_code(services[service]) or "")
        assert any(expand(p).endswith(f":{ui}") for p in services[service]["ports"])
    else:
        ui = args[args.index("--webui-port") + 1]
        assert f"localhost:{ui}/json/" in (healthcheck_code(services[service]) or "")


# -- running the producer and the pipeline ----------------------------------------------


def _psql(url: str, sql_file: Path) -> None:
    """Run an init SQL file the way the postgres image's entrypoint does."""
    subprocess.run(["psql", "-v", "ON_ERROR_STOP=1", "--no-psqlrc", "-q", "-f", str(sql_file),
                    url], check=True, capture_output=True, timeout=60)


def _producer(bootstrap: str, topic: str, dsn: str, tmp: Path, duration: float | None,
              *extra: str) -> subprocess.Popen[str]:
    """The producer service's command, configured through its environment variables."""
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap, "DEMO_TOPIC": topic,
           "SHOP_DSN": dsn, "PRODUCER_READY_FILE": str(tmp / "producer.ready")}
    if duration is not None:
        extra = ("--duration", str(duration), *extra)
    return subprocess.Popen([sys.executable, str(PRODUCER), "--seed", "7", *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str]) -> dict[str, int]:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    counts: dict[str, int] = json.loads(out.strip().splitlines()[-1])
    return counts


def _topic_records(bootstrap: str, topic: str, partitions: int) -> list[dict[str, Any]]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"t-{uuid.uuid4().hex}",
                  "enable.auto.commit": False})
    try:
        ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in range(partitions)}
        c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        records: list[dict[str, Any]] = []
        total = sum(ends.values())
        while len(records) < total:
            msg = c.poll(5)
            assert msg is not None, f"read {len(records)} of {total} records"
            assert msg.error() is None, msg.error()
            raw = msg.value()
            assert raw is not None
            value = json.loads(raw)
            assert msg.key() == str(value["customer_id"]).encode()
            records.append(value)
        return records
    finally:
        c.close()


def _table(url: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as c:
        return list(c.execute(query).fetchall())


def test_producer_writes_kafka_and_postgres(compose_kafka: Any, pg_url: str,
                                            tmp_path: Path) -> None:
    kafka = compose_kafka
    _psql(pg_url, EXAMPLES / "init.sql")
    topic = f"demo-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 3)
    proc = _producer(kafka.bootstrap, topic, pg_url, tmp_path, 3, "--rate", "100",
                     "--pg-rate", "20")
    wait_for(lambda: (tmp_path / "producer.ready").exists() or proc.poll() is not None,
             timeout=30, what="the producer's ready file")
    counts = _finish(proc)
    assert not (tmp_path / "producer.ready").exists()  # removed when it stops
    assert counts["failed"] == 0 and counts["records"] >= 100
    records = _topic_records(kafka.bootstrap, topic, 3)
    assert len(records) == counts["records"]
    assert {r["kind"] for r in records} <= {"view", "cart", "purchase"}
    assert len({r["id"] for r in records}) == len(records)
    customers = _table(pg_url, "SELECT count(*) FROM customers")[0][0]
    orders = _table(pg_url, "SELECT count(*) FROM orders")[0][0]
    assert counts["transactions"] >= 20 and customers >= 1
    # every transaction inserts an order; some insert a customer; deletes remove orders
    assert customers + counts["transactions"] == counts["inserts"]
    assert orders == counts["transactions"] - counts["deletes"]
    # The Kafka records reference customers that exist (or customer 1 before the first).
    assert {r["customer_id"] for r in records} <= {1} | {
        row[0] for row in _table(pg_url, "SELECT id FROM customers")}
    # A second run, as compose runs it (no duration), continues after the rows
    # of the first and stops cleanly on SIGTERM (`docker compose stop`).
    proc = _producer(kafka.bootstrap, topic, pg_url, tmp_path, None)
    wait_for(lambda: (tmp_path / "producer.ready").exists() or proc.poll() is not None,
             timeout=30, what="the producer's ready file")
    proc.send_signal(signal.SIGTERM)
    again = _finish(proc)
    assert again["inserts"] >= 1 and again["failed"] == 0
    assert _table(pg_url, "SELECT count(*) FROM orders")[0][0] == \
        orders + again["transactions"] - again["deletes"]


@pytest.fixture
def reclock_db(pg_logical: Any) -> Iterator[str]:
    """The ``reclock`` database that databases.sql creates, dropped afterwards."""
    admin = pg_logical.url
    yield admin.rsplit("/", 1)[0] + "/reclock"
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute('DROP DATABASE IF EXISTS "reclock" WITH (FORCE)')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_compose_pipeline_end_to_end(services: dict[str, dict[str, Any]], compose_kafka: Any,
                                     cdc_url: str, reclock_db: str, spark: Any,
                                     tmp_path: Path) -> None:
    """examples/compose/pipeline.yaml, its hosts pointed at the compose kafka
    service (run from its own settings) and
    the logical-replication cluster, while the producer writes: the Kafka
    records land exactly once in the log table, the state table equals the
    customers table, the Delta output holds the orders table."""
    kafka = compose_kafka
    # The postgres service's initialisation: databases.sql, then init.sql, in the shop db.
    _psql(cdc_url, EXAMPLES / "databases.sql")
    _psql(cdc_url, EXAMPLES / "init.sql")
    topic = f"demo-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 4)
    address, shop_db = cdc_url.rsplit("@", 1)[1].split("/", 1)
    pg_host, pg_port = address.split(":")
    http_port = _free_port()
    env = {"POSTGRES_PASSWORD": "unused-with-trust", "POSTGRES_HOST": pg_host,
           "POSTGRES_PORT": pg_port, "SHOP_DB": shop_db,
           "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap, "DEMO_TOPIC": topic,
           "RECLOCK_STATE_DIR": str(tmp_path / "state"), "SPARK_MASTER": "local[2]",
           "RECLOCK_HTTP_HOST": "127.0.0.1", "RECLOCK_HTTP_PORT": str(http_port)}
    cfg = load_config(EXAMPLES / "pipeline.yaml", env=env)
    assert cfg.remap_store_url.endswith("/reclock")
    proc = _producer(kafka.bootstrap, topic, cdc_url, tmp_path, 4, "--rate", "100",
                     "--pg-rate", "10")
    try:
        with running(cfg, spark) as runners:
            counts = _finish(proc)
            assert counts["records"] >= 200 and counts["failed"] == 0
            assert counts["transactions"] >= 20 and counts["updates"] > 0

            def caught_up() -> bool:
                logged = _table(reclock_db, "SELECT count(*) FROM information_schema.tables "
                                "WHERE table_name IN ('demo_events', 'shop_customers')")[0][0]
                if logged < 2:
                    return False
                n = _table(reclock_db, "SELECT coalesce(sum(_diff), 0) FROM demo_events")[0][0]
                state = _table(reclock_db, "SELECT id, name, email, tier FROM shop_customers "
                               "ORDER BY id")
                source = _table(cdc_url, "SELECT id, name, email, tier FROM customers "
                                "ORDER BY id")
                return bool(n == counts["records"] and state == source)

            wait_for(caught_up, timeout=90, what="the outputs to catch up with the producer")
            # every output of the shop source (orders too) holds every commit so far
            shop = [r for r in runners if r.name == "shop"]
            wait_for(resumed_past(shop, flushed_lsn(cdc_url)), timeout=90,
                     what="the shop outputs to hold every commit")
            status = json.loads((cfg.state_dir / "status.json").read_text())
            assert {s["source"] for s in status["sources"]} == {"events", "shop"}
            # The pipeline service's healthcheck, against this run's HTTP endpoint.
            assert str(http_port) in str(status.get("http"))
            check = (healthcheck_code(services["pipeline"]) or "").replace(
                "127.0.0.1:9464", f"127.0.0.1:{http_port}")
            assert str(http_port) in check
            subprocess.run([sys.executable, "-c", check], check=True, timeout=30)
            url = f"http://127.0.0.1:{http_port}/status.json"
            with urllib.request.urlopen(url, timeout=5) as resp:
                served = json.loads(resp.read())
            assert {s["source"] for s in served["sources"]} == {"events", "shop"}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Exactly once: every record once, none twice, no error rows.
    rows = _table(reclock_db, "SELECT id, count(*), bool_or(_error IS NOT NULL) "
                  "FROM demo_events GROUP BY id")
    assert len(rows) == counts["records"] and all(n == 1 and not e for _, n, e in rows)
    # The Delta output: the orders that exist upstream, each once.
    updates = read_updates(cfg, "shop", "orders")
    net: dict[int, int] = {}
    for oid, diff in zip(updates.column("id").to_pylist(), updates.column("_diff").to_pylist(),
                         strict=True):
        net[oid] = net.get(oid, 0) + diff
    assert sorted(k for k, v in net.items() if v) == \
        [r[0] for r in _table(cdc_url, "SELECT id FROM orders ORDER BY id")]
    assert set(net.values()) <= {0, 1}
