"""Kafka-to-Kafka pipelines against real Apache Kafka brokers: leader failover
and a whole-cluster restart on a 3-node cluster, a zombie driver fenced by the
broker, and two pipelines with equal names on one cluster.

Every test checks its output against an independent model, not reclock's own
readers: the producer wrote ids ``0..n-1`` once each (an idempotent producer),
so a plain ``read_committed`` consumer of the output topic must get exactly
those ids, once each.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from reclock.config import load_config
from reclock.verify import verify_pipeline
from tests.kafkabroker import read_committed
from tests.running import durable, running, wait_for
from tests.tally import count

RELAY = """
state_dir: {state}
timestamp_interval: 200ms
sources:
  - name: relay
    kafka: {{bootstrap_servers: "{bootstrap}", topic: {topic}, timeout: 5s}}
    outputs:
      - name: relay
        format: {{type: json, schema: {{id: int64}}}}
        sink: {{type: kafka, bootstrap_servers: "{bootstrap}", topic: {topic}-out,
               timeout: 10s, properties: {{transaction.timeout.ms: 30000}}}}
"""


def relay_config(tmp_path: Path, bootstrap: str, topic: str) -> Path:
    path = tmp_path / "relay.yaml"
    path.write_text(RELAY.format(state=tmp_path / "state", bootstrap=bootstrap, topic=topic))
    return path


class Ids:
    """Produces ids 0, 1, 2, ... as JSON records, idempotently (acks=all)."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        self.topic, self.partitions, self.next = topic, partitions, 0
        self.producer = Producer({
            "bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
            "linger.ms": 5, "message.timeout.ms": 300_000, "log_level": 0})

    def send(self, n: int) -> None:
        failed: list[Any] = []
        for _ in range(n):
            i = self.next
            self.producer.produce(self.topic, key=str(i).encode(),
                                  value=json.dumps({"id": i}).encode(),
                                  partition=i % self.partitions,
                                  on_delivery=lambda err, _m: err and failed.append(err))
            self.next += 1
            self.producer.poll(0)
        assert self.producer.flush(300) == 0 and not failed, failed[:3]


def read_ids(bootstrap: str, topic: str) -> list[int]:
    """Every id that a plain read_committed consumer gets from ``topic``."""
    return [int(json.loads(m.value())["id"]) for m in read_committed(bootstrap, topic)]


def audit(ids: list[int], n: int) -> tuple[int, int, int]:
    """(records, doubled, lost) of ``ids`` against the model ``0..n-1``."""
    seen = Counter(ids)
    return len(ids), sum(c - 1 for c in seen.values() if c > 1), len(set(range(n)) - set(seen))


def held(r: Any) -> int:
    """Records the output holds, by its durable progress (offsets summed)."""
    return sum(durable(r).values())


@pytest.mark.timeout(600)
def test_leader_failover_and_whole_cluster_restart(
    tmp_path: Path, spark: Any, kafka_cluster: Any
) -> None:
    """On 3 brokers (replication 3, min.insync.replicas 2): SIGKILL the leader
    of the source's partition, then of the sink's, each brought back later;
    then SIGKILL every broker and start them again. The pipeline stalls,
    recovers, loses nothing and doubles nothing; verify is clean."""
    k = kafka_cluster
    topic = f"fo-{uuid.uuid4().hex[:8]}"
    k.create_topic(topic, 2)
    k.create_topic(f"{topic}-out", 2)
    ids = Ids(k.bootstrap, topic, 2)
    cfg = load_config(relay_config(tmp_path, k.bootstrap, topic))
    kills = 0
    stalled_seen = False
    with running(cfg, spark) as runners:
        r = runners[0]
        ids.send(2000)
        wait_for(lambda: held(r) >= 2000, 120, lambda: f"the first records ({held(r)}, {r.health})")
        for target in (topic, f"{topic}-out"):  # the source's leader, then the sink's
            leader = k.leader(target, 0)
            k.kill(leader)
            kills += 1
            ids.send(2000)  # two of three brokers: still min.insync.replicas
            want = ids.next
            wait_for(lambda w=want: held(r) >= w, 180,
                     lambda n=leader: f"catching up with broker {n} down ({held(r)}, {r.health})")
            k.start_node(leader)
        for node in k.alive():
            k.kill(node)
            kills += 1
        wait_for(lambda: r.health.status == "stalled", 120,
                 lambda: f"a stall with every broker down ({r.health})")
        stalled_seen = not r.health.definite
        time.sleep(2)
        k.start_all()
        ids.send(2000)
        wait_for(lambda: held(r) >= ids.next, 240,
                 lambda: f"recovery after the restart ({held(r)} of {ids.next}, {r.health})")
        wait_for(lambda: r.health.status == "running", 60, lambda: str(r.health))
    assert stalled_seen, "the stall with every broker down was not transient"
    got = read_ids(k.bootstrap, f"{topic}-out")
    records, doubled, lost = audit(got, ids.next)
    assert (records, doubled, lost) == (ids.next, 0, 0)
    reports = verify_pipeline(cfg)
    assert all(rep.ok for rep in reports), [(o.breaches, o.samples) for o in reports[0].outputs]
    assert reports[0].complete_checked == ids.next
    count("kafka failover (3 brokers)", records=ids.next, broker_kills=kills, lost=lost,
          doubled=doubled)
    print(f"failover: {ids.next} records, {kills} broker kills, {lost} lost, {doubled} doubled")


