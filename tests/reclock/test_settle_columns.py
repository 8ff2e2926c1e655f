"""Settling intents in whole columns (what drivers do) gives exactly the
updates and key changes of settling them one intent after the other (the
reference), and what a plain dictionary model of the intents says each
IntoTime must change.

The intents are random: values and tombstones of few keys (so a key comes
back many times in one slice), values equal to the key's current one (no
update: NaN equals NaN, -0.0 equals 0.0, equal lists), error rows, updates
that leave a column unsent (taken from the key's current row, or from the
row a tombstone just removed when the update moved the row to another key),
settled in slices of a few intents so that pairs straddle them.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from reclock.runtime import upsert_state
from reclock.runtime.keystate import (
    KeyedIntents,
    MemoryKeys,
    SqliteKeys,
    canonical,
    canonical_keys,
    hashable,
    split_intents,
)
from reclock.runtime.upsert_state import UpsertState

pytestmark = pytest.mark.unit

COLS = ["k", "s", "v", "f", "tags", "ts"]
KEY = ("k", "s")
USER = [("k", pa.int64()), ("s", pa.string()), ("v", pa.string()), ("f", pa.float64()),
        ("tags", pa.list_(pa.string())), ("ts", pa.timestamp("us", tz="UTC"))]
META = [("_into_time", pa.int64()), ("_diff", pa.int64()), ("_src_part", pa.int32()),
        ("_src_offset", pa.int64()), ("_src_seq", pa.int32()), ("_src_ts", pa.int64()),
        ("_error", pa.string()), ("_raw_key", pa.binary()), ("_raw_value", pa.binary())]
SCHEMA = pa.schema(USER + META)
INTENTS = SCHEMA.append(pa.field("_unchanged", pa.list_(pa.int32())))
FLOATS = [0.0, -0.0, 1.5, math.nan, None]
TAGS: list[list[str] | None] = [[], ["a"], ["a", "b"], None]
ATS = [None, datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 1, 2, tzinfo=UTC)]

Row = tuple[Any, ...]


def _model_batches(rng: random.Random, batches: int, positions: int, unsent: bool
                   ) -> tuple[list[pa.Table], list[dict[int, Counter[Any]]], dict[Any, Row]]:
    """Random intents, one table per commit, and the model: applied intent
    by intent to a dictionary of key -> row, the net change of each
    IntoTime (hashable row -> count) per commit, and the final rows."""
    state: dict[Any, Row] = {}
    nets: list[dict[int, Counter[Any]]] = []
    out = []
    pos = 0
    for _ in range(batches):
        rows: list[dict[str, Any]] = []
        net: dict[int, Counter[Any]] = {}
        for _ in range(positions):
            t = 10 + pos // 5
            before = dict(state)
            at = {"_into_time": t, "_src_part": 0, "_src_offset": pos}
            here: list[dict[str, Any]] = []

            def emit(here: list[dict[str, Any]] = here, at: dict[str, int] = at,
                     **kw: Any) -> None:
                here.append({**at, "_src_seq": len(here), **kw})

            def key() -> tuple[int, str]:
                return rng.randrange(12), rng.choice(["x", "y"])

            r = rng.random()
            if r < 0.04:
                k, s = key()
                emit(_diff=rng.choice([0, 1]), k=k, s=s, v="bad", _error="cannot decode")
            elif unsent and r < 0.12 and state and (free := [
                    (k, s) for k in range(12, 40) for s in "xy" if (k, s) not in state]):
                old = rng.choice(sorted(state))
                kept = state.pop(old)
                new = rng.choice(free)
                emit(_diff=0, k=old[0], s=old[1])
                emit(_diff=1, k=new[0], s=new[1], v=None, f=9.0, tags=["moved"], ts=None,
                     _unchanged=[2, 5])
                state[new] = (new[0], new[1], kept[2], 9.0, ["moved"], kept[5])
            elif unsent and r < 0.18 and state:
                k, s = rng.choice(sorted(state))
                f = rng.choice(FLOATS)
                at_ = rng.choice(ATS)
                emit(_diff=1, k=k, s=s, v=None, f=f, tags=None, ts=at_, _unchanged=[2, 4])
                cur = state[(k, s)]
                state[(k, s)] = (k, s, cur[2], f, cur[4], at_)
            else:
                for _ in range(rng.randrange(1, 4)):
                    k, s = key()
                    if rng.random() < 0.25:
                        emit(_diff=0, k=k, s=s)
                        state.pop((k, s), None)
                    else:
                        row = (k, s, rng.choice(["p", "q", None]), rng.choice(FLOATS),
                               rng.choice(TAGS), rng.choice(ATS))
                        emit(_diff=1, **dict(zip(COLS, row, strict=True)))
                        state[(k, s)] = row
            rows.extend(here)
            change = net.setdefault(t, Counter())
            for row in before.values():
                change[hashable(row)] -= 1
            for row in state.values():
                change[hashable(row)] += 1
            pos += 1
        out.append(pa.Table.from_pylist(rows, schema=INTENTS))
        nets.append({t: Counter({r: n for r, n in c.items() if n}) for t, c in net.items()})
    return out, nets, state


def _split(rng: random.Random, batch: pa.Table) -> KeyedIntents:
    """The batch as two tasks split it (cut at a random position)."""
    offs = batch.column("_src_offset").to_pylist()
    cut = rng.choice(offs)
    lo = batch.filter(pa.array([o < cut for o in offs]))
    hi = batch.filter(pa.array([o >= cut for o in offs]))
    return KeyedIntents.merged([split_intents(lo, KEY, None, 1 << 40, "a"),
                                split_intents(hi, KEY, None, 1 << 40, "b")])


def _net(updates: pa.Table) -> dict[int, Counter[Any]]:
    out: dict[int, Counter[Any]] = {}
    for r in updates.to_pylist():
        if r["_error"] is None:
            c = out.setdefault(r["_into_time"], Counter())
            c[hashable(tuple(r[c] for c in COLS))] += r["_diff"]
    return {t: Counter({r: n for r, n in c.items() if n}) for t, c in out.items()}


def _exact(t: pa.Table) -> list[Any]:
    return [hashable(tuple(r.values())) for r in t.to_pylist()]


@pytest.mark.parametrize("seed", range(10))
def test_settling_in_columns_equals_intent_by_intent_and_the_model(
        tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    monkeypatch.setattr(upsert_state, "SLICE_ROWS", [3, 7, 40, 65_536][seed % 4])
    unsent = seed % 3 != 2  # (without them, every slice is settled in columns)
    batches, nets, final = _model_batches(rng, 3, 90, unsent)
    ways: Counter[str] = Counter()  # how the slices of the settling under test went
    disk = UpsertState(COLS, KEY, SqliteKeys(tmp_path / "columns.sqlite"))

    def counting(name: str) -> Any:
        real = getattr(UpsertState, name)

        def counted(self: UpsertState, *args: Any) -> pa.Table | None:
            out = real(self, *args)
            if self is disk and out is not None:
                ways[name] += 1
            return out  # type: ignore[no-any-return]
        return counted

    for name in ("_slice_columns", "_slice_rows"):
        monkeypatch.setattr(UpsertState, name, counting(name))
    ref = UpsertState(COLS, KEY, MemoryKeys())
    errors = 0
    for n, (batch, net) in enumerate(zip(batches, nets, strict=True)):
        intents = _split(rng, batch)
        budget = rng.choice([1, 1 << 30])  # a round per key group, or one round
        got = list(disk.settle(intents, SCHEMA, budget))
        want = list(ref.settle(intents, SCHEMA, budget, vectorised=False))
        assert [_exact(t) for t in got] == [_exact(t) for t in want]
        whole = pa.concat_tables([SCHEMA.empty_table(), *got])
        assert _net(whole) == net
        errors += whole.column("_error").null_count != whole.num_rows
        disk.commit(f"m{n}")
        ref.commit(f"m{n}")
    assert errors
    held = {k: hashable(v) for k, v in disk.rows.items()}
    assert held == {k: hashable(v) for k, v in ref.rows.items()}
    assert held == {k: hashable(v) for k, v in final.items()}
    assert ways["_slice_columns"] and bool(ways["_slice_rows"]) == unsent


def test_an_equal_value_changes_nothing_and_a_key_repeated_in_a_slice_settles_in_order(
        tmp_path: Path) -> None:
    """A hand-made case: the updates in full, in position order."""
    st = UpsertState(COLS, KEY, SqliteKeys(tmp_path / "k.sqlite"))
    first = [dict(k=1, s="x", v="a", f=math.nan, tags=["t"]), dict(k=2, s="x", v="b", f=0.0)]
    t = pa.Table.from_pylist([{**r, "_into_time": 1, "_diff": 1, "_src_part": 0,
                               "_src_offset": i, "_src_seq": 0} for i, r in enumerate(first)],
                             schema=SCHEMA)
    list(st.settle(split_intents(t, KEY, None, 1 << 40, "a"), SCHEMA, 1 << 30))
    st.commit("one")
    second = [dict(k=1, s="x", v="a", f=math.nan, tags=["t"], _diff=1),  # equal: nothing
              dict(k=2, s="x", v="b", f=-0.0, _diff=1),  # equal: nothing
              dict(k=2, s="x", v="c", f=1.0, _diff=1),
              dict(k=2, s="x", _diff=0),
              dict(k=3, s="y", _diff=0),  # no such key: nothing
              dict(k=2, s="x", v="d", _diff=1)]
    t = pa.Table.from_pylist([{**r, "_into_time": 2, "_src_part": 0, "_src_offset": 10 + i,
                               "_src_seq": 0} for i, r in enumerate(second)], schema=SCHEMA)
    out = pa.concat_tables(list(st.settle(split_intents(t, KEY, None, 1 << 40, "a"),
                                          SCHEMA, 1 << 30)))
    got = [(r["_src_offset"], r["_diff"], r["k"], r["v"], r["f"]) for r in out.to_pylist()]
    assert got == [(12, -1, 2, "b", 0.0), (12, 1, 2, "c", 1.0), (13, -1, 2, "c", 1.0),
                   (15, 1, 2, "d", None)]
    st.commit("two")
    assert {k: v[2] for k, v in st.rows.items()} == {(1, "x"): "a", (2, "x"): "d"}


def test_canonical_keys_of_whole_columns_are_those_of_each_value() -> None:
    """Keys of integers, strings, booleans and bytes take a shortcut (their
    tuples' repr); they must be exactly :func:`canonical`'s, which the key
    store and the buckets are keyed by."""
    t = pa.table({"i": pa.array([1, None, -7, 2**62], pa.int64()),
                  "s": ["a", None, "it's \"q\"", "é\n\x00"],
                  "b": [True, None, False, True],
                  "y": pa.array([b"\x00", None, b"'", b""], pa.binary()),
                  "f": [0.0, -0.0, math.nan, None],
                  "l": pa.array([[1.5], None, [math.nan], []], pa.list_(pa.float64()))})
    for key in [("i",), ("s",), ("i", "s", "b", "y"), ("f",), ("i", "l")]:
        each = [canonical(vals) for vals in zip(*(t.column(k).to_pylist() for k in key),
                                                strict=True)]
        assert canonical_keys(t, key) == each
