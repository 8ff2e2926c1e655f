"""Snapshot progress without peers: the driver's bookkeeping of chunk tasks
(:mod:`reclock.runtime.snapshot_progress`), the Postgres source's estimate,
and how the status line, ``reclock status`` and the metrics show it. The
Postgres end to end is ``tests/sources/test_pg_snapshot_progress.py``."""

from __future__ import annotations

from typing import Any

import pytest

from reclock import cli
from reclock.contracts.source import ReadTask, SnapshotSize
from reclock.metrics import make_registry, render
from reclock.pipeline import progress_line
from reclock.runtime.dataplane import TaskResult, _RecordsByTask
from reclock.runtime.snapshot_progress import SnapshotProgress, describe, entry
from reclock.sources.postgres.snapshot_size import estimate
from tests.reclock.test_http import samples, value


def _tasks() -> list[ReadTask]:
    """Two chunks of output 0, one of output 1, and a replication range."""
    return [ReadTask("pg", 0, None, 10, snapshot=0), ReadTask("pg", 1, None, 10, snapshot=0),
            ReadTask("pg", 2, None, 10, snapshot=1), ReadTask("pg", 3, None, 10)]


def test_rows_read_follow_the_finished_chunks_and_the_commit_makes_them_final() -> None:
    sp = SnapshotProgress()
    assert sp.submitted([ReadTask("pg", 0, None, 10)]) is None  # no snapshot: not followed
    sizes = {0: SnapshotSize(None, False, "public.a"), 1: SnapshotSize(50, False, "public.b")}
    assert sp.status(sizes) == {0: entry("public.a", 0, None, False, False),
                                1: entry("public.b", 0, 50, False, False)}
    progress = sp.submitted(_tasks())
    assert progress is not None
    progress.finished(0, 30)
    progress.finished(3, 1000)  # the replication range is not the snapshot
    assert sp.status(sizes)[0] == entry("public.a", 30, None, False, False)
    progress.finished(2, 70)  # more than the estimate: the total shows what was read
    assert sp.status(sizes)[1] == entry("public.b", 70, 70, False, False)
    sizes[0] = SnapshotSize(100, True, "public.a")  # the count arrived
    assert sp.status(sizes)[0] == entry("public.a", 30, 100, True, False)
    results = [TaskResult(0, records=30), TaskResult(1, records=70), TaskResult(2, records=80),
               TaskResult(3, records=1000)]
    sp.committed(progress, results, sizes)
    # the source released its snapshot: the numbers stay, final
    assert sp.status({}) == {0: entry("public.a", 100, 100, True, True),
                             1: entry("public.b", 80, 80, True, True)}
    sp.abandoned()
    assert sp.status({})[0]["done"]


def test_a_job_that_fails_reads_from_zero_again() -> None:
    sp = SnapshotProgress()
    sizes = {0: SnapshotSize(20, True, "public.a")}
    first = sp.submitted(_tasks()[:2])
    assert first is not None
    first.finished(0, 10)
    assert sp.status(sizes)[0]["rows_read"] == 10
    sp.abandoned()  # the job failed: what it read is not in the output
    assert sp.status(sizes)[0] == entry("public.a", 0, 20, True, False)
    sp.committed(first, [TaskResult(0, records=10)], sizes)  # too late: ignored
    assert not sp.status(sizes)[0]["done"]
    again = sp.submitted(_tasks()[:2])
    assert again is not None
    again.finished(1, 10)
    again.finished(0, 10)
    assert sp.status(sizes)[0] == entry("public.a", 20, 20, True, False)


def test_the_accumulator_merges_into_new_dicts() -> None:
    param = _RecordsByTask()
    a = param.zero({})
    b = param.addInPlace(a, {3: 5})
    c = param.addInPlace(b, {3: 1, 4: 2})
    assert (a, b, c) == ({}, {3: 5}, {3: 6, 4: 2})  # a reader of b never sees c's change


