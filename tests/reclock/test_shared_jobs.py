"""Small jobs of many sources run in shared Spark jobs: every source still
holds each of its records exactly once (a plain model: record n of a counter
is n, each once), a source whose sink fails stalls alone, and failures
injected at the source probe and the commit lose nothing."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from reclock import faults
from reclock.config import load_config
from reclock.pipeline import run
from reclock.runtime.driver import SourceRunner
from reclock.verify import verify_pipeline
from tests.running import read_updates, wait_for

SOURCES, TOTAL = 10, 1200


def test_small_jobs_of_many_sources_share_spark_jobs_exactly_once(
        tmp_path: Path, spark: Any) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file where a directory should be")
    sources = "".join(f"""
  - name: s{i}
    generator: {{kind: counter, rate: 400, max_records: {TOTAL}, seed: {i}}}
    outputs:
      - {{name: value, format: {{type: json, schema: {{n: int64}}}}, sink: file}}""" for i in
                      range(SOURCES))
    path = tmp_path / "p.yaml"
    path.write_text(f"""
timestamp_interval: 200ms
sources:{sources}
  - name: broken
    generator: {{kind: counter, rate: 400}}
    outputs:
      - {{name: value, format: json, sink: {{type: file, path: {blocker}/out}}}}
""")
    cfg = load_config(path)
    runners: list[SourceRunner] = []
    stop = threading.Event()
    done: list[Any] = []

    def watch(started: list[SourceRunner]) -> None:
        runners.extend(started)

        def until_finished() -> None:
            wait_for(lambda: all(r.health.status == "finished" for r in started
                                 if r.name != "broken"), 60, "the counters to finish")
            stop.set()

        threading.Thread(target=until_finished, daemon=True).start()

    faults.arm("source:3,commit:3")
    try:
        done.append(run(cfg, spark=spark, stop=stop, out=None, install_signals=False,
                        on_ready=watch))
    finally:
        faults.disarm()
    assert done[0].stalled == ["broken"]
    by = {r.name: r for r in runners}
    assert all(by[f"s{i}"].health.status == "finished" for i in range(SOURCES)), \
        {r.name: r.status()["health"] for r in runners}
    shared = [e["shared"] for r in runners for e in r.events.recent
              if e["kind"] == "read" and e["source"] == r.name]
    assert max(shared) > 2, Counter(shared)  # jobs of several sources ran as one
    print("sources per job:", sorted(Counter(shared).items()))
    for i in range(SOURCES):
        t = read_updates(cfg, f"s{i}", "value")
        assert t.filter(pc.invert(pc.is_null(t.column("_error")))).num_rows == 0
        held = Counter(zip(t.column("n").to_pylist(), t.column("_diff").to_pylist(),
                           strict=True))
        assert held == Counter({(n, 1): 1 for n in range(TOTAL)}), f"s{i}"
    reports = [r for r in verify_pipeline(cfg) if r.source != "broken"]
    assert reports and all(r.ok for r in reports), [r.source for r in reports if not r.ok]


def test_a_task_that_raises_and_a_worker_that_dies_in_shared_jobs(
        tmp_path: Path, spark: Any) -> None:
    """In shared jobs: one source's tasks raise (its output's directory is a
    regular file), and, once, a Python worker is killed (SIGKILL from inside
    a task, after it staged its files: the OOM killer's way). The failing
    source stalls alone and retries; the job the worker died in fails for
    every source in it, which read again; against the model (record n of
    a counter is n), nothing is lost and nothing doubled anywhere."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file where a directory should be")
    marker = tmp_path / "worker-killed"
    sources = "".join(f"""
  - name: s{i}
    generator: {{kind: counter, rate: 400, max_records: {TOTAL}, seed: {i}}}
    outputs:
      - {{name: value, format: {{type: json, schema: {{n: int64}}}}, sink: file}}""" for i in
                      range(SOURCES))
    path = tmp_path / "p.yaml"
    path.write_text(f"""
timestamp_interval: 200ms
sources:{sources}
  - name: broken
    generator: {{kind: counter, rate: 400}}
    outputs:
      - {{name: value, format: json, sink: {{type: file, path: {blocker}/out}}}}
""")
    cfg = load_config(path)
    runners: list[SourceRunner] = []
    stop = threading.Event()
    done: list[Any] = []

    sc = spark.sparkContext
    plain = sc.environment

    def shared_reads(started: list[SourceRunner]) -> list[int]:
        return [e["shared"] for r in started for e in list(r.events.recent)
                if e["kind"] == "read" and e["source"] == r.name]

    def watch(started: list[SourceRunner]) -> None:
        runners.extend(started)

        def kill_then_finish() -> None:
            # Once jobs are shared, arm the kill (in a job of several
            # sources): the variable reaches the workers of the jobs started
            # from now on (a new dict: a job being started reads the old one
            # whole).
            wait_for(lambda: max(shared_reads(started), default=0) > 2, 60,
                     "jobs of several sources to share a Spark job")
            sc.environment = {**plain, "RECLOCK_KILL_WORKER": f"shared:{marker}"}
            wait_for(marker.exists, 60, "a worker to be killed")
            sc.environment = plain
            wait_for(lambda: all(r.health.status == "finished" for r in started
                                 if r.name != "broken"), 120, "the counters to finish")
            stop.set()

        threading.Thread(target=kill_then_finish, daemon=True).start()

    try:
        done.append(run(cfg, spark=spark, stop=stop, out=None, install_signals=False,
                        on_ready=watch))
    finally:
        sc.environment = plain
    assert marker.exists(), "no worker was killed"
    killed = int(marker.read_text())
    assert done[0].stalled == ["broken"]
    by = {r.name: r for r in runners}
    assert all(by[f"s{i}"].health.status == "finished" for i in range(SOURCES)), \
        {r.name: r.status()["health"] for r in runners}
    # The broken source stalled on its own task's error, a transient one it retries.
    errors = [e for e in by["broken"].events.recent if e["kind"] == "health"
              and e["source"] == "broken" and e["status"] == "stalled"]
    assert errors and "not-a-dir" in (errors[-1].get("error") or ""), errors[-1:]
    # The job the worker died in failed for the sources in it: they stalled
    # and read again.
    hit = {r.name for r in runners for e in r.events.recent
           if e["kind"] == "health" and e["source"] == r.name and e["status"] == "stalled"
           and r.name != "broken"}
    assert len(hit) >= 2, f"the job of worker {killed} failed for {sorted(hit)} only"
    print("killed worker", killed, "; sources whose job failed:", sorted(hit),
          [e.get("error", "")[:300] for r in runners for e in r.events.recent
           if e["kind"] == "health" and e["source"] == r.name and e["status"] == "stalled"
           and r.name != "broken"][:2])
    shared = [e["shared"] for r in runners for e in r.events.recent
              if e["kind"] == "read" and e["source"] == r.name]
    assert max(shared) > 2, Counter(shared)
    for i in range(SOURCES):
        t = read_updates(cfg, f"s{i}", "value")
        assert t.filter(pc.invert(pc.is_null(t.column("_error")))).num_rows == 0
        held = Counter(zip(t.column("n").to_pylist(), t.column("_diff").to_pylist(),
                           strict=True))
        assert held == Counter({(n, 1): 1 for n in range(TOTAL)}), f"s{i}"
