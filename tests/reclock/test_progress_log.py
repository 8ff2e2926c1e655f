"""The progress log: one JSON line per event, written through at once while
the file stays open, rotated at ``max_bytes``."""

from __future__ import annotations

import json
from pathlib import Path

from reclock.core.clock import ManualClock
from reclock.runtime.progress_log import ProgressLog, tail


def test_lines_are_written_through_and_the_file_rotates(tmp_path: Path) -> None:
    path = tmp_path / "state" / "progress.jsonl"
    log = ProgressLog(path, ManualClock(5), max_bytes=200)
    log.log("a", "open", bound=[1])
    # visible to a reader at once, without closing
    assert [json.loads(x) for x in path.read_text().splitlines()] == [
        {"ts": 5, "source": "a", "kind": "open", "bound": [1]}]
    for i in range(10):
        log.log("b", "binding", n=i)
    old = path.with_suffix(".jsonl.1")
    assert old.exists() and path.stat().st_size <= 200 + 60  # rotated, one generation kept
    lines = old.read_text().splitlines() + path.read_text().splitlines()
    assert [json.loads(x)["n"] for x in lines if "n" in x][-1] == 9
    assert [e["n"] for e in tail(path, 1, "b")] == [9]
    log.close()
    log.log("b", "binding", n=10)  # reopens after close
    assert tail(path, 1)[0]["n"] == 10
    log.close()


def test_an_unwritable_log_never_stops_the_caller(tmp_path: Path) -> None:
    path = tmp_path / "progress.jsonl"
    path.mkdir()  # a directory where the file should be
    log = ProgressLog(path)
    log.log("a", "open")
    assert [e["kind"] for e in log.recent] == ["open"]
