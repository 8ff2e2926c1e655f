"""A Kafka source over several topics, against the real broker: a topic
pattern whose topics share one output, topics created and partitions added
while it runs, injected faults, and an output per topic; each checked
against what a plain consumer of the topics reads (the model), and by
``verify``. (The kill test runs a pattern source through SIGKILLs.)"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from reclock import faults
from reclock.cli import main
from reclock.config import ConfigError, load_config
from reclock.contracts.source import ReadTask
from reclock.sources.kafka import KafkaReader
from reclock.verify import verify_pipeline
from tests.kafkabroker import kafka_end, read_committed
from tests.running import durable, read_updates, running, wait_for
from tests.sources.test_kafka_source import _read_all

SCHEMA = "format: {type: json, schema: {id: int64, body: string}}"


def _produce(bootstrap: str, topic: str, partitions: int, start: int, n: int,
             bad_every: int = 0) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for i in range(start, start + n):
        value = (b"{not json" if bad_every and i % bad_every == 0
                 else json.dumps({"id": i, "body": topic}).encode())
        p.produce(topic, key=str(i).encode(), value=value, partition=i % partitions)
    assert p.flush(30) == 0


def _model(bootstrap: str, topics: list[str]) -> Counter[tuple[str, int, int, bytes]]:
    """What the topics hold, read by a plain consumer: (topic, partition,
    offset, value) once each."""
    return Counter((t, m.partition(), m.offset(), m.value())
                   for t in topics for m in read_committed(bootstrap, t))


def _held(t: Any) -> Counter[tuple[str, int, int, bytes]]:
    """The output's rows as (topic, partition, offset, value); an error row
    by its raw value, a data row by its value re-made from its columns."""
    out: Counter[tuple[str, int, int, bytes]] = Counter()
    for r in t.to_pylist():
        assert r["_diff"] == 1
        value = (r["_raw_value"] if r["_error"] is not None
                 else json.dumps({"id": r["id"], "body": r["body"]}).encode())
        out[(r["_topic"], r["_partition"], r["_src_offset"], value)] += 1
    return out


def _pipeline(tmp_path: Path, bootstrap: str, topics: str, outputs: str) -> Path:
    """A pipeline file: one Kafka source ``events`` reading ``topics`` (its
    YAML lines) into ``outputs`` (theirs)."""
    path = tmp_path / "pipeline.yaml"
    path.write_text(f"""
timestamp_interval: 200ms
sources:
  - name: events
    kafka:
      bootstrap_servers: "{bootstrap}"
      {topics}
      timeout: 3s
    outputs:{outputs}
