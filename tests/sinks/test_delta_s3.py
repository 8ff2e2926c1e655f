"""The Delta sink on object storage (a local S3 endpoint: moto's server):
what is its own beyond the sink contract (tests/sinks/test_contract.py runs
the contract on S3 too) -- configuration, secrets, errors, the fence between
racing committers, orphans, and a commit whose answer is lost."""

from __future__ import annotations

import threading
import uuid
from contextlib import suppress
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from reclock.config import ConfigError, load_config
from reclock.contracts.config import redacted_dump
from reclock.contracts.sink import SinkError, SinkFenced, SinkState
from reclock.core.clock import ManualClock
from reclock.core.errors import TransientError
from reclock.sinks._store import Location, S3Access, split_uri
from reclock.sinks.delta import DeltaSink
from tests.s3server import SECRET, CommitTrap
from tests.sinks.rows import USER, updates

pytestmark = pytest.mark.integration

NAME = "orders.main"


def open_sink(s3: Any, bucket: str | None = None, endpoint: str | None = None,
              **kw: Any) -> DeltaSink:
    uri = f"s3://{bucket or s3.bucket()}/lake/{uuid.uuid4().hex[:6]}"
    return DeltaSink(NAME, uri, storage=S3Access.resolve(env=s3.env(endpoint)), **kw)


def keys_of(sink: DeltaSink) -> list[str]:
    t = sink.read_updates()
    return sorted(t.filter(pa.compute.is_null(t.column("_error"))).column("k").to_pylist())


# -- configuration ----------------------------------------------------------------------


@pytest.mark.parametrize(("path", "words"), [
    ("gs://bucket/out", "unsupported URI scheme 'gs'"),
    ("hdfs://nn/out", "unsupported URI scheme 'hdfs'"),
    ("s3:/bucket/out", "malformed URI"),
    ("s3://user:pw@bucket/out", "malformed S3 URI"),
    ("file://host/out", "names a host"),
])
def test_an_unsupported_or_malformed_uri_is_a_located_config_error(
        tmp_path: Path, path: str, words: str) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("sources:\n  - name: c\n    generator: {kind: counter}\n    outputs:\n"
                 f"      - name: o\n        sink: {{type: file, path: \"{path}\"}}\n")
    with pytest.raises(ConfigError) as info:
        load_config(f)
    msg = str(info.value)
    assert words in msg and f"{f}:6" in msg, msg
    assert not any(p.name.startswith(("gs:", "s3:", "hdfs:")) for p in tmp_path.rglob("*"))
    assert "pw" not in msg


