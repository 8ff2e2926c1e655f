"""A source's successive binding frontiers, held as what changed.

A :class:`~reclock.core.bindings.Bindings` snapshot holds ``R(t_0) <= R(t_1)
<= ...``. Holding each frontier whole costs the partitions times the
bindings: a day of bindings of a 512-partition topic, where each binding
moves a partition or two, is 44 million elements, while what changed is
86,400. These logs hold the changes, in memory and in a job's pickle, and
answer what bindings are asked from them:

* :class:`TotalLog` -- a totally ordered time (counter, LSN): one value per
  binding, an int64 array.
* :class:`PartLog` -- a partitioned time (Kafka, GTID): per change, the
  binding, the partition, its point's new offset and its previous one
  (``-1``: no point); and the other elements (intervals, "every partition
  from ``lo``"), which change rarely, as a set per change.

Each log rebuilds a frontier (:meth:`frontier`) from the nearer end, is
validated change by change as it is built (only the elements a binding adds
are compared with the frontier before it, by the order of frontiers of
docs/design.md, "FromTime and IntoTime"),
and compiles into :class:`Compiled`, the reclocking search: per partition,
the bindings at which its least contained offset moves. Reclocking a record
is a binary search among its partition's moves.

Builders (:class:`TotalBuilder`, :class:`PartBuilder`) take frontiers whole,
as :class:`~reclock.core.frontier.Antichain` objects or as stored encodings,
or as changes read from the remap store.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from reclock.core.errors import BindingError
from reclock.core.frontier import Antichain
from reclock.core.time import is_partitioned, time_type

INT64_MAX = np.iinfo(np.int64).max
#: Sentinel in vectorized results: the record is not bound yet (it waits).
UNBOUND = -1
#: An element ``(lo, hi, offset)`` of a partitioned frontier (``hi`` None: unbounded).
Elem = tuple[int, int | None, int]
I64 = npt.NDArray[np.int64]


def _ints(xs: Sequence[int] | I64) -> I64:
    return np.asarray(xs, dtype=np.int64)


# -- compiled: the reclocking search ------------------------------------------------------


@dataclass(frozen=True)
class Compiled:
    """Per row (a partition; the last row stands for every partition above
    the others; a total order has one row), the bindings at which the row's
    bound moves, in order: ``at[k]`` the binding, ``bound[k]`` the least
    offset its frontier contains from there on (``INT64_MAX``: none), rising
    within a row. Row ``r`` is ``[start[r], end[r])`` of both. A position
    ``(r, o)`` reclocks to the first binding whose bound is above ``o``.
    ``flat`` (when it fits) is the rows' bounds in one sorted array, so that
    a batch of many partitions is one search."""

    nb: int
    times_ext: I64  # binding times, then UNBOUND
    at: I64
    bound: I64
    start: I64
    end: I64
    rest: int  # rows >= rest share this row
    stride: int
    clip: int
    flat: I64 | None

    def _at(self, k: I64, end: I64 | int) -> I64:
        """The bindings of moves ``k``, ``nb`` where ``k`` is past its row's ``end``."""
        return np.where(k < end, self.at[np.minimum(k, len(self.at) - 1)], self.nb)

    def first_above(self, rows: I64, offsets: I64) -> I64:
        """Per ``(row, offset)``: the first binding whose bound is above the
        offset (its index; ``nb`` when none is)."""
        rows = np.minimum(rows, self.rest)
        if rows.size == 0 or self.nb == 0:
            return np.full(rows.shape, self.nb, dtype=np.int64)
        lo, hi = int(rows.min()), int(rows.max())
        if lo == hi:  # one partition: the common case of a task's range
            s, e = int(self.start[lo]), int(self.end[lo])
            return self._at(np.searchsorted(self.bound[s:e], offsets, side="right") + s, e)
        if self.flat is not None:
            keys = rows * self.stride + np.minimum(offsets, self.clip)
            return self._at(np.searchsorted(self.flat, keys, side="right"), self.end[rows])
        out = np.empty(rows.shape, dtype=np.int64)
        for r in np.unique(rows):
            mask = rows == r
            s, e = int(self.start[r]), int(self.end[r])
            out[mask] = self._at(np.searchsorted(self.bound[s:e], offsets[mask], side="right")
                                 + s, e)
        return out

    def times_of(self, index: I64) -> I64:
        """IntoTimes of binding indexes (``nb``: :data:`UNBOUND`)."""
        return self.times_ext[index]

    def passed(self, lower: I64) -> int:
        """The bindings before the returned index each contain every
        position a frontier with per-row least offsets ``lower`` (rows as
        here; ``INT64_MAX``: none) contains: a job reading from it needs
        only the bindings from there on."""
        if self.nb == 0:
            return 0
        rows = np.arange(len(lower), dtype=np.int64)
        # a row's first binding whose bound is above the lower's: every
        # binding before it contains the row's positions from the lower on;
        # a row the lower does not contain at all never limits
        firsts = self.first_above(rows, np.minimum(lower, INT64_MAX - 1))
        firsts[lower == INT64_MAX] = self.nb
        return int(firsts.min()) if firsts.size else self.nb


