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
``MutableAntichain``) and the seeds' capture/replay protocol live with the
tests, in ``tests/capture.py``: the product never counts capabilities, and
they serve there as the protocol's reference model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any, Generic

from reclock.core.errors import InvalidTimeError
from reclock.core.time import Partitioned, T, time_type


def _minimal(elements: Iterable[T]) -> tuple[T, ...]:
    """The minimal elements of ``elements``, deduplicated, in canonical order."""
    ordered = sorted(set(elements), key=lambda e: e.sort_key())
    result: list[T] = []
    # After sorting by a linear extension, an element can only be dominated by
    # an element that comes earlier.
    for e in ordered:
        if not any(r.less_equal(e) for r in result):
            result.append(e)
    return tuple(result)


class Antichain(Generic[T]):
    """An immutable set of mutually incomparable times (a frontier)."""

    __slots__ = ("_elements", "_hash")

    _elements: tuple[T, ...]
    _hash: int | None

    def __init__(self, elements: Iterable[T] = ()) -> None:
        object.__setattr__(self, "_elements", _minimal(elements))
        object.__setattr__(self, "_hash", None)

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
        return (Antichain, (self._elements,))

    def as_option(self) -> T | None:
        """For totally ordered times: the single element, or ``None`` if empty."""
        if len(self._elements) > 1:
            raise ValueError(f"antichain {self!r} has more than one element")
        return self._elements[0] if self._elements else None

    # -- order --------------------------------------------------------------
    def less_equal_time(self, time: T) -> bool:
        """True when the frontier contains ``time`` (some element ``<= time``):
        ``time`` is not yet complete."""
        return any(e.less_equal(time) for e in self._elements)

    def less_than_time(self, time: T) -> bool:
        """True when some element is strictly less than ``time``."""
        return any(e.less_equal(time) and e != time for e in self._elements)

    def less_equal(self, other: Antichain[T]) -> bool:
        """``self <= other``: every element of ``other`` is contained in ``self``."""
        return all(self.less_equal_time(o) for o in other._elements)

    def less_than(self, other: Antichain[T]) -> bool:
        return self.less_equal(other) and self != other

    # -- lattice ------------------------------------------------------------
    def join(self, other: Antichain[T]) -> Antichain[T]:
        """Least upper bound: the frontier that has passed both."""
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
        return Antichain(ty.decode(v) for v in value)

    @staticmethod
    def decode_json(kind: str, text: str) -> Antichain[Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidTimeError(f"not JSON: {text[:80]!r}: {exc}") from None
        return Antichain.decode(kind, value)


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
