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


def _pipeline(tmp_path: Path, bootstrap: str, topics: str, outputs: str,
              interval: str = "200ms") -> Path:
    """A pipeline file: one Kafka source ``relay`` reading ``topics`` (its
    keys: ``topic: t``, ``topic_pattern: ...``) into ``outputs`` (YAML lines)."""
    path = tmp_path / "pipeline.yaml"
    path.write_text(f"""
state_dir: {tmp_path / 'state'}
timestamp_interval: {interval}
sources:
  - name: relay
    kafka: {{bootstrap_servers: "{bootstrap}", {topics}, timeout: 5s}}
    outputs:
{outputs}
""")
    return path


def _relay(tmp_path: Path, bootstrap: str, topic: str, sink: str) -> Path:
    """A pipeline file: Kafka topic ``topic`` (JSON ``{"id": n}``) into ``sink``."""
    return _pipeline(tmp_path, bootstrap, f"topic: {topic}", f"""      - name: relay
        format: {{type: json, schema: {{id: int64}}}}
        sink: {sink}""")


def _relayed_into_kafka(tmp_path: Path, spark: Any, kafka: Any, partitions: int, n: int
                        ) -> tuple[Path, Any, str, str]:
    """A source topic of ``partitions`` holding ``n`` records relayed into a
    Kafka sink's topic until all are durable: (file, config, source, data topic)."""
    run = uuid.uuid4().hex[:8]
    src, dst = f"wsrc{run}", f"wdst{run}"
    kafka.create_topic(src, partitions)
    kafka.create_topic(dst, 1)
    _produce(kafka.bootstrap, src, partitions, 0, n)
    path = _relay(tmp_path, kafka.bootstrap, src,
                  f'{{type: kafka, bootstrap_servers: "{kafka.bootstrap}", topic: {dst}}}')
    cfg = load_config(path)
    with running(cfg, spark) as runners:
        wait_for(lambda: sum(durable(runners[0]).values()) == n, 60, f"{n} records")
    return path, cfg, src, dst


def _stalled_with(r: SourceRunner, kind: str) -> bool:
    h = r.health
    return h.status == "stalled" and h.definite and (h.error or "").startswith(kind)


def _ids(bootstrap: str, topic: str) -> Counter[int]:
    """The ids a plain read_committed consumer finds in a Kafka sink's data topic."""
    return Counter(json.loads(m.value())["id"] for m in read_committed(bootstrap, topic))


def test_a_kafka_sinks_progress_topic_deleted_while_stopped_is_a_definite_error(
        tmp_path: Path, spark: Any, kafka: Any, capsys: Any) -> None:
    """The progress topic of a Kafka sink deleted while the driver is stopped:
    the sink then reports nothing committed, which the driver does not
    believe (it recorded the output's upper): a definite error naming the
    output, not every record written a second time. ``reclock resnapshot``
    rebuilds the output; with the data topic emptied first, every record
    lands once."""
    path, cfg, src, dst = _relayed_into_kafka(tmp_path, spark, kafka, 2, 300)
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
        wait_for(lambda: r.health.status == "running", 60, lambda: f"running, {r.health}")
    assert _ids(kafka.bootstrap, dst) == Counter(range(350))


def _held_ids(cfg: Any, output: str) -> Counter[int]:
    """The ids an output of ``relay`` holds, each row an insertion, no error."""
    from tests.running import read_updates

    t = read_updates(cfg, "relay", output)
    assert all(r["_diff"] == 1 and r["_error"] is None for r in t.to_pylist())
    return Counter(r["id"] for r in t.to_pylist())


def _relayed(cfg: Any) -> Counter[tuple[int, int]]:
    """The relay output's rows as (id, _src_part), each row once."""
    from tests.running import read_updates

    t = read_updates(cfg, "relay", "relay")
    assert all(r["_diff"] == 1 and r["_error"] is None for r in t.to_pylist())
    return Counter((r["id"], r["_src_part"]) for r in t.to_pylist())


def _topic_id(kafka: Any, topic: str) -> str:
    from confluent_kafka import TopicCollection

    return str(kafka.admin().describe_topics(TopicCollection([topic]))[topic].result().topic_id)


