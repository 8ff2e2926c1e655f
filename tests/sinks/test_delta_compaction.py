"""Compaction of Delta outputs (``DeltaSink.compact``/``maintain``) and the
retention of the files it removes (``expire_removed``): rows, reads as of any
time, the state and its fencing are the same before and after; the delta-rs
behaviours the design rests on are pinned."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable
from deltalake.transaction import CommitProperties, RemoveAction, Transaction

import reclock.sinks.delta as delta_mod
from reclock.config import ConfigError, load_config
from reclock.contracts.config import parse_duration, parse_size
from reclock.contracts.sink import SinkState
from reclock.runtime.upsert_state import UpsertState
from reclock.sinks._store import S3Access
from reclock.sinks.delta import Compaction, DeltaSink, FileStats, stats
from tests.sinks.rows import USER, updates

NAME = "orders.main"


def fill(sink: DeltaSink, commits: int, start: int = 0, *, keys: int = 3,
         state: SinkState | None = None) -> SinkState:
    """``commits`` commits of ``keys`` rows each (every 5th row an error row,
    every 4th commit also retracting a row of the one before), one file each;
    returns the state after them."""
    st = state if state is not None else sink.state()
    for i in range(start, start + commits):
        rows = updates([f"k{i}-{j}" for j in range(keys)], 1000 + 10 * i, offset=keys * i)
        if i % 5 == 0:
            rows = pa.concat_tables([rows, updates(["bad"], 1000 + 10 * i, offset=10**6 + i,
                                                   error="not json")])
        if i % 4 == 3:
            rows = pa.concat_tables([rows, updates([f"k{i - 1}-0"], 1000 + 10 * i, diff=-1,
                                                   offset=keys * (i - 1))])
        new = SinkState(1000 + 10 * i + 10, json.dumps([{"o": keys * (i + 1)}]))
        sink.commit(sink.stager().stage(f"c{i}", 0, rows), st, new)
        st = new
    return st


def canonical(t: pa.Table) -> list[dict[str, Any]]:
    return t.sort_by([("_src_offset", "ascending"), ("_diff", "ascending")]).to_pylist()


def data_files(sink: DeltaSink) -> list[str]:
    return DeltaTable(sink.uri, storage_options=sink.location.storage_options()).file_uris()


def last_commit(path: Path) -> dict[str, Any]:
    entry = sorted((path / "_delta_log").glob("*.json"))[-1]
    out: dict[str, Any] = {"remove": 0, "add": 0, "txn": []}
    for line in entry.read_text().splitlines():
        doc = json.loads(line)
        if "commitInfo" in doc:
            out["info"] = doc["commitInfo"]
        elif "txn" in doc:
            out["txn"].append(doc["txn"])
        elif "remove" in doc:
            out["remove"] += 1
            assert doc["remove"]["dataChange"] is False
        elif "add" in doc:
            out["add"] += 1
            assert doc["add"]["dataChange"] is False
    return out


@pytest.fixture
def sink(tmp_path: Path) -> DeltaSink:
    s = DeltaSink(NAME, tmp_path / "out")
    s.ensure(USER)
    return s


# -- the same rows, reads and state ----------------------------------------------------------


def test_compaction_keeps_rows_reads_as_of_and_state(sink: DeltaSink) -> None:
    st = fill(sink, 40)
    before = sink.read_updates()
    as_of = {t: canonical(sink.read_updates(t)) for t in (999, 1000, 1155, 1200, 1389, 1390)}
    v_before = DeltaTable(str(sink.path)).version()
    old_version = canonical(DeltaTable(str(sink.path), version=v_before).to_pyarrow_table())

    done = sink.compact(min_files=2)
    assert done["files_removed"] == 40 and done["files_added"] == 1, done
    assert len(data_files(sink)) == 1
    info = last_commit(sink.path)
    assert info["remove"] == 40 and info["add"] == 1
    # The commit carries the output's txn and progress exactly as they were.
    assert [(t["appId"], t["version"]) for t in info["txn"]] == [(sink.app_id, st.upper)]
    assert info["info"]["reclock.upper"] == st.upper
    assert info["info"]["reclock.progress"] == st.progress
    assert info["info"]["reclock.maintenance"] == "compact"

    assert sink.state() == st
    assert DeltaSink(NAME, sink.path).state() == st  # a fresh reader, too
    assert canonical(sink.read_updates()) == canonical(before)
    assert before.num_rows == sink.read_updates().num_rows
    for t, rows in as_of.items():
        assert canonical(sink.read_updates(t)) == rows, t
    # Time travel to the version before: its files are kept (retention).
    assert canonical(DeltaTable(str(sink.path), version=v_before).to_pyarrow_table()) \
        == old_version
    # The merged file's statistics are those of its rows (readers prune on them).
    add = pa.table(DeltaTable(str(sink.path)).get_add_actions(flatten=True))
    assert add.column("num_records").to_pylist() == [before.num_rows]
    assert add.column("min._into_time").to_pylist() == [1000]
    assert add.column("max._into_time").to_pylist() == [1390]
    # Nothing left to merge: a second pass does nothing and writes nothing.
    v = DeltaTable(str(sink.path)).version()
    assert sink.compact(min_files=2) == {}
    assert DeltaTable(str(sink.path)).version() == v

    # The writer carries on from the compacted table.
    st = fill(sink, 3, 40, state=st)
    assert sink.state() == st
    assert sink.read_updates().num_rows == before.num_rows + 3 * 3 + 1


def test_upsert_key_state_rebuilds_the_same_from_a_compacted_output(sink: DeltaSink) -> None:
    fill(sink, 24)
    schema_cols = ["k", "v"]
    before = UpsertState.rebuild(sink.read_updates(), schema_cols, ("k",)).rows
    assert sink.compact(min_files=2)["files_removed"] == 24
    after = UpsertState.rebuild(sink.read_updates(), schema_cols, ("k",)).rows
    assert after == before and len(before) == 24 * 3 - 6


def test_runs_of_target_size_in_intotime_order_and_min_files(sink: DeltaSink) -> None:
    fill(sink, 12)
    size = DeltaTable(str(sink.path)).get_add_actions(flatten=True).column("size_bytes")
    one = max(size.to_pylist())
    assert sink.compact(min_files=13) == {}  # 12 small files: below min_files
    done = sink.compact(target_size=4 * one, min_files=12)
    assert done["files_removed"] == 12 and done["files_added"] == 3, done
    adds = pa.table(DeltaTable(str(sink.path)).get_add_actions(flatten=True)).sort_by(
        "min._into_time")
    # Runs follow IntoTime: the merged files' time ranges do not overlap.
    lo, hi = adds.column("min._into_time").to_pylist(), adds.column("max._into_time").to_pylist()
    assert all(h < nxt for h, nxt in zip(hi, lo[1:], strict=False)), (lo, hi)
    # At most max_files per pass; the rest is reported as left.
    sink2 = DeltaSink("x.y", sink.path.parent / "other")
    sink2.ensure(USER)
    fill(sink2, 10)
    done = sink2.compact(min_files=2, max_files=6)
    assert (done["files_removed"], done["files_left"]) == (6, 4)


def test_files_from_before_a_column_was_added_merge_with_nulls_in_it(sink: DeltaSink) -> None:
    st = fill(sink, 3)
    sink.ensure(pa.schema([*USER, pa.field("note", pa.string())]))
    rows = updates(["n1", "n2"], 2000, offset=500).append_column("note", pa.array(["a", None]))
    sink.commit(sink.stager().stage("wide", 0, rows), st, SinkState(3000, "p"))
    before = canonical(sink.read_updates())
    assert sink.compact(min_files=2)["files_removed"] == 4
    assert canonical(sink.read_updates()) == before
    assert sorted(n for n in sink.read_updates().column("note").to_pylist() if n) == ["a"]


def test_file_stats_of_pieces_equal_stats_of_the_whole() -> None:
    a = updates(["a", "b"], 5, offset=3)
    b = updates(["c"], 2, offset=9, error="bad")
    assert FileStats().add(a).add(b).json() == stats(pa.concat_tables([a, b]))


# -- fencing and interleavings -------------------------------------------------------------


def test_a_compaction_between_a_writers_check_and_commit_is_retried_over(
        sink: DeltaSink, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer loads snapshot v, a compaction commits v+1 (carrying the
    output's txn, so delta-rs refuses the writer's commit from v); the
    writer reloads, finds its state unchanged, commits: nothing lost."""
    st = fill(sink, 6)
    compactor = DeltaSink(NAME, sink.path, lock=False)
    writer = DeltaSink(NAME, sink.path, lock=False)
    real_load = writer._load
    loads: list[int] = []

    def load_then_compact() -> DeltaTable:
        dt = real_load()
        loads.append(dt.version())
        if len(loads) == 1:
            assert compactor.compact(min_files=2)["files_removed"] == 6
        return dt

    monkeypatch.setattr(writer, "_load", load_then_compact)
    staged = writer.stager().stage("late", 0, updates(["late"], 2000, offset=999))
    writer.commit(staged, st, SinkState(3000, "p-late"))
    assert len(loads) == 2 and loads[1] == loads[0] + 1
    assert sink.state() == SinkState(3000, "p-late")
    keys = sink.read_updates().column("k").to_pylist()
    assert keys.count("late") == 1 and len(keys) == 6 * 3 + 2 + 1 + 1


