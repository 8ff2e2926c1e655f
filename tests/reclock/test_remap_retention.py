"""The driver holds only the bindings its run still reads; the store keeps
``housekeeping.remap_retention`` of history. Records are stamped, resumed
and verified exactly as when the driver held all of it: checked against a
model built from the progress log's binding events, not from the store."""

from __future__ import annotations

import bisect
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from reclock.config import load_config
from reclock.pipeline import Pipeline, run
from reclock.runtime import housekeeping
from reclock.verify import verify_pipeline

pytestmark = pytest.mark.unit

PIPELINE = """state_dir: state
timestamp_interval: 100ms
housekeeping: {{remap_retention: {retention}}}
sources:
  - name: c
    generator: {{kind: counter, rate: 3000}}
    outputs:
      - name: value
        format: {{type: json, schema: {{n: int64}}}}
        sink: file
"""


def _run(tmp_path: Path, retention: str, seconds: float, minted: int = 0
         ) -> tuple[Any, list[int]]:
    """Run the pipeline for ``seconds``, or until its operator minted
    ``minted`` bindings (a loaded machine mints fewer in a given time); the
    largest number of bindings its operator held after each tick (the first
    tick's open reads the whole store)."""
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE.format(retention=retention))
    cfg = load_config(path)
    held: list[int] = []
    done = threading.Event()
    stop = threading.Event()

    def sample(runner: Any) -> None:
        while not done.wait(0.01):
            op = runner.operator
            if op is not None and runner.ticks >= 2:
                held.append(len(op.bindings))
                if minted and op.retained >= minted:
                    stop.set()

    def ready(runners: list[Any]) -> None:
        threading.Thread(target=sample, args=(runners[0],), daemon=True).start()

    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(housekeeping, "COMPACT_EVERY_TICKS", 5)
            runners = run(cfg, use_spark=False, out=None, install_signals=False,
                          duration=seconds, on_ready=ready, stop=stop)
    finally:
        done.set()
    return runners[0], held


def test_the_driver_holds_what_it_reads_and_the_store_what_is_retained(
        tmp_path: Path) -> None:
    # 1. Everything retained: the store grows, the driver's memory does not.
    r1, held = _run(tmp_path, "1h", 60.0, minted=20)
    cfg = load_config(tmp_path / "pipeline.yaml")
    pipe = Pipeline(cfg)
    stored = pipe.store.read("c")
    assert len(stored) >= 15, len(stored)
    assert r1.status()["bindings"] == r1.operator.retained == len(stored)
    assert held and max(held) <= 3, held
    assert len(r1.operator.bindings) < len(stored)
    first = int(stored.bindings[0].time)

    # 2. A restart with a short retention: the store is compacted behind where
    # the outputs resume; its count stays the one status reports.
    r2, held = _run(tmp_path, "300ms", 3.0)
    stored = pipe.store.read("c")
    assert int(stored.since) == int(stored.bindings[0].time) > first
    assert r2.operator.store_since == int(stored.since)
    assert r2.status()["bindings"] == r2.operator.retained == len(stored)
    assert len(stored) <= 12, len(stored)  # ~300 ms of 100 ms bindings, and what resuming needs
    assert held and max(held) <= 3, held

    # 3. The model: counter value n is at position n; a record at position p
    # is stamped with the time of the first binding logged whose frontier
    # passed p. Every value up to the committed ones lands exactly once.
    events = [json.loads(line) for line in
              (tmp_path / "state" / "progress.jsonl").read_text().splitlines()]
    bound: dict[int, int] = {}
    for e in events:
        if e["kind"] == "binding" and e["frontier"]:
            bound.setdefault(int(e["time"]), int(e["frontier"][0]))
    times = sorted(bound)
    frontiers = [bound[t] for t in times]
    assert frontiers == sorted(frontiers)
    built = pipe.build_source(pipe.source_config("c"))
    table = built.outputs[0].sink.read_updates()
    ns = table.column("n").to_pylist()
    offsets = table.column("_src_offset").to_pylist()
    stamps = table.column("_into_time").to_pylist()
    assert table.column("_error").null_count == table.num_rows
    assert sorted(ns) == list(range(len(ns))) and len(ns) > 10_000
    assert ns == offsets
    want = [times[bisect.bisect_right(frontiers, p)] for p in offsets]
    assert stamps == want
    upper = built.outputs[0].sink.state().upper
    assert upper is not None and max(stamps) < upper
    pipe.close()

    reports = verify_pipeline(cfg)
    assert all(rep.ok for rep in reports), reports
