"""Bindings and reclocking: the worked example of docs/design.md ("Reclocking"),
partition discovery, resumption, compaction, and the vectorized forms against
the scalar rule."""

from __future__ import annotations

import pickle
import random
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reclock.core.bindings import UNBOUND, Binding, Bindings
from reclock.core.errors import BindingError, SinceViolation
from reclock.core.frontier import Antichain, kafka_frontier
from reclock.core.time import Counter, IntoTime, Lsn, Partitioned
from tests.strategies import antichains, kafka_bindings, partitioned, total_bindings


def kb(*pairs: tuple[int, dict[int, int]], upper: int | None = None) -> Bindings[Partitioned]:
    return Bindings(
        "kafka", [Binding(IntoTime(t), kafka_frontier(o)) for t, o in pairs], upper=upper
    )


def test_design_worked_example() -> None:
    """1000 -> {offset 4}, 2000 -> {offset 9}: 0..3 get 1000, 4..8 get 2000, 9 waits."""
    b = kb((1000, {0: 4}), (2000, {0: 9}))
    got = [b.reclock(Partitioned.point(0, o)) for o in range(12)]
    assert got == [1000] * 4 + [2000] * 5 + [None] * 3
    vec = b.reclock_offsets(np.zeros(12, dtype=np.int64), np.arange(12))
    assert vec.tolist() == [1000] * 4 + [2000] * 5 + [UNBOUND] * 3
    arr = b.reclock_arrow(pa.array([0] * 12), pa.array(range(12)))
    assert arr.to_pylist() == [1000] * 4 + [2000] * 5 + [None] * 3


def test_partition_discovery_covers_new_partition_from_offset_zero() -> None:
    # Partition 2 unknown at 1000; it appears (with 7 records) before 2000.
    b = kb((1000, {0: 5, 1: 3}), (2000, {0: 5, 1: 3, 2: 7}))
    assert b.reclock(Partitioned.point(2, 0)) == 2000
    assert b.reclock(Partitioned.point(2, 6)) == 2000
    assert b.reclock(Partitioned.point(2, 7)) is None
    assert b.reclock(Partitioned.point(3, 0)) is None  # still unknown: waits
    assert b.reclock_offsets([2, 2, 3], [0, 6, 0]).tolist() == [2000, 2000, UNBOUND]


def test_reclock_frontier_element_by_element() -> None:
    b = kb((1000, {0: 4, 1: 2}), (2000, {0: 9, 1: 2}), upper=2500)
    # source upper {p0: 6, p1: 2}: future data of p0 is at >= 2000, of p1 waits (upper)
    f = kafka_frontier({0: 6, 1: 2})
    assert b.reclock_frontier(f) == Antichain.from_elem(IntoTime(2000))
    assert b.reclock_frontier(kafka_frontier({0: 9, 1: 2})) == Antichain.from_elem(IntoTime(2500))
    assert b.reclock_frontier(Antichain.empty()) == Antichain.empty()


def test_source_upper_at() -> None:
    b = kb((1000, {0: 4}), (2000, {0: 9}), upper=3000)
    assert b.source_upper_at(2000) == kafka_frontier({0: 4})
    assert b.source_upper_at(2001) == kafka_frontier({0: 9})
    assert b.source_upper_at(3000) == kafka_frontier({0: 9})
    # before any binding: the initial frontier (the as_of binding)
    assert b.source_upper_at(500) == kafka_frontier({0: 4})
    assert b.source_upper_at(1000) == kafka_frontier({0: 4})
    with pytest.raises(BindingError, match="beyond the remap upper"):
        b.source_upper_at(3001)
    with pytest.raises(BindingError, match="closed"):
        b.source_upper_at(Antichain.empty())


def test_frontier_at_and_compaction() -> None:
    b = kb((1000, {0: 4}), (2000, {0: 9}), (3000, {0: 12}), upper=3500)
    assert b.frontier_at(999) is None
    assert b.frontier_at(2999) == kafka_frontier({0: 9})
    c = b.compacted(2999)
    assert [int(x.time) for x in c.bindings] == [2999, 3000]
    # R(t) unchanged for t >= since; earlier records map to since
    for t in (2999, 3000, 3499):
        assert c.frontier_at(t) == b.frontier_at(t)
    assert c.reclock(Partitioned.point(0, 2)) == 2999
    assert c.reclock(Partitioned.point(0, 10)) == b.reclock(Partitioned.point(0, 10)) == 3000
    with pytest.raises(SinceViolation):
        c.frontier_at(2000)
    with pytest.raises(SinceViolation):
        c.compacted(1000)


