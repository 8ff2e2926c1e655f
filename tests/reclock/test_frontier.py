"""ChangeBatch and MutableAntichain: counts per time, discrete frontier changes."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from reclock.core.frontier import Antichain
from reclock.core.time import IntoTime, Partitioned
from tests.capture import ChangeBatch, MutableAntichain
from tests.strategies import partitioned


def test_change_batch_consolidates() -> None:
    b: ChangeBatch[IntoTime] = ChangeBatch([(IntoTime(3), 1), (IntoTime(1), 2)])
    b.update(IntoTime(3), -1)
    assert b.items() == [(IntoTime(1), 2)]
    assert b.drain() == [(IntoTime(1), 2)] and b.is_empty()


def test_mutable_antichain_reports_discrete_changes() -> None:
    m = MutableAntichain.new_bottom(IntoTime(0))
    assert m.frontier() == Antichain.from_elem(IntoTime(0))
    # a capability at 5 joins while 0 is still held: no change
    assert m.update_iter([(IntoTime(5), 1)]) == []
    # releasing 0 moves the frontier to 5
    assert m.update_iter([(IntoTime(0), -1)]) == [(IntoTime(0), -1), (IntoTime(5), 1)]
    # a second count at 5 and releasing one of them: no change
    assert m.update_iter([(IntoTime(5), 1)]) == []
    assert m.update_iter([(IntoTime(5), -1)]) == []
    assert m.update_iter([(IntoTime(5), -1)]) == [(IntoTime(5), -1)]
    assert m.is_empty()


def test_partitioned_frontier_of_incomparable_times() -> None:
    m = MutableAntichain([(Partitioned.point(0, 3), 1), (Partitioned.point(1, 7), 1)])
    assert len(m.frontier()) == 2
    changes = m.update_iter([(Partitioned.point(0, 3), -1), (Partitioned.point(0, 5), 1)])
    assert changes == [(Partitioned.point(0, 3), -1), (Partitioned.point(0, 5), 1)]
    assert m.less_equal(Partitioned.point(1, 9)) and not m.less_equal(Partitioned.point(0, 4))


@given(
    st.lists(st.lists(st.tuples(partitioned(4, 6), st.integers(-2, 2)), max_size=4), max_size=12)
)
def test_frontier_tracks_positive_counts(batches: list[list[tuple[Any, int]]]) -> None:
    m: MutableAntichain[Any] = MutableAntichain()
    counts: dict[Any, int] = {}
    shadow: ChangeBatch[Any] = ChangeBatch(
        [(t, 1) for t in m.frontier()]
    )  # the frontier as rebuilt from reported changes
    for batch in batches:
        changes = m.update_iter(batch)
        for t, d in batch:
            counts[t] = counts.get(t, 0) + d
        expected = Antichain(t for t, c in counts.items() if c > 0)
        assert m.frontier() == expected
        shadow.extend(changes)
        assert all(d == 1 for _, d in shadow.items())
        assert Antichain(t for t, _ in shadow.items()) == expected


# -- the fast paths for Kafka frontiers agree with the pairwise definitions ------------------

@st.composite
def _kafka_elements(draw: st.DrawFn) -> list[Partitioned]:
    """Points and unbounded elements (what Kafka frontiers hold), more than
    the fast paths' threshold, with repeats and dominated ones."""
    pts = draw(st.lists(st.builds(Partitioned.point, st.integers(0, 40), st.integers(0, 9)),
                        min_size=9, max_size=60))
    ups = draw(st.lists(st.builds(Partitioned, st.integers(0, 45), st.none(),
                                  st.integers(0, 9)), max_size=4))
    return pts + ups


@given(_kafka_elements(), _kafka_elements(), st.lists(partitioned(max_partition=45), max_size=20))
def test_fast_kafka_antichains_agree_with_pairwise_definitions(
        a: list[Partitioned], b: list[Partitioned], probes: list[Partitioned]) -> None:
    from reclock.core.frontier import _minimal_pairwise

    x, y = Antichain(a), Antichain(b)
    assert x.elements == _minimal_pairwise(a) and y.elements == _minimal_pairwise(b)
    for t in [*probes, *a, *b]:
        assert x.less_equal_time(t) == any(e.less_equal(t) for e in x.elements)
    assert x.less_equal(y) == all(any(e.less_equal(o) for e in x.elements) for o in y.elements)
    assert x.less_equal(x) and x.meet(y).less_equal(x) and x.less_equal(x.join(y))
    pairwise = [j for e in x.elements for f in y.elements if (j := e.join(f)) is not None]
    assert x.join(y).elements == _minimal_pairwise(pairwise)
    assert x.meet(y).elements == _minimal_pairwise([*x.elements, *y.elements])


@given(_kafka_elements(), _kafka_elements())
def test_kafka_frontiers_read_off_their_encoding_agree_with_the_decoded_ones(
        a: list[Partitioned], b: list[Partitioned]) -> None:
    """What status documents, metrics and charts read straight off an encoded
    frontier equals what its decoded antichain says (a meet holds intervals)."""
    from reclock.core.time import encoded_kafka_offsets, kafka_offsets
    from reclock.metrics import frontier_position

    for f in (Antichain(a), Antichain(a).meet(Antichain(b)), Antichain.empty()):
        enc = f.encode()
        assert encoded_kafka_offsets(enc) == kafka_offsets(f)
        assert Antichain.decode("kafka", enc) == f
        want = None if f.is_empty() else float(sum(kafka_offsets(f)[0].values()))
        assert frontier_position("kafka", enc) == want
    assert encoded_kafka_offsets("nope") is None and encoded_kafka_offsets([[1, 2]]) is None


@given(_kafka_elements(), st.lists(st.sampled_from(
    [[3, 5, 1], [0, 0, True], [1, 0, 2], [2, None, -1], "x", [1, 1], (4, 4, 0)]), max_size=2))
def test_decoding_a_large_kafka_frontier_equals_the_general_path(
        a: list[Partitioned], odd: list[Any]) -> None:
    """Decoding an encoded frontier of points and unbounded elements works on
    the integers (reading a shard at 2,048 partitions): the same antichain
    as decoding each element and taking the minimal ones, in any order, with
    repeats and dominated elements; anything else goes the general way."""
    import random

    import pytest

    from reclock.core.errors import InvalidTimeError
    from reclock.core.time import Gtid

    enc = [e.encode() for e in a]
    random.Random(len(enc)).shuffle(enc)
    for kind, ty in (("kafka", Partitioned), ("gtid", Gtid)):
        got = Antichain.decode(kind, enc)
        want = Antichain(ty(*e) for e in enc)
        assert got == want and all(type(e) is ty for e in got)
        mixed = enc + odd
        try:
            expected: Any = Antichain(ty.decode(v) for v in mixed)
        except InvalidTimeError:
            with pytest.raises(InvalidTimeError):
                Antichain.decode(kind, mixed)
        else:
            assert Antichain.decode(kind, mixed) == expected


def test_decoding_a_kafka_time_still_refuses_what_is_not_one() -> None:
    import pytest

    from reclock.core.errors import InvalidTimeError

    for bad in ([-1, 0, 0], [0, None, -5], [3, 2, 0], [True, None, 0], [0, None, 1.5],
                [0, "x", 0], [0, 1]):
        with pytest.raises(InvalidTimeError):
            Partitioned.decode(bad)
    assert Partitioned.decode([2, None, 7]) == Partitioned(2, None, 7)
