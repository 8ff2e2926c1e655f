"""Avro through a schema registry, as the subject evolves: v1 and v2 records
on a real Kafka broker, read with the driver running across the change and
stopped across it. Each output ends holding every record once, with each
field on every record that carried it (the output's columns are the union
of the writer schemas), or stalls with a definite error naming the subject,
the change and the way out (the output's ``schema_change`` policy)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest

from reclock.config import load_config
from tests.registry import RegistryServer, avro_values, delete_subject, registry_server
from tests.running import (
    all_durable,
    read_updates,
    running,
    running_again,
    stalled_with,
)
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
        all_durable(runners, 3)
        if not stopped:
            _send(kafka, registry, topic, subject, V2, v2)
            all_durable(runners, 7)
            running_again(runners)
    if stopped:
        _send(kafka, registry, topic, subject, V2, v2)
        with running(cfg, spark) as runners:
            all_durable(runners, 7)
    good, bad = _output(cfg)
    assert bad == []
    cols = ["id", "name", "score", "email"]
    assert [{c: r[c] for c in cols} for r in good] == _model(
        [(V1, r) for r in v1] + [(V2, r) for r in v2], cols)
    # a v1 record written after v2 (an old producer) lands too
    _send(kafka, registry, topic, subject, V1, [{"id": 9, "name": "old", "score": 9}])
    with running(cfg, spark) as runners:
        all_durable(runners, 8)
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
        all_durable(runners, 1)
        if not stopped:
            _send(kafka, registry, topic, subject, V2_LONG, v2)
            all_durable(runners, 3)
    if stopped:
        _send(kafka, registry, topic, subject, V2_LONG, v2)
        with running(cfg, spark) as runners:
            all_durable(runners, 3)
    good, bad = _output(cfg)
    assert bad == []
    assert [(r["id"], r["score"]) for r in good] == [(1, 7), (2, 2**40), (3, -5)]
    t = read_updates(cfg, "users", "users")
    assert str(t.schema.field("score").type) == "int64"


@pytest.mark.parametrize("policy", ["evolve", "freeze", "fail"])
def test_an_incompatible_version_is_a_definite_error_under_every_policy(
        tmp_path: Path, spark: Any, kafka: Any, registry: RegistryServer, policy: str) -> None:
    cfg, topic, subject = _setup(tmp_path, kafka, registry, policy)
    _send(kafka, registry, topic, subject, V1, [{"id": 1, "name": "a", "score": 1}])
    with running(cfg, spark) as runners:
        all_durable(runners, 1)
        _send(kafka, registry, topic, subject, V3_BAD, [{"id": 2, "name": "b", "score": "x"}])
        h = stalled_with(runners, repr(subject), "'score'", "no common type", "resnapshot")
        assert h.definite
    good, bad = _output(cfg)
    assert [r["id"] for r in good] == [1] and bad == []  # what was accepted stays


def test_freeze_keeps_the_columns_and_counts_what_it_drops(
        tmp_path: Path, spark: Any, kafka: Any, registry: RegistryServer) -> None:
    cfg, topic, subject = _setup(tmp_path, kafka, registry, "freeze")
    v1 = [{"id": 1, "name": "a", "score": 1}]
    v2 = [{"id": 2, "name": "b", "score": 2, "email": "b@x"},
          {"id": 3, "name": "c", "score": 3, "email": None}]
    _send(kafka, registry, topic, subject, V1, v1)
    with running(cfg, spark) as runners:
        all_durable(runners, 1)
        _send(kafka, registry, topic, subject, V2, v2)
        all_durable(runners, 3)
        running_again(runners)
        assert runners[0].outputs[0].dropped.counts == {"email": 1}  # one non-null value
        status = runners[0].status()["outputs"][0]
        assert status["dropped_values"] == {"email": 1}
    # ... and after a restart with v2 registered, still today's columns
    _send(kafka, registry, topic, subject, V2, [{"id": 4, "name": "d", "score": 4,
                                                 "email": "d@x"}])
    with running(cfg, spark) as runners:
        all_durable(runners, 4)
        assert runners[0].outputs[0].dropped.counts == {"email": 1}
    good, bad = _output(cfg)
    assert bad == [] and "email" not in good[0]
    assert [(r["id"], r["name"], r["score"]) for r in good] == [
        (1, "a", 1), (2, "b", 2), (3, "c", 3), (4, "d", 4)]
    events = [json.loads(line) for line in
              (tmp_path / "state" / "progress.jsonl").read_text().splitlines()]
    named = [e for e in events if e.get("kind") == "schema"]
    assert any(e.get("dropping_values_of") == "email" for e in named), named


def test_freeze_makes_a_value_its_column_cannot_hold_an_error_row(
        tmp_path: Path, spark: Any, kafka: Any, registry: RegistryServer) -> None:
    cfg, topic, subject = _setup(tmp_path, kafka, registry, "freeze")
    _send(kafka, registry, topic, subject, V1, [{"id": 1, "name": "a", "score": 1}])
    with running(cfg, spark) as runners:
        all_durable(runners, 1)
    _send(kafka, registry, topic, subject, V2_LONG, [{"id": 2, "name": "b", "score": 2},
                                                     {"id": 3, "name": "c", "score": 2**40}])
    with running(cfg, spark) as runners:
        all_durable(runners, 3)
    good, bad = _output(cfg)
    assert [(r["id"], r["score"]) for r in good] == [(1, 1), (2, 2)]
    assert [(r["_src_offset"], str(2**40) in r["_error"], "'score'" in r["_error"])
            for r in bad] == [(2, True, True)]
    t = read_updates(cfg, "users", "users")
    assert str(t.schema.field("score").type) == "int32"


def test_fail_names_the_change_and_the_way_out(tmp_path: Path, spark: Any, kafka: Any,
                                               registry: RegistryServer) -> None:
    cfg, topic, subject = _setup(tmp_path, kafka, registry, "fail")
    _send(kafka, registry, topic, subject, V1, [{"id": 1, "name": "a", "score": 1}])
    with running(cfg, spark) as runners:
        all_durable(runners, 1)
        _send(kafka, registry, topic, subject, V2, [{"id": 2, "name": "b", "score": 2,
                                                     "email": "b@x"}])
        h = stalled_with(runners, "schema_change is fail", "schema_change: evolve")
        assert h.definite
    with running(cfg, spark) as runners:  # stopped across it: the same at the open
        h = stalled_with(runners, "'email' added upstream", "schema_change is fail")
    good, _ = _output(cfg)
    assert [r["id"] for r in good] == [1]
    # switching the output to evolve takes the change, losing nothing
    path = tmp_path / "pipeline.yaml"
    path.write_text(path.read_text().replace("schema_change: fail", "schema_change: evolve"))
    cfg = load_config(path)
    with running(cfg, spark) as runners:
        all_durable(runners, 2)
    good, bad = _output(cfg)
    assert bad == [] and [(r["id"], r["email"]) for r in good] == [(1, None), (2, "b@x")]


def test_a_reset_subject_is_named_and_refused_when_it_does_not_fit(
        tmp_path: Path, spark: Any, kafka: Any, registry: RegistryServer) -> None:
    cfg, topic, subject = _setup(tmp_path, kafka, registry)
    _send(kafka, registry, topic, subject, V1, [{"id": 1, "name": "a", "score": 1}])
    with running(cfg, spark) as runners:
        all_durable(runners, 1)
    # deleted and registered again with a compatible schema: carried on, named
    delete_subject(registry.url, subject, permanent=True)
    _send(kafka, registry, topic, subject, V2, [{"id": 2, "name": "b", "score": 2,
                                                 "email": "e"}])
    with running(cfg, spark) as runners:
        all_durable(runners, 2)
    events = (tmp_path / "state" / "progress.jsonl").read_text()
    assert f"schema registry subject '{subject}' was reset" in events
    # ... and again with one that does not fit what the output took
    delete_subject(registry.url, subject, permanent=True)
    _send(kafka, registry, topic, subject, V3_BAD, [{"id": 3, "name": "c", "score": "x"}])
    with running(cfg, spark) as runners:
        h = stalled_with(runners, repr(subject), "deleted and registered again", "'score'",
                         "resnapshot")
        assert h.definite
    good, bad = _output(cfg)
    assert bad == [] and [(r["id"], r["email"]) for r in good] == [(1, None), (2, "e")]