def test_s3_state_dir_and_storage_without_s3_are_config_errors(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("state_dir: s3://bucket/state\nsources:\n  - name: c\n"
                 "    generator: {kind: counter}\n    outputs:\n      - name: o\n"
                 "        sink: {type: file, path: out, storage: {region: eu-west-1}}\n")
    with pytest.raises(ConfigError) as info:
        load_config(f)
    msg = str(info.value)
    assert "state_dir must be a local directory" in msg and f"{f}:1" in msg
    assert "only applies to an s3:// path" in msg and f"{f}:7" in msg


def test_s3_paths_resolve_to_canonical_uris_and_secrets_never_print(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_SECRET", SECRET)
    f = tmp_path / "p.yaml"
    f.write_text("sources:\n  - name: c\n    generator: {kind: counter}\n    outputs:\n"
                 "      - name: main\n        sinks:\n"
                 "          - {name: a, type: file, path: 's3a://bkt/lake//a/'}\n"
                 "          - name: b\n            type: file\n"
                 "            path: s3://bkt/lake/b\n            storage:\n"
                 "              endpoint: http://127.0.0.1:9\n              access_key_id: AK\n"
                 "              secret_access_key: ${MY_SECRET}\n")
    cfg = load_config(f)
    a, b = cfg.sources[0].outputs[0].sinks or ()
    assert a.path == "s3://bkt/lake/a" and b.path == "s3://bkt/lake/b"  # type: ignore[union-attr]
    dumped = str(redacted_dump(cfg))
    access = b.storage.access()  # type: ignore[union-attr]
    assert access.secret_access_key == SECRET and access.allow_http
    assert SECRET not in dumped and SECRET not in repr(cfg) and SECRET not in repr(access)
    assert SECRET not in repr(b.build(_ctx(tmp_path)))  # type: ignore[union-attr]


def test_two_outputs_on_one_s3_prefix_are_refused(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("sources:\n  - name: c\n    generator: {kind: counter}\n    outputs:\n"
                 "      - {name: a, sink: {type: file, path: 's3://bkt/lake/x'}}\n"
                 "      - {name: b, sink: {type: file, path: 's3a://bkt/lake/x/'}}\n")
    with pytest.raises(ConfigError, match="s3://bkt/lake/x"):
        load_config(f)


def _ctx(tmp_path: Path) -> Any:
    from reclock.contracts.sink import SinkContext

    return SinkContext(source="c", output="b", state_dir=tmp_path, identity="test")


def test_split_uri() -> None:
    assert split_uri("/a/b") == ("", "/a/b")
    assert split_uri("rel/x") == ("", "rel/x")
    assert split_uri("file:///abs/x") == ("", "/abs/x")
    assert split_uri("S3://Bkt/p/") == ("s3", "Bkt/p")
    assert split_uri("s3://bkt") == ("s3", "bkt")


# -- the sink on S3 ----------------------------------------------------------------------


def test_staged_files_go_to_the_bucket_and_only_commit_shows_them(s3: Any) -> None:
    bucket = s3.bucket()
    sink = open_sink(s3, bucket)
    sink.ensure(USER)
    staged = sink.stager().stage("b1", 0, updates(["a", "b"], 10))
    prefix = sink.location.root.split("/", 1)[1]
    assert f"{prefix}/{staged[0]['path']}" in s3.keys(bucket, prefix)
    assert keys_of(sink) == []
    sink.commit(staged, SinkState(), SinkState(11, '"p"'))
    assert keys_of(sink) == ["a", "b"]
    dt = DeltaTable(sink.uri, storage_options=sink.location.storage_options())
    assert dt.transaction_version(sink.app_id) == 11
    with pytest.raises(ValueError, match="not on the local filesystem"):
        _ = sink.path


def test_racing_committers_on_s3_never_both_commit(s3: Any) -> None:
    """No flock on S3: S3's conditional write is the only fence."""
    first = open_sink(s3)
    first.ensure(USER)
    results: list[str] = []
    barrier = threading.Barrier(4)

    def race(i: int) -> None:
        s = DeltaSink(NAME, first.uri, storage=first.location.s3)
        staged = s.stager().stage(f"r{i}", 0, updates([f"k{i}"], 10))
        barrier.wait()
        try:
            s.commit(staged, SinkState(), SinkState(11, f'"p{i}"'))
            results.append("ok")
        except SinkFenced:
            results.append("fenced")

    threads = [threading.Thread(target=race, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["fenced", "fenced", "fenced", "ok"]
    assert len(keys_of(first)) == 1


def test_orphans_on_s3_are_vacuumed_after_the_grace_period(s3: Any) -> None:
    clock = ManualClock(0)
    sink = open_sink(s3, clock=clock)
    sink.ensure(USER)
    kept = sink.stager().stage("c", 0, updates(["a"], 10))
    sink.commit(kept, SinkState(), SinkState(11))
    orphan = sink.stager().stage("o", 0, updates(["z"], 20))
    clock.set(int((sink.location.stat(orphan[0]["path"]) or (0, 0))[1]) + 1000)
    assert sink.vacuum_orphans(grace_seconds=60) == []  # too young
    clock.advance(120_000)
    assert sink.vacuum_orphans(grace_seconds=60) == [orphan[0]["path"]]
    assert sink.location.stat(kept[0]["path"]) is not None
    assert keys_of(sink) == ["a"]


def test_compaction_on_s3_keeps_rows_and_state_and_expires_what_it_removed(s3: Any) -> None:
    """On S3 the swap is delta-rs's commit (no put-if-absent of reclock's
    own there), made in a child from the planned snapshot; the checkpoint
    and the expiry after it run in children too."""
    sink = open_sink(s3)
    sink.ensure(USER)
    st = SinkState()
    for i in range(6):
        new = SinkState(10 * i + 10, f"p{i}")
        sink.commit(sink.stager().stage(f"c{i}", 0, updates([f"k{i}"], 10 * i)), st, new)
        st = new
    assert sink.compact(min_files=2)["files_removed"] == 6
    assert sink.state() == st
    assert keys_of(sink) == [f"k{i}" for i in range(6)]
    assert len(sink.expire_removed(0)) == 6
    assert keys_of(sink) == [f"k{i}" for i in range(6)]
    sink.commit(sink.stager().stage("c6", 0, updates(["k6"], 60)), st, SinkState(70, "p6"))
    assert sink.state() == SinkState(70, "p6")


def test_a_missing_bucket_is_definite_and_an_unreachable_store_transient(s3: Any) -> None:
    with pytest.raises(SinkError, match="NoSuchBucket"):
        open_sink(s3, bucket="reclock-never-made").ensure(USER)
    dead = f"http://127.0.0.1:{_closed_port()}"
    gone = open_sink(s3, endpoint=dead)
    with pytest.raises(TransientError) as info:
        gone.state()
    assert NAME in str(info.value) and SECRET not in str(info.value)
    with pytest.raises(TransientError):
        gone.stager().stage("b", 0, updates(["a"], 1))


def test_a_commit_whose_answer_is_lost_is_fenced_then_seen_as_committed(s3: Any) -> None:
    """The commit reached S3, the answer did not: a retry finds the entry and
    is fenced, and a fresh read of the state is exactly the new state, the
    rows there once."""
    trap = CommitTrap(s3.port)
    try:
        sink = open_sink(s3, endpoint=trap.endpoint)
        sink.ensure(USER)
        staged = sink.stager().stage("b1", 0, updates(["a", "b"], 10))
        trap.arm("drop_answer")
        with suppress(SinkFenced, TransientError):  # the driver then re-reads the state
            sink.commit(staged, SinkState(), SinkState(11, '"p"'))
        assert trap.sprung == ["drop_answer"]
        fresh = DeltaSink(NAME, sink.uri, storage=S3Access.resolve(env=s3.env()))
        assert fresh.state() == SinkState(11, '"p"')
        assert keys_of(fresh) == ["a", "b"]
        with pytest.raises(SinkFenced):
            sink.commit(staged, SinkState(), SinkState(11, '"p"'))
        assert keys_of(fresh) == ["a", "b"]
    finally:
        trap.close()


def test_location_is_picklable_without_its_filesystem(s3: Any) -> None:
    import pickle

    loc = Location.of(NAME, f"s3://{s3.bucket()}/x", S3Access.resolve(env=s3.env()))
    loc.write("f.bin", lambda f: f.write(b"12345"))
    again = pickle.loads(pickle.dumps(loc))
    assert again.stat("f.bin") is not None and again.stat("f.bin")[0] == 5  # type: ignore[index]
    assert again.read_text("missing") is None
    again.delete("f.bin")
    assert again.files() == []


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