def test_a_topic_recreated_while_stopped_stalls_until_accepted_then_reads_it_from_its_start(
        tmp_path: Path, spark: Any, kafka: Any, capsys: Any) -> None:
    """10 records ingested; the topic deleted and re-created and 25 records
    produced while the driver is stopped. Before, a restart read only the 15
    at offsets past the old end. Now the source stalls with a definite error
    naming the topic, both topic ids and the recovery; after `reclock
    accept-recreated` every one of the 25 lands once, under partition ids of
    its own, beside the old topic's 10."""
    run = uuid.uuid4().hex[:8]
    src = f"wre{run}"
    kafka.create_topic(src, 1)
    _produce(kafka.bootstrap, src, 1, 0, 10)
    path = _relay(tmp_path, kafka.bootstrap, src, "file")
    cfg = load_config(path)
    with running(cfg, spark) as runners:
        wait_for(lambda: sum(durable(runners[0]).values()) == 10, 60, "10 records")
    old = _topic_id(kafka, src)
    kafka.delete_topic(src)
    kafka.create_topic(src, 1)
    new = _topic_id(kafka, src)
    _produce(kafka.bootstrap, src, 1, 100, 25)
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: _stalled_with(r, "IdentityChanged"), 60,
                 lambda: f"a definite error, health is {r.health}")
        err, hint = r.health.error or "", r.health.hint or ""
        assert f"topic {src!r} was deleted and re-created" in err
        assert old in err and new in err
        assert f"reclock accept-recreated FILE relay {src}" in hint
    assert _relayed(cfg) == Counter({(i, 0): 1 for i in range(10)})  # nothing of the new one

    capsys.readouterr()
    assert main(["accept-recreated", str(path), "relay", src]) == 0
    assert new in capsys.readouterr().out
    assert main(["accept-recreated", str(path), "relay", src]) == 0  # again: still pending
    with running(cfg, spark) as runners:
        r = runners[0]
        # the new topic's partition 0 is partition id 1: the frontier's next id
        wait_for(lambda: durable(r).get(1) == 25, 60, lambda: f"25 new records, {r.health}")
        wait_for(lambda: r.health.status == "running", 60, lambda: f"running, {r.health}")
        _produce(kafka.bootstrap, src, 1, 200, 5)  # and it goes on
        wait_for(lambda: durable(r).get(1) == 30, 60, lambda: f"5 more, {r.health}")
        assert r.source.committed() == {1: 30}  # the group: the new topic's offsets
    assert _relayed(cfg) == Counter(
        {(i, 0): 1 for i in range(10)} | {(i, 1): 1 for i in [*range(100, 125), *range(200, 205)]})
    capsys.readouterr()
    assert main(["accept-recreated", str(path), "relay", src]) == 2  # nothing to accept now
    assert "nothing to accept" in capsys.readouterr().err


def test_a_pattern_topic_recreated_and_refilled_within_one_tick_is_a_new_member(
        tmp_path: Path, spark: Any, kafka: Any) -> None:
    """A topic_pattern source, its topic deleted, re-created and refilled
    with 200 records between two probes (a long interval), with the driver
    running, and once more while it is stopped: each incarnation is a new
    member of the pattern, read from its first record. Before, the records
    below the old end were skipped (190 of 200)."""
    run = uuid.uuid4().hex[:8]
    topic = f"wpat{run}-a"
    kafka.create_topic(topic, 2)
    _produce(kafka.bootstrap, topic, 2, 0, 10)
    path = _pipeline(tmp_path, kafka.bootstrap, f'topic_pattern: "wpat{run}-.*"', """\
      - name: relay
        format: {type: json, schema: {id: int64}}
        sink: file""", interval="5s")
    cfg = load_config(path)

    def ids() -> Counter[int]:
        return _held_ids(cfg, "relay")

    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: sum(durable(r).values()) == 10, 60, "10 records")
        # (a 5 s interval: most often no probe sees the topic gone or empty)
        kafka.delete_topic(topic)
        kafka.create_topic(topic, 2)
        _produce(kafka.bootstrap, topic, 2, 1000, 200)
        wait_for(lambda: sum(durable(r).values()) == 210, 60,
                 lambda: f"200 more, {durable(r)} {r.health}")
        assert r.health.status == "running"
    kafka.delete_topic(topic)
    kafka.create_topic(topic, 1)
    _produce(kafka.bootstrap, topic, 1, 2000, 7)
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: sum(durable(r).values()) == 217, 60,
                 lambda: f"7 more, {durable(r)} {r.health}")
    assert ids() == Counter([*range(10), *range(1000, 1200), *range(2000, 2007)])