def test_bindings_reject_broken_histories() -> None:
    with pytest.raises(BindingError, match="monotone"):
        kb((1000, {0: 9}), (2000, {0: 4}))
    with pytest.raises(BindingError, match="increase"):
        kb((2000, {0: 4}), (1000, {0: 9}), upper=3000)
    with pytest.raises(BindingError, match="not below the upper"):
        kb((1000, {0: 4}), upper=1000)
    with pytest.raises(BindingError, match="not a kafka time"):
        Bindings("kafka", [Binding(IntoTime(1), Antichain.from_elem(Lsn(3)))])


def test_closed_source() -> None:
    b = Bindings(
        "lsn",
        [
            Binding(IntoTime(1000), Antichain.from_elem(Lsn(10))),
            Binding(IntoTime(2000), Antichain.empty()),
        ],
        upper=Antichain.empty(),
    )
    assert b.is_closed
    assert b.reclock(Lsn(10**9)) == 2000
    assert b.reclock_values([5, 10, 10**12]).tolist() == [1000, 2000, 2000]
    assert b.source_upper_at(Antichain.empty()) == Antichain.empty()


@given(f=antichains(partitioned(), max_size=6), g=antichains(partitioned(), max_size=6),
       data=st.data())
def test_vectorized_equals_scalar_with_intervals(f: Antichain[Partitioned],
                                                  g: Antichain[Partitioned],
                                                  data: st.DataObject) -> None:
    # frontiers holding intervals (meets), not only a Kafka frontier's points
    # and one unbounded element: the compiled rows span those partitions
    bs = [Binding(IntoTime(1000), f)]
    if f.less_equal(f.join(g)) and f != f.join(g):
        bs.append(Binding(IntoTime(2000), f.join(g)))
    b = Bindings("kafka", bs, upper=3000)
    recs = data.draw(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 15)), max_size=40))
    scalar = [b.reclock(Partitioned.point(p, o)) for p, o in recs]
    vec = b.reclock_offsets([p for p, _ in recs], [o for _, o in recs]).tolist()
    assert vec == [UNBOUND if s is None else int(s) for s in scalar]


@given(b=kafka_bindings(), data=st.data())
def test_vectorized_equals_scalar_kafka(b: Bindings[Partitioned], data: st.DataObject) -> None:
    recs = data.draw(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 60)), max_size=60))
    parts = np.array([p for p, _ in recs], dtype=np.int64)
    offs = np.array([o for _, o in recs], dtype=np.int64)
    scalar = [b.reclock(Partitioned.point(p, o)) for p, o in recs]
    vec = b.reclock_offsets(parts, offs).tolist()
    assert vec == [UNBOUND if s is None else int(s) for s in scalar]


@given(b=total_bindings(), values=st.lists(st.integers(0, 100), max_size=40))
def test_vectorized_equals_scalar_lsn(b: Bindings[Any], values: list[int]) -> None:
    scalar = [b.reclock(Lsn(v)) for v in values]
    assert b.reclock_values(values).tolist() == [UNBOUND if s is None else s for s in scalar]


@given(b=kafka_bindings(), data=st.data())
def test_reclock_is_independent_of_order_batching_and_pickling(
    b: Bindings[Partitioned], data: st.DataObject
) -> None:
    recs = data.draw(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 60)), max_size=50))
    seed = data.draw(st.integers(0, 2**32))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(recs)), max_size=4)))
    truth = {r: b.reclock(Partitioned.point(*r)) for r in recs}

    shuffled = list(recs)
    random.Random(seed).shuffle(shuffled)
    remote = pickle.loads(pickle.dumps(b))  # what an executor gets
    got: list[tuple[tuple[int, int], int]] = []
    for lo, hi in zip([0, *cuts], [*cuts, len(shuffled)], strict=True):
        chunk = shuffled[lo:hi]
        out = remote.reclock_offsets([p for p, _ in chunk], [o for _, o in chunk])
        got.extend(zip(chunk, out.tolist(), strict=True))
    assert sorted(got) == sorted(
        (r, UNBOUND if truth[r] is None else int(truth[r]))  # type: ignore[arg-type]
        for r in recs
    )


