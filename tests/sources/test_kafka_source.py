"""The Kafka source against a real Apache Kafka broker (KRaft, see
tests/kafkabroker.py): partition discovery, start positions, malformed
records, offsets acknowledged only when durable, and topic/broker faults."""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest
from confluent_kafka import Producer

from reclock.config import load_config
from reclock.pipeline import Pipeline
from reclock.runtime.driver import SourceRunner
from reclock.verify import verify_pipeline
from tests.kafkabroker import kafka_end
from tests.running import durable, running, wait_for
from tests.tally import count


def produce(bootstrap: str, topic: str, records: list[tuple[int, bytes | None, bytes | None]]
            ) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for part, key, value in records:
        p.produce(topic, key=key, value=value, partition=part)
    assert p.flush(30) == 0


UPSERT_FORMAT = ("format: {type: json, schema: {body: string}}\n"
                 "        key_format: {type: json, schema: {id: int64}}\n"
                 "        envelope: {type: upsert, key: [id]}")


def config(tmp_path: Path, bootstrap: str, topic: str, extra: str = "",
           upsert: bool = False) -> Path:
    """The topic's JSON records into a Delta output; ``upsert``: keyed by the
    record key's ``id``, the latest value per key."""
    path = tmp_path / "pipeline.yaml"
    fmt = UPSERT_FORMAT if upsert else "format: {type: json, schema: {id: int64, body: string}}"
    path.write_text(f"""
timestamp_interval: 200ms
sources:
  - name: events
    kafka:
      bootstrap_servers: "{bootstrap}"
      topic: {topic}
      timeout: 3s
{extra}
    outputs:
      - name: events
        {fmt}
        sink: file
""")
    return path


def rows(cfg: Any) -> Any:
    pipe = Pipeline(cfg)
    built = pipe.build_source(pipe.source_config("events"))
    t = built.outputs[0].sink.read_updates()
    pipe.close()
    return t


def recs(part: int, start: int, n: int) -> list[tuple[int, bytes | None, bytes | None]]:
    return [(part, str(i).encode(), json.dumps({"id": i, "body": f"p{part}"}).encode())
            for i in range(start, start + n)]


def test_partitions_appearing_later_are_ingested_from_offset_zero(
    tmp_path: Path, spark: Any, kafka: Any
) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 4)
    for p in range(4):
        produce(kafka.bootstrap, topic, recs(p, p * 1000, 50))
    cfg = load_config(config(tmp_path, kafka.bootstrap, topic))
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: r.records >= 200, what="first 200 records")
        kafka.add_partitions(topic, 8)  # CreatePartitions while the pipeline runs
        for p in range(8):
            produce(kafka.bootstrap, topic, recs(p, p * 1000 + 100, 30))
        produced = time.monotonic()
        # The new partitions' first records are durable within about one
        # timestamp_interval (200 ms: the probe sees them) plus one job.
        wait_for(lambda: all(durable(r).get(p, 0) >= 1 for p in range(4, 8)), 30,
                 lambda: f"the new partitions durable: {durable(r)}")
        latency = time.monotonic() - produced
        assert latency < 10, latency
        count("kafka: partitions added while running", partitions_added=4,
              first_durable_ms=int(latency * 1000))
        wait_for(lambda: r.records >= 200 + 240, what="all 440 records")
        wait_for(lambda: all(o.state.upper and o.state.upper > 0 for o in r.outputs))
        committed = r.source.committed()  # type: ignore[attr-defined]
    table = rows(cfg)
    assert table.num_rows == 440
    for p in range(4, 8):
        offs = sorted(table.filter(pc.equal(table.column("_src_part"), p))
                      .column("_src_offset").to_pylist())
        assert offs == list(range(30)), (p, offs)  # from offset 0
    reports = verify_pipeline(cfg)
    assert all(rep.ok for rep in reports), [(o.breaches, o.samples) for o in reports[0].outputs]
    assert reports[0].complete_checked == 440
    # acknowledged offsets never exceed what the outputs hold
    held: dict[int, int] = {}
    for part, off in zip(table.column("_src_part").to_pylist(),
                         table.column("_src_offset").to_pylist(), strict=True):
        held[part] = max(held.get(part, 0), off + 1)
    assert committed and all(o <= held.get(p, 0) for p, o in committed.items()), (committed, held)


def test_malformed_records_land_in_the_error_collection(
    tmp_path: Path, spark: Any, kafka: Any
) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 2)
    produce(kafka.bootstrap, topic,
            [*recs(0, 0, 5), (0, b"k", b"{not json"), (1, None, None), *recs(1, 10, 5)])
    cfg = load_config(config(tmp_path, kafka.bootstrap, topic))
    with running(cfg, spark) as runners:
        wait_for(lambda: runners[0].records >= 12)
    table = rows(cfg)
    errs = table.filter(pc.invert(pc.is_null(table.column("_error")))).to_pylist()
    assert [(e["_src_part"], e["_src_offset"]) for e in errs] == [(0, 5), (1, 0)]
    assert "json" in errs[0]["_error"] and errs[0]["_raw_value"] == b"{not json"
    assert "null" in errs[1]["_error"]
    assert all(r.ok for r in verify_pipeline(cfg))
    # An audit waits out a broker that is briefly away, as the pipeline would.
    kafka.broker_down()
    threading.Timer(4.0, kafka.broker_up).start()
    reports = verify_pipeline(cfg)
    assert all(r.ok for r in reports) and reports[0].complete_checked == 12


