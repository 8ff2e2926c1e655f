"""The Delta sink against real Delta tables in a temporary directory."""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import pickle
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable, Field, Schema
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import CommitProperties, Transaction

import reclock.sinks.delta as delta_mod
from reclock.contracts.rows import output_schema
from reclock.contracts.sink import SinkError, SinkFenced, SinkState
from reclock.core.clock import ManualClock
from reclock.core.errors import DefiniteError
from reclock.sinks._store import Location
from reclock.sinks.delta import CLOSED, DeltaSink, DeltaStager
from tests.sinks.rows import SCHEMA, USER, race_commits, updates

NAME = "orders.main"


@pytest.fixture
def sink(tmp_path: Path) -> DeltaSink:
    s = DeltaSink(NAME, tmp_path / "out")
    s.ensure(USER)
    return s


def keys(table: pa.Table) -> list[str]:
    return sorted(table.column("k").to_pylist())


def log_versions(path: Path) -> list[int]:
    return sorted(int(p.name.split(".")[0]) for p in (path / "_delta_log").glob("*.json"))


# -- ensure ------------------------------------------------------------------------------


def test_ensure_creates_the_table_with_the_output_schema(tmp_path: Path) -> None:
    s = DeltaSink(NAME, tmp_path / "a" / "b")
    assert s.state() == SinkState()
    s.ensure(USER)
    dt = DeltaTable(str(tmp_path / "a" / "b"))
    assert dt.schema() == Schema.from_arrow(output_schema(USER))
    assert s.state() == SinkState()
    assert s.read_updates().num_rows == 0
    s.ensure(USER)  # idempotent: no new version
    assert DeltaTable(str(tmp_path / "a" / "b")).version() == dt.version()


def test_a_lazy_sink_creates_its_table_at_its_first_commit(tmp_path: Path) -> None:
    # a pipeline's file sink: opening a thousand outputs writes no table yet
    path = tmp_path / "lazy"
    s = DeltaSink(NAME, path, create_lazily=True)
    s.ensure(USER)
    assert not (path / "_delta_log").exists()
    assert s.state() == SinkState() and s.state() == SinkState()
    assert s.read_updates().num_rows == 0 and s.vacuum_orphans() == []
    staged = s.stager().stage("b1", 0, updates(["a", "b"], 1000))
    s.commit(staged, SinkState(), SinkState(2000, "p"))
    dt = DeltaTable(str(path))
    assert dt.schema() == Schema.from_arrow(output_schema(USER))
    assert [h["operation"] for h in dt.history()][::-1][:1] == ["CREATE TABLE"]
    assert s.state() == SinkState(2000, "p")
    assert keys(s.read_updates()) == ["a", "b"]
    again = DeltaSink(NAME, path, create_lazily=True)  # a restart finds it and checks it
    again.ensure(USER)
    assert again.state() == SinkState(2000, "p")
    with pytest.raises(SinkError, match="stored schema differs"):
        DeltaSink(NAME, path, create_lazily=True).ensure(
            pa.schema([("k", pa.int64()), ("v", pa.int64())]))


def test_a_lazy_sink_commits_into_a_table_created_meanwhile(tmp_path: Path) -> None:
    # a driver killed after creating the table, before its commit (or a zombie
    # that created it): the next commit uses the table, or refuses a clash
    path = tmp_path / "t"
    s = DeltaSink(NAME, path, create_lazily=True)
    s.ensure(USER)
    DeltaSink(NAME, path).ensure(USER)
    s.commit(s.stager().stage("b1", 0, updates(["a"], 1000)), SinkState(), SinkState(2000))
    assert keys(s.read_updates()) == ["a"] and s.state() == SinkState(2000)
    other = DeltaSink(NAME, tmp_path / "u", create_lazily=True)
    other.ensure(USER)
    DeltaSink(NAME, tmp_path / "u").ensure(pa.schema([("k", pa.int64())]))
    with pytest.raises(SinkError, match="stored schema differs"):
        other.commit([], SinkState(), SinkState(1))


