"""MariaDB GTID positions as FromTime frontiers.

A GTID is ``domain-server-seq``; within one replication domain the sequence
numbers grow (from 1), domains are independent: the GTID set is partially
ordered, one coordinate per domain, like Kafka's partitions. So the FromTime
is :class:`~reclock.core.time.Gtid` (Kafka's partitioned time under a kind
of its own, ``gtid``) with the partition the domain id and the offset a
sequence number: a transaction ``d-s-n`` is the point
``(d, n)``. A position (``@@gtid_binlog_pos``, the last GTID per domain) is
the frontier of the next sequence number per domain: ``0-1-57`` ->
``{0: 58}``; domains not named in it (and domain 0 always, so that the
snapshot of a server with an empty binary log has a point before it) are
covered from sequence number 0 by interval elements and by the open-ended
element above the highest domain, so a domain that appears later is read
from its first transaction.

Positions are handled here as ``{domain: next seq}`` dicts; a domain that is
absent is at its start (nothing of it seen).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from reclock.core.errors import DefiniteError
from reclock.core.frontier import Antichain
from reclock.core.time import Gtid

Pos = dict[int, int]


def parse_gtids(text: str | None) -> list[tuple[int, int, int]]:
    """``"0-1-57,1-2-3"`` -> ``[(domain, server, seq), ...]``."""
    out = []
    for part in (text or "").replace("\n", "").split(","):
        part = part.strip()
        if not part:
            continue
        try:
            d, s, n = (int(x) for x in part.split("-"))
        except ValueError:
            raise DefiniteError(f"not a MariaDB GTID: {part!r}") from None
        out.append((d, s, n))
    return out


def position(text: str | None) -> Pos:
    """A GTID position (the last GTID per domain) as next sequence numbers."""
    pos: Pos = {}
    for d, _, n in parse_gtids(text):
        pos[d] = max(pos.get(d, 0), n + 1)
    return pos


def frontier(pos: Mapping[int, int]) -> Antichain[Gtid]:
    """``{domain: next seq}`` as a frontier (see the module docstring)."""
    have = {d: n for d, n in pos.items() if n > 0}
    have.setdefault(0, max(1, have.get(0, 1)))
    elems: list[Gtid] = []
    prev = -1
    for d in sorted(have):
        if d > prev + 1:
            elems.append(Gtid(prev + 1, d - 1, 0))  # domains not seen yet
        elems.append(Gtid.point(d, have[d]))
        prev = d
    elems.append(Gtid.above(prev + 1))
    return Antichain(elems)


def INITIAL() -> Antichain[Gtid]:
    """Before everything: every domain from its start."""
    return Antichain.from_elem(Gtid.above(0))


def of(f: Antichain[Any]) -> Pos:
    """A frontier as ``{domain: next seq}`` (domains at their start left out)."""
    offsets, _ = Gtid.partitions(f)
    return {d: n for d, n in offsets.items() if n > 1}


def nxt(pos: Mapping[int, int], domain: int) -> int:
    return pos.get(domain, 1)


def before(pos: Mapping[int, int], domain: int, seq: int) -> bool:
    """Whether transaction ``domain-*-seq`` is before position ``pos``."""
    return seq < nxt(pos, domain)


def le(a: Mapping[int, int], b: Mapping[int, int]) -> bool:
    """``a <= b`` in every domain."""
    return all(nxt(b, d) >= n for d, n in a.items() if n > 1)


def join(*ps: Mapping[int, int]) -> Pos:
    out: Pos = {}
    for p in ps:
        for d, n in p.items():
            out[d] = max(out.get(d, 1), n)
    return {d: n for d, n in out.items() if n > 1}


def meet(ps: Iterable[Mapping[int, int]]) -> Pos:
    ps = list(ps)
    if not ps:
        return {}
    domains = set().union(*(p.keys() for p in ps))
    out = {d: min(nxt(p, d) for p in ps) for d in domains}
    return {d: n for d, n in out.items() if n > 1}


def text(pos: Mapping[int, int]) -> str:
    """A position as MariaDB writes one, without server ids: ``0-*-57``."""
    return ",".join(f"{d}-*-{n - 1}" for d, n in sorted(pos.items()) if n > 1) or "(empty)"
