"""A pipeline writing Delta to a local S3 endpoint, killed at random moments,
at the driver's crash points, and in the middle of its Delta commits (a proxy
in front of S3 kills the driver as a commit request arrives, or once S3 has
answered it but before the driver hears, or hangs up on the driver instead of
answering): after restarts ``reclock verify`` is clean, and the outputs hold
what a separate model of the counter says -- every position once, values in
order of their IntoTime -- read straight from the bucket."""

from __future__ import annotations

import itertools
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from reclock.config import load_config
from reclock.verify import verify_pipeline
from tests.running import (
    close_driver,
    counter_source,
    crash_env,
    finished,
    start_driver,
    stop_driver,
    wait_exit,
    wait_running,
)
from tests.s3server import CommitTrap
from tests.tally import count

pytestmark = pytest.mark.integration

TOTAL = 16_000
BAD_EVERY = 97

PIPELINE = """
timestamp_interval: 250ms
spark:
  master: local[2]
  max_records_per_job: 2000
  conf:
    spark.driver.extraJavaOptions: "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
sources:
{counter}
  - name: shop
    generator: {{kind: orders, rate: 3000, max_records: {total}, seed: 11}}
    outputs:
      - {{name: customers, sink: {{type: file, path: "s3://{bucket}/lake/customers"}}}}
      - {{name: orders, sink: {{type: file, path: "s3://{bucket}/lake/orders"}}}}
"""


def _counter_rows(s3: Any, bucket: str) -> Any:
    dt = DeltaTable(f"s3://{bucket}/lake/counter",
                    storage_options={**s3.env(), "AWS_ALLOW_HTTP": "true"})
    return dt.to_pyarrow_table(columns=["n", "_src_offset", "_into_time", "_diff", "_error"])


@pytest.mark.timeout(600)
def test_kills_during_s3_commits_lose_nothing_and_double_nothing(
        tmp_path: Path, s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = s3.bucket()
    counter = counter_source(3000, TOTAL, BAD_EVERY,
                             sink=f'{{type: file, path: "s3://{bucket}/lake/counter"}}')
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE.format(counter=counter, total=TOTAL, bucket=bucket))
    trap = CommitTrap(s3.port)
    state = tmp_path / "state"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **s3.env(trap.endpoint)}
    rng = random.Random(20261124)
    plan: list[str | None] = ["kill_before", "kill_after", "drop_answer",
                              "after_sink_commit", None]
    rng.shuffle(plan)
    fired: dict[str, int] = {}
    try:
        for i, step in enumerate(plan):
            point = step if step == "after_sink_commit" else None
            proc = start_driver(path, crash_env(env, point, 0.3, i))
            try:
                up = wait_running(state, proc)
                if up and step in ("kill_before", "kill_after", "drop_answer"):
                    time.sleep(rng.uniform(0.2, 1.5))
                    trap.arm(step, proc.pid)
                    deadline = time.monotonic() + 20
                    while trap.sprung.count(step) <= fired.get(step, 0) and (
                            time.monotonic() < deadline and proc.poll() is None):
                        time.sleep(0.05)
                    trap.arm(None)
                    if step == "drop_answer":  # it lives on: let it get past it, then kill
                        time.sleep(rng.uniform(1.0, 2.0))
                        proc.send_signal(signal.SIGKILL)
                elif up and step is None:
                    time.sleep(rng.uniform(0.5, 2.5))
                    proc.send_signal(signal.SIGKILL)
                rc = wait_exit(proc, 60 if point else 30)
                if rc == -signal.SIGKILL and step is not None:
                    fired[step] = fired.get(step, 0) + 1
            finally:
                close_driver(proc)
        # Every trap mode fired as planned, and the kills landed.
        assert trap.sprung.count("kill_before") >= 1 and trap.sprung.count("kill_after") >= 1
        assert "drop_answer" in trap.sprung
        assert sum(fired.values()) >= 3, fired
        # Then without faults, to the end.
        proc = start_driver(path, env)
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and proc.poll() is None:
                if {"counter", "shop"} <= finished(state):
                    break
                time.sleep(0.5)
        finally:
            rc, err = stop_driver(proc)
        assert rc == 0 and "Traceback" not in err, err[-3000:]
    finally:
        trap.close()

    # The model: the counter wrote positions 0..TOTAL-1 once each, value n at
    # position n, a malformed record at every BAD_EVERY-th; stamping follows
    # the positions (a later position never gets an earlier IntoTime).
    t = _counter_rows(s3, bucket).sort_by("_src_offset")
    offsets = t.column("_src_offset").to_pylist()
    assert offsets == list(range(TOTAL)), (len(offsets), len(set(offsets)))
    assert set(t.column("_diff").to_pylist()) == {1}
    errors = pc.is_valid(t.column("_error")).to_pylist()
    assert [o for o, e in zip(offsets, errors, strict=True) if e] == [
        n for n in range(TOTAL) if n % BAD_EVERY == BAD_EVERY - 1]
    good = t.filter(pc.invert(pc.is_valid(t.column("_error"))))
    assert good.column("n").to_pylist() == good.column("_src_offset").to_pylist()
    into = t.column("_into_time").to_pylist()
    assert all(a <= b for a, b in itertools.pairwise(into))

    for k, v in s3.env().items():  # verify reaches the bucket as the driver did
        monkeypatch.setenv(k, v)
    reports = verify_pipeline(load_config(path))
    for r in reports:
        assert r.ok, (r.source, [(o.output, o.breaches, o.samples) for o in r.outputs])
    assert {r.source: r.complete_checked for r in reports} == {"counter": TOTAL, "shop": TOTAL}
    count("kill: counter, orders -> Delta on S3", kill_points_tried=len(plan),
          sigkills=sum(fired.values()), commits_trapped=len(trap.sprung),
          records_checked=2 * TOTAL)
    print(f"S3 kill test: trap fired {trap.sprung}, kills {fired}, "
          f"{2 * TOTAL} records verified exactly once")