def test_start_latest_and_offsets_fixed_at_construction(
    tmp_path: Path, spark: Any, kafka: Any
) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 2)
    produce(kafka.bootstrap, topic, recs(0, 0, 10) + recs(1, 100, 10))
    cfg = load_config(config(tmp_path, kafka.bootstrap, topic, """      start: offsets
      start_offsets: [{partition: 0, offset: 7}]"""))
    with running(cfg, spark) as runners:
        wait_for(lambda: runners[0].records >= 13)
        time.sleep(0.5)
        produce(kafka.bootstrap, topic, recs(0, 10, 2))
        wait_for(lambda: runners[0].records >= 15)
    table = rows(cfg)
    got = sorted(zip(table.column("_src_part").to_pylist(),
                     table.column("_src_offset").to_pylist(), strict=True))
    assert got == [(0, o) for o in range(7, 12)] + [(1, o) for o in range(10)]
    # latest: nothing that was there before the start
    other = tmp_path / "latest"
    other.mkdir()
    cfg2 = load_config(config(other, kafka.bootstrap, topic, "      start: latest"))
    with running(cfg2, spark) as runners:
        wait_for(lambda: bool(runners[0].operator and runners[0].operator.bindings.bindings))
        produce(kafka.bootstrap, topic, recs(1, 500, 3))
        wait_for(lambda: runners[0].records >= 3)
    t2 = rows(cfg2)
    assert sorted(t2.column("id").to_pylist()) == [500, 501, 502]


def test_topic_faults_give_health_with_hints(tmp_path: Path, spark: Any, kafka: Any) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 1)
    produce(kafka.bootstrap, topic, recs(0, 0, 10))
    cfg = load_config(config(tmp_path, kafka.bootstrap, topic))
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: r.records >= 10)
        produce(kafka.bootstrap, topic, recs(0, 10, 20))
        wait_for(lambda: r.records >= 30)
        kafka.broker_down()
        wait_for(lambda: r.health.status == "stalled", what="stall while the broker is down")
        assert not r.health.definite and "broker" in (r.health.hint or "")
        kafka.broker_up()
        produce(kafka.bootstrap, topic, recs(0, 30, 5))
        wait_for(lambda: r.health.status == "running" and r.records >= 35,
                 what=lambda: f"recovery after the broker returns ({r.health}, {r.records})")
        kafka.delete_topic(topic)
        wait_for(lambda: r.health.status == "stalled" and r.health.definite,
                 what="definite error for a deleted topic")
        assert "does not exist" in (r.health.error or "") and r.health.hint
        kafka.create_topic(topic, 1)  # re-created: a new topic id
        produce(kafka.bootstrap, topic, recs(0, 0, 3))
        wait_for(lambda: "was deleted and re-created" in (r.health.error or ""),
                 what="re-created topic error")
        assert r.health.definite and "reclock accept-recreated" in (r.health.hint or "")


def test_retention_before_read_is_a_definite_error(tmp_path: Path, spark: Any, kafka: Any
                                                   ) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 1)
    produce(kafka.bootstrap, topic, recs(0, 0, 10))
    kafka.delete_records(topic, 0, 4)  # gone before the source ever started
    cfg = load_config(config(tmp_path, kafka.bootstrap, topic, """      start: offsets
      start_offsets: [{partition: 0, offset: 0}]"""))
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: r.health.status == "stalled" and r.health.definite)
        assert "removed by retention" in (r.health.error or "") and "retention" in (
            r.health.hint or "")


