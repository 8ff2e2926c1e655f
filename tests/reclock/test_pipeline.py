"""End to end on embedded defaults: YAML in, Spark in the middle, Delta out."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from reclock.config import load_config
from reclock.contracts.consolidate import consolidate
from reclock.pipeline import Pipeline, run
from reclock.verify import verify_pipeline


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "pipeline.yaml"
    p.write_text(text)
    return p


FINITE = """
timestamp_interval: 200ms
sources:
  - name: counter
    generator: {kind: counter, rate: 20000, max_records: 6000, bad_every: 500}
    outputs:
      - name: value
        format: {type: json, schema: {n: int64, payload: string, even: bool}}
        sink: file
  - name: shop
    generator: {kind: orders, rate: 20000, max_records: 3000}
    outputs:
      - {name: customers, sink: file}
      - {name: orders, sink: file}
"""


def test_finite_generators_land_exactly_once(tmp_path: Path, spark: Any) -> None:
    cfg = load_config(write(tmp_path, FINITE))
    runners = run(cfg, spark=spark, duration=120, out=None, install_signals=False)
    assert all(r.health.status == "finished" for r in runners), [r.status() for r in runners]
    reports = verify_pipeline(cfg)
    assert all(r.ok for r in reports), reports
    assert sum(r.complete_checked for r in reports) == 9000
    pipe = Pipeline(cfg)
    built = pipe.build_source(pipe.source_config("counter"))
    out = built.outputs[0]
    updates = out.sink.read_updates()
    assert out.sink.state().upper is None  # finished: closed
    # 6000 records: 12 malformed ones in the error collection, the rest decoded
    assert updates.num_rows == 6000
    errs = updates.filter(pc.invert(pc.is_null(updates.column("_error"))))
    assert errs.num_rows == 12
    assert all("json" in e for e in errs.column("_error").to_pylist())
    good = consolidate(updates, None, ["n", "payload", "even"])
    assert good.num_rows == 5988
    assert sorted(good.column("n").to_pylist())[:3] == [0, 1, 2]
    shop = pipe.build_source(pipe.source_config("shop"))
    counts = [o.sink.read_updates().num_rows for o in shop.outputs]
    assert counts == [600, 2400]
    pipe.close()


def test_stop_and_resume_in_process(tmp_path: Path, spark: Any) -> None:
    cfg = load_config(write(tmp_path, FINITE.replace("max_records: 6000", "max_records: 40000")
                            .replace("rate: 20000, max_records: 40000",
                                     "rate: 10000, max_records: 40000")))
    stop = threading.Event()
    timer = threading.Timer(2.5, stop.set)
    timer.start()
    run(cfg, spark=spark, stop=stop, out=None, install_signals=False)
    assert all(r.ok for r in verify_pipeline(cfg))
    runners = run(cfg, spark=spark, duration=120, out=None, install_signals=False)
    assert all(r.health.status == "finished" for r in runners)
    reports = verify_pipeline(cfg)
    assert all(r.ok for r in reports), reports
    assert sum(r.complete_checked for r in reports) == 43000


def test_a_burst_that_fits_one_task_is_spread_over_every_core(tmp_path: Path, spark: Any) -> None:
    """60,000 records due at once fit one task (200,000 at most): planned
    again as a task per core of local[2], they land once as before."""
    import json

    cfg = load_config(write(tmp_path, """
timestamp_interval: 500ms
sources:
  - name: burst
    generator: {kind: counter, rate: 100000000, max_records: 60000}
    outputs:
      - {name: value, format: {type: json, schema: {n: int64}}, sink: file}
"""))
    runners = run(cfg, spark=spark, duration=120, out=None, install_signals=False)
    assert all(r.health.status == "finished" for r in runners), [r.status() for r in runners]
    reads = [json.loads(line) for line in (tmp_path / "state" / "progress.jsonl")
             .read_text().splitlines()]
    reads = [e for e in reads if e["kind"] == "read" and e["records"]]
    big = [e for e in reads if e["records"] >= 40_000]
    assert big, reads
    assert all(e["tasks"] == 2 and e["largest_task"] == -(-e["records"] // 2) for e in big), big
    reports = verify_pipeline(cfg)
    assert all(r.ok for r in reports) and sum(r.complete_checked for r in reports) == 60_000
    pipe = Pipeline(cfg)
    value = pipe.build_source(pipe.source_config("burst")).outputs[0].sink.read_updates()
    assert sorted(value.column("n").to_pylist()) == list(range(60_000))
    pipe.close()
