"""The remap store's PostgreSQL server restarted while a pipeline runs on it:
the sources stall (a transient error, nothing minted half-way) and carry on
when it is back; every record lands once at its bindings' IntoTime."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from reclock.config import load_config
from reclock.verify import verify_pipeline
from tests.running import running, wait_for
from tests.tally import count

TOTAL = 60_000


def test_remap_store_restart_mid_run(tmp_path: Path, spark: Any, cdc_url: str,
                                     pg_logical: Any) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
remap_store: "{cdc_url}"
timestamp_interval: 200ms
sources:
  - name: counter
    generator: {{kind: counter, rate: 5000, max_records: {TOTAL}}}
    outputs:
      - name: value
        format: {{type: json, schema: {{n: int64, payload: string}}}}
        sink: file
""")
    cfg = load_config(path)
    seen: set[str] = set()
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: r.records > 5_000, 60, "data before the restart")
        with pg_logical.down():  # down until the pipeline notices (a restart may fall
            # between two ticks of a busy machine, and go unnoticed)
            wait_for(lambda: seen.add(r.health.status) or r.health.status == "stalled", 60,
                     "the pipeline to stall on its store")
        wait_for(lambda: seen.add(r.health.status) or r.health.status == "finished", 180,
                 "the pipeline to finish after the restart")
    # the restart was noticed: a stall with its error is in the progress log
    events = [json.loads(x) for x in (tmp_path / "state" / "progress.jsonl").read_text()
              .splitlines()]
    stalls = [e for e in events if e["kind"] == "health" and e["status"] == "stalled"]
    assert stalls, sorted(seen)
    [report] = verify_pipeline(cfg)
    assert report.ok, [(o.output, o.breaches, o.samples) for o in report.outputs]
    assert report.complete_checked == TOTAL
    count("remap store restart", restarts=1, records_checked=TOTAL)
