"""The console sink: prints committed updates, keeps an exact, fenced state."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import pyarrow as pa
import pytest

from reclock.contracts.sink import SinkError, SinkFenced, SinkState
from reclock.sinks.console import ConsoleSink
from tests.sinks.rows import USER, updates

NAME = "orders.main"


@pytest.fixture
def out() -> io.StringIO:
    return io.StringIO()


@pytest.fixture
def sink(tmp_path: Path, out: io.StringIO) -> ConsoleSink:
    s = ConsoleSink(NAME, tmp_path / "state" / "orders.main.json", out=out, max_rows=3)
    s.ensure(USER)
    return s


def test_commit_prints_rows_and_persists_the_state(sink: ConsoleSink, out: io.StringIO) -> None:
    assert sink.state() == SinkState()
    staged = sink.stager().stage("b1", 0, updates(["a", "b"], 1000))
    sink.commit(staged, SinkState(), SinkState(2000, "[1]"))
    assert out.getvalue().splitlines() == [
        '[orders.main] into_time=1000 diff=1 {"k": "a", "v": 0}',
        '[orders.main] into_time=1000 diff=1 {"k": "b", "v": 1}',
    ]
    assert sink.state() == SinkState(2000, "[1]")
    assert json.loads(sink.state_path.read_text()) == {"upper": 2000, "progress": "[1]"}
    # A new process reads the same state.
    assert ConsoleSink(NAME, sink.state_path).state() == SinkState(2000, "[1]")


def test_at_most_max_rows_are_printed_then_a_count(sink: ConsoleSink, out: io.StringIO) -> None:
    stager = sink.stager()
    staged = stager.stage("b", 0, updates([f"k{i}" for i in range(5)], 7))
    staged += stager.stage("b", 1, updates(["x", "y"], 8, diff=-1))
    assert [len(d["rows"]) for d in staged] == [3, 2]  # executors ship at most max_rows
    sink.commit(staged, SinkState(), SinkState(9))
    lines = out.getvalue().splitlines()
    assert len(lines) == 4
    assert lines[-1] == "[orders.main] ... and 4 more"


def test_error_rows_show_the_reason(sink: ConsoleSink, out: io.StringIO) -> None:
    staged = sink.stager().stage("b", 0, updates(["?"], 5, error="bad json at byte 3"))
    sink.commit(staged, SinkState(), SinkState(6))
    assert "error='bad json at byte 3'" in out.getvalue()


def test_idle_commit_prints_nothing_and_moves_the_upper(
    sink: ConsoleSink, out: io.StringIO
) -> None:
    sink.commit([], SinkState(), SinkState(100, "p"))
    sink.commit([], SinkState(100, "p"), SinkState(None, "[]"))
    assert out.getvalue() == ""
    assert sink.state() == SinkState(None, "[]")


def test_stale_expected_is_fenced_and_prints_nothing(sink: ConsoleSink, out: io.StringIO) -> None:
    sink.commit([], SinkState(), SinkState(100, "p"))
    staged = sink.stager().stage("zombie", 0, updates(["z"], 50))
    with pytest.raises(SinkFenced, match=NAME):
        sink.commit(staged, SinkState(), SinkState(200))
    with pytest.raises(SinkFenced):
        sink.commit(staged, SinkState(100, "other"), SinkState(200))
    assert out.getvalue() == ""
    assert sink.state() == SinkState(100, "p")


def test_corrupt_state_file_is_a_sink_error_naming_it(sink: ConsoleSink) -> None:
    sink.state_path.write_text("{not json")
    with pytest.raises(SinkError) as info:
        sink.state()
    assert str(sink.state_path) in str(info.value)
    sink.state_path.write_text('{"upper": "soon", "progress": null}')
    with pytest.raises(SinkError):
        sink.state()


def test_read_updates_is_empty(sink: ConsoleSink) -> None:
    sink.commit(sink.stager().stage("b", 0, updates(["a"], 1)), SinkState(), SinkState(2))
    got = sink.read_updates()
    assert got.num_rows == 0 and "k" in got.column_names


def test_values_are_shipped_as_json(tmp_path: Path, out: io.StringIO) -> None:
    s = ConsoleSink(NAME, tmp_path / "s.json", out=out)
    user = pa.schema([("b", pa.binary()), ("f", pa.float64()), ("t", pa.timestamp("ms"))])
    s.ensure(user)
    base = updates(["x"], 1).drop_columns(["k", "v"])
    table = pa.table(
        [pa.array([b"\xff\x00"]), pa.array([float("nan")]),
         pa.array([0], pa.timestamp("ms")), *base.columns],
        names=["b", "f", "t", *base.column_names],
    )
    staged = pickle.loads(pickle.dumps(s.stager())).stage("b", 0, table)
    json.dumps(staged)  # JSON-able, as the contract requires
    s.commit(staged, SinkState(), SinkState(2))
    line = out.getvalue()
    assert '"b": "base64:/wA="' in line and '"f": "nan"' in line and "1970-01-01T00:00:00" in line


def test_default_output_is_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = ConsoleSink(NAME, tmp_path / "s.json")
    s.ensure(USER)
    s.commit(s.stager().stage("b", 0, updates(["a"], 1)), SinkState(), SinkState(2))
    assert '{"k": "a", "v": 0}' in capsys.readouterr().out
