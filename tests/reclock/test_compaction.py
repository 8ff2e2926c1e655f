"""Compaction of file outputs in running pipelines: ``reclock read`` (as of
any time, errors too), ``reclock verify`` and the upsert key state the driver
rebuilds at start give the same answers before and after a compaction; the
driver compacts between ticks; and a driver killed in the middle of a
compaction, or right after one, loses nothing and doubles nothing.

The pipelines run without Spark (``run(..., use_spark=False)``: the same
driver and sinks, tasks in-process), so that each of the kill test's driver
processes starts in about a second."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from reclock.cli import main
from reclock.config import load_config
from reclock.pipeline import Pipeline, run
from reclock.runtime.upsert_state import UpsertState
from reclock.verify import verify_pipeline
from tests.running import close_driver, counter_source, crash_env, stop_driver, wait_exit

TOTAL = 3000
BAD_EVERY = 97

PIPELINE = """
timestamp_interval: 100ms
sources:
{counter}
  - name: shop
    generator: {{kind: orders, rate: 1500, max_records: {total}, seed: 5}}
    outputs:
      - {{name: customers, sink: {sink}}}
      - {{name: orders, sink: {sink}}}
"""

OUTPUTS = [("counter", "value"), ("shop", "customers"), ("shop", "orders")]


def write(tmp_path: Path, total: int, sink: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE.format(counter=counter_source(1500, total, BAD_EVERY, sink=sink),
                                    total=total, sink=sink))
    return path


def sinks_of(cfg: Any) -> tuple[Pipeline, dict[str, Any]]:
    pipe = Pipeline(cfg)
    out = {}
    for source, output in OUTPUTS:
        src = pipe.source_config(source)
        out[f"{source}.{output}"] = pipe.sink(src, src.output(output))
    return pipe, out


def answers(path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """What a user sees: ``reclock read`` of every output (now, as of three
    earlier times, the error collection), ``reclock verify``, and the key
    state of the upsert outputs as the driver rebuilds it at start."""
    cfg = load_config(path)
    pipe, sinks = sinks_of(cfg)
    try:
        times = sorted(set(sinks["counter.value"].read_updates().column(
            "_into_time").to_pylist()))
        uppers = [times[len(times) // 4], times[len(times) // 2], times[-2]]
        got: dict[str, Any] = {}
        for name in sinks:
            for extra in ([], *(["--as-of", str(t)] for t in uppers), ["--errors"]):
                capsys.readouterr()
                assert main(["read", str(path), name, "--json", *extra]) == 0
                got[f"read {name} {extra}"] = capsys.readouterr().out
                if not extra:
                    assert got[f"read {name} {extra}"].count("\n") > 10
        got["verify"] = [dataclasses.asdict(r) for r in verify_pipeline(cfg)]
        for name, key in (("shop.customers", ("customer_id",)), ("shop.orders", ("order_id",))):
            updates = sinks[name].read_updates()
            cols = [c for c in updates.column_names if not c.startswith("_")]
            got[f"keys {name}"] = UpsertState.rebuild(updates, cols, key).rows
        return got
    finally:
        for s in sinks.values():
            s.close()
        pipe.close()


def files(path: str) -> int:
    return len(DeltaTable(path).file_uris())


def test_read_verify_and_key_state_are_the_same_after_compaction(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from reclock.runtime import housekeeping

    released: list[bool] = []  # the driver hands free memory back after its passes
    real = housekeeping.release_free_memory
    monkeypatch.setattr(housekeeping, "release_free_memory",
                        lambda: released.append(real(force=True)))
    # Stopped halfway: the sources are open, the upsert outputs mid-stream.
    path = write(tmp_path, 2 * TOTAL, "{type: file, compact: off}")
    run(load_config(path), use_spark=False, out=None, install_signals=False, duration=2.0)
    before = answers(path, capsys)
    assert all(0 < r["complete_checked"] < 2 * TOTAL
               and not any(o["breaches"] for o in r["outputs"])
               for r in before["verify"]), before["verify"]

    pipe, sinks = sinks_of(load_config(path))
    try:
        states = {n: s.state() for n, s in sinks.items()}
        for name, s in sinks.items():
            n = files(s.uri)
            done = s.compact(min_files=2)
            assert done["files_removed"] == n > 10 and files(s.uri) == 1, (name, n, done)
            assert s.state() == states[name]
    finally:
        pipe.close()
    after = answers(path, capsys)
    assert after.keys() == before.keys()
    for k in before:
        assert after[k] == before[k], k

    # The driver starts on the compacted outputs (the key state of the upsert
    # outputs rebuilt from them), writes on to the end, and compacts between ticks.
    path = write(tmp_path, 2 * TOTAL, "{type: file, compact: {every: 1s, min_files: 3}}")
    run(load_config(path), use_spark=False, out=None, install_signals=False)
    reports = verify_pipeline(load_config(path))
    assert {r.source: r.complete_checked for r in reports} == {"counter": 2 * TOTAL,
                                                                "shop": 2 * TOTAL}
    assert all(r.ok for r in reports), [dataclasses.asdict(r) for r in reports]
    events = [json.loads(line) for line in
              (tmp_path / "state" / "progress.jsonl").read_text().splitlines()]
    maintained = [e for e in events if e["kind"] == "maintain"]
    assert maintained and all(e["files_removed"] >= 3 for e in maintained), maintained
    assert released and all(released)


# -- killed during a compaction ------------------------------------------------------------


def start_local_driver(path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A driver process (as ``reclock run`` but without Spark)."""
    code = ("import sys; from reclock.config import load_config; "
            "from reclock.pipeline import run; "
            "r = run(load_config(sys.argv[1]), use_spark=False, out=None); "
            "sys.exit(1 if r.stalled else 0)")
    return subprocess.Popen([sys.executable, "-c", code, str(path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def log_entries(table: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted((table / "_delta_log").glob("*.json")):
        for line in f.read_text().splitlines():
            doc = json.loads(line)
            if "commitInfo" in doc:
                out.append(doc["commitInfo"])
    return out


def unreferenced(table: Path) -> set[str]:
    live = {Path(p).name for p in DeltaTable(str(table)).file_uris()}
    removed = set(DeltaTable(str(table)).vacuum(retention_hours=0, dry_run=True,
                                                enforce_retention_duration=False))
    return {p.name for p in table.glob("*.parquet")} - live - removed


@pytest.mark.timeout(300)
def test_a_driver_killed_during_compaction_loses_nothing(tmp_path: Path) -> None:
    total = 8000  # about 5 s of data: each run's first compaction pass comes 1 s in
    path = write(tmp_path, total, "{type: file, compact: {every: 1s, min_files: 4}}")
    state = tmp_path / "state"
    tables = [state / "outputs" / s / o for s, o in OUTPUTS]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    compactions = 0
    for i, point in enumerate(["mid_compaction", "after_compaction", "mid_compaction"]):
        proc = start_local_driver(path, crash_env(env, point, 1.0, i))
        try:
            rc = wait_exit(proc, 60)
        finally:
            close_driver(proc)
        assert rc == -signal.SIGKILL, (point, rc)
        entries = [e for t in tables if t.exists() for e in log_entries(t)]
        done = sum(e.get("reclock.maintenance") == "compact" for e in entries)
        leftovers = [n for t in tables if t.exists() for n in unreferenced(t)]
        # (Each source compacts its outputs in its own thread: another
        # compaction may commit before the kill lands.)
        if point == "mid_compaction":
            # killed with a merged file written and its commit not made
            assert any("-compact-" in n for n in leftovers), leftovers
        else:
            assert done > compactions  # killed right after a compaction's commit
            assert any(
                log_entries(t)[-1].get("reclock.maintenance") == "compact" for t in tables)
        compactions = done
    # Then without faults, to the end.
    proc = start_local_driver(path, env)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rc, err = stop_driver(proc)
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    if sum(e.get("reclock.maintenance") == "compact"
           for t_ in tables for e in log_entries(t_)) == compactions:
        # The run caught up and its sources finished before its first pass
        # (everything was due by then; shared Spark jobs read it at once):
        # compact the outputs the kills left as the driver would.
        pipe, sinks = sinks_of(load_config(path))
        try:
            for s in sinks.values():
                s.compact(min_files=2)
        finally:
            for s in sinks.values():
                s.close()
            pipe.close()

    # The model: the counter wrote positions 0..total-1 once each, value n at
    # position n, a malformed record at every BAD_EVERY-th; stamping follows
    # the positions.
    t = DeltaTable(str(tables[0])).to_pyarrow_table(
        columns=["n", "_src_offset", "_into_time", "_diff", "_error"]).sort_by("_src_offset")
    offsets = t.column("_src_offset").to_pylist()
    assert offsets == list(range(total)), (len(offsets), len(set(offsets)))
    assert set(t.column("_diff").to_pylist()) == {1}
    errors = pc.is_valid(t.column("_error")).to_pylist()
    assert [o for o, e in zip(offsets, errors, strict=True) if e] == [
        n for n in range(total) if n % BAD_EVERY == BAD_EVERY - 1]
    good = t.filter(pc.invert(pc.is_valid(t.column("_error"))))
    assert good.column("n").to_pylist() == good.column("_src_offset").to_pylist()
    assert all(a <= b for a, b in itertools.pairwise(t.column("_into_time").to_pylist()))
    assert sum(e.get("reclock.maintenance") == "compact"
               for t_ in tables for e in log_entries(t_)) > compactions

    reports = verify_pipeline(load_config(path))
    for r in reports:
        assert r.ok, (r.source, [(o.output, o.breaches, o.samples) for o in r.outputs])
    assert {r.source: r.complete_checked for r in reports} == {"counter": total, "shop": total}
