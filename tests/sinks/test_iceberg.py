"""What is the Iceberg sink's own (the contract is tests/sinks/test_contract.py):
state tables (the sum of an IntoTime's updates per key, deletes, refused
breaches), the fence between racing writers and the retry over writers that
are not this output's, compaction and snapshot expiry that keep rows and
state, the orphan vacuum, schema evolution, masked secrets, the
configuration block, and what a plain pyiceberg reader sees."""

from __future__ import annotations

import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pydantic import SecretStr

from reclock.contracts.rows import output_schema
from reclock.contracts.sink import SinkError, SinkFenced, SinkState
from reclock.core.errors import ReclockError
from reclock.sinks.iceberg import CatalogConfig, IcebergSink
from tests.sinks.rows import USER, updates

NAME = "shop.orders"


def _catalog(tmp: Path) -> CatalogConfig:
    return CatalogConfig(type="sql", uri=f"sqlite:///{tmp}/catalog.db",
                         warehouse=str(tmp / "wh"))


def _sink(tmp: Path, mode: str = "log", table: str = "lake.orders", **kw: Any) -> IcebergSink:
    s = IcebergSink(NAME, _catalog(tmp).access(None), table, mode=mode,  # type: ignore[arg-type]
                    key=("k",) if mode == "state" else (), **kw)
    s.ensure(USER)
    return s


def _glue_sinks(request: Any, n: int, endpoint: str | None = None) -> list[IcebergSink]:
    """``n`` sinks of one output in a Glue catalog (``endpoint``: its
    server; default moto's, which also serves the S3 warehouse)."""
    import uuid

    from reclock.sinks._store import S3Access

    s3 = request.getfixturevalue("s3")
    env = s3.env()
    storage = S3Access.resolve(env=env)
    access = CatalogConfig(type="glue", warehouse=f"s3://{s3.bucket()}/wh").access(
        storage, {"endpoint": endpoint or env["AWS_ENDPOINT_URL"],
                  "region": env["AWS_REGION"], "access_key_id": env["AWS_ACCESS_KEY_ID"],
                  "secret_access_key": env["AWS_SECRET_ACCESS_KEY"]})
    table = f"lake.orders_{uuid.uuid4().hex[:8]}"
    sinks = [IcebergSink(NAME, access, table, storage=storage) for _ in range(n)]
    for s in sinks:
        s.ensure(USER)
    return sinks


def _rows(keys: list[str], values: list[int], into: int, diff: int, offset: int = 0
          ) -> pa.Table:
    t = updates(keys, into, diff=diff, offset=offset)
    return t.set_column(t.schema.get_field_index("v"), "v", pa.array(values, pa.int64()))


def _live(s: IcebergSink) -> dict[str, tuple[int, int]]:
    t = s.read_updates()
    t = t.filter(pc.is_null(t.column("_error")))
    return {k: (v, into) for k, v, into in zip(t.column("k").to_pylist(), t.column("v").to_pylist(),
                                               t.column("_into_time").to_pylist(), strict=True)}


def _reader(tmp: Path, table: str = "lake.orders") -> pa.Table:
    """The table as a plain pyiceberg user reads it (its own catalog object)."""
    from pyiceberg.catalog import load_catalog

    cat = load_catalog("reclock", type="sql", uri=f"sqlite:///{tmp}/catalog.db")
    return cat.load_table(table).scan().to_arrow()


def test_a_state_table_holds_the_sum_of_each_intotime_per_key(tmp_path: Path) -> None:
    s = _sink(tmp_path, "state")
    st = s.stager()
    s1 = SinkState(11, '"p1"')
    s.commit(st.stage("b1", 0, _rows(["a", "b", "c"], [1, 2, 3], 10, 1)), SinkState(), s1)
    assert _live(s) == {"a": (1, 10), "b": (2, 10), "c": (3, 10)}
    # One commit of two IntoTimes: a updated at 20 then 30; b deleted at 20;
    # c retracted and inserted again at 30 (its updates in no order); d inserted.
    batch = pa.concat_tables([
        _rows(["a"], [1], 20, -1), _rows(["a"], [5], 20, 1),
        _rows(["a"], [6], 30, 1, offset=5), _rows(["a"], [5], 30, -1, offset=6),
        _rows(["b"], [2], 20, -1), _rows(["c"], [4], 30, 1), _rows(["c"], [3], 30, -1),
        _rows(["d"], [7], 30, 1)])
    s2 = SinkState(31, '"p2"')
    s.commit(st.stage("b2", 0, batch), s1, s2)
    want = {"a": (6, 30), "c": (4, 30), "d": (7, 30)}
    assert _live(s) == want
    assert s.state() == s2
    # What pyiceberg reads: one row per live key, the user's columns and
    # _into_time, nothing else.
    seen = _reader(tmp_path)
    assert seen.column_names == [*USER.names, "_into_time"]
    assert sorted(zip(seen.column("k").to_pylist(), seen.column("v").to_pylist(),
                      strict=True)) == [("a", 6), ("c", 4), ("d", 7)]
    # Compaction of a state table: its small files merged, the rows and state kept.
    s3 = SinkState(36, '"p3"')
    s.commit(st.stage("b3", 0, _rows(["e"], [8], 35, 1)), s2, s3)
    assert s.compact(min_files=2)["files_compacted"] >= 2
    assert _live(s) == {**want, "e": (8, 35)} and s.state() == s3
    assert len(list(s._load().scan().plan_files())) == 1
    # A delete that empties the table.
    s4 = SinkState(41, '"p4"')
    s.commit(st.stage("b4", 0, pa.concat_tables([
        _rows(["a"], [6], 40, -1), _rows(["c"], [4], 40, -1), _rows(["d"], [7], 40, -1),
        _rows(["e"], [8], 40, -1)])), s3, s4)
    assert _live(s) == {}
    assert s.state() == s4
    # Expiry deletes the files pyiceberg's copy-on-write commits replaced, too.
    data = tmp_path / "wh" / "lake" / "orders" / "data"
    assert s.expire(0, int(time.time() * 1000) + 1000) >= 4
    table = s._load()
    held = {f.file_path.rsplit("/", 1)[-1] for t in table.scan().plan_files()
            for f in (t.file, *t.delete_files)}
    assert {p.name for p in data.glob("*.parquet")} == held
    # A compaction then rewrites the file whose rows are all deleted, and
    # drops the delete files: nothing is left.
    assert s.compact(min_files=2)["delete_files_dropped"] >= 1
    assert s.expire(0, int(time.time() * 1000) + 2000) >= 1
    assert list(data.glob("*.parquet")) == [] and _live(s) == {} and s.state() == s4