def test_debezium_envelope_reads_as_state_as_of_any_time(
    tmp_path: Path, spark: Any, kafka: Any
) -> None:
    from reclock.contracts.consolidate import consolidate

    topic = f"t-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 1)
    path = config(tmp_path, kafka.bootstrap, topic)
    path.write_text(path.read_text().replace(
        "format: {type: json, schema: {id: int64, body: string}}",
        "format: {type: json, schema: {id: int64, body: string}}\n"
        "        envelope: {type: debezium, key: [id]}"))
    cfg = load_config(path)

    def ev(before: Any, after: Any, wrap: bool = False) -> bytes:
        op = "c" if before is None else "d" if after is None else "u"
        body = {"before": before, "after": after, "op": op}
        return json.dumps({"schema": {}, "payload": body} if wrap else body).encode()

    produce(kafka.bootstrap, topic, [
        (0, b"1", ev(None, {"id": 1, "body": "a"})),
        (0, b"2", ev(None, {"id": 2, "body": "x"}, wrap=True)),
    ])
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: r.records >= 2)
        wait_for(lambda: durable(r) == {0: 2}, what="the creates durable")
        first_upper = r.outputs[0].state.upper
        produce(kafka.bootstrap, topic, [
            (0, b"1", ev({"id": 1, "body": "a"}, {"id": 1, "body": "b"})),  # update
            (0, b"2", ev({"id": 2, "body": "x"}, None)),                     # delete
            (0, b"3", b'{"before": 5}'),                                     # malformed
            (0, b"4", ev(None, {"id": "four"})),                             # bad after image
        ])
        wait_for(lambda: durable(r) == {0: 6}, what="all events durable")
    table = rows(cfg)
    now = consolidate(table, None, ["id", "body"]).to_pylist()
    assert now == [{"id": 1, "body": "b", "_count": 1}]
    assert first_upper is not None
    then = consolidate(table, first_upper - 1, ["id", "body"]).to_pylist()
    assert then == [{"id": 1, "body": "a", "_count": 1}, {"id": 2, "body": "x", "_count": 1}]
    errs = table.filter(pc.invert(pc.is_null(table.column("_error")))).to_pylist()
    assert [e["_src_offset"] for e in errs] == [4, 5]
    assert "not a JSON object" in errs[0]["_error"] and "after" in errs[1]["_error"]
    assert all(rep.ok for rep in verify_pipeline(cfg))


def test_debezium_replica_identity_default_makes_no_phantom_rows(
    tmp_path: Path, spark: Any, kafka: Any
) -> None:
    """Under REPLICA IDENTITY DEFAULT, Debezium sends updates without a before
    image and deletes whose before image holds only the key. With ``key:
    [id]`` the output is exactly the table's state. (Without a key such events
    could not be applied, and the deleted row stayed live beside error rows:
    a keyless debezium envelope is refused when the file is loaded,
    tests/reclock/test_config.py.)"""
    from reclock.contracts.consolidate import consolidate

    topic = f"t-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 1)
    path = config(tmp_path, kafka.bootstrap, topic)
    path.write_text(path.read_text().replace(
        "format: {type: json, schema: {id: int64, body: string}}",
        "format: {type: json, schema: {id: int64, body: string}}\n"
        "        envelope: {type: debezium, key: [id]}"))
    cfg = load_config(path)

    def ev(op: str, before: Any, after: Any) -> tuple[int, bytes | None, bytes | None]:
        return (0, None, json.dumps({"before": before, "after": after, "op": op}).encode())

    events = [
        ev("c", None, {"id": 1, "body": "a"}),
        ev("c", None, {"id": 2, "body": "x"}),
        ev("u", None, {"id": 1, "body": "b"}),      # update, no before image
        ev("d", {"id": 1}, None),                   # delete, key-only before image
        ev("u", {"id": 2, "body": "x"}, {"id": 3, "body": "x"}),  # the key moves
    ]
    produce(kafka.bootstrap, topic, events)
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: durable(r) == {0: 5}, what=lambda: f"all durable: {r.health}")
    table = rows(cfg)
    now = consolidate(table, None, ["id", "body"]).to_pylist()
    errs = table.filter(pc.invert(pc.is_null(table.column("_error")))).to_pylist()
    # the model: the table upstream holds only id 3
    assert now == [{"id": 3, "body": "x", "_count": 1}] and errs == []
    reports = verify_pipeline(cfg)
    assert all(rep.ok for rep in reports), [(o.breaches, o.samples) for o in reports[0].outputs]


def test_avro_records_and_bad_avro_in_the_error_collection(
    tmp_path: Path, spark: Any, kafka: Any
) -> None:
    import io

    import fastavro

    schema = {"type": "record", "name": "E", "fields": [
        {"name": "id", "type": "long"}, {"name": "body", "type": ["null", "string"]}]}
    parsed = fastavro.parse_schema(schema)

    def enc(rec: dict[str, Any]) -> bytes:
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, parsed, rec)
        return buf.getvalue()

    topic = f"t-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 1)
    produce(kafka.bootstrap, topic, [
        (0, None, enc({"id": 1, "body": "one"})),
        (0, None, b"\x02"),  # truncated: not an Avro datum of this schema
        (0, None, enc({"id": 3, "body": None})),
    ])
    path = config(tmp_path, kafka.bootstrap, topic)
    path.write_text(path.read_text().replace(
        "format: {type: json, schema: {id: int64, body: string}}",
        "format: {type: avro, schema: '" + json.dumps(schema) + "'}"))
    cfg = load_config(path)
    with running(cfg, spark) as runners:
        wait_for(lambda: runners[0].records >= 3)
        wait_for(lambda: durable(runners[0]) == {0: 3}, what="all records durable")
    table = rows(cfg)
    good = table.filter(pc.is_null(table.column("_error")))
    assert sorted(zip(good.column("id").to_pylist(), good.column("body").to_pylist(),
                      strict=True)) == [(1, "one"), (3, None)]
    errs = table.filter(pc.invert(pc.is_null(table.column("_error")))).to_pylist()
    assert [(e["_src_part"], e["_src_offset"]) for e in errs] == [(0, 1)]
    assert "avro" in errs[0]["_error"].lower()


