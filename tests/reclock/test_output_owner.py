"""Two pipelines writing one output.

Regression: a second pipeline (its own state directory, so its own identity)
pointed at the output of a running one stalled on ``AssertionError: plan
moved backwards``, logged as an unclassified error and retried for ever,
never saying that the output belonged to another pipeline: the output's
commits carried no pipeline id.

Now every commit records the pipeline's identity with the output's state
(Delta commit info, the Postgres sink's ``reclock_uppers``, the Kafka sink's
progress records); the second pipeline meets a definite error naming the
output and both pipelines, and the first goes on unharmed. Its output is
compared with the generator's model: every counter value exactly once.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from reclock.config import load_config
from tests.running import read_updates, running, wait_for


def _config(tmp_path: Path, name: str, sink: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/{name}-state
timestamp_interval: 200ms
sources:
  - name: counter
    generator: {{kind: counter, rate: 2000}}
    outputs:
      - name: value
        format: {{type: json, schema: {{n: int64, payload: string}}}}
        sink: {sink}
""")
    return path


def _sink(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if kind == "file":
        return f'{{type: file, path: "{tmp_path}/shared"}}'
    if kind == "postgres":
        url = request.getfixturevalue("pg_url")
        return f'{{type: postgres, dsn: "{url}", table: shared}}'
    kafka = request.getfixturevalue("kafka")
    return (f'{{type: kafka, bootstrap_servers: "{kafka.bootstrap}", '
            f"topic: shared-{uuid.uuid4().hex[:8]}}}")


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["file", "postgres", "kafka"])
def test_a_second_pipeline_on_an_output_is_refused_naming_both(
        kind: str, tmp_path: Path, spark: Any, request: pytest.FixtureRequest) -> None:
    sink = _sink(kind, tmp_path, request)
    cfg_a = load_config(_config(tmp_path, "a", sink))
    cfg_b = load_config(_config(tmp_path, "b", sink))
    with running(cfg_a, spark) as first:
        a = first[0]
        wait_for(lambda: a.records > 1_000, 90, lambda: f"the first pipeline ({a.health})")
        with running(cfg_b, spark) as second:
            b = second[0]
            wait_for(lambda: b.health.status == "stalled", 90,
                     lambda: f"the second pipeline to stall ({b.health})")
            stalled = b.health
            records = a.records
            wait_for(lambda: a.records > records + 1_000, 90,
                     lambda: f"the first pipeline to go on ({a.health})")
        assert a.health.status == "running", a.health
        ids = {r: json.loads((tmp_path / f"{r}-state" / "status.json").read_text())
               for r in ("a", "b")}
    assert stalled.definite, stalled
    error = stalled.error or ""
    assert error.startswith("OutputOwned: output 'counter.value' at "), error
    assert f"(state in {tmp_path}/a-state)" in error, error
    assert f"(state in {tmp_path}/b-state)" in error, error
    assert "two pipelines must not write one output" in (stalled.hint or "")
    assert b.records == 0
    # Never the assertion of old, not even once.
    events = (tmp_path / "b-state" / "progress.jsonl").read_text().splitlines()
    healths = [json.loads(e) for e in events if '"health"' in e]
    assert healths and not any("AssertionError" in (h.get("error") or "") for h in healths)
    assert ids["a"]["pid"] == ids["b"]["pid"]  # (both in this process)
    # The first pipeline's output: every counter value once, from 0 on.
    t = read_updates(cfg_a, "counter", "value")
    offsets = sorted(t.column("_src_offset").to_pylist())
    assert offsets == list(range(len(offsets))) and len(offsets) > 2_000
    assert sorted(t.column("n").to_pylist()) == offsets