def test_compiled_bindings_travel_with_the_pickle() -> None:
    b = kb((1000, {0: 4, 1: 1}), (2000, {0: 9, 1: 3}))
    b.reclock_offsets([0], [1])  # compiles
    remote = pickle.loads(pickle.dumps(b))
    assert "_compiled" in remote.__dict__
    assert remote == b
    assert remote.reclock_offsets([0, 1, 1], [5, 0, 3]).tolist() == [2000, 1000, UNBOUND]


def test_large_offsets_fall_back_without_overflow() -> None:
    big = 2**62
    b = kb((1000, {0: big, 1: 5}), (2000, {0: big + 10, 1: 6}))
    out = b.reclock_offsets([0, 0, 1, 1, 0], [big - 1, big + 3, 5, 6, big + 10])
    assert out.tolist() == [1000, 2000, 2000, UNBOUND, UNBOUND]


def _same_stamps_past(lower: Antichain[Partitioned], part: Bindings[Any],
                      whole: Bindings[Any], data: st.DataObject) -> None:
    """Drawn positions that ``lower`` contains (not read yet from there)
    reclock alike with ``part`` of the bindings and with ``whole``."""
    parts = np.array(data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=30)))
    offs = np.array(data.draw(st.lists(st.integers(0, 60), min_size=len(parts),
                                       max_size=len(parts))))
    inside = np.array([lower.less_equal_time(Partitioned.point(int(p), int(o)))
                       for p, o in zip(parts, offs, strict=True)])
    assert (part.reclock_positions(parts, offs)[inside]
            == whole.reclock_positions(parts, offs)[inside]).all()


@given(kafka_bindings(max_bindings=10, max_partitions=4), st.integers(0, 12), st.data())
def test_a_job_ships_only_the_bindings_its_range_needs(
        b: Bindings[Any], k: int, data: st.DataObject) -> None:
    """``covering(lower)`` reclocks every position ``lower`` contains as the
    whole history does, and leaves out the bindings ``lower`` has passed."""
    if not b.bindings:
        assert b.covering(Antichain.from_elem(Partitioned.above(0))) is b
        return
    lower = b.bindings[min(k, len(b.bindings) - 1)].frontier
    cut = b.covering(lower)
    assert all(not x.frontier.less_equal(lower) for x in cut.bindings[1:])
    assert cut.upper == b.upper
    assert cut.bindings == b.bindings[len(b.bindings) - len(cut.bindings):]
    _same_stamps_past(lower, cut, b, data)
    # a total order too: a counter source's steady state ships the bindings
    # past where the job starts (here the last one), not 49
    c = Bindings("counter", [Binding(IntoTime(1000 * i), Antichain.from_elem(Counter(10 * i)))
                             for i in range(1, 50)], upper=50_000)
    assert len(c.covering(Antichain.from_elem(Counter(485))).bindings) == 1
    assert len(c.covering(Antichain.from_elem(Counter(475))).bindings) == 2


