"""The generative fault test (see tests/generative.py): 200 seeded sequences
over upsert, debezium and append outputs into Delta, Postgres (log and state)
and Kafka, with stage, commit and source failures injected at random moments,
compared with an independent model of the records produced. The long soak is
``bench/generative_soak.py``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.generative import run
from tests.tally import count

SEED = int(os.environ.get("RECLOCK_GEN_SEED", "20261123"))


@pytest.mark.timeout(300)
def test_generated_sequences_with_faults_match_the_model(
    tmp_path: Path, spark: Any, kafka: Any, pg_url: str
) -> None:
    out = run(tmp_path, spark, kafka, pg_url, SEED, 200)
    count(f"generative (seed {SEED})", sequences=out.sequences, records=out.records,
          faults_armed=sum(out.faults.values()), lost=out.lost, doubled=out.doubled,
          wrong=out.wrong)
    assert (out.lost, out.doubled, out.wrong) == (0, 0, 0), out.samples