def compile_rows(times: I64, at: I64, row: I64, bound: I64, rows: int) -> Compiled:
    """:class:`Compiled` of the rows' moves (sorted by row, then binding)."""
    nb = len(times)
    times_ext = np.empty(nb + 1, dtype=np.int64)
    times_ext[:nb] = times
    times_ext[nb] = UNBOUND
    r = np.arange(rows, dtype=np.int64)
    start = np.searchsorted(row, r, side="left").astype(np.int64)
    end = np.searchsorted(row, r, side="right").astype(np.int64)
    finite = bound[bound != INT64_MAX]
    clip = int(finite.max()) + 1 if finite.size else 0
    stride = clip + 2
    flat: I64 | None = None
    if rows * stride < (1 << 62):
        flat = row * stride + np.minimum(bound, clip + 1)
    return Compiled(nb, times_ext, at, bound, start, end, rows - 1, stride, clip, flat)


# -- totally ordered times ------------------------------------------------------------------


@dataclass(frozen=True)
class TotalLog:
    """One value per binding (``INT64_MAX``: the empty frontier, closed)."""

    kind: str
    values: I64

    @property
    def n(self) -> int:
        return len(self.values)

    def frontier(self, i: int) -> Antichain[Any]:
        v = int(self.values[i])
        if v == INT64_MAX:
            return Antichain.empty()
        return Antichain.from_elem(time_type(self.kind)(v))

    def frontiers(self) -> list[Antichain[Any]]:
        return [self.frontier(i) for i in range(self.n)]

    def sliced(self, lo: int) -> TotalLog:
        return TotalLog(self.kind, self.values[lo:])

    def appended(self, other: TotalLog) -> TotalLog:
        return TotalLog(self.kind, np.concatenate([self.values, other.values]))

    def builder(self) -> TotalBuilder:
        """A builder continuing after this log's last frontier."""
        b = TotalBuilder(self.kind)
        if self.n:
            b.last = int(self.values[-1])
            b.n = self.n
        return b

    def compile(self, times: I64) -> Compiled:
        n = self.n
        return compile_rows(times, np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64),
                            self.values, 1)

    def lower_rows(self, lower: Antichain[Any]) -> I64:
        v = lower.as_option()
        return _ints([INT64_MAX if v is None else int(v)])

    def first_not_containing(self, time: Any, compiled: Compiled) -> int:
        return int(compiled.first_above(_ints([0]), _ints([int(time)]))[0])

    def same(self, other: Any) -> bool:
        return isinstance(other, TotalLog) and np.array_equal(self.values, other.values)


