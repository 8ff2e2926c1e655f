"""Real Apache Kafka brokers for the tests, in KRaft mode.

The broker's jars come from Maven Central through ``tests/broker/pom.xml``;
``tests/setup.sh`` resolves them once into ``$RECLOCK_CACHE/kafka-broker/libs``
(default ``~/.cache/reclock``), and nothing is downloaded while the tests run.
A :class:`KafkaCluster` of ``nodes`` combined broker+controller processes
(``java -cp LIBS/* kafka.Kafka server.properties``) runs on free loopback
ports with its storage formatted in a temporary directory; the tests start
one single-node cluster and, for failover, one 3-node cluster (replication
factor 3, ``min.insync.replicas=2``) per run.

Topics are created, grown, deleted and trimmed through the AdminClient, as a
user would. :meth:`KafkaCluster.kill` (SIGKILL) and :meth:`KafkaCluster.start_node`
take a node down and bring it back on the same ports and storage.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic, OffsetSpec


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("RECLOCK_CACHE") or Path(base) / "reclock")


def libs_dir() -> Path:
    """The broker's jars, as tests/setup.sh left them."""
    libs = Path(os.environ.get("RECLOCK_KAFKA_LIBS") or cache_dir() / "kafka-broker" / "libs")
    if not any(libs.glob("kafka_2.13-*.jar")):
        raise RuntimeError(f"Apache Kafka's jars are not in {libs}: run `bash tests/setup.sh` "
                           "(it resolves tests/broker/pom.xml with Maven)")
    return libs


def kafka_version() -> str:
    jar = next(libs_dir().glob("kafka_2.13-*.jar"))
    return jar.name.removeprefix("kafka_2.13-").removesuffix(".jar")


def new_cluster_id() -> str:
    """A random KRaft cluster id: 16 bytes in URL-safe base64. Like Kafka's
    own ``Uuid.randomUuid``, never one that starts with ``-``: the storage
    tool would read it as an option (``-t -x...``: "expected one argument")."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_LOG4J2 = """\
