"""A job that never finishes (a task that stops making progress, as one
whose result a driver out of memory never takes in: the ``hang`` failure
point) is not a silent ``running``: past ``spark.job_timeout`` it is
cancelled, the source reports a stall naming it and reads the range again,
losing and doubling nothing; and a stop is not held up by it."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest

from reclock import faults
from reclock.config import load_config
from reclock.pipeline import run
from reclock.verify import verify_pipeline
from tests.running import read_updates, wait_for

PIPELINE = """
state_dir: {tmp}/state
timestamp_interval: 200ms
spark: {{job_timeout: 2s}}
sources:
  - name: gen
    generator: {{kind: counter, rate: 2000, max_records: {total}}}
    outputs:
      - {{name: n, format: {{type: json, schema: {{n: int64}}}}, sink: file}}
"""


@pytest.fixture
def disarmed() -> Any:
    yield
    faults.disarm()


def _start(tmp_path: Path, total: int) -> tuple[Any, threading.Event, list[Any], threading.Thread]:
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(tmp=tmp_path, total=total))
    cfg = load_config(path)
    stop = threading.Event()
    runners: list[Any] = []
    t = threading.Thread(target=run, kwargs=dict(cfg=cfg, use_spark=False, stop=stop, out=None,
                                                  install_signals=False,
                                                  on_ready=runners.extend))
    t.start()
    wait_for(lambda: bool(runners), 30, "the source to start")
    return cfg, stop, runners, t


def test_a_job_past_its_timeout_is_a_stall_and_is_read_again(
        tmp_path: Path, disarmed: None) -> None:
    faults.arm("hang:1")
    cfg, stop, runners, t = _start(tmp_path, 3000)
    r = runners[0]
    try:
        wait_for(lambda: r.health.status == "stalled", 10, lambda: f"a stall: {r.health}")
        assert r.health.error is not None and "without finishing" in r.health.error
        assert r.health.hint is not None and "out of memory" in r.health.hint
        started = time.monotonic()
        wait_for(lambda: r.health.status == "finished", 60, lambda: f"the end: {r.health}")
        assert time.monotonic() - started < faults.HANG_S + 30
    finally:
        stop.set()
        t.join(60)
    t = read_updates(cfg, "gen", "n")
    ok = t.filter(pc.is_null(t.column("_error")))
    net: Counter[int] = Counter()
    for n, d in zip(ok.column("n").to_pylist(), ok.column("_diff").to_pylist(), strict=True):
        net[n] += d
    assert +net == Counter(range(3000))  # each record once
    assert all(rep.ok for rep in verify_pipeline(cfg))


def test_a_stop_does_not_wait_for_a_job_that_never_finishes(
        tmp_path: Path, disarmed: None) -> None:
    _cfg, stop, runners, t = _start(tmp_path, 10**9)
    r = runners[0]
    wait_for(lambda: r.records > 0, 30, "records")
    faults.arm("hang:1")
    time.sleep(0.6)  # the next job's task hangs
    asked = time.monotonic()
    stop.set()
    t.join(60)
    took = time.monotonic() - asked
    assert not t.is_alive() and took < faults.HANG_S - 2, took  # grace: min(20 s, 2 s)
    assert r.health.status == "stopped", r.health