class TotalBuilder:
    """Builds a :class:`TotalLog`, checking each frontier against the one before."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.ty = time_type(kind)
        self.values: list[int] = []
        self.last: int | None = None  # the frontier before the next (None: none yet)
        self.n = 0

    def add(self, frontier: Antichain[Any], check: bool = True) -> None:
        els = frontier.elements
        for e in els:
            if not isinstance(e, self.ty):
                raise BindingError(f"element {e!r} is not a {self.kind} time")
        if len(els) > 1:
            raise BindingError(f"a {self.kind} frontier has one element at most: {frontier!r}")
        self._value(None if not els else int(els[0]), frontier, check)

    def add_encoded(self, encoded: Any, check: bool = True) -> None:
        if not isinstance(encoded, list) or len(encoded) > 1:
            raise BindingError(f"not a {self.kind} frontier: {encoded!r}")
        self._value(None if not encoded else int(self.ty.decode(encoded[0])), encoded, check)

    def add_change(self, removed: Iterable[Any], added: Iterable[Any], check: bool = True) -> None:
        """A change as the store keeps it: encoded elements removed and added."""
        gone = {int(self.ty.decode(v)) for v in removed}
        now = [] if self.last is None or self.last == INT64_MAX else [self.last]
        now = [v for v in now if v not in gone] + [int(self.ty.decode(v)) for v in added]
        if len(now) > 1:
            raise BindingError(f"a {self.kind} frontier has one element at most: {now!r}")
        self._value(now[0] if now else None, now, check)

    def _value(self, value: int | None, shown: Any, check: bool) -> None:
        """``value``: the frontier's one element (None: the empty frontier)."""
        if value is not None and value >= INT64_MAX:
            raise BindingError(f"{self.kind} time {value} is beyond what reclocking holds (2^63)")
        v = INT64_MAX if value is None else value
        if check and self.last is not None and v < self.last:
            raise BindingError(f"bindings must be monotone: {self.last} is not <= {shown!r}")
        self.values.append(v)
        self.last = v
        self.n += 1

    def log(self) -> TotalLog:
        return TotalLog(self.kind, _ints(self.values))


# -- partitioned times -----------------------------------------------------------------------


def _covers(e: Elem, p: int) -> bool:
    return e[0] <= p and (e[1] is None or p <= e[1])


def _le(a: Elem, b: Elem) -> bool:
    """``a <= b`` of two partitioned elements (:meth:`Partitioned.less_equal`)."""
    if a[2] > b[2] or a[0] > b[0]:
        return False
    return a[1] is None or (b[1] is not None and b[1] <= a[1])