def test_upsert_envelope_as_of_latest_and_earlier_survives_restart(
    tmp_path: Path, spark: Any, kafka: Any
) -> None:
    from reclock.contracts.consolidate import consolidate

    topic = f"t-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 2)
    path = config(tmp_path, kafka.bootstrap, topic, upsert=True)
    cfg = load_config(path)

    def rec(part: int, k: int, body: str | None) -> tuple[int, bytes | None, bytes | None]:
        return (part, json.dumps({"id": k}).encode(),
                None if body is None else json.dumps({"body": body}).encode())

    def upper_of(r: SourceRunner) -> int:
        return r.outputs[0].state.upper or 0

    produce(kafka.bootstrap, topic, [rec(0, 1, "a"), rec(1, 2, "b"), rec(0, 3, "c"),
                                     rec(0, 1, "a2")])
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: r.records >= 4)
        wait_for(lambda: durable(r) == {0: 3, 1: 1}, what="the first 4 records durable")
        first = upper_of(r)
    # restart: the key state is rebuilt from the output
    produce(kafka.bootstrap, topic, [rec(0, 3, None), rec(1, 2, "b2"), rec(1, 9, None),
                                     rec(0, 1, "a3"), rec(1, 2, "b2")])
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: durable(r) == {0: 5, 1: 4}, what="all 9 records durable")
    table = rows(cfg)
    cols = ["id", "body"]
    now = consolidate(table, None, cols).to_pylist()
    assert now == [{"id": 1, "body": "a3", "_count": 1}, {"id": 2, "body": "b2", "_count": 1}]
    then = consolidate(table, first - 1, cols).to_pylist()
    assert then == [{"id": 1, "body": "a2", "_count": 1}, {"id": 2, "body": "b", "_count": 1},
                    {"id": 3, "body": "c", "_count": 1}]
    # every key holds at most one live value at every time
    for t in sorted(set(table.column("_into_time").to_pylist())):
        state = consolidate(table, t, cols).to_pylist()
        assert all(s["_count"] == 1 for s in state)
        assert len({s["id"] for s in state}) == len(state)
    reports = verify_pipeline(cfg)
    assert all(rep.ok for rep in reports), [(o.breaches, o.samples) for o in reports[0].outputs]


def _read_all(reader: Any, spec: Any) -> Any:
    import pyarrow as pa

    from reclock.contracts.source import ReadTask
    from reclock.sources.kafka import task_ranges

    n = sum(e - b for _p, b, e in task_ranges(spec))
    batches = [b for _, b in reader.read(ReadTask("events", 0, spec, n))]
    if not batches:  # a range of aborted records and markers only
        return None, 0
    table = pa.Table.from_batches(batches)
    if not isinstance(spec[0], int):  # several partitions: their records interleave
        table = table.sort_by([("_src_part", "ascending"), ("_src_offset", "ascending")])
    return table, len(batches)


