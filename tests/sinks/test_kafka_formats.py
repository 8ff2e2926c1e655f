"""The Kafka sink's registry formats and keyed envelopes, read back as other
consumers read them: a plain confluent-kafka ``Consumer`` (read_committed)
with the registry's deserializers, against the real broker and the
in-process registry (tests/registry.py).

The expected outputs come from an independent model of the input: the
updates the tests commit are applied to a dict (key -> row) here, and the
topic is folded the way a compacting consumer (upsert) or a minimal
Debezium consumer (before/after/op) folds it.
"""

from __future__ import annotations

import base64
import json
import multiprocessing as mp
import os
import pickle
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from confluent_kafka import Producer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from reclock.clients.schema_registry import RegistryHandle
from reclock.config import load_config
from reclock.contracts.consolidate import consolidate
from reclock.contracts.rows import output_schema
from reclock.contracts.sink import SinkError, SinkState
from reclock.pipeline import Pipeline
from reclock.sinks.kafka import KafkaSink
from tests.kafkabroker import KafkaCluster, read_committed
from tests.registry import RegistryServer, registry_server
from tests.running import kafka_upsert_source, running, snapshot_durable, wait_for

NAME = "src.orders"
USER = pa.schema([("k", pa.string()), ("v", pa.int64()), ("tags", pa.list_(pa.string()))])
SCHEMA = output_schema(USER)


@pytest.fixture(scope="module")
def registry() -> Iterator[RegistryServer]:
    with registry_server() as reg:
        yield reg


def rows(spec: list[tuple[str, int | None, int, int, int]]) -> pa.Table:
    """Updates ``(k, v, diff, into_time, offset)``: v None is a row without v."""
    n = len(spec)
    return pa.table({
        "k": [s[0] for s in spec], "v": [s[1] for s in spec],
        "tags": [[f"t{s[1]}"] if s[1] is not None else [] for s in spec],
        "_into_time": [s[3] for s in spec], "_diff": [s[2] for s in spec],
        "_src_part": pa.array([0] * n, pa.int32()), "_src_offset": [s[4] for s in spec],
        "_src_seq": pa.array([0] * n, pa.int32()), "_src_ts": pa.array([None] * n, pa.int64()),
        "_error": pa.array([None] * n, pa.string()), "_raw_key": pa.array([None] * n, pa.binary()),
        "_raw_value": pa.array([None] * n, pa.binary()),
    }, schema=SCHEMA)


#: Commits of updates (k, v, diff, into_time, offset): inserts; an update, a
#: delete and an unchanged row (-x +x) at one IntoTime; two IntoTimes in one
#: commit (b back, then gone again; c updated twice); a key moving its row.
COMMITS: list[list[tuple[str, int | None, int, int, int]]] = [
    [("a", 1, 1, 10, 0), ("b", 2, 1, 10, 1), ("c", 3, 1, 10, 2), ("d", 4, 1, 10, 3)],
    [("a", 1, -1, 20, 4), ("a", 11, 1, 20, 4), ("b", 2, -1, 20, 5), ("d", 4, -1, 20, 6),
     ("d", 4, 1, 20, 6)],
    [("b", 22, 1, 30, 7), ("c", 3, -1, 30, 8), ("c", 33, 1, 30, 8),
     ("b", 22, -1, 40, 9), ("c", 33, -1, 40, 10), ("c", None, 1, 40, 10), ("e", 5, 1, 40, 11)],
]


def model(commits: list[list[tuple[str, int | None, int, int, int]]]) -> dict[str, int | None]:
    """The rows per key after every update (the upstream's own state)."""
    state: dict[str, int | None] = {}
    for commit in commits:
        for k, v, diff, _, _ in sorted(commit, key=lambda s: (s[3], s[2])):  # -1 before +1
            if diff < 0:
                assert state.pop(k) == v
            else:
                assert k not in state
                state[k] = v
    return state


def make_sink(kafka: KafkaCluster, tmp_path: Path, topic: str,
              reg: RegistryServer | RegistryHandle | None, fmt: str = "avro",
              envelope: str = "upsert", **kw: Any) -> KafkaSink:
    """The tests' sink on ``topic``: keyed by ``k`` unless the envelope is
    log; ``reg`` a registry server (a writer's handle of its URL) or a
    handle; ``kw`` overrides the rest."""
    registry = (RegistryHandle.writer(reg.url) if isinstance(reg, RegistryServer) else reg)
    settings: dict[str, Any] = {
        "staging_dir": tmp_path / "staging", "timeout_s": 10.0, "format": fmt,
        "envelope": envelope, "key": ("k",) if envelope != "log" else (),
        "registry": registry, **kw}
    return KafkaSink(NAME, bootstrap_servers=kafka.bootstrap, topic=topic, **settings)