@dataclass(frozen=True)
class PartLog:
    """Changes of a partitioned time's frontiers. Points (``hi == lo``, one
    per partition at most): per change ``idx`` (the binding), ``part``,
    ``off`` (the point's offset from that binding on, ``-1``: no point) and
    ``prev`` (before it), sorted by binding then partition. The other
    elements: ``span_at[s]`` the binding from which ``spans[s]`` is the set
    of them (``span_at[0] == 0``)."""

    kind: str
    n: int
    idx: I64
    part: I64
    off: I64
    prev: I64
    span_at: tuple[int, ...]
    spans: tuple[frozenset[Elem], ...]

    # -- frontiers ------------------------------------------------------------------
    def points_at(self, i: int) -> dict[int, int]:
        """The points of binding ``i``'s frontier (a fresh dict), rebuilt
        from the nearer end: forward from the first binding, or back from
        the last one's (kept once rebuilt)."""
        j = int(np.searchsorted(self.idx, i, side="right"))  # changes up to binding i
        if i >= self.n - 1:
            tip: dict[int, int] | None = self.__dict__.get("_tip")
            if tip is None:
                tip = self._forward(len(self.idx))
                object.__setattr__(self, "_tip", tip)
            return dict(tip)
        if j <= len(self.idx) - j:
            return self._forward(j)
        state = self.points_at(self.n - 1)
        part, prev = self.part[j:], self.prev[j:]
        uniq, first = np.unique(part, return_index=True)  # the first change after i
        for p, o in zip(uniq.tolist(), prev[first].tolist(), strict=True):
            if o >= 0:
                state[p] = o
            else:
                state.pop(p, None)
        return state

    def _forward(self, j: int) -> dict[int, int]:
        """The points after the first ``j`` changes."""
        part, off = self.part[:j][::-1], self.off[:j][::-1]
        uniq, first = np.unique(part, return_index=True)  # the last change of each
        return {p: o for p, o in zip(uniq.tolist(), off[first].tolist(), strict=True)
                if o >= 0}

    def spans_at(self, i: int) -> frozenset[Elem]:
        s = int(np.searchsorted(_ints(self.span_at), i, side="right")) - 1
        return self.spans[s] if s >= 0 else frozenset()

    def frontier(self, i: int) -> Antichain[Any]:
        return _antichain(self.kind, self.points_at(i), self.spans_at(i))

    def frontiers(self) -> list[Antichain[Any]]:
        """Every frontier, in order (forward, change by change)."""
        out: list[Antichain[Any]] = []
        points: dict[int, int] = {}
        j, s, m = 0, -1, len(self.idx)
        idx, part, off = self.idx.tolist(), self.part.tolist(), self.off.tolist()
        for i in range(self.n):
            while j < m and idx[j] == i:
                if off[j] >= 0:
                    points[part[j]] = off[j]
                else:
                    points.pop(part[j], None)
                j += 1
            while s + 1 < len(self.span_at) and self.span_at[s + 1] <= i:
                s += 1
            out.append(_antichain(self.kind, points, self.spans[s] if s >= 0 else frozenset()))
        return out

    # -- derived logs -----------------------------------------------------------------
    def sliced(self, lo: int) -> PartLog:
        """Bindings ``lo`` on, renumbered from 0: binding ``lo``'s frontier
        is the first, whole."""
        if lo == 0:
            return self
        if lo >= self.n:
            return PartLog(self.kind, 0, *(_ints([]),) * 4, (), ())
        a = int(np.searchsorted(self.idx, lo, side="right"))  # the changes after lo
        first = self.points_at(lo)
        ps = sorted(first)
        k = len(ps)
        idx = np.concatenate([np.zeros(k, dtype=np.int64), self.idx[a:] - lo])
        part = np.concatenate([_ints(ps), self.part[a:]])
        off = np.concatenate([_ints([first[p] for p in ps]), self.off[a:]])
        prev = np.concatenate([np.full(k, -1, dtype=np.int64), self.prev[a:]])
        s0 = int(np.searchsorted(_ints(self.span_at), lo, side="right")) - 1
        span_at = (0, *(t - lo for t in self.span_at[s0 + 1:]))
        return PartLog(self.kind, self.n - lo, idx, part, off, prev, span_at, self.spans[s0:])

    def appended(self, other: PartLog) -> PartLog:
        """This log, then ``other`` (built by :meth:`builder`: its changes
        are against this log's last frontier, its bindings numbered after)."""
        if not self.n:
            return other
        span_at, spans = self.span_at, self.spans
        for t, s in zip(other.span_at, other.spans, strict=True):
            if s != spans[-1]:
                span_at, spans = (*span_at, t), (*spans, s)
        return PartLog(self.kind, other.n, np.concatenate([self.idx, other.idx]),
                       np.concatenate([self.part, other.part]),
                       np.concatenate([self.off, other.off]),
                       np.concatenate([self.prev, other.prev]), span_at, spans)

    def builder(self) -> PartBuilder:
        """A builder continuing after this log's last frontier (its bindings
        numbered on from here: :meth:`appended` joins the two)."""
        b = PartBuilder(self.kind)
        if self.n:
            b.points = self.points_at(self.n - 1)
            b.spans = self.spans_at(self.n - 1)
            b.n = self.n
            b.span_at, b.span_sets = [], []
        return b

    # -- reclocking --------------------------------------------------------------------
    def top_row(self) -> int:
        tops = [int(self.part.max()) if self.part.size else 0]
        tops += [max(lo, hi or 0) for spans in self.spans for lo, hi, _o in spans]
        return max(tops) + 1

    def compile(self, times: I64) -> Compiled:
        n, rest = self.n, self.top_row()
        rows = rest + 1
        if n == 0:
            return compile_rows(times, *(_ints([]),) * 3, rows)
        # each span set's bound per row
        sb = np.full((len(self.spans), rows), INT64_MAX, dtype=np.int64)
        for s, spans in enumerate(self.spans):
            for lo, hi, o in spans:
                seg = sb[s, lo:(rows if hi is None else hi + 1)]
                np.minimum(seg, o, out=seg)
        # events: the points' changes, and the rows a span set changes (all
        # rows at binding 0)
        ev_row, ev_idx = [self.part], [self.idx]
        for s in range(len(self.spans)):
            moved = (np.arange(rows, dtype=np.int64) if s == 0
                     else np.flatnonzero(sb[s] != sb[s - 1]).astype(np.int64))
            ev_row.append(moved)
            ev_idx.append(np.full(len(moved), self.span_at[s], dtype=np.int64))
        m = len(self.part)
        row, idx = np.concatenate(ev_row), np.concatenate(ev_idx)
        is_pt = np.zeros(len(row), dtype=bool)
        is_pt[:m] = True
        val = np.zeros(len(row), dtype=np.int64)
        val[:m] = np.where(self.off < 0, INT64_MAX, self.off)
        order = np.lexsort((is_pt, idx, row))
        row, idx, is_pt, val = row[order], idx[order], is_pt[order], val[order]
        # the row's point from its last change at or before each event
        e = len(row)
        filled = np.maximum.accumulate(np.where(is_pt, np.arange(e), -1))
        row_start = np.searchsorted(row, np.arange(rows), side="left")[row]
        ptv = np.where(filled >= row_start, val[np.maximum(filled, 0)], INT64_MAX)
        seg = np.searchsorted(_ints(self.span_at), idx, side="right") - 1
        bound = np.minimum(ptv, sb[seg, row])
        last = np.ones(e, dtype=bool)  # one bound per (row, binding): the last event's
        last[:-1] = (row[1:] != row[:-1]) | (idx[1:] != idx[:-1])
        row, idx, bound = row[last], idx[last], bound[last]
        moves = np.ones(len(row), dtype=bool)  # only where the bound moves
        moves[1:] = (row[1:] != row[:-1]) | (bound[1:] != bound[:-1])
        return compile_rows(times, idx[moves], row[moves], bound[moves], rows)

    def lower_rows(self, lower: Antichain[Any]) -> I64:
        """Per row as :meth:`compile` numbers them, the least offset of the
        row's partitions that ``lower`` contains (``INT64_MAX``: none)."""
        rest = self.top_row()
        out = np.full(rest + 1, INT64_MAX, dtype=np.int64)
        pts = [(e.lo, e.offset) for e in lower if e.hi == e.lo]
        if pts:
            p = np.minimum(_ints([x for x, _ in pts]), rest)
            np.minimum.at(out, p, _ints([o for _, o in pts]))
        for e in lower:
            if e.hi != e.lo:
                seg = out[min(e.lo, rest):(rest + 1 if e.hi is None else min(e.hi, rest) + 1)]
                np.minimum(seg, e.offset, out=seg)
        return out

    def first_not_containing(self, time: Any, compiled: Compiled) -> int:
        """The first binding whose frontier does not contain ``time``."""
        if time.hi == time.lo:
            return int(compiled.first_above(_ints([time.lo]), _ints([time.offset]))[0])
        # only an element that is not a point can be <= one that is not
        t: Elem = (time.lo, time.hi, time.offset)
        for at, spans in zip(self.span_at, self.spans, strict=True):
            if not any(_le(e, t) for e in spans):
                return at
        return self.n

    def same(self, other: Any) -> bool:
        return (isinstance(other, PartLog) and self.n == other.n
                and all(np.array_equal(a, b) for a, b in (
                    (self.idx, other.idx), (self.part, other.part), (self.off, other.off),
                    (self.prev, other.prev)))
                and self.span_at == other.span_at and self.spans == other.spans)