def test_native_and_python_readers_read_the_same_records(kafka: Any) -> None:
    """The C range reader (sources/_kafka_native.c) and the Python one give the
    same records, batches and errors: null keys and values, timestamps,
    aborted transactions and their markers (offsets never delivered), ranges
    that start and end mid-partition, tasks of several partitions, batches
    split at ``batch`` rows."""
    import dataclasses

    import pytest

    from reclock.core.errors import DefiniteError
    from reclock.sources.kafka import KafkaReader, native_reader

    assert native_reader() is not None, "the C extension was not built (is a compiler missing?)"
    topic = f"t-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 2)
    tx = Producer({"bootstrap.servers": kafka.bootstrap, "transactional.id": f"tx-{topic}"})
    tx.init_transactions(10)
    expected: dict[int, list[tuple[bytes | None, bytes | None]]] = {0: [], 1: []}
    for round_ in range(6):
        tx.begin_transaction()
        for i in range(40):
            part = i % 2
            key = None if i % 7 == 0 else f"k{round_}-{i}".encode()
            value = None if i % 11 == 0 else json.dumps({"id": i, "r": round_}).encode()
            tx.produce(topic, key=key, value=value, partition=part, timestamp=1_000 + i)
            if round_ % 3 != 1:
                expected[part].append((key, value))
        # Delivered before the abort, so the aborted records are in the log.
        # (An abort racing the producer's registration of its partitions can
        # fail with INVALID_TXN_STATE: librdkafka issue 4849.)
        tx.flush(10)
        if round_ % 3 == 1:
            tx.abort_transaction(10)
        else:
            tx.commit_transaction(10)
    ends = {p: kafka_end(kafka.bootstrap, topic, p) for p in (0, 1)}
    # 6 rounds of 20 records per partition, aborted ones included, and a marker each.
    assert ends == {0: 126, 1: 126}

    native = KafkaReader(kafka.bootstrap, topic, (), 5.0, native=True, batch=9)
    python = dataclasses.replace(native, native=False)
    checked = 0
    for spec in [(0, 0, ends[0]), (1, 0, ends[1]), (0, 3, ends[0] - 5), (1, 30, 31),
                 (1, 55, 80)]:
        got, n_batches = _read_all(native, spec)
        want, want_batches = _read_all(python, spec)
        if spec == (1, 30, 31):  # inside round 1's aborted transaction: nothing delivered
            assert got is None and want is None and n_batches == want_batches == 0
            continue
        assert got.equals(want), spec
        # Both split at ``batch`` rows (the C reader after a whole poll of at most that many).
        assert want_batches == -(-want.num_rows // 9)
        assert -(-got.num_rows // 17) <= n_batches <= want_batches
        assert got.column("_src_ts").null_count == 0
        checked += got.num_rows
    for spec2 in [((0, 0, ends[0]), (1, 0, ends[1])), ((1, 10, 60), (0, 3, 50))]:
        got, _ = _read_all(native, spec2)
        want, _ = _read_all(python, spec2)
        assert got.equals(want), spec2
        assert got.num_rows == sum(
            _read_all(python, r)[0].num_rows for r in spec2), spec2
        checked += got.num_rows
    full, _ = _read_all(native, (0, 0, ends[0]))
    assert list(zip(full.column("key").to_pylist(), full.column("value").to_pylist(),
                    strict=True)) == expected[0]
    assert checked > 400

    kafka.delete_records(topic, 1, 20)
    for reader in (native, python):
        with pytest.raises(DefiniteError, match=r"removed \(retention\) before they were read"):
            _read_all(reader, (1, 0, ends[1]))


def test_partition_ranges_pack_into_even_tasks() -> None:
    """A job's partition ranges are packed into ceil(total / max_task) tasks
    of even size, each partition at most once per task, covering every
    offset exactly once, in partition order."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from reclock.sources.kafka import pack_ranges

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 500)), max_size=40),
           st.integers(1, 2000))
    def check(spans: list[tuple[int, int]], max_task: int) -> None:
        pieces = [(p, b, b + n) for p, (b, n) in enumerate(spans)]
        total = sum(n for _b, n in spans)
        tasks = pack_ranges(pieces, max_task)
        assert len(tasks) == (-(-total // max_task) if total else 0)
        sizes = [sum(e - b for _p, b, e in t) for t in tasks]
        assert all(s <= max_task for s in sizes)
        assert not sizes or max(sizes) - min(sizes) <= max(1, len(tasks))
        for t in tasks:
            assert len({p for p, _b, _e in t}) == len(t)
        flat = [r for t in tasks for r in t]
        assert [p for p, _b, _e in flat] == sorted(p for p, _b, _e in flat)
        for p, b, e in pieces:
            mine = [(rb, re) for rp, rb, re in flat if rp == p]
            assert mine[0][0] == b and mine[-1][1] == e
            assert all(x[1] == y[0] for x, y in itertools.pairwise(mine))

    check()
    assert pack_ranges([(0, 0, 31), (1, 0, 31), (2, 5, 36)], 50) == [
        ((0, 0, 31), (1, 0, 16)), ((1, 16, 31), (2, 5, 36))]


# -- what only a real broker does ---------------------------------------------------------------


def _txn(bootstrap: str, topic: str, txid: str) -> Producer:
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": txid, "linger.ms": 5})
    p.init_transactions(30)
    return p


def _in_txn(p: Producer, topic: str, records: list[tuple[int, bytes | None, bytes | None]],
            commit: bool) -> None:
    p.begin_transaction()
    for part, key, value in records:
        p.produce(topic, key=key, value=value, partition=part)
    p.flush(30)
    if commit:
        p.commit_transaction(30)
    else:
        p.abort_transaction(30)


def _ends(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    """Each partition's last stable offset, as a read_committed consumer sees it."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"ends-{uuid.uuid4().hex}",
                  "isolation.level": "read_committed"})
    try:
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in range(partitions)}
    finally:
        c.close()