def after_planning(monkeypatch: pytest.MonkeyPatch, compactor: DeltaSink,
                   then: Callable[[], object]) -> None:
    """Run ``then`` whenever a compaction pass of ``compactor`` has been
    planned from its snapshot (in its child), before its merges and swap."""
    real_state_at = compactor._state_at

    def planned(version: int, txn: int | None) -> SinkState:
        then()
        return real_state_at(version, txn)

    monkeypatch.setattr(compactor, "_state_at", planned)


def commit_w(writer: DeltaSink, st: SinkState) -> None:
    """A commit of one row ``w`` from state ``st`` to (3000, "p-w")."""
    writer.commit(writer.stager().stage("w", 0, updates(["w"], 2000)), st,
                  SinkState(3000, "p-w"))


def test_a_commit_between_a_compactions_load_and_commit_drops_the_compaction(
        sink: DeltaSink, monkeypatch: pytest.MonkeyPatch) -> None:
    st = fill(sink, 6)
    compactor = DeltaSink(NAME, sink.path, lock=False)
    after_planning(monkeypatch, compactor, lambda: commit_w(sink, st))
    assert compactor.compact(min_files=2) == {}
    assert sink.state() == SinkState(3000, "p-w")
    assert len(data_files(sink)) == 7  # nothing merged
    # Its new file was deleted again: nothing but the table's own files.
    assert sorted(p.name for p in sink.path.glob("*.parquet")) == sorted(
        Path(f).name for f in data_files(sink))
    monkeypatch.undo()
    assert sink.compact(min_files=2)["files_removed"] == 7


