"""`verify`'s once rule for upsert outputs: one position (a truncate) may
retract many keys, but no key twice, and never insert twice."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from reclock.core.bindings import Binding, Bindings
from reclock.core.frontier import Antichain
from reclock.core.time import IntoTime, Lsn
from reclock.verify import check_output
from sinks.base import output_schema

USER = pa.schema([("id", pa.int64()), ("v", pa.string())])
B = Bindings("lsn", [Binding(IntoTime(1000), Antichain.from_elem(Lsn(100)))])


def rows(*spec: tuple[int, int, int, int]) -> pa.Table:
    """(id, diff, offset, seq) per row, at IntoTime 1000."""
    schema = output_schema(USER)
    cols: dict[str, list[Any]] = {f.name: [] for f in schema}
    for id_, diff, off, seq in spec:
        vals = {"id": id_, "v": f"v{id_}", "_into_time": 1000, "_diff": diff, "_src_part": 0,
                "_src_offset": off, "_src_seq": seq}
        for f in schema:
            cols[f.name].append(vals.get(f.name))
    return pa.Table.from_pydict(cols, schema=schema)


def test_a_truncate_retracts_many_keys_at_one_position() -> None:
    truncate = rows((1, 1, 10, 1), (2, 1, 10, 3), (1, -1, 50, 0), (2, -1, 50, 0))
    assert check_output("o", truncate, B, 1001, ("id",)).breaches == {}
    # without the key (not an upsert output) that is a duplicate position
    assert check_output("o", truncate, B, 1001).breaches == {"duplicate-position": 1}


def test_a_key_retracted_twice_or_two_insertions_at_one_position_breach() -> None:
    twice = rows((1, 1, 10, 1), (1, -1, 50, 0), (1, -1, 50, 0))
    assert check_output("o", twice, B, 1001, ("id",)).breaches == {"duplicate-position": 1}
    inserts = rows((1, 1, 10, 1), (2, 1, 10, 1))
    assert check_output("o", inserts, B, 1001, ("id",)).breaches == {"duplicate-position": 1}


def test_rows_at_the_upper_are_fine_only_before_the_progress() -> None:
    """A binding committed in several jobs: its rows sit at the upper's time
    while the progress says how far it got."""
    part = rows((1, 1, 10, 0), (2, 1, 20, 0))  # both at IntoTime 1000
    assert check_output("o", part, B, 1000).breaches == {"beyond-upper": 2}
    assert check_output("o", part, B, 1000, progress=Antichain.from_elem(Lsn(21))).breaches == {}
    # a row the progress says was not written yet is beyond the upper
    got = check_output("o", part, B, 1000, progress=Antichain.from_elem(Lsn(15)))
    assert got.breaches == {"beyond-upper": 1} and got.samples["beyond-upper"] == [(0, 20, 0)]
    # and nothing may lie past the upper, whatever the progress
    assert check_output("o", part, B, 999,
                        progress=Antichain.from_elem(Lsn(21))).breaches == {"beyond-upper": 2}
