"""The Kafka sink against a real Apache Kafka broker (KRaft, tests/kafkabroker.py).

Each test writes its own topics (unique names) on the session's broker,
creating them first through the AdminClient.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import math
import multiprocessing as mp
import os
import pickle
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from confluent_kafka import Producer

import reclock.sinks.kafka as kafka_mod
from reclock.contracts.rows import output_schema
from reclock.contracts.sink import SinkError, SinkFenced, SinkState
from reclock.core.clock import ManualClock
from reclock.core.errors import DefiniteError, TransientError
from reclock.sinks.kafka import (
    DATA_META,
    HEADER_BATCH,
    HEADER_OUTPUT,
    KafkaSink,
    KafkaStager,
    ProgressRecord,
    resolve_chain,
)
from tests.kafkabroker import KafkaCluster, read_committed
from tests.sinks.rows import SCHEMA, USER, updates

NAME = "orders.main"


@dataclass
class Topics:
    """One test's topics on the shared broker, and a sink factory."""

    kafka: KafkaCluster
    topic: str
    staging: Path

    @property
    def progress(self) -> str:
        return f"{self.topic}.reclock-progress"

    @property
    def errors(self) -> str:
        return f"{self.topic}.reclock-errors"

    def sink(self, cls: type[KafkaSink] = KafkaSink, **kw: Any) -> KafkaSink:
        kw.setdefault("key_columns", ["k"])
        return cls(NAME, bootstrap_servers=self.kafka.bootstrap, topic=self.topic,
                   staging_dir=self.staging, timeout_s=kw.pop("timeout_s", 10.0), **kw)


@pytest.fixture
def topics(kafka: KafkaCluster, tmp_path: Path) -> Topics:
    t = Topics(kafka, f"out-{uuid.uuid4().hex[:10]}", tmp_path / "staging")
    kafka.create_topic(t.topic, 2)  # the errors and progress topics: the sink creates them
    return t


@pytest.fixture
def sink(topics: Topics) -> Iterator[KafkaSink]:
    s = topics.sink()
    s.ensure(USER)
    yield s
    s.close()


def keys(table: pa.Table) -> list[str]:
    return sorted(table.column("k").to_pylist())


def stage(s: KafkaSink, batch: str, *tables: pa.Table) -> list[dict[str, Any]]:
    st = s.stager()
    return [d for i, t in enumerate(tables) for d in st.stage(batch, i, t)]


# -- round trip, state -------------------------------------------------------------------------


def test_staged_rows_round_trip_through_the_topic(topics: Topics, sink: KafkaSink) -> None:
    staged = stage(sink, "b1", updates(["a", "b"], 1000), updates(["c"], 1000, offset=2, part=1))
    assert [d["rows"] for d in staged] == [2, 1]
    assert sorted(os.listdir(sink.staging_root)) == ["b1-00000.arrow", "b1-00001.arrow"]
    sink.commit(staged, SinkState(), SinkState(2000, '{"p": 1}'))

    got = sink.read_updates()
    assert got.schema == SCHEMA
    assert keys(got) == ["a", "b", "c"]
    rows = sorted(got.to_pylist(), key=lambda r: r["k"])
    assert [(r["v"], r["_into_time"], r["_diff"], r["_src_part"], r["_src_offset"]) for r in rows] \
        == [(0, 1000, 1, 0, 0), (1, 1000, 1, 0, 1), (2, 1000, 1, 1, 2)]
    assert all(r["_error"] is None and r["_raw_value"] is None for r in rows)
    assert os.listdir(sink.staging_root) == []  # staged files go once committed

    # What any Kafka consumer sees: JSON key and value, batch and output headers.
    recs = read_committed(topics.kafka.bootstrap, topics.topic)
    assert len(recs) == 3
    for m in recs:
        value = json.loads(m.value())
        assert list(value) == ["k", "v", *DATA_META]
        assert json.loads(m.key()) == {"k": value["k"]}
        headers = dict(m.headers())
        assert headers[HEADER_OUTPUT] == NAME.encode()
        assert len(headers[HEADER_BATCH]) == 32
    assert len({dict(m.headers())[HEADER_BATCH] for m in recs}) == 1  # one transaction
    assert read_committed(topics.kafka.bootstrap, topics.errors) == []


