"""A zombie: a second driver started on the same pipeline and state while the
first one runs (without the one-driver lock, which refuses a plain second
``run``, as this test checks first). Both mint and commit; the remap store's compare-and-append
and the sinks' fenced commits make them take turns. Afterwards the bindings
are valid, every record is in its output exactly once at the IntoTime its
bindings give (``reclock verify``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reclock.config import load_config
from reclock.verify import verify_pipeline
from tests.running import (
    close_driver,
    counter_source,
    start_driver,
    stop_driver,
    wait_for,
    wait_running,
)
from tests.tally import count

TOTAL = 80_000


@pytest.mark.timeout(400)
def test_two_drivers_on_one_state_are_fenced(tmp_path: Path, pg_url: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
remap_store: "{pg_url}"
timestamp_interval: 200ms
spark:
  master: local[1]
  max_records_per_job: 4000
  conf:
    spark.driver.extraJavaOptions: "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
sources:
{counter_source(6000, TOTAL, 89)}
  - name: shop
    generator: {{kind: orders, rate: 6000, max_records: {TOTAL}, seed: 3}}
    outputs:
      - name: customers
        sink: {{type: postgres, dsn: "{pg_url}", table: customers, mode: state,
               key: [customer_id]}}
      - {{name: orders, sink: file}}
""")
    state = tmp_path / "state"
    first = start_driver(path)
    assert wait_running(state, first)
    # A second run of the same file is refused at once, naming the first...
    refused = subprocess.run([sys.executable, "-m", "reclock.cli", "run", str(path)],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"already running as pid {first.pid} on host {socket.gethostname()}" in \
        refused.stderr, refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr
    # ... so the zombie is one that runs without the lock, as a driver that
    # lost its store session would: same file, same state, same remap store.
    zombie = start_driver(path, {**os.environ, "PYTHONUNBUFFERED": "1",
                                 "RECLOCK_SKIP_DRIVER_LOCK": "1"})
    assert wait_running(state, zombie)
    # Both run side by side; the first dies well before the generators'
    # rate lets them finish (~TOTAL / 6000 s after the first started).
    time.sleep(5)
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    close_driver(first)
    cfg = load_config(path)

    def finished() -> bool:
        if zombie.poll() is not None:  # it exits once every source finished
            return True
        doc = json.loads((state / "status.json").read_text())
        return doc["pid"] == zombie.pid and all(
            s["health"]["status"] == "finished" for s in doc["sources"])

    try:
        wait_for(finished, 240, "the remaining driver to finish")
        zombie.wait(60)
    finally:
        rc, err = stop_driver(zombie)
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    reports = verify_pipeline(cfg)  # reads the bindings back: they validate
    for r in reports:
        assert r.ok, (r.source, [(o.output, o.breaches, o.samples) for o in r.outputs])
    assert {r.source: r.complete_checked for r in reports} == {"counter": TOTAL,
                                                               "shop": TOTAL - TOTAL // 5}
    count("zombie driver", drivers=2, records_checked=sum(r.complete_checked for r in reports))
