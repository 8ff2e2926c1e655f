"""`verify`'s once rule for upsert outputs: one position (a truncate) may
retract many keys, but no key twice, and never insert twice."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from reclock.contracts.rows import output_schema
from reclock.core.bindings import Binding, Bindings
from reclock.core.columns import correction_part
from reclock.core.frontier import Antichain, kafka_frontier
from reclock.core.time import IntoTime, Lsn
from reclock.verify import check_output

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


# -- corrections (a re-snapshot by replay) ------------------------------------------------------
K = Bindings("kafka", [
    Binding(IntoTime(1000), kafka_frontier({0: 10, 1: 10}, partitions=2)),
    Binding(IntoTime(2000), kafka_frontier({0: 20, 1: 20}, partitions=2)),
], upper=3000)


def kafka_rows(*spec: tuple[int, int, int, int, int]) -> pa.Table:
    """(id, diff, into, part, offset) per row, seq 0."""
    schema = output_schema(USER)
    cols: dict[str, list[Any]] = {f.name: [] for f in schema}
    for id_, diff, into, part, off in spec:
        vals = {"id": id_, "v": f"v{id_}", "_into_time": into, "_diff": diff, "_src_part": part,
                "_src_offset": off, "_src_seq": 0}
        for f in schema:
            cols[f.name].append(vals.get(f.name))
    return pa.Table.from_pydict(cols, schema=schema)


def test_a_correction_stands_at_or_after_the_record_it_restates() -> None:
    ins, ret = correction_part(1, False), correction_part(0, True)
    # record (1, 12) at 2000, restated at 2000 (its own time) and at 2500
    fine = kafka_rows((1, 1, 2000, 1, 12), (1, 1, 2000, ins, 12), (7, -1, 2500, ret, 3),
                      (1, 1, 2500, ins, 12))
    assert check_output("o", fine, K, 3000).breaches == {}
    # a correction before the record's time, or of a record not bound yet
    early = kafka_rows((1, 1, 1000, ins, 12), (2, 1, 2500, ins, 25))
    got = check_output("o", early, K, 3000)
    assert got.breaches == {"wrong-time": 2}
    assert got.samples["wrong-time"][0][:3] == (ins, 12, 0)  # as stored
    # one re-snapshot restates a record once
    twice = kafka_rows((1, 1, 2500, ins, 12), (1, 1, 2500, ins, 12))
    assert check_output("o", twice, K, 3000).breaches == {"duplicate-position": 1}


def test_a_position_whose_rows_a_correction_cancelled_is_not_held() -> None:
    from reclock.verify import _held_positions

    ret, ins = correction_part(0, True), correction_part(0, False)
    t = kafka_rows((1, 1, 1000, 0, 5), (1, -1, 2500, ret, 5),  # a row cancelled
                   (2, 1, 1000, 0, 6), (2, -1, 2500, ret, 6), (3, 1, 2500, ins, 6),  # replaced
                   (4, 1, 1000, 0, 7))  # no correction
    held = _held_positions("kafka", t).to_pylist()
    assert sorted({(r["_src_part"], r["_src_offset"]) for r in held}) == [(0, 6), (0, 7)]