def commit_all(sink: KafkaSink, commits: list[list[tuple[str, int | None, int, int, int]]]
               ) -> SinkState:
    state = sink.state()
    for i, c in enumerate(commits):
        staged = sink.stager().stage(f"b{i}", 0, rows(c))
        new = SinkState(max(s[3] for s in c) + 1, json.dumps(f"p{i}"))
        sink.commit(staged, state, new)
        state = new
    return state


class Reader:
    """A consumer's deserializers for ``fmt``, built from the registry alone
    (Protobuf: the message class from the schema the registry holds)."""

    def __init__(self, fmt: str, url: str | None) -> None:
        self.fmt = fmt
        self.client = SchemaRegistryClient({"url": url}) if url else None
        self._pb: dict[int, Any] = {}

    def __call__(self, data: bytes | None, topic: str, key: bool) -> Any:
        if data is None:
            return None
        ctx = SerializationContext(topic, MessageField.KEY if key else MessageField.VALUE)
        if self.fmt == "json":
            return json.loads(data)
        if self.fmt == "avro":
            return AvroDeserializer(self.client)(data, ctx)
        if self.fmt == "json_schema":
            return JSONDeserializer(None, schema_registry_client=self.client)(data, ctx)
        from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory

        sid = int.from_bytes(data[1:5], "big")
        if sid not in self._pb:
            text = self.client.get_schema(sid, fmt="serialized").schema_str
            fd = descriptor_pb2.FileDescriptorProto.FromString(base64.b64decode(text))
            pool = descriptor_pool.DescriptorPool()
            pool.Add(fd)
            full = f"{fd.package}.{fd.message_type[0].name}"
            self._pb[sid] = message_factory.GetMessageClass(pool.FindMessageTypeByName(full))
        msg = ProtobufDeserializer(self._pb[sid], {"use.deprecated.format": False})(data, ctx)
        return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def _v(doc: dict[str, Any]) -> int | None:
    v = doc.get("v")
    return None if v is None else int(v)  # (protobuf's JSON: int64 as a string)


