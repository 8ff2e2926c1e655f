"""Consolidation of an update log into the collection as of one IntoTime."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reclock.contracts.consolidate import COUNT, consolidate, errors


def log(rows: list[tuple[Any, ...]], schema: pa.Schema) -> pa.Table:
    """Updates ``(user values..., into_time, diff, error)``."""
    n = len(schema)
    cols: list[list[Any]] = [[r[i] for r in rows] for i in range(n + 3)]
    return pa.table(
        [*(pa.array(cols[i], schema.field(i).type) for i in range(n)),
         pa.array(cols[n], pa.int64()), pa.array(cols[n + 1], pa.int64()),
         pa.array(cols[n + 2], pa.string())],
        names=[*schema.names, "_into_time", "_diff", "_error"],
    )


FLAT = pa.schema([("a", pa.int64()), ("s", pa.string()), ("f", pa.float64())])


def test_inserts_retractions_and_nulls() -> None:
    updates = log(
        [
            (1, "x", 0.5, 10, 1, None),
            (1, "x", 0.5, 10, 1, None),  # a duplicate: count 2
            (2, None, None, 10, 1, None),
            (2, None, None, 20, -1, None),  # retracted at 20
            (None, "y", -0.0, 10, 1, None),
            (None, "y", 0.0, 15, 1, None),  # -0.0 and 0.0 are one value
            (3, "z", 1.0, 30, 1, None),  # after as_of 25
            (4, "bad", None, 10, 1, "does not decode"),  # an error row
        ],
        FLAT,
    )
    assert consolidate(updates, 25, ["a", "s", "f"]).to_pylist() == [
        {"a": 1, "s": "x", "f": 0.5, COUNT: 2},
        {"a": None, "s": "y", "f": 0.0, COUNT: 2},
    ]
    assert consolidate(updates, 15, ["a", "s", "f"]).to_pylist() == [
        {"a": 1, "s": "x", "f": 0.5, COUNT: 2},
        {"a": 2, "s": None, "f": None, COUNT: 1},
        {"a": None, "s": "y", "f": 0.0, COUNT: 2},
    ]
    everything = consolidate(updates, None, ["a", "s", "f"])
    assert everything.schema == pa.schema([*FLAT, pa.field(COUNT, pa.int64())])
    assert everything.column("a").to_pylist() == [1, 3, None]
    # Grouping by fewer columns adds up the rest.
    assert consolidate(updates, None, ["s"]).to_pylist() == [
        {"s": "x", COUNT: 2}, {"s": "y", COUNT: 2}, {"s": "z", COUNT: 1}
    ]
    assert consolidate(updates, None, []).to_pylist() == [{COUNT: 5}]


def test_errors_are_separate() -> None:
    updates = log([(1, "x", None, 10, 1, None), (2, "?", None, 12, 1, "bad"),
                   (3, "?", None, 40, 1, "worse")], FLAT)
    got = errors(updates, 20)
    assert got.column("_error").to_pylist() == ["bad"]
    assert errors(updates, None).num_rows == 2


def test_missing_user_column_is_reported() -> None:
    with pytest.raises(ValueError, match="nope"):
        consolidate(log([], FLAT), None, ["nope"])


def test_nested_columns_fall_back_to_a_canonical_encoding() -> None:
    schema = pa.schema([("l", pa.list_(pa.int64())), ("st", pa.struct([("x", pa.float64())]))])
    updates = log(
        [
            ([1, 2], {"x": 1.0}, 1, 1, None),
            ([1, 2], {"x": 1.0}, 2, 1, None),
            ([1, 2], {"x": -0.0}, 2, 1, None),
            ([1, 2], {"x": 0.0}, 2, 1, None),
            (None, None, 3, 1, None),
            ([3], None, 3, 1, None),
            ([3], None, 4, -1, None),
        ],
        schema,
    )
    got = consolidate(updates, None, ["l", "st"]).to_pylist()
    assert [(r["l"], r["st"], r[COUNT]) for r in got] == [
        ([1, 2], {"x": -0.0}, 2),  # -0.0 == 0.0; the group shows its first row's value
        ([1, 2], {"x": 1.0}, 2),
        (None, None, 1),
    ]


# -- property: consolidation equals a naive multiset ---------------------------------------


def canon(v: Any) -> Any:
    """Value equality as consolidation defines it: NaN == NaN, -0.0 == 0.0."""
    if isinstance(v, float):
        return "nan" if math.isnan(v) else v + 0.0
    if isinstance(v, list):
        return tuple(canon(x) for x in v)
    return v


ints = st.one_of(st.none(), st.integers(-2, 2))
strs = st.one_of(st.none(), st.sampled_from(["", "a", "b", "é"]))
floats = st.one_of(st.none(), st.sampled_from([0.0, 1.5, float("nan"), float("inf")]))
lists = st.one_of(st.none(), st.lists(st.integers(0, 2), max_size=2))


def twin(v: Any) -> Any:
    """A value equal to ``v`` under ``canon`` but not identical to it."""
    if isinstance(v, float) and v == 0:
        return -v
    if isinstance(v, float) and math.isnan(v):
        return float("nan")  # another NaN object
    return v


@st.composite
def update_rows(draw: st.DrawFn, *columns: st.SearchStrategy[Any]) -> list[list[Any]]:
    """Updates whose values come from a small pool per column, so that equal
    rows meet often; about half of them use the value's twin (-0.0 for 0.0)."""
    pools = [draw(st.lists(c, min_size=1, max_size=3)) for c in columns]
    update = st.tuples(
        st.tuples(*(st.sampled_from(p) for p in pools)), st.booleans(),
        st.integers(0, 5), st.integers(-2, 2), st.one_of(st.none(), st.just("err")),
    )
    return [
        [*(twin(v) if flip else v for v in values), *rest]
        for values, flip, *rest in draw(st.lists(update, max_size=40))
    ]