@given(kafka_bindings(max_bindings=10, max_partitions=4), st.data())
def test_held_bindings_answer_what_the_run_still_asks(
        b: Bindings[Any], data: st.DataObject) -> None:
    """``held_from(u)``, what the driver holds once its outputs resume at
    ``u``, equals the history compacted to the latest binding before ``u``:
    from ``u`` on, resumption frontiers, and the stamps of every position
    the resumption frontier leaves to read, are the whole history's. As
    stored (not decoded yet) or decoded alike."""
    if not b.bindings:
        return
    upper = b.upper.as_option()
    last = int(upper) if upper is not None else int(b.bindings[-1].time) + 1
    u = data.draw(st.integers(int(b.since), last))
    stored = Bindings.from_encoded(b.kind, [(int(x.time), x.frontier.encode())
                                            for x in b.bindings],
                                   since=int(b.since), upper=b.upper)
    for whole in (b, stored):
        held = whole.held_from(u)
        before = [x for x in b.bindings if int(x.time) < u]
        if len(before) < 2:
            assert held is whole
            continue
        assert held == b.compacted(int(before[-1].time))
        for v in range(u, last + 1, max(1, (last - u) // 7)):
            assert held.source_upper_at(v) == b.source_upper_at(v)
        _same_stamps_past(b.source_upper_at(u), held, b, data)


@given(kafka_bindings(max_bindings=12, max_partitions=10), st.data())
def test_reclock_frontier_agrees_with_a_linear_scan(b: Bindings[Any], data: st.DataObject) -> None:
    """``reclock_frontier`` (which starts its search after the bindings the
    frontier has passed) against the rule read plainly: each element maps
    to the first binding, scanned from the oldest, whose frontier does not
    contain it, or to the upper."""
    if b.bindings and data.draw(st.booleans()):
        f = b.bindings[data.draw(st.integers(0, len(b.bindings) - 1))].frontier
    else:
        f = data.draw(antichains(partitioned(), max_size=5))

    def model(e: Partitioned) -> list[IntoTime]:
        for x in b.bindings:
            if not x.frontier.less_equal_time(e):
                return [x.time]
        return list(b.upper)

    assert b.reclock_frontier(f) == Antichain([t for e in f for t in model(e)])


@given(st.dictionaries(st.integers(0, 30), st.integers(0, 50), max_size=30), st.integers(0, 40))
def test_kafka_frontier_built_fast_equals_its_points(offsets: dict[int, int], n: int) -> None:
    top = max([*offsets, -1]) + 1
    parts = max(top, n)
    slow = Antichain([*(Partitioned.point(p, offsets.get(p, 0)) for p in range(parts)),
                      Partitioned.above(parts)])
    fast = kafka_frontier(offsets, partitions=n)
    assert fast == slow
    assert list(fast) == list(slow)  # the same canonical order
    assert [type(e) for e in fast] == [Partitioned] * len(slow)


def _outcome(make: Any) -> Any:
    try:
        return make()
    except BindingError as exc:
        return type(exc)


@given(frontiers=st.lists(st.one_of(
           antichains(partitioned(), max_size=5),
           st.dictionaries(st.integers(0, 6), st.integers(0, 30), max_size=6).map(
               lambda o: kafka_frontier(o, partitions=len(o)))), max_size=6),
       gaps=st.lists(st.integers(-1, 3), min_size=6, max_size=6),
       since=st.integers(0, 9000), upper=st.one_of(st.none(), st.integers(0, 20_000)),
       data=st.data())
def test_bindings_from_stored_encodings_equal_the_decoded_ones(
        frontiers: list[Antichain[Partitioned]], gaps: list[int], since: int,
        upper: int | None, data: st.DataObject) -> None:
    # Stored shards as they come back from the store, broken ones included
    # (times out of order, below since or at the upper, frontiers moving
    # back, intervals the compiled path does not take): the snapshot built
    # from the encodings either fails as the decoded one does or equals it,
    # reclocking included. The model is the general path: decode every
    # frontier, validate pairwise.
    t, rows = 6000, []
    for f, g in zip(frontiers, gaps, strict=False):
        rows.append((t, f.encode()))
        t += g * 1000
    # no upper given: the constructor's default (just after the last binding);
    # an empty one: a closed shard
    up: Antichain[IntoTime] | None = (
        Antichain.from_elem(IntoTime(upper)) if upper is not None
        else None if data.draw(st.booleans()) else Antichain.empty())
    fast = _outcome(lambda: Bindings.from_encoded("kafka", rows, since=since, upper=up))
    slow = _outcome(lambda: Bindings(
        "kafka", [Binding(IntoTime(t), Antichain.decode("kafka", e)) for t, e in rows],
        since=since, upper=up))
    if isinstance(slow, type):
        assert fast is slow
        return
    assert isinstance(fast, Bindings)
    recs = data.draw(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 40)), max_size=40))
    parts, offs = [p for p, _ in recs], [o for _, o in recs]
    assert fast.reclock_offsets(parts, offs).tolist() == slow.reclock_offsets(parts, offs).tolist()
    assert len(fast) == len(slow) and fast == slow  # (decodes the frontiers)
    assert pickle.loads(pickle.dumps(fast)) == slow


def test_stored_encodings_that_are_not_kafka_times_are_named() -> None:
    # a damaged row takes the general path, which says what is wrong
    good = kafka_frontier({0: 3, 1: 4}, partitions=2).encode()
    for bad in ([[0, 0, -1]], [[0, 0, 1.5]], [[0, 0, True]], [["0", 0, 1]], [[0, 1]],
                [[1, 0, 2]], "x"):
        with pytest.raises(Exception) as info:
            Bindings.from_encoded("kafka", [(1000, good), (2000, bad)], upper=3000)
        assert not isinstance(info.value, AssertionError)
    b = Bindings.from_encoded("kafka", [(1000, good)], upper=3000)
    assert "_bs" not in b.__dict__  # held as changes, not rebuilt whole (yet)
    assert b.reclock_offsets([0, 0, 1, 2], [2, 3, 3, 0]).tolist() == [1000, UNBOUND, 1000, UNBOUND]