def _antichain(kind: str, points: dict[int, int], spans: frozenset[Elem]) -> Antichain[Any]:
    enc: list[Any] = [[p, p, o] for p, o in points.items()]
    enc += [list(s) for s in spans]
    return Antichain.decode(kind, enc)


class PartBuilder:
    """Builds a :class:`PartLog`, checking what each frontier adds against
    the frontier before it (its other elements were in that one already)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.ty = time_type(kind)
        self.points: dict[int, int] = {}
        self.spans: frozenset[Elem] = frozenset()
        self.n = 0  # frontiers taken (numbering the next; a builder may continue a log)
        self.idx: list[int] = []
        self.part: list[int] = []
        self.off: list[int] = []
        self.prev: list[int] = []
        self.span_at: list[int] = [0]
        self.span_sets: list[frozenset[Elem]] = [frozenset()]

    def add(self, frontier: Antichain[Any], check: bool = True) -> None:
        ty = self.ty
        els: list[Elem] = []
        for e in frontier:
            if not isinstance(e, ty):
                raise BindingError(f"element {e!r} is not a {self.kind} time")
            els.append((e.lo, e.hi, e.offset))
        self.add_whole(els, frontier, check)

    def add_encoded(self, encoded: Any, check: bool = True) -> None:
        if not isinstance(encoded, list):
            raise BindingError(f"not a {self.kind} frontier: {encoded!r}")
        self.add_whole([_elem(self.ty, v) for v in encoded], encoded, check)

    def add_whole(self, els: Iterable[Elem], shown: Any, check: bool) -> None:
        points: dict[int, int] = {}
        spans: set[Elem] = set()
        for e in els:
            if e[1] == e[0]:
                if e[0] in points and points[e[0]] != e[2]:
                    raise BindingError(f"two points of partition {e[0]} in {shown!r}")
                points[e[0]] = e[2]
            else:
                spans.add(e)
        old = self.points
        changes = {p: o for p, o in points.items() if old.get(p) != o}
        for p in old:
            if p not in points:
                changes[p] = -1
        self._record(changes, frozenset(spans), shown, check)

    def add_change(self, removed: Iterable[Any], added: Iterable[Any], check: bool = True) -> None:
        """A change as the store keeps it: encoded elements removed from the
        frontier before, and added."""
        old = self.points
        changes: dict[int, int] = {}
        spans: set[Elem] | None = None
        for v in removed:
            lo, hi, o = _elem(self.ty, v)
            if hi == lo:
                if old.get(lo) != o:
                    raise BindingError(f"a change removes {v!r}, which the frontier lacks")
                changes[lo] = -1
            else:
                spans = set(self.spans) if spans is None else spans
                if (lo, hi, o) not in spans:
                    raise BindingError(f"a change removes {v!r}, which the frontier lacks")
                spans.discard((lo, hi, o))
        for v in added:
            lo, hi, o = _elem(self.ty, v)
            if hi == lo:
                if changes.get(lo, -1) >= 0 or (lo not in changes and lo in old):
                    raise BindingError(f"two points of partition {lo} after a change adding {v!r}")
                changes[lo] = o
            else:
                spans = set(self.spans) if spans is None else spans
                spans.add((lo, hi, o))
        self._record(changes, self.spans if spans is None else frozenset(spans),
                     (list(removed), list(added)), check)

    def _record(self, changes: dict[int, int], spans: frozenset[Elem], shown: Any,
                check: bool) -> None:
        old, old_spans, i = self.points, self.spans, self.n
        if check and self.n:
            for p, o in changes.items():
                if o < 0:
                    continue
                before = old.get(p, -1)
                if not (0 <= before <= o or any(s[2] <= o and _covers(s, p) for s in old_spans)):
                    raise BindingError(
                        f"bindings must be monotone: partition {p} at offset {o} in binding "
                        f"{i} is behind the binding before it ({shown!r})")
            for s in spans - old_spans:
                if not any(_le(e, s) for e in old_spans):
                    raise BindingError(
                        f"bindings must be monotone: {s!r} in binding {i} is contained in no "
                        f"element of the binding before it ({shown!r})")
        for p in sorted(changes):
            o = changes[p]
            before = old.get(p, -1)
            if o == before:
                continue
            self.idx.append(i)
            self.part.append(p)
            self.off.append(o)
            self.prev.append(before)
            if o < 0:
                del old[p]
            else:
                old[p] = o
        if spans != old_spans:
            if self.span_at and self.span_at[-1] == i:
                self.span_sets[-1] = spans
            else:
                self.span_at.append(i)
                self.span_sets.append(spans)
            self.spans = spans
        self.n += 1

    def log(self) -> PartLog:
        return PartLog(self.kind, self.n, _ints(self.idx), _ints(self.part), _ints(self.off),
                       _ints(self.prev), tuple(self.span_at), tuple(self.span_sets))


def _elem(ty: type[Any], v: Any) -> Elem:
    """An encoded partitioned element, checked (:meth:`Partitioned.decode` names what is wrong)."""
    if type(v) is list and len(v) == 3:
        lo, hi, o = v
        if (type(lo) is int and type(o) is int and lo >= 0 and o >= 0
                and (hi is None or (type(hi) is int and hi >= lo))):
            return (lo, hi, o)
    e = ty.decode(v)
    return (e.lo, e.hi, e.offset)


Log = TotalLog | PartLog
Builder = TotalBuilder | PartBuilder


def builder(kind: str) -> Builder:
    """An empty builder for frontiers of ``kind`` (validates the kind)."""
    time_type(kind)
    return PartBuilder(kind) if is_partitioned(kind) else TotalBuilder(kind)


__all__ = ["INT64_MAX", "UNBOUND", "Builder", "Compiled", "Log", "PartBuilder", "PartLog",
           "TotalBuilder", "TotalLog", "builder"]