def test_delta_calls_in_flight_are_bounded(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # a thousand outputs opened at once hung every delta-rs call: at most
    # _DELTA_CALLS run at once; a sink's methods calling each other take one
    monkeypatch.setattr(delta_mod, "_DELTA_CALLS", threading.BoundedSemaphore(2))
    inside, most = [0], [0]
    lock = threading.Lock()
    real = DeltaSink._open

    def counted(self: DeltaSink) -> Any:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            threading.Event().wait(0.02)
            return real(self)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(DeltaSink, "_open", counted)
    sinks = [DeltaSink(NAME, tmp_path / f"t{i}") for i in range(8)]
    threads = [threading.Thread(target=s.ensure, args=(USER,)) for s in sinks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 2
    monkeypatch.setattr(delta_mod, "_DELTA_CALLS", threading.BoundedSemaphore(1))
    s = sinks[0]  # commit -> _load -> _open within one slot
    s.commit(s.stager().stage("b", 0, updates(["a"], 1)), s.state(), SinkState(2))
    assert keys(s.read_updates()) == ["a"]


def test_missing_table_reads_empty_and_has_the_initial_state(tmp_path: Path) -> None:
    s = DeltaSink(NAME, tmp_path / "never")
    assert s.state() == SinkState()
    assert s.read_updates(5).num_rows == 0
    assert s.vacuum_orphans() == []


#: Names in ``_delta_log``, with and without what makes it a table.
_LOG_NAMES = [
    "00000000000000000003.json", "00000000000000000003.crc",
    "00000000000000000000.00000000000000000003.compacted.json",
    "00000000000000000003.checkpoint.parquet",
    "00000000000000000003.checkpoint.0000000001.0000000002.parquet",
    "00000000000000000003.checkpoint.5d2ee3ca-6083-48a5-8ed1-f5b5fd18b513.parquet",
    "00000000000000000003.checkpoint.5d2ee3ca-6083-48a5-8ed1-f5b5fd18b513.json",
    "_last_checkpoint", ".00000000000000000000.json.0123456789abcdef0123456789abcdef.tmp",
    "00000000000000000003.json.tmp", "00000000000000000003.foo", "0000000000000000003.json",
    "00000000000000000003", "00000000000000000003.checkpoint.1.2.parquet",
    "x00000000000000000003.json",
]


@pytest.mark.parametrize("names", [[n] for n in _LOG_NAMES] + [[], _LOG_NAMES[7:]])
def test_a_local_tables_log_is_found_as_delta_rs_finds_it(tmp_path: Path,
                                                          names: list[str]) -> None:
    """``has_log`` (the file system, no delta-rs call) answers what
    ``DeltaTable.is_deltatable`` answers, name by name."""
    (tmp_path / "_delta_log").mkdir()
    for n in names:
        (tmp_path / "_delta_log" / n).write_bytes(b"")
    assert delta_mod.has_log(str(tmp_path)) == DeltaTable.is_deltatable(str(tmp_path))


def test_no_log_is_no_table(tmp_path: Path) -> None:
    assert not delta_mod.has_log(str(tmp_path / "missing"))
    assert not delta_mod.has_log(str(tmp_path))
    (tmp_path / "_delta_log").write_bytes(b"")  # a file, not a directory
    assert not delta_mod.has_log(str(tmp_path)) and not DeltaTable.is_deltatable(str(tmp_path))


def _in_a_fresh_process(code: str, path: Path, in_process: bool) -> Any:
    """``code`` run by a new interpreter with ``path`` as its argument, this
    repository importable; ``in_process``: ``RECLOCK_IN_PROCESS=1`` (delta-rs
    calls in that process, none in children), else unset. Its
    CompletedProcess, output captured as text."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "RECLOCK_IN_PROCESS"}
    env["PYTHONPATH"] = str(root)
    if in_process:
        env["RECLOCK_IN_PROCESS"] = "1"
    return subprocess.run([sys.executable, "-c", code, str(path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


_PASSES_IN_A_FRESH_PROCESS = """
import os, sys
from reclock.sinks.delta import Compaction, DeltaSink
s = DeltaSink("o", sys.argv[1], compaction=Compaction(every_ms=1, min_files=1_000_000))
for i in range(3):
    s.vacuum_orphans(grace_seconds=0)
    s.maintain(10**13 + i)
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(sum(n.startswith("tokio") for n in names))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc")
def test_maintenance_of_a_local_table_starts_no_delta_rs_thread_in_the_asker(
        tmp_path: Path) -> None:
    """Vacuum and maintenance passes (which read the table in children) start
    no delta-rs runtime thread in the driver: asking whether the table is
    there once went through ``is_deltatable``, whose runtime left a thread
    behind for ten seconds each call (a soak's thread count swung with it)."""
    path = tmp_path / "t"
    s = DeltaSink(NAME, path)
    s.ensure(USER)
    s.commit(s.stager().stage("b", 0, updates(["a"], 1)), SinkState(), SinkState(2))
    out = _in_a_fresh_process(_PASSES_IN_A_FRESH_PROCESS, path, in_process=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0"]


def test_ensure_rejects_a_changed_column_type_naming_output_path_and_column(
    sink: DeltaSink,
) -> None:
    with pytest.raises(SinkError) as info:
        sink.ensure(pa.schema([("k", pa.int64()), ("v", pa.int64())]))
    msg = str(info.value)
    assert NAME in msg and str(sink.path) in msg
    assert "'k'" in msg and "string" in msg and "long" in msg


def test_ensure_rejects_reclock_column_names(tmp_path: Path) -> None:
    with pytest.raises(DefiniteError, match="_diff"):
        DeltaSink(NAME, tmp_path / "t").ensure(pa.schema([("_diff", pa.int64())]))


def test_ensure_adds_new_nullable_columns_and_old_rows_read_null(sink: DeltaSink) -> None:
    sink.commit(sink.stager().stage("b1", 0, updates(["a"], 5)), SinkState(), SinkState(10))
    wider = pa.schema([*USER, pa.field("note", pa.string())])
    sink.ensure(wider)
    rows = updates(["b"], 12).append_column("note", pa.array(["hi"]))
    sink.commit(sink.stager().stage("b2", 0, rows), SinkState(10), SinkState(20))
    got = sink.read_updates().sort_by("k")
    assert got.column("note").to_pylist() == [None, "hi"]
    assert sink.state() == SinkState(20)
    sink.ensure(wider)  # now equal: nothing to add
    sink.ensure(USER)  # a stored superset is compatible: the stager fills nulls
    sink.commit(sink.stager().stage("b3", 0, updates(["c"], 25)), SinkState(20), SinkState(30))
    assert sink.read_updates().sort_by("k").column("note").to_pylist() == [None, "hi", None]


# -- stage + commit ----------------------------------------------------------------------


def test_stage_commit_round_trip(sink: DeltaSink) -> None:
    staged = sink.stager().stage("b1", 3, updates(["a", "b", "c"], 1000, offset=7))
    assert [d["path"] for d in staged] == ["part-b1-00003-000.parquet"]
    (d,) = staged
    assert d["rows"] == 3 and d["size"] == (sink.path / d["path"]).stat().st_size
    stats = json.loads(d["stats"])
    assert stats["numRecords"] == 3
    assert stats["minValues"] == {"_into_time": 1000, "_src_offset": 7}
    assert stats["maxValues"] == {"_into_time": 1000, "_src_offset": 9}
    assert stats["nullCount"]["_error"] == 3 and stats["nullCount"]["k"] == 0

    assert sink.read_updates().num_rows == 0  # staged is not visible
    sink.commit(staged, SinkState(), SinkState(2000, '[{"p":0,"o":10}]'))
    assert sink.state() == SinkState(2000, '[{"p":0,"o":10}]')

    got = sink.read_updates()
    assert got.schema == SCHEMA
    assert got.sort_by("k").to_pylist() == updates(["a", "b", "c"], 1000, offset=7).to_pylist()
    assert sink.read_updates(999).num_rows == 0
    assert sink.read_updates(1000).num_rows == 3

    # The commit carries the state in its commitInfo, readable by any Delta client.
    last = DeltaTable(str(sink.path)).history(1)[0]
    assert last["reclock.upper"] == 2000
    assert last["reclock.progress"] == '[{"p":0,"o":10}]'
    assert DeltaTable(str(sink.path)).transaction_version(f"reclock:{NAME}") == 2000


def test_as_of_reads_across_commits(sink: DeltaSink) -> None:
    sink.commit(sink.stager().stage("b1", 0, updates(["a"], 100)), SinkState(), SinkState(200))
    sink.commit(
        sink.stager().stage("b2", 0, updates(["a"], 250, diff=-1)), SinkState(200), SinkState(300)
    )
    assert sink.read_updates(199).column("_diff").to_pylist() == [1]
    assert sorted(sink.read_updates(300).column("_diff").to_pylist()) == [-1, 1]


def test_timestamps_are_stored_as_delta_timestamps(tmp_path: Path) -> None:
    user = pa.schema([("at", pa.timestamp("ms"))])
    s = DeltaSink(NAME, tmp_path / "ts")
    s.ensure(user)
    base = updates(["x"], 5).drop_columns(["k", "v"])
    rows = pa.table([pa.array([1_700_000_000_123], pa.timestamp("ms")), *base.columns],
                    names=["at", *base.column_names])
    s.commit(s.stager().stage("b", 0, rows), SinkState(), SinkState(6))
    (got,) = s.read_updates().column("at").to_pylist()
    assert got == rows.column("at")[0].as_py()


def test_a_table_on_table_features_lists_the_invariants_spark_requires(tmp_path: Path) -> None:
    """A timestamp without a zone moves a table to table features (writer
    version 7); delta-rs then listed only ``timestampNtz``, and Spark's Delta
    refused the table because reclock's NOT NULL columns imply
    ``invariants`` (tests/sinks/test_delta_interop.py reads it with Spark).
    A table made before the fix is mended when the sink next opens it."""
    user = pa.schema([("at", pa.timestamp("us"))])
    s = DeltaSink(NAME, tmp_path / "ntz")
    s.ensure(user)
    p = DeltaTable(str(tmp_path / "ntz")).protocol()
    assert p.min_writer_version == 7
    assert set(p.writer_features or []) == {"timestampNtz", "invariants"}
    old = tmp_path / "old"
    DeltaTable.create(str(old), Schema.from_arrow(output_schema(user)))
    assert "invariants" not in (DeltaTable(str(old)).protocol().writer_features or [])
    DeltaSink(NAME, old).ensure(user)
    assert "invariants" in (DeltaTable(str(old)).protocol().writer_features or [])
    plain = tmp_path / "plain"  # a zoned timestamp: legacy protocol, nothing to list
    DeltaSink(NAME, plain).ensure(pa.schema([("at", pa.timestamp("us", tz="UTC"))]))
    assert DeltaTable(str(plain)).protocol().min_writer_version < 7


def test_nanoseconds_delta_cannot_store_are_error_rows(tmp_path: Path) -> None:
    """Bad input is data: a timestamp or duration with a sub-microsecond part
    (Delta keeps microseconds) must not fail the whole stage for good: that
    row is an error row naming the column, and the rest of the batch lands."""
    user = pa.schema([("at", pa.timestamp("ns")), ("took", pa.duration("ns"))])
    s = DeltaSink(NAME, tmp_path / "ns")
    s.ensure(user)
    base = updates(["a", "b", "c", "d"], 5).drop_columns(["k", "v"])
    rows = pa.table([pa.array([1_000, 1_001, None, 2_000], pa.timestamp("ns")),
                     pa.array([5_000, 0, 7, None], pa.duration("ns")), *base.columns],
                    names=["at", "took", *base.column_names])
    staged = s.stager().stage("b", 0, rows)
    assert sum(d["errors"] for d in staged) == 2
    s.commit(staged, SinkState(), SinkState(6))
    got = s.read_updates().sort_by("_src_offset").to_pylist()
    assert [(r["_error"] is None) for r in got] == [True, False, False, True]
    assert "'at' holds a value with nanoseconds" in got[1]["_error"]
    assert "'took'" in got[2]["_error"]
    assert got[3]["at"] is not None and got[3]["took"] is None


def test_large_stage_is_split_into_files_of_bounded_rows(tmp_path: Path) -> None:
    s = DeltaSink(NAME, tmp_path / "split", rows_per_file=3)
    s.ensure(USER)
    staged = s.stager().stage("big", 12, updates([f"k{i}" for i in range(7)], 1))
    assert [(d["path"], d["rows"]) for d in staged] == [
        ("part-big-00012-000.parquet", 3),
        ("part-big-00012-001.parquet", 3),
        ("part-big-00012-002.parquet", 1),
    ]
    s.commit(staged, SinkState(), SinkState(2))
    assert s.read_updates().num_rows == 7


def test_part_numbers_beyond_five_digits_keep_working(sink: DeltaSink) -> None:
    # The data plane numbers parts task * 10_000 + flush.
    staged = sink.stager().stage("b", 123_456, updates(["a"], 1))
    assert staged[0]["path"] == "part-b-123456-000.parquet"
    sink.commit(staged, SinkState(), SinkState(2))
    assert sink.read_updates().num_rows == 1


def test_restaging_overwrites_the_same_files(sink: DeltaSink) -> None:
    stager = sink.stager()
    first = stager.stage("b1", 0, updates(["a", "b"], 1))
    second = stager.stage("b1", 0, updates(["c", "d"], 1))
    assert [d["path"] for d in first] == [d["path"] for d in second]
    assert len(list(sink.path.glob("*.parquet"))) == 1
    assert not list(sink.path.glob(".*.tmp"))
    sink.commit(second, SinkState(), SinkState(2))
    assert keys(sink.read_updates()) == ["c", "d"]


def test_empty_table_stages_nothing(sink: DeltaSink) -> None:
    assert sink.stager().stage("b1", 0, updates([], 1)) == []
    assert not list(sink.path.glob("*.parquet"))


def test_commit_without_files_moves_the_upper(sink: DeltaSink) -> None:
    sink.commit([], SinkState(), SinkState(5000, "[]"))
    assert sink.state() == SinkState(5000, "[]")
    sink.commit([], SinkState(5000, "[]"), SinkState(6000, "[]"))
    assert sink.state() == SinkState(6000, "[]")
    assert sink.read_updates().num_rows == 0


def test_progress_moves_while_the_upper_stays(sink: DeltaSink) -> None:
    sink.commit(sink.stager().stage("a", 0, updates(["a"], 0)), SinkState(), SinkState(0, "p1"))
    assert sink.state() == SinkState(0, "p1")
    sink.commit(sink.stager().stage("b", 0, updates(["b"], 0)), SinkState(0, "p1"),
                SinkState(0, "p2"))
    assert sink.state() == SinkState(0, "p2")


def test_closed_upper(sink: DeltaSink) -> None:
    sink.commit([], SinkState(), SinkState(100, "p"))
    sink.commit([], SinkState(100, "p"), SinkState(None, "[]"))
    assert sink.state() == SinkState(None, "[]")
    assert DeltaTable(str(sink.path)).transaction_version(sink.app_id) == CLOSED
    assert DeltaSink(NAME, sink.path).state() == SinkState(None, "[]")
    sink.commit([], SinkState(None, "[]"), SinkState(None, "[]"))  # closed stays closed


def test_two_outputs_in_one_table_keep_separate_states(tmp_path: Path) -> None:
    a = DeltaSink("s.a", tmp_path / "t")
    b = DeltaSink("s.b", tmp_path / "t")
    a.ensure(USER)
    a.commit([], SinkState(), SinkState(10, "pa"))
    b.commit([], SinkState(), SinkState(20, "pb"))
    a.commit([], SinkState(10, "pa"), SinkState(30, "pa2"))
    assert a.state() == SinkState(30, "pa2")
    assert b.state() == SinkState(20, "pb")


# -- fencing -----------------------------------------------------------------------------


def test_delta_rs_rejects_a_stale_commit_of_the_same_app_id(tmp_path: Path) -> None:
    """Pins the delta-rs behaviour the fence relies on (deltalake 1.6.6): a
    commit built on snapshot v fails when a commit after v carries a txn of the
    same appId, even with unrelated commits in between; other appIds pass."""
    path = str(tmp_path / "t")
    DeltaTable.create(path, Schema.from_arrow(SCHEMA))

    def commit(dt: DeltaTable, app: str, version: int) -> None:
        props = CommitProperties(app_transactions=[Transaction(app, version)])
        dt.create_write_transaction([], "append", dt.schema(), commit_properties=props)

    stale = DeltaTable(path)
    commit(DeltaTable(path), "reclock:x", 1)  # another app: no conflict with ours
    commit(DeltaTable(path), "reclock:o", 1)  # ours, from a fresh snapshot
    commit(DeltaTable(path), "reclock:x", 2)
    with pytest.raises(CommitFailedError, match="Concurrent transaction"):
        commit(stale, "reclock:o", 1)
    behind_other_only = DeltaTable(path)
    commit(DeltaTable(path), "reclock:x", 3)
    commit(behind_other_only, "reclock:o", 2)  # only foreign commits since: fine
    assert DeltaTable(path).transaction_version("reclock:o") == 2


def test_a_commit_between_our_check_and_our_commit_fences_us(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interleaving a lock cannot cover across machines, made
    deterministic: A checks, B checks and commits, A commits. Without the
    lock, delta-rs's conflict check must turn A's commit into SinkFenced."""
    path = tmp_path / "t"
    a = DeltaSink(NAME, path, lock=False)
    b = DeltaSink(NAME, path, lock=False)
    a.ensure(USER)
    a_staged = a.stager().stage("a", 0, updates(["from-a"], 1))
    b_staged = b.stager().stage("b", 0, updates(["from-b"], 1))
    real_state_of = a._state_of
    checks = []

    def check_then_let_b_win(dt: DeltaTable) -> SinkState:
        state = real_state_of(dt)
        checks.append(state)
        if len(checks) == 1:
            b.commit(b_staged, SinkState(), SinkState(10, "b"))
        return state

    monkeypatch.setattr(a, "_state_of", check_then_let_b_win)
    with pytest.raises(SinkFenced):
        a.commit(a_staged, SinkState(), SinkState(10, "a"))
    # A passed its check, lost in delta-rs, re-checked from a new snapshot.
    assert checks == [SinkState(), SinkState(10, "b")]
    assert b.state() == SinkState(10, "b")
    assert keys(b.read_updates()) == ["from-b"]


def _check_race(path: Path, results: list[tuple[int, int, str]], racers: int, rounds: int) -> None:
    assert len(results) == racers * rounds
    winners: dict[int, int] = {}
    for r, who, outcome in results:
        if outcome == "ok":
            assert r not in winners, f"round {r}: racers {winners[r]} and {who} both committed"
            winners[r] = who
    assert sorted(winners) == list(range(rounds)), "every round has exactly one winner"
    got = DeltaSink(NAME, path).read_updates()
    assert keys(got) == sorted(f"w{w}r{r}" for r, w in winners.items())
    last = rounds - 1
    assert DeltaSink(NAME, path).state() == SinkState(rounds, f'"w{winners[last]}r{last}"')


@pytest.mark.parametrize("lock", [True, False], ids=["flock", "delta-only"])
def test_racing_threads_never_both_commit(tmp_path: Path, lock: bool) -> None:
    racers, rounds = 4, 12
    path = tmp_path / "race"
    DeltaSink(NAME, path).ensure(USER)
    barrier = threading.Barrier(racers)
    results: queue.Queue[tuple[int, int, str]] = queue.Queue()
    errors: list[BaseException] = []

    def run(who: int) -> None:
        try:
            race_commits(str(path), NAME, lock, who, rounds, barrier, results)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    _check_race(path, [results.get_nowait() for _ in range(results.qsize())], racers, rounds)


@pytest.mark.parametrize("lock", [True, False], ids=["flock", "delta-only"])
def test_racing_processes_never_both_commit(tmp_path: Path, lock: bool) -> None:
    racers, rounds = 4, 8
    path = tmp_path / "race"
    DeltaSink(NAME, path).ensure(USER)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(racers, timeout=120)
    results: Any = ctx.Queue()
    procs = [
        ctx.Process(target=race_commits, args=(str(path), NAME, lock, i, rounds, barrier, results))
        for i in range(racers)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=180) for _ in range(racers * rounds)]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    _check_race(path, got, racers, rounds)


def test_an_unrelated_concurrent_commit_is_retried_not_fenced(
    sink: DeltaSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A schema change landing between our check and our commit makes delta-rs
    fail the commit; the state is still ours, so the sink retries."""
    real_load = sink._load
    calls = {"n": 0}

    def load_then_interfere() -> DeltaTable:
        dt = real_load()
        calls["n"] += 1
        if calls["n"] == 1:  # another writer adds a column (a commit of its own)
            DeltaTable(str(sink.path)).alter.add_columns(
                [Field("extra", "integer", nullable=True)])
        return dt

    monkeypatch.setattr(sink, "_load", load_then_interfere)
    sink.commit(sink.stager().stage("b", 0, updates(["a"], 1)), SinkState(), SinkState(2, "p"))
    assert calls["n"] >= 2
    assert sink.state() == SinkState(2, "p")
    assert keys(sink.read_updates()) == ["a"]


# -- durability of the state -------------------------------------------------------------


def test_state_survives_checkpoints(sink: DeltaSink) -> None:
    for i in range(120):
        staged = sink.stager().stage(f"b{i}", 0, updates([f"k{i}"], i)) if i % 10 == 0 else []
        sink.commit(staged, sink.state() if i == 0 else SinkState(i, f"p{i}"),
                    SinkState(i + 1, f"p{i + 1}"))
    last = json.loads((sink.path / "_delta_log" / "_last_checkpoint").read_text())
    assert last["version"] >= 100
    assert sink.state() == SinkState(120, "p120")
    # What cleanup_metadata may delete once expired: every log entry before the
    # checkpoint. The state does not need them.
    for v in log_versions(sink.path):
        if v < last["version"]:
            (sink.path / "_delta_log" / f"{v:020d}.json").unlink()
    fresh = DeltaSink(NAME, sink.path)
    assert fresh.state() == SinkState(120, "p120")
    assert fresh.read_updates().num_rows == 12


def test_progress_cleaned_up_with_the_log_is_a_loud_error(tmp_path: Path) -> None:
    """The checkpoint keeps the txn (the upper), not the commitInfo (the
    progress): an upper without its progress would make the driver write
    records again, so this is an error with the fix, never a silent None."""
    path = tmp_path / "t"
    DeltaTable.create(
        str(path), Schema.from_arrow(SCHEMA),
        configuration={"delta.logRetentionDuration": "interval 0 seconds"},
    )
    s = DeltaSink(NAME, path)
    s.ensure(USER)
    s.commit([], SinkState(), SinkState(10, "p10"))
    for i in range(105):  # a foreign writer, whose commits checkpoint and clean up the log
        dt = DeltaTable(str(path))
        props = CommitProperties(app_transactions=[Transaction("someone", i)])
        dt.create_write_transaction([], "append", dt.schema(), commit_properties=props)
    dt = DeltaTable(str(path))
    dt.create_checkpoint()
    dt.cleanup_metadata()
    assert min(log_versions(path)) > 1
    with pytest.raises(SinkError, match="no longer holds the commit") as err:
        s.state()
    assert "logRetentionDuration" in (err.value.hint or "")


def test_progress_found_behind_foreign_commits(sink: DeltaSink) -> None:
    sink.commit([], SinkState(), SinkState(10, "p10"))
    for i in range(5):
        dt = DeltaTable(str(sink.path))
        props = CommitProperties(app_transactions=[Transaction("someone", i)],
                                 custom_metadata={"reclock.upper": 999})
        dt.create_write_transaction([], "append", dt.schema(), commit_properties=props)
    assert sink.state() == SinkState(10, "p10")
    sink.commit([], SinkState(10, "p10"), SinkState(11, "p11"))
    assert sink.state() == SinkState(11, "p11")


# -- log entries reclock writes itself ---------------------------------------------------


def _entry(path: Path, version: int) -> list[dict[str, Any]]:
    text = (path / "_delta_log" / f"{version:020d}.json").read_text()
    return [json.loads(line) for line in text.splitlines()]


def _engine(path: Path, version: int) -> str:
    return str(next(a["commitInfo"] for a in _entry(path, version) if "commitInfo" in a)
               ["engineInfo"])


def test_appends_are_log_entries_of_reclocks_own_that_delta_rs_reads(sink: DeltaSink) -> None:
    """A commit on a local table writes its log entry itself: commitInfo
    with the progress, an add action per file, the txn. delta-rs reads the
    table's rows, state and history from those entries, and so does a
    checkpoint it writes over them."""
    staged = sink.stager().stage("b1", 0, updates(["a", "b"], 5))
    sink.commit(staged, SinkState(), SinkState(6, "p6"))
    v = log_versions(sink.path)[-1]
    entry = _entry(sink.path, v)
    assert [next(iter(a)) for a in entry] == ["commitInfo", "add", "txn"]
    info, add, txn = entry[0]["commitInfo"], entry[1]["add"], entry[2]["txn"]
    assert info["engineInfo"] == "reclock" and info["readVersion"] == v - 1
    assert (info["reclock.upper"], info["reclock.progress"]) == (6, "p6")
    assert add["path"] == staged[0]["path"] and add["size"] == staged[0]["size"]
    assert json.loads(add["stats"])["numRecords"] == 2 and add["dataChange"] is True
    assert (txn["appId"], txn["version"]) == (f"reclock:{NAME}", 6)
    dt = DeltaTable(str(sink.path))
    assert dt.version() == v and dt.transaction_version(f"reclock:{NAME}") == 6
    assert dt.history(1)[0]["operation"] == "WRITE"
    assert keys(dt.to_pyarrow_table()) == ["a", "b"]
    for i in range(6, 6 + delta_mod.CHECKPOINT_INTERVAL):
        sink.commit(sink.stager().stage(f"c{i}", 0, updates([f"k{i}"], i)),
                    SinkState(i, f"p{i}"), SinkState(i + 1, f"p{i + 1}"))
    assert (sink.path / "_delta_log" / "_last_checkpoint").exists()
    fresh = DeltaSink(NAME, sink.path)
    assert fresh.state() == SinkState(31, "p31")
    assert fresh.read_updates().num_rows == 2 + delta_mod.CHECKPOINT_INTERVAL


def test_a_table_with_a_writer_feature_reclock_does_not_honour_is_committed_by_delta_rs(
    sink: DeltaSink,
) -> None:
    """A check constraint (writer protocol 3) is beyond what reclock's own
    entries honour: delta-rs writes the commits, and they still land."""
    sink.commit([], SinkState(), SinkState(1, "p1"))
    assert _engine(sink.path, log_versions(sink.path)[-1]) == "reclock"
    DeltaTable(str(sink.path)).alter.add_constraint({"v_non_negative": "v >= 0"})
    for i in (1, 2):
        sink.commit(sink.stager().stage(f"b{i}", 0, updates([f"k{i}"], i)),
                    SinkState(i, f"p{i}"), SinkState(i + 1, f"p{i + 1}"))
        assert _engine(sink.path, log_versions(sink.path)[-1]).startswith("delta-rs")
    assert DeltaSink(NAME, sink.path).state() == SinkState(3, "p3")
    assert keys(sink.read_updates()) == ["k1", "k2"]


def test_a_commit_after_a_foreign_one_lands_after_it_and_a_zombies_commit_fences(
    sink: DeltaSink,
) -> None:
    """The sink knows version v from its own last commit. Another writer's
    commit since (not of this output) takes v+1: the sink's entry lands at
    v+2. A commit of this output by someone else (a zombie driver, through
    delta-rs) since: the sink is fenced, though its own last commit says its
    state is the one expected."""
    sink.commit([], SinkState(), SinkState(1, "p1"))
    other = DeltaSink("someone.else", sink.path)
    other.commit([], SinkState(), SinkState(7, "x"))
    before = log_versions(sink.path)[-1]
    sink.commit(sink.stager().stage("b", 0, updates(["a"], 1)), SinkState(1, "p1"),
                SinkState(2, "p2"))
    assert log_versions(sink.path) == list(range(before + 2))
    assert _engine(sink.path, before + 1) == "reclock"
    assert sink.state() == SinkState(2, "p2") and other.state() == SinkState(7, "x")

    zombie = DeltaSink(NAME, sink.path)
    zombie.commit(zombie.stager().stage("z", 0, updates(["z"], 2)), SinkState(2, "p2"),
                  SinkState(3, "zombie"))
    with pytest.raises(SinkFenced, match="durable state is"):
        sink.commit(sink.stager().stage("c", 0, updates(["c"], 2)), SinkState(2, "p2"),
                    SinkState(3, "p3"))
    assert sink.state() == SinkState(3, "zombie")
    assert keys(sink.read_updates()) == ["a", "z"]


def test_a_table_made_again_under_the_same_path_is_not_appended_to_blindly(
    sink: DeltaSink,
) -> None:
    """The table is removed and created again while the sink runs: its
    versions start over, so the version the sink committed last is gone.
    The sink loads the new table, which holds another state: fenced, and no
    entry past the new table's end."""
    for i in range(3):
        sink.commit([], SinkState() if i == 0 else SinkState(i, f"p{i}"),
                    SinkState(i + 1, f"p{i + 1}"))
    import shutil

    shutil.rmtree(sink.path)
    DeltaSink(NAME, sink.path).ensure(USER)
    with pytest.raises(SinkFenced):
        sink.commit([], SinkState(3, "p3"), SinkState(4, "p4"))
    assert log_versions(sink.path) == [0]


def test_a_killed_commits_temp_file_is_ignored_and_vacuumed(tmp_path: Path) -> None:
    clock = ManualClock(int((os.path.getmtime(tmp_path) + 10) * 1000))
    s = DeltaSink(NAME, tmp_path / "t", clock=clock)
    s.ensure(USER)
    s.commit([], SinkState(), SinkState(1, "p1"))
    v = log_versions(s.path)[-1]
    temp = f".{v + 1:020d}.json.{'ab' * 16}.tmp"
    (s.path / "_delta_log" / temp).write_text('{"commitInfo": {"half')  # killed mid-write
    assert DeltaTable(str(s.path)).version() == v
    s.commit([], SinkState(1, "p1"), SinkState(2, "p2"))
    assert DeltaSink(NAME, s.path).state() == SinkState(2, "p2")
    assert s.vacuum_orphans(grace_seconds=3600) == []
    clock.advance(3_601_000)
    assert s.vacuum_orphans(grace_seconds=3600) == [f"_delta_log/{temp}"]
    assert not (s.path / "_delta_log" / temp).exists()


def slow_checkpoint(location: Location, cleanup_every: int) -> int:
    """A checkpoint (in the child) that waits for the test to let it go."""
    root = Path(location.root)
    (root / "writing").touch()
    deadline = time.monotonic() + 60
    while not (root / "release").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return delta_mod.checkpoint_table(location, cleanup_every)


def test_a_pipelines_sink_checkpoints_aside_and_no_commit_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``checkpoint_aside`` (the file sink of a pipeline) the process's
    checkpointer thread has the checkpoints written (in a child): commits
    go on while one is being written, and it is written."""
    s = DeltaSink(NAME, tmp_path / "t", checkpoint_aside=True)
    s.ensure(USER)
    monkeypatch.setattr(delta_mod, "checkpoint_table", slow_checkpoint)
    n = 2 * delta_mod.CHECKPOINT_INTERVAL
    for i in range(n):
        s.commit(s.stager().stage(f"b{i}", 0, updates([f"k{i}"], i)),
                 SinkState() if i == 0 else SinkState(i, f"p{i}"), SinkState(i + 1, f"p{i + 1}"))
    deadline = time.monotonic() + 30
    while not (s.path / "writing").exists():
        assert time.monotonic() < deadline, "no checkpoint was asked for"
        time.sleep(0.02)
    assert not (s.path / "_delta_log" / "_last_checkpoint").exists()  # none had to wait
    (s.path / "release").touch()
    deadline = time.monotonic() + 30
    while delta_mod._CHECKPOINTER.pending() or not (
            s.path / "_delta_log" / "_last_checkpoint").exists():
        assert time.monotonic() < deadline, "the checkpoint was never written"
        time.sleep(0.05)
    version = json.loads((s.path / "_delta_log" / "_last_checkpoint").read_text())["version"]
    assert version >= delta_mod.CHECKPOINT_INTERVAL
    assert DeltaSink(NAME, s.path).state() == SinkState(n, f"p{n}")
    assert DeltaSink(NAME, s.path).read_updates().num_rows == n


_EXIT_DURING_CHECKPOINT = """
import sys, time
from deltalake import DeltaTable
import reclock.sinks.delta as delta_mod
from reclock.contracts.sink import SinkState
from tests.sinks.rows import USER

real = DeltaTable.create_checkpoint
def slow(dt):
    print("writing", flush=True)
    time.sleep(1.0)
    real(dt)
DeltaTable.create_checkpoint = slow
s = delta_mod.DeltaSink("o", sys.argv[1], checkpoint_aside=True)
s.ensure(USER)
for i in range(delta_mod.CHECKPOINT_INTERVAL):
    s.commit([], SinkState() if i == 0 else SinkState(i), SinkState(i + 1))
while delta_mod._CHECKPOINTER.pending():
    time.sleep(0.01)
"""


def test_a_process_exiting_while_a_checkpoint_is_written_waits_for_it(tmp_path: Path) -> None:
    """The interpreter exits while the checkpointer thread is inside a
    checkpoint written in the process (``RECLOCK_IN_PROCESS=1``): the thread
    finishes it first (a daemon thread left inside delta-rs at finalization
    killed a stopping driver with SIGSEGV), and the process exits cleanly."""
    path = tmp_path / "t"
    out = _in_a_fresh_process(_EXIT_DURING_CHECKPOINT, path, in_process=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "writing" in out.stdout
    assert (path / "_delta_log" / "_last_checkpoint").exists()


# -- orphans -----------------------------------------------------------------------------


def test_orphans_are_invisible_and_vacuumed_after_the_grace_period(tmp_path: Path) -> None:
    clock = ManualClock(int((os.path.getmtime(tmp_path) + 10) * 1000))
    s = DeltaSink(NAME, tmp_path / "t", clock=clock)
    s.ensure(USER)
    committed = s.stager().stage("ok", 0, updates(["a"], 1))
    s.commit(committed, SinkState(), SinkState(2))
    # A crash between stage and commit leaves these behind.
    orphan = s.stager().stage("crashed", 0, updates(["x", "y"], 1))
    (s.path / ".part-crashed-00001-000.parquet.0123abcd.tmp").write_bytes(b"half")
    (s.path / "someone-elses.parquet").write_bytes(b"not ours")
    assert keys(s.read_updates()) == ["a"]
    assert keys(DeltaSink(NAME, s.path).read_updates()) == ["a"]

    assert s.vacuum_orphans(grace_seconds=3600) == []  # too young: may be a running job
    clock.advance(3_601_000)
    removed = s.vacuum_orphans(grace_seconds=3600)
    assert removed == sorted([orphan[0]["path"], ".part-crashed-00001-000.parquet.0123abcd.tmp"])
    assert (s.path / committed[0]["path"]).exists()
    assert (s.path / "someone-elses.parquet").exists()
    assert keys(s.read_updates()) == ["a"]
    assert s.state() == SinkState(2)


def test_a_vacuum_reads_the_table_only_when_the_directory_holds_a_file_it_does_not_know(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver of a thousand outputs vacuums 17 of them a second: a pass
    whose directory holds only files the table referenced or kept at the
    last read, or that the sink committed since, lists the directory and
    reads nothing else; an unknown old staged file (and every
    FULL_VACUUM_EVERY-th pass) reads the table."""
    clock = ManualClock(int((os.path.getmtime(tmp_path) + 10) * 1000))
    s = DeltaSink(NAME, tmp_path / "t", clock=clock,
                  compaction=delta_mod.Compaction(in_child=False))  # (counted here)
    s.ensure(USER)
    reads = []
    real = delta_mod.orphan_files

    def counted(*args: Any) -> Any:
        reads.append(1)
        return real(*args)

    monkeypatch.setattr(delta_mod, "orphan_files", counted)
    monkeypatch.setattr(delta_mod, "FULL_VACUUM_EVERY", 5)
    st = SinkState()
    for i in range(3):
        new = SinkState(i + 1)
        s.commit(s.stager().stage(f"b{i}", 0, updates([f"k{i}"], i)), st, new)
        st = new
    # (the clock is ahead of every file: each is old enough to be an orphan)
    assert s.vacuum_orphans(grace_seconds=1) == [] and len(reads) == 1  # the first pass
    assert s.vacuum_orphans(grace_seconds=1) == [] and len(reads) == 1
    s.commit(s.stager().stage("b3", 0, updates(["k3"], 3)), st, SinkState(4))
    assert s.vacuum_orphans(grace_seconds=1) == [] and len(reads) == 1  # committed: known
    orphan = s.stager().stage("crashed", 0, updates(["x"], 9))
    assert s.vacuum_orphans(grace_seconds=1) == [orphan[0]["path"]] and len(reads) == 2
    assert s.vacuum_orphans(grace_seconds=1) == [] and len(reads) == 2
    assert s.vacuum_orphans(grace_seconds=1) == [] and len(reads) == 3  # the 6th pass
    # A file the table references that this sink did not commit (another
    # writer's) is read for once, then known.
    other = DeltaSink(NAME, s.path, lock=False)
    other.commit(other.stager().stage("w", 0, updates(["w"], 5)), SinkState(4), SinkState(5))
    assert s.vacuum_orphans(grace_seconds=1) == [] and len(reads) == 4
    assert s.vacuum_orphans(grace_seconds=1) == [] and len(reads) == 4
    assert keys(DeltaSink(NAME, s.path).read_updates()) == ["k0", "k1", "k2", "k3", "w"]


def test_vacuum_passes_hold_no_name_per_file_of_the_directory(tmp_path: Path) -> None:
    """Against a model of the directory (what was committed, what was
    staged and left): after every pass with no grace, exactly the committed
    files remain and each orphan went at the first pass after it was
    staged; what the sink holds to account for files between passes is the
    files committed since the last pass, not the directory (a day of small
    files with the default retention: 86,400 names an output)."""
    import random

    rnd = random.Random(17)
    s = DeltaSink(NAME, tmp_path / "t", compaction=delta_mod.Compaction(in_child=False))
    s.ensure(USER)
    committed: set[str] = set()
    orphans: set[str] = set()
    since_pass = 0
    model_keys: list[str] = []
    st = SinkState()
    for step in range(60):
        op = rnd.choice(["commit", "commit", "commit", "orphan", "vacuum"])
        if op == "commit":
            files = s.stager().stage(f"b{step}", 0, updates([f"k{step}"], step))
            new = SinkState(st.upper + 1)
            s.commit(files, st, new)
            st = new
            committed |= {f["path"] for f in files}
            model_keys.append(f"k{step}")
            since_pass += len(files)
        elif op == "orphan":
            orphans |= {f["path"] for f in s.stager().stage(f"lost{step}", 0,
                                                            updates(["x"], step))}
        else:
            assert s.vacuum_orphans(grace_seconds=0) == sorted(orphans)
            orphans.clear()
            staged = {p.name for p in s.path.glob("part-*.parquet")}
            assert staged == committed
            assert len(s._kept) <= since_pass
            since_pass = 0
    assert sorted(keys(s.read_updates())) == sorted(model_keys)


def test_a_vacuum_judges_files_by_the_clock_that_is_behind(tmp_path: Path) -> None:
    """A pass skips the files an earlier pass judged: those last written
    ``grace`` before it by the sink's clock and by the file system's,
    whichever is behind. With the sink's clock an hour behind the files',
    an orphan written a minute ago is young at the first passes, and the
    first pass after the clock reaches it still finds it without reading
    the table for that (not judged by the file system's time alone)."""
    real = time.time()
    clock = ManualClock(int((real - 3600) * 1000))
    s = DeltaSink(NAME, tmp_path / "t", clock=clock,
                  compaction=delta_mod.Compaction(in_child=False))
    s.ensure(USER)
    s.commit(s.stager().stage("b", 0, updates(["a"], 1)), SinkState(), SinkState(1))
    orphan = s.stager().stage("lost", 0, updates(["x"], 2))[0]["path"]
    os.utime(s.path / orphan, (real - 60, real - 60))
    assert s.vacuum_orphans(grace_seconds=1) == []  # (the first pass reads the table)
    assert s.vacuum_orphans(grace_seconds=1) == []  # young by the sink's clock
    clock.set(int((real + 10) * 1000))
    assert s.vacuum_orphans(grace_seconds=1) == [orphan]
    assert keys(s.read_updates()) == ["a"]


def test_a_file_of_the_passes_millisecond_is_old_enough_for_no_grace(tmp_path: Path) -> None:
    """The sink's clock counts milliseconds and the file system nanoseconds:
    a file written in the millisecond a pass starts is as old as no grace
    asks. (CI once saw an orphan staged just before a pass outlive it.)"""
    s = DeltaSink(NAME, tmp_path / "t", clock=ManualClock(0))
    s.ensure(USER)
    orphan = s.stager().stage("lost", 0, updates(["x"], 2))[0]["path"]
    ms = int(os.path.getmtime(s.path / orphan) * 1000) - 5
    os.utime(s.path / orphan, ns=(ms * 1_000_000 + 700_000,) * 2)  # 0.7 ms into it
    s._clock = ManualClock(ms)
    assert s.vacuum_orphans(grace_seconds=0) == [orphan]


def test_commits_and_vacuums_intern_no_file_name(tmp_path: Path, monkeypatch: Any) -> None:
    """The names of part files, log entries and temp files are new every
    commit. Interned (this Python's pathlib interns each component of a path
    it parses), they churn the interpreter's table of interned strings, which
    then resizes in a long run (a 3.7 MiB step in the soak). A sink's
    commits, vacuums and maintenance intern none of them."""
    import re
    import sys

    s = DeltaSink(NAME, tmp_path / "t", compaction=delta_mod.Compaction(in_child=False))
    s.ensure(USER)
    st = SinkState()
    seen: list[str] = []
    real = sys.intern

    def recording(name: str) -> str:
        seen.append(name)
        return real(name)

    monkeypatch.setattr(sys, "intern", recording)
    for step in range(4):
        files = s.stager().stage(f"b{step}", 0, updates([f"k{step}"], step))
        new = SinkState(st.upper + 1)
        s.commit(files, st, new)
        st = new
        s.stager().stage(f"lost{step}", 0, updates(["x"], step))
        s.vacuum_orphans(grace_seconds=0)
        s.maintain(int(time.time() * 1000))
    monkeypatch.setattr(sys, "intern", real)
    named = re.compile(r".*(\.parquet|\.json|\.tmp|\.crc)$|part-.*")
    assert [n for n in seen if named.fullmatch(n)] == []
    assert sorted(keys(s.read_updates())) == ["k0", "k1", "k2", "k3"]


def test_commit_of_a_vacuumed_file_fails_and_writes_nothing(tmp_path: Path) -> None:
    clock = ManualClock(0)
    s = DeltaSink(NAME, tmp_path / "t", clock=clock)
    s.ensure(USER)
    staged = s.stager().stage("slow", 0, updates(["a"], 1))
    clock.set(int((os.path.getmtime(s.path / staged[0]["path"]) + 10) * 1000))
    assert s.vacuum_orphans(grace_seconds=1) == [staged[0]["path"]]
    with pytest.raises(SinkError, match="gone"):
        s.commit(staged, SinkState(), SinkState(2))
    assert s.state() == SinkState()


# -- errors ------------------------------------------------------------------------------


@pytest.fixture
def unwritable(tmp_path: Path) -> Iterator[Path]:
    """A path nothing can be created under. Tests run as root, which ignores
    permission bits, so then the parent is a regular file instead."""
    if os.geteuid() == 0:
        blocker = tmp_path / "blocker"
        blocker.write_text("a regular file, not a directory")
        yield blocker / "out"
        return
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        yield ro / "out"
    finally:
        ro.chmod(0o700)


def test_ensure_on_an_unwritable_path_names_the_path(unwritable: Path) -> None:
    with pytest.raises(SinkError) as info:
        DeltaSink(NAME, unwritable / "t").ensure(USER)
    msg = str(info.value)
    assert NAME in msg and str(unwritable) in msg
    assert "permission denied" in msg or "not a directory" in msg


def test_stage_on_an_unwritable_path_names_the_path(unwritable: Path) -> None:
    stager = DeltaStager(NAME, Location.of(NAME, unwritable), SCHEMA)
    with pytest.raises(SinkError) as info:
        stager.stage("b", 0, updates(["a"], 1))
    msg = str(info.value)
    assert NAME in msg and str(unwritable) in msg
    assert "permission denied" in msg or "not a directory" in msg


@pytest.mark.parametrize(
    ("code", "words"),
    [(errno.ENOSPC, "disk full"), (errno.EACCES, "permission denied"),
     (errno.EROFS, "read-only file system")],
)
def test_write_failures_become_sink_errors(
    sink: DeltaSink, monkeypatch: pytest.MonkeyPatch, code: int, words: str
) -> None:
    def fail(table: pa.Table, f: Any) -> None:
        f.write(b"partial")
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(delta_mod, "_write_parquet", fail)
    with pytest.raises(SinkError) as info:
        sink.stager().stage("b", 0, updates(["a"], 1))
    msg = str(info.value)
    assert words in msg and NAME in msg and "part-b-00000-000.parquet" in msg
    assert not [p for p in os.listdir(sink.path) if p.endswith((".tmp", ".parquet"))]


def test_staging_checks_the_stored_schema(sink: DeltaSink) -> None:
    stager = sink.stager()
    with pytest.raises(SinkError, match="surprise"):
        stager.stage("b", 0, updates(["a"], 1).append_column("surprise", pa.array([1])))
    bad = updates(["a"], 1).set_column(2, "_into_time", pa.array([None], pa.int64()))
    with pytest.raises(SinkError, match="NOT NULL"):
        stager.stage("b", 0, bad)
    with pytest.raises(ValueError, match="batch id"):
        stager.stage("../escape", 0, updates(["a"], 1))
    # Missing nullable columns and other integer widths are fine.
    loose = updates(["a"], 1).drop_columns(["v", "_raw_key"]).set_column(
        0, "k", pa.array(["a"], pa.large_string())
    )
    sink.commit(stager.stage("b", 0, loose), SinkState(), SinkState(2))
    assert sink.read_updates().column("v").to_pylist() == [None]


def test_commit_before_ensure_is_a_sink_error(tmp_path: Path) -> None:
    with pytest.raises(SinkError, match="ensure"):
        DeltaSink(NAME, tmp_path / "nothing").commit([], SinkState(), SinkState(1))


def test_stager_pickles(sink: DeltaSink) -> None:
    stager = pickle.loads(pickle.dumps(sink.stager()))
    staged = stager.stage("p", 0, updates(["a"], 1))
    sink.commit(staged, SinkState(), SinkState(2))
    assert keys(sink.read_updates()) == ["a"]


def test_only_low_cardinality_columns_are_dictionary_encoded(tmp_path: Path) -> None:
    """Staged Parquet files dictionary-encode the columns with few distinct
    values (in an even sample) and write the others plain; the data is the same."""
    import pyarrow.parquet as pq

    from reclock.sinks.delta import _write_parquet, dictionary_columns

    n = 10_000
    t = pa.table({"id": pa.array(range(n), pa.int64()),
                  "text": pa.array([f"row {i}" for i in range(n)]),
                  "kind": pa.array(["a", "b", None, "c"] * (n // 4)),
                  "into": pa.array([1000] * n, pa.int64()),
                  "tags": pa.array([[1, 2]] * n, pa.list_(pa.int32()))})
    assert dictionary_columns(t) == ["kind", "into"]
    assert dictionary_columns(t.slice(0, 0)) == ["id", "text", "kind", "into"]
    path = tmp_path / "f.parquet"
    with path.open("wb") as f:
        _write_parquet(t, f)
    meta = pq.ParquetFile(path).metadata.row_group(0)
    encodings = {meta.column(i).path_in_schema: meta.column(i).encodings
                 for i in range(meta.num_columns)}
    for name in ("kind", "into"):
        assert any("DICTIONARY" in e for e in encodings[name]), encodings
    for name in ("id", "text"):
        assert not any("DICTIONARY" in e for e in encodings[name]), encodings
    assert pq.read_table(path).equals(t)


def _foreign_commits(path: Path, n: int) -> None:
    """``n`` commits by another writer (commitInfo only: a valid, empty commit)."""
    log = path / "_delta_log"
    v = max(log_versions(path))
    for i in range(1, n + 1):
        (log / f"{v + i:020d}.json").write_text(json.dumps(
            {"commitInfo": {"timestamp": 1, "operation": "OTHER WRITER"}}) + "\n")


def test_progress_is_found_under_many_foreign_commits(sink: DeltaSink, tmp_path: Path) -> None:
    """However many commits of other writers lie between (before: 1,000 at
    most, then a silent fallback to the upper alone, which rewrote records)."""
    new = SinkState(1000, '[{"p":0,"o":7}]')
    sink.commit(sink.stager().stage("b1", 0, updates(["a"], 500)), SinkState(), new)
    _foreign_commits(tmp_path / "out", 1_200)
    assert DeltaSink(NAME, tmp_path / "out").state() == new