@pytest.mark.parametrize("reader", ["native", "python"])
def test_transactional_input_markers_and_aborts(
    tmp_path: Path, spark: Any, kafka: Any, reader: str
) -> None:
    """Commit and abort markers take offsets. Ranges that end on a marker, or
    hold only markers and aborted records, are read to their end without a
    stall; aborted records never reach the output; verify's completeness check
    knows that those offsets hold no record."""
    topic = f"t-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 2)
    p = _txn(kafka.bootstrap, topic, f"in-{topic}")
    committed: set[int] = set()
    next_id = itertools.count()

    def batch(part: int, n: int) -> list[tuple[int, bytes | None, bytes | None]]:
        return [(part, None, json.dumps({"id": i, "body": f"p{part}"}).encode())
                for i in (next(next_id) for _ in range(n))]

    def send(part: int, n: int, commit: bool) -> None:
        recs_ = batch(part, n)
        _in_txn(p, topic, recs_, commit)
        if commit:
            committed.update(json.loads(v or b"")["id"] for _p, _k, v in recs_)

    send(0, 5, True)    # offsets 0-4, commit marker 5
    send(0, 3, False)   # 6-8 aborted, abort marker 9
    send(0, 2, True)    # 10-11, marker 12
    send(1, 4, False)   # partition 1 holds nothing but an aborted transaction
    cfg = load_config(config(tmp_path, kafka.bootstrap, topic, f"      reader: {reader}"))
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: durable(r) == {0: 13, 1: 5},
                 what=lambda: f"offsets up to the markers durable: {durable(r)}, {r.health}")
        # Later ranges that hold only markers and aborted records.
        send(0, 2, False)
        send(1, 3, False)
        send(1, 1, True)
        ends = _ends(kafka.bootstrap, topic, 2)
        wait_for(lambda: durable(r) == ends,
                 what=lambda: f"{ends} durable, got {durable(r)}, {r.health}")
        assert r.health.status == "running", r.health
    table = rows(cfg)
    assert table.column("_error").null_count == table.num_rows
    assert sorted(table.column("id").to_pylist()) == sorted(committed)
    reports = verify_pipeline(cfg)
    assert all(rep.ok for rep in reports), [(o.breaches, o.samples) for o in reports[0].outputs]
    assert reports[0].complete_checked == len(committed)
    p.flush(5)