def test_a_job_that_read_a_topic_replaced_since_its_probe_commits_nothing(
        kafka: Any, tmp_path: Path) -> None:
    """The race the probe cannot see: the topic re-created between the probe
    that bound a range and the tasks that read it. They read the new topic's
    records at the old positions; the source's check after the job (before
    its commit) finds the topic's id changed and fails the job, so nothing
    it read is committed; with the topic as probed, the same check passes."""
    from reclock.config import load_config
    from reclock.core.errors import TransientError
    from reclock.pipeline import Pipeline

    topic = f"wrace{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 1)
    _produce(kafka.bootstrap, topic, 1, 0, 5)
    pipe = Pipeline(load_config(_relay(tmp_path, kafka.bootstrap, topic, "file")))
    try:
        source = pipe.build_source(pipe.source_config("relay")).source
        probed = source.probe()
        tasks, _ = source.plan(source.initial_frontier(), probed, 100, 100)

        def read() -> int:
            reader = source.reader()
            n = sum(b.num_rows for t in tasks for _i, b in reader.read(t))
            source.confirm(tasks)
            return n

        assert read() == 5
        old = _topic_id(kafka, topic)
        kafka.delete_topic(topic)
        kafka.create_topic(topic, 1)
        _produce(kafka.bootstrap, topic, 1, 100, 5)
        try:
            read()
        except TransientError as exc:
            assert f"{topic!r} (topic id {old} -> {_topic_id(kafka, topic)})" in str(exc)
        else:
            raise AssertionError("a read of the re-created topic passed for the old one")
        source.close()
    finally:
        pipe.close()


def test_a_listed_topic_recreated_while_running_stalls_its_output_only_until_accepted(
        tmp_path: Path, spark: Any, kafka: Any, capsys: Any) -> None:
    """`topics: [a, b]` with an output each: `a` deleted and re-created while
    the driver runs. Its output stalls with the definite error (the other
    goes on reading `b`); `reclock accept-recreated` while it runs takes the
    new `a` up, read from its first record. The driver sees `a` gone before
    it is re-created (as a probe between the two would), and the output's
    health then names the error that holds now, with the recovery it needs."""
    run = uuid.uuid4().hex[:8]
    a, b = f"wla{run}", f"wlb{run}"
    kafka.create_topic(a, 1)
    kafka.create_topic(b, 1)
    _produce(kafka.bootstrap, a, 1, 0, 4)
    _produce(kafka.bootstrap, b, 1, 100, 4)
    path = _pipeline(
        tmp_path, kafka.bootstrap,
        f"topics: [{a}, {b}], output_per_topic: true, topic_outputs: {{{a}: oa, {b}: ob}}",
        """\
      - {name: oa, format: {type: json, schema: {id: int64}}, sink: file}
      - {name: ob, format: {type: json, schema: {id: int64}}, sink: file}""")
    cfg = load_config(path)

    def ids(output: str) -> Counter[int]:
        return _held_ids(cfg, output)

    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: sum(durable(r).values()) == 8, 60, "8 records")
        kafka.delete_topic(a)
        wait_for(lambda: (r.outputs[0].health.error or "").endswith(f"topic {a!r} was deleted"),
                 60, lambda: f"output oa's error for the deleted topic, {r.outputs[0].health}")
        kafka.create_topic(a, 1)
        _produce(kafka.bootstrap, a, 1, 10, 3)
        wait_for(lambda: "was deleted and re-created" in (r.outputs[0].health.error or ""),
                 60, lambda: f"output oa's definite error, {r.outputs[0].health}")
        assert "accept-recreated" in (r.outputs[0].health.hint or ""), r.outputs[0].health
        errors = [e["error"] for e in r.events.recent
                  if e["kind"] == "output_error" and e["output"] == "oa"]
        assert len(errors) == 2 and "re-created" in errors[1], errors
        assert r.outputs[0].health.definite
        _produce(kafka.bootstrap, b, 1, 200, 2)  # the other topic goes on
        wait_for(lambda: ids("ob") == Counter([*range(100, 104), 200, 201]), 60, "b goes on")
        assert ids("oa") == Counter(range(4))
        assert main(["accept-recreated", str(path), "relay", a]) == 0
        wait_for(lambda: ids("oa") == Counter([*range(4), 10, 11, 12]), 60,
                 lambda: f"the new a, {r.outputs[0].health}")
        wait_for(lambda: not r.outputs[0].health.definite, 60, "oa running again")


