"""Timestamp types: the two clocks of reclock.

* **IntoTime** -- system time, milliseconds since the epoch, a total order. The
  only clock outputs expose.
* **FromTime** -- a source's own notion of progress:

  - :class:`Lsn` -- a Postgres WAL position (total order; a transaction is
    stamped at its commit LSN).
  - :class:`Counter` -- a generator's counter (total order).
  - :class:`Partitioned` -- Kafka's partitioned offsets, a *partial* order.
    An element is an interval of partition ids together with an offset.
    ``(p..p, o)`` is a point (partition ``p`` at offset ``o``);
    ``(lo.., 0)`` stands for every partition ``>= lo`` at offset 0. ``a <= b``
    when ``a``'s interval contains ``b``'s and ``a.offset <= b.offset``. A
    Kafka frontier holds one point per known partition plus ``(max+1.., 0)``,
    so that a partition appearing later is covered from offset 0.
  - :class:`Gtid` -- MariaDB's GTID position: the same partial order and
    implementation as :class:`Partitioned`, with the replication domain as
    the partition and the sequence number as the offset; a kind of its own
    (``gtid``) so that it renders as GTIDs and is not taken for Kafka's.

A second partitioned clock is a subclass of :class:`Partitioned` with its
own ``KIND`` (and ``render``), registered in :data:`TIME_KINDS`; the core
asks :func:`is_partitioned`, never for a kind by name.

Every type is an immutable value with ``less_equal``, ``join`` (least upper
bound, ``None`` when the two have no common upper bound), ``meet`` (greatest
lower bound), a ``sort_key`` for canonical ordering, and a stable
``encode``/``decode`` pair (JSON-compatible values) for stores and files.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Self, TypeVar

from reclock.core.errors import InvalidTimeError

JSON = Any

#: The largest value a 64-bit unsigned position holds (a partition id range's open end).
U64_MAX = (1 << 64) - 1


class Timestamp(Protocol):
    """What every time type offers; ``Antichain`` is generic over it."""

    KIND: ClassVar[str]

    def less_equal(self, other: Self) -> bool:
        """True when ``self <= other`` in the (partial) order."""
        ...

    def join(self, other: Self) -> Self | None:
        """Least upper bound, or ``None`` when there is no common upper bound."""
        ...

    def meet(self, other: Self) -> Self:
        """Greatest lower bound."""
        ...

    def sort_key(self) -> tuple[int, ...]:
        """A linear extension of the order (``a <= b`` implies
        ``a.sort_key() <= b.sort_key()``): canonical listings, and finding the
        minimal elements of a set in one pass."""
        ...

    def encode(self) -> JSON:
        """A stable JSON-compatible form; ``decode(encode(t)) == t``."""
        ...

    @classmethod
    def decode(cls, value: JSON) -> Self:
        """Inverse of :meth:`encode`; raises :class:`InvalidTimeError`."""
        ...

    @classmethod
    def minimum(cls) -> Self:
        """The least time: every other time is ``>=`` it."""
        ...

    @classmethod
    def render(cls, encoded: list[JSON]) -> str:
        """A human form of the encoded elements of a frontier of this type."""
        ...

    @classmethod
    def position(cls, frontier: Iterable[Self]) -> float:
        """One number that grows as a (non-empty) frontier advances."""
        ...

    @classmethod
    def distance(cls, behind: Iterable[Self], ahead: Iterable[Self]) -> int:
        """Positions between two non-empty frontiers (``behind <= ahead``)."""
        ...

    @classmethod
    def partitions(cls, frontier: Iterable[Self]) -> tuple[dict[int, int], int | None] | None:
        """Per-partition next offsets of a partitioned frontier, and the first
        partition its open-ended element covers; ``None`` for total orders."""
        ...


T = TypeVar("T", bound=Timestamp)


class _TotalTime(int):
    """Base of the totally ordered times: an immutable non-negative int."""

    KIND: ClassVar[str] = "total"
    __slots__ = ()

    def __new__(cls, value: int = 0) -> Self:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidTimeError(f"{cls.__name__} must be an integer, got {value!r}")
        if value < 0 or value > U64_MAX:
            raise InvalidTimeError(f"{cls.__name__} out of range: {value}")
        return super().__new__(cls, value)

    def less_equal(self, other: Self) -> bool:
        return int(self) <= int(other)

    def join(self, other: Self) -> Self:
        return self if int(self) >= int(other) else other

    def meet(self, other: Self) -> Self:
        return self if int(self) <= int(other) else other

    def sort_key(self) -> tuple[int, ...]:
        return (int(self),)

    def encode(self) -> JSON:
        return int(self)

    @classmethod
    def decode(cls, value: JSON) -> Self:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidTimeError(f"cannot decode {cls.__name__} from {value!r}")
        return cls(value)

    @classmethod
    def minimum(cls) -> Self:
        return cls(0)

    @classmethod
    def render(cls, encoded: list[JSON]) -> str:
        """A human form of an encoded frontier's elements: ``{v, ...}``."""
        return "{" + ", ".join(str(e) for e in encoded) + "}"

    @classmethod
    def position(cls, frontier: Iterable[Self]) -> float:
        return float(int(min(frontier)))

    @classmethod
    def distance(cls, behind: Iterable[Self], ahead: Iterable[Self]) -> int:
        return max(0, int(min(ahead)) - int(min(behind)))

    @classmethod
    def partitions(cls, frontier: Iterable[Self]) -> tuple[dict[int, int], int | None] | None:
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({int(self)})"