def test_compacted_input_upsert_equals_the_latest_value_per_key(
    tmp_path: Path, spark: Any, kafka: Any
) -> None:
    """A compacted topic has offset gaps; an upsert output over it holds the
    topic's latest value per key, and verify's completeness check accepts
    the gaps."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    from reclock.contracts.consolidate import consolidate

    topic = f"t-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 1, config={
        "cleanup.policy": "compact", "segment.ms": "100", "min.cleanable.dirty.ratio": "0.01",
        "delete.retention.ms": "100", "min.compaction.lag.ms": "0"})

    def rec(k: int, v: int | None) -> tuple[int, bytes | None, bytes | None]:
        return (0, json.dumps({"id": k}).encode(),
                None if v is None else json.dumps({"body": f"v{v}"}).encode())

    latest: dict[int, int | None] = {}
    for rnd in range(6):
        batch = [rec(k, None if (k + rnd) % 7 == 0 else rnd) for k in range(20)]
        for _p, key, value in batch:
            latest[json.loads(key or b"")["id"]] = (
                None if value is None else int(json.loads(value)["body"][1:]))
        produce(kafka.bootstrap, topic, batch)
        time.sleep(0.3)  # segment.ms=100: the next batch rolls a new segment

    def held() -> int:
        c = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": uuid.uuid4().hex,
                      "enable.partition.eof": True})
        c.assign([TopicPartition(topic, 0, 0)])
        n = 0
        try:
            while True:
                m = c.poll(5)
                if m is None or (m.error() and m.error().code() == KafkaError._PARTITION_EOF):
                    return n
                n += 1
        finally:
            c.close()

    # The cleaner compacts the closed segments: offsets now have gaps.
    for _ in range(300):
        produce(kafka.bootstrap, topic, [rec(999, 0)])  # rolls the active segment
        if held() < 100:
            break
        time.sleep(0.2)
    assert held() < 100, "the log cleaner did not compact the topic"
    latest[999] = 0
    path = config(tmp_path, kafka.bootstrap, topic, upsert=True)
    cfg = load_config(path)
    end = _ends(kafka.bootstrap, topic, 1)
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: durable(r) == end, what=lambda: f"{end} durable: {durable(r)}")
    now = consolidate(rows(cfg), None, ["id", "body"]).to_pylist()
    want = sorted((k, f"v{v}") for k, v in latest.items() if v is not None)
    assert sorted((s["id"], s["body"]) for s in now) == want
    assert all(s["_count"] == 1 for s in now)
    reports = verify_pipeline(cfg)
    assert all(rep.ok for rep in reports), [(o.breaches, o.samples) for o in reports[0].outputs]


def test_commit_offsets_false_writes_no_consumer_group(
    tmp_path: Path, spark: Any, kafka: Any
) -> None:
    """``commit_offsets: false`` (for clusters that grant no group ACL): the
    source ingests and resumes from its own state, and never commits to the
    consumer group. The option is one field of KafkaConfig in sources/kafka.py,
    read by its ``build``: nothing else names it."""
    topic = f"nc-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 2)
    produce(kafka.bootstrap, topic, recs(0, 0, 20) + recs(1, 100, 20))
    group = f"g-{uuid.uuid4().hex[:8]}"
    extra = f"      group_id: {group}\n      commit_offsets: false"
    cfg = load_config(config(tmp_path, kafka.bootstrap, topic, extra))
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: sum(durable(r).values()) == 40, 60, lambda: str(r.health))
        time.sleep(0.6)  # a few more ticks: each acknowledges the resumption frontier
        assert r.source.committed() == {}  # type: ignore[attr-defined]
    assert rows(cfg).num_rows == 40
    cfg2 = load_config(config(tmp_path, kafka.bootstrap, topic, f"      group_id: {group}"))
    with running(cfg2, spark) as runners:  # the default commits
        r = runners[0]
        wait_for(lambda: r.source.committed() == {0: 20, 1: 20}, 30,  # type: ignore[attr-defined]
                 lambda: str(r.source.committed()))  # type: ignore[attr-defined]


def test_tasks_are_cut_by_bytes_as_well_as_records(
    tmp_path: Path, spark: Any, kafka: Any
) -> None:
    """Records of just under 1 MiB with 4 MiB tasks: the first tasks read a
    few records (sizes unknown yet), later ones 4 each, although the record
    counts allow 1,000."""
    topic = f"big-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 1, config={"max.message.bytes": str(2**21)})
    p = Producer({"bootstrap.servers": kafka.bootstrap, "message.max.bytes": 2**21 + 2**16})

    def write(ids: range) -> None:
        for i in ids:
            p.produce(topic, value=json.dumps({"id": i, "body": f"{i}" + "x" * (2**20 - 64)}
                                              ).encode())
        assert p.flush(60) == 0

    write(range(40))
    path = tmp_path / "pipeline.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
spark: {{max_bytes_per_task: 4MiB, max_records_per_task: 1000}}
sources:
  - name: events
    kafka: {{bootstrap_servers: "{kafka.bootstrap}", topic: {topic}, timeout: 5s}}
    outputs:
      - {{name: events, format: {{type: json, schema: {{id: int64, body: string}}}}, sink: file}}
""")
    cfg = load_config(path)
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: durable(r).get(0) == 40, 90, lambda: f"40 records: {durable(r)}")
        first = len((tmp_path / "state" / "progress.jsonl").read_text().splitlines())
        write(range(40, 60))
        wait_for(lambda: durable(r).get(0) == 60, 90, lambda: f"all 60 records: {durable(r)}")
        per = r.jobs.record_bytes
    events = [json.loads(e) for e in (tmp_path / "state" / "progress.jsonl")
              .read_text().splitlines()]
    reads = [e for e in events[:first] if e["kind"] == "read" and e["records"]]
    later = [e for e in events[first:] if e["kind"] == "read" and e["records"]]
    assert all(e["largest_task"] <= 4 for e in reads)  # sizes unknown: a Kafka source starts small
    assert per is not None and 2**20 - 2**10 <= per < 2**20, per
    assert later and all(e["largest_task"] <= 4 for e in later), [
        (e["tasks"], e["largest_task"]) for e in later]
    reads += later
    assert sum(e["records"] for e in reads) == 60
    t = rows(cfg)
    assert sorted(t.column("id").to_pylist()) == list(range(60))
    assert all(len(b) == 2**20 - 64 + len(str(i)) for i, b in zip(
        t.column("id").to_pylist(), t.column("body").to_pylist(), strict=True))
    assert all(rep.ok for rep in verify_pipeline(cfg))


HEADERS = [
    [("a", b"1"), ("a", b"2"), ("b", None)],  # order and duplicates kept, a null value
    [],
    None,  # no headers at all
    [("ключ", b"\x00\xff" * 5), ("", b"")],  # a UTF-8 key, binary and empty values
    [("big", b"x" * 100_000)],
]


def test_headers_are_read_alike_by_both_readers_and_land_in_the_output(
    tmp_path: Path, spark: Any, kafka: Any
) -> None:
    import dataclasses

    from reclock.sources.kafka import KafkaReader

    topic = f"h-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 2)
    p = Producer({"bootstrap.servers": kafka.bootstrap})
    for i in range(50):
        h = HEADERS[i % len(HEADERS)]
        p.produce(topic, value=json.dumps({"id": i, "body": f"b{i}"}).encode(),
                  partition=i % 2, headers=h)
    assert p.flush(30) == 0
    want = {i: [{"key": k, "value": v} for k, v in HEADERS[i % len(HEADERS)] or []]
            for i in range(50)}
    native = KafkaReader(kafka.bootstrap, topic, (), 5.0, native=True, batch=7, headers=True)
    python = dataclasses.replace(native, native=False)
    for spec in [((0, 0, 25), (1, 0, 25)), (1, 3, 20)]:
        got, _ = _read_all(native, spec)
        same, _ = _read_all(python, spec)
        assert got.equals(same), spec
        assert got.schema.field("headers").type == same.schema.field("headers").type
    got, _ = _read_all(native, ((0, 0, 25), (1, 0, 25)))
    ids = [json.loads(v)["id"] for v in got.column("value").to_pylist()]
    assert got.column("headers").to_pylist() == [want[i] for i in ids]
    plain, _ = _read_all(dataclasses.replace(native, headers=False), (0, 0, 25))
    assert "headers" not in plain.column_names  # opt-in

    path = config(tmp_path, kafka.bootstrap, topic, extra="      include_headers: true")
    cfg = load_config(path)
    with running(cfg, spark) as runners:
        wait_for(lambda: sum(durable(runners[0]).values()) == 50, 60, "50 records")
    t = rows(cfg)
    assert {i: h for i, h in zip(t.column("id").to_pylist(), t.column("headers").to_pylist(),
                                 strict=True)} == want
    assert all(rep.ok for rep in verify_pipeline(cfg))


