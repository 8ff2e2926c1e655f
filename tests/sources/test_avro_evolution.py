"""Avro through a schema registry, as the subject evolves: v1 and v2 records
on a real Kafka broker, read with the driver running across the change and
stopped across it. Each output ends holding every record once, with each
field on every record that carried it (the output's columns are the union
of the writer schemas), or stalls with a definite error naming the subject,
the change and the way out (the output's ``schema_change`` policy)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest

from reclock.config import load_config
from tests.registry import RegistryServer, avro_values, registry_server
from tests.running import durable, read_updates, running, wait_for
from tests.sources.test_kafka_source import produce

V1 = {"type": "record", "name": "User", "fields": [
    {"name": "id", "type": "long"}, {"name": "name", "type": "string"},
    {"name": "score", "type": "int"}]}
#: adds an optional field
V2 = {"type": "record", "name": "User", "fields": [
    {"name": "id", "type": "long"}, {"name": "name", "type": "string"},
    {"name": "score", "type": "int"},
    {"name": "email", "type": ["null", "string"], "default": None}]}
#: promotes score int -> long (legal in Avro, and a widening of the output)
V2_LONG = {"type": "record", "name": "User", "fields": [
    {"name": "id", "type": "long"}, {"name": "name", "type": "string"},
    {"name": "score", "type": "long"}]}
#: score becomes a string: no type holds both
V3_BAD = {"type": "record", "name": "User", "fields": [
    {"name": "id", "type": "long"}, {"name": "name", "type": "string"},
    {"name": "score", "type": "string"}]}


@pytest.fixture
def registry() -> Iterator[RegistryServer]:
    with registry_server() as reg:
        yield reg


def _setup(tmp_path: Path, kafka: Any, registry: RegistryServer, policy: str | None = None
           ) -> tuple[Any, str, str]:
    topic = f"avro-{uuid.uuid4().hex[:8]}"
    subject = f"{topic}-value"
    kafka.create_topic(topic, 1)
    path = tmp_path / "pipeline.yaml"
    extra = f"\n        schema_change: {policy}" if policy else ""
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
sources:
  - name: users
    kafka: {{bootstrap_servers: "{kafka.bootstrap}", topic: {topic}, timeout: 3s}}
    outputs:
      - name: users
        format: {{type: avro, registry_url: "{registry.url}", subject: {subject}}}
        sink: file{extra}
""")
    return load_config(path), topic, subject


def _send(kafka: Any, registry: RegistryServer, topic: str, subject: str,
          schema: dict[str, Any], records: list[dict[str, Any]]) -> None:
    produce(kafka.bootstrap, topic,
            [(0, None, v) for v in avro_values(registry.url, subject, schema, records)])


def _all_durable(runners: list[Any], n: int) -> None:
    wait_for(lambda: durable(runners[0]) == {0: n}, 90,
             lambda: f"{n} records durable (health {runners[0].health})")


def _stalled(runners: list[Any], *words: str) -> Any:
    def check() -> bool:
        h = runners[0].health
        return h.status == "stalled" and all(w in f"{h.error} {h.hint}" for w in words)

    try:
        wait_for(check, 60, f"a stall naming {words}")
    except AssertionError:
        raise AssertionError(runners[0].health) from None
    return runners[0].health


def _output(cfg: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(data rows by _src_offset, error rows) of the output."""
    t = read_updates(cfg, "users", "users")
    good = t.filter(pc.is_null(t.column("_error"))).to_pylist()
    bad = t.filter(pc.invert(pc.is_null(t.column("_error")))).to_pylist()
    return sorted(good, key=lambda r: r["_src_offset"]), bad


def _model(records: list[tuple[dict[str, Any], dict[str, Any]]], columns: list[str]
           ) -> list[dict[str, Any]]:
    """What the output must hold: each record once, each column holding what
    the record carried (null where its writer schema had no such field)."""
    return [{c: rec.get(c) for c in columns} for _, rec in records]


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_a_new_optional_field_evolves_the_output(tmp_path: Path, spark: Any, kafka: Any,
                                                 registry: RegistryServer, stopped: bool
                                                 ) -> None:
    cfg, topic, subject = _setup(tmp_path, kafka, registry)
    v1 = [{"id": i, "name": f"n{i}", "score": i} for i in range(3)]
    v2 = [{"id": i, "name": f"n{i}", "score": i, "email": f"{i}@x" if i % 2 else None}
          for i in range(3, 7)]
    _send(kafka, registry, topic, subject, V1, v1)
    with running(cfg, spark) as runners:
        _all_durable(runners, 3)
        if not stopped:
            _send(kafka, registry, topic, subject, V2, v2)
            _all_durable(runners, 7)
            assert runners[0].health.status == "running", runners[0].health
    if stopped:
        _send(kafka, registry, topic, subject, V2, v2)
        with running(cfg, spark) as runners:
            _all_durable(runners, 7)
    good, bad = _output(cfg)
    assert bad == []
    cols = ["id", "name", "score", "email"]
    assert [{c: r[c] for c in cols} for r in good] == _model(
        [(V1, r) for r in v1] + [(V2, r) for r in v2], cols)
    # a v1 record written after v2 (an old producer) lands too
    _send(kafka, registry, topic, subject, V1, [{"id": 9, "name": "old", "score": 9}])
    with running(cfg, spark) as runners:
        _all_durable(runners, 8)
    good, bad = _output(cfg)
    assert bad == [] and {c: good[-1][c] for c in cols} == {
        "id": 9, "name": "old", "score": 9, "email": None}


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_int_promoted_to_long_widens_the_output(tmp_path: Path, spark: Any, kafka: Any,
                                                registry: RegistryServer, stopped: bool) -> None:
    cfg, topic, subject = _setup(tmp_path, kafka, registry)
    v1 = [{"id": 1, "name": "a", "score": 7}]
    v2 = [{"id": 2, "name": "b", "score": 2**40}, {"id": 3, "name": "c", "score": -5}]
    _send(kafka, registry, topic, subject, V1, v1)
    with running(cfg, spark) as runners:
        _all_durable(runners, 1)
        if not stopped:
            _send(kafka, registry, topic, subject, V2_LONG, v2)
            _all_durable(runners, 3)
    if stopped:
        _send(kafka, registry, topic, subject, V2_LONG, v2)
        with running(cfg, spark) as runners:
            _all_durable(runners, 3)
    good, bad = _output(cfg)
    assert bad == []
    assert [(r["id"], r["score"]) for r in good] == [(1, 7), (2, 2**40), (3, -5)]
    t = read_updates(cfg, "users", "users")
    assert str(t.schema.field("score").type) == "int64"