def test_a_state_commit_that_breaks_the_key_is_refused_and_writes_nothing(
        tmp_path: Path) -> None:
    s = _sink(tmp_path, "state")
    st = s.stager()
    s1 = SinkState(11, '"p1"')
    s.commit(st.stage("b1", 0, _rows(["a"], [1], 10, 1)), SinkState(), s1)
    for bad in (_rows(["a", "a"], [2, 3], 20, 1),  # a second row for a
                _rows(["a"], [5], 20, 1),  # a second row for a, which holds one
                _rows(["z"], [1], 20, -1)):  # a negative count
        staged = st.stage("bad", 0, bad)
        with pytest.raises(SinkError) as err:
            s.commit(staged, s1, SinkState(21, '"p2"'))
        assert "a state table holds one row per key" in str(err.value)
        assert "IntoTime 20" in str(err.value)
    assert s.state() == s1 and _live(s) == {"a": (1, 10)}


def test_error_rows_of_a_state_table_keep_their_position(tmp_path: Path) -> None:
    s = _sink(tmp_path, "state")
    bad = updates(["x"], 10, offset=7, error="malformed JSON")
    staged = s.stager().stage("b", 0, pa.concat_tables([bad, _rows(["a"], [1], 10, 1)]))
    s.commit(staged, SinkState(), SinkState(11, '"p"'))
    t = s.read_updates()
    errs = t.filter(pc.is_valid(t.column("_error")))
    assert errs.column("_src_offset").to_pylist() == [7]
    assert errs.column("_error").to_pylist() == ["malformed JSON"]
    assert _live(s) == {"a": (1, 10)}
    assert s.read_updates(as_of=5).filter(pc.is_valid(pc.field("_error"))).num_rows == 0
    # The state table holds the current rows alone; the error rows are in
    # <table>_errors, where pyiceberg reads them with their positions.
    assert _reader(tmp_path).column_names == [*USER.names, "_into_time"]
    assert _reader(tmp_path).column("k").to_pylist() == ["a"]
    side = _reader(tmp_path, "lake.orders_errors")
    assert side.column("_error").to_pylist() == ["malformed JSON"]
    assert side.column("_src_offset").to_pylist() == [7]


def _model_commits() -> list[tuple[pa.Table, SinkState, SinkState]]:
    """Three commits with error rows among their updates, and the states
    they move: the input of the crash test below and of its model."""
    s1, s2, s3 = SinkState(11, '"p1"'), SinkState(21, '"p2"'), SinkState(31, '"p3"')
    return [
        (pa.concat_tables([_rows(["a", "b"], [1, 2], 10, 1),
                           updates(["x"], 10, offset=3, error="malformed JSON")]),
         SinkState(), s1),
        (pa.concat_tables([_rows(["a"], [1], 20, -1), _rows(["a"], [5], 20, 1, offset=1),
                           updates(["y"], 20, offset=4, error="not a number"),
                           updates(["z"], 20, offset=5, error="not a number")]), s1, s2),
        (pa.concat_tables([_rows(["b"], [2], 30, -1), _rows(["c"], [9], 30, 1, offset=1)]),
         s2, s3),
    ]


_CRASHING_COMMIT = """
import sys
import pyarrow as pa
from reclock.contracts.sink import SinkState
from tests.sinks.test_iceberg import _model_commits, _sink
from pathlib import Path
s = _sink(Path(sys.argv[1]), "state")
n = int(sys.argv[2])
batch, expected, new = _model_commits()[n]
s.commit(s.stager().stage(f"b{n}", 0, batch), expected, new)
"""


def test_a_kill_between_the_errors_commit_and_the_state_commit_loses_and_doubles_nothing(
        tmp_path: Path) -> None:
    """A state commit with error rows commits the errors table first: a
    SIGKILL between the two commits (crash point ``after_errors_commit``)
    leaves the errors table one commit ahead; the retry of the same commit
    (as a restarted driver runs it) skips the errors table and lands the
    rows. Compared with a model: each commit's live rows by key, and its
    error rows once each."""
    import os
    import subprocess
    import sys

    commits = _model_commits()
    for n in range(len(commits)):
        env = {**os.environ, "RECLOCK_CRASH_AT": "after_errors_commit"}
        run = subprocess.run([sys.executable, "-c", _CRASHING_COMMIT, str(tmp_path), str(n)],
                             env=env, capture_output=True, text=True)
        had_errors = bool(pc.sum(pc.is_valid(commits[n][0].column("_error"))).as_py())
        assert run.returncode == (-9 if had_errors else 0), run.stderr
        s = _sink(tmp_path, "state")
        if had_errors:  # the state table did not move; the retry, without the crash
            assert s.state() == commits[n][1]
            assert s._errors is not None and s._errors.state() == commits[n][2]
            s.commit(s.stager().stage(f"b{n}", 0, commits[n][0]), commits[n][1], commits[n][2])
        assert s.state() == commits[n][2]
    # The model: the last row of each key across the commits, and every error row once.
    live: dict[str, tuple[int, int]] = {}
    errors: list[tuple[int, str]] = []
    for batch, _, _ in commits:
        for row in batch.to_pylist():
            if row["_error"] is not None:
                errors.append((row["_src_offset"], row["_error"]))
            elif row["_diff"] > 0:
                live[row["k"]] = (row["v"], row["_into_time"])
            elif live.get(row["k"], (None,))[0] == row["v"]:
                del live[row["k"]]
    s = _sink(tmp_path, "state")
    assert _live(s) == live
    t = s.read_updates()
    errs = t.filter(pc.is_valid(t.column("_error")))
    assert sorted(zip(errs.column("_src_offset").to_pylist(), errs.column("_error").to_pylist(),
                      strict=True)) == sorted(errors)
    side = _reader(tmp_path, "lake.orders_errors")
    assert side.num_rows == len(errors)
    state_rows = _reader(tmp_path)
    assert sorted(zip(state_rows.column("k").to_pylist(), state_rows.column("v").to_pylist(),
                      strict=True)) == sorted((k, v) for k, (v, _) in live.items())


