"""kill -9 at random moments, and at every named crash point of the commit path,
while producers keep writing to Kafka: after restarts, every generated and
every produced record is in its output (Delta tables, an Iceberg table, a
Kafka topic) exactly once, at the IntoTime its
bindings give (``reclock verify``), and the consumer group's committed offsets
never exceed what the outputs hold."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer, TopicPartition

from reclock import faults
from reclock.config import load_config
from reclock.verify import verify_pipeline
from tests.kafkabroker import read_committed
from tests.running import (
    close_driver,
    counter_source,
    crash_env,
    finished,
    start_driver,
    status_sources,
    stop_driver,
    wait_exit,
    wait_running,
)
from tests.tally import count

TOTAL = 60_000
#: The crash points this pipeline passes: a Delta state table's commit points
#: need a state output (tests/sinks/test_delta_state_pipeline.py and the
#: generative harness's killed drivers draw them).
_POINTS = [p for p in faults.POINTS if p not in faults.STATE_POINTS]

PIPELINE = """
timestamp_interval: 250ms
spark:
  master: local[2]
  max_records_per_job: 3000      # several bounded jobs per binding: partial commits
  max_records_per_task: 1500
  conf:
    spark.driver.extraJavaOptions: "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
sources:
{counter}
  - name: shop
    generator: {{kind: orders, rate: 4000, max_records: {total}, seed: 7}}
    outputs:
      - {{name: customers, sink: file}}
      - {{name: orders, sink: file}}
  - name: events
    kafka: {{bootstrap_servers: "{bootstrap}", topic: {topic}, group_id: kill-test, timeout: 5s}}
    outputs:
      - name: events
        format: {{type: json, schema: {{id: int64}}}}
        sink: file
  - name: relay  # over several topics; {topic}-b is created between kills
    kafka: {{bootstrap_servers: "{bootstrap}", topic_pattern: "{topic}(-b)?", group_id: relay,
            timeout: 5s}}
    outputs:
      - name: relay
        format: {{type: json, schema: {{id: int64}}}}
        sink: {{type: kafka, bootstrap_servers: "{bootstrap}", topic: {topic}-out}}
"""


class Producing:
    """Keeps producing JSON records to the topic until stopped."""

    def __init__(self, bootstrap: str, topic: str, rate: float = 800, first: int = 0,
                 partitions: int = 4) -> None:
        self.bootstrap, self.topic, self.rate = bootstrap, topic, rate
        self.first, self.partitions = first, partitions
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        p = Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 5})
        while not self._stop.is_set():
            for _ in range(int(self.rate / 10)):
                n = self.first + self.sent
                p.produce(self.topic, key=str(n).encode(), value=json.dumps({"id": n}).encode(),
                          partition=self.sent % self.partitions)
                self.sent += 1
            p.poll(0)
            time.sleep(0.1)
        assert p.flush(30) == 0

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.sent


def _held_offsets(state: Path) -> dict[int, int]:
    """Per partition: one past the highest offset the events output holds."""
    from deltalake import DeltaTable

    path = state / "outputs" / "events" / "events"
    if not (path / "_delta_log").exists():
        return {}
    t = DeltaTable(str(path)).to_pyarrow_table(columns=["_src_part", "_src_offset"])
    held: dict[int, int] = {}
    for part, off in zip(t.column("_src_part").to_pylist(), t.column("_src_offset").to_pylist(),
                         strict=True):
        held[part] = max(held.get(part, 0), off + 1)
    return held


def _committed(bootstrap: str, topic: str) -> dict[int, int]:
    """The consumer group's committed offsets, read with the AdminClient."""
    from confluent_kafka import ConsumerGroupTopicPartitions
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    req = ConsumerGroupTopicPartitions("kill-test",
                                       [TopicPartition(topic, p) for p in range(4)])
    res = admin.list_consumer_group_offsets([req], request_timeout=10)["kill-test"].result(30)
    return {tp.partition: tp.offset for tp in res.topic_partitions if tp.offset >= 0}


