"""Faults on demand (``RECLOCK_FAIL_AT``) from the command line: a transient
source error, commit failures and a row the sink refuses, each
injected into a running ``reclock run``. The outputs are compared with an
independent model of the input: the counter generator emits ``n = 0..N-1``
once each, and the orders generator's customers output is keyed by
``customer_id``. Orphaned staged files that the failed commits left are
vacuumed by the driver on its schedule: afterwards the Delta table's
directory holds exactly the files its log references.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest

from reclock import faults
from reclock.config import load_config
from reclock.verify import verify_pipeline
from tests.running import read_updates

TOTAL = 4000


def test_unknown_failure_point_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown failure point 'stag'"):
        faults.arm("stag")


@pytest.mark.integration  # runs `reclock run` processes (Spark) of its own
@pytest.mark.timeout(300)
def test_injected_faults_lose_nothing_and_leave_no_orphans(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
housekeeping: {{vacuum_every: 1s, orphan_grace: 10s}}
spark:
  master: local[1]
  max_records_per_job: 500
  conf:
    spark.driver.extraJavaOptions: "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
sources:
  - name: counter
    generator: {{kind: counter, rate: 200, max_records: {TOTAL}}}
    outputs:
      - name: value
        format: {{type: json, schema: {{n: int64, payload: string}}}}
        sink: file
""")
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "RECLOCK_FAIL_AT": "source:2,commit:4,refuse:40"}
    log = tmp_path / "driver.log"
    with log.open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "reclock.cli", "run", str(path)],
                                env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        rc = proc.wait(240)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text(errors="replace")
    assert rc == 0, text[-3000:]
    assert text.count("injected failure at 'commit'") >= 1, text[-3000:]
    cfg = load_config(path)
    table = read_updates(cfg, "counter", "value")
    good = table.filter(pc.is_null(table.column("_error"))).column("n").to_pylist()
    refused = [json.loads(r["_raw_value"])["n"] for r in table.filter(
        pc.invert(pc.is_null(table.column("_error")))).to_pylist()
        if "injected refusal" in r["_error"]]
    assert refused, "no row was refused"  # jobs of failed commits used some refusals up
    assert sorted(good + refused) == list(range(TOTAL))  # the model: each n once
    assert all(r.ok for r in verify_pipeline(cfg))
    # Housekeeping: only files the Delta log references are left.
    from deltalake import DeltaTable

    table_dir = Path(cfg.sources[0].outputs[0].sink.path)  # type: ignore[union-attr]
    deadline = time.monotonic() + 5
    on_disk = {p.name for p in table_dir.glob("*.parquet")}
    referenced = {Path(f).name for f in DeltaTable(str(table_dir)).file_uris()}
    while on_disk != referenced and time.monotonic() < deadline:
        time.sleep(0.5)
        on_disk = {p.name for p in table_dir.glob("*.parquet")}
    assert on_disk == referenced, (sorted(on_disk - referenced), len(referenced))