def test_merge_on_read_commits_write_the_changed_rows_and_position_deletes_only(
        tmp_path: Path) -> None:
    """A state commit writes one data file of the changed keys' rows and one
    position-delete file in the spec's layout (file_path, pos with their
    reserved field ids, sorted), in ONE snapshot; no other file is written."""
    s = _sink(tmp_path, "state", index_path=str(tmp_path / "keys.sqlite"))
    st = s.stager()
    s1, s2 = SinkState(11, '"p1"'), SinkState(21, '"p2"')
    s.commit(st.stage("b1", 0, _rows([f"k{i}" for i in range(50)], list(range(50)), 10, 1)),
             SinkState(), s1)
    first = s._load().current_snapshot().snapshot_id
    s.commit(st.stage("b2", 0, pa.concat_tables([
        _rows(["k7", "k3"], [7, 3], 20, -1), _rows(["k7"], [70], 20, 1, offset=9),
        _rows(["new"], [1], 20, 1, offset=10)])), s1, s2)
    table = s._load()
    snap = table.current_snapshot()
    assert snap.parent_snapshot_id == first and snap.summary.operation.value == "overwrite"
    assert snap.summary["added-data-files"] == "1" and snap.summary["added-delete-files"] == "1"
    assert snap.summary["added-records"] == "2" and snap.summary["added-position-deletes"] == "2"
    [old] = [t.file.file_path for t in table.scan(snapshot_id=first).plan_files()]
    tasks = list(table.scan().plan_files())
    [deletes] = {d.file_path for t in tasks for d in t.delete_files}
    import pyarrow.parquet as pq

    with table.io.new_input(deletes).open() as f:
        pd = pq.read_table(f)
    assert [(f.name, f.metadata[b"PARQUET:field_id"]) for f in pd.schema] == [
        ("file_path", b"2147483546"), ("pos", b"2147483545")]
    with table.io.new_input(old).open() as f:
        ks = pq.read_table(f).column("k").to_pylist()
    at = sorted([ks.index("k3"), ks.index("k7")])
    assert pd.to_pylist() == [{"file_path": old, "pos": at[0]}, {"file_path": old, "pos": at[1]}]
    assert _live(s) == {**{f"k{i}": (i, 10) for i in range(50) if i not in (3, 7)},
                        "k7": (70, 20), "new": (1, 20)}
    assert s._index is not None and s._index.version == snap.snapshot_id


def test_a_merge_on_read_state_table_keyed_by_a_struct_column(tmp_path: Path) -> None:
    """A key whose values Python cannot hash (a struct: dicts) is summed per
    IntoTime and found in the key index like any other: the row it replaces
    is deleted, the others stay (compared with the updates' model)."""
    kt = pa.struct([("a", pa.int64()), ("b", pa.string())])
    user = pa.schema([("k", kt), ("v", pa.int64())])
    s = IcebergSink(NAME, _catalog(tmp_path).access(None), "lake.orders", mode="state",
                    key=("k",), index_path=str(tmp_path / "keys.sqlite"))
    s.ensure(user)

    def rows(keys: list[dict[str, Any]], values: list[int], into: int, diff: int,
             offset: int = 0) -> pa.Table:
        t = updates(["?"] * len(keys), into, diff=diff, offset=offset)
        t = t.drop_columns(["k", "v"])
        return t.add_column(0, "v", pa.array(values, pa.int64())).add_column(
            0, "k", pa.array(keys, kt))

    k1, k2 = {"a": 1, "b": "x"}, {"a": 2, "b": "y"}
    st = s.stager()
    s1, s2 = SinkState(11, '"p1"'), SinkState(21, '"p2"')
    s.commit(st.stage("b1", 0, rows([k1, k2], [1, 2], 10, 1)), SinkState(), s1)
    s.commit(st.stage("b2", 0, pa.concat_tables([
        rows([k1], [1], 20, -1), rows([k1], [5], 20, 1, offset=5)])), s1, s2)
    t = s.read_updates()
    assert sorted(zip([(k["a"], k["b"]) for k in t.column("k").to_pylist()],
                      t.column("v").to_pylist(), t.column("_into_time").to_pylist(),
                      strict=True)) == [((1, "x"), 5, 20), ((2, "y"), 2, 10)]
    assert s.state() == s2