@pytest.mark.timeout(900)
def test_sigkill_at_random_moments_and_crash_points(tmp_path: Path, kafka: Any) -> None:
    topic = f"kill-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 4)
    # Kafka-to-Kafka; the sink creates its errors and progress topics.
    kafka.create_topic(f"{topic}-out", 8)
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE.format(total=TOTAL, bootstrap=kafka.bootstrap, topic=topic,
                                    counter=counter_source(4000, TOTAL, 97, sink=(
                                        "{type: iceberg, catalog: {type: sql, uri: "
                                        f"'sqlite:///{tmp_path}/iceberg.db', warehouse: "
                                        f"'{tmp_path}/warehouse'}}, table: kill.counter}}"))))
    producing = Producing(kafka.bootstrap, topic)
    ack_checks = 0
    state = tmp_path / "state"
    rng = random.Random(20261121)
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Every named crash point (passed many times a run, it fires at 25% each
    # time), plus plain random SIGKILLs. (Each start costs a Spark JVM: the
    # test command's 20 minutes allow about this many; the generative and
    # Postgres kill tests add more random ones.)
    plan: list[str | None] = _POINTS + [None] * 2
    rng.shuffle(plan)
    kills = 0
    crash_exits = 0
    second: Producing | None = None
    for i, point in enumerate(plan):
        if i == 2:  # a topic the relay's pattern matches appears between kills
            kafka.create_topic(f"{topic}-b", 2)
            second = Producing(kafka.bootstrap, f"{topic}-b", rate=300, first=10**7,
                               partitions=2)
        proc = start_driver(path, crash_env(base_env, point, 0.25, i))
        try:
            up = wait_running(state, proc)
            if point is None and up:
                time.sleep(rng.uniform(0.2, 3.0))
                proc.send_signal(signal.SIGKILL)
                kills += 1
            rc = wait_exit(proc, 60 if point else 30)
            if rc is None:
                kills += 1
            elif point is not None:
                if rc == -signal.SIGKILL:
                    crash_exits += 1
                else:  # finished before the point fired: fine, nothing to kill
                    assert rc == 0, proc.stderr.read().decode() if proc.stderr else rc
        finally:
            close_driver(proc)
        # nothing is acknowledged upstream before it is durable in the output
        committed = _committed(kafka.bootstrap, topic)
        held = _held_offsets(state)
        assert all(o <= held.get(p, 0) for p, o in committed.items()), (committed, held)
        ack_checks += bool(committed)
    assert kills + crash_exits >= 5, (kills, crash_exits)
    produced = producing.stop()
    assert second is not None
    produced_b = second.stop()
    # Run without faults until the generators finish and Kafka is caught up.
    proc = start_driver(path, base_env)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            held = _held_offsets(state)
            sources = status_sources(state)
            done = finished(state)
            relay = sources.get("relay")
            relayed = sum(o for _lo, _hi, o in (relay or {}).get("read_from") or []
                          if _hi is not None)
            if (sum(held.values()) >= produced and {"counter", "shop"} <= done
                    and relayed >= produced + produced_b):
                # Caught up: the group's offsets come to exactly what the output holds.
                committed = _committed(kafka.bootstrap, topic)
                assert all(o <= held.get(p, 0) for p, o in committed.items()), (committed, held)
                if committed == held:
                    ack_checks += 1
                    break
            time.sleep(0.5)
        else:
            raise AssertionError(f"did not catch up: {sum(_held_offsets(state).values())} "
                                 f"of {produced} Kafka records")
    finally:
        rc, err = stop_driver(proc)
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    cfg = load_config(path)
    reports = verify_pipeline(cfg)
    for r in reports:
        assert r.ok, (r.source, [(o.output, o.breaches, o.samples) for o in r.outputs])
    counts = {r.source: r.complete_checked for r in reports}
    assert counts == {"counter": TOTAL, "shop": TOTAL, "events": produced,
                      "relay": produced + produced_b}
    assert ack_checks > 0
    # Exactly once as any Kafka consumer sees it: a plain read_committed
    # consumer of the sink's topic gets every produced id once (the model: the
    # producers wrote ids 0..produced-1 and 10**7.. 10**7+produced_b-1, each
    # once, into the two topics), none of a killed attempt's.
    relayed = [int(json.loads(m.value())["id"])
               for m in read_committed(kafka.bootstrap, f"{topic}-out")]
    dups = len(relayed) - len(set(relayed))
    model = set(range(produced)) | set(range(10**7, 10**7 + produced_b))
    missing = model - set(relayed)
    assert (dups, sorted(missing)[:10], set(relayed) - model, len(relayed)) == (
        0, [], set(), produced + produced_b)
    count("kill: generator, kafka -> file, iceberg, kafka sinks", kill_points_tried=len(plan),
          sigkills=kills, crash_point_exits=crash_exits, records_checked=sum(counts.values()),
          acknowledgement_checks=ack_checks)
    print(f"kill test: {kills} SIGKILLs, {crash_exits} crash-point exits, "
          f"{sum(counts.values())} records verified exactly once "
          f"({produced} from Kafka), {ack_checks} acknowledgement checks")