def naive(rows: list[list[Any]], n: int, as_of: int | None) -> Counter[tuple[Any, ...]]:
    total: Counter[tuple[Any, ...]] = Counter()
    for r in rows:
        if r[n + 2] is None and (as_of is None or r[n] <= as_of):
            total[tuple(canon(v) for v in r[:n])] += r[n + 1]
    return Counter({k: c for k, c in total.items() if c != 0})


def as_multiset(table: pa.Table, n: int) -> Counter[tuple[Any, ...]]:
    got: Counter[tuple[Any, ...]] = Counter()
    for row in table.to_pylist():
        values = list(row.values())
        key = tuple(canon(v) for v in values[:n])
        assert key not in got, f"row {key} appears twice"
        assert values[n] != 0
        got[key] = values[n]
    return got


@given(update_rows(ints, strs, floats), st.one_of(st.none(), st.integers(-1, 6)),
       st.randoms(use_true_random=False))
def test_flat_consolidation_matches_a_counter(
    rows: list[list[Any]], as_of: int | None, rnd: random.Random
) -> None:
    updates = log([tuple(r) for r in rows], FLAT)
    got = consolidate(updates, as_of, ["a", "s", "f"])
    assert as_multiset(got, 3) == naive(rows, 3, as_of)
    # Deterministic: the order of the log does not matter.
    shuffled = list(rows)
    rnd.shuffle(shuffled)
    again = consolidate(log([tuple(r) for r in shuffled], FLAT), as_of, ["a", "s", "f"])
    assert repr(again.to_pylist()) == repr(got.to_pylist())


NESTED = pa.schema([("l", pa.list_(pa.int64())), ("s", pa.string())])


@given(update_rows(lists, strs), st.one_of(st.none(), st.integers(-1, 6)))
def test_nested_consolidation_matches_a_counter(rows: list[list[Any]], as_of: int | None) -> None:
    updates = log([tuple(r) for r in rows], NESTED)
    got = consolidate(updates, as_of, ["l", "s"])
    assert as_multiset(got, 2) == naive(rows, 2, as_of)
    again = consolidate(log([tuple(r) for r in reversed(rows)], NESTED), as_of, ["l", "s"])
    assert again.to_pylist() == got.to_pylist()
