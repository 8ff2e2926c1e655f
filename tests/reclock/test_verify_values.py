"""``reclock verify`` checks values, keyed history and upstream identities,
against the real broker and Delta outputs damaged behind reclock's back by
another Delta writer (delta-rs), and says per output what it checked and
what it could not. Each damage is also measured against what a plain
consumer of the topic says (the model), so the test does not rest on
verify's own assumptions."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest
from confluent_kafka import Producer
from deltalake import DeltaTable

from reclock.cli import main
from reclock.config import load_config
from reclock.pipeline import Pipeline
from reclock.runtime.resnapshot import Requests
from reclock.verify import verify_pipeline
from tests.kafkabroker import kafka_end, read_committed
from tests.running import durable, read_updates, running, wait_for

pytestmark = pytest.mark.integration

LOG = "format: {type: json, schema: {id: int64, body: string}}"
KV = ("format: {type: json, schema: {body: string}}\n"
      "        key_format: {type: json, schema: {id: int64}}\n"
      "        envelope: {type: upsert, key: [id]}")


def _pipeline(tmp_path: Path, bootstrap: str, sources: dict[str, tuple[str, str]]) -> Path:
    """A pipeline file: per source name, (its topic, its output's format
    lines); each source has one output of its own name, sink: file."""
    text = f"state_dir: {tmp_path / 'state'}\ntimestamp_interval: 200ms\nsources:\n"
    for name, (topic, fmt) in sources.items():
        text += f"""  - name: {name}
    kafka: {{bootstrap_servers: "{bootstrap}", topic: {topic}, timeout: 5s}}
    outputs:
      - name: {name}
        {fmt}
        sink: file