def test_state_is_read_back_by_a_new_sink_object(topics: Topics, sink: KafkaSink) -> None:
    assert sink.state() == SinkState()
    s1, s2 = SinkState(1000, '"one"'), SinkState(2000, '"two"')
    sink.commit(stage(sink, "b1", updates(["a"], 500)), SinkState(), s1)
    sink.commit(stage(sink, "b2", updates(["b"], 1500, offset=1)), s1, s2)
    assert sink.state() == s2

    fresh = topics.sink()
    assert fresh.state() == s2
    assert keys(fresh.read_updates()) == ["a", "b"]  # no ensure(): the stored schema
    assert fresh.read_updates().schema == SCHEMA
    assert keys(fresh.read_updates(as_of=1000)) == ["a"]
    # The progress records: partition 0, keyed by the output, naming their batch.
    progress = read_committed(topics.kafka.bootstrap, topics.progress)
    docs = [json.loads(m.value()) for m in progress]
    assert [m.key() for m in progress] == [NAME.encode()] * 2
    assert [d["upper"] for d in docs] == [1000, 2000]
    assert docs[0]["prev"] is None and docs[1]["prev"] == docs[0]["batch"]
    fresh.close()


def test_an_output_never_written_has_the_initial_state(kafka: KafkaCluster, tmp_path: Path) -> None:
    s = KafkaSink(NAME, bootstrap_servers=kafka.bootstrap, topic=f"none-{uuid.uuid4().hex}",
                  staging_dir=tmp_path, timeout_s=5)
    assert s.state() == SinkState()  # the progress topic does not even exist
    assert s.read_updates().num_rows == 0
    s.close()


def test_missing_topics_are_created_and_the_progress_topic_keeps_everything(
    kafka: KafkaCluster, tmp_path: Path
) -> None:
    """Clusters often disable auto-creation: the sink creates the missing data,
    errors and progress topics; the progress topic with one partition and no
    time or size retention."""
    from confluent_kafka.admin import ConfigResource, ResourceType

    topic = f"new-{uuid.uuid4().hex[:10]}"
    s = KafkaSink(NAME, bootstrap_servers=kafka.bootstrap, topic=topic, staging_dir=tmp_path,
                  key_columns=["k"])
    s.ensure(USER)
    s.commit(stage(s, "b1", updates(["a"], 500)), SinkState(), SinkState(1000, None))
    admin = kafka.admin()
    md = admin.list_topics(timeout=10)
    progress = f"{topic}.reclock-progress"
    assert {topic, f"{topic}.reclock-errors", progress} <= set(md.topics)
    assert len(md.topics[progress].partitions) == 1
    res = ConfigResource(ResourceType.TOPIC, progress)
    conf = next(iter(admin.describe_configs([res]).values())).result(timeout=10)
    assert (conf["retention.ms"].value, conf["retention.bytes"].value,
            conf["cleanup.policy"].value) == ("-1", "-1", "delete")
    assert keys(s.read_updates()) == ["a"]
    s.close()


@pytest.mark.parametrize("partitions, config, named", [
    (4, {}, "4 partitions"),
    (1, {"retention.ms": "604800000"}, "retention.ms=604800000"),
    (1, {"retention.ms": "-1", "retention.bytes": "1000000"}, "retention.bytes=1000000"),
    (1, {"retention.ms": "-1", "cleanup.policy": "compact"}, "cleanup.policy=compact"),
])
def test_a_progress_topic_that_could_lose_records_is_refused(
    topics: Topics, partitions: int, config: dict[str, str], named: str
) -> None:
    progress = f"{topics.topic}.p-{uuid.uuid4().hex[:6]}"
    topics.kafka.create_topic(progress, partitions, config=config)
    s = topics.sink(progress_topic=progress)
    with pytest.raises(SinkError, match="could lose the output's state") as err:
        s.ensure(USER)
    assert named in str(err.value) and "retention.ms=-1" in (err.value.hint or "")
    s.close()