status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = warn
rootLogger.appenderRef.file.ref = file
"""


@dataclass
class _Node:
    id: int
    port: int
    controller_port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class KafkaCluster:
    """``start()`` -> ``bootstrap``; admin helpers; ``kill``/``start_node``; ``close``."""

    #: The tests' JVM: starts fast (C1 only), small heap.
    TEST_JVM = ("-Xms128m", "-Xmx768m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")

    def __init__(self, nodes: int = 1, *, partitions: int = 4,
                 settings: dict[str, str] | None = None,
                 jvm: tuple[str, ...] = TEST_JVM) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="reclock-kafka-"))
        self.libs = libs_dir()
        self.partitions = partitions
        self.replication = min(3, nodes)
        self.settings = settings or {}
        self.jvm = jvm
        self.nodes = [_Node(i, _free_port(), _free_port(), self.dir / f"node{i}")
                      for i in range(1, nodes + 1)]
        self.bootstrap = ",".join(n.address for n in self.nodes)
        self.bootstrap_servers = self.bootstrap
        self._admin: AdminClient | None = None
        self.cluster_id = new_cluster_id()

    # -- lifecycle --------------------------------------------------------------------
    def _properties(self, node: _Node) -> str:
        n, isr = self.replication, min(2, self.replication)
        voters = ",".join(f"{m.id}@127.0.0.1:{m.controller_port}" for m in self.nodes)
        props = {
            "process.roles": "broker,controller",
            "node.id": str(node.id),
            "controller.quorum.voters": voters,
            "listeners": f"PLAINTEXT://127.0.0.1:{node.port},"
                         f"CONTROLLER://127.0.0.1:{node.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{node.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(node.dir / "data"),
            "num.partitions": str(self.partitions),
            "default.replication.factor": str(n),
            "min.insync.replicas": str(isr),
            "offsets.topic.replication.factor": str(n),
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": str(n),
            "transaction.state.log.min.isr": str(isr),
            "transaction.state.log.num.partitions": "4",
            "share.coordinator.state.topic.replication.factor": str(n),
            "share.coordinator.state.topic.min.isr": str(isr),
            "group.initial.rebalance.delay.ms": "0",
            "log.cleaner.backoff.ms": "500",
            "auto.create.topics.enable": "true",
            **self.settings,
        }
        return "".join(f"{k}={v}\n" for k, v in props.items())

    def _java(self, node: _Node, main: str, *args: str) -> list[str]:
        return ["java", *self.jvm, "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={node.dir / 'log4j2.properties'}",
                "-cp", f"{self.libs}/*", main, *args]

    def start(self, timeout: float = 90.0) -> KafkaCluster:
        for node in self.nodes:
            node.dir.mkdir(parents=True)
            (node.dir / "server.properties").write_text(self._properties(node))
            (node.dir / "log4j2.properties").write_text(
                _LOG4J2.format(log=node.dir / "server.log"))
            done = subprocess.run(
                self._java(node, "kafka.tools.StorageTool", "format",
                           f"--cluster-id={self.cluster_id}",
                           "-c", str(node.dir / "server.properties")),
                capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"formatting node {node.id}'s storage failed:\n"
                                   f"{done.stdout}{done.stderr}")
        for node in self.nodes:
            self._spawn(node)
        self.wait_ready(timeout)
        return self

    def _spawn(self, node: _Node) -> None:
        out = (node.dir / "stdout.log").open("ab")
        node.proc = subprocess.Popen(
            self._java(node, "kafka.Kafka", str(node.dir / "server.properties")),
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()

    def admin(self) -> AdminClient:
        """One AdminClient for the cluster's life (it reconnects after restarts;
        a client dropped while its futures are pending would cancel them)."""
        if self._admin is None:
            self._admin = AdminClient({"bootstrap.servers": self.bootstrap,
                                       "socket.connection.setup.timeout.ms": 5000,
                                       "reconnect.backoff.max.ms": 500,
                                       "log_level": 0})
        return self._admin

    def alive(self) -> list[int]:
        return [n.id for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until every running node is registered and every partition has a leader."""
        deadline = time.monotonic() + timeout
        want = set(self.alive())
        last: object = None
        while True:
            for node in self.nodes:
                if node.proc is not None and node.proc.poll() is not None and node.id in want:
                    raise RuntimeError(f"Kafka node {node.id} exited with {node.proc.returncode}:"
                                       f"\n{self.log_tail(node.id)}")
            try:
                md = self.admin().list_topics(timeout=2)
                brokers = set(md.brokers)
                leaderless = [(t, p) for t, tm in md.topics.items()
                              for p, pm in tm.partitions.items() if pm.leader < 0]
                if want <= brokers and not leaderless:
                    return
                last = f"brokers {sorted(brokers)}, leaderless {leaderless[:5]}"
            except Exception as exc:  # the broker is still starting
                last = exc
            if time.monotonic() > deadline:
                raise RuntimeError(f"Kafka not ready after {timeout:.0f} s ({last}):\n"
                                   f"{self.log_tail(self.nodes[0].id)}")
            time.sleep(0.2)

    def log_tail(self, node_id: int, lines: int = 30) -> str:
        node = self.nodes[node_id - 1]
        text = ""
        for name in ("stdout.log", "server.log"):
            with contextlib.suppress(OSError):
                text += (node.dir / name).read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def kill(self, node_id: int = 1) -> None:
        """SIGKILL one node (a crash: no controlled shutdown)."""
        node = self.nodes[node_id - 1]
        if node.proc is not None and node.proc.poll() is None:
            os.killpg(node.proc.pid, signal.SIGKILL)
            node.proc.wait()

    def start_node(self, node_id: int = 1, timeout: float = 90.0) -> None:
        """Bring a killed node back on its ports and storage; waits until it serves."""
        node = self.nodes[node_id - 1]
        if node.proc is None or node.proc.poll() is not None:
            self._spawn(node)
        self.wait_ready(timeout)

    def start_all(self, timeout: float = 120.0) -> None:
        """Start every node that is down at once (a quorum needs a majority)."""
        for node in self.nodes:
            if node.proc is None or node.proc.poll() is not None:
                self._spawn(node)
        self.wait_ready(timeout)

    # The names the tests used for the development broker's fault switches.
    def broker_down(self, node_id: int = 1) -> None:
        self.kill(node_id)

    def broker_up(self, node_id: int = 1) -> None:
        self.start_node(node_id)

    def close(self) -> None:
        for node in self.nodes:
            self.kill(node.id)
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- topics, through the AdminClient --------------------------------------------
    @staticmethod
    def _wait(futures: dict[Any, Any], what: str, timeout: float = 60.0) -> None:
        for key, fut in futures.items():
            try:
                fut.result(timeout=timeout)
            except Exception as exc:
                raise RuntimeError(f"{what} {key}: {exc}") from exc

    def create_topic(self, topic: str, partitions: int | None = None,
                     replication: int | None = None, config: dict[str, str] | None = None
                     ) -> None:
        new = NewTopic(topic, partitions or self.partitions, replication or self.replication,
                       config=config or {})
        self._wait(self.admin().create_topics([new], operation_timeout=30), "create topic")
        self.wait_leaders(topic)

    def new_topic(self, prefix: str, partitions: int = 1) -> str:
        """A topic of its own for one test, ``<prefix>-<8 hex digits>``, created."""
        topic = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.create_topic(topic, partitions)
        return topic

    def add_partitions(self, topic: str, total: int) -> None:
        """CreatePartitions: the topic grows to ``total`` partitions."""
        self._wait(self.admin().create_partitions([NewPartitions(topic, total)],
                                                  operation_timeout=30), "add partitions to")
        self.wait_leaders(topic, total)

    def delete_topic(self, topic: str) -> None:
        self._wait(self.admin().delete_topics([topic], operation_timeout=30), "delete topic")

    def delete_records(self, topic: str, partition: int, before_offset: int) -> None:
        """Retention: drop the records before ``before_offset`` (the new log start)."""
        self._wait(self.admin().delete_records([TopicPartition(topic, partition, before_offset)]),
                   "delete records of")

    def wait_leaders(self, topic: str, partitions: int | None = None,
                     timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            tm = self.admin().list_topics(topic, timeout=10).topics.get(topic)
            if (tm is not None and tm.error is None and tm.partitions
                    and (partitions is None or len(tm.partitions) >= partitions)
                    and all(pm.leader >= 0 for pm in tm.partitions.values())
                    and self._serves(topic, sorted(tm.partitions))):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"topic {topic!r} has no leader for every partition")
            time.sleep(0.1)

    def _serves(self, topic: str, partitions: list[int]) -> bool:
        """Every partition's leader answers ListOffsets (metadata reaches the
        brokers a moment after CreateTopics returns)."""
        req = {TopicPartition(topic, p): OffsetSpec.latest() for p in partitions}
        try:
            for fut in self.admin().list_offsets(req, request_timeout=10).values():
                fut.result(timeout=15)
        except Exception:
            self._admin = None  # its cached leader epochs may be the stale part
            return False
        return True

    def leader(self, topic: str, partition: int) -> int:
        tm = self.admin().list_topics(topic, timeout=10).topics[topic]
        return int(tm.partitions[partition].leader)