@pytest.mark.parametrize("race", [False, True])
def test_a_table_reclock_does_not_append_to_itself_is_compacted_by_delta_rs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, race: bool) -> None:
    """A table with a writer feature reclock does not write log entries for
    (a CHECK constraint: writer protocol 3) has its swap committed by
    delta-rs from the planned snapshot, in a child (:func:`swap_files`):
    the same rows, state and reads as of; a commit of the output between
    the plan and the swap drops the pass."""
    sink = DeltaSink(NAME, tmp_path / "t")
    sink.ensure(USER)
    DeltaTable(str(sink.path)).alter.add_constraint({"k_set": "k IS NOT NULL"})
    st = fill(sink, 8)
    assert DeltaTable(str(sink.path)).protocol().min_writer_version == 3
    before = canonical(sink.read_updates())
    as_of = {t: canonical(sink.read_updates(t)) for t in (1000, 1035, 1080)}
    if race:
        writer = DeltaSink(NAME, sink.path, lock=False)
        after_planning(monkeypatch, sink, lambda: commit_w(writer, st))
        assert sink.compact(min_files=2) == {}
        monkeypatch.undo()
        assert len(data_files(sink)) == 9  # nothing merged, its files deleted again
        assert sorted(p.name for p in sink.path.glob("*.parquet")) == sorted(
            Path(f).name for f in data_files(sink))
        assert sink.state() == SinkState(3000, "p-w")
        return
    assert sink.compact(min_files=2)["files_removed"] == 8
    info = last_commit(sink.path)
    assert info["remove"] == 8 and info["add"] == 1
    assert info["info"].get("engineInfo") != "reclock"  # delta-rs wrote it
    assert [(t["appId"], t["version"]) for t in info["txn"]] == [(sink.app_id, st.upper)]
    assert info["info"]["reclock.progress"] == st.progress
    assert sink.state() == st and DeltaSink(NAME, sink.path).state() == st
    assert canonical(sink.read_updates()) == before
    for t, rows in as_of.items():
        assert canonical(sink.read_updates(t)) == rows, t
    fill(sink, 2, start=8, state=st)