FORMATS = ["avro", "protobuf", "json_schema", "json"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_upsert_records_fold_to_the_upstream_rows(
    kafka: KafkaCluster, tmp_path: Path, registry: RegistryServer, fmt: str
) -> None:
    topic = kafka.new_topic(f"up-{fmt.replace('_', '')}", 2)
    sink = make_sink(kafka, tmp_path, topic, None if fmt == "json" else registry, fmt, "upsert")
    sink.ensure(USER)
    commit_all(sink, COMMITS)
    want = model(COMMITS)

    read = Reader(fmt, None if fmt == "json" else registry.url)
    folded: dict[str, int | None] = {}
    tombstones = []
    for m in read_committed(kafka.bootstrap, topic):
        k = read(m.key(), topic, key=True)["k"]
        value = read(m.value(), topic, key=False)
        if value is None:
            tombstones.append(k)
            folded.pop(k, None)
        else:
            assert value["k"] == k and "_into_time" in value
            folded[k] = _v(value)
    assert folded == want
    # b deleted twice (at 20 and 40), c's old row never deleted alone: d's
    # -x +x was no change, so no record for it after the insert
    assert sorted(tombstones) == ["b", "b"]
    if fmt != "json":
        subjects = {s for s in registry.subjects if s.startswith(topic)}
        assert subjects == {f"{topic}-key", f"{topic}-value"}

    # reclock's own reading: the current rows, each once
    again = make_sink(kafka, tmp_path, topic, None if fmt == "json" else registry, fmt, "upsert")
    got = consolidate(again.read_updates(), None, ["k", "v"]).to_pylist()
    assert {r["k"]: r["v"] for r in got} == want and all(r["_count"] == 1 for r in got)
    assert again.holds_state
    sink.close()
    again.close()


@pytest.mark.parametrize("fmt", ["avro", "protobuf", "json_schema", "json"])
def test_debezium_events_fold_to_the_upstream_rows(
    kafka: KafkaCluster, tmp_path: Path, registry: RegistryServer, fmt: str
) -> None:
    topic = kafka.new_topic(f"dbz-{fmt.replace('_', '')}")
    sink = make_sink(kafka, tmp_path, topic, None if fmt == "json" else registry, fmt,
                     "debezium")
    sink.ensure(USER)
    commit_all(sink, COMMITS)

    # a minimal Debezium consumer: c/u/r put ``after``, d removes ``before``'s
    # key; a tombstone only tells compaction; ``before`` must be what it held
    read = Reader(fmt, None if fmt == "json" else registry.url)
    state: dict[str, int | None] = {}
    ops = []
    for m in read_committed(kafka.bootstrap, topic):
        k = read(m.key(), topic, key=True)["k"]
        event = read(m.value(), topic, key=False)
        if event is None:
            assert ops[-1] == (k, "d")  # a tombstone follows its delete
            continue
        op = event["op"]
        ops.append((k, op))
        assert event["source"]["connector"] == "reclock"
        assert event["source"]["name"] == NAME
        assert int(event["ts_ms"]) == int(event["source"]["into_time"])
        before, after = event.get("before"), event.get("after")
        if op in ("u", "d"):
            assert before is not None and before["k"] == k and _v(before) == state[k]
        if op == "c":
            assert not before and k not in state
        if op == "d":
            assert not after
            del state[k]
        else:
            state[k] = _v(after)
    assert state == model(COMMITS)
    assert ops == [("a", "c"), ("b", "c"), ("c", "c"), ("d", "c"),
                   ("a", "u"), ("b", "d"),
                   ("b", "c"), ("c", "u"),
                   ("b", "d"), ("c", "u"), ("e", "c")]
    again = make_sink(kafka, tmp_path, topic, None if fmt == "json" else registry, fmt,
                      "debezium")
    got = consolidate(again.read_updates(), None, ["k", "v"]).to_pylist()
    assert {r["k"]: r["v"] for r in got} == model(COMMITS)
    sink.close()
    again.close()


def test_a_resnapshot_sends_its_new_rows_as_reads_and_its_corrections_as_changes(
    kafka: KafkaCluster, tmp_path: Path
) -> None:
    """Rows at negative ``_src_part`` are a snapshot's: a snapshot's rows
    (chunk parts ``-1 - chunk``) are reads (``r``, ``source.snapshot``
    ``"true"``, the commit's last ``"last"``); a re-snapshot
    (``reclock resnapshot``: what it retracts at ``RESNAPSHOT_PART``, what
    it reads at chunk parts) sends a row it did not hold as a read, a row
    it found changed as ``u`` and one gone as ``d`` (changes a consumer
    applies as such), and nothing for a row it found as it was; streamed
    changes (part 0) are ``c``/``u``/``d``, every one ``"false"``."""
    from reclock.core.columns import RESNAPSHOT_PART

    topic = f"dbz-snap-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 1)
    sink = make_sink(kafka, tmp_path, topic, None, "json", "debezium")
    sink.ensure(USER)

    def at(spec: list[tuple[str, int, int, int, int]], parts: list[int]) -> pa.Table:
        t = rows(spec)
        return t.set_column(t.schema.get_field_index("_src_part"), "_src_part",
                            pa.array(parts, pa.int32()))

    snapshot = at([("a", 1, 1, 10, 0), ("b", 2, 1, 10, 0), ("c", 3, 1, 10, 0)], [-1, -1, -2])
    stream = rows([("d", 4, 1, 20, 5), ("a", 1, -1, 20, 6), ("a", 9, 1, 20, 6)])
    resnap = at([("a", 9, -1, 30, 0), ("b", 2, -1, 30, 0), ("c", 3, -1, 30, 0),
                 ("d", 4, -1, 30, 0),  # the retractions of what the output held ...
                 ("a", 9, 1, 30, 0), ("b", 7, 1, 30, 0), ("d", 4, 1, 30, 0),  # ... the rows read
                 ("e", 5, 1, 30, 0)], [RESNAPSHOT_PART] * 4 + [-1] * 4)
    state = SinkState()
    for i, t in enumerate((snapshot, stream, resnap)):
        new = SinkState(11 + 10 * i, f'"p{i}"')
        sink.commit(sink.stager().stage(f"b{i}", 0, t), state, new)
        state = new
    got = []
    for m in read_committed(kafka.bootstrap, topic):
        if m.value() is not None:
            event = json.loads(m.value())
            got.append((json.loads(m.key())["k"], event["op"], event["source"]["snapshot"]))
    assert got == [("a", "r", "true"), ("b", "r", "true"), ("c", "r", "last"),
                   ("d", "c", "false"), ("a", "u", "false"),
                   ("b", "u", "false"), ("c", "d", "false"), ("e", "r", "last")], got
    sink.close()


def test_log_envelope_in_avro_round_trips(
    kafka: KafkaCluster, tmp_path: Path, registry: RegistryServer
) -> None:
    topic = kafka.new_topic("log-avro")
    sink = make_sink(kafka, tmp_path, topic, registry, "avro", "log", key_columns=["k"])
    sink.ensure(USER)
    commit_all(sink, COMMITS[:2])
    read = Reader("avro", registry.url)
    recs = [(read(m.key(), topic, True), read(m.value(), topic, False))
            for m in read_committed(kafka.bootstrap, topic)]
    assert len(recs) == sum(len(c) for c in COMMITS[:2])
    assert all(k == {"k": v["k"]} for k, v in recs)
    assert {"_diff", "_into_time", "_src_offset"} <= set(recs[0][1])
    got = sink.read_updates()
    assert sorted(zip(got.column("k").to_pylist(), got.column("_diff").to_pylist(),
                      strict=True)) == sorted((s[0], s[2]) for c in COMMITS[:2] for s in c)
    sink.close()


@pytest.mark.parametrize("fmt", ["avro", "protobuf"])
def test_a_column_added_registers_a_new_version_and_old_records_still_read(
    kafka: KafkaCluster, tmp_path: Path, registry: RegistryServer, fmt: str
) -> None:
    topic = kafka.new_topic(f"evo-{fmt}")
    sink = make_sink(kafka, tmp_path, topic, registry, fmt, "upsert")
    sink.ensure(USER)
    state = commit_all(sink, COMMITS[:1])
    # (inserted before the last column: protobuf numbers fields by position,
    # and records are read with the schema that wrote them)
    wider = pa.schema([USER.field("k"), USER.field("v"), ("extra", pa.float64()),
                       USER.field("tags")])
    sink.ensure(wider)
    assert len(registry.subjects[f"{topic}-value"]) == 2  # a second version
    stager = pickle.loads(pickle.dumps(sink.stager()))  # (its codecs stay behind)
    table = rows([("z", 9, 1, 50, 20)])
    table = table.add_column(2, "extra", pa.array([0.5]))
    sink.commit(stager.stage("b9", 0, table), state, SinkState(51, '"q"'))
    got = make_sink(kafka, tmp_path, topic, registry, fmt, "upsert").read_updates()
    assert sorted(zip(got.column("k").to_pylist(), got.column("extra").to_pylist(),
                      got.column("tags").to_pylist(), strict=True)) == [
        ("a", None, ["t1"]), ("b", None, ["t2"]), ("c", None, ["t3"]), ("d", None, ["t4"]),
        ("z", 0.5, ["t9"])]
    sink.close()


def test_values_a_format_cannot_hold_are_error_rows(
    kafka: KafkaCluster, tmp_path: Path, registry: RegistryServer
) -> None:
    """Avro has no unsigned 64-bit type: a value above a long's range is an
    error row with its position; the rest of the batch lands."""
    topic = kafka.new_topic("bad")
    user = pa.schema([("k", pa.string()), ("n", pa.uint64())])
    sink = make_sink(kafka, tmp_path, topic, registry)
    sink.ensure(user)
    base = rows([("a", 1, 1, 10, 0), ("b", 2, 1, 10, 1), ("c", 3, 1, 10, 2)])
    table = pa.table({"k": base.column("k"), "n": pa.array([1, 2**64 - 1, 3], pa.uint64()),
                      **{c: base.column(c) for c in SCHEMA.names if c.startswith("_")}},
                     schema=output_schema(user))
    staged = sink.stager().stage("b0", 0, table)
    assert [(d["rows"], d["errors"]) for d in staged] == [(2, 1)]
    sink.commit(staged, SinkState(), SinkState(11, '"x"'))
    got = sink.read_updates()
    errs = got.filter(pa.compute.is_valid(got.column("_error")))
    assert errs.column("_src_offset").to_pylist() == [1]
    assert "cannot be serialized" in errs.column("_error")[0].as_py()
    ok = got.filter(pa.compute.is_null(got.column("_error")))
    assert sorted(ok.column("k").to_pylist()) == ["a", "c"]
    read = Reader("avro", registry.url)
    assert sorted(read(m.value(), topic, False)["n"]
                  for m in read_committed(kafka.bootstrap, topic)) == [1, 3]
    sink.close()


def test_updates_that_leave_a_key_two_rows_are_refused(
    kafka: KafkaCluster, tmp_path: Path, registry: RegistryServer
) -> None:
    topic = kafka.new_topic("two")
    sink = make_sink(kafka, tmp_path, topic, registry, "avro", "upsert")
    sink.ensure(USER)
    staged = sink.stager().stage("b0", 0, rows([("a", 1, 1, 10, 0), ("a", 2, 1, 10, 1)]))
    with pytest.raises(SinkError, match=r"key \{'k': 'a'\} at IntoTime 10 do not leave it one"):
        sink.commit(staged, SinkState(), SinkState(11, '"x"'))
    assert sink.state() == SinkState()
    assert read_committed(kafka.bootstrap, topic) == []
    sink.close()


def test_settings_are_checked(kafka: KafkaCluster, tmp_path: Path,
                              registry: RegistryServer) -> None:
    topic = f"cfg-{uuid.uuid4().hex[:8]}"
    with pytest.raises(SinkError, match="needs a schema registry"):
        make_sink(kafka, tmp_path, topic, None, "avro", "upsert")
    with pytest.raises(SinkError, match="needs the key columns"):
        KafkaSink(NAME, bootstrap_servers=kafka.bootstrap, topic=topic,
                  staging_dir=tmp_path, envelope="upsert")
    bad = pa.schema([("k", pa.string()), ("my col", pa.int64())])
    sink = make_sink(kafka, tmp_path, topic, registry, "avro", "upsert")
    with pytest.raises(SinkError, match="field names are letters"):
        sink.ensure(bad)
    sink.close()


# -- kill -9 in the middle of a commit -------------------------------------------------------


class CrashingSink(KafkaSink):
    crash_at: tuple[str, int] = ("", -1)

    def _step(self, step: str, count: int = 0) -> None:
        if (step, count) == self.crash_at:
            self._producer.flush(10)
            os.kill(os.getpid(), signal.SIGKILL)


def crash_commit(bootstrap: str, topic: str, staging: str, url: str,
                 staged: list[dict[str, Any]], expected: SinkState, new: SinkState) -> None:
    """Child process: commit ``staged``, dying by SIGKILL after half the records."""
    s = CrashingSink(NAME, bootstrap_servers=bootstrap, topic=topic, staging_dir=staging,
                     format="avro", registry=RegistryHandle.writer(url), envelope="upsert",
                     key=("k",))
    s.crash_at = ("produced", 6)  # of 12
    s.ensure(USER)
    s.commit(staged, expected, new)


def test_kill_9_mid_commit_loses_and_doubles_nothing(
    kafka: KafkaCluster, tmp_path: Path, registry: RegistryServer
) -> None:
    topic = kafka.new_topic("kill", 2)
    sink = make_sink(kafka, tmp_path, topic, registry, "avro", "upsert")
    sink.ensure(USER)
    s1 = commit_all(sink, COMMITS[:1])
    second = COMMITS[1] + [(f"f{i}", i, 1, 20, 20 + i) for i in range(10)]
    staged = sink.stager().stage("b1", 0, rows(second))
    s2 = SinkState(21, '"p1"')
    p = mp.get_context("spawn").Process(target=crash_commit, args=(
        kafka.bootstrap, topic, str(tmp_path / "staging"), registry.url, staged, s1, s2))
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL

    read = Reader("avro", registry.url)

    def seen() -> list[tuple[str, int | None]]:
        out = []
        for m in read_committed(kafka.bootstrap, topic):
            value = read(m.value(), topic, False)
            out.append((read(m.key(), topic, True)["k"], None if value is None else value["v"]))
        return sorted(out, key=str)

    # the killed transaction is invisible to a read_committed consumer
    assert seen() == sorted([("a", 1), ("b", 2), ("c", 3), ("d", 4)], key=str)
    after = make_sink(kafka, tmp_path, topic, registry, "avro", "upsert")
    assert after.state() == s1
    after.ensure(USER)
    after.commit(staged, s1, s2)  # the driver's retry: the same staged files
    # each record once: the first commit's four, then a's update, b's
    # tombstone and the ten new keys
    assert seen() == sorted([("a", 1), ("b", 2), ("c", 3), ("d", 4), ("a", 11), ("b", None),
                             *((f"f{i}", i) for i in range(10))], key=str)
    got = consolidate(after.read_updates(), None, ["k", "v"]).to_pylist()
    assert {r["k"]: r["v"] for r in got} == model([COMMITS[0], second])
    sink.close()
    after.close()


# -- a pipeline on Spark -----------------------------------------------------------------------


def test_an_upsert_topic_lands_as_registry_avro_with_keys_and_tombstones(
    tmp_path: Path, spark: Any, kafka: KafkaCluster, registry: RegistryServer
) -> None:
    """A keyed output (the upsert envelope over a JSON topic) into a Kafka
    sink writing registry Avro with upsert keys: a plain consumer with the
    registry's AvroDeserializer, folding key -> value with tombstones, gets
    the latest value per key of what was produced (a dict here)."""
    src = f"in-{uuid.uuid4().hex[:8]}"
    out = f"{src}-out"
    kafka.create_topic(src, 1)
    kafka.create_topic(out, 2)
    path = tmp_path / "p.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
sources:
  - name: up
    kafka: {{bootstrap_servers: "{kafka.bootstrap}", topic: {src}, timeout: 5s}}
    outputs:
      - name: up
        format: {{type: json, schema: {{body: string, n: int64}}}}
        key_format: {{type: json, schema: {{id: int64}}}}
        envelope: {{type: upsert, key: [id]}}
        sink: {{type: kafka, bootstrap_servers: "{kafka.bootstrap}", topic: {out},
                format: avro, registry: {{url: "{registry.url}"}}, envelope: upsert,
                key: [id], timeout: 5s}}
""")
    # in phases, each durable before the next: a delete of a key whose row
    # was written is a tombstone (one in the same IntoTime as the insert
    # would cancel it)
    phases: list[list[tuple[int, dict[str, Any] | None]]] = [
        [(1, {"body": "a", "n": 1}), (2, {"body": "b", "n": 2}), (3, {"body": "c", "n": 3}),
         (1, {"body": "a2", "n": 10})],
        [(2, None), (4, {"body": "d", "n": 4}), (3, {"body": "c", "n": 3})],  # 3: unchanged
        [(4, None), (5, None)],  # 5: never held a value
        [(4, {"body": "d2", "n": 40})]]
    records = [r for ph in phases for r in ph]

    def produce(recs: list[tuple[int, dict[str, Any] | None]]) -> None:
        p = Producer({"bootstrap.servers": kafka.bootstrap})
        for k, v in recs:
            p.produce(src, key=json.dumps({"id": k}).encode(),
                      value=None if v is None else json.dumps(v).encode(), partition=0)
        assert p.flush(30) == 0

    want: dict[int, dict[str, Any]] = {}
    for k, v in records:
        if v is None:
            want.pop(k, None)
        else:
            want[k] = v
    cfg = load_config(path)

    def durable(r: Any) -> int:
        from reclock.core.frontier import Antichain
        from reclock.core.time import kafka_offsets

        prog = r.outputs[0].state.progress
        return 0 if prog is None else kafka_offsets(Antichain.decode_json("kafka", prog))[0].get(
            0, 0)

    with running(cfg, spark) as runners:
        r = runners[0]
        done = 0
        for ph in phases:
            produce(ph)
            done += len(ph)
            wait_for(lambda n=done: durable(r) == n, 120, lambda: f"{durable(r)}, {r.health}")
        assert r.health.status == "running"

    read = Reader("avro", registry.url)
    folded: dict[int, dict[str, Any]] = {}
    tombstones = 0
    per_key: dict[int, int] = {}
    for m in read_committed(kafka.bootstrap, out):
        key = read(m.key(), out, True)
        value = read(m.value(), out, False)
        per_key[key["id"]] = per_key.get(key["id"], 0) + 1
        if value is None:
            tombstones += 1
            folded.pop(key["id"], None)
        else:
            folded[key["id"]] = {"body": value["body"], "n": value["n"]}
    assert folded == want
    assert tombstones == 2  # 2 and 4 deleted; 5 never held a value
    assert per_key[3] == 1 and 5 not in per_key  # 3's second record changed nothing
    pipe = Pipeline(cfg)
    try:
        sink = pipe.sink(pipe.source_config("up"), cfg.sources[0].outputs[0])
        got = consolidate(sink.read_updates(), None, ["id", "body", "n"]).to_pylist()
    finally:
        pipe.close()
    assert {g["id"]: {"body": g["body"], "n": g["n"]} for g in got} == want


# -- configuration -------------------------------------------------------------------------------

PIPELINE = """
state_dir: {dir}/state
sources:
  - name: users
    kafka: {{bootstrap_servers: "k:9092", topic: users}}
    outputs:
      - name: users
        format: {{type: json, schema: {{email: string}}}}
        key_format: {{type: json, schema: {{id: int64}}}}
        envelope: {{type: upsert, key: [id]}}
        sink: {{type: kafka, bootstrap_servers: "k:9092", topic: users-out, {sink}}}
"""


@pytest.mark.parametrize(("sink", "problem"), [
    ("format: avro, registry: {url: 'http://r:8081'}, envelope: debezium, key: [id]", None),
    ("envelope: upsert", "key: required with envelope: upsert"),
    ("format: protobuf", "registry: required with format: protobuf"),
    ("envelope: upsert, key: [email]", "must contain the output's upstream key ['id']"),
    ("envelope: upsert, key: [id], key_columns: [id]", "key_columns: is for envelope: log"),
    ("format: xml", "format"),
])
def test_the_sink_block_is_checked_when_the_file_loads(
    tmp_path: Path, sink: str, problem: str | None
) -> None:
    from reclock.config import ConfigError

    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(dir=tmp_path, sink=sink))
    if problem is None:
        cfg = load_config(path)
        block = cfg.sources[0].outputs[0].sink
        assert block.state_key == ("id",)
        assert "http://r:8081" in repr(block)
        return
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert problem in str(info.value)


def test_the_registry_block_makes_the_writers_client_settings() -> None:
    """The sink's ``registry:`` block becomes a writer's handle: basic auth,
    the CA file, the timeout in whole seconds (at least one) and the
    client's own request retries; every handle of the same settings in a
    process (a codec's pickled copy too) shares one client, other
    credentials get their own."""
    from reclock.sinks.kafka import RegistryConfig

    block = RegistryConfig.model_validate({
        "url": "https://registry:8081", "username": "writer", "password": "pw-1",
        "ca_location": "/etc/ssl/ca.pem", "timeout": 1500})
    handle = block.registry()
    assert handle._conf() == {"url": "https://registry:8081", "timeout": 1.0,
                              "basic.auth.user.info": "writer:pw-1",
                              "ssl.ca.location": "/etc/ssl/ca.pem"}
    assert "pw-1" not in repr(handle)
    short = RegistryConfig.model_validate({"url": "http://r:8081", "timeout": 200}).registry()
    assert short._conf() == {"url": "http://r:8081", "timeout": 1.0}
    plain = RegistryHandle.writer("http://r:8081")
    copy = pickle.loads(pickle.dumps(plain))
    assert copy is not plain and copy.shared_client() is plain.shared_client()
    other = RegistryHandle.writer("http://r:8081", user="u", password="p")
    assert other.shared_client() is not plain.shared_client()


def test_an_unreachable_registry_is_transient(kafka: KafkaCluster, tmp_path: Path) -> None:
    from reclock.core.errors import TransientError

    topic = f"noreg-{uuid.uuid4().hex[:8]}"
    unreachable = RegistryHandle.writer("http://127.0.0.1:9", user="u", password="s3cret-pw",
                                        timeout=1)
    sink = make_sink(kafka, tmp_path, topic, unreachable)
    with pytest.raises(TransientError, match="schema registry") as info:
        sink.ensure(USER)
    assert "s3cret-pw" not in str(info.value) and "s3cret-pw" not in repr(sink.stager())
    sink.close()


def test_a_postgres_table_lands_as_debezium_events_a_consumer_folds_to_the_table(
    tmp_path: Path, spark: Any, kafka: KafkaCluster, registry: RegistryServer, cdc_url: str
) -> None:
    """A Postgres CDC table (its primary key the sink's key) into Debezium
    events in registry Protobuf: after inserts, updates, deletes and primary
    key changes (a swap within one statement included), a minimal Debezium
    consumer (r/c/u put ``after``, d removes the key) holds ``SELECT *`` of
    the table: the upstream itself is the model. The rows of the initial
    snapshot come as Debezium's snapshots send theirs: each a read (``op``
    ``r``, no ``before``) marked ``source.snapshot`` ``"true"``, the last
    one ``"last"``, and each key's first event; every later change is
    ``c``, ``u`` or ``d`` with ``source.snapshot`` ``"false"``."""
    import psycopg

    from tests.sources.cdc import execute, flushed_lsn, resumed_past

    table = f"dbz_{uuid.uuid4().hex[:6]}"
    out = f"{table}-events"
    kafka.create_topic(out, 2)
    execute(cdc_url,
            f"create table {table} (id int, v text, n bigint, "
            f"constraint {table}_pk primary key (id) deferrable initially immediate)",
            f"alter table {table} replica identity full",
            f"insert into {table} select i, 'v' || i, i * 10 from generate_series(1, 20) i")
    path = tmp_path / "p.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
sources:
  - name: db
    postgres: {{dsn: "{cdc_url}", tables: [{table}]}}
    outputs:
      - name: {table}
        sink: {{type: kafka, bootstrap_servers: "{kafka.bootstrap}", topic: {out},
                format: protobuf, registry: {{url: "{registry.url}"}}, envelope: debezium,
                key: [id], timeout: 5s}}
""")
    cfg = load_config(path)
    with running(cfg, spark) as runners:
        snapshot_durable(runners)
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute(f"update {table} set v = v || '!' where id % 3 = 0")
            c.execute(f"delete from {table} where id in (4, 5)")
            c.execute(f"update {table} set id = 3 - id where id in (1, 2)")  # a swap
            c.execute(f"update {table} set id = id + 100, n = null where id = 7")  # a key change
            c.execute(f"insert into {table} values (4, 'back', 40), (50, null, 5)")
            with c.transaction():
                c.execute(f"update {table} set v = 'x' where id = 8")
                c.execute(f"delete from {table} where id = 8")
        done = resumed_past(runners, flushed_lsn(cdc_url))
        wait_for(lambda: done() and runners[0].health.status == "running", 90,
                 lambda: f"the changes: {runners[0].health}")
    with psycopg.connect(cdc_url) as c:
        upstream = {r[0]: (r[1], r[2]) for r in c.execute(f"select id, v, n from {table}")}

    read = Reader("protobuf", registry.url)
    state: dict[int, tuple[Any, Any]] = {}
    ops: dict[str, int] = {}
    first: dict[int, str] = {}  # each key's first op
    marks: list[str] = []  # source.snapshot of the reads
    for m in read_committed(kafka.bootstrap, out):
        key = int(read(m.key(), out, True)["id"])
        event = read(m.value(), out, False)
        if event is None:
            assert key not in state  # the tombstone after its delete
            continue
        op, snapshot = event["op"], event["source"]["snapshot"]
        ops[op] = ops.get(op, 0) + 1
        first.setdefault(key, op)
        if op == "r":
            assert not event.get("before") and key not in state, event
            assert event["source"]["src_part"] < 0, event  # a snapshot chunk's position
            marks.append(snapshot)
        else:
            assert snapshot == "false", event
        if op == "d":
            assert int(event["before"]["id"]) == key
            del state[key]
        else:
            after = event["after"]
            n = after.get("n")
            state[key] = (after.get("v"), None if n is None else int(n))
    assert state == upstream
    assert set(ops) == {"r", "c", "u", "d"}, ops
    # the snapshot: the 20 rows the table held, each read once, before any change of it
    assert ops["r"] == 20 and {k for k, op in first.items() if op == "r"} == set(range(1, 21))
    assert sorted(marks) == ["last"] + ["true"] * 19, marks


@pytest.mark.timeout(600)
def test_kill_9_of_the_driver_loses_and_doubles_no_upsert_record(
    tmp_path: Path, kafka: KafkaCluster, registry: RegistryServer
) -> None:
    """A driver writing registry Avro upserts, killed at crash points of the
    commit path and by a plain SIGKILL, then run to the end: a plain
    read_committed consumer folds the topic to the latest value per key of
    what was produced (a dict), and each key's records are, in order, a
    subsequence of the values it was given upstream (a commit written twice,
    or a record lost between two that remain out of order, would not be;
    jobs of one IntoTime may skip a key's intermediate values)."""
    import random

    from tests.running import (
        close_driver,
        crash_env,
        start_driver,
        stop_driver,
        wait_exit,
        wait_running,
    )

    src = f"kin-{uuid.uuid4().hex[:8]}"
    out = f"{src}-out"
    kafka.create_topic(src, 2)
    kafka.create_topic(out, 2)
    rng = random.Random(20261127)
    records: list[tuple[int, dict[str, Any] | None]] = []
    for _ in range(2000):
        k = rng.randrange(150)
        records.append((k, None if rng.random() < 0.15 else {"body": f"b{rng.randrange(10**6)}"}))
    want: dict[int, str] = {}
    for k, v in records:
        if v is None:
            want.pop(k, None)
        else:
            want[k] = v["body"]
    p = Producer({"bootstrap.servers": kafka.bootstrap})
    for k, v in records:
        p.produce(src, key=json.dumps({"id": k}).encode(), partition=k % 2,
                  value=None if v is None else json.dumps(v).encode())
    assert p.flush(30) == 0
    state = tmp_path / "state"
    sink = (f'sink: {{type: kafka, bootstrap_servers: "{kafka.bootstrap}", topic: {out}, '
            f'format: avro, registry: {{url: "{registry.url}"}}, envelope: upsert, key: [id], '
            "timeout: 5s}")
    path = tmp_path / "p.yaml"
    path.write_text(f"""
state_dir: {state}
timestamp_interval: 250ms
spark:
  master: local[2]
  max_records_per_job: 400      # several bounded jobs: several commits
  conf:
    spark.driver.extraJavaOptions: "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
sources:
{kafka_upsert_source("up", kafka.bootstrap, src, sink)}""")
    read = Reader("avro", registry.url)

    def fold() -> tuple[dict[int, str], dict[int, list[str | None]]]:
        held: dict[int, str] = {}
        history: dict[int, list[str | None]] = {}
        for m in read_committed(kafka.bootstrap, out):
            key = read(m.key(), out, True)["id"]
            value = read(m.value(), out, False)
            history.setdefault(key, []).append(None if value is None else value["body"])
            if value is None:
                held.pop(key, None)
            else:
                held[key] = value["body"]
        return held, history

    base = {**os.environ, "PYTHONUNBUFFERED": "1"}
    kills = 0
    # (each start costs a Spark JVM: two kills, then the run to the end)
    for i, point in enumerate(["after_sink_commit", None]):
        proc = start_driver(path, crash_env(base, point, 0.5, i))
        try:
            up = wait_running(state, proc)
            if point is None and up:
                time.sleep(rng.uniform(0.5, 2.0))
                proc.send_signal(signal.SIGKILL)
            rc = wait_exit(proc, 60)
            kills += rc == -signal.SIGKILL
        finally:
            close_driver(proc)
    assert kills >= 2, kills
    proc = start_driver(path, base)
    try:
        deadline = time.monotonic() + 180
        while fold()[0] != want and time.monotonic() < deadline:
            time.sleep(1)
    finally:
        rc, err = stop_driver(proc)
    held, history = fold()
    assert held == want, err[-3000:]
    upstream: dict[int, list[str | None]] = {}
    for k, v in records:  # what each key held in turn (a delete of nothing: no change)
        seq = upstream.setdefault(k, [None])
        body = None if v is None else v["body"]
        if seq[-1] != body:
            seq.append(body)
    for k, got in history.items():
        it = iter(upstream[k][1:])
        assert all(any(x == g for x in it) for g in got), (k, got, upstream[k])
        # a tombstone deletes a row the key had: never two in a row
        assert all(a is not None or b is not None for a, b in zip(["", *got], got,
                                                                   strict=False)), (k, got)


def test_registry_credentials_are_sent_and_a_refusal_is_definite(
    kafka: KafkaCluster, tmp_path: Path
) -> None:
    topic = kafka.new_topic("auth")
    with registry_server(auth=("writer", "right-pw")) as reg:
        good = make_sink(kafka, tmp_path, topic,
                         RegistryHandle.writer(reg.url, user="writer", password="right-pw"))
        good.ensure(USER)
        commit_all(good, COMMITS[:1])
        assert {f"{topic}-key", f"{topic}-value"} <= set(reg.subjects)
        good.close()
        bad = make_sink(kafka, tmp_path, topic,
                        RegistryHandle.writer(reg.url, user="writer", password="wrong-pw"))
        with pytest.raises(SinkError, match="schema registry") as info:
            bad.ensure(USER)
        assert "wrong-pw" not in str(info.value) and "wrong-pw" not in repr(bad.stager())
        bad.close()