def test_a_key_index_that_names_another_snapshot_is_rebuilt_from_the_table(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key index is never trusted for a snapshot it does not name: after
    a commit whose index change was lost (as a kill after the catalog commit
    leaves it), and after commits of another driver of the output (another
    index), the next commit rebuilds it from the table and lands exactly the
    rows a model of the updates holds."""
    from reclock.sinks import iceberg_mor

    a = _sink(tmp_path, "state", index_path=str(tmp_path / "a.sqlite"))
    st = a.stager()
    s1, s2, s3, s4 = (SinkState(u, f'"p{u}"') for u in (11, 21, 31, 41))
    a.commit(st.stage("b1", 0, _rows(["a", "b", "c"], [1, 2, 3], 10, 1)), SinkState(), s1)
    real = iceberg_mor.Change.delete_keys

    def lost(self: Any, hits: Any) -> None:
        raise KeyboardInterrupt("killed before the index change")

    monkeypatch.setattr(iceberg_mor.Change, "delete_keys", lost)
    with pytest.raises(KeyboardInterrupt):
        a.commit(st.stage("b2", 0, pa.concat_tables([
            _rows(["a"], [1], 20, -1), _rows(["a"], [5], 20, 1, offset=1)])), s1, s2)
    monkeypatch.setattr(iceberg_mor.Change, "delete_keys", real)
    assert a.state() == s2  # the catalog commit landed; the index names s1's snapshot
    b = _sink(tmp_path, "state", index_path=str(tmp_path / "b.sqlite"))  # another driver
    b.commit(b.stager().stage("b3", 0, pa.concat_tables([
        _rows(["b"], [2], 30, -1), _rows(["d"], [4], 30, 1)])), s2, s3)
    a.commit(st.stage("b4", 0, pa.concat_tables([
        _rows(["a"], [5], 40, -1), _rows(["a"], [6], 40, 1, offset=1),
        _rows(["d"], [4], 40, -1), _rows(["d"], [8], 40, 1, offset=2)])), s3, s4)
    want = {"a": (6, 40), "c": (3, 10), "d": (8, 40)}
    assert _live(a) == want
    rows = _reader(tmp_path)
    assert sorted(rows.column("k").to_pylist()) == sorted(want)
    # A key that was re-inserted or deleted twice would be refused or doubled:
    # the rebuilt index holds each live key once, where the table holds it.
    assert a._index is not None
    assert sorted(a._index.lookup([repr((k,)) for k in ("a", "b", "c", "d")])) == [
        repr(("a",)), repr(("c",)), repr(("d",))]


def test_state_compaction_merges_small_files_in_bounded_passes_and_moves_the_index(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A merge-on-read state table of three large mostly-live files and many
    small commit files: compaction merges only the small ones (however many
    there are), at most the row cap a pass; a file with enough of its rows
    deleted is rewritten, one pass at a time. The key index moves each
    rewritten file's rows (rewriting no key), and still finds every key of a
    model of the updates where the table holds it (the same as an index
    rebuilt from the table). A kill after a compaction's catalog commit
    leaves the index naming the older snapshot: the next commit rebuilds it
    and lands exactly the model. (Limits scaled down: 40 live rows make a
    file large, 100 rows a pass.)"""
    import random

    from reclock import faults
    from reclock.sinks import iceberg
    from reclock.sinks.iceberg_mor import KeyIndex, lookup_paths, rebuild

    monkeypatch.setattr(iceberg, "STATE_SMALL_ROWS", 40, raising=False)
    monkeypatch.setattr(iceberg, "STATE_PASS_ROWS", 100, raising=False)
    s = _sink(tmp_path, "state", index_path=str(tmp_path / "keys.sqlite"))
    st = s.stager()
    rng = random.Random(7)
    model: dict[str, tuple[int, int]] = {}
    state = SinkState()
    n_batch = 0

    def commit(into: int, update: list[str], delete: list[str], insert: list[str]) -> None:
        nonlocal state, n_batch
        parts, off = [], 0
        for k in update + delete:
            v, _ = model[k]
            parts.append(_rows([k], [v], into, -1, offset=off))
            off += 1
        for k in update + insert:
            v = rng.randrange(10**6)
            parts.append(_rows([k], [v], into, 1, offset=off))
            off += 1
            model[k] = (v, into)
        for k in delete:
            del model[k]
        n_batch += 1
        new = SinkState(into + 1, f'"p{into}"')
        s.commit(st.stage(f"b{n_batch}", 0, pa.concat_tables(parts)), state, new)
        state = new

    def plan() -> set[str]:
        return {t.file.file_path for t in s._load().scan().plan_files()}

    def live_rows(paths: set[str]) -> int:
        return sum(t.file.record_count - sum(d.record_count for d in t.delete_files)
                   for t in s._load().scan().plan_files() if t.file.file_path in paths)

    # Three large files (200 keys each; the bulk load of a table).
    for b in range(3):
        commit(10 + b, [], [], [f"k{b * 200 + i:03d}" for i in range(200)])
    large = plan()
    assert len(large) == 3
    # Twenty commits of a few random changes: twenty small files.
    recent: set[str] = set()
    for t in range(20):
        keys = rng.sample(sorted(model), 5)
        ins = [f"n{t:02d}{i}" for i in range(3)]
        commit(100 + t, keys[:4], keys[4:], ins)
        recent.update(keys[:4] + ins)
        recent.discard(keys[4])
    assert len(plan()) == 23
    # The first pass takes small files only, oldest first, within the row cap.
    before = plan()
    done = s.compact(min_files=5)
    after = plan()
    merged = before - after
    assert large <= after and merged and not merged & large
    assert done["files_compacted"] == len(merged) >= 2 and done["files_left"] >= 1
    [new_file] = after - before
    assert live_rows({new_file}) <= 100
    # Passes go on while enough small files are left, each within the cap.
    for _ in range(5):
        before = plan()
        if not s.compact(min_files=5):
            break
        added = plan() - before
        assert large <= plan() and live_rows(added) <= 100
    assert large <= plan() and len(plan() - large) < 3 + 5
    # Changes to the keys the merged files hold: those files, 30 % deleted and
    # more, are rewritten (a move of moved rows), one a pass under the cap.
    for t in range(12):
        keys = rng.sample(sorted(recent & set(model)), 6)
        commit(200 + t, keys[:5], keys[5:], [])
    for _ in range(6):
        if not s.compact(min_files=5):
            break
    assert large <= plan()
    # The index finds every key of the model where the table holds it, and
    # no other: as an index rebuilt from the table does.
    table = s._load()
    texts = {repr((k,)): k for k in [*model, "k000", "n000", "gone"]}
    assert s._index is not None and s._index.version == table.current_snapshot().snapshot_id
    found = lookup_paths(s._index, sorted(texts))
    assert sorted(texts[t] for t in found) == sorted(model)
    fresh = KeyIndex(str(tmp_path / "fresh.sqlite"))
    rebuild(fresh, table, ("k",), lambda rows: s._key_texts(table, rows))
    assert lookup_paths(fresh, sorted(texts)) == found
    import pyarrow.parquet as pq

    held: dict[str, list[Any]] = {}
    for text, (path, pos) in found.items():
        if path not in held:
            with table.io.new_input(path).open() as f:
                held[path] = pq.read_table(f).column("k").to_pylist()
        assert held[path][pos] == texts[text]
    assert _live(s) == model
    # A kill after a compaction's catalog commit, before the index's change.
    for t in range(8):
        keys = rng.sample(sorted(model), 6)
        commit(300 + t, keys[:5], keys[5:], [f"m{t}"])
    real = faults.crash_point

    def killed(name: str) -> None:
        if name == "after_compaction":
            raise KeyboardInterrupt("killed after the compaction's commit")
        real(name)

    monkeypatch.setattr(faults, "crash_point", killed)
    with pytest.raises(KeyboardInterrupt):
        s.compact(min_files=5)
    monkeypatch.setattr(faults, "crash_point", real)
    assert s._index.version != s._load().current_snapshot().snapshot_id
    keys = rng.sample(sorted(model), 6)
    commit(400, keys[:5], keys[5:], ["last"])
    assert _live(s) == model and s.state() == state
    assert sorted(_reader(tmp_path).column("k").to_pylist()) == sorted(model)


def _refusals(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The commits a REST catalog refused (its 409s, pyiceberg's
    CommitFailedException), as the catalog worded them: every REST catalog
    object's ``commit_table`` is watched, and still does the commit."""
    from pyiceberg.catalog.rest import RestCatalog as PyRestCatalog
    from pyiceberg.exceptions import CommitFailedException

    refused: list[str] = []
    real = PyRestCatalog.commit_table

    def watched(self: Any, table: Any, requirements: Any, updates: Any) -> Any:
        try:
            return real(self, table, requirements, updates)
        except CommitFailedException as exc:
            refused.append(str(exc))
            raise

    monkeypatch.setattr(PyRestCatalog, "commit_table", watched)
    return refused


def _rest_access(catalog: str, tmp_path: Path, request: Any) -> tuple[Any, Any]:
    """A REST catalog's access and its server: the in-process one of
    tests/icebergrest.py (``rest``, for this test), or Apache Iceberg's own
    server (``rest-java``, the run's)."""
    if catalog == "rest":
        from tests.icebergrest import RestCatalog

        server = RestCatalog(tmp_path, "race-token")
        request.addfinalizer(server.close)
        return CatalogConfig(type="rest", uri=server.url,
                             token=SecretStr("race-token")).access(None), server
    server = request.getfixturevalue("iceberg_rest")
    return CatalogConfig(type="rest", uri=server.url).access(None), server


#: Iceberg's words for a failed assert-ref-snapshot-id (CatalogHandlers), and
#: pyiceberg's (the SQL catalog behind tests/icebergrest.py's server).
_MAIN_MOVED = r"(?i)branch main has changed|branch main was created concurrently"


@pytest.mark.parametrize("catalog", ["sql", "rest", "glue",
                                     pytest.param("rest-java", marks=pytest.mark.integration)])
def test_racing_committers_fence_each_other_and_lose_nothing(
        tmp_path: Path, catalog: str, request: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four writers of one output (four sink objects, as four drivers) race
    every round from the same state: exactly one commit lands per round, the
    others are fenced (by the SQL catalog's compare-and-swap, or the REST
    catalog's 409 on the snapshot requirement: the in-process one, or
    Apache Iceberg's own server; or Glue's version lock: moto's Glue with the
    lock moto lacks, tests/gluelock.py), and the table holds exactly the
    winners' rows."""
    refused = _refusals(monkeypatch)
    rounds = 5
    if catalog == "sql":
        sinks = [_sink(tmp_path) for _ in range(4)]
    elif catalog.startswith("rest"):
        access, server = _rest_access(catalog, tmp_path, request)
        table = f"lake.race_{uuid.uuid4().hex[:8]}"
        sinks = [IcebergSink(NAME, access, table) for _ in range(4)]
        for s in sinks:
            s.ensure(USER)
    else:  # (each commit is a dozen Glue and S3 calls: fewer rounds)
        rounds = 3
        lock = request.getfixturevalue("glue_lock")
        before = lock.refusals()
        sinks = _glue_sinks(request, 4, lock.endpoint)
    barrier = threading.Barrier(4)
    outcomes: dict[int, list[str]] = {}
    errors: list[BaseException] = []

    def race(who: int) -> None:
        s = sinks[who]
        try:
            for r in range(rounds):
                expected = s.state()
                staged = s.stager().stage(f"w{who}r{r}", 0, updates([f"w{who}r{r}"], r))
                barrier.wait()
                try:
                    s.commit(staged, expected, SinkState(r + 1, f'"w{who}r{r}"'))
                    outcomes.setdefault(r, []).append(f"w{who}r{r}")
                except SinkFenced:
                    pass
                barrier.wait()
        except threading.BrokenBarrierError:
            pass  # another writer failed: its error is the test's
        except BaseException as exc:  # handed to the test; the other writers stop
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=race, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(len(outcomes.get(r, [])) == 1 for r in range(rounds)), outcomes
    rows = sorted(sinks[0].read_updates().column("k").to_pylist())
    assert rows == sorted(w for r in range(rounds) for w in outcomes[r])
    assert sinks[0].state() == SinkState(rounds, f'"{outcomes[rounds - 1][0]}"')
    if catalog.startswith("rest"):  # commits reached the catalog and lost there (409)
        assert refused, "no commit was refused by the catalog"
        assert all(re.search(_MAIN_MOVED, text) for text in refused), refused
    if catalog == "rest":
        commits = [p for m, p in server.requests if m == "POST" and "/tables/race_" in p]
        assert len(commits) == rounds + len(refused), commits
    if catalog == "glue":  # updates reached Glue and lost to its version lock
        assert lock.refusals() > before


@pytest.mark.parametrize("catalog", ["rest", pytest.param("rest-java",
                                                          marks=pytest.mark.integration)])
def test_a_writer_behind_another_is_refused_by_the_rest_catalog(
        tmp_path: Path, catalog: str, request: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two writers of one table read the same state; the second's commit
    request reaches the catalog only after the first's landed (its request
    is held until then), so the sink's own check passed and only the
    catalog's ``assert-ref-snapshot-id`` requirement stands between them: the
    catalog refuses it (409), the second writer finds the state moved and is
    fenced, and the table holds the first writer's rows and state alone."""
    refused = _refusals(monkeypatch)
    access, _server = _rest_access(catalog, tmp_path, request)
    table = f"lake.fence_{uuid.uuid4().hex[:8]}"
    first, second = IcebergSink(NAME, access, table), IcebergSink(NAME, access, table)
    for s in (first, second):
        s.ensure(USER)
    start = SinkState(11, '"p11"')
    first.commit(first.stager().stage("b0", 0, updates(["a"], 10)), SinkState(), start)
    assert first.state() == second.state() == start
    cat = second._cat()
    send = cat.commit_table  # the watched one: a refusal is recorded
    sent: list[int] = []

    def held_until_the_first_lands(tbl: Any, requirements: Any, upd: Any) -> Any:
        if not sent:
            first.commit(first.stager().stage("b1", 0, updates(["first"], 20, offset=1)),
                         start, SinkState(21, '"first"'))
        sent.append(1)
        return send(tbl, requirements, upd)

    monkeypatch.setattr(cat, "commit_table", held_until_the_first_lands)
    with pytest.raises(SinkFenced, match="expected"):
        second.commit(second.stager().stage("b1", 0, updates(["second"], 20, offset=1)),
                      start, SinkState(21, '"second"'))
    assert len(sent) == 1 and len(refused) == 1, (sent, refused)
    assert re.search(_MAIN_MOVED, refused[0]), refused
    reader = IcebergSink(NAME, access, table)
    assert reader.state() == SinkState(21, '"first"')
    assert sorted(reader.read_updates().column("k").to_pylist()) == ["a", "first"]


@pytest.fixture(scope="module")
def glue_lock(tmp_path_factory: Any) -> Any:
    """moto's server with Glue's UpdateTable version lock (tests/gluelock.py)."""
    from tests.gluelock import GlueLockServer

    server = GlueLockServer(tmp_path_factory.mktemp("gluelock") / "server.log")
    yield server
    server.close()


def _between_read_and_update(sink: IcebergSink, other: IcebergSink, staged: list[Any],
                             expected: SinkState, new: SinkState) -> None:
    """Have ``other`` commit once, just before ``sink``'s next Glue
    ``UpdateTable`` is sent: after the sink (and pyiceberg's GlueCatalog)
    read the table and checked the state and the requirements against it."""
    fired: list[bool] = []

    def hook(**_: Any) -> None:
        if not fired:
            fired.append(True)
            other.commit(staged, expected, new)

    sink._cat().glue.meta.events.register("before-call.glue.UpdateTable", hook)


def test_a_writer_between_the_glue_read_and_update_is_fenced_by_the_version_lock(
        request: Any, glue_lock: Any) -> None:
    """A Glue catalog: another writer commits after this one read the table
    (its state checked, pyiceberg's requirements met) and before its
    ``UpdateTable``: Glue refuses the update (the version it read is gone),
    the commit is :class:`SinkFenced`, and the table holds the other
    writer's commit and nothing of this one's. On moto's own Glue (no
    lock) the same commit would succeed and overwrite the other's
    (:func:`test_moto_glue_ignores_the_update_version`)."""
    a, b = _glue_sinks(request, 2, glue_lock.endpoint)
    s1 = SinkState(10, '"p10"')
    a.commit(a.stager().stage("a0", 0, updates(["a"], 5)), SinkState(), s1)
    theirs = b.stager().stage("b1", 0, updates(["b"], 15, offset=1))
    _between_read_and_update(a, b, theirs, s1, SinkState(20, '"b20"'))
    before = glue_lock.refusals()
    mine = a.stager().stage("a1", 0, updates(["z"], 15, offset=2))
    with pytest.raises(SinkFenced):
        a.commit(mine, s1, SinkState(20, '"a20"'))
    assert glue_lock.refusals() == before + 1
    assert b.state() == SinkState(20, '"b20"') and a.state() == SinkState(20, '"b20"')
    assert sorted(a.read_updates().column("k").to_pylist()) == ["a", "b"]


def test_moto_glue_ignores_the_update_version(s3: Any) -> None:
    """Why tests/gluelock.py exists: moto's Glue (5.2.5) applies an
    ``UpdateTable`` whose ``VersionId`` is not the table's (AWS Glue
    refuses it with ConcurrentModificationException). When this fails,
    moto enforces the lock and the racing tests can use moto's server."""
    import boto3

    env = s3.env()
    glue = boto3.client("glue", endpoint_url=env["AWS_ENDPOINT_URL"],
                        region_name=env["AWS_REGION"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    db = f"lock_{time.monotonic_ns()}"
    glue.create_database(DatabaseInput={"Name": db})
    glue.create_table(DatabaseName=db, TableInput={"Name": "t"})
    glue.update_table(DatabaseName=db, TableInput={"Name": "t"}, VersionId="1")
    glue.update_table(DatabaseName=db, TableInput={"Name": "t"}, VersionId="1")  # stale
    assert glue.get_table(DatabaseName=db, Name="t")["Table"]["VersionId"] == "3"


def test_a_commit_over_another_writers_snapshot_goes_through(tmp_path: Path) -> None:
    """A snapshot of another writer (an outside append) after ours: the state
    is found behind it, and the next commit lands on top of it."""
    s = _sink(tmp_path)
    s1 = SinkState(11, '"p1"')
    s.commit(s.stager().stage("b1", 0, updates(["a"], 10)), SinkState(), s1)
    from pyiceberg.catalog import load_catalog

    outside = load_catalog("reclock", type="sql", uri=f"sqlite:///{tmp_path}/catalog.db"
                           ).load_table("lake.orders")
    extra = updates(["outside"], 10, offset=99).cast(output_schema(USER))
    outside.append(extra)
    assert s.state() == s1
    # An expiry keeps the snapshot that carries the state behind the outside one.
    assert s.expire(0, int(time.time() * 1000) + 1000) == 0
    assert s.state() == s1
    s2 = SinkState(21, '"p2"')
    s.commit(s.stager().stage("b2", 0, updates(["b"], 20, offset=1)), s1, s2)
    assert s.state() == s2
    assert sorted(s.read_updates().column("k").to_pylist()) == ["a", "b", "outside"]


def test_compaction_and_expiry_keep_rows_and_state_and_vacuum_takes_orphans(
        tmp_path: Path) -> None:
    now = [int(time.time() * 1000)]

    class Clock:
        def now(self) -> int:
            return now[0]

    s = _sink(tmp_path, clock=Clock())
    state = SinkState()
    for i in range(6):
        new = SinkState(10 * i + 11, f'"p{i}"')
        s.commit(s.stager().stage(f"b{i}", 0, updates([f"k{i}"], 10 * i + 10, offset=i)),
                 state, new)
        state = new
    before = sorted(s.read_updates().column("k").to_pylist())
    files_before = len(list(s._load().scan().plan_files()))
    assert s.compact(min_files=2) == {"files_compacted": 6, "files_written": 1}
    assert s.state() == state
    assert sorted(s.read_updates().column("k").to_pylist()) == before
    assert len(list(s._load().scan().plan_files())) == 1 < files_before
    # Expiry: every snapshot but the current one is old; the small files
    # only they referenced are deleted, the rows and the state stay.
    data = tmp_path / "wh" / "lake" / "orders" / "data"
    assert len(list(data.glob("reclock-*.parquet"))) == 7
    now[0] += 3_600_000
    assert s.expire(60_000) >= 6
    assert len(list(data.glob("reclock-*.parquet"))) == 1
    assert s.state() == state
    assert sorted(s.read_updates().column("k").to_pylist()) == before
    # A commit after the maintenance lands as usual.
    new = SinkState(100, '"p9"')
    s.commit(s.stager().stage("after", 0, updates(["z"], 90, offset=9)), state, new)
    assert s.state() == new
    # Orphans: a staged file never committed is deleted once past the grace,
    # the committed ones stay.
    s.stager().stage("orphan", 0, updates(["o"], 95, offset=10))
    assert s.vacuum_orphans(3600) == []
    now[0] += 7_200_000
    assert s.vacuum_orphans(3600) == ["data/reclock-orphan-00000-000.parquet"]
    assert sorted(s.read_updates().column("k").to_pylist()) == [*before, "z"]


def test_schema_evolution_adds_columns_and_widens_types(tmp_path: Path) -> None:
    narrow = pa.schema([("k", pa.string()), ("n", pa.int32())])
    s = IcebergSink(NAME, _catalog(tmp_path).access(None), "lake.evolve")
    s.ensure(narrow)
    rows = pa.table({"k": ["a"], "n": pa.array([1], pa.int32())})
    s1 = SinkState(11)
    s.commit(s.stager().stage("b1", 0, _with_meta(rows, 10)),
        SinkState(), s1)
    wide = pa.schema([("k", pa.string()), ("n", pa.int64()), ("extra", pa.string())])
    s.ensure(wide)
    more = pa.table({"k": ["b"], "n": pa.array([2**40], pa.int64()), "extra": ["x"]})
    s.commit(s.stager().stage("b2", 0, _with_meta(more, 20)), s1, SinkState(21))
    got = s.read_updates().sort_by("k")
    assert got.schema.field("n").type == pa.int64()
    assert got.select(["k", "n", "extra"]).to_pylist() == [
        {"k": "a", "n": 1, "extra": None}, {"k": "b", "n": 2**40, "extra": "x"}]
    with pytest.raises(SinkError, match=r"key columns \['id'\]"):
        IcebergSink(NAME, _catalog(tmp_path).access(None), "lake.keyed", mode="state",
                    key=("id",)).ensure(narrow)
    with pytest.raises(SinkError, match="cannot take columns"):
        s.ensure(pa.schema([("k", pa.int64()), ("n", pa.int64()), ("extra", pa.string())]))


def _with_meta(user: pa.Table, into: int) -> pa.Table:
    meta = updates(["_"] * user.num_rows, into).drop_columns(["k", "v"])
    out = user
    for f in meta.schema:
        out = out.append_column(f, meta.column(f.name))
    return out


def test_secrets_are_masked(tmp_path: Path) -> None:
    cat = CatalogConfig(type="sql", uri="postgresql+psycopg://u:s3cr3t-pw@127.0.0.1:1/db",
                        warehouse=str(tmp_path / "wh"))
    s = IcebergSink(NAME, cat.access(None), "lake.t")
    assert "s3cr3t-pw" not in repr(s) and "u:***@127.0.0.1:1/db" in repr(s)
    with pytest.raises(ReclockError) as err:
        s.ensure(USER)
    assert "s3cr3t-pw" not in str(err.value) and "lake.t" in str(err.value)
    # A REST catalog that refuses the token: a definite error, the token unsaid.
    from tests.icebergrest import RestCatalog

    server = RestCatalog(tmp_path, "the-right-token")
    try:
        rest = CatalogConfig(type="rest", uri=server.url, token=SecretStr("wr0ng-t0ken-9"),
                             properties={"header.X-Api-Secret": "h3ader-s3cret"})
        assert "h3ader-s3cret" in rest.access(None).secrets()
        s = IcebergSink(NAME, rest.access(None), "lake.t")
        with pytest.raises(SinkError) as err:
            s.ensure(USER)
        assert "wr0ng-t0ken-9" not in str(err.value) and "rest catalog" in str(err.value)
    finally:
        server.close()


def test_an_unreachable_glue_catalog_is_transient_and_keeps_its_secret() -> None:
    from reclock.core.errors import TransientError
    from reclock.sinks._store import AwsAccessConfig

    cat = CatalogConfig(type="glue", warehouse="s3://b/wh", properties={"glue.max-retries": "1"},
                        glue=AwsAccessConfig(endpoint="http://127.0.0.1:9", region="us-east-1",
                                             access_key_id="AKIA1",
                                             secret_access_key=SecretStr("gl0e-s3cret")))
    s = IcebergSink(NAME, cat.access(None), "lake.t")
    assert repr(s) == "IcebergSink('shop.orders', glue catalog http://127.0.0.1:9, table='lake.t')"
    with pytest.raises(TransientError) as err:
        s.ensure(USER)
    assert "glue catalog http://127.0.0.1:9" in str(err.value)
    assert "gl0e-s3cret" not in str(err.value)


def test_the_configuration_block(tmp_path: Path) -> None:
    from reclock.config import load_config

    def load(sink: str) -> Any:
        p = tmp_path / "p.yaml"
        p.write_text(f"""
state_dir: state
sources:
  - name: shop
    generator: {{kind: counter, rate: 10, max_records: 10}}
    outputs:
      - name: out
        format: {{type: json, schema: {{n: int64}}}}
        sink: {sink}
""")
        return load_config(p)

    cfg = load("{type: iceberg, catalog: {type: sql, uri: 'sqlite:///cat.db', warehouse: wh},"
               " table: lake.out}")
    sink = cfg.sources[0].outputs[0].sink
    assert sink.catalog.uri == f"sqlite:///{tmp_path}/cat.db"
    assert sink.catalog.warehouse == str(tmp_path / "wh")
    with pytest.raises(Exception, match="key"):
        load("{type: iceberg, catalog: {type: sql, uri: 'sqlite:///c.db'}, table: lake.out, "
             "mode: state}")
    with pytest.raises(Exception, match="table"):
        load("{type: iceberg, catalog: {type: sql, uri: 'sqlite:///c.db'}, table: out}")
    with pytest.raises(Exception, match="errors_table"):
        load("{type: iceberg, catalog: {type: sql, uri: 'sqlite:///c.db'}, table: lake.out, "
             "errors_table: lake.bad}")
    with pytest.raises(Exception, match="errors_table"):
        load("{type: iceberg, catalog: {type: sql, uri: 'sqlite:///c.db'}, table: lake.out, "
             "mode: state, key: [n], errors_table: lake.out}")
    assert sink.write_mode == "merge-on-read" and sink.errors_table is None
    # Glue: no uri; its endpoint, region and credentials in glue (else the storage block's)
    glue = load("{type: iceberg, catalog: {type: glue, warehouse: 's3://b/wh', glue: {region: "
                "eu-west-1, access_key_id: AKIA1, secret_access_key: gl0e-s3cret}}, "
                "table: lake.out, storage: {region: us-east-2}}").sources[0].outputs[0].sink
    access = glue.catalog.access(None, glue.storage.given())
    assert access.properties["glue.region"] == "eu-west-1"
    assert access.properties["glue.secret-access-key"] == "gl0e-s3cret"
    assert "gl0e-s3cret" in access.secrets() and "gl0e-s3cret" not in repr(glue)
    tuned = load("{type: iceberg, catalog: {type: glue, properties: {glue.max-retries: '5'}}, "
                 "table: lake.out}").sources[0].outputs[0].sink
    assert tuned.catalog.access(None).properties["glue.max-retries"] == 5
    inherit = load("{type: iceberg, catalog: {type: glue, warehouse: 's3://b/wh'}, "
                   "table: lake.out, storage: {endpoint: 'http://127.0.0.1:9', region: "
                   "us-east-2}}").sources[0].outputs[0].sink
    access = inherit.catalog.access(None, inherit.storage.given())
    assert access.properties["glue.endpoint"] == "http://127.0.0.1:9"
    assert access.properties["glue.region"] == "us-east-2" and access.kind == "glue"
    with pytest.raises(Exception, match="a glue catalog has no uri"):
        load("{type: iceberg, catalog: {type: glue, uri: 'http://x'}, table: lake.out}")
    with pytest.raises(Exception, match="required for a sql catalog"):
        load("{type: iceberg, catalog: {type: sql}, table: lake.out}")
    with pytest.raises(Exception, match="only applies to type: glue"):
        load("{type: iceberg, catalog: {type: sql, uri: 'sqlite:///c.db', glue: {}}, "
             "table: lake.out}")
    assert access.properties["glue.max-retries"] == 3  # (boto3 takes a number)
    with pytest.raises(Exception, match="must be a whole number of attempts"):
        load("{type: iceberg, catalog: {type: glue, properties: {glue.max-retries: many}}, "
             "table: lake.out}")
    with pytest.raises(Exception, match="allow_http"):
        load("{type: iceberg, catalog: {type: glue, glue: {allow_http: true}}, "
             "table: lake.out}")
    # The state tables' key rule (reclock.contracts.config.state_key_problem),
    # as for Postgres: Kafka records with the append envelope have no upstream key.
    p = tmp_path / "k.yaml"
    p.write_text("""
sources:
  - name: events
    kafka: {bootstrap_servers: "127.0.0.1:9", topic: t}
    outputs:
      - name: out
        format: {type: json, schema: {n: int64}}
        sink: {type: iceberg, catalog: {type: sql, uri: 'sqlite:///c.db'}, table: lake.out,
               mode: state, key: [n]}
""")
    with pytest.raises(Exception, match="a state table keeps one row per key"):
        load_config(p)


def test_a_table_committed_often_keeps_few_manifests_and_metadata_files(
        tmp_path: Path) -> None:
    """An output commits every interval: its table merges manifests once
    ``commit.manifest.min-count-to-merge`` pile up, and keeps the newest
    ``write.metadata.previous-versions-max`` metadata files, not one per
    commit (the sink creates tables with 100 and 100; 10 and 10 here, to
    need fewer commits)."""
    from reclock.sinks.iceberg import TABLE_PROPERTIES

    s = _sink(tmp_path)
    table = s._load()
    assert table.format_version == 2  # (format-version is the table's, not a property)
    assert {k: table.properties.get(k) for k in TABLE_PROPERTIES if k != "format-version"
            } == {k: v for k, v in TABLE_PROPERTIES.items() if k != "format-version"}
    with table.transaction() as tx:
        tx.set_properties({"commit.manifest.min-count-to-merge": "10",
                           "write.metadata.previous-versions-max": "10"})
    state = SinkState()
    for i in range(30):
        new = SinkState(i + 1)
        staged = s.stager().stage(f"b{i}", 0, updates([f"k{i}"], i, offset=i)) if i % 2 else []
        s.commit(staged, state, new)
        state = new
    table = s._load()
    assert len(table.current_snapshot().manifests(table.io)) <= 10
    metadata = tmp_path / "wh" / "lake" / "orders" / "metadata"
    assert len(list(metadata.glob("*.metadata.json"))) <= 11
    assert s.read_updates().num_rows == 15 and s.state() == SinkState(30)


def test_maintain_expires_snapshots_past_the_retention_on_any_tick(tmp_path: Path) -> None:
    from reclock.sinks.iceberg import Compaction

    s = _sink(tmp_path, compaction=Compaction(every_ms=3_600_000, retention_ms=120_000))
    state = SinkState()
    for i in range(4):
        new = SinkState(i + 1)
        s.commit(s.stager().stage(f"b{i}", 0, updates([f"k{i}"], i, offset=i)), state, new)
        state = new
    now = int(time.time() * 1000)
    assert s.maintain(now) == {}  # nothing past the retention; compaction not due
    assert s.maintain(now + 120_000 + 61_000) == {"snapshots_expired": 3}
    assert len(s._load().metadata.snapshots) == 1
    assert s.state() == state and s.read_updates().num_rows == 4
