"""Work run apart from the driver (``sinks/_apart.py``): a compaction's merge
runs in a child process, its result and its errors come back, a child that
dies fails the pass as a transient error without touching the output, and
the next pass merges."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable

import reclock.sinks.delta as delta_mod
from reclock.contracts.sink import SinkError
from reclock.core.errors import TransientError
from reclock.sinks import _apart
from reclock.sinks._store import Location
from reclock.sinks.delta import Compaction, DeltaSink
from tests.sinks.rows import USER
from tests.sinks.test_delta_compaction import NAME, canonical, data_files, fill

MERGE = delta_mod.merge_files  # the real one, while a test patches the module's


def whose_pid() -> int:
    return os.getpid()


def refuse(message: str) -> None:
    raise SinkError(message, hint="a hint that must survive")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def dying_merge(location: Location, paths: list[str], name: str, schema: pa.Schema) -> Any:
    """A merge whose process is killed halfway: the merged file is half written."""
    (Path(location.root) / name).write_bytes(b"PAR1 half a file")
    die()


def recording_merge(location: Location, paths: list[str], name: str,
                    schema: pa.Schema) -> dict[str, Any]:
    d = MERGE(location, paths, name, schema)
    (Path(location.root) / f"{name}.pid").write_text(str(os.getpid()))
    return d


def test_a_call_runs_in_another_process_and_returns_or_raises() -> None:
    assert _apart.available()
    pids = {_apart.run_apart(whose_pid) for _ in range(3)}
    assert os.getpid() not in pids
    assert len(pids) == 3  # one call a child: the memory it took ends with it
    with pytest.raises(SinkError) as err:
        _apart.run_apart(refuse, "output 'x': no room")
    assert "no room" in str(err.value) and err.value.hint == "a hint that must survive"


def test_a_child_that_dies_is_a_transient_error_and_the_next_call_works() -> None:
    with pytest.raises(TransientError, match="the child process running it ended abruptly"):
        _apart.run_apart(die, what="a test")
    assert _apart.run_apart(whose_pid) != os.getpid()


def test_the_merge_runs_in_a_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sink = DeltaSink(NAME, tmp_path / "out")
    sink.ensure(USER)
    fill(sink, 12)
    before = canonical(sink.read_updates())
    monkeypatch.setattr(delta_mod, "merge_files", recording_merge)
    assert sink.compact(min_files=2)["files_removed"] == 12
    pids = [int(p.read_text()) for p in (tmp_path / "out").glob("*.pid")]
    assert pids and os.getpid() not in pids
    assert canonical(sink.read_updates()) == before


def test_in_child_false_merges_in_the_driver(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    sink = DeltaSink(NAME, tmp_path / "out", compaction=Compaction(in_child=False))
    sink.ensure(USER)
    fill(sink, 6)
    monkeypatch.setattr(delta_mod, "merge_files", recording_merge)
    assert sink.compact(min_files=2)["files_removed"] == 6
    assert [int(p.read_text()) for p in (tmp_path / "out").glob("*.pid")] == [os.getpid()]


def test_a_merge_killed_midway_fails_the_pass_and_changes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sink = DeltaSink(NAME, tmp_path / "out")
    sink.ensure(USER)
    st = fill(sink, 10)
    before = canonical(sink.read_updates())
    files = sorted(data_files(sink))
    version = DeltaTable(str(sink.path)).version()
    monkeypatch.setattr(delta_mod, "merge_files", dying_merge)
    with pytest.raises(TransientError, match="compact"):
        sink.compact(min_files=2)
    # The table is as it was: same version, files, rows and state.
    assert DeltaTable(str(sink.path)).version() == version
    assert sorted(data_files(sink)) == files
    assert canonical(sink.read_updates()) == before
    assert sink.state() == st
    # The half-written file is an orphan the vacuum removes once old enough.
    half = [p.name for p in (tmp_path / "out").glob("part-*-compact-*")]
    assert len(half) == 1
    assert sink.vacuum_orphans(grace_seconds=0) == half
    # The next pass merges.
    monkeypatch.setattr(delta_mod, "merge_files", recording_merge)
    assert sink.compact(min_files=2)["files_removed"] == 10
    assert canonical(sink.read_updates()) == before
    fill(sink, 2, start=10, state=st)  # the output goes on committing
    assert len(canonical(sink.read_updates())) > len(before)


def interrupted() -> str:
    """Ctrl-C in a terminal reaches every process of the group."""
    os.kill(os.getpid(), signal.SIGINT)
    return "went on"


def test_a_child_ignores_sigint_and_finishes() -> None:
    assert _apart.run_apart(interrupted) == "went on"


def test_maintenance_loads_the_table_only_in_children(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints, compaction passes (plan, merge, swap), expiry and the
    orphan vacuum read the whole table; the driver does none of that itself
    (delta-rs's allocations there stay with the driver, bench/soak.py):
    with delta-rs's table reads failing in this process, all of them work,
    and the commits after a compaction go on without a reload (after an
    expiry's commits, the next commit reloads: those are delta-rs's)."""
    sink = DeltaSink(NAME, tmp_path / "out")
    sink.ensure(USER)
    st = fill(sink, 12)
    before = canonical(sink.read_updates())
    (tmp_path / "out" / "part-orphan-00000-000.parquet").write_bytes(b"PAR1")

    def not_here(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a table read in the driver")

    with monkeypatch.context() as m:
        for method in ("__init__", "get_add_actions", "create_checkpoint", "vacuum",
                       "create_write_transaction", "update_incremental"):
            m.setattr(DeltaTable, method, not_here)
        assert sink.compact(min_files=2)["files_removed"] == 12
        st = fill(sink, 3, start=12, state=st)  # direct appends after the swap: no reload
        sink._checkpoint()
        assert sink.vacuum_orphans(grace_seconds=0) == ["part-orphan-00000-000.parquet"]
        assert len(sink.expire_removed(0)) == 12  # (two commits of delta-rs's, in the child)
    last = json.loads((tmp_path / "out" / "_delta_log" / "_last_checkpoint").read_text())
    assert last["version"] >= 13
    assert sink.state() == st
    assert canonical(sink.read_updates(as_of=1000 + 10 * 11)) == before
