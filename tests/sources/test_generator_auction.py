"""The ``auction`` generator (Materialize's AUCTION tables): record ``n`` a
pure function of ``(seed, n)``, checked against a plain-Python reference,
the tables' keys and references, and end to end into five Delta outputs
(audited by ``verify``)."""

from __future__ import annotations

import datetime as dt
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from reclock.config import load_config
from reclock.contracts.source import ReadTask
from reclock.core.clock import SystemClock
from reclock.core.errors import DefiniteError
from reclock.sources.generator import GeneratorReader, GeneratorSource, GeneratorSpec
from reclock.verify import verify_pipeline
from tests.running import read_updates, running, wait_for
from tests.sources.test_generator_kv import mix

OUTPUTS = ["organizations", "users", "accounts", "auctions", "bids"]
ITEMS = ["Vintage Poster", "Concert Tickets", "Handmade Quilt", "Tasting Menu", "Sailing Trip"]
BASE = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)


def reference(n: int, seed: int) -> tuple[str, tuple[Any, ...]] | None:
    """Record ``n``: (output, row), or None for a position that holds nothing."""
    if n < 20:
        return "organizations", (n + 1, f"Organization {n + 1}")
    if n < 220:
        uid = n - 19
        return "users", (uid, (uid - 1) % 20 + 1, f"user-{uid}")
    if n < 240:
        oid = n - 219
        return "accounts", (oid + 42, oid, 10_000)
    group, slot = (n - 240) // 10 + 1, (n - 240) % 10
    hg, hn = mix(group, seed), mix(n, seed)
    at = BASE + dt.timedelta(seconds=n)
    if slot == 0:
        return "auctions", (group, hg % 200 + 1, ITEMS[(hg >> 16) % 5], at + dt.timedelta(
            seconds=10))
    if slot <= 2 + hg % 8:
        return "bids", (group * 10 + slot - 1, hn % 200 + 1, group, (hn >> 20) % 99 + 1, at)
    return None


def read(lo: int, hi: int, seed: int = 3, step: int = 10_000) -> dict[str, list[tuple[Any, ...]]]:
    """The reader's rows of ``[lo, hi)``, read in tasks of ``step``."""
    reader = GeneratorReader(GeneratorSpec("auction", seed))
    out: dict[str, list[tuple[Any, ...]]] = {o: [] for o in OUTPUTS}
    for a in range(lo, hi, step):
        task = ReadTask("a", 0, (a, min(hi, a + step), 0, 0, 1000.0), min(hi, a + step) - a)
        for i, batch in reader.read(task):
            rows = batch.to_pylist()
            out[OUTPUTS[i]] += [tuple(v for k, v in r.items() if not k.startswith("_"))
                                for r in rows]
    return out


def test_records_equal_the_plain_python_reference() -> None:
    want: dict[str, list[tuple[Any, ...]]] = {o: [] for o in OUTPUTS}
    for n in range(3000):
        rec = reference(n, 3)
        if rec is not None:
            want[rec[0]].append(rec[1])
    assert read(0, 3000) == want
    assert read(0, 3000, step=7) == want  # any cut into tasks: the same rows


def test_the_tables_hold_together() -> None:
    rows = read(0, 20_240, seed=11)
    assert [len(rows[o]) for o in OUTPUTS[:4]] == [20, 200, 20, 2000]
    for o in OUTPUTS:
        assert len({r[0] for r in rows[o]}) == len(rows[o]), f"{o}: an id twice"
    per_auction = Counter(b[2] for b in rows["bids"])
    assert set(per_auction) == {a[0] for a in rows["auctions"]}
    assert set(per_auction.values()) == set(range(2, 10))  # 2 to 9 bids each
    users = {u[0] for u in rows["users"]}
    assert {a[1] for a in rows["auctions"]} <= users and {b[1] for b in rows["bids"]} <= users
    assert {u[1] for u in rows["users"]} == {o[0] for o in rows["organizations"]}
    assert read(0, 2000, seed=12) != read(0, 2000, seed=11)


def test_outputs_are_the_five_tables() -> None:
    with pytest.raises(DefiniteError, match="'bids'"):
        GeneratorSource("a", clock=SystemClock(), kind="auction", output_names=["auctions"])
    src = GeneratorSource("a", clock=SystemClock(), kind="auction", output_names=OUTPUTS[::-1])
    assert [o.name for o in src.outputs()] == OUTPUTS
    assert all(o.typed and o.key == ("id",) for o in src.outputs())


PIPELINE = """
state_dir: {state}
timestamp_interval: 100ms
sources:
  - name: auction
    generator: {{kind: auction, seed: 3, rate: 20000, max_records: 3000}}
    outputs:
{outputs}
"""


def test_into_delta_outputs(tmp_path: Path, spark: Any) -> None:
    outputs = "\n".join(f"      - {{name: {o}, sink: file}}" for o in OUTPUTS)
    path = tmp_path / "p.yaml"
    path.write_text(textwrap.dedent(PIPELINE).format(state=tmp_path / "state", outputs=outputs))
    cfg = load_config(path)
    with running(cfg, spark) as runners:
        wait_for(lambda: runners[0].health.status == "finished", 60, "the generator's end")
    want = read(0, 3000)
    for o in OUTPUTS:
        t = read_updates(cfg, "auction", o)
        held = sorted(tuple(r[c] for c in t.schema.names if not c.startswith("_"))
                      for r in t.to_pylist())
        assert held == sorted(want[o]), o
    [report] = verify_pipeline(cfg)
    assert report.ok and report.complete_checked == sum(len(v) for v in want.values()), report