@pytest.mark.parametrize(("stats", "rows"), [
    ((100, 5000.0, 50), 10_000),  # 100 rows a page, the table doubled since ANALYZE
    ((0, 0.0, 0), 0),             # empty
    ((7, -1.0, 0), None),         # never analyzed (reltuples -1)
    ((7, 0.0, 0), None),          # statistics from before the table had pages
    ((0, 1234.0, 0), 1234),       # partitioned: the parent has no pages of its own
    ((10, None, None), None),
])
def test_the_catalogs_estimate(stats: tuple[Any, Any, Any], rows: int | None) -> None:
    assert estimate(*stats) == rows


def test_how_a_snapshot_in_progress_reads() -> None:
    assert describe("orders", entry("public.orders", 120_000, 1_000_000, True, False)) == \
        "snapshot orders: 120,000 of 1,000,000 rows (12%)"
    assert describe("orders", entry("public.orders", 5, 1_000, False, False)) == \
        "snapshot orders: 5 of ~1,000 rows (0%)"
    assert describe("orders", entry("public.orders", 7, None, False, False)) == \
        "snapshot orders: 7 rows read (total not known yet)"
    assert describe("empty", entry("public.empty", 0, 0, True, False)) == \
        "snapshot empty: 0 of 0 rows (100%)"
    assert describe("orders", entry("public.orders", 9, 9, True, True)) is None  # done
    assert describe("orders", None) is None


def _doc() -> dict[str, Any]:
    health = {"status": "running", "error": None, "hint": None, "since_ms": 5,
              "definite": False}

    def out(name: str, snap: dict[str, Any] | None) -> dict[str, Any]:
        return {"name": name, "upper": 0, "lag_ms": 100, "rows": 0, "errors": 0,
                "health": health, "snapshot": snap}

    return {"pid": 1, "updated_ms": 1_700_000_000_000, "http": None, "dropped": [],
            "sources": [{
                "source": "shop", "kind": "lsn", "health": health, "probe": ["0/10"],
                "bound": ["0/10"], "remap_upper": 5, "bindings": 1, "read_from": ["0/0"],
                "resume": ["0/0"], "records": 0, "records_per_s": 0.0, "lag_records": 16,
                "job_seconds": 0.0,
                "outputs": [out("orders", entry("public.orders", 120_000, 1_000_000, True,
                                                False)),
                            out("items", entry("public.items", 300, None, False, False)),
                            out("done", entry("public.done", 42, 42, True, True)),
                            out("none", None)]}]}


def test_the_metrics_of_a_snapshot() -> None:
    ss = samples(render(make_registry(_doc)).decode())

    def v(name: str, output: str) -> float | None:
        return value(ss, name, source="shop", output=output)

    assert (v("reclock_snapshot_rows_read", "orders"), v("reclock_snapshot_rows", "orders"),
            v("reclock_snapshot_rows_exact", "orders"),
            v("reclock_snapshot_done", "orders")) == (120_000, 1_000_000, 1, 0)
    # an unknown total has no sample; the rows read do
    assert v("reclock_snapshot_rows_read", "items") == 300
    assert v("reclock_snapshot_rows", "items") is None
    assert v("reclock_snapshot_rows_exact", "items") == 0
    # done: it stays, read == total
    assert v("reclock_snapshot_rows_read", "done") == v("reclock_snapshot_rows", "done") == 42
    assert v("reclock_snapshot_done", "done") == 1
    # an output that takes no snapshot has no series
    assert not [k for k in ss if k[0].startswith("reclock_snapshot")
                and ("output", "none") in k[1]]


def test_the_status_line_and_reclock_status_show_it(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    doc = _doc()
    line = progress_line(doc["sources"][0])
    assert line.endswith("; snapshot orders: 120,000 of 1,000,000 rows (12%)"
                         "; snapshot items: 300 rows read (total not known yet)"), line
    st = {"state_dir": "/x", "driver_running": True, "sources": [
        {**doc["sources"][0], "resume_into": 0}]}
    monkeypatch.setattr(cli, "collect_status", lambda file, history: st)
    assert cli.main(["status", "p.yaml"]) == 0
    shown = capsys.readouterr().out.splitlines()
    i = shown.index("  output orders: nothing committed yet")
    assert shown[i + 1] == "    snapshot orders: 120,000 of 1,000,000 rows (12%)"
    assert "    snapshot items: 300 rows read (total not known yet)" in shown
    assert not [s for s in shown if "snapshot done" in s or "snapshot none" in s]
