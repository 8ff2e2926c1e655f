"""A Kafka-protocol broker for development and tests: librdkafka's mock cluster.

The librdkafka shared library inside the confluent-kafka wheel carries a mock
Kafka cluster that answers the real protocol over TCP (produce, fetch,
metadata, list offsets, consumer groups, offset commits, transactions). This
module drives its C API through ctypes: create a cluster, create topics with any
partition count, delete topics, delete records (retention), and take brokers
down and up. reclock's product code never imports this module: it talks to
the cluster's bootstrap address exactly as it would to Apache Kafka.

The cluster lives inside the process that created it; ``reclock dev kafka``
runs one in the foreground and prints its bootstrap address.

Known limits of the mock: no CreateTopics/CreatePartitions/DescribeConfigs
requests (topics auto-create with 4 partitions; use :meth:`MockKafka.create_topic`),
about 5 MB kept per partition. Partitions cannot be added to an existing
topic; :meth:`MockKafka.hide_partitions` / :meth:`MockKafka.reveal_partitions`
make some partitions leaderless (unavailable) and available again, which is
how tests stand in for "partitions added while running".
"""

from __future__ import annotations

import ctypes
import os
import threading

from reclock.clients.librdkafka import library_path

RD_KAFKA_PRODUCER = 0


class KafkaMockError(RuntimeError):
    pass


class MockKafka:
    """One mock cluster, alive until :meth:`close` (or process exit)."""

    _lib: ctypes.CDLL | None = None

    def __init__(self, brokers: int = 1) -> None:
        lib = self._load()
        errstr = ctypes.create_string_buffer(512)
        conf = lib.rd_kafka_conf_new()
        # Keep the mock's internal client quiet.
        for k, v in ((b"log_level", b"0"),):
            lib.rd_kafka_conf_set(conf, k, v, errstr, len(errstr))
        self._rk = lib.rd_kafka_new(RD_KAFKA_PRODUCER, conf, errstr, len(errstr))
        if not self._rk:
            raise KafkaMockError(f"rd_kafka_new failed: {errstr.value.decode()}")
        self._mc = lib.rd_kafka_mock_cluster_new(self._rk, brokers)
        if not self._mc:
            raise KafkaMockError("rd_kafka_mock_cluster_new failed")
        self.bootstrap: str = lib.rd_kafka_mock_cluster_bootstraps(self._mc).decode()
        self.brokers = brokers
        self._lock = threading.Lock()

    @classmethod
    def _load(cls) -> ctypes.CDLL:
        if cls._lib is not None:
            return cls._lib
        lib = ctypes.CDLL(library_path())
        vp, cp, i32, i64 = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32, ctypes.c_int64
        sigs: dict[str, tuple[object, list[object]]] = {
            "rd_kafka_conf_new": (vp, []),
            "rd_kafka_conf_set": (ctypes.c_int, [vp, cp, cp, cp, ctypes.c_size_t]),
            "rd_kafka_new": (vp, [ctypes.c_int, vp, cp, ctypes.c_size_t]),
            "rd_kafka_destroy": (None, [vp]),
            "rd_kafka_mock_cluster_new": (vp, [vp, ctypes.c_int]),
            "rd_kafka_mock_cluster_destroy": (None, [vp]),
            "rd_kafka_mock_cluster_bootstraps": (cp, [vp]),
            "rd_kafka_mock_topic_create": (ctypes.c_int, [vp, cp, ctypes.c_int, ctypes.c_int]),
            "rd_kafka_mock_topic_delete": (ctypes.c_int, [vp, cp]),
            "rd_kafka_mock_partition_delete_records": (ctypes.c_int, [vp, cp, i32, i64]),
            "rd_kafka_mock_partition_set_leader": (ctypes.c_int, [vp, cp, i32, i32]),
            "rd_kafka_mock_broker_set_down": (ctypes.c_int, [vp, i32]),
            "rd_kafka_mock_broker_set_up": (ctypes.c_int, [vp, i32]),
            "rd_kafka_err2str": (cp, [ctypes.c_int]),
        }
        for name, (res, args) in sigs.items():
            fn = getattr(lib, name)
            fn.restype = res
            fn.argtypes = args
        cls._lib = lib
        return lib

    def _check(self, err: int, what: str) -> None:
        if err:
            lib = self._load()
            raise KafkaMockError(f"{what}: {lib.rd_kafka_err2str(err).decode()}")

    # -- topics ---------------------------------------------------------------------
    def create_topic(self, topic: str, partitions: int = 4, replication: int = 1) -> None:
        lib = self._load()
        self._check(lib.rd_kafka_mock_topic_create(self._mc, topic.encode(), partitions,
                                                   replication), f"create topic {topic!r}")

    def delete_topic(self, topic: str) -> None:
        lib = self._load()
        self._check(lib.rd_kafka_mock_topic_delete(self._mc, topic.encode()),
                    f"delete topic {topic!r}")

    def delete_records(self, topic: str, partition: int, before_offset: int) -> None:
        """Retention: drop records before ``before_offset`` (the new log start)."""
        lib = self._load()
        self._check(lib.rd_kafka_mock_partition_delete_records(
            self._mc, topic.encode(), partition, before_offset),
            f"delete records of {topic!r}[{partition}] before {before_offset}")

    def hide_partitions(self, topic: str, partitions: list[int]) -> None:
        """Make partitions leaderless: metadata lists them as unavailable."""
        lib = self._load()
        for p in partitions:
            self._check(lib.rd_kafka_mock_partition_set_leader(self._mc, topic.encode(), p, -1),
                        f"hide {topic!r}[{p}]")

    def reveal_partitions(self, topic: str, partitions: list[int], broker: int = 1) -> None:
        lib = self._load()
        for p in partitions:
            self._check(lib.rd_kafka_mock_partition_set_leader(self._mc, topic.encode(), p,
                                                               broker),
                        f"reveal {topic!r}[{p}]")

    # -- brokers ----------------------------------------------------------------------
    def broker_down(self, broker: int = 1) -> None:
        self._check(self._load().rd_kafka_mock_broker_set_down(self._mc, broker), "broker down")

    def broker_up(self, broker: int = 1) -> None:
        self._check(self._load().rd_kafka_mock_broker_set_up(self._mc, broker), "broker up")

    def close(self) -> None:
        with self._lock:
            if self._mc:
                lib = self._load()
                lib.rd_kafka_mock_cluster_destroy(self._mc)
                lib.rd_kafka_destroy(self._rk)
                self._mc = None
                self._rk = None


def serve(brokers: int = 1, topics: list[str] | None = None, partitions: int = 4) -> None:
    """``reclock dev kafka``: run a mock cluster until interrupted."""
    import signal
    import sys

    mock = MockKafka(brokers)
    for t in topics or []:
        mock.create_topic(t, partitions)
    sys.stdout.write(f"{mock.bootstrap}\n")
    sys.stdout.flush()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    mock.close()
    os._exit(0)