class IntoTime(_TotalTime):
    """System time in milliseconds since the Unix epoch."""

    KIND = "into"
    __slots__ = ()

    def __str__(self) -> str:
        return str(int(self))


class Counter(_TotalTime):
    """A generator's counter: record ``n`` is at time ``n``."""

    KIND = "counter"
    __slots__ = ()


_LSN_RE = re.compile(r"^([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})$")


class Lsn(_TotalTime):
    """A Postgres WAL log sequence number; encodes as Postgres's ``X/Y`` text."""

    KIND = "lsn"
    __slots__ = ()

    def encode(self) -> JSON:
        return f"{int(self) >> 32:X}/{int(self) & 0xFFFFFFFF:X}"

    @classmethod
    def decode(cls, value: JSON) -> Self:
        if isinstance(value, str):
            m = _LSN_RE.match(value)
            if not m:
                raise InvalidTimeError(f"not a Postgres LSN (expected 'X/Y' hex): {value!r}")
            return cls((int(m.group(1), 16) << 32) | int(m.group(2), 16))
        return super().decode(value)

    @classmethod
    def parse(cls, text: str) -> Lsn:
        """Parse Postgres's ``X/Y`` text form."""
        return cls.decode(text)

    def __str__(self) -> str:
        return str(self.encode())


def trusted_element(cls: type[P], lo: int, hi: int | None, offset: int) -> P:
    """A ``cls`` (a subclass of :class:`Partitioned`) of valid values, without checks."""
    p = object.__new__(cls)
    _SET(p, "lo", lo)
    _SET(p, "hi", hi)
    _SET(p, "offset", offset)
    return p


def _partitioned(lo: int, hi: int | None, offset: int) -> Partitioned:
    """A :class:`Partitioned` that was valid when pickled, without checks."""
    p = object.__new__(Partitioned)
    _SET(p, "lo", lo)
    _SET(p, "hi", hi)
    _SET(p, "offset", offset)
    return p


_SET = object.__setattr__


