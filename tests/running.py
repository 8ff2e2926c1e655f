"""Running a pipeline: in a background thread of the test process, or as a
driver process of its own (``reclock run``) that tests can kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa

from reclock.pipeline import Pipeline, run
from reclock.runtime.driver import SourceRunner


def durable(r: SourceRunner) -> dict[int, int]:
    """Per partition, the next offset the first output of a Kafka source has
    made durable."""
    from reclock.core.frontier import Antichain
    from reclock.core.time import kafka_offsets

    p = r.outputs[0].state.progress
    return {} if p is None else kafka_offsets(Antichain.decode_json("kafka", p))[0]


def status_sources(state: Path) -> dict[str, dict[str, Any]]:
    """Per source, its entry in a driver's ``status.json`` (none while the
    file does not exist or is being replaced)."""
    try:
        doc = json.loads((state / "status.json").read_text())
    except (OSError, ValueError):
        return {}
    return {s["source"]: s for s in doc["sources"]}


def finished(state: Path) -> set[str]:
    """The sources a driver's ``status.json`` shows finished."""
    return {n for n, s in status_sources(state).items() if s["health"]["status"] == "finished"}


def read_updates(cfg: Any, source: str, output: str, sink: str | None = None) -> pa.Table:
    """Every update row an output holds (errors too), read through its sink
    ``sink`` (default: its first)."""
    pipe = Pipeline(cfg)
    try:
        src = pipe.source_config(source)
        persist = pipe.sink(src, src.output(output), sink)
        try:
            return persist.read_updates()
        finally:
            persist.close()
    finally:
        pipe.close()


def request_resnapshot(cfg: Any, source: str, output: str) -> None:
    """Asks the driver running ``cfg`` for a re-snapshot of an output (as
    ``reclock resnapshot`` does)."""
    pipe = Pipeline(cfg)
    try:
        pipe.request_resnapshot(source, output)
    finally:
        pipe.close()


def counter_source(rate: int, total: int, bad_every: int | None, sink: str = "file", *,
                   sinks: str | None = None) -> str:
    """The YAML of the crash tests' counter source (under ``sources:``): JSON
    values with a malformed record every ``bad_every`` (None: none), into one
    output, to ``sink`` (or to ``sinks``, the YAML after ``sinks:``)."""
    bad = "" if bad_every is None else f", bad_every: {bad_every}"
    return (
        "  - name: counter\n"
        f"    generator: {{kind: counter, rate: {rate}, max_records: {total}{bad}}}\n"
        "    outputs:\n"
        "      - name: value\n"
        "        format: {type: json, schema: {n: int64, payload: string}}\n"
        + (f"        sink: {sink}" if sinks is None else f"        sinks: {sinks}"))


def kv_source(keys: int, seed: int, rate: int, total: int, delete_every: int,
              value_size: int, sink: str = "sink: file") -> str:
    """The YAML of the key-value tests' source ``kv`` (under ``sources:``):
    one upsert output ``state`` of JSON values ``{n, payload}`` keyed by a
    JSON ``{key}``; ``sink`` is the output's ``sink:`` or ``sinks:`` line."""
    return (
        "  - name: kv\n"
        f"    generator: {{kind: key-value, keys: {keys}, seed: {seed}, rate: {rate},\n"
        f"                 max_records: {total}, delete_every: {delete_every}, "
        f"value_size: {value_size}}}\n"
        "    outputs:\n"
        "      - name: state\n"
        "        format: {type: json, schema: {n: int64, payload: string}}\n"
        "        key_format: {type: json, schema: {key: int64}}\n"
        "        envelope: {type: upsert, key: [key]}\n"
        f"        {sink}\n")


def kafka_upsert_source(name: str, bootstrap: str, topic: str, sink: str = "sink: file"
                        ) -> str:
    """The YAML of a Kafka source ``name`` (under ``sources:``) reading
    ``topic``'s JSON records ``{body}`` keyed by a JSON ``{id}``, upserted
    into output ``name``; ``sink`` is the output's ``sink:`` line."""
    return (
        f"  - name: {name}\n"
        f'    kafka: {{bootstrap_servers: "{bootstrap}", topic: {topic}, timeout: 5s}}\n'
        "    outputs:\n"
        f"      - name: {name}\n"
        "        format: {type: json, schema: {body: string}}\n"
        "        key_format: {type: json, schema: {id: int64}}\n"
        "        envelope: {type: upsert, key: [id]}\n"
        f"        {sink}\n")


