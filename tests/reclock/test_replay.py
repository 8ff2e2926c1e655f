"""The correction a replay commits (reclock/runtime/replay.py ``correction``):
the difference between what an output holds and what its records say, each
row at the position of the record it restates; nothing for an undamaged
output; rows below retention kept."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import pyarrow as pa

from reclock.contracts.rows import output_schema
from reclock.core.columns import CORRECTION_SPLIT, restated
from reclock.runtime.replay import correction

USER = pa.schema([("id", pa.int64()), ("v", pa.string())])


def table(*rows: tuple[int, str | None, int, int, int]) -> pa.Table:
    """(id, v, diff, partition, offset) per row; v None: an error row."""
    schema = output_schema(USER)
    cols: dict[str, list[Any]] = {f.name: [] for f in schema}
    for id_, v, diff, part, off in rows:
        vals = {"id": None if v is None else id_, "v": v, "_into_time": 1000, "_diff": diff,
                "_src_part": part, "_src_offset": off, "_src_seq": 0,
                "_error": "bad" if v is None else None}
        for f in schema:
            cols[f.name].append(vals.get(f.name))
    return pa.Table.from_pydict(cols, schema=schema)


def out(key: tuple[str, ...] | None) -> Any:
    return SimpleNamespace(user_schema=USER, upsert_key=key)


def net(*tables: pa.Table) -> Counter[tuple[Any, ...]]:
    c: Counter[tuple[Any, ...]] = Counter()
    for t in tables:
        for r in t.to_pylist():
            if r["_error"] is None:
                c[(r["id"], r["v"])] += r["_diff"]
    return +c


def test_an_undamaged_output_gets_no_correction() -> None:
    log = table((1, "a", 1, 0, 0), (2, "b", 1, 0, 1), (3, None, 1, 1, 0))
    assert correction(log, log, out(None), 5000, {}, None).num_rows == 0
    keyed = table((1, "a", 1, 0, 0), (1, "a", -1, 0, 1), (1, "b", 1, 0, 1))
    model = table((1, "a", 1, 0, 0), (1, "a", -1, 0, 1), (1, "b", 1, 0, 1))
    assert correction(keyed, model, out(("id",)), 5000, {}, None).num_rows == 0


def test_a_damaged_log_is_corrected_at_the_positions_of_its_records() -> None:
    model = table((1, "a", 1, 0, 0), (2, "b", 1, 0, 1), (3, "c", 1, 1, 0), (4, None, 1, 1, 1))
    held = table((1, "a", 1, 0, 0), (2, "X", 1, 0, 1), (9, "z", 1, 1, 7))  # lost, changed, extra
    fix = correction(held, model, out(None), 5000, {}, None)
    assert net(held, fix) == net(model)
    assert set(fix.column("_into_time").to_pylist()) == {5000}
    part, corr = restated(fix.column("_src_part").to_numpy().astype("int64"))
    assert corr.all()
    retract = fix.column("_src_part").to_numpy() < CORRECTION_SPLIT
    got = sorted(zip(part.tolist(), fix.column("_src_offset").to_pylist(), retract.tolist(),
                     fix.column("_diff").to_pylist(), strict=True))
    # (2,X) retracted where it was held, (9,z) too; (2,b), (3,c) and the lost error inserted
    assert got == [(0, 1, False, 1), (0, 1, True, -1), (1, 0, False, 1), (1, 1, False, 1),
                   (1, 7, True, -1)]
    # corrected twice: nothing more
    assert correction(pa.concat_tables([held, fix]), model, out(None), 6000, {}, None
                      ).num_rows == 0


def test_rows_below_retention_stay_unless_a_retained_record_of_their_key_supersedes_them(
) -> None:
    model = table((2, "b2", 1, 0, 12))  # all retention left of partition 0: offsets >= 10
    held = table((1, "a", 1, 0, 3), (2, "b", 1, 0, 4), (3, "x", 1, 0, 11))
    fix = correction(held, model, out(("id",)), 5000, {0: 10}, {(2,)})
    # key 1 stays (below retention, no retained record), key 2 replaced, key 3 retracted
    assert net(held, fix) == Counter({(1, "a"): 1, (2, "b2"): 1})
    log_fix = correction(held, model, out(None), 5000, {0: 10}, None)
    assert net(held, log_fix) == Counter({(1, "a"): 1, (2, "b"): 1, (2, "b2"): 1})
