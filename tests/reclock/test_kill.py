"""kill -9 at random moments, and at every named crash point of the commit path:
after restarts, every generated record is in its output exactly once, at the
IntoTime its bindings give (``reclock verify``)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reclock import faults
from reclock.config import load_config
from reclock.verify import verify_pipeline

TOTAL = 60_000

PIPELINE = f"""
timestamp_interval: 250ms
spark:
  master: local[2]
  max_records_per_job: 3000      # several bounded jobs per binding: partial commits
  max_records_per_task: 1500
  conf:
    spark.driver.extraJavaOptions: "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
sources:
  - name: counter
    generator: {{kind: counter, rate: 4000, max_records: {TOTAL}, bad_every: 97}}
    outputs:
      - name: value
        format: {{type: json, schema: {{n: int64, payload: string}}}}
        sink: file
  - name: shop
    generator: {{kind: orders, rate: 4000, max_records: {TOTAL}, seed: 7}}
    outputs:
      - {{name: customers, sink: file}}
      - {{name: orders, sink: file}}
"""


def _start(path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "reclock.cli", "run", str(path)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def _wait_running(state: Path, proc: subprocess.Popen[bytes], timeout: float = 90) -> bool:
    """Until the driver's status file shows this process with open sources."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            doc = json.loads((state / "status.json").read_text())
            if doc.get("pid") == proc.pid and doc["sources"]:
                return True
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise AssertionError("driver did not come up")


@pytest.mark.timeout(900)
def test_sigkill_at_random_moments_and_crash_points(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE)
    state = tmp_path / "state"
    rng = random.Random(20261121)
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Every named crash point, each at least twice, plus plain random SIGKILLs.
    plan: list[str | None] = [p for p in faults.POINTS for _ in range(2)] + [None] * 12
    rng.shuffle(plan)
    kills = 0
    crash_exits = 0
    for i, point in enumerate(plan):
        env = dict(base_env)
        if point is not None:
            env["RECLOCK_CRASH_AT"] = f"{point}:0.25"
            env["RECLOCK_CRASH_SEED"] = str(i)
        proc = _start(path, env)
        try:
            up = _wait_running(state, proc)
            if point is None and up:
                time.sleep(rng.uniform(0.2, 3.0))
                proc.send_signal(signal.SIGKILL)
                kills += 1
            rc = proc.wait(timeout=60 if point else 30)
            if point is not None:
                if rc == -signal.SIGKILL:
                    crash_exits += 1
                else:  # finished before the point fired: fine, nothing to kill
                    assert rc == 0, proc.stderr.read().decode() if proc.stderr else rc
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            kills += 1
        finally:
            if proc.stderr:
                proc.stderr.close()
    assert kills + crash_exits >= 20, (kills, crash_exits)
    # Run to completion without faults.
    done = subprocess.run(
        [sys.executable, "-m", "reclock.cli", "run", str(path)], env=base_env,
        capture_output=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    cfg = load_config(path)
    reports = verify_pipeline(cfg)
    for r in reports:
        assert r.ok, (r.source, [(o.output, o.breaches, o.samples) for o in r.outputs])
    counts = {r.source: r.complete_checked for r in reports}
    assert counts == {"counter": TOTAL, "shop": TOTAL}
    print(f"kill test: {kills} SIGKILLs, {crash_exits} crash-point exits, "
          f"{sum(counts.values())} records verified exactly once")