def test_a_kafka_sinks_progress_topic_deleted_while_running_is_a_definite_error(
        tmp_path: Path, spark: Any, kafka: Any) -> None:
    """The progress topic deleted under a running driver: the sink's next
    state read finds it gone (its topic id changed), is fenced, and the
    re-open meets the recorded upper: the same definite error as after a
    restart. Before, the producer's next commit made the broker auto-create
    the topic with its defaults (4 partitions, a retention), and the source
    stalled on a refusal of that topic that said nothing of the lost state."""
    _path, cfg, src, dst = _relayed_into_kafka(tmp_path, spark, kafka, 1, 50)
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: sum(durable(r).values()) == 50, 60, "50 records")
        kafka.delete_topic(f"{dst}.reclock-progress")
        _produce(kafka.bootstrap, src, 1, 50, 10)
        wait_for(lambda: _stalled_with(r, "IdentityChanged"), 60,
                 lambda: f"a definite error, health is {r.health}")
        assert "reports nothing committed" in (r.health.error or "")
    assert _ids(kafka.bootstrap, dst) == Counter(range(50))  # nothing written twice


def test_a_postgres_sinks_table_dropped_while_stopped_is_a_definite_error(
        tmp_path: Path, spark: Any, kafka: Any, pg_url: str) -> None:
    """The sink's table dropped while the driver is stopped, its row in
    reclock_uppers kept (a DBA's DROP TABLE). Before, the next start made an
    empty table and trusted the row: the output read empty while its state
    said everything was there, and only new records landed. Now the row
    belongs to the dropped table, the sink reports nothing committed, and
    the driver stalls naming the output; `reclock resnapshot` rebuilds it
    with every record once."""
    import psycopg

    run = uuid.uuid4().hex[:8]
    src = f"wpg{run}"
    kafka.create_topic(src, 2)
    _produce(kafka.bootstrap, src, 2, 0, 40)
    path = _relay(tmp_path, kafka.bootstrap, src,
                  f'{{type: postgres, dsn: "{pg_url}", table: relay_out}}')
    cfg = load_config(path)

    def ids() -> Counter[int]:
        with psycopg.connect(pg_url) as c:
            return Counter(i for (i,) in c.execute(
                "SELECT id FROM relay_out WHERE _error IS NULL AND _diff = 1"))

    with running(cfg, spark) as runners:
        wait_for(lambda: sum(durable(runners[0]).values()) == 40, 60, "40 records")
    assert ids() == Counter(range(40))
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute("DROP TABLE relay_out")
    _produce(kafka.bootstrap, src, 2, 40, 10)
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: _stalled_with(r, "IdentityChanged"), 60,
                 lambda: f"a definite error, health is {r.health}")
        assert "output 'relay'" in (r.health.error or "")
    assert main(["resnapshot", str(path), "relay", "relay"]) == 0
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: ids() == Counter(range(50)), 60, lambda: f"50 once, {r.health}")


def test_a_kafka_sinks_data_topic_deleted_while_stopped_is_a_definite_error(
        tmp_path: Path, spark: Any, kafka: Any) -> None:
    """The data topic of a Kafka sink deleted while the driver is stopped,
    its progress topic kept. Before, the next start made the topic again and
    trusted the progress records: the records counted there were gone and
    only new ones landed. Now each progress record names the data topic's id:
    the sink reports nothing committed, the driver stalls naming the output,
    and `reclock resnapshot` rebuilds it, every record once."""
    path, cfg, src, dst = _relayed_into_kafka(tmp_path, spark, kafka, 1, 30)
    kafka.delete_topic(dst)
    _produce(kafka.bootstrap, src, 1, 30, 5)
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: _stalled_with(r, "IdentityChanged"), 60,
                 lambda: f"a definite error, health is {r.health}")
    assert main(["resnapshot", str(path), "relay", "relay"]) == 0
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: sum(durable(r).values()) == 35, 60, lambda: f"35, {r.health}")
    assert _ids(kafka.bootstrap, dst) == Counter(range(35))