""")
    return path


def _store_as_before_changes(cfg: Any) -> None:
    import sqlalchemy as sa

    from reclock.pipeline import Pipeline
    from reclock.remap_store.sql import bindings_table, pipeline_table

    pipe = Pipeline(cfg)
    try:
        store: Any = pipe.store
        b = store.read("events")
        with store.engine.begin() as conn:
            fmt = conn.execute(sa.select(pipeline_table.c.value).where(
                pipeline_table.c.key == "bindings_format")).scalar()
            assert fmt == "delta-1"
            for x in b.bindings:
                conn.execute(sa.update(bindings_table).where(
                    bindings_table.c.shard == "events",
                    bindings_table.c.into_time == int(x.time)).values(
                        frontier=x.frontier.encode_json()))
            conn.execute(sa.delete(pipeline_table).where(
                pipeline_table.c.key == "bindings_format"))
    finally:
        pipe.close()


def _ends(bootstrap: str, parts: dict[str, int]) -> int:
    return sum(kafka_end(bootstrap, t, p) for t, n in parts.items() for p in range(n))


def test_topic_pattern_reads_topics_that_appear_later_exactly_once(
        tmp_path: Path, spark: Any, kafka: Any, capsys: Any) -> None:
    run = uuid.uuid4().hex[:8]
    a, b, c, other = f"mt{run}-a", f"mt{run}-b", f"mt{run}-c.x", f"other{run}"
    parts = {a: 2, b: 1}
    for t, n in (*parts.items(), (other, 1)):
        kafka.create_topic(t, n)
    _produce(kafka.bootstrap, a, 2, 0, 300, bad_every=50)
    _produce(kafka.bootstrap, b, 1, 1000, 200)
    _produce(kafka.bootstrap, other, 1, 5000, 50)  # not matched: never read
    path = _pipeline(tmp_path, kafka.bootstrap, f'topic_pattern: "mt{run}-.*"', f"""
      - name: events
        {SCHEMA}
        sink: file""")
    cfg = load_config(path)
    try:
        with running(cfg, spark) as runners:
            r = runners[0]
            wait_for(lambda: sum(durable(r).values()) == _ends(kafka.bootstrap, parts), 60,
                     "the first two topics")
            # While it runs: a fault at each step, a new topic and a new partition.
            faults.arm("source:1,commit:2")
            kafka.create_topic(c, 2)
            parts[c] = 2
            _produce(kafka.bootstrap, c, 2, 2000, 150, bad_every=40)
            kafka.add_partitions(a, 3)
            parts[a] = 3
            _produce(kafka.bootstrap, a, 3, 3000, 90)
            wait_for(lambda: sum(durable(r).values()) == _ends(kafka.bootstrap, parts), 90,
                     "the new topic and partition")
            assert not any(faults.take(p) for p in ("source", "commit"))  # all were met
    finally:
        faults.disarm()
    t = read_updates(cfg, "events", "events")
    model = _model(kafka.bootstrap, [a, b, c])
    assert sum(model.values()) == 300 + 200 + 150 + 90
    held = _held(t)
    assert held == model  # every record once, nothing of the unmatched topic
    errors = [r for r in t.to_pylist() if r["_error"] is not None]
    assert len(errors) == 6 + 4 and {r["_topic"] for r in errors} == {a, c}
    # _src_part is the source's own id of (topic, partition), one id each
    ids: dict[tuple[str, int], set[int]] = {}
    for r in t.select(["_topic", "_partition", "_src_part"]).to_pylist():
        ids.setdefault((r["_topic"], r["_partition"]), set()).add(r["_src_part"])
    assert all(len(v) == 1 for v in ids.values())
    assert len({next(iter(v)) for v in ids.values()}) == len(ids) == 2 + 1 + 2 + 1
    reports = verify_pipeline(cfg)
    assert all(rep.ok for rep in reports), [(o.breaches, o.samples) for o in reports[0].outputs]
    assert reports[0].complete_checked == sum(model.values())
    # The store as an older reclock wrote it (every binding whole, no format
    # key) is migrated when it is opened, and verify agrees before and after.
    _store_as_before_changes(cfg)
    again = verify_pipeline(cfg)
    assert [(r.ok, r.complete_checked, [o.breaches for o in r.outputs]) for r in again] == [
        (r.ok, r.complete_checked, [o.breaches for o in r.outputs]) for r in reports]
    # `reclock bindings` names the topic and partition of each id
    capsys.readouterr()
    assert main(["bindings", str(path), "events"]) == 0
    legend = capsys.readouterr().out.splitlines()[-1]
    for (topic, partition), pid in ids.items():
        assert f"{next(iter(pid))} = {topic}/{partition}" in legend


def test_topics_with_an_output_each(tmp_path: Path, spark: Any, kafka: Any) -> None:
    run = uuid.uuid4().hex[:8]
    x, y = f"x{run}", f"y.{run}"
    kafka.create_topic(x, 2)
    kafka.create_topic(y, 1)
    _produce(kafka.bootstrap, x, 2, 0, 120)
    _produce(kafka.bootstrap, y, 1, 500, 80, bad_every=20)
    # Both readers read a task of several topics alike (ids, _topic, _partition).
    native = KafkaReader(kafka.bootstrap, "", (), 5.0, native=True, batch=25, multi=True)
    python = dataclasses.replace(native, native=False)
    spec = ((0, 5, 60, x, 1), (7, 0, 60, x, 0), (3, 10, 80, y, 0))
    got, _ = _read_all(native, spec)
    assert got.equals(_read_all(python, spec)[0])
    assert got.num_rows == 55 + 60 + 70
    assert set(zip(got.column("_src_part").to_pylist(), got.column("_topic").to_pylist(),
                   got.column("_partition").to_pylist(), strict=True)) == {
        (0, x, 1), (7, x, 0), (3, y, 0)}
    routed = KafkaReader(kafka.bootstrap, "", (), 5.0, multi=True, routes=((x, 0), (y, 1)))
    task = ReadTask("events", 0, spec, 185)
    by_output = Counter((i, t) for i, b in routed.read(task)
                        for t in b.column("_topic").to_pylist())
    assert by_output == {(0, x): 115, (1, y): 70}

    path = _pipeline(tmp_path, kafka.bootstrap, f"""topics: [{x}, {y}]
      output_per_topic: true
      topic_outputs: {{{x}: xs}}""", f"""
      - name: xs
        {SCHEMA}
        sink: file
      - name: y_{run}
        format: {{type: json, schema: {{id: int64}}}}
        sink: file""")
    cfg = load_config(path)
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: sum(durable(r).values()) == 200, 60, "both topics")
        # A deleted topic is a definite error of its own output only: the
        # other topic's records keep coming in.
        kafka.delete_topic(y)

        def health() -> dict[str, Any]:
            return {o["name"]: o["health"] for o in r.status()["outputs"]}

        wait_for(lambda: health()[f"y_{run}"]["status"] == "stalled", 30, "y's output stalls")
        _produce(kafka.bootstrap, x, 2, 120, 30)
        wait_for(lambda: sum(durable(r).values()) == 230, 30, "x after y was deleted")
        h = health()
        assert h["xs"]["status"] == "running" and r.health.status == "running"
        assert h[f"y_{run}"]["definite"] and "was deleted" in h[f"y_{run}"]["error"]
    xs = read_updates(cfg, "events", "xs")
    ys = read_updates(cfg, "events", f"y_{run}")
    assert _held(xs) == _model(kafka.bootstrap, [x]) and xs.num_rows == 150
    assert set(ys.column("_topic").to_pylist()) == {y}
    assert sorted(ys.filter(ys.column("_error").is_null()).column("id").to_pylist()) == [
        i for i in range(500, 580) if i % 20]


def test_multi_topic_configuration_is_checked(tmp_path: Path) -> None:
    def load(kafka: str, outputs: str = "      - {name: events, sink: file}") -> Any:
        path = tmp_path / "p.yaml"
        path.write_text("sources:\n  - name: events\n    kafka:\n"
                        "      bootstrap_servers: localhost:9\n" + kafka
                        + "\n    outputs:\n" + outputs + "\n")
        return load_config(path)

    cases = {
        "      topic: a\n      topics: [b]": "exactly one of topic, topics and topic_pattern",
        "      group_id: g": "exactly one of topic, topics and topic_pattern",
        "      topic_pattern: '(['": "not a regular expression",
        "      topic_pattern: a.*\n      output_per_topic: true": "needs topics",
        "      topics: [a]\n      topic_outputs: {a: b}": "only applies to output_per_topic",
        "      topics: [a.b, a_b]\n      output_per_topic: true": "would both write output 'a_b'",
        "      topics: [a]\n      output_per_topic: true\n      topic_outputs: {c: d}":
            "not one of topics",
        "      topics: [a]\n      start: offsets\n"
        "      start_offsets: [{partition: 0, offset: 3}]": "needs its topic",
        "      topic: a\n      start: offsets\n"
        "      start_offsets: [{topic: a, partition: 0, offset: 3}]": "takes no topic",
    }
    for block, message in cases.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
            load(block)
    from reclock.sources.kafka import output_for_topic

    assert [output_for_topic(t) for t in ("orders", "web.clicks", "9lives")] == [
        "orders", "web_clicks", "t_9lives"]