def _driver(path: Path, log: Path) -> subprocess.Popen[bytes]:
    # Without the one-driver lock: the second driver is a zombie's successor.
    with log.open("wb") as err:
        return subprocess.Popen([sys.executable, "-m", "reclock.cli", "run", str(path)],
                                env={**os.environ, "PYTHONUNBUFFERED": "1",
                                     "RECLOCK_SKIP_DRIVER_LOCK": "1"},
                                stdout=subprocess.DEVNULL, stderr=err)


def _status(state: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((state / "status.json").read_text()))
    except (OSError, ValueError):
        return {}


@pytest.mark.timeout(400)
def test_a_zombie_driver_is_fenced_by_the_broker(tmp_path: Path, kafka: Any) -> None:
    """Two drivers on one state with a Kafka sink: the second initialises the
    same transactional id and the broker fences the first. The zombie stops
    the source with a clear health status and writes nothing more; a plain
    read_committed consumer sees every record once."""
    topic = f"zo-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 2)
    path = relay_config(tmp_path, kafka.bootstrap, topic)
    path.write_text(path.read_text().replace(
        "timestamp_interval: 200ms",
        "timestamp_interval: 200ms\nspark:\n  master: local[1]\n  conf:\n"
        "    spark.driver.extraJavaOptions: \"-XX:TieredStopAtLevel=1 -XX:+UseSerialGC\""))
    state = tmp_path / "state"
    ids = Ids(kafka.bootstrap, topic, 2)
    ids.send(1000)
    first = _driver(path, tmp_path / "first.log")
    second: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: _status(state).get("pid") == first.pid, 120, "the first driver")
        ids.send(1000)
        second = _driver(path, tmp_path / "second.log")
        # Keep records coming, so that both drivers try to commit.
        deadline = time.monotonic() + 180
        while "Superseded" not in (tmp_path / "first.log").read_text(errors="replace"):
            assert time.monotonic() < deadline, "the first driver was never fenced:\n" + (
                tmp_path / "first.log").read_text()[-3000:]
            assert second.poll() is None, (tmp_path / "second.log").read_text()[-3000:]
            ids.send(200)
            time.sleep(0.5)
        fenced_at = ids.next
        ids.send(1000)  # only the second driver may write these

        wait_for(lambda: len(read_ids(kafka.bootstrap, f"{topic}-out")) >= ids.next, 180,
                 lambda: f"the second driver catching up ({_status(state).get('pid')})")
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    log = (tmp_path / "first.log").read_text(errors="replace")
    assert "stopped: " in log and "transactional.id" in log, log[-2000:]
    got = read_ids(kafka.bootstrap, f"{topic}-out")
    records, doubled, lost = audit(got, ids.next)
    assert (records, doubled, lost) == (ids.next, 0, 0)
    reports = verify_pipeline(load_config(path))
    assert all(rep.ok for rep in reports), [(o.breaches, o.samples) for o in reports[0].outputs]
    count("kafka zombie fenced by the broker", records=ids.next, fenced_after=fenced_at,
          lost=lost, doubled=doubled)
    print(f"zombie: {ids.next} records, fenced after {fenced_at}, {lost} lost, {doubled} doubled")


def test_two_pipelines_with_equal_names_do_not_fence_each_other(
    tmp_path: Path, spark: Any, kafka: Any
) -> None:
    """Source and output names are equal, the topics differ: each pipeline has
    its own identity (minted in its remap store), so their transactional ids
    and consumer groups differ, and both write exactly once side by side."""
    topics = [f"id{i}-{uuid.uuid4().hex[:8]}" for i in range(2)]
    cfgs, producers = [], []
    for i, topic in enumerate(topics):
        kafka.create_topic(topic, 2)
        d = tmp_path / f"p{i}"
        d.mkdir()
        cfgs.append(load_config(relay_config(d, kafka.bootstrap, topic)))
        producers.append(Ids(kafka.bootstrap, topic, 2))
    with running(cfgs[0], spark) as a, running(cfgs[1], spark) as b:
        for _ in range(5):
            for p in producers:
                p.send(300)
            time.sleep(0.3)
        for runners, p in ((a, producers[0]), (b, producers[1])):
            wait_for(lambda r=runners[0], n=p.next: held(r) >= n, 120,
                     lambda r=runners[0]: f"{held(r)} held, {r.health}")
        assert [x[0].health.status for x in (a, b)] == ["running", "running"]
        groups = {x[0].source.group for x in (a, b)}  # type: ignore[attr-defined]
        txids = {x[0].outputs[0].sink.transactional_id for x in (a, b)}  # type: ignore[attr-defined]
    assert len(groups) == 2 and len(txids) == 2, (groups, txids)
    for topic, p in zip(topics, producers, strict=True):
        assert audit(read_ids(kafka.bootstrap, f"{topic}-out"), p.next) == (p.next, 0, 0)
