"""Changes of the world around a pipeline, with it stopped and running, on
the real broker: topics deleted and re-created, a sink's progress state
removed. Each ends with every record once (checked against what a plain
consumer of the upstream reads: the model) or with a definite error that
names the object and the fix, never ``running`` with a gap."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

from reclock.cli import main
from reclock.config import load_config
from reclock.runtime.driver import SourceRunner
from tests.kafkabroker import read_committed
from tests.running import durable, running, wait_for


def _produce(bootstrap: str, topic: str, partitions: int, start: int, n: int) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for i in range(start, start + n):
        p.produce(topic, key=str(i).encode(), value=json.dumps({"id": i}).encode(),
                  partition=i % partitions)
    assert p.flush(30) == 0


def _relay(tmp_path: Path, bootstrap: str, topic: str, sink: str) -> Path:
    """A pipeline file: Kafka topic ``topic`` (JSON ``{"id": n}``) into ``sink``."""
    path = tmp_path / "pipeline.yaml"
    path.write_text(f"""
state_dir: {tmp_path / 'state'}
timestamp_interval: 200ms
sources:
  - name: relay
    kafka: {{bootstrap_servers: "{bootstrap}", topic: {topic}, timeout: 5s}}
    outputs:
      - name: relay
        format: {{type: json, schema: {{id: int64}}}}
        sink: {sink}
""")
    return path


def _stalled_with(r: SourceRunner, kind: str) -> bool:
    h = r.health
    return h.status == "stalled" and h.definite and (h.error or "").startswith(kind)


def _ids(bootstrap: str, topic: str) -> Counter[int]:
    """The ids a plain read_committed consumer finds in a Kafka sink's data topic."""
    return Counter(json.loads(m.value())["id"] for m in read_committed(bootstrap, topic))


def test_a_kafka_sinks_progress_topic_deleted_while_stopped_is_a_definite_error(
        tmp_path: Path, spark: Any, kafka: Any, capsys: Any) -> None:
    """The progress topic of a Kafka sink deleted while the driver is stopped:
    the sink then reports nothing committed, which the driver no longer
    believes (it recorded the output's upper): a definite error naming the
    output, not every record written a second time. ``reclock resnapshot``
    rebuilds the output; with the data topic emptied first, every record
    lands once."""
    run = uuid.uuid4().hex[:8]
    src, dst = f"wsrc{run}", f"wdst{run}"
    kafka.create_topic(src, 2)
    kafka.create_topic(dst, 1)
    _produce(kafka.bootstrap, src, 2, 0, 300)
    path = _relay(tmp_path, kafka.bootstrap, src,
                  f'{{type: kafka, bootstrap_servers: "{kafka.bootstrap}", topic: {dst}}}')
    cfg = load_config(path)
    with running(cfg, spark) as runners:
        wait_for(lambda: sum(durable(runners[0]).values()) == 300, 60, "300 records")
    assert _ids(kafka.bootstrap, dst) == Counter(range(300))

    kafka.delete_topic(f"{dst}.reclock-progress")
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: _stalled_with(r, "IdentityChanged"), 60,
                 lambda: f"a definite error, health is {r.health}")
        err, hint = r.health.error or "", r.health.hint or ""
        assert "output 'relay'" in err and "reports nothing committed" in err
        assert "committed it up to upper" in err
        assert "reclock resnapshot FILE relay relay" in hint
        assert ".reclock-progress" in hint
    assert _ids(kafka.bootstrap, dst) == Counter(range(300))  # nothing written twice

    # The documented recovery: empty the target, then rebuild the output.
    kafka.delete_topic(dst)
    kafka.delete_topic(f"{dst}.reclock-progress")
    kafka.create_topic(dst, 1)
    assert main(["resnapshot", str(path), "relay", "relay"]) == 0
    _produce(kafka.bootstrap, src, 2, 300, 50)
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: sum(durable(r).values()) == 350, 60, lambda: f"350, {r.health}")
        assert r.health.status == "running"
    assert _ids(kafka.bootstrap, dst) == Counter(range(350))