def test_two_compactions_from_one_snapshot_never_both_commit(
        sink: DeltaSink, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two drivers compacting at once (a zombie on S3, where there is no
    lock): the txn fences the second, so no row is merged twice."""
    fill(sink, 8)
    rows = sink.read_updates().num_rows
    a = DeltaSink(NAME, sink.path, lock=False)
    b = DeltaSink(NAME, sink.path, lock=False)
    def a_compacts() -> None:
        assert a.compact(min_files=2)["files_removed"] == 8

    after_planning(monkeypatch, b, a_compacts)
    assert b.compact(min_files=2) == {}
    assert sink.read_updates().num_rows == rows
    assert len(data_files(sink)) == 1


def test_delta_rs_optimize_is_not_fenced(tmp_path: Path) -> None:
    """Pins why compaction is reclock's own commit (deltalake 1.6.6): the
    txn given to ``optimize.compact`` is dropped, and two optimizes from one
    snapshot both commit, duplicating the rows. Should delta-rs change,
    ``DeltaSink.compact`` might use it."""
    s = DeltaSink(NAME, tmp_path / "t")
    s.ensure(USER)
    fill(s, 4, keys=1)
    rows = s.read_updates().num_rows
    a, b = DeltaTable(str(s.path)), DeltaTable(str(s.path))
    props = CommitProperties(app_transactions=[Transaction(s.app_id, 10**6)])
    a.optimize.compact(commit_properties=props)
    assert DeltaTable(str(s.path)).transaction_version(s.app_id) != 10**6
    b.optimize.compact(commit_properties=props)
    assert DeltaTable(str(s.path)).to_pyarrow_table().num_rows == 2 * rows


def test_the_state_is_found_behind_other_writers_compactions_and_vacuums(
        sink: DeltaSink) -> None:
    """delta-rs's optimize and vacuum commit without our txn: the state is
    read from the newest commit that has it, however many lie between, and
    the writer's next commit goes through."""
    st = fill(sink, 6)
    DeltaTable(str(sink.path)).optimize.compact()  # an external OPTIMIZE
    assert sink.compact(min_files=2) == {}  # nothing small left to merge
    assert sink.state() == st
    assert [Path(p).name for p in sink.expire_removed(0)]  # VACUUM START/END commits
    DeltaTable(str(sink.path)).create_write_transaction(  # another app's commit
        [], "append", DeltaTable(str(sink.path)).schema(),
        commit_properties=CommitProperties(app_transactions=[Transaction("other", 1)]))
    history = [h["operation"] for h in DeltaTable(str(sink.path)).history(4)]
    assert history[1:] == ["VACUUM END", "VACUUM START", "OPTIMIZE"], history
    assert sink.state() == st
    st = fill(sink, 1, 6, state=st)
    assert sink.state() == st


# -- retention, orphans, crashes --------------------------------------------------------------


def test_removed_files_stay_for_the_retention_and_orphans_spare_them(sink: DeltaSink) -> None:
    fill(sink, 10)
    v_before = DeltaTable(str(sink.path)).version()
    rows = canonical(sink.read_updates())
    sink.compact(min_files=2)
    on_disk = {p.name for p in sink.path.glob("*.parquet")}
    assert len(on_disk) == 11
    assert sink.vacuum_orphans(0) == []  # removed files are not orphans
    assert sink.expire_removed(3_600_000) == []  # an hour has not passed
    assert len(DeltaTable(str(sink.path), version=v_before).to_pyarrow_table()) == len(rows)
    v = DeltaTable(str(sink.path)).version()
    expired = sink.expire_removed(0)
    assert len(expired) == 10 and all(n.startswith("part-c") for n in expired)
    assert {p.name for p in sink.path.glob("*.parquet")} == on_disk - set(expired)
    assert DeltaTable(str(sink.path)).version() == v + 2  # VACUUM START, END
    assert canonical(sink.read_updates()) == rows
    assert sink.expire_removed(0) == []
    assert DeltaTable(str(sink.path)).version() == v + 2  # nothing to do: no commit


def test_checkpoints_keep_removes_for_the_table_retention_and_orphans_follow_them(
        sink: DeltaSink, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the retention property is for: a checkpoint keeps remove actions
    younger than ``delta.deletedFileRetentionDuration`` (their files stay
    spared by vacuum_orphans) and drops older ones (their files, named like
    ours, are then deleted like orphans: they are past any retention) -- by
    the sink's next pass that reads the table (a sink that read the table
    knows the files it kept until then: every FULL_VACUUM_EVERY-th pass)."""
    monkeypatch.setattr(delta_mod, "FULL_VACUUM_EVERY", 2)
    fill(sink, 3)
    dt = DeltaTable(str(sink.path))
    dt.alter.set_table_properties({"delta.deletedFileRetentionDuration": "interval 2 hours"})
    dt = DeltaTable(str(sink.path))
    old, young, kept = sorted(pa.table(dt.get_add_actions(flatten=True)).column(
        "path").to_pylist())
    now = int(time.time() * 1000)
    dt.create_write_transaction(
        [RemoveAction(old, False, now - 3 * 3_600_000),
         RemoveAction(young, False, now - 1_800_000)], "append", dt.schema())
    assert sink.vacuum_orphans(0) == []  # no checkpoint yet: both removes are in the log
    DeltaTable(str(sink.path)).create_checkpoint()
    assert sink.vacuum_orphans(0) == []  # known as kept: the table is not read
    assert sink.vacuum_orphans(0) == [old]  # the pass that reads it again
    assert sink.expire_removed(3_600_000) == []  # young is not an hour old
    assert sorted(p.name for p in sink.path.glob("*.parquet")) == sorted([young, kept])
    assert sink.read_updates().column("k").to_pylist() == ["k2-0", "k2-1", "k2-2"]


def test_spread_puts_the_first_pass_up_to_a_period_later_at_random(tmp_path: Path) -> None:
    """A pipeline's outputs (``spread``): the first pass lands anywhere in
    ``[first pass, first pass + every)``, so that outputs started together
    do not compact together every period."""
    firsts = set()
    for i in range(20):
        s = DeltaSink(NAME, tmp_path / f"t{i}", compaction=Compaction(every_ms=600_000,
                                                                      spread=True))
        s.maintain(0)
        assert s._maintain_at is not None
        firsts.add(s._maintain_at)
        assert delta_mod.FIRST_PASS_MS <= s._maintain_at < delta_mod.FIRST_PASS_MS + 600_000
    assert len(firsts) > 10


def test_a_maintenance_pass_reads_the_table_only_when_it_may_have_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Choosing files to merge and looking for files to expire read the
    whole table (in a child). A pass skips the first while the directory
    holds fewer small data files than min_files, and the second unless a
    compaction of this sink left removed files waiting (or it is the first
    pass, or every EXPIRY_CHECK_EVERY-th): a thousand young outputs each
    forked two children at their first pass."""
    calls: list[str] = []
    for name in ("plan_compaction", "expire_files"):
        real = getattr(delta_mod, name)

        def counted(*args: Any, _real: Any = real, _name: str = name) -> Any:
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(delta_mod, name, counted)
    monkeypatch.setattr(delta_mod, "EXPIRY_CHECK_EVERY", 3)
    s = DeltaSink(NAME, tmp_path / "t", compaction=Compaction(
        every_ms=1000, min_files=5, retention_ms=3_600_000, in_child=False))  # (counted here)
    s.ensure(USER)
    st = fill(s, 4)
    assert s.maintain(0) == {}  # schedules the first pass
    assert s.maintain(1000) == {} and calls == ["expire_files"]  # 4 files: no plan
    assert s.maintain(2000) == {} and calls == ["expire_files"]
    st = fill(s, 2, start=4, state=st)
    done = s.maintain(3000)
    assert done["files_removed"] == 6
    assert calls == ["expire_files", "plan_compaction", "expire_files"]
    assert s.maintain(4000) == {}  # 1 file; its 6 removed files wait an hour
    assert calls[3:] == ["expire_files"]
    assert s.expire_removed(0) != [] and not s._expiring  # none waiting any more
    calls.clear()
    assert s.maintain(5000) == {} and calls == []
    assert s.maintain(6000) == {} and calls == []
    assert s.maintain(7000) == {} and calls == ["expire_files"]  # the 7th pass: 7 % 3 == 1
    assert s.state() == st


def test_maintain_runs_on_schedule_and_sets_the_retention_property(tmp_path: Path) -> None:
    path = tmp_path / "t"
    plain = DeltaSink(NAME, path)
    plain.ensure(USER)  # made without compaction: delta-rs's default retention
    fill(plain, 6)
    assert "delta.deletedFileRetentionDuration" not in DeltaTable(str(path)).metadata(
        ).configuration
    assert plain.maintain(0) == {}  # no compaction configured
    s = DeltaSink(NAME, path, compaction=Compaction(every_ms=10_000, min_files=5,
                                                    retention_ms=2 * 3_600_000 - 1))
    assert s.maintain(-9_000) == {}  # the first pass: every_ms after the first call
    assert s.maintain(999) == {}
    done = s.maintain(1_000)
    assert done["files_removed"] == 6 and "files_left" not in done
    assert DeltaTable(str(path)).metadata().configuration[
        "delta.deletedFileRetentionDuration"] == "interval 3 hours"  # an hour more
    fill(s, 6, 6)
    assert s.maintain(10_999) == {}  # not due yet
    assert s.maintain(11_000)["files_removed"] == 7  # the merged file joins the run
    made = DeltaSink(NAME, tmp_path / "new", compaction=Compaction())
    made.ensure(USER)  # a new table gets the property with its creation
    assert DeltaTable(str(tmp_path / "new")).version() == 0
    assert DeltaTable(str(tmp_path / "new")).metadata().configuration[
        "delta.deletedFileRetentionDuration"] == "interval 25 hours"


def test_maintain_catches_up_a_pass_at_a_time(sink: DeltaSink,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    fill(sink, 9)
    monkeypatch.setattr(delta_mod, "COMPACT_MAX_FILES", 4)
    sink.compaction = Compaction(every_ms=3_600_000, min_files=2)
    assert sink.maintain(-60_000) == {}  # the first pass: a minute after the first call
    assert sink.maintain(0)["files_removed"] == 4  # 5 left: due again at once
    assert sink.maintain(1)["files_removed"] == 4  # the merged file + 3; 2 left
    assert sink.maintain(2)["files_removed"] == 3  # the rest, and now on schedule
    assert sink.maintain(3) == {}
    assert len(data_files(sink)) == 1


def test_a_crash_mid_compaction_changes_nothing_and_leaves_only_orphans(
        sink: DeltaSink, monkeypatch: pytest.MonkeyPatch) -> None:
    st = fill(sink, 8)
    rows = canonical(sink.read_updates())
    files = set(data_files(sink))

    class Killed(BaseException):
        pass

    def crash(name: str) -> None:
        if name == "mid_compaction":
            raise Killed

    monkeypatch.setattr(delta_mod.faults, "crash_point", crash)
    with pytest.raises(Killed):
        sink.compact(min_files=2)
    monkeypatch.undo()
    left = {p.name for p in sink.path.glob("*.parquet")} - {Path(f).name for f in files}
    assert len(left) == 1 and "-compact-" in left.pop()
    fresh = DeltaSink(NAME, sink.path)
    assert fresh.state() == st and set(data_files(fresh)) == files
    assert canonical(fresh.read_updates()) == rows
    assert [n for n in fresh.vacuum_orphans(0) if "-compact-" in n]
    assert fresh.compact(min_files=2)["files_removed"] == 8
    assert fresh.state() == st and canonical(fresh.read_updates()) == rows


# -- configuration ------------------------------------------------------------------------


def _pipeline(tmp_path: Path, sink: str) -> Path:
    f = tmp_path / "p.yaml"
    f.write_text("sources:\n  - name: c\n    generator: {kind: counter}\n    outputs:\n"
                 f"      - name: o\n        sink: {sink}\n")
    return f


def test_compact_config_defaults_custom_values_and_off(tmp_path: Path) -> None:
    def compaction(sink: str) -> Compaction | None:
        cfg = load_config(_pipeline(tmp_path, sink))
        block = cfg.sources[0].outputs[0].sink
        return None if block.compact is None else block.compact.settings()

    # (a pipeline's outputs spread their first passes)
    assert compaction("file") == Compaction(600_000, 50, 128 * 2**20, 86_400_000, spread=True)
    assert compaction("{type: file, compact: off}") is None
    assert compaction("{type: file, compact: null}") is None
    assert compaction("{type: file, compact: {every: 30s, min_files: 8, target_size: 64MB, "
                      "retention: 7d}}") == Compaction(30_000, 8, 64_000_000, 7 * 86_400_000,
                                                       spread=True)
    with pytest.raises(ConfigError) as info:
        load_config(_pipeline(tmp_path, "{type: file, compact: {target_size: 12 parsecs, "
                                        "retention: 30m, min_files: 1, speed: 3}}"))
    msg = str(info.value)
    for words in ("target_size: expected a positive size such as '128MiB'", "retention",
                  "min_files", "speed"):
        assert words in msg, msg
    assert parse_duration("7d") == 7 * 86_400_000 and parse_size("1GiB") == 2**30
    assert parse_size(4096) == 4096 and parse_size("1.5KB") == 1500


# -- S3 ------------------------------------------------------------------------------------


@pytest.mark.integration
def test_compaction_and_retention_on_s3(s3: Any) -> None:
    uri = f"s3://{s3.bucket()}/lake/{uuid.uuid4().hex[:6]}"
    sink = DeltaSink(NAME, uri, storage=S3Access.resolve(env=s3.env()),
                     compaction=Compaction(min_files=5))
    sink.ensure(USER)
    st = fill(sink, 12)
    rows = canonical(sink.read_updates())
    as_of = canonical(sink.read_updates(1055))
    assert sink.maintain(-60_000) == {}
    done = sink.maintain(0)
    assert done["files_removed"] == 12 and done["files_added"] == 1, done
    assert sink.state() == st and canonical(sink.read_updates()) == rows
    assert canonical(sink.read_updates(1055)) == as_of
    assert len(data_files(sink)) == 1
    names = {n for n, _, _ in sink.location.files()}
    assert len(names) == 13
    assert sink.vacuum_orphans(0) == []
    assert len(sink.expire_removed(0)) == 12
    assert {n for n, _, _ in sink.location.files()} == {
        Path(f).name for f in data_files(sink)}
    st = fill(sink, 1, 12, state=st)
    assert sink.state() == st
    assert pc.sum(sink.read_updates().column("_diff")).as_py() > 0


# -- an outside OPTIMIZE racing a pass ----------------------------------------------------------


def model_of_fill(commits: int, keys: int = 3) -> list[tuple[int, int]]:
    """What :func:`fill` committed, from its parameters alone: ``(source
    offset, diff)`` of every row, sorted (each exactly once)."""
    out: list[tuple[int, int]] = []
    for i in range(commits):
        out += [(keys * i + j, 1) for j in range(keys)]
        if i % 5 == 0:
            out.append((10**6 + i, 1))
        if i % 4 == 3:
            out.append((keys * (i - 1), -1))
    return sorted(out)


def rows_of(sink: DeltaSink) -> list[tuple[int, int]]:
    t = DeltaTable(sink.uri, storage_options=sink.location.storage_options()).to_pyarrow_table(
        columns=["_src_offset", "_diff"])
    return sorted(zip(t.column("_src_offset").to_pylist(), t.column("_diff").to_pylist(),
                      strict=True))


@pytest.mark.parametrize("where", ["local", "local-delta-rs",
                                   pytest.param("s3", marks=pytest.mark.integration)])
def test_an_outside_optimize_between_plan_and_swap_drops_the_pass(
        where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        request: pytest.FixtureRequest) -> None:
    """Regression: a delta-rs ``optimize.compact()`` of another program
    committed while a pass was between choosing its files and committing
    its swap; the swap went through delta-rs, whose conflict checker lets a
    second remove of one file pass when ``dataChange`` is false, and every
    row both merged was in the table twice (on S3, and on a local table
    reclock does not write log entries of itself: ``local-delta-rs``, a
    CHECK constraint). The swap now commits only if none of the files it
    removes was removed meanwhile, by anyone: the pass is dropped and its
    merged file deleted. Rows are compared with a model of what was written
    (each position exactly once)."""
    if where == "s3":
        s3 = request.getfixturevalue("s3")
        sink = DeltaSink(NAME, f"s3://{s3.bucket()}/lake/{uuid.uuid4().hex[:6]}",
                         storage=S3Access.resolve(env=s3.env()))
    else:
        sink = DeltaSink(NAME, tmp_path / "out")
    sink.ensure(USER)
    if where == "local-delta-rs":
        DeltaTable(str(sink.path)).alter.add_constraint({"k_set": "k IS NOT NULL"})
    st = fill(sink, 12)
    model = model_of_fill(12)
    assert rows_of(sink) == model
    outside = DeltaTable(sink.uri, storage_options=sink.location.storage_options())
    optimized: list[dict[str, Any]] = []
    after_planning(monkeypatch, sink, lambda: optimized.append(outside.optimize.compact()))
    assert sink.compact(min_files=2) == {}
    monkeypatch.undo()
    assert optimized and optimized[0]["numFilesRemoved"] == 12
    assert rows_of(sink) == model  # each position exactly once
    assert sink.state() == st
    # The dropped pass's merged file is gone: no orphan, nothing referenced lost.
    assert not [n for n, _, _ in sink.location.files() if "-compact-" in n]
    assert sink.vacuum_orphans(0) == []
    assert rows_of(sink) == model
    # The output carries on: a commit, then a pass over what is small now.
    st = fill(sink, 2, 12, state=st)
    assert sink.state() == st
    assert sink.compact(min_files=2)["files_removed"] == 3
    assert rows_of(sink) == model_of_fill(14)


def test_a_pass_commits_over_a_commit_that_removed_none_of_its_files(
        sink: DeltaSink, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another program's commit between plan and swap that touches none of
    the pass's files (an append of its own) does not drop the pass: the
    swap goes on top of it, and both are in the table."""
    st = fill(sink, 6)
    other = DeltaTable(str(sink.path))
    v = other.version()

    def outside_append() -> None:
        other.create_write_transaction(
            [], "append", other.schema(),
            commit_properties=CommitProperties(app_transactions=[Transaction("other", 1)]))

    after_planning(monkeypatch, sink, outside_append)
    assert sink.compact(min_files=2)["files_removed"] == 6
    monkeypatch.undo()
    assert DeltaTable(str(sink.path)).version() == v + 2
    assert last_commit(sink.path)["info"]["readVersion"] == v + 1
    assert rows_of(sink) == model_of_fill(6) and sink.state() == st
    assert len(data_files(sink)) == 1
    st = fill(sink, 1, 6, state=st)
    assert rows_of(sink) == model_of_fill(7) and sink.state() == st