@dataclass(frozen=True, slots=True)
class Partitioned:
    """Kafka time: an interval of partitions ``[lo, hi]`` (``hi=None``: no upper
    bound) at an ``offset``.

    Points ``Partitioned.point(p, o)`` are the times of records; intervals
    appear in frontiers, where ``Partitioned.above(n)`` covers every partition
    ``>= n`` from offset 0.
    """

    lo: int
    hi: int | None
    offset: int

    KIND: ClassVar[str] = "kafka"

    def __post_init__(self) -> None:
        for name, v in (("lo", self.lo), ("offset", self.offset)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidTimeError(f"Partitioned.{name} must be an int >= 0, got {v!r}")
        if self.hi is not None and (
            isinstance(self.hi, bool) or not isinstance(self.hi, int) or self.hi < self.lo
        ):
            raise InvalidTimeError(
                f"Partitioned.hi must be None or an int >= lo={self.lo}, got {self.hi!r}"
            )

    @classmethod
    def point(cls, partition: int, offset: int) -> Self:
        return cls(partition, partition, offset)

    @classmethod
    def above(cls, partition: int) -> Self:
        """Every partition ``>= partition``, at offset 0."""
        return cls(partition, None, 0)

    @property
    def is_point(self) -> bool:
        return self.hi == self.lo

    def covers(self, partition: int) -> bool:
        return self.lo <= partition and (self.hi is None or partition <= self.hi)

    def less_equal(self, other: Partitioned) -> bool:
        if self.offset > other.offset or self.lo > other.lo:
            return False
        if self.hi is None:
            return True
        return other.hi is not None and other.hi <= self.hi

    def join(self, other: Self) -> Self | None:
        lo = max(self.lo, other.lo)
        if self.hi is None:
            hi = other.hi
        elif other.hi is None:
            hi = self.hi
        else:
            hi = min(self.hi, other.hi)
        if hi is not None and hi < lo:
            return None
        return type(self)(lo, hi, max(self.offset, other.offset))

    def meet(self, other: Self) -> Self:
        hi = None if self.hi is None or other.hi is None else max(self.hi, other.hi)
        return type(self)(min(self.lo, other.lo), hi, min(self.offset, other.offset))

    def sort_key(self) -> tuple[int, ...]:
        # Offset first, then lower bound, then the widest interval first: if
        # a <= b, each component of a's key is <= b's in turn.
        return (self.offset, self.lo, -(U64_MAX if self.hi is None else self.hi))

    def encode(self) -> JSON:
        return [self.lo, self.hi, self.offset]

    def __reduce__(self) -> tuple[Any, ...]:
        # A frozen slotted dataclass unpickles through dataclasses' generic
        # __setstate__ (5 us each); a broadcast snapshot at 2,048 partitions
        # holds 200,000 of them per 100 bindings.
        return (_partitioned, (self.lo, self.hi, self.offset))

    @classmethod
    def decode(cls, value: JSON) -> Self:
        if not (isinstance(value, list | tuple) and len(value) == 3):
            raise InvalidTimeError(f"cannot decode {cls.__name__} from {value!r}")
        lo, hi, offset = value
        if (type(lo) is int and type(offset) is int and lo >= 0 and offset >= 0
                and (hi is None or (type(hi) is int and hi >= lo))):
            if cls is Partitioned:
                return _partitioned(lo, hi, offset)  # type: ignore[return-value]  # valid: no checks
            return trusted_element(cls, lo, hi, offset)
        return cls(lo, hi, offset)  # raises, naming what is wrong

    @classmethod
    def minimum(cls) -> Self:
        return cls(0, None, 0)

    @classmethod
    def position(cls, frontier: Iterable[Partitioned]) -> float:
        return float(sum(kafka_offsets(frontier)[0].values()))

    @classmethod
    def distance(cls, behind: Iterable[Partitioned], ahead: Iterable[Partitioned]) -> int:
        lo, _ = kafka_offsets(behind)
        hi, _ = kafka_offsets(ahead)
        return sum(max(0, o - lo.get(p, 0)) for p, o in hi.items())

    @classmethod
    def partitions(cls, frontier: Iterable[Partitioned]) -> tuple[dict[int, int], int | None]:
        return kafka_offsets(frontier)

    @classmethod
    def render(cls, encoded: list[JSON]) -> str:
        """``{partition: offset, ...; >=N: 0}`` of an encoded Kafka frontier
        (each element as :meth:`label` names it, by partition)."""
        return "{" + ", ".join(cls.label(lo, hi, off) for lo, hi, off
                               in sorted(encoded, key=lambda e: (e[0], e[2]))) + "}"

    @staticmethod
    def label(lo: int, hi: int | None, off: int) -> str:
        """One encoded element: ``p:offset``, ``lo-hi:offset`` or ``>=lo:offset``."""
        if hi is None:
            return f">={lo}:{off}"
        return f"{lo}:{off}" if lo == hi else f"{lo}-{hi}:{off}"

    def __repr__(self) -> str:
        if self.hi is None:
            return f"P({self.lo}..:{self.offset})"
        if self.is_point:
            return f"P({self.lo}:{self.offset})"
        return f"P({self.lo}..{self.hi}:{self.offset})"


P = TypeVar("P", bound=Partitioned)


def _gtid(lo: int, hi: int | None, offset: int) -> Gtid:
    return trusted_element(Gtid, lo, hi, offset)


@dataclass(frozen=True, slots=True)
class Gtid(Partitioned):
    """MariaDB's GTID position (``sources/mysql/gtid.py``): a
    :class:`Partitioned` time whose partition is the replication domain and
    whose offset is a sequence number; a transaction ``d-s-n`` is the point
    ``(d, n)``, and a frontier names each domain's next sequence number plus
    an element for the domains not seen yet. Only the kind and the rendering
    differ from Kafka's time."""

    KIND: ClassVar[str] = "gtid"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_gtid, (self.lo, self.hi, self.offset))

    @staticmethod
    def label(lo: int, hi: int | None, off: int) -> str:
        """``domain 0: seq 58``, ``domains >=1: from the start``: each
        domain's next sequence number (``seq 58``: the transactions ``0-*-1``
        to ``0-*-57`` are before it)."""
        at = "from the start" if off <= 1 else f"seq {off}"
        if hi is None:
            return f"domains >={lo}: {at}"
        return f"domain {lo}: {at}" if lo == hi else f"domains {lo}-{hi}: {at}"

    def __repr__(self) -> str:
        return "G" + Partitioned.__repr__(self)[1:]


