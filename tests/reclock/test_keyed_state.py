"""Key state derived from an output (the upsert envelope) changes only when
the commit carrying its updates succeeds, and can be rebuilt from any value
the output holds (lists, maps, NaN).

The expected outputs come from a separate model of the input: the latest
value per key of the records the test produced, computed here by a dict.
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from confluent_kafka import Producer

from reclock import faults
from reclock.config import load_config
from reclock.pipeline import Pipeline
from reclock.runtime.upsert_state import UpsertState
from reclock.verify import verify_pipeline
from tests.running import kafka_upsert_source, running, wait_for


def _meta(n: int, diff: list[int], t0: int = 10) -> dict[str, pa.Array]:
    return {
        "_into_time": pa.array([t0] * n, pa.int64()), "_diff": pa.array(diff, pa.int64()),
        "_src_part": pa.array([0] * n, pa.int32()), "_src_offset": pa.array(range(n), pa.int64()),
        "_src_seq": pa.array([0] * n, pa.int64()), "_src_ts": pa.array([None] * n, pa.int64()),
        "_error": pa.array([None] * n, pa.string()), "_raw_key": pa.array([None] * n, pa.binary()),
        "_raw_value": pa.array([None] * n, pa.binary()),
    }


def _intents(schema: pa.Schema, rows: list[dict[str, Any] | tuple[int, None]]) -> pa.Table:
    """Rows of ``schema``: a dict is a value, ``(k, None)`` a tombstone for key k."""
    user = [f.name for f in schema if not f.name.startswith("_")]
    cols: dict[str, list[Any]] = {c: [] for c in user}
    diffs = []
    for r in rows:
        if isinstance(r, tuple):
            for c in user:
                cols[c].append(r[0] if c == "k" else None)
            diffs.append(0)
        else:
            for c in user:
                cols[c].append(r.get(c))
            diffs.append(1)
    arrays = {c: pa.array(cols[c], schema.field(c).type) for c in user}
    meta = _meta(len(rows), diffs)
    return pa.table({n: arrays[n] if n in arrays else meta[n] for n in schema.names},
                    schema=schema)


SCHEMA = pa.schema([
    ("k", pa.int64()), ("tags", pa.list_(pa.string())), ("attrs", pa.map_(pa.string(), pa.int64())),
    ("x", pa.float64()),
    ("_into_time", pa.int64()), ("_diff", pa.int64()), ("_src_part", pa.int32()),
    ("_src_offset", pa.int64()), ("_src_seq", pa.int64()), ("_src_ts", pa.int64()),
    ("_error", pa.string()), ("_raw_key", pa.binary()), ("_raw_value", pa.binary()),
])


def test_apply_does_not_touch_the_state_until_accepted() -> None:
    st = UpsertState(["k", "tags", "attrs", "x"], ("k",))
    first, pending = st.apply(_intents(SCHEMA, [{"k": 1, "x": 1.0}, {"k": 2, "x": 2.0}]), SCHEMA)
    assert first.num_rows == 2 and st.rows == {}  # a failed commit would leave it so
    again, pending = st.apply(_intents(SCHEMA, [{"k": 1, "x": 1.0}, {"k": 2, "x": 2.0}]), SCHEMA)
    assert again.num_rows == 2  # the retry emits the same updates, nothing is lost
    st.accept(pending)
    assert sorted(st.rows) == [(1,), (2,)]
    upd, pending = st.apply(_intents(SCHEMA, [(1, None), {"k": 3, "x": 3.0}]), SCHEMA)
    assert sorted(upd.column("_diff").to_pylist()) == [-1, 1] and sorted(st.rows) == [(1,), (2,)]
    st.accept(pending)
    assert sorted(st.rows) == [(2,), (3,)]


def test_state_rebuilds_from_lists_maps_and_nan() -> None:
    """Values that Python cannot hash (lists, maps) or that never equal
    themselves (NaN) still cancel: insert, retract, re-insert."""
    st = UpsertState(["k", "tags", "attrs", "x"], ("k",))
    log = []
    for rows in ([{"k": 1, "tags": ["a", "b"], "attrs": [("z", 1)], "x": math.nan},
                  {"k": 2, "tags": [], "attrs": [], "x": 0.5}],
                 [{"k": 1, "tags": ["a"], "attrs": [("z", 2)], "x": math.nan}],
                 [{"k": 1, "tags": ["a"], "attrs": [("z", 2)], "x": math.nan}],  # unchanged
                 [(2, None), {"k": 3, "tags": None, "attrs": None, "x": math.nan}]):
        upd, pending = st.apply(_intents(SCHEMA, rows), SCHEMA)
        st.accept(pending)
        log.append(upd)
    assert log[2].num_rows == 0  # NaN equals NaN here: an unchanged value emits nothing
    rebuilt = UpsertState.rebuild(pa.concat_tables(log), ["k", "tags", "attrs", "x"], ("k",))
    assert sorted(rebuilt.rows) == [(1,), (3,)]
    assert rebuilt.rows[(1,)][1] == ["a"] and math.isnan(rebuilt.rows[(3,)][3])


def upsert_pipeline(tmp_path: Path, bootstrap: str, topic: str) -> Path:
    """A pipeline file: the topic's JSON records, keyed by ``id``, upserted into Delta."""
    path = tmp_path / "p.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