@contextmanager
def running(cfg: Any, spark: Any) -> Iterator[list[SourceRunner]]:
    """Run ``cfg`` on ``spark`` until the block ends; yields the runners."""
    stop = threading.Event()
    runners: list[SourceRunner] = []
    t = threading.Thread(target=run, kwargs=dict(
        cfg=cfg, spark=spark, stop=stop, out=None, install_signals=False,
        on_ready=runners.extend))
    t.start()
    try:
        wait_for(lambda: bool(runners), what="the source loops to start")
        yield runners
    finally:
        stop.set()
        t.join(timeout=60)


def wait_for(cond: Callable[[], bool], timeout: float = 60,
             what: str | Callable[[], str] = "condition") -> None:
    """Polls ``cond``; ``what`` (or what it returns at the timeout) names it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")


def all_durable(runners: list[SourceRunner], n: int) -> None:
    """Waits until the first output of a one-partition Kafka source has made
    its first ``n`` records durable."""
    wait_for(lambda: durable(runners[0]) == {0: n}, 90,
             lambda: f"{n} records durable (health {runners[0].health})")


def running_again(runners: list[SourceRunner]) -> None:
    """The source is back to running: the tick that made the records durable
    sets the health when it returns, just after the commit the test saw."""
    wait_for(lambda: runners[0].health.status == "running", 30,
             lambda: f"the source running again (health {runners[0].health})")


def stalled_with(runners: list[SourceRunner], *words: str) -> Any:
    """Waits until the source stalls with an error (or hint) naming every
    one of ``words``; its health. Fails showing the health it had instead."""
    def check() -> bool:
        h = runners[0].health
        return h.status == "stalled" and all(w in f"{h.error} {h.hint}" for w in words)

    try:
        wait_for(check, 60, f"a stall naming {words}")
    except AssertionError:
        raise AssertionError(runners[0].health) from None
    return runners[0].health


def snapshot_durable(runners: list[SourceRunner]) -> None:
    """Waits until a CDC source has made its initial snapshot durable (its
    resume position is past 0/0)."""
    wait_for(lambda: runners[0].status().get("resume") not in (None, ["0/0"]), 90,
             "the snapshot to be durable")


def config_errors(tmp_path: Path, text: str) -> list[tuple[int | None, str | None, str]]:
    """The (line, path, message) of each issue ``load_config`` finds in the
    pipeline file ``text`` (dedented), which it must refuse."""
    import pytest

    from reclock.config import ConfigError, load_config

    path = tmp_path / "pipeline.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    return [(i.line, i.path, i.message) for i in info.value.issues]


# -- a driver in its own process (`reclock run FILE`), for kill tests ----------------------------


def start_driver(path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``python -m reclock.cli run path``; stderr kept for :func:`stop_driver`."""
    return subprocess.Popen(
        [sys.executable, "-m", "reclock.cli", "run", str(path)],
        env=env if env is not None else {**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def crash_env(base: dict[str, str], point: str | None, probability: float, seed: int
              ) -> dict[str, str]:
    """``base``, plus: crash at the named crash point (``reclock.faults``) with
    ``probability`` each time it is passed; ``None``: no crash point."""
    env = dict(base)
    if point is not None:
        env["RECLOCK_CRASH_AT"] = f"{point}:{probability}"
        env["RECLOCK_CRASH_SEED"] = str(seed)
    return env


def wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """The driver's exit status; ``None`` when it had to be killed after ``timeout``."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def wait_running(state: Path, proc: subprocess.Popen[bytes], timeout: float = 90) -> bool:
    """Until the driver's status file shows this process with open sources;
    False when the process exited first."""
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


def stop_driver(proc: subprocess.Popen[bytes], timeout: float = 60) -> tuple[int, str]:
    """SIGTERM (if still running), wait; returns (exit status, stderr)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=timeout)
    err = proc.stderr.read().decode() if proc.stderr else ""
    close_driver(proc)
    return rc, err


def close_driver(proc: subprocess.Popen[bytes]) -> None:
    """Release the pipe of a driver that exited (killed or crashed)."""
    if proc.stderr:
        proc.stderr.close()
