"""Delta state tables (``mode: state``) on S3 (moto's server, see
tests/s3server.py): each log entry is created only if absent by reclock's
own conditional PUT, the key index is a local file, the data, deletion
vector and errors-table files go to the bucket. Each test compares the
table with the independent model of tests/sinks/test_delta_state.py (a
dict of each key's current row)."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest

import reclock.sinks.delta as delta_mod
from reclock.contracts.sink import SinkFenced, SinkState
from reclock.sinks._store import S3Access
from reclock.sinks.delta import DeltaSink, read_current
from reclock.sinks.delta_state import INDEX_NAME
from tests.peers import duckdb_s3
from tests.s3server import KEY_ID, REGION, SECRET
from tests.sinks.test_delta_state import (
    NAME,
    USER,
    Model,
    commit,
    current,
    killed_second_commit,
    updates,
)

pytestmark = pytest.mark.integration


def _sink(s3: Any, uri: str, index: Path) -> DeltaSink:
    sink = DeltaSink(NAME, uri, storage=S3Access.resolve(env=s3.env()), mode="state",
                     key=["k"], index_dir=index)
    sink.ensure(USER)
    return sink


def test_state_commits_on_s3_equal_the_model_and_fence_a_second_writer(
        s3: Any, tmp_path: Path) -> None:
    uri = f"s3://{s3.bucket()}/lake/st"
    sink = _sink(s3, uri, tmp_path / "a")
    model, rnd, st = Model(), random.Random(17), SinkState()
    for c in range(5):
        rows = model.step(rnd, c + 1, 40)
        st = commit(sink, updates(rows, errors=1 if c == 2 else 0), st, c + 2)
        assert current(read_current(sink.location)) == model.expected()
    bucket = uri[5:].split("/")[0]
    keys = s3.keys(bucket, "lake/st/")
    assert any("/deletion_vector_" in k for k in keys), keys
    assert any(k.startswith("lake/st/_errors/_delta_log/") for k in keys), keys
    assert (tmp_path / "a" / INDEX_NAME).exists()  # the key index: local
    got = sink.read_updates()
    assert got.filter(pc.is_valid(got.column("_error"))).column("k").to_pylist() == [10**9]
    duck = duckdb_s3(s3.endpoint, KEY_ID, SECRET, REGION)
    assert sorted(duck.execute(f"SELECT k, v, n, _into_time FROM delta_scan('{uri}')")
                  .fetchall()) == model.expected()
    # a second writer with its own (empty) key index: it rebuilds it from the
    # bucket and commits on top; the first one is then fenced, writing nothing
    other = _sink(s3, uri, tmp_path / "b")
    assert other.state() == st
    rows = model.step(rnd, 10, 40)
    st2 = commit(other, updates(rows), st, 11)
    assert current(read_current(other.location)) == model.expected()
    log = sorted(k for k in s3.keys(bucket, "lake/st/_delta_log/"))
    with pytest.raises(SinkFenced):
        commit(sink, updates(model.step(random.Random(1), 10, 5)), st, 11)
    assert sorted(s3.keys(bucket, "lake/st/_delta_log/")) == log
    assert sink.state() == other.state() == st2


def test_racing_state_committers_on_s3_one_wins(s3: Any, tmp_path: Path) -> None:
    """Two writers of one version: S3's conditional PUT lets one entry in
    (412 for the other, which reloads, sees another state and is fenced)."""
    uri = f"s3://{s3.bucket()}/lake/race"
    _sink(s3, uri, tmp_path / "x")
    barrier = threading.Barrier(3)
    results: dict[int, str] = {}

    def race(i: int) -> None:
        s = _sink(s3, uri, tmp_path / f"w{i}")
        staged = s.stager().stage(f"r{i}", 0, updates([(i, f"w{i}", None, 1, 1)]))
        barrier.wait()
        try:
            s.commit(staged, SinkState(), SinkState(2, f'"{i}"'))
            results[i] = "ok"
        except SinkFenced:
            results[i] = "fenced"

    threads = [threading.Thread(target=race, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results.values()) == ["fenced", "fenced", "ok"], results
    (winner,) = [i for i, r in results.items() if r == "ok"]
    assert current(read_current(_sink(s3, uri, tmp_path / "y").location)) == [
        (winner, f"w{winner}", None, 1)]


@pytest.mark.parametrize("point", ["state_before_log", "state_logged"])
def test_a_crash_around_the_log_entry_on_s3_loses_and_doubles_nothing(
        s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    """Killed before the conditional PUT: nothing happened; after it, before
    the local key index committed: the commit happened, and the restarted
    writer rebuilds its stale index from the bucket."""
    uri = f"s3://{s3.bucket()}/lake/crash"
    sink = _sink(s3, uri, tmp_path / "i")
    model, rnd = Model(), random.Random(23)
    st, before, rows = killed_second_commit(sink, model, rnd, point, monkeypatch)
    fresh = _sink(s3, uri, tmp_path / "i")  # the restarted driver, same index file
    landed = fresh.state()
    if point == "state_before_log":
        assert landed == st and current(read_current(fresh.location)) == before
        landed = commit(fresh, updates(rows), st, 3)
    assert landed == SinkState(3, '"3"')
    assert current(read_current(fresh.location)) == model.expected()
    commit(fresh, updates(model.step(rnd, 3, 30)), landed, 4)
    assert current(read_current(fresh.location)) == model.expected()


def test_compaction_checkpoints_and_vacuums_keep_an_s3_state_table(
        s3: Any, tmp_path: Path) -> None:
    uri = f"s3://{s3.bucket()}/lake/cmp"
    bucket = uri[5:].split("/")[0]
    sink = DeltaSink(NAME, uri, storage=S3Access.resolve(env=s3.env()), mode="state",
                     key=["k"], index_dir=tmp_path / "i",
                     compaction=delta_mod.Compaction(in_child=False))
    sink.ensure(USER)
    model, rnd, st = Model(), random.Random(29), SinkState()
    for c in range(27):  # past a checkpoint (every 25 versions)
        st = commit(sink, updates(model.step(rnd, c + 1, 30)), st, c + 2)
    assert "lake/cmp/_delta_log/_last_checkpoint" in s3.keys(bucket, "lake/cmp/_delta_log/")
    assert sink.compact(min_files=5)["files_removed"] >= 5
    assert sink.state() == st
    assert current(read_current(sink.location)) == model.expected()
    st = commit(sink, updates(model.step(rnd, 40, 30)), st, 41)
    sink._checkpoint()
    dvs = {k for k in s3.keys(bucket, "lake/cmp/") if "/deletion_vector_" in k}
    assert any(p.startswith("deletion_vector_") for p in sink.expire_removed(0))
    assert {k for k in s3.keys(bucket, "lake/cmp/") if "/deletion_vector_" in k} < dvs
    sink.vacuum_orphans(0)
    assert sink.state() == st
    assert current(read_current(sink.location)) == model.expected()
    duck = duckdb_s3(s3.endpoint, KEY_ID, SECRET, REGION)
    assert sorted(duck.execute(f"SELECT k, v, n, _into_time FROM delta_scan('{uri}')")
                  .fetchall()) == model.expected()
    # a writer with no key index rebuilds it from the bucket's checkpoint and log
    fresh = _sink(s3, uri, tmp_path / "new")
    st = commit(fresh, updates(model.step(rnd, 50, 30)), st, 51)
    assert current(read_current(fresh.location)) == model.expected()


def test_a_pipelines_s3_state_output_keeps_its_key_index_in_the_state_dir(
        s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from reclock.contracts.sink import SinkContext
    from reclock.sinks.delta import FileSinkConfig

    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    uri = f"s3://{s3.bucket()}/lake/cfg"
    cfg = FileSinkConfig.model_validate({"type": "delta", "path": uri, "mode": "state",
                                         "key": ["k"]})
    sink = cfg.build(SinkContext(source="c", output="b", state_dir=tmp_path, identity="t"))
    sink.ensure(USER)
    model, rnd = Model(), random.Random(31)
    commit(sink, updates(model.step(rnd, 1, 20)), SinkState(), 2)
    assert (tmp_path / "outputs" / "c" / "b" / INDEX_NAME).exists()
    assert current(read_current(sink.location)) == model.expected()