sources:
{kafka_upsert_source("up", bootstrap, topic)}""")
    return path


def _produce(bootstrap: str, topic: str, recs: list[tuple[int, dict[str, Any] | None]]) -> None:
    p = Producer({"bootstrap.servers": bootstrap})
    for k, v in recs:
        p.produce(topic, key=json.dumps({"id": k}).encode(),
                  value=None if v is None else json.dumps(v).encode(), partition=0)
    assert p.flush(30) == 0


@pytest.mark.parametrize("point", ["stage", "commit"])
def test_a_failed_stage_or_commit_loses_no_key(
    tmp_path: Path, spark: Any, kafka: Any, point: str
) -> None:
    """Issue: an upsert batch whose staging failed once was lost for good (the
    key state had moved on, so the retry emitted nothing) while verify said
    ok. Now the retry lands every key."""
    from reclock.contracts.consolidate import consolidate

    topic = f"up-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 1)
    path = upsert_pipeline(tmp_path, kafka.bootstrap, topic)
    records: list[tuple[int, dict[str, Any] | None]] = [(k, {"body": f"v{k}"}) for k in range(5)]
    _produce(kafka.bootstrap, topic, records)
    cfg = load_config(path)
    faults.arm(point)  # fails once, at the first batch's stage or commit
    try:
        with running(cfg, spark) as runners:
            r = runners[0]
            wait_for(lambda: durable(r) == {0: 5}, 90,
                     lambda: f"the first batch durable: {durable(r)}, {r.health}")
            more: list[tuple[int, dict[str, Any] | None]] = [(1, None), (2, {"body": "w2"})]
            _produce(kafka.bootstrap, topic, more)
            records += more
            wait_for(lambda: durable(r) == {0: 7}, 60,
                     lambda: f"the second batch durable: {durable(r)}, {r.health}")
    finally:
        faults.disarm()
    model: dict[int, str] = {}
    for k, v in records:  # the model: latest value per key
        if v is None:
            model.pop(k, None)
        else:
            model[k] = v["body"]
    pipe = Pipeline(cfg)
    table = pipe.sink(pipe.source_config("up"), cfg.sources[0].outputs[0]).read_updates()
    now = consolidate(table, None, ["id", "body"]).to_pylist()
    assert sorted((s["id"], s["body"]) for s in now) == sorted(model.items())
    assert all(s["_count"] == 1 for s in now)
    reports = verify_pipeline(cfg)
    assert all(rep.ok for rep in reports), [(o.breaches, o.samples) for o in reports[0].outputs]


def durable(r: Any) -> dict[int, int]:
    from reclock.core.frontier import Antichain
    from reclock.core.time import kafka_offsets

    p = r.outputs[0].state.progress
    return {} if p is None else kafka_offsets(Antichain.decode_json("kafka", p))[0]


def test_verify_replays_an_upsert_output_and_names_a_deleted_key(
    tmp_path: Path, spark: Any, kafka: Any
) -> None:
    """verify re-reads the source, puts its records through the envelope from
    a fresh key state and compares key by key, as of every IntoTime: a row
    deleted from the Delta table behind reclock's back makes `reclock
    verify` exit 1 naming the key (and its record's position as missing)."""
    import subprocess
    import sys

    from deltalake import DeltaTable

    topic = f"vk-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 2)
    path = upsert_pipeline(tmp_path, kafka.bootstrap, topic)
    p = Producer({"bootstrap.servers": kafka.bootstrap})
    for k, v in [(1, "a"), (2, "b"), (3, "c"), (1, "a2"), (2, None), (4, "d")]:
        p.produce(topic, key=json.dumps({"id": k}).encode(), partition=k % 2,
                  value=None if v is None else json.dumps({"body": v}).encode())
    assert p.flush(30) == 0
    cfg = load_config(path)
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: sum(durable(r).values()) == 6, 90, lambda: str(r.health))
    reports = verify_pipeline(cfg)
    assert all(rep.ok for rep in reports), [(o.breaches, o.samples) for o in reports[0].outputs]
    table = str(cfg.sources[0].outputs[0].sink.path)  # type: ignore[union-attr]
    DeltaTable(table).delete("id = 3 AND _diff = 1")  # behind reclock's back
    out = subprocess.run([sys.executable, "-m", "reclock.cli", "verify", str(path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "keyed-history=1" in out.stdout and "missing=1" in out.stdout, out.stdout
    assert "key {'id': 3}: missing as of " in out.stdout, out.stdout


@pytest.mark.parametrize("sink", ["pgstate", "kafka"])
def test_a_value_the_sink_refuses_leaves_the_key_as_it_was(
    tmp_path: Path, spark: Any, kafka: Any, request: Any, sink: str
) -> None:
    """Issue: a row a keyed output's sink cannot store (a NUL for PostgreSQL,
    a record over the producer's message.max.bytes for Kafka) was refused in
    the driver's stage after the key state had taken it, so the state and the
    output parted ways. Now the task screens upsert intents with the sink's
    own rules: the refused value is an error row with its position, the key
    keeps its previous row, and later updates of the key land."""
    from reclock.contracts.consolidate import consolidate

    topic = f"rf-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 1)
    if sink == "pgstate":
        pg_url = request.getfixturevalue("pg_url")
        target = f'{{type: postgres, dsn: "{pg_url}", table: rf, mode: state, key: [id]}}'
        bad = "b\x00ad"
    else:
        target = (f'{{type: kafka, bootstrap_servers: "{kafka.bootstrap}", topic: {topic}-out, '
                  "properties: {message.max.bytes: 20000}}")
        bad = "x" * 30_000
    path = upsert_pipeline(tmp_path, kafka.bootstrap, topic)
    path.write_text(path.read_text().replace("sink: file", f"sink: {target}"))
    records: list[tuple[int, dict[str, Any] | None]] = [
        (1, {"body": "a"}), (2, {"body": "b"}), (1, {"body": bad}), (3, {"body": bad})]
    _produce(kafka.bootstrap, topic, records)
    cfg = load_config(path)
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: durable(r) == {0: 4}, 90, lambda: f"{durable(r)}, {r.health}")
        _produce(kafka.bootstrap, topic, [(1, {"body": "a2"}), (2, None)])
        wait_for(lambda: durable(r) == {0: 6}, 60, lambda: f"{durable(r)}, {r.health}")
        assert r.health.status == "running"
    pipe = Pipeline(cfg)
    try:
        table = pipe.sink(pipe.source_config("up"), cfg.sources[0].outputs[0]).read_updates()
    finally:
        pipe.close()
    errs = table.filter(pa.compute.invert(pa.compute.is_null(table.column("_error"))))
    assert sorted(errs.column("_src_offset").to_pylist()) == [2, 3]
    reason = "NUL character" if sink == "pgstate" else "message.max.bytes"
    assert all(reason in e for e in errs.column("_error").to_pylist())
    ok = table.filter(pa.compute.is_null(table.column("_error")))
    now = consolidate(ok, None, ["id", "body"]).to_pylist()
    # key 1: a, then refused, then a2; key 2 deleted; key 3 never held a value
    assert sorted((s["id"], s["body"], s["_count"]) for s in now) == [(1, "a2", 1)]
