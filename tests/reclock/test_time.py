"""Timestamps and antichains: order, lattice laws, encode/decode round trips."""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reclock.core.bindings import UNBOUND, Binding, Bindings
from reclock.core.errors import InvalidTimeError
from reclock.core.frontier import Antichain, kafka_frontier, render
from reclock.core.time import (
    Counter,
    Gtid,
    IntoTime,
    Lsn,
    Partitioned,
    is_partitioned,
    kafka_offsets,
    time_type,
)
from tests.strategies import TIME_STRATEGIES, antichains, partitioned, points

KINDS = sorted(TIME_STRATEGIES)


def test_lsn_text_form() -> None:
    assert Lsn.parse("16/B374D848") == Lsn((0x16 << 32) | 0xB374D848)
    assert Lsn((0x16 << 32) | 0xB374D848).encode() == "16/B374D848"
    assert str(Lsn(0)) == "0/0"
    with pytest.raises(InvalidTimeError, match="not a Postgres LSN"):
        Lsn.parse("16-B374")


def test_total_times_reject_bad_values() -> None:
    with pytest.raises(InvalidTimeError):
        IntoTime(-1)
    with pytest.raises(InvalidTimeError):
        Counter.decode("7")
    with pytest.raises(InvalidTimeError):
        IntoTime.decode(True)


def test_partitioned_order() -> None:
    above = Partitioned.above(4)
    assert above.less_equal(Partitioned.point(7, 0))
    assert above.less_equal(Partitioned.point(4, 99))
    assert not above.less_equal(Partitioned.point(3, 99))
    assert not Partitioned.point(2, 5).less_equal(Partitioned.point(2, 4))
    assert Partitioned.point(2, 4).less_equal(Partitioned.point(2, 5))
    assert not Partitioned.point(2, 4).less_equal(Partitioned.above(2))
    assert Partitioned(0, 3, 1).join(Partitioned(2, None, 5)) == Partitioned(2, 3, 5)
    assert Partitioned.point(1, 0).join(Partitioned.point(2, 0)) is None
    assert Partitioned.point(1, 3).meet(Partitioned.point(4, 1)) == Partitioned(1, 4, 1)
    with pytest.raises(InvalidTimeError, match="hi"):
        Partitioned(3, 2, 0)


def test_kafka_frontier_covers_unknown_partitions_from_zero() -> None:
    f = kafka_frontier({0: 4, 1: 2})
    assert set(f.elements) == {
        Partitioned.point(0, 4),
        Partitioned.point(1, 2),
        Partitioned.above(2),
    }
    assert f.less_equal_time(Partitioned.point(9, 0))  # a later partition is not done
    assert not f.less_equal_time(Partitioned.point(0, 3))  # offsets 0..3 of p0 are done
    assert kafka_offsets(f) == ({0: 4, 1: 2}, 2)
    assert kafka_frontier(partitions=3) == kafka_frontier({0: 0, 1: 0, 2: 0})


def test_gtid_is_partitioned_time_of_its_own_kind() -> None:
    """MariaDB's GTID positions: Kafka's order and implementation, the kind
    ``gtid``, rendered as domains and sequence numbers; the core takes every
    subclass of Partitioned as partitioned."""
    assert time_type("gtid") is Gtid and Gtid.KIND == "gtid" != Partitioned.KIND
    assert [k for k in ("into", "counter", "lsn", "kafka", "gtid", "nope")
            if is_partitioned(k)] == ["kafka", "gtid"]
    g = Gtid.point(0, 58)
    assert g != Partitioned.point(0, 58)  # never mixed up with a Kafka time
    assert type(g.join(Gtid(0, None, 3))) is Gtid and type(g.meet(Gtid.above(1))) is Gtid
    assert type(Gtid.decode([0, 0, 58])) is Gtid and Gtid.decode([0, 0, 58]) == g
    assert pickle.loads(pickle.dumps(g)) == g and type(pickle.loads(pickle.dumps(g))) is Gtid
    with pytest.raises(InvalidTimeError, match="cannot decode Gtid"):
        Gtid.decode([0, 0])
    f = Antichain([Gtid.point(0, 58), Gtid(1, 2, 0), Gtid.point(3, 7), Gtid.above(4)])
    assert f.less_equal_time(Gtid.point(0, 58)) and not f.less_equal_time(Gtid.point(0, 57))
    assert f.less_equal_time(Gtid.point(9, 0))  # a later domain: from its start
    assert Gtid.partitions(f) == ({0: 58, 1: 0, 2: 0, 3: 7}, 4)
    assert Antichain.decode_json("gtid", f.encode_json()) == f
    assert render("gtid", f.encode()) == (
        "{domain 0: seq 58, domains 1-2: from the start, domain 3: seq 7, "
        "domains >=4: from the start}")
    assert render("kafka", [[0, 0, 58], [1, None, 0]]) == "{0:58, >=1:0}"
    # reclocking, vectorized: as Kafka's bindings over the same numbers
    fr = [{0: 3}, {0: 9, 1: 2}]
    for ty in (Partitioned, Gtid):
        b = Bindings(ty.KIND, [Binding(IntoTime(t), Antichain(
            [*(ty.point(d, n) for d, n in o.items()), ty.above(max(o) + 1)]))
            for t, o in zip((1000, 2000), fr, strict=True)], upper=2001)
        got = b.reclock_positions([0, 0, 0, 1, 1, 2], [1, 5, 9, 1, 2, 0]).tolist()
        assert got == [1000, 2000, UNBOUND, 2000, UNBOUND, UNBOUND], ty
        assert b.reclock(ty.point(0, 4)) == IntoTime(2000)


