"""Hypothesis strategies for the time model."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from reclock.core.bindings import Binding, Bindings
from reclock.core.frontier import Antichain, kafka_frontier
from reclock.core.time import Counter, Gtid, IntoTime, Lsn, Partitioned


@st.composite
def partitioned(draw: st.DrawFn, max_partition: int = 6, max_offset: int = 12) -> Partitioned:
    lo = draw(st.integers(0, max_partition))
    hi = draw(st.one_of(st.none(), st.integers(lo, lo + 3)))
    return Partitioned(lo, hi, draw(st.integers(0, max_offset)))


def points(max_partition: int = 6, max_offset: int = 12) -> st.SearchStrategy[Partitioned]:
    return st.builds(Partitioned.point, st.integers(0, max_partition), st.integers(0, max_offset))


def antichains(
    elem: st.SearchStrategy[Any], max_size: int = 4
) -> st.SearchStrategy[Antichain[Any]]:
    return st.lists(elem, max_size=max_size).map(Antichain)


TIME_STRATEGIES: dict[str, st.SearchStrategy[Any]] = {
    "kafka": partitioned(),
    "gtid": partitioned().map(lambda p: Gtid(p.lo, p.hi, p.offset)),
    "into": st.integers(0, 50).map(IntoTime),
    "lsn": st.integers(0, (1 << 64) - 1).map(Lsn),
    "counter": st.integers(0, 50).map(Counter),
}


@st.composite
def kafka_bindings(
    draw: st.DrawFn, max_bindings: int = 8, max_partitions: int = 5, closed: bool = False
) -> Bindings[Partitioned]:
    """Monotone Kafka bindings with partitions appearing over time."""
    n = draw(st.integers(0, max_bindings))
    offsets: dict[int, int] = {}
    t = draw(st.integers(0, 5)) * 1000
    out = []
    for _ in range(n):
        nparts = max(len(offsets), draw(st.integers(0, max_partitions)))
        for p in range(nparts):
            offsets[p] = offsets.get(p, 0) + draw(st.integers(0, 6))
        out.append(Binding(IntoTime(t), kafka_frontier(offsets, partitions=nparts)))
        t += draw(st.integers(1, 3)) * 1000
    if closed and out:
        out.append(Binding(IntoTime(t), Antichain.empty()))
        return Bindings("kafka", out, upper=Antichain.empty())
    return Bindings("kafka", out, upper=t)


@st.composite
def total_bindings(draw: st.DrawFn, kind: str = "lsn", max_bindings: int = 8) -> Bindings[Any]:
    ty = {"lsn": Lsn, "counter": Counter}[kind]
    n = draw(st.integers(0, max_bindings))
    v, t, out = 0, 1000, []
    for _ in range(n):
        v += draw(st.integers(0, 10))
        out.append(Binding(IntoTime(t), Antichain.from_elem(ty(v))))
        t += draw(st.integers(1, 3)) * 1000
    return Bindings(kind, out, upper=t)
