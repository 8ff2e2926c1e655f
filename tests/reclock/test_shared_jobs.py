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
