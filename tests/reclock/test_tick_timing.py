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


def test_bindings_are_minted_just_after_their_time(tmp_path: Path) -> None:
    """A real pipeline (no Spark: the data plane in this process): each
    binding is logged moments after its IntoTime, not anywhere within the
    interval that follows it."""
    path = tmp_path / "pipeline.yaml"
    path.write_text(f"""state_dir: {json.dumps(str(tmp_path / 'state'))}
timestamp_interval: 500ms
sources:
  - name: c
    generator: {{kind: counter, rate: 200}}
    outputs: [{{name: value, sink: file}}]
""")
    cfg = load_config(path)
    # start mid-interval: ticks an interval apart would stay that late
    while not 200 <= time.time() * 1000 % 500 < 220:
        time.sleep(0.002)
    run(cfg, use_spark=False, out=None, install_signals=False, duration=4.0)
    events = [json.loads(line) for line in
              (tmp_path / "state" / "progress.jsonl").read_text().splitlines()]
    late = [e["ts"] - e["time"] for e in events if e["kind"] == "binding"][1:]
    assert len(late) >= 5, late
    assert all(x >= 0 for x in late)
    # without the alignment each is about as late as the first tick was
    # into its interval (here 200 ms or more), and a loaded machine only
    # makes a tick later: several bindings minted within 60 ms of their
    # time show the alignment whatever else the machine is doing
    assert sum(x < 60 for x in late) >= 2, late