"""
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    return path


def _produce(bootstrap: str, topic: str, records: list[tuple[int, bytes | None, bytes | None]]
             ) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for part, key, value in records:
        p.produce(topic, key=key, value=value, partition=part)
    assert p.flush(30) == 0


def _table(tmp_path: Path, name: str) -> str:
    return str(tmp_path / "state" / "outputs" / name / name)


def _verify_cli(path: Path, capsys: Any, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["verify", str(path), *extra])
    return rc, capsys.readouterr().out


def _report(path: Path, capsys: Any) -> tuple[int, dict[str, Any]]:
    """``reclock verify --json``: exit status, and per source its report."""
    rc, out = _verify_cli(path, capsys, "--json")
    return rc, {r["source"]: r for r in json.loads(out)}


def _caught_up(runners: list[Any], bootstrap: str, topics: dict[str, tuple[str, int]]) -> None:
    """Until each source's output is durable up to its topic's end."""
    ends = {n: {p: kafka_end(bootstrap, t, p) for p in range(parts)}
            for n, (t, parts) in topics.items()}
    wait_for(lambda: all(durable(r) == ends[r.name] for r in runners), 90,
             lambda: f"the outputs to catch up: {[(r.name, durable(r)) for r in runners]}")


def test_a_value_changed_behind_reclocks_back_is_a_wrong_value_at_its_position(
        tmp_path: Path, spark: Any, kafka: Any, capsys: Any) -> None:
    """An append output of a Kafka topic (malformed records among them) in
    Delta. Another writer changes one user value of one row: the positions,
    times and signs are as they were, so before, `verify` passed it. Now it
    exits 1 with a ``wrong-value`` breach naming that row's position, in
    text and in JSON, and says what it checked."""
    topic = f"vv{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 2)
    _produce(kafka.bootstrap, topic, [
        (i % 2, None, b"{broken" if i % 10 == 3 else json.dumps({"id": i, "body": f"b{i}"})
         .encode()) for i in range(40)])
    path = _pipeline(tmp_path, kafka.bootstrap, {"log": (topic, LOG)})
    cfg = load_config(path)
    with running(cfg, spark) as runners:
        _caught_up(runners, kafka.bootstrap, {"log": (topic, 2)})
    # the model: where id 7 is, from a plain consumer
    where = [(m.partition(), m.offset()) for m in read_committed(kafka.bootstrap, topic)
             if m.value() == json.dumps({"id": 7, "body": "b7"}).encode()]
    assert len(where) == 1
    part, offset = where[0]

    clean = _verify_cli(path, capsys)
    clean_rc, clean_doc = _report(path, capsys)
    assert clean[0] == 0 and clean_rc == 0, clean[1]

    # Another Delta writer changes the body of id 7 (and nothing else).
    DeltaTable(_table(tmp_path, "log")).update(predicate="id = 7",
                                               updates={"body": "'changed'"})
    t = read_updates(cfg, "log", "log")
    got = Counter((r["id"], r["body"]) for r in t.to_pylist() if r["_error"] is None)
    model = Counter((v["id"], v["body"]) for m in read_committed(kafka.bootstrap, topic)
                    if m.value()[:1] == b"{" and m.value() != b"{broken"
                    for v in [json.loads(m.value())])
    assert got != model and got - model == Counter({(7, "changed"): 1})

    rc, out = _verify_cli(path, capsys)
    assert rc == 1, out
    assert "source log: BREACH" in out and "wrong-value=1" in out
    assert f"wrong-value: e.g. [({part}, {offset}, 0)]" in out
    rc, doc = _report(path, capsys)
    log = doc["log"]["outputs"][0]
    assert rc == 1 and not doc["log"]["ok"]
    assert log["breaches"] == {"wrong-value": 1}
    assert log["samples"]["wrong-value"] == [[part, offset, 0]]

    # what it says it checked, undamaged
    out = clean[1]
    assert "output log: 40 rows (4 errors)" in out and ": ok" in out
    assert "checked: time (40 rows), upper" in out and "values (40 positions)" in out
    log = clean_doc["log"]["outputs"][0]
    assert log["breaches"] == {}
    assert list(log["checks"]) == ["time", "upper", "once", "complete", "values", "history",
                                   "identity"]
    assert log["checks"]["values"] == "40 positions" and log["unchecked"] == {}


def _rows_of(cfg: Any, source: str) -> list[dict[str, Any]]:
    t = read_updates(cfg, source, source)
    return sorted(t.to_pylist(), key=lambda r: (r["_into_time"], r["_src_offset"], r["_diff"]))


def test_keyed_history_is_checked_as_of_every_into_time_and_a_missing_key_is_reported(
        tmp_path: Path, spark: Any, kafka: Any, capsys: Any) -> None:
    """An upsert topic: key 1 updated v1 -> v2 -> v3 at three IntoTimes,
    key 2 written once. Another writer removes the v2 update (its
    retraction of v1 and its insertion of v2) and rewrites the next
    retraction to retract v1: the final state is right, so before, `verify`
    passed it, while `reclock read --as-of` between the two times shows v1.
    Now that is a ``keyed-history`` breach naming the key and the time. A
    key deleted behind reclock's back is reported ``missing`` (before, every
    missing position of a keyed output was discarded)."""
    topic = f"vk{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 1)
    path = _pipeline(tmp_path, kafka.bootstrap, {"kv": (topic, KV)})
    cfg = load_config(path)

    def put(key: int, body: str | None) -> None:
        _produce(kafka.bootstrap, topic, [(0, json.dumps({"id": key}).encode(),
                                           None if body is None else
                                           json.dumps({"body": body}).encode())])

    with running(cfg, spark) as runners:
        r = runners[0]
        put(1, "v1")
        put(2, "w1")
        put(9, None)  # a tombstone of a key never written: no update, not missing
        wait_for(lambda: durable(r) == {0: 3}, 60, "v1")
        put(1, "v2")
        wait_for(lambda: durable(r) == {0: 4}, 60, "v2")
        put(1, "v3")
        wait_for(lambda: durable(r) == {0: 5}, 60, "v3")
    rows = _rows_of(cfg, "kv")
    ins = {r["body"]: r for r in rows if r["_diff"] == 1}
    t1, t2, t3 = (ins[v]["_into_time"] for v in ("v1", "v2", "v3"))
    assert t1 < t2 < t3
    assert [(r["id"], r["body"], r["_diff"], r["_src_offset"]) for r in rows] == [
        (1, "v1", 1, 0), (2, "w1", 1, 1), (1, "v1", -1, 3), (1, "v2", 1, 3),
        (1, "v2", -1, 4), (1, "v3", 1, 4)]
    clean_rc, clean = _report(path, capsys)
    assert clean_rc == 0 and clean["kv"]["outputs"][0]["breaches"] == {}, clean

    # Remove the v2 update, and make the v3 update's retraction retract v1.
    t = DeltaTable(_table(tmp_path, "kv"))
    t.delete("_src_offset = 3")
    DeltaTable(_table(tmp_path, "kv")).update(predicate="_src_offset = 4 AND _diff = -1",
                                              updates={"body": "'v1'"})
    # the final state is as the topic says; as of t2 it is not
    capsys.readouterr()
    assert main(["read", str(path), "kv", "--json"]) == 0
    assert sorted(json.loads(x)["body"] for x in capsys.readouterr().out.splitlines()) == [
        "v3", "w1"]
    assert main(["read", str(path), "kv", "--json", "--as-of", str(t2)]) == 0
    as_of_t2 = {json.loads(x)["id"]: json.loads(x)["body"]
                for x in capsys.readouterr().out.splitlines()}
    assert as_of_t2 == {1: "v1", 2: "w1"}  # the topic says v2

    rc, doc = _report(path, capsys)
    kv = doc["kv"]["outputs"][0]
    assert rc == 1
    assert kv["breaches"]["keyed-history"] == 2  # key 1 as of t2 and as of t3
    assert kv["samples"]["keyed-history"][0] == (
        f"key {{'id': 1}}: as of {t2} holds [{{'id': 1, 'body': 'v1'}}], the replay "
        "[{'id': 1, 'body': 'v2'}]")
    assert kv["breaches"]["missing"] == 1  # the v2 update's position
    assert kv["samples"]["missing"] == [[0, 3, 0]]

    # Key 2 deleted behind reclock's back: reported missing, by position and by key.
    DeltaTable(_table(tmp_path, "kv")).delete("id = 2")
    rc, out = _verify_cli(path, capsys)
    assert rc == 1
    assert "missing=2" in out and "missing: e.g. [(0, 1, 0), (0, 3, 0)]" in out
    assert f"key {{'id': 2}}: missing as of {t1} (the replay holds" in out
    # (v1 and w1 may have been bound at two times)
    assert clean["kv"]["outputs"][0]["checks"]["history"] == (
        f"as of {len({r['_into_time'] for r in rows})} IntoTimes")


def test_an_undamaged_pipeline_with_errors_deletes_and_a_correction_is_clean(
        tmp_path: Path, spark: Any, kafka: Any, capsys: Any) -> None:
    """An append and an upsert output with malformed records, tombstones
    and values that do not decode, damaged behind reclock's back and healed
    by ``reclock resnapshot`` while the producer goes on: equal to what a
    plain consumer says, and `verify` is clean. Its report says that what
    the outputs held before the correction is not checked, and, once
    retention removed records, that their rows are not (before, they were
    ``unexpected``)."""
    run = uuid.uuid4().hex[:8]
    log, kv = f"vl{run}", f"vu{run}"
    kafka.create_topic(log, 2)
    kafka.create_topic(kv, 2)
    n = 0

    def write(count: int) -> None:
        nonlocal n
        recs, kvs = [], []
        for i in range(n, n + count):
            recs.append((i % 2, None, b"{broken" if i % 17 == 5 else
                         json.dumps({"id": i, "body": f"b{i}"}).encode()))
            k = i % 23
            kvs.append((k % 2, json.dumps({"id": k}).encode(),
                        None if i % 7 == 0 else b"nope" if i % 31 == 4 else
                        json.dumps({"body": f"v{i}"}).encode()))
        n += count
        _produce(kafka.bootstrap, log, recs)
        _produce(kafka.bootstrap, kv, kvs)

    path = _pipeline(tmp_path, kafka.bootstrap, {"log": (log, LOG), "kv": (kv, KV)})
    cfg = load_config(path)
    topics = {"log": (log, 2), "kv": (kv, 2)}
    write(300)
    with running(cfg, spark) as runners:
        _caught_up(runners, kafka.bootstrap, topics)
        write(100)
        _caught_up(runners, kafka.bootstrap, topics)
    DeltaTable(_table(tmp_path, "log")).delete("id % 5 = 0")
    DeltaTable(_table(tmp_path, "log")).update(predicate="id = 3", updates={"body": "'x'"})
    DeltaTable(_table(tmp_path, "kv")).delete("id = 4")
    DeltaTable(_table(tmp_path, "kv")).update(predicate="id = 6", updates={"body": "'x'"})
    rc, doc = _report(path, capsys)
    assert rc == 1
    assert set(doc["log"]["outputs"][0]["breaches"]) == {"missing", "wrong-value"}
    assert {"missing", "keyed-history"} <= set(doc["kv"]["outputs"][0]["breaches"])

    pipe = Pipeline(cfg)
    try:
        pipe.request_resnapshot("log", "log")
        pipe.request_resnapshot("kv", "kv")
    finally:
        pipe.close()
    requests = [Requests(tmp_path / "state", s) for s in ("log", "kv")]
    with running(cfg, spark) as runners:
        wait_for(lambda: not any(r.pending() for r in requests), 90, "the re-snapshots")
        write(150)
        _caught_up(runners, kafka.bootstrap, topics)

    # the model, from a plain consumer: every decodable log record once; per
    # key the latest decodable value, a tombstone removing it
    want_log = Counter((v["id"], v["body"]) for m in read_committed(kafka.bootstrap, log)
                       if m.value() != b"{broken" for v in [json.loads(m.value())])
    state: dict[int, str] = {}
    for m in sorted(read_committed(kafka.bootstrap, kv), key=lambda m: (m.partition(),
                                                                         m.offset())):
        k = json.loads(m.key())["id"]
        if m.value() is None:
            state.pop(k, None)
        elif m.value() != b"nope":
            state[k] = json.loads(m.value())["body"]

    def net(name: str) -> Counter[tuple[Any, ...]]:
        t = read_updates(cfg, name, name)
        ok = t.filter(pc.is_null(t.column("_error")))
        c: Counter[tuple[Any, ...]] = Counter()
        for r in ok.to_pylist():
            c[(r["id"], r["body"])] += r["_diff"]
        return +c

    assert net("log") == want_log
    assert net("kv") == Counter(state.items())
    for name in ("log", "kv"):
        t = read_updates(cfg, name, name)
        assert pc.sum(pc.less(t.column("_src_part"), 0)).as_py() > 0  # corrections
        assert t.filter(pc.is_valid(t.column("_error"))).num_rows > 0  # errors

    rc, doc = _report(path, capsys)
    assert rc == 0, [(s, o["breaches"], o["samples"]) for s, r in doc.items()
                     for o in r["outputs"]]
    for name in ("log", "kv"):
        o = doc[name]["outputs"][0]
        assert {"time", "upper", "once", "complete", "values", "history"} <= set(o["checks"])
        assert "re-snapshot correction at" in o["unchecked"]["history"]
    assert "from the re-snapshot correction at" in doc["kv"]["outputs"][0]["checks"]["history"]
    assert doc["log"]["complete_checked"] == doc["kv"]["complete_checked"] == n
    rc, out = _verify_cli(path, capsys)
    assert rc == 0 and "not checked: history: " in out

    # Retention removes each topic's first 60 records of partition 0: the
    # rows held for them cannot be compared, and are said so, not breached
    kafka.delete_records(log, 0, 60)
    kafka.delete_records(kv, 0, 60)
    rc, doc = _report(path, capsys)
    assert rc == 0, [(s, o["breaches"], o["samples"]) for s, r in doc.items()
                     for o in r["outputs"]]
    for name in ("log", "kv"):
        o = doc[name]["outputs"][0]
        assert "rows of records retention removed" in o["unchecked"]["complete"], o
        assert doc[name]["complete_checked"] == n - 60
    assert "keys with rows of records that cannot be read again" in (
        doc["kv"]["outputs"][0]["unchecked"]["history"])


def _topic_id(kafka: Any, topic: str) -> str:
    from confluent_kafka import TopicCollection

    return str(kafka.admin().describe_topics(TopicCollection([topic]))[topic].result().topic_id)


def test_a_recreated_topic_is_an_identity_breach_until_accepted_then_clean_with_a_note(
        tmp_path: Path, spark: Any, kafka: Any, capsys: Any) -> None:
    """10 records ingested; the topic deleted and re-created with 25 records.
    Not accepted: the new topic's records sit at the old one's positions, so
    by positions alone the output looked complete (the loss is invisible);
    now `verify` exits 1 with an ``identity`` breach naming the topic, rather
    than failing (exit 2). Accepted and ingested: clean, and it says the
    old topic's rows cannot be re-read. `verify` itself records nothing:
    the acceptance is still pending after it."""
    topic = f"vr{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 1)

    def produce(start: int, count: int) -> None:
        _produce(kafka.bootstrap, topic, [(0, None, json.dumps({"id": i, "body": "x"}).encode())
                                          for i in range(start, start + count)])

    produce(0, 10)
    path = _pipeline(tmp_path, kafka.bootstrap, {"relay": (topic, LOG)})
    cfg = load_config(path)
    with running(cfg, spark) as runners:
        wait_for(lambda: durable(runners[0]) == {0: 10}, 60, "10 records")
    clean_rc, clean = _report(path, capsys)
    assert clean_rc == 0
    old = _topic_id(kafka, topic)
    kafka.delete_topic(topic)
    kafka.create_topic(topic, 1)
    new = _topic_id(kafka, topic)
    produce(100, 25)

    rc, out = _verify_cli(path, capsys)
    assert rc == 1, out
    assert "source relay: BREACH" in out and "identity=1" in out
    assert f"topic {topic!r} was deleted and re-created" in out and old in out and new in out
    assert "not checked: complete: the upstream was replaced" in out
    rc, doc = _report(path, capsys)
    o = doc["relay"]["outputs"][0]
    assert rc == 1 and list(o["breaches"]) == ["identity"]
    assert f"reclock accept-recreated FILE relay {topic}" in o["samples"]["identity"][0]

    def pending() -> Any:
        pipe = Pipeline(cfg)
        try:
            return json.loads(pipe.store.facts("relay")[f"kafka.topic:{topic}"]).get("accept")
        finally:
            pipe.close()

    assert main(["accept-recreated", str(path), "relay", topic]) == 0
    rc, doc = _report(path, capsys)  # accepted, not taken up yet
    o = doc["relay"]["outputs"][0]
    assert rc == 0 and o["breaches"] == {}
    assert "10 rows of partition id 0" in o["unchecked"]["complete"]
    assert pending() == new  # verify took nothing up

    with running(cfg, spark) as runners:
        wait_for(lambda: durable(runners[0]).get(1) == 25, 60, "the new topic's 25")
    assert pending() is None
    t = read_updates(cfg, "relay", "relay")
    assert Counter((r["id"], r["_src_part"]) for r in t.to_pylist()) == Counter(
        {(i, 0): 1 for i in range(10)} | {(i, 1): 1 for i in range(100, 125)})
    rc, out = _verify_cli(path, capsys)
    assert rc == 0, out
    assert "source relay: OK (25 source records re-read)" in out
    assert "note: not re-read: partition id 0: " in out
    assert "before the topic was deleted and re-created" in out
    reports = verify_pipeline(cfg)
    assert reports[0].ok and reports[0].complete_checked == 25
    assert "10 rows of partition id 0" in reports[0].outputs[0].unchecked["values"]
    assert clean["relay"]["outputs"][0]["checks"]["identity"] == "unchanged"
