"""Clean stops: Ctrl-C (SIGINT to the whole foreground process group, as a
terminal sends it: the driver, its Spark JVM and the Python workers) and
SIGTERM (to the driver, as ``docker stop`` sends it) both end ``reclock run``
with exit 0, each source's final progress line and no Spark error or Python
traceback on the way down. The output is then consistent (``verify``) and
holds a prefix of the counter, each value once (the model)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest

from reclock.config import load_config
from reclock.verify import verify_pipeline
from tests.running import read_updates, wait_running

pytestmark = pytest.mark.integration

PIPELINE = """
state_dir: {state}
timestamp_interval: 200ms
spark:
  master: local[2]
  conf:
    spark.driver.extraJavaOptions: "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
sources:
  - name: counter
    generator: {{kind: counter, rate: 2000}}
    outputs:
      - {{name: value, format: {{type: json, schema: {{n: int64, payload: string}}}}, sink: file}}
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_signal_stops_the_run_cleanly(tmp_path: Path, how: str) -> None:
    path = tmp_path / "p.yaml"
    state = tmp_path / "state"
    path.write_text(PIPELINE.format(state=state))
    proc = subprocess.Popen([sys.executable, "-m", "reclock.cli", "run", str(path)],
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)  # its own group: a terminal's job
    try:
        assert wait_running(state, proc)
        time.sleep(3)  # a few commits in
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        rc = proc.wait(90)
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        if proc.stderr:
            proc.stderr.close()
    assert rc == 0, err[-3000:]
    lines = err.splitlines()
    assert lines[-1] == "reclock: stopped", err[-3000:]
    assert lines[-2].startswith("[counter] stopped "), err[-3000:]
    assert "Traceback" not in err and " ERROR " not in err and "Exception" not in err, \
        err[-3000:]
    cfg = load_config(path)
    assert all(r.ok for r in verify_pipeline(cfg))
    table = read_updates(cfg, "counter", "value")
    ns = sorted(table.filter(pc.is_null(table.column("_error"))).column("n").to_pylist())
    assert ns and ns == list(range(len(ns)))  # a prefix of the counter, each value once