def test_a_new_sink_reads_back_past_its_first_window(
    topics: Topics, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With other outputs' records in between, the head is found by widening
    the window from the end of the partition until an anchor is in it."""
    monkeypatch.setattr(kafka_mod, "PROGRESS_WINDOW", 2)
    mine = topics.sink()
    other = KafkaSink("other.main", bootstrap_servers=topics.kafka.bootstrap,
                      topic=topics.topic, staging_dir=topics.staging,
                      progress_topic=topics.progress)
    mine.ensure(USER)
    other.ensure(USER)
    st_mine = SinkState()
    for i in range(2):
        new = SinkState(10 * (i + 1), None)
        mine.commit([], st_mine, new)
        st_mine = new
    st_other = SinkState()
    for i in range(5):
        new = SinkState(i + 1, None)
        other.commit([], st_other, new)
        st_other = new
    assert topics.sink().state() == st_mine
    mine.close()
    other.close()


# -- the chain rule (pure) ---------------------------------------------------------------------


def rec(offset: int, batch: str, prev: str | None) -> ProgressRecord:
    return ProgressRecord(offset, batch, prev, SinkState(offset, None))


def test_chain_first_writer_wins_and_losers_are_ignored() -> None:
    records = [rec(0, "a", None), rec(2, "b", "a"), rec(4, "z", "a"), rec(6, "c", "b"),
               rec(8, "y", None)]
    assert [r.batch for r in resolve_chain(records, complete=True) or []] == ["a", "b", "c"]


def test_chain_from_a_window_starts_at_an_anchor() -> None:
    # The window begins with a loser ("z" lost to "b" for "a"): not an anchor.
    window = [rec(4, "z", "a"), rec(5, "b", "a"), rec(6, "c", "b"), rec(7, "d", "c")]
    assert resolve_chain(window[:1], complete=False) is None  # cannot tell yet
    assert [r.batch for r in resolve_chain(window, complete=False) or []] == ["b", "c", "d"]
    # A loser after the anchor is ignored; ancestors before it are kept.
    window = [rec(1, "a", None), rec(2, "b", "a"), rec(3, "x", "a"), rec(4, "c", "b")]
    assert [r.batch for r in resolve_chain(window, complete=False) or []] == ["a", "b", "c"]


def test_chain_whose_start_expired_trusts_the_oldest_record() -> None:
    assert [r.batch for r in resolve_chain([rec(9, "q", "gone")], complete=True) or []] == ["q"]
    assert resolve_chain([], complete=True) == []


# -- fencing -----------------------------------------------------------------------------------


def test_stale_expected_is_fenced_and_nothing_is_written(topics: Topics, sink: KafkaSink) -> None:
    s1 = SinkState(1000, None)
    sink.commit(stage(sink, "b1", updates(["a"], 500)), SinkState(), s1)
    before = {t: len(read_committed(topics.kafka.bootstrap, t))
              for t in (topics.topic, topics.errors, topics.progress)}
    staged = stage(sink, "b2", updates(["b"], 1500, offset=1))
    with pytest.raises(SinkFenced, match="nothing was written"):
        sink.commit(staged, SinkState(), SinkState(2000, None))
    after = {t: len(read_committed(topics.kafka.bootstrap, t)) for t in before}
    assert after == before
    assert sink.state() == s1
    assert os.listdir(sink.staging_root) == ["b2-00000.arrow"]  # kept for a retry


class RacingSink(KafkaSink):
    """Runs ``race`` once, right after its fence check passed."""

    race: Any = None

    def _step(self, step: str, count: int = 0) -> None:
        if step == "checked" and self.race is not None:
            race, self.race = self.race, None
            race()


def test_a_zombie_with_the_same_transactional_id_is_fenced(topics: Topics) -> None:
    zombie = topics.sink(RacingSink)
    zombie.ensure(USER)
    s1 = SinkState(1000, None)
    zombie.commit(stage(zombie, "b1", updates(["a"], 500)), SinkState(), s1)

    # A new pipeline takes over (same name, so the same transactional.id).
    live = topics.sink()
    live.ensure(USER)
    s2 = SinkState(2000, None)
    live.commit(stage(live, "b2", updates(["b"], 1500, offset=1)), s1, s2)

    # The zombie still believes in s1: fenced before it writes anything.
    with pytest.raises(SinkFenced):
        zombie.commit(stage(zombie, "z1", updates(["zombie1"], 1500, offset=1)), s1,
                      SinkState(2000, None))

    # Worse: the zombie passes its check, then the live writer commits first.
    # The broker fenced the zombie's producer when the live one initialised
    # the same transactional.id: its transaction cannot commit. SinkFenced.
    s3 = SinkState(3000, None)
    zombie.race = lambda: live.commit(stage(live, "b3", updates(["c"], 2500, offset=2)), s2, s3)
    with pytest.raises(SinkFenced):
        zombie.commit(stage(zombie, "z2", updates(["zombie2"], 2500, offset=2)), s2,
                      SinkState(3000, '"zombie"'))
    for reader in (live, topics.sink()):
        assert reader.state() == s3
        assert keys(reader.read_updates()) == ["a", "b", "c"]
    # A plain read_committed consumer sees each committed row once, and none
    # of the zombie's: Kafka fenced it.
    seen = [json.loads(m.value())["k"]
            for m in read_committed(topics.kafka.bootstrap, topics.topic)]
    assert sorted(seen) == ["a", "b", "c"]
    zombie.close()
    live.close()


# -- crashes -----------------------------------------------------------------------------------


class CrashingSink(KafkaSink):
    """SIGKILLs its process at ``crash_at`` (``(step, count)``), after making
    sure what it produced so far reached the broker."""

    crash_at: tuple[str, int] = ("", 0)

    def _step(self, step: str, count: int = 0) -> None:
        if (step, count) == self.crash_at:
            self._producer.flush(10)
            os.kill(os.getpid(), signal.SIGKILL)


def crash_commit(bootstrap: str, topic: str, staging: str, staged: list[dict[str, Any]],
                 expected: SinkState, new: SinkState, crash_at: tuple[str, int]) -> None:
    """Child process: commit ``staged`` with a sink that dies at ``crash_at``."""
    s = CrashingSink(NAME, bootstrap_servers=bootstrap, topic=topic, staging_dir=staging,
                     key_columns=["k"])
    s.crash_at = crash_at
    s.ensure(USER)
    s.commit(staged, expected, new)


def run_crashing_commit(topics: Topics, staged: list[dict[str, Any]], expected: SinkState,
                        new: SinkState, crash_at: tuple[str, int]) -> None:
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=crash_commit, args=(
        topics.kafka.bootstrap, topics.topic, str(topics.staging), staged, expected, new,
        crash_at))
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL


def test_crash_mid_transaction_then_a_retry_writes_each_row_once(
    topics: Topics, sink: KafkaSink
) -> None:
    s1 = SinkState(1000, '"one"')
    sink.commit(stage(sink, "b1", updates(["a"], 500)), SinkState(), s1)
    staged = stage(sink, "b2", updates([f"r{i}" for i in range(10)], 1500, offset=1))
    s2 = SinkState(2000, '"two"')
    run_crashing_commit(topics, staged, s1, s2, ("produced", 5))  # half the rows, no commit

    after = topics.sink()
    assert after.state() == s1
    assert keys(after.read_updates()) == ["a"]
    # Kafka hides the dead transaction's records from read_committed consumers.
    plain = [json.loads(m.value())["k"]
             for m in read_committed(topics.kafka.bootstrap, topics.topic)]
    assert plain == ["a"]

    after.ensure(USER)
    after.commit(staged, s1, s2)  # the driver's retry: the same staged files
    assert after.state() == s2
    got = after.read_updates()
    assert keys(got) == ["a", *sorted(f"r{i}" for i in range(10))]  # each row once
    assert topics.sink().state() == s2
    after.close()


def test_crash_after_the_progress_record_is_all_or_nothing(
    topics: Topics, sink: KafkaSink
) -> None:
    staged = stage(sink, "b1", updates(["a", "b", "c"], 500))
    s1 = SinkState(1000, '"one"')
    run_crashing_commit(topics, staged, SinkState(), s1, ("progress_produced", 0))
    after = topics.sink()
    # Kafka aborts the transaction: nothing committed, no rows for anyone.
    assert after.state() == SinkState()
    assert after.read_updates().num_rows == 0
    assert read_committed(topics.kafka.bootstrap, topics.topic) == []
    after.ensure(USER)
    after.commit(staged, SinkState(), s1)  # the driver's retry
    assert after.state() == s1 and keys(after.read_updates()) == ["a", "b", "c"]
    plain = [json.loads(m.value())["k"]
             for m in read_committed(topics.kafka.bootstrap, topics.topic)]
    assert sorted(plain) == ["a", "b", "c"]
    after.close()


# -- errors ------------------------------------------------------------------------------------


def test_error_rows_go_to_the_errors_topic(topics: Topics, sink: KafkaSink) -> None:
    good = updates(["a", "b"], 500)
    bad = updates([None, None], 500, offset=2, error="bad json: line 1")
    bad = bad.set_column(bad.schema.get_field_index("_raw_key"), "_raw_key",
                         pa.array([b"k1", None], pa.binary()))
    staged = stage(sink, "b1", good, bad)
    assert [(d["rows"], d["errors"]) for d in staged] == [(2, 0), (0, 2)]
    sink.commit(staged, SinkState(), SinkState(1000, None))

    data = read_committed(topics.kafka.bootstrap, topics.topic)
    assert sorted(json.loads(m.value())["k"] for m in data) == ["a", "b"]
    errors = read_committed(topics.kafka.bootstrap, topics.errors)
    assert len(errors) == 2
    docs = sorted((json.loads(m.value()) for m in errors), key=lambda d: d["_src_offset"])
    assert [d["_error"] for d in docs] == ["bad json: line 1"] * 2
    assert docs[0]["_raw_value"] == "cmF3"  # base64 of b"raw"
    assert sorted(m.key() or b"" for m in errors) == [b"", b"k1"]
    assert {dict(m.headers())[HEADER_BATCH] for m in errors} == \
        {dict(m.headers())[HEADER_BATCH] for m in data}  # the same transaction

    got = sink.read_updates()
    errs = got.filter(got.column("_error").is_valid()).to_pylist()
    assert sorted(r["_src_offset"] for r in errs) == [2, 3]
    assert {r["_raw_value"] for r in errs} == {b"raw"}
    assert sorted(r["_raw_key"] or b"" for r in errs) == [b"", b"k1"]
    assert got.num_rows == 4


def test_broker_down_during_commit_is_transient_and_commits_nothing(topics: Topics) -> None:
    fast = {"message.timeout.ms": 1000, "transaction.timeout.ms": 2000,
            "socket.timeout.ms": 1000, "reconnect.backoff.max.ms": 200}
    s = topics.sink(RacingSink, properties=fast, timeout_s=2.0)
    s.ensure(USER)
    s1 = SinkState(1000, None)
    s.commit(stage(s, "b1", updates(["a"], 500)), SinkState(), s1)
    staged = stage(s, "b2", updates(["b", "c"], 1500, offset=1))
    s2 = SinkState(2000, None)
    s.race = topics.kafka.broker_down  # after the fence check, before producing
    try:
        t0 = time.monotonic()
        with pytest.raises(TransientError) as info:
            s.commit(staged, s1, s2)
        assert not isinstance(info.value, SinkFenced | DefiniteError)
        assert NAME in str(info.value)
        assert time.monotonic() - t0 < 15
        with pytest.raises(TransientError):
            s.state()  # still down: the state cannot be read either
    finally:
        topics.kafka.broker_up()
    assert s.state() == s1
    assert keys(s.read_updates()) == ["a"]
    s.commit(staged, s1, s2)  # the retry, on a fresh producer
    assert keys(topics.sink().read_updates()) == ["a", "b", "c"]
    s.close()


def test_settings_and_schemas_are_checked(topics: Topics, sink: KafkaSink) -> None:
    with pytest.raises(SinkError, match="key columns"):
        topics.sink(key_columns=["nope"]).ensure(USER)
    with pytest.raises(SinkError, match="format"):
        topics.sink(format="avro")
    with pytest.raises(DefiniteError, match="_diff"):
        topics.sink().ensure(pa.schema([("_diff", pa.int64())]))
    sink.commit(stage(sink, "b1", updates(["a"], 500)), SinkState(), SinkState(1000, None))
    with pytest.raises(SinkError, match="'v'"):
        topics.sink().ensure(pa.schema([("k", pa.string()), ("v", pa.string())]))
    wider = pa.schema([("k", pa.string()), ("v", pa.int64()), ("w", pa.float64())])
    topics.sink().ensure(wider)  # added columns are fine
    with pytest.raises(SinkError, match="schema unknown"):
        KafkaSink("x", bootstrap_servers=topics.kafka.bootstrap, topic=topics.topic,
                  staging_dir=topics.staging).stager()


def test_secrets_stay_out_of_reprs_and_messages(topics: Topics) -> None:
    s = topics.sink(properties={"sasl.password": "hunter2", "sasl.username": "u",
                                "no.such.property": "hunter2"})
    assert "hunter2" not in repr(s)
    with pytest.raises(SinkError) as info:
        s.commit([], SinkState(), SinkState(1, None))
    assert "hunter2" not in str(info.value)
    assert "no.such.property" in str(info.value)
    # librdkafka quotes an invalid value: shown when the property is not one
    # librdkafka marks sensitive (it is what to fix), never a secret's
    s = topics.sink(properties={"security.protocol": "plaintxt", "sasl.password": "hunter2"})
    with pytest.raises(SinkError) as info:
        s.commit([], SinkState(), SinkState(1, None))
    assert "hunter2" not in str(info.value) and "hunter2" not in repr(s)
    assert 'Invalid value "plaintxt" for configuration property "security.protocol"' in (
        str(info.value))


# -- staging, encoding -------------------------------------------------------------------------


def test_the_stager_is_picklable_and_restaging_replaces(sink: KafkaSink) -> None:
    st = pickle.loads(pickle.dumps(sink.stager()))
    assert isinstance(st, KafkaStager)
    first = st.stage("b1", 3, updates(["a", "b", "c"], 500))
    again = st.stage("b1", 3, updates(["a"], 500))
    assert first[0]["path"] == again[0]["path"] == "b1-00003.arrow"
    assert again[0]["rows"] == 1
    assert st.stage("b1", 4, updates([], 500)) == []
    with pytest.raises(ValueError, match="batch id"):
        st.stage("../x", 0, updates(["a"], 500))
    sink.commit(again, SinkState(), SinkState(1000, None))
    assert keys(sink.read_updates()) == ["a"]
    with pytest.raises(SinkError, match="gone"):  # committed files are deleted
        sink.commit(again, SinkState(1000, None), SinkState(2000, None))


def test_values_of_every_type_round_trip_exactly(topics: Topics) -> None:
    user = pa.schema([
        ("k", pa.string()), ("f", pa.float64()), ("ts", pa.timestamp("ns", tz="UTC")),
        ("d", pa.date32()), ("t", pa.time64("us")), ("dur", pa.duration("ms")),
        ("dec", pa.decimal128(12, 3)), ("bin", pa.binary()), ("b", pa.bool_()),
        ("l", pa.list_(pa.timestamp("us"))), ("s", pa.struct([("x", pa.int32()),
                                                               ("y", pa.binary())])),
        ("m", pa.map_(pa.string(), pa.float32())), ("dict", pa.dictionary(pa.int8(), pa.string())),
    ])
    ts = pa.array([1_700_000_000_123_456_789, None], pa.timestamp("ns", tz="UTC"))
    user_cols = {
        "k": ["a", "b"], "f": [math.inf, math.nan], "ts": ts,
        "d": pa.array([dt.date(2024, 2, 29), None]), "t": pa.array([dt.time(1, 2, 3, 4), None]),
        "dur": pa.array([dt.timedelta(milliseconds=5), None], pa.duration("ms")),
        "dec": pa.array([decimal.Decimal("-12.345"), None], pa.decimal128(12, 3)),
        "bin": [b"\x00\xff", None], "b": [True, None],
        "l": pa.array([[dt.datetime(2020, 1, 1, 0, 0, 0, 1)], []], pa.list_(pa.timestamp("us"))),
        "s": pa.array([{"x": 1, "y": b"\x01"}, None], user.field("s").type),
        "m": pa.array([[("p", -math.inf)], None], user.field("m").type),
        "dict": pa.array(["u", "v"]).dictionary_encode().cast(user.field("dict").type),
    }
    table = updates(["a", "b"], 500)
    schema = output_schema(user)
    cols = {n: user_cols[n] for n in user.names} | {
        n: table.column(n) for n in schema.names if n not in user.names}
    rows = pa.table(cols).cast(schema)
    s = topics.sink()
    s.ensure(user)
    s.commit(stage(s, "b1", rows), SinkState(), SinkState(1000, None))
    got = topics.sink().read_updates().sort_by("k")  # the stored schema, no ensure
    assert got.schema == schema
    for name in user.names:
        if name == "ts":  # nanoseconds survive (Python's datetime would drop them)
            assert got.column(name).cast(pa.int64()).to_pylist() == \
                [1_700_000_000_123_456_789, None]
            continue
        want, have = rows.column(name).to_pylist(), got.column(name).to_pylist()
        if name == "f":
            assert have[0] == math.inf and math.isnan(have[1])
        else:
            assert have == want, name
    s.close()


def test_vacuum_removes_only_old_staged_files(topics: Topics, sink: KafkaSink) -> None:
    now = ManualClock(int(time.time() * 1000))
    s = topics.sink(clock=now)
    s.ensure(USER)
    stage(s, "old", updates(["a"], 500))
    assert s.vacuum_orphans(grace_seconds=60) == []
    now.advance(120_000)
    assert s.vacuum_orphans(grace_seconds=60) == ["old-00000.arrow"]
    assert os.listdir(s.staging_root) == []


# -- the broker's transactions ----------------------------------------------------------------


def test_read_committed_consumers_see_no_open_or_aborted_transaction(
    kafka: KafkaCluster,
) -> None:
    """What the chain in sinks/kafka.py need not work around on Apache Kafka:
    a read_committed consumer sees neither an open transaction's records nor
    an aborted one's; commit and abort markers take offsets."""
    topic = f"abort-{uuid.uuid4().hex[:10]}"
    kafka.create_topic(topic, 1)
    p = Producer({"bootstrap.servers": kafka.bootstrap, "transactional.id": f"t-{topic}"})
    p.init_transactions(10)
    p.begin_transaction()
    p.produce(topic, b"open", partition=0)
    p.flush(10)
    assert read_committed(kafka.bootstrap, topic) == []
    p.abort_transaction(10)
    p.begin_transaction()
    p.produce(topic, b"committed", partition=0)
    p.commit_transaction(10)
    got = read_committed(kafka.bootstrap, topic)
    assert [(m.value(), m.offset()) for m in got] == [(b"committed", 2)]  # 1: abort marker


def test_a_record_larger_than_the_producer_allows_is_an_error_row(topics: Topics) -> None:
    """Bad input is data: a record over message.max.bytes lands in the errors
    topic with the reason and its position (its content cut), and the rest of
    the batch lands (before: the whole batch was refused, for ever)."""
    s = topics.sink(properties={"message.max.bytes": 20_000})
    s.ensure(USER)
    rows = updates(["a", "b" * 50_000, "c"], 500)
    staged = stage(s, "b1", rows)
    assert [(d["rows"], d["errors"]) for d in staged] == [(2, 1)]
    s.commit(staged, SinkState(), SinkState(1000, None))
    got = s.read_updates()
    good = got.filter(pc.is_null(got.column("_error")))
    assert sorted(good.column("k").to_pylist()) == ["a", "c"]
    err = got.filter(pc.invert(pc.is_null(got.column("_error")))).to_pylist()
    assert [e["_src_offset"] for e in err] == [1]
    assert "message.max.bytes" in err[0]["_error"]
    assert err[0]["_raw_value"].startswith(b'{"k": "bbb')
    s.close()


def test_a_data_topic_thinned_behind_the_sinks_back_is_refused_loudly(
    topics: Topics, sink: KafkaSink
) -> None:
    """Issue: the Kafka sink rebuilt an upsert output's key state from its
    whole data topic, which retention, compaction or delete-records may have
    thinned, and then carried on with a partial state. Now reading the update
    log checks every committed batch's records against its progress record,
    and a thinned topic is a definite error naming the topic and the fix."""
    s1, s2 = SinkState(1000, '"one"'), SinkState(2000, '"two"')
    sink.commit(stage(sink, "b1", updates(["a", "b"], 500)), SinkState(), s1)
    sink.commit(stage(sink, "b2", updates(["c"], 1500, offset=2)), s1, s2)
    assert keys(sink.read_updates()) == ["a", "b", "c"]
    held = {m.partition(): m.offset() for m in read_committed(topics.kafka.bootstrap, topics.topic)}
    part = min(held)
    topics.kafka.delete_records(topics.topic, part, held[part] + 1)  # retention took a record
    fresh = topics.sink()
    try:
        with pytest.raises(SinkError, match="records were removed behind reclock's back") as e:
            fresh.read_updates()
        assert topics.topic in str(e.value) and "retention.ms=-1" in (e.value.hint or "")
    finally:
        fresh.close()
