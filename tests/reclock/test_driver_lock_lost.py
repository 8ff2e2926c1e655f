"""The driver lock of a PostgreSQL remap store lost while the driver runs.

Regression: the advisory lock was taken once at start and never checked
again. A restart of the store's server ended its session and the lock with
it; a second driver with its own state directory then started, and the two
took turns writing (fenced commits, health flipping between running and
stalled), neither saying it had lost the lock.

Now the lock is re-checked for the driver's life: lost, nothing commits and
the health says which lock and why; taken again when the server is back; a
driver that took it meanwhile keeps it, and the first stops for good naming
it. The outputs are compared with the generator's model: every counter value
exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from reclock.config import load_config
from reclock.core.errors import AlreadyRunning
from reclock.pipeline import run
from tests.running import (
    close_driver,
    read_updates,
    running,
    start_driver,
    wait_exit,
    wait_for,
    wait_running,
)

pytestmark = pytest.mark.integration


def _config(tmp_path: Path, name: str, store: str, out: Path, total: int | None, rate: int,
            spark_master: str = "local[1]") -> Path:
    """A pipeline of one counter source whose output is ``out`` (shared by
    the two drivers of a test: one pipeline, two state directories);
    ``total``: the generator's records (None: no end)."""
    end = "" if total is None else f", max_records: {total}"
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/{name}-state
remap_store: "{store}"
timestamp_interval: 200ms
spark:
  master: {spark_master}
  conf:
    spark.driver.extraJavaOptions: "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
sources:
  - name: counter
    generator: {{kind: counter, rate: {rate}{end}}}
    outputs:
      - name: value
        format: {{type: json, schema: {{n: int64, payload: string}}}}
        sink: {{type: file, path: "{out}"}}
""")
    return path


def _assert_exactly_once(cfg: Any, total: int | None) -> None:
    """The model: the counter's records 0 .. total-1, each once, with its
    value (``total`` None: as many as the output holds, from 0 on)."""
    t = read_updates(cfg, "counter", "value")
    offsets = sorted(t.column("_src_offset").to_pylist())
    total = len(offsets) if total is None else total
    assert offsets == list(range(total)), (len(offsets), total)
    assert set(t.column("_diff").to_pylist()) == {1}
    assert sorted(t.column("n").to_pylist()) == list(range(total))


def _events(state: Path) -> list[dict[str, Any]]:
    """The driver's progress events so far (none before it wrote its log)."""
    log = state / "progress.jsonl"
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def test_a_store_restart_loses_the_lock_until_it_is_taken_again(
        tmp_path: Path, spark: Any, cdc_url: str, pg_logical: Any) -> None:
    out = tmp_path / "out"
    cfg = load_config(_config(tmp_path, "a", cdc_url, out, None, 2000))
    cfg_b = load_config(_config(tmp_path, "b", cdc_url, out, None, 2000))
    state = tmp_path / "a-state"
    seen: list[str] = []
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: r.records > 3_000, 60, "data before the restart")
        with pg_logical.down():
            wait_for(lambda: "LockLost" in (r.health.error or ""), 60,
                     lambda: f"the source to say it lost the lock (health {r.health})")
            seen.append(r.health.error or "")
            records = r.records
        wait_for(lambda: r.health.status == "running" and r.records > records, 120,
                 lambda: f"the source to run again ({r.health})")
        # Held again: a second driver (its own state directory) is refused,
        # naming this one.
        with pytest.raises(AlreadyRunning,
                           match=f"as pid {os.getpid()} on host {socket.gethostname()}"):
            run(cfg_b, spark=spark, out=None, install_signals=False, duration=5)
        records = r.records
        wait_for(lambda: r.records > records + 2_000, 120, "more data after the refusal")
    assert "the driver lock (advisory lock in the remap store postgresql" in seen[0]
    assert "its session ended" in seen[0], seen[0]
    lost = [e for e in _events(state) if e["kind"] == "health"
            and "LockLost" in (e.get("error") or "")]
    assert lost and "nothing commits until it is taken again" in lost[0]["error"]
    _assert_exactly_once(cfg, None)


@pytest.mark.timeout(400)
def test_a_driver_that_took_the_lost_lock_keeps_it_and_the_first_stops(
        tmp_path: Path, spark: Any, cdc_url: str, pg_logical: Any) -> None:
    """The first driver is frozen (SIGSTOP: a paused VM) while the server
    restarts, so it cannot take its lock again before a second driver, with
    a state directory of its own, takes it. Thawed, the first stops for good
    with a definite error naming the second; the second finishes the output
    alone; every record is there once."""
    total = 40_000
    out = tmp_path / "out"
    path_a = _config(tmp_path, "a", cdc_url, out, total, 3000)
    cfg_b = load_config(_config(tmp_path, "b", cdc_url, out, total, 3000))
    state_a = tmp_path / "a-state"
    first = start_driver(path_a)
    try:
        assert wait_running(state_a, first)
        wait_for(lambda: any(e["kind"] == "sink_upper" for e in _events(state_a)), 120,
                 "the first driver to commit")
        first.send_signal(signal.SIGSTOP)
        pg_logical.restart()  # the first's session, and its lock, are gone
        stop = threading.Event()
        runners: list[Any] = []
        t = threading.Thread(target=run, kwargs=dict(
            cfg=cfg_b, spark=spark, stop=stop, out=None, install_signals=False,
            on_ready=runners.extend))
        t.start()
        try:
            wait_for(lambda: bool(runners), 60, "the second driver to start")
            r = runners[0]
            wait_for(lambda: r.records > 0 and r.health.status == "running", 120,
                     "the second driver to commit")
            first.send_signal(signal.SIGCONT)
            rc = wait_exit(first, 120)
            err = first.stderr.read().decode() if first.stderr else ""
            assert rc == 2, (rc, err[-3000:])
            assert (f"now held by pid {os.getpid()} on host {socket.gethostname()}"
                    in err), err[-3000:]
            assert "Traceback" not in err, err[-3000:]
            status = json.loads((state_a / "status.json").read_text())
            [src] = status["sources"]
            assert src["health"]["status"] == "stopped" and src["health"]["definite"]
            assert src["health"]["error"].startswith("LockTaken: the driver lock"), src
            # The second carries on unharmed to the end.
            wait_for(lambda: r.health.status == "finished", 240,
                     lambda: f"the second driver to finish ({r.health})")
            assert not any(e["kind"] == "health" and "Lock" in (e.get("error") or "")
                           for e in _events(tmp_path / "b-state"))
        finally:
            stop.set()
            t.join(60)
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGCONT)
            first.kill()
            first.wait(30)
        close_driver(first)
    _assert_exactly_once(cfg_b, total)
