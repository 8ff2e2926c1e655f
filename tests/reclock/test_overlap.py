"""Job k+1 reads while job k runs and commits; commits stay one at a time, in order,
and a failed commit discards the job in flight (its data is read again)."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from reclock.config import load_config
from reclock.core.errors import TransientError
from reclock.pipeline import run
from reclock.runtime.jobs import Jobs
from reclock.sinks.delta import DeltaSink
from reclock.verify import verify_pipeline

PIPELINE = """
timestamp_interval: 300ms
spark: {max_records_per_job: 3000, max_records_per_task: 1500}
sources:
  - name: counter
    generator: {kind: counter, rate: 200000, max_records: 30000}
    outputs:
      - name: value
        format: {type: json, schema: {n: int64, payload: string, even: bool}}
        sink: file
"""

def _run_to_the_end(tmp_path: Path, spark: Any) -> Any:
    """Run PIPELINE until its source finishes; returns its configuration."""
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE)
    cfg = load_config(path)
    runners = run(cfg, spark=spark, duration=180, out=None, install_signals=False)
    assert runners[0].health.status == "finished", runners[0].status()
    return cfg


def _every_record_once(cfg: Any) -> None:
    reports = verify_pipeline(cfg)
    assert all(r.ok for r in reports), reports
    assert reports[0].complete_checked == 30_000


def test_next_job_reads_while_a_commit_runs_and_a_failed_commit_discards_it(
    tmp_path: Path, spark: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = threading.Lock()
    jobs: list[tuple[float, float]] = []
    commits: list[tuple[float, float, int | None]] = []
    failed = {"n": 0}
    execute, commit = Jobs.execute, DeltaSink.commit

    def timed_execute(self: Jobs, ctx: Any, tasks: Any) -> Any:
        t0 = time.monotonic()
        try:
            return execute(self, ctx, tasks)
        finally:
            with lock:
                jobs.append((t0, time.monotonic()))

    def slow_commit(self: DeltaSink, staged: Any, expected: Any, new: Any) -> None:
        t0 = time.monotonic()
        time.sleep(0.3)  # a slow sink: the next job should be reading meanwhile
        if staged and len(commits) == 3 and not failed["n"]:
            failed["n"] += 1
            raise TransientError("injected: the sink went away mid-commit")
        commit(self, staged, expected, new)
        with lock:
            commits.append((t0, time.monotonic(), new.upper))

    monkeypatch.setattr(Jobs, "execute", timed_execute)
    monkeypatch.setattr(DeltaSink, "commit", slow_commit)
    cfg = _run_to_the_end(tmp_path, spark)
    assert failed["n"] == 1
    # Some job ran while a commit was under way ...
    overlapped = sum(1 for j0, j1 in jobs for c0, c1, _ in commits if j0 < c1 and c0 < j1)
    assert overlapped >= 3, (jobs, commits)
    # ... yet commits never overlapped each other and their uppers only grew.
    ordered = sorted(commits)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ordered))
    uppers = [u for _, _, u in ordered]
    assert uppers[:-1] == sorted(uppers[:-1]) and uppers[-1] is None  # finished: closed
    # The failed commit's data and the discarded job's were read again: all once.
    _every_record_once(cfg)


def test_a_failure_planning_the_next_job_still_commits_the_one_read(
    tmp_path: Path, spark: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from reclock.sources.generator import GeneratorSource

    events: list[str] = []
    plan, commit = GeneratorSource.plan, DeltaSink.commit

    def flaky_plan(self: Any, *args: Any) -> Any:
        # the first plan made while a job is read and not yet committed (not
        # a fixed call: on a slow machine the third call can come after both
        # earlier jobs committed, and then nothing is in flight)
        if "plan failed" not in events and events and events[-1] == "execute":
            events.append("plan failed")
            raise TransientError("injected: cannot plan")
        return plan(self, *args)

    def logged_commit(self: DeltaSink, staged: Any, expected: Any, new: Any) -> None:
        commit(self, staged, expected, new)
        events.append("commit")

    execute = Jobs.execute

    def logged_execute(self: Jobs, ctx: Any, tasks: Any) -> Any:
        events.append("execute")
        return execute(self, ctx, tasks)

    monkeypatch.setattr(GeneratorSource, "plan", flaky_plan)
    monkeypatch.setattr(DeltaSink, "commit", logged_commit)
    monkeypatch.setattr(Jobs, "execute", logged_execute)
    cfg = _run_to_the_end(tmp_path, spark)
    at = events.index("plan failed")
    # the job already read was committed, not read again
    assert events[at + 1] == "commit", events
    _every_record_once(cfg)


@pytest.mark.parametrize("depth", [1, 2])
def test_jobs_in_flight_read_together_and_commit_in_order(
    tmp_path: Path, spark: Any, monkeypatch: pytest.MonkeyPatch, depth: int
) -> None:
    """``spark.jobs_in_flight: 2`` lets job k+1 run while job k runs (Spark's
    fixed cost per job is hidden); with 1, jobs never overlap. Either way
    commits are one at a time, in job order, and every record lands once."""
    lock = threading.Lock()
    jobs: list[tuple[float, float, str]] = []
    commits: list[tuple[float, float, int | None]] = []
    execute, commit = Jobs.execute, DeltaSink.commit

    def slow_execute(self: Jobs, ctx: Any, tasks: Any) -> Any:
        t0 = time.monotonic()
        time.sleep(0.2)  # a job's fixed cost: the next one should run meanwhile
        try:
            return execute(self, ctx, tasks)
        finally:
            with lock:
                jobs.append((t0, time.monotonic(), ctx.batch_id))

    def timed_commit(self: DeltaSink, staged: Any, expected: Any, new: Any) -> None:
        t0 = time.monotonic()
        commit(self, staged, expected, new)
        with lock:
            commits.append((t0, time.monotonic(), new.upper))

    monkeypatch.setattr(Jobs, "execute", slow_execute)
    monkeypatch.setattr(DeltaSink, "commit", timed_commit)
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE.replace("max_records_per_task: 1500}",
                                     f"max_records_per_task: 1500, jobs_in_flight: {depth}}}"))
    cfg = load_config(path)
    assert cfg.spark.jobs_in_flight == depth
    runners = run(cfg, spark=spark, duration=180, out=None, install_signals=False)
    assert runners[0].health.status == "finished", runners[0].status()
    overlapping = sum(1 for a, b in itertools.combinations(jobs, 2) if a[0] < b[1] and b[0] < a[1])
    if depth == 1:
        assert overlapping == 0, jobs
    else:
        assert overlapping >= 3, jobs
    ordered = sorted(commits)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ordered))
    uppers = [u for _, _, u in ordered]
    assert uppers[:-1] == sorted(uppers[:-1]) and uppers[-1] is None
    _every_record_once(cfg)
