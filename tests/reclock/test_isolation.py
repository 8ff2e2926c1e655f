"""Sources are independent: a failing one stalls alone, a dropped one stops
promptly and keeps its outputs, and late results of a dropped source are
discarded."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path
from typing import Any

from reclock.cli import collect_status, status_exit_code
from reclock.config import load_config
from reclock.pipeline import Pipeline, run
from reclock.runtime.driver import SourceRunner
from reclock.verify import verify_pipeline
from tests.running import running, wait_for


def test_a_failing_sink_stalls_only_its_source(tmp_path: Path, spark: Any) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file where a directory should be")
    cfg_path = tmp_path / "p.yaml"
    cfg_path.write_text(f"""
timestamp_interval: 200ms
sources:
  - name: broken
    generator: {{kind: counter, rate: 1000}}
    outputs:
      - {{name: value, format: json, sink: {{type: file, path: {blocker}/out}}}}
  - name: healthy
    generator: {{kind: counter, rate: 1000, max_records: 2000}}
    outputs:
      - {{name: value, format: json, sink: file}}
""")
    cfg = load_config(cfg_path)
    runners: list[SourceRunner] = []
    codes: list[int] = []

    def watch_status(started: list[SourceRunner]) -> None:
        """``reclock status`` while the run goes on: exit 1 once a source stalls."""
        runners.extend(started)

        def poll() -> None:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                doc = collect_status(str(cfg_path))
                if any(s["health"]["status"] == "stalled" for s in doc["sources"]):
                    codes.append(status_exit_code(doc))
                    return
                time.sleep(0.5)

        def until_seen() -> None:  # the status answered, the healthy source done
            wait_for(lambda: bool(codes) and all(
                r.health.status == "finished" for r in started if r.name == "healthy"), 20,
                "the status poll and the healthy source's end")
            stop.set()

        threading.Thread(target=poll, daemon=True).start()
        threading.Thread(target=until_seen, daemon=True).start()

    stop = threading.Event()
    result = run(cfg, spark=spark, duration=20, stop=stop, out=None, install_signals=False,
                 on_ready=watch_status)
    assert codes == [1]
    assert result.stalled == ["broken"]  # so reclock run exits 1
    assert status_exit_code(collect_status(str(cfg_path))) == 3  # the driver stopped
    by = {r.name: r for r in runners}
    assert by["healthy"].health.status == "finished"
    broken = by["broken"].health
    assert broken.status == "stopped"  # it was stalled until the driver stopped
    events = [e for e in by["broken"].events.recent if e["kind"] == "health"]
    stalled = [e for e in events if e["status"] == "stalled"]
    assert stalled and str(blocker) in stalled[0]["error"]
    assert all(r.ok for r in verify_pipeline(cfg) if r.source == "healthy")


def test_drop_stops_promptly_discards_late_results_and_keeps_outputs(
    tmp_path: Path, spark: Any
) -> None:
    cfg_path = tmp_path / "p.yaml"
    cfg_path.write_text("""
timestamp_interval: 200ms
spark: {max_records_per_job: 4000000, max_records_per_task: 4000000}
sources:
  - name: heavy
    generator: {kind: counter, rate: 2000000}
    outputs:
      - {name: value, format: {type: json, schema: {n: int64}}, sink: file}
  - name: light
    generator: {kind: counter, rate: 500}
    outputs:
      - {name: value, format: json, sink: file}
""")
    cfg = load_config(cfg_path)
    pipe = Pipeline(cfg)
    with running(cfg, spark) as runners:
        wait_for(lambda: all(r.records > 0 for r in runners), what="both sources to ingest")
        heavy = next(r for r in runners if r.name == "heavy")
        light = next(r for r in runners if r.name == "light")
        time.sleep(1.0)  # let a big heavy job get under way
        upper_before = heavy.outputs[0].sink.state().upper
        pipe.request_drop("heavy")
        dropped_at = time.monotonic()
        heavy.join(timeout=15)
        assert not heavy.alive
        assert time.monotonic() - dropped_at < 8  # no waiting for it to drain
        assert heavy.health.status == "dropped"
        # nothing was committed for it after the drop request: a job in flight
        # was cancelled or its results discarded
        drop_ms = heavy.clock.now() - int((time.monotonic() - dropped_at) * 1000)
        late = [e for e in heavy.events.recent if e["source"] == "heavy"
                and e["kind"] == "sink_upper" and e["ts"] > drop_ms + 1000]
        assert late == []
        assert upper_before is not None
        light_records = light.records
        # the other source goes on (on a loaded machine its next job may
        # wait behind the heavy job being cancelled: no fixed deadline)
        wait_for(lambda: light.records > light_records, 60, "the light source to go on")
        assert light.alive
    # outputs are kept and still consistent
    reports = {r.source: r for r in verify_pipeline(cfg)}
    assert reports["heavy"].ok and reports["heavy"].outputs[0].rows > 0
    # a restart does not start the dropped source
    runners2: list[SourceRunner] = []
    said = io.StringIO()
    run(cfg, spark=spark, duration=2, out=said, install_signals=False, on_ready=runners2.extend)
    assert [r.name for r in runners2] == ["light"]
    assert "reclock: not running dropped source(s) heavy (reclock undrop FILE SOURCE" in \
        said.getvalue()
    # undrop: the next run resumes it from its outputs, which stay consistent
    pipe.undrop("heavy")
    runners3: list[SourceRunner] = []
    run(cfg, spark=spark, duration=3, out=None, install_signals=False, on_ready=runners3.extend)
    assert sorted(r.name for r in runners3) == ["heavy", "light"]
    reports = {r.source: r for r in verify_pipeline(cfg)}
    assert reports["heavy"].ok and reports["light"].ok
    pipe.close()
