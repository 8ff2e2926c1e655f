"""The generative fault tests (see tests/generative.py), each compared with an
independent model of the records produced:

* 200 seeded sequences in process, over Kafka (append, upsert, debezium),
  Postgres CDC and generator sources into Delta (log and state), Postgres
  (log and state), Iceberg state and Kafka, with stage, commit and source
  failures armed at random moments;
* sequences through ``reclock run`` processes started with random crash
  points (a Delta state table's commit points among them) and failures
  (refused rows too) and SIGKILLed at random moments;
* 200 sequences with changes of the world around the pipeline, with the
  driver running and stopped (tests/world.py): Kafka topics, partitions and
  progress topics, key-state files, registry schema versions, Postgres DDL.

The long soak is ``bench/generative_soak.py``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from reclock import faults
from tests.generative import Outcome, run, run_killed
from tests.tally import count

SEED = int(os.environ.get("RECLOCK_GEN_SEED", "20261123"))


def _report(what: str, out: Outcome) -> None:
    count(what, sequences=out.sequences, records=out.records,
          faults=sum(out.faults.values()), refused_rows=out.refused,
          injected_refusals=out.excused, lost=out.lost, doubled=out.doubled, wrong=out.wrong)
    print(what, dict(out.faults))
    assert (out.lost, out.doubled, out.wrong) == (0, 0, 0), out.samples


@pytest.mark.timeout(300)
def test_generated_sequences_with_faults_match_the_model(
    tmp_path: Path, spark: Any, kafka: Any, cdc_url: str
) -> None:
    out = run(tmp_path, spark, kafka, cdc_url, SEED, 200)
    _report(f"generative (seed {SEED})", out)
    assert out.refused > 0  # the draw holds values the sinks refuse


@pytest.mark.timeout(600)
def test_generated_sequences_through_killed_drivers_match_the_model(
    tmp_path: Path, kafka: Any, cdc_url: str
) -> None:
    out = run_killed(tmp_path, kafka, cdc_url, SEED + 1, 70, restarts=4)
    _report(f"generative, killed drivers (seed {SEED + 1})", out)
    assert out.faults["sigkill"] + out.faults["crash-point exit"] >= 2, out.faults
    # the Delta state lane's commit crash points are among those drawn
    assert {f"crash-point {p}" for p in faults.STATE_POINTS} & set(out.faults), out.faults


@pytest.mark.timeout(300)
def test_generated_world_changes_match_the_model(
    tmp_path: Path, spark: Any, kafka: Any, cdc_url: str
) -> None:
    """200 sequences over three runs of a driver, with topics deleted and
    re-created (named and by pattern), partitions added, a Kafka sink's
    progress topic deleted, key-state files damaged, new registry schema
    versions of an Avro topic, and columns added, dropped, renamed and
    widened in Postgres tables (keyed, and REPLICA IDENTITY FULL), each drawn
    with the driver running or stopped (tests/world.py)."""
    from tests.registry import registry_server
    from tests.world import run as run_world

    with registry_server() as registry:
        out = run_world(tmp_path, spark, kafka, cdc_url, registry.url, SEED + 2, 200)
    _report(f"generative, world changes (seed {SEED + 2})", out)
    assert sum(out.faults.values()) >= 12, out.faults
    drawn = " ".join(out.faults)  # the seed draws DDL and registry versions too
    assert "_column" in drawn and "new_version" in drawn, out.faults