def test_unknown_kind_is_named() -> None:
    with pytest.raises(InvalidTimeError, match="unknown time kind 'nope'"):
        time_type("nope")


@pytest.mark.parametrize("kind", KINDS)
@given(data=st.data())
def test_encode_decode_round_trip(kind: str, data: st.DataObject) -> None:
    t = data.draw(TIME_STRATEGIES[kind])
    ty = time_type(kind)
    assert ty.decode(json.loads(json.dumps(t.encode()))) == t
    a = data.draw(antichains(TIME_STRATEGIES[kind]))
    assert Antichain.decode_json(kind, a.encode_json()) == a
    assert pickle.loads(pickle.dumps(a)) == a


@given(a=antichains(partitioned()), b=antichains(partitioned()), c=antichains(partitioned()))
def test_antichain_lattice_laws_partitioned(
    a: Antichain[Any], b: Antichain[Any], c: Antichain[Any]
) -> None:
    _lattice_laws(a, b, c)


@given(
    a=antichains(TIME_STRATEGIES["into"], 1),
    b=antichains(TIME_STRATEGIES["into"], 1),
    c=antichains(TIME_STRATEGIES["into"], 1),
)
def test_antichain_lattice_laws_total(
    a: Antichain[Any], b: Antichain[Any], c: Antichain[Any]
) -> None:
    _lattice_laws(a, b, c)


def _lattice_laws(a: Antichain[Any], b: Antichain[Any], c: Antichain[Any]) -> None:
    # commutative, associative, idempotent, absorption
    assert a.join(b) == b.join(a)
    assert a.meet(b) == b.meet(a)
    assert a.join(b.join(c)) == a.join(b).join(c)
    assert a.meet(b.meet(c)) == a.meet(b).meet(c)
    assert a.join(a) == a and a.meet(a) == a
    assert a.join(a.meet(b)) == a
    assert a.meet(a.join(b)) == a
    # the order agrees with the operations
    assert a.less_equal(b) == (a.join(b) == b) == (a.meet(b) == a)
    assert a.less_equal(a.join(b)) and b.less_equal(a.join(b))
    assert a.meet(b).less_equal(a) and a.meet(b).less_equal(b)
    assert a.less_than(b) == (a.less_equal(b) and a != b)
    # distributive (antichains of up-sets form a distributive lattice)
    assert a.join(b.meet(c)) == a.join(b).meet(a.join(c))
    # the empty antichain is the top, {minimum} the bottom
    top: Antichain[Any] = Antichain.empty()
    assert a.less_equal(top) and a.join(top) == top


@given(a=antichains(partitioned()), t=points())
def test_containment_matches_order(a: Antichain[Any], t: Partitioned) -> None:
    assert a.less_equal_time(t) == a.less_equal(Antichain.from_elem(t))
    assert a.less_equal_time(t) == any(e.less_equal(t) for e in a.elements)


@given(a=antichains(partitioned()))
def test_antichain_elements_are_incomparable(a: Antichain[Any]) -> None:
    for x in a.elements:
        for y in a.elements:
            assert x == y or not x.less_equal(y)