def kafka_end(bootstrap: str, topic: str, partition: int) -> int:
    """The partition's end offset (its high watermark)."""
    from confluent_kafka import Consumer

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "probe"})
    try:
        return int(c.get_watermark_offsets(TopicPartition(topic, partition), 10)[1])
    finally:
        c.close()


def read_committed(bootstrap: str, topic: str, timeout: float = 120.0) -> list[Any]:
    """Every record a plain ``read_committed`` consumer (not reclock's reader)
    gets from ``topic``, to the end of each partition: what any downstream
    Kafka consumer would see."""
    from confluent_kafka import Consumer, KafkaError

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"plain-{uuid.uuid4().hex}",
                  "isolation.level": "read_committed", "enable.partition.eof": True,
                  "enable.auto.commit": False, "auto.offset.reset": "earliest",
                  "fetch.wait.max.ms": 10, "log_level": 0})
    try:
        parts = sorted(c.list_topics(topic, timeout=10).topics[topic].partitions)
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        pending, out = set(parts), []
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            for m in c.consume(10_000, 0.5):
                if m.error():
                    assert m.error().code() == KafkaError._PARTITION_EOF, m.error()
                    pending.discard(m.partition())
                else:
                    out.append(m)
        assert not pending, f"did not reach the end of {topic}: {pending}"
        return out
    finally:
        c.close()