TIME_KINDS: dict[str, type[Any]] = {
    IntoTime.KIND: IntoTime,
    Counter.KIND: Counter,
    Lsn.KIND: Lsn,
    Partitioned.KIND: Partitioned,
    Gtid.KIND: Gtid,
}


def time_type(kind: str) -> type[Any]:
    """The time type registered under ``kind`` (``into``, ``counter``, ``lsn``,
    ``kafka``, ``gtid``)."""
    try:
        return TIME_KINDS[kind]
    except KeyError:
        raise InvalidTimeError(
            f"unknown time kind {kind!r}; expected one of {sorted(TIME_KINDS)}"
        ) from None


def encoded_canonical(kind: str) -> Callable[[list[JSON]], list[JSON]]:
    """The encoded elements of a minimal frontier of ``kind`` in the order
    :meth:`Antichain.encode` gives them (by :meth:`sort_key`), read off the
    encoding: a partitioned frontier by ``(offset, lo, widest first)``, a
    total order's (at most one element) as it is."""
    if not is_partitioned(kind):
        return list
    return lambda enc: sorted(enc, key=lambda e: (e[2], e[0], -(U64_MAX if e[1] is None else e[1])))


def is_partitioned(kind: str) -> bool:
    """Whether times of ``kind`` are partitioned (:class:`Partitioned` or a
    subclass: per-partition offsets, ``(_src_part, _src_offset)`` positions),
    as opposed to a total order."""
    ty = TIME_KINDS.get(kind)
    return ty is not None and issubclass(ty, Partitioned)


def kafka_offsets(frontier: Any) -> tuple[dict[int, int], int | None]:
    """The per-partition next offsets of a Kafka frontier, and the first
    partition covered by the open-ended "above" element (``None`` if absent).

    Only points and the "above" element are resolved; an interval element
    covering a finite range (which only appears after ``meet``) is expanded.
    """
    return _offsets((e.lo, e.hi, e.offset) for e in frontier)


def encoded_kafka_offsets(encoded: Any) -> tuple[dict[int, int], int | None] | None:
    """:func:`kafka_offsets` of a frontier in :meth:`Antichain.encode`'s form,
    without decoding it (status documents, metrics and charts read many of
    them each second); ``None`` when it is not one."""
    if not isinstance(encoded, list):
        return None
    try:
        return _offsets((int(lo), None if hi is None else int(hi), int(off))
                        for lo, hi, off in encoded)
    except (TypeError, ValueError):
        return None


def _offsets(elements: Iterable[tuple[int, int | None, int]]
             ) -> tuple[dict[int, int], int | None]:
    offsets: dict[int, int] = {}
    above: int | None = None
    get = offsets.get
    for lo, hi, off in elements:
        if hi == lo:  # a point: one per partition in a Kafka frontier
            if off < get(lo, off + 1):
                offsets[lo] = off
        elif hi is None:
            above = lo if above is None else min(above, lo)
        else:
            for p in range(lo, hi + 1):
                offsets[p] = min(get(p, off), off)
    if above is not None:
        offsets = {p: o for p, o in offsets.items() if p < above}
    return offsets, above
