"""When a source ticks: just past the IntoTime its next binding can take, so
that a binding's time is when its frontier was probed (and an output's lag
after a commit is the tick's own time, not up to an interval more)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from reclock.config import load_config
from reclock.pipeline import run
from reclock.runtime.driver import TICK_AFTER_BOUNDARY_MS, next_tick_in

pytestmark = pytest.mark.unit


def test_the_next_tick_waits_for_the_first_binding_time_past_the_remap_upper() -> None:
    after = TICK_AFTER_BOUNDARY_MS / 1000.0
    # bound up to 12,000 (upper 12,001); the tick ended at 12,300 after 0.3 s
    assert next_tick_in(1000, 12_001, 12_300, 0.3) == pytest.approx(0.7 + after)
    # a tick that began late in an interval: the next boundary comes soon,
    # not a whole interval after the tick began
    assert next_tick_in(1000, 12_001, 12_950, 0.05) == pytest.approx(0.05 + after)
    # the clock already passed the next boundary: at once
    assert next_tick_in(1000, 12_001, 13_020, 0.5) == 0.0
    # an upper on a boundary (a binding can take it): just past it
    assert next_tick_in(1000, 13_000, 12_998, 0.1) == pytest.approx(0.002 + after)
    # never more than the rest of the interval since the tick began (a
    # clock that does not move), never less than 0; overran: at once
    assert next_tick_in(1000, 12_001, 12_001, 0.6) == pytest.approx(0.4 + after)
    assert next_tick_in(1000, 12_001, 11_000, 0.0) == pytest.approx(1.0 + after)
    assert next_tick_in(1000, 12_001, 12_300, 1.7) == 0.0
    # no upper (closed, or nothing minted yet): the rest of the interval
    assert next_tick_in(1000, None, 12_300, 0.25) == pytest.approx(0.75)


def test_a_running_source_sleeps_until_just_past_its_next_binding_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real pipeline (no Spark: the data plane in this process) asks
    :func:`next_tick_in` with its real remap upper and clock after each tick,
    and sleeps what it answers: each wake-up is aimed just past the IntoTime
    the next binding takes, not a whole interval after the tick began. (How
    late bindings land on a loaded machine is a latency figure, measured by
    bench/pipeline_bench.py, not asserted here.)"""
    from reclock.runtime import driver

    calls: list[tuple[int | None, int, float]] = []

    def recorded(interval_ms: int, upper: int | None, now_ms: int, elapsed_s: float) -> float:
        wait = next_tick_in(interval_ms, upper, now_ms, elapsed_s)
        calls.append((upper, now_ms, wait))
        return wait

    monkeypatch.setattr(driver, "next_tick_in", recorded)
    path = tmp_path / "pipeline.yaml"
    path.write_text(f"""state_dir: {json.dumps(str(tmp_path / 'state'))}
timestamp_interval: 2s
sources:
  - name: c
    generator: {{kind: counter, rate: 20}}
    outputs: [{{name: value, sink: file}}]
""")
    cfg = load_config(path)
    started = time.time() * 1000
    run(cfg, use_spark=False, out=None, install_signals=False, duration=7.0)
    events = [json.loads(line) for line in
              (tmp_path / "state" / "progress.jsonl").read_text().splitlines()]
    bound = [e["time"] for e in events if e["kind"] == "binding"]
    assert len(bound) >= 3, bound
    uppers = [u for u, _now, _w in calls if u is not None]
    # the runner passes the upper of the bindings it minted (a binding at t
    # leaves the upper at t + 1) and the clock's own time
    assert set(uppers) <= {t + 1 for t in bound} and len(uppers) >= 3, (uppers, bound)
    assert all(started - 1000 <= now <= time.time() * 1000 + 1 for _u, now, _w in calls)
    # each wake-up lands just past the boundary after the upper; a tick that
    # overran it (a loaded machine) goes on at once
    for u, now, wait in calls:
        if u is None:
            continue
        boundary = -(-u // 2000) * 2000 + TICK_AFTER_BOUNDARY_MS
        if wait == 0:
            assert now >= boundary - 10, (u, now, calls)
        else:
            assert abs(now + wait * 1000 - boundary) <= 10, (u, now, wait, calls)
    # a tick of a 20 records/s counter takes far less than 2 s: some wait
    assert sum(wait > 0 for u, _now, wait in calls if u is not None) >= 1, calls