def test_headers_refused_where_they_cannot_go(tmp_path: Path, kafka: Any) -> None:
    from reclock.core.errors import DefiniteError

    debezium = config(tmp_path, kafka.bootstrap, "any", extra="      include_headers: true")
    debezium.write_text(debezium.read_text().replace(
        "format: {type: json, schema: {id: int64, body: string}}",
        "format: {type: json, schema: {id: int64}}\n        envelope: {type: debezium, key: [id]}"))
    pipe = Pipeline(load_config(debezium))
    with pytest.raises(DefiniteError, match="debezium envelope takes no"):
        pipe.build_source(pipe.source_config("events"))
    clash = config(tmp_path, kafka.bootstrap, "any", extra="      include_headers: true")
    clash.write_text(clash.read_text().replace("body: string", "headers: string"))
    pipe = Pipeline(load_config(clash))
    with pytest.raises(DefiniteError, match="already have"):
        pipe.build_source(pipe.source_config("events"))


def test_retention_after_the_plans_last_look_is_met_by_the_reader(
        kafka: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan reads the earliest offsets at most every EARLIEST_EVERY_S: a
    range retention removed after that reading is planned, and its task
    fails with the same definite error; once the reading is due again, the
    plan refuses the range itself."""
    import reclock.sources.kafka as sk
    from reclock.core.clock import SystemClock
    from reclock.core.errors import DefiniteError

    topic = f"t-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 1)
    produce(kafka.bootstrap, topic, recs(0, 0, 10))
    src = sk.KafkaSource("k", kafka.bootstrap, topic, SystemClock(), group_id="g",
                         output_names=["k"])
    try:
        start = src.initial_frontier()
        src.open(start, start)
        src.plan(start, src.probe(), 1000, 10_000)  # reads the earliest offsets (0)
        produce(kafka.bootstrap, topic, recs(0, 10, 10))
        kafka.delete_records(topic, 0, 15)
        upper = src.probe()
        tasks, _ = src.plan(start, upper, 1000, 10_000)  # the reading from before
        assert [r[:3] for t in tasks for r in sk.task_ranges(t.spec)] == [(0, 0, 20)]
        with pytest.raises(DefiniteError, match=r"removed \(retention\) before they were read"):
            for _ in src.reader().read(tasks[0]):
                pass
        monkeypatch.setattr(sk, "EARLIEST_EVERY_S", 0.0)
        with pytest.raises(DefiniteError, match="removed by retention before they were read"):
            src.plan(start, upper, 1000, 10_000)
    finally:
        src.close()


def test_a_reader_learns_a_new_topics_metadata_before_reading_it(kafka: Any) -> None:
    """A cached consumer about to read a topic it has not met fetches every
    topic's metadata first, once (librdkafka otherwise fetches such a
    partition only after its periodic topic scan, ~0.8 s): both readers read
    topics created after their consumer was, and remember what they learnt."""
    import dataclasses

    from reclock.sources import kafka as kafka_mod
    from reclock.sources.kafka import KafkaReader

    first = f"t-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(first, 1)
    produce(kafka.bootstrap, first, [(0, None, b'{"id": 0}')] * 5)
    native = KafkaReader(kafka.bootstrap, first, (), 5.0, native=True, batch=100)
    python = dataclasses.replace(native, native=False)
    for reader in (native, python):
        got, _ = _read_all(reader, (0, 0, 5))
        assert got.num_rows == 5
    for round_ in range(2):
        topic = f"t-{uuid.uuid4().hex[:8]}"  # created after both consumers
        kafka.create_topic(topic, 1)
        produce(kafka.bootstrap, topic, [(0, b"k", b'{"id": %d}' % i) for i in range(7)])
        for reader in (native, python):
            r = dataclasses.replace(reader, topic=topic)
            got, _ = _read_all(r, (0, 0, 7))
            assert [json.loads(v)["id"] for v in got.column("value").to_pylist()] == list(range(7))
            _c, known = r._consumer(kafka_mod.native_reader() if r.native else None)
            assert {first, topic} <= known, round_
