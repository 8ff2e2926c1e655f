"""Frontiers: antichains of times, and the Kafka frontier helpers.

An :class:`Antichain` is a set of mutually incomparable times. As an *upper*
it is exclusive: it "contains" (is ``<=``) a time ``t`` when some element ``f``
has ``f <= t`` -- every time it contains is still to come. The empty antichain
contains nothing: the stream is complete. Antichains are ordered by the sets of
times they contain (their up-sets): ``A <= B`` when everything ``B`` contains,
``A`` contains too, i.e. ``B`` is further along. Under that order

* ``A.join(B)`` (least upper bound) is the frontier that has passed both:
  the minimal pairwise joins of elements;
* ``A.meet(B)`` (greatest lower bound) is the frontier behind both:
  the minimal elements of the union.

Counted times that report frontier changes (``ChangeBatch``,
``MutableAntichain``) and the capture/replay protocol live with the tests,
in ``tests/capture.py``: the product never counts capabilities, and they
serve there as the protocol's reference model (docs/design.md, "Capture and
replay").
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Iterable, Iterator
from typing import Any, Generic

from reclock.core.errors import InvalidTimeError
from reclock.core.time import U64_MAX, Partitioned, T, time_type, trusted_element


def _minimal(elements: Iterable[T]) -> tuple[T, ...]:
    """The minimal elements of ``elements``, deduplicated, in canonical order."""
    items = set(elements)
    if len(items) <= 1:  # the common frontier of one counter or offset
        return tuple(items)
    if len(items) > 8 and all(_simple(e) for e in items):
        return _minimal_partitioned(items)  # type: ignore[arg-type, return-value]
    return _minimal_pairwise(items)


def _minimal_pairwise(items: Iterable[T]) -> tuple[T, ...]:
    """:func:`_minimal` for any partial order: each element against those kept."""
    ordered = sorted(set(items), key=lambda e: e.sort_key())
    result: list[T] = []
    # After sorting by a linear extension, an element can only be dominated by
    # an element that comes earlier.
    for e in ordered:
        if not any(r.less_equal(e) for r in result):
            result.append(e)
    return tuple(result)


# -- Kafka's partitioned time, fast -------------------------------------------------------
#
# A Kafka frontier holds one point per known partition and an "every higher
# partition" element (an interval without upper end). Comparing every element
# with every other is quadratic in the partitions (150 ms per antichain at
# 2,048); for antichains of points and unbounded intervals only, these work on
# a map partition -> offset and the unbounded intervals sorted by their lower
# end, in O(n log n). Other intervals (rare: from joins of intervals) take the
# general path. The test tests/reclock/test_frontier.py holds both to the same
# answers.


def _simple(e: Any) -> bool:
    return type(e) is Partitioned and (e.hi is None or e.hi == e.lo)


class _Index:
    """A simple Kafka antichain's elements, ready for containment: the
    points by partition, and its unbounded elements by lower end with their
    offsets (decreasing, as the antichain is minimal)."""

    __slots__ = ("above", "los", "offsets", "points")

    def __init__(self, elements: Iterable[Partitioned]) -> None:
        self.points: dict[int, Partitioned] = {}
        self.above: list[Partitioned] = []
        for e in elements:
            if e.hi is None:
                self.above.append(e)
            else:
                self.points[e.lo] = e
        self.above.sort(key=lambda e: (e.lo, e.offset))
        self.los = [e.lo for e in self.above]
        self.offsets = [e.offset for e in self.above]

    def above_offset(self, partition: int) -> int | None:
        """The least offset of an unbounded element covering ``partition``."""
        i = bisect_right(self.los, partition) - 1
        return None if i < 0 else self.offsets[i]

    def contains(self, t: Partitioned) -> bool:
        """Some element ``<= t``."""
        a = self.above_offset(t.lo)
        if a is not None and a <= t.offset:
            return True
        if t.hi is None or t.hi != t.lo:
            return False  # a point never covers more than its partition
        p = self.points.get(t.lo)
        return p is not None and p.offset <= t.offset


def _minimal_partitioned(items: set[Partitioned]) -> tuple[Partitioned, ...]:
    points: dict[int, Partitioned] = {}
    above: list[Partitioned] = []
    for e in items:
        if e.hi is None:
            above.append(e)
        else:
            have = points.get(e.lo)
            if have is None or e.offset < have.offset:
                points[e.lo] = e
    above.sort(key=lambda e: (e.lo, e.offset))
    kept: list[Partitioned] = []
    for a in above:  # lower ends ascending: kept only if below every earlier offset
        if not kept or a.offset < kept[-1].offset:
            kept.append(a)
    index = _Index(kept)
    result = list(kept)
    for p, e in points.items():
        least = index.above_offset(p)
        if least is None or least > e.offset:
            result.append(e)
    result.sort(key=lambda e: e.sort_key())
    return tuple(result)


class Antichain(Generic[T]):
    """An immutable set of mutually incomparable times (a frontier)."""

    __slots__ = ("_elements", "_hash", "_index")

    _elements: tuple[T, ...]
    _hash: int | None
    _index: _Index | None

    def __init__(self, elements: Iterable[T] = ()) -> None:
        object.__setattr__(self, "_elements", _minimal(elements))
        object.__setattr__(self, "_hash", None)
        object.__setattr__(self, "_index", None)

    def _fast(self) -> _Index | None:
        """The containment index of a large simple Kafka antichain (built
        once), ``None`` for any other antichain."""
        idx = self._index
        if idx is None and len(self._elements) > 8 and all(_simple(e) for e in self._elements):
            idx = _Index(self._elements)  # type: ignore[arg-type]
            object.__setattr__(self, "_index", idx)
        return idx

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Antichain is immutable")

    # -- construction -----------------------------------------------------
    @classmethod
    def from_elem(cls, element: T) -> Antichain[T]:
        return cls((element,))

    @classmethod
    def empty(cls) -> Antichain[T]:
        """The empty frontier: complete, contains no time."""
        return cls(())

    # -- inspection -------------------------------------------------------
    @property
    def elements(self) -> tuple[T, ...]:
        """The elements in canonical (sort-key) order."""
        return self._elements

    def is_empty(self) -> bool:
        return not self._elements

    def __iter__(self) -> Iterator[T]:
        return iter(self._elements)

    def __len__(self) -> int:
        return len(self._elements)

    def __bool__(self) -> bool:
        return bool(self._elements)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Antichain) and self._elements == other._elements

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            h = hash(self._elements)
            object.__setattr__(self, "_hash", h)
        return h

    def __repr__(self) -> str:
        return "{" + ", ".join(repr(e) for e in self._elements) + "}"

    def __reduce__(self) -> tuple[Any, ...]:
        # Minimal and ordered already: unpickling (each Spark task, for every
        # binding of the broadcast snapshot) need not establish it again.
        return (_trusted, (self._elements,))

    def as_option(self) -> T | None:
        """For totally ordered times: the single element, or ``None`` if empty."""
        if len(self._elements) > 1:
            raise ValueError(f"antichain {self!r} has more than one element")
        return self._elements[0] if self._elements else None

    # -- order --------------------------------------------------------------
    def less_equal_time(self, time: T) -> bool:
        """True when the frontier contains ``time`` (some element ``<= time``):
        ``time`` is not yet complete."""
        idx = self._fast()
        if idx is not None and type(time) is Partitioned:
            return idx.contains(time)  # type: ignore[arg-type]
        return any(e.less_equal(time) for e in self._elements)

    def less_than_time(self, time: T) -> bool:
        """True when some element is strictly less than ``time``."""
        return any(e.less_equal(time) and e != time for e in self._elements)

    def less_equal(self, other: Antichain[T]) -> bool:
        """``self <= other``: every element of ``other`` is contained in ``self``."""
        idx = self._fast()
        if idx is not None:
            theirs = other._fast()
            if theirs is not None:
                return _less_equal_partitioned(idx, theirs)
            return all(idx.contains(o) for o in other._elements)  # type: ignore[arg-type]
        return all(self.less_equal_time(o) for o in other._elements)

    def less_than(self, other: Antichain[T]) -> bool:
        return self.less_equal(other) and self != other

    # -- lattice ------------------------------------------------------------
    def join(self, other: Antichain[T]) -> Antichain[T]:
        """Least upper bound: the frontier that has passed both."""
        mine, theirs = self._fast(), other._fast()
        if mine is not None and theirs is not None:
            return Antichain(_join_partitioned(mine, theirs))  # type: ignore[arg-type]
        joins = []
        for a in self._elements:
            for b in other._elements:
                j = a.join(b)
                if j is not None:
                    joins.append(j)
        return Antichain(joins)

    def meet(self, other: Antichain[T]) -> Antichain[T]:
        """Greatest lower bound: the frontier behind both."""
        return Antichain(self._elements + other._elements)

    # -- encoding -------------------------------------------------------------
    def encode(self) -> list[Any]:
        return [e.encode() for e in self._elements]

    def encode_json(self) -> str:
        """Canonical JSON text: equal antichains give equal text."""
        return json.dumps(self.encode(), separators=(",", ":"))

    @staticmethod
    def decode(kind: str, value: Any) -> Antichain[Any]:
        """Decode an antichain of the time kind ``kind`` from :meth:`encode`'s form."""
        ty = time_type(kind)
        if not isinstance(value, list):
            raise InvalidTimeError(f"cannot decode a {kind} antichain from {value!r}")
        if len(value) > 8 and issubclass(ty, Partitioned):
            fast = _decode_partitioned(ty, value)
            if fast is not None:
                return _trusted(fast)
        return Antichain(ty.decode(v) for v in value)

    @staticmethod
    def decode_json(kind: str, text: str) -> Antichain[Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidTimeError(f"not JSON: {text[:80]!r}: {exc}") from None
        return Antichain.decode(kind, value)


def _trusted(elements: tuple[T, ...]) -> Antichain[T]:
    """An antichain of ``elements`` as :meth:`Antichain.__reduce__` gave them:
    minimal and in canonical order."""
    a: Antichain[T] = Antichain.__new__(Antichain)
    object.__setattr__(a, "_elements", tuple(elements))
    object.__setattr__(a, "_hash", None)
    object.__setattr__(a, "_index", None)
    return a


def _less_equal_partitioned(a: _Index, b: _Index) -> bool:
    """``A <= B`` for two simple Kafka antichains: :meth:`_Index.contains`
    of every element of ``B``, inlined (validating a shard's bindings at
    2,048 partitions compares a million elements)."""
    los, offsets, points = a.los, a.offsets, a.points
    for p, e in b.points.items():
        i = bisect_right(los, p) - 1
        if i >= 0 and offsets[i] <= e.offset:
            continue
        q = points.get(p)
        if q is None or q.offset > e.offset:
            return False
    for e in b.above:  # an unbounded element: only an unbounded one covers it
        i = bisect_right(los, e.lo) - 1
        if i < 0 or offsets[i] > e.offset:
            return False
    return True


def _decode_partitioned(ty: type[Partitioned], value: list[Any]) -> tuple[Any, ...] | None:
    """The minimal elements, in canonical order, of an encoded partitioned
    frontier of valid points and unbounded elements (a Kafka frontier as
    stored: at 2,048 partitions, reading a shard's bindings decoded a million
    of them); ``None`` for any other list (the general path decodes it, and
    names what is invalid). :func:`_minimal_partitioned` on the encoded
    integers: only the elements kept are made, and their order's keys are
    plain tuples."""
    points: dict[int, int] = {}  # partition -> least offset
    above: dict[int, int] = {}  # lower end -> least offset
    for v in value:
        if type(v) is not list or len(v) != 3:
            return None
        lo, hi, off = v
        if type(lo) is not int or type(off) is not int or lo < 0 or off < 0:
            return None
        if hi is None:
            if off < above.get(lo, off + 1):
                above[lo] = off
        elif type(hi) is int and hi == lo:
            if off < points.get(lo, off + 1):
                points[lo] = off
        else:
            return None
    los: list[int] = []
    offsets: list[int] = []
    for lo in sorted(above):  # lower ends ascending: kept only if below every earlier offset
        if not offsets or above[lo] < offsets[-1]:
            los.append(lo)
            offsets.append(above[lo])
    keyed: list[tuple[tuple[int, int, int], int, int | None, int]] = [
        ((off, lo, -U64_MAX), lo, None, off) for lo, off in zip(los, offsets, strict=True)]
    for p, off in points.items():
        i = bisect_right(los, p) - 1
        if i < 0 or offsets[i] > off:
            keyed.append(((off, p, -p), p, p, off))
    keyed.sort()
    make = trusted_element
    return tuple(make(ty, lo, hi, off) for _key, lo, hi, off in keyed)


def _join_partitioned(a: _Index, b: _Index) -> list[Partitioned]:
    """The pairwise joins of two simple Kafka antichains that can be minimal:
    per point, with the other side's point of its partition and with the
    least offset among the other side's unbounded elements covering it; and
    the unbounded elements pairwise (few)."""
    out: list[Partitioned] = []
    for mine, theirs in ((a, b), (b, a)):
        for p, e in mine.points.items():
            q = theirs.points.get(p)
            if q is not None and mine is a:  # each pair of points once
                out.append(Partitioned(p, p, max(e.offset, q.offset)))
            o = theirs.above_offset(p)
            if o is not None:
                out.append(Partitioned(p, p, max(e.offset, o)))
    out += [Partitioned(max(x.lo, y.lo), None, max(x.offset, y.offset))
            for x in a.above for y in b.above]
    return out


# -- Kafka frontiers, distances, rendering ------------------------------------------------


def kafka_frontier(offsets: dict[int, int] | None = None, *, partitions: int | None = None) -> Any:
    """The Kafka frontier for next offsets ``{partition: offset}``.

    One point per known partition plus "every partition above the highest known
    one, at offset 0". ``partitions`` declares partitions ``0..partitions-1``
    known (missing ones at offset 0). Returns ``Antichain[Partitioned]``.
    """
    known = dict(offsets or {})
    n = max([*known.keys(), -1]) + 1
    if partitions is not None:
        n = max(n, partitions)
    # as decoded (the elements kept are made once, unchecked once checked
    # here: a probe of 2,048 partitions each second); anything odd (a
    # negative or non-int offset) takes the checked path, which names it
    enc: list[Any] = [[p, p, known.get(p, 0)] for p in range(n)]
    enc.append([n, None, 0])
    fast = _decode_partitioned(Partitioned, enc) if n > 8 else None
    if fast is not None:
        return _trusted(fast)
    elems = [Partitioned.point(p, known.get(p, 0)) for p in range(n)]
    elems.append(Partitioned.above(n))
    return Antichain(elems)


def frontier_distance(kind: str, behind: Any, ahead: Any) -> int | None:
    """How many positions lie between two frontiers of one source (``behind <=
    ahead``): records for counters and Kafka offsets, bytes of WAL for LSNs.
    ``None`` when either is empty or unknown."""
    if behind is None or ahead is None or behind.is_empty() or ahead.is_empty():
        return None
    return int(time_type(kind).distance(behind, ahead))


def frontier_position(kind: str, frontier: Antichain[Any] | None) -> float | None:
    """One number that grows as the frontier advances (for charts and lag):
    the value of a totally ordered frontier, the sum of a Kafka frontier's
    offsets. ``None`` when unknown or empty (complete)."""
    if frontier is None or frontier.is_empty():
        return None
    return float(time_type(kind).position(frontier))


def frontier_partitions(kind: str, frontier: Antichain[Any]
                        ) -> tuple[dict[int, int], int | None] | None:
    """A partitioned frontier's next offset per partition and the first
    partition of its "every higher partition" element; ``None`` for a totally
    ordered time."""
    return time_type(kind).partitions(frontier)  # type: ignore[no-any-return]


def render(kind: str, encoded: Any) -> str:
    """A human form of an encoded frontier of ``kind`` (``-`` for none); each
    time type renders its own elements."""
    if encoded is None:
        return "-"
    if not encoded:
        return "{} (complete)"
    return str(time_type(kind).render(list(encoded)))
