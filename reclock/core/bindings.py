"""Bindings: the remap collection, and applying it (reclocking).

A :class:`Binding` ``t -> R(t)`` says: at IntoTime ``t`` the source's upper was
the FromTime frontier ``R(t)``. A :class:`Bindings` snapshot is an immutable,
picklable copy of a source's remap collection as read back from the remap
store, with the store's ``since`` and ``upper``::

    since <= t_0 < t_1 < ... < t_n < upper         R(t_0) <= R(t_1) <= ... <= R(t_n)

Only bindings at times below ``upper`` exist; the interval ``[since, upper)``
is half-open like every other interval in reclock.

**The reclocking rule.** A record at FromTime ``s`` gets the *least* IntoTime
``t`` such that ``s`` is not beyond ``R(t)`` (no element of ``R(t)`` is
``<= s``). A record no binding covers yet gets ``None``: it waits, it is never
guessed. For one Kafka partition with ``1000 -> {offset 4}``,
``2000 -> {offset 9}``: offsets 0..3 get 1000, 4..8 get 2000, 9 waits.

Reclocking is a pure function of (record time, bindings): executors get a
snapshot (broadcast), never the store. The vectorized forms
(:meth:`Bindings.reclock_offsets`, :meth:`Bindings.reclock_values`,
:meth:`Bindings.reclock_arrow`) compile the snapshot once into each
partition's moves (the bindings at which its least contained offset rises)
and answer with one binary search per record. The frontiers themselves are
held as what changed from one binding to the next
(:mod:`reclock.core.frontier_log`): a day of bindings of a 512-partition
topic is the partitions that moved, not 512 elements a binding.

**Resumption.** :meth:`Bindings.source_upper_at` turns an IntoTime upper (all
data at times ``< u`` is durable) into the FromTime frontier to resume from:
``R`` of the latest binding before ``u``; before any binding, the first
binding's frontier (the source's initial frontier at ``as_of``; data before it
is never read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Generic

import numpy as np
import numpy.typing as npt

from reclock.core.errors import BindingError, SinceViolation
from reclock.core.frontier import Antichain
from reclock.core.frontier_log import UNBOUND, Compiled, Log, builder
from reclock.core.time import IntoTime, T, is_partitioned

__all__ = ["UNBOUND", "Binding", "Bindings", "beyond", "check_appendable"]


@dataclass(frozen=True, slots=True)
class Binding(Generic[T]):
    """``time -> frontier``: at IntoTime ``time`` the source upper was ``frontier``."""

    time: IntoTime
    frontier: Antichain[T]

    def __repr__(self) -> str:
        return f"{int(self.time)} -> {self.frontier!r}"


def _upper_value(upper: Antichain[IntoTime]) -> int | None:
    u = upper.as_option()
    return None if u is None else int(u)


class Bindings(Generic[T]):
    """An immutable, picklable snapshot of one source's remap collection.

    The frontiers are held as what changed from one binding to the next
    (:mod:`reclock.core.frontier_log`): memory, pickles and the reclocking
    search grow with the partitions that moved, not with all of them. A
    frontier is rebuilt when asked for (:attr:`last`, :meth:`frontier_at`,
    :meth:`source_upper_at`); :attr:`bindings` rebuilds them all."""

    kind: str
    since: IntoTime
    upper: Antichain[IntoTime]
    _times: npt.NDArray[np.int64]
    _log: Log

    def __init__(
        self,
        kind: str,
        bindings: Sequence[Binding[T]],
        *,
        since: int = 0,
        upper: Antichain[IntoTime] | int | None = None,
        _checked: int = 0,
    ) -> None:
        """``_checked``: how many leading bindings are known valid already
        (:meth:`extended`, unpickling); only the rest is validated, each
        against the one before it."""
        bs = tuple(bindings)
        b = builder(kind)
        for i, x in enumerate(bs):
            if not isinstance(x, Binding):
                raise BindingError(f"not a Binding: {x!r}")
            b.add(x.frontier, check=i >= _checked)
        self._init(kind, since, upper, np.array([int(x.time) for x in bs], dtype=np.int64),
                   b.log())

    def _init(self, kind: str, since: int, upper: Antichain[IntoTime] | int | None,
              times: npt.NDArray[np.int64], log: Log, checked: int = 0) -> None:
        """Set the snapshot's fields; the times from ``checked`` on are
        checked (increasing, within ``[since, upper)``)."""
        if upper is None:
            upper_ac: Antichain[IntoTime] = Antichain.from_elem(
                IntoTime(int(times[-1]) + 1 if len(times) else since))
        elif isinstance(upper, Antichain):
            upper_ac = upper
        else:
            upper_ac = Antichain.from_elem(IntoTime(upper))
        _check_times(times, int(since), _upper_value(upper_ac), checked)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "since", IntoTime(since))
        object.__setattr__(self, "upper", upper_ac)
        object.__setattr__(self, "_times", times)
        object.__setattr__(self, "_log", log)

    @classmethod
    def _of(cls, kind: str, since: int, upper: Antichain[IntoTime] | int | None,
            times: npt.NDArray[np.int64], log: Log, checked: int = 0) -> Bindings[Any]:
        b: Bindings[Any] = cls.__new__(cls)
        b._init(kind, since, upper, times, log, checked)
        return b

    @classmethod
    def from_log(cls, kind: str, times: Sequence[int] | npt.NDArray[np.int64], log: Log, *,
                 since: int = 0, upper: Antichain[IntoTime] | int | None = None
                 ) -> Bindings[Any]:
        """The snapshot of frontiers a builder of
        :mod:`reclock.core.frontier_log` validated (the remap store reads its
        changes into one); the times are checked here."""
        return cls._of(kind, since, upper, np.asarray(times, dtype=np.int64), log)

    @classmethod
    def from_encoded(
        cls, kind: str, rows: Sequence[tuple[int, list[Any]]], *, since: int = 0,
        upper: Antichain[IntoTime] | int | None = None,
    ) -> Bindings[Any]:
        """The snapshot of whole frontiers as :meth:`Antichain.encode` gave
        them, ``(time, frontier)`` in time order."""
        b = builder(kind)
        for _t, enc in rows:
            b.add_encoded(enc)
        return cls.from_log(kind, [int(t) for t, _ in rows], b.log(), since=since, upper=upper)

    @property
    def bindings(self) -> tuple[Binding[T], ...]:
        """Every binding, its frontier rebuilt whole (kept once asked for):
        for a few bindings, or to show them; the driver and the jobs never
        ask."""
        bs = self.__dict__.get("_bs")
        if bs is None:
            bs = tuple(Binding(IntoTime(t), f) for t, f in
                       zip(self._times.tolist(), self._log.frontiers(), strict=True))
            self.__dict__["_bs"] = bs
        return bs

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Bindings is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        # Ship the compiled search along when it exists, so that a broadcast
        # snapshot is compiled once on the driver rather than in every task.
        return (_rebuild_bindings, (self.kind, int(self.since), self.upper, self._times,
                                    self._log, self.__dict__.get("_compiled")))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Bindings)
            and self.kind == other.kind
            and self.since == other.since
            and self.upper == other.upper
            and np.array_equal(self._times, other._times)
            and self._log.same(other._log)
        )

    def __hash__(self) -> int:
        return hash((self.kind, self.since, self.upper, len(self),
                     int(self._times[-1]) if len(self) else None))

    def __len__(self) -> int:
        return len(self._times)

    def __repr__(self) -> str:
        return (
            f"Bindings({self.kind}, since={int(self.since)}, upper={self.upper!r}, "
            f"{list(self.bindings)!r})"
        )

    # -- derived snapshots ----------------------------------------------------
    def _slice(self, lo: int, *, since: int | None = None, first: int | None = None
               ) -> Bindings[T]:
        """Bindings ``lo`` on (binding ``lo``'s frontier whole), with the
        ``since`` given (else this one) and the first binding moved to
        ``first``."""
        times = self._times[lo:]
        if first is not None and len(times):
            times = times.copy()
            times[0] = first
        return Bindings._of(self.kind, int(self.since) if since is None else since, self.upper,
                            times, self._log.sliced(lo), checked=len(times))

    def extended(self, new: Sequence[Binding[T]], new_upper: Antichain[IntoTime]) -> Bindings[T]:
        """This snapshot plus bindings appended after it, with the new upper:
        only the new ones are checked, each against the one before it."""
        b = self._log.builder()
        for x in new:
            if not isinstance(x, Binding):
                raise BindingError(f"not a Binding: {x!r}")
            b.add(x.frontier)
        times = np.concatenate([self._times, np.array([int(x.time) for x in new],
                                                      dtype=np.int64)])
        log = self._log.appended(b.log()) if new else self._log  # type: ignore[arg-type]
        return Bindings._of(self.kind, int(self.since), new_upper, times, log,
                            checked=len(self))

    def covering(self, lower: Antichain[T]) -> Bindings[T]:
        """The bindings a job reading from ``lower`` needs: every position
        ``lower`` contains reclocks as it does here. Bindings that contain
        every position ``lower`` contains (a prefix: frontiers are monotone)
        are left out, so a job ships what its range needs, not the whole
        retained history."""
        if not len(self):
            return self
        k = self._compiled.passed(self._log.lower_rows(lower))
        return self if k == 0 else self._slice(k)

    def held_from(self, into_upper: int) -> Bindings[T]:
        """The bindings from the latest one before ``into_upper`` on: what
        :meth:`source_upper_at` of ``into_upper`` or later, and the reclocking
        of every position it gives, still read. Equal to :meth:`compacted`
        to that binding's time (nothing to consolidate: the older ones go)."""
        i = int(np.searchsorted(self._times, into_upper, side="left")) - 1
        if i <= 0:
            return self
        return self._slice(i, since=int(self._times[i]))

    def compacted(self, new_since: int) -> Bindings[T]:
        """History before ``new_since`` consolidated into one binding at ``new_since``.

        ``R(t)`` is unchanged for every ``t >= new_since``; records that mapped
        to earlier times now map to ``new_since``.
        """
        if new_since < int(self.since):
            raise SinceViolation(f"cannot move since backwards: {int(self.since)} -> {new_since}")
        u = _upper_value(self.upper)
        if u is not None and new_since >= u:
            raise SinceViolation(f"since {new_since} must stay below the upper {u}")
        i = int(np.searchsorted(self._times, new_since, side="right"))
        if i == 0:
            return self._slice(0, since=new_since)
        return self._slice(i - 1, since=new_since, first=new_since)

    # -- the frontier as of a time ---------------------------------------------
    @property
    def is_closed(self) -> bool:
        """True when the source finished: the upper is the empty frontier."""
        return self.upper.is_empty()

    @property
    def last(self) -> Binding[T] | None:
        if not len(self):
            return None
        last: Binding[T] | None = self.__dict__.get("_last")
        if last is None:
            last = Binding(IntoTime(int(self._times[-1])), self._frontier(len(self) - 1))
            self.__dict__["_last"] = last
        return last

    @property
    def first(self) -> Binding[T] | None:
        """The earliest binding kept: the source's initial frontier at
        ``as_of`` until history is compacted, then the binding at ``since``."""
        if not len(self):
            return None
        return Binding(IntoTime(int(self._times[0])), self._frontier(0))

    def _frontier(self, i: int) -> Antichain[T]:
        if i == len(self) - 1 and "_last" in self.__dict__:
            return self.__dict__["_last"].frontier  # type: ignore[no-any-return]
        bs = self.__dict__.get("_bs")
        return bs[i].frontier if bs is not None else self._log.frontier(i)

    def frontier_at(self, into_time: int) -> Antichain[T] | None:
        """``R(into_time)``: the source frontier as of IntoTime ``into_time``.

        ``None`` before the first binding. Raises when ``into_time`` is below
        ``since`` (compacted away) or not below ``upper`` (not decided yet).
        """
        if into_time < int(self.since):
            raise SinceViolation(
                f"IntoTime {into_time} is below since {int(self.since)}: history compacted"
            )
        u = _upper_value(self.upper)
        if u is not None and into_time >= u:
            raise BindingError(f"IntoTime {into_time} is not below the remap upper {u} yet")
        i = int(np.searchsorted(self._times, into_time, side="right"))
        return self._frontier(i - 1) if i else None

    # -- reclocking -------------------------------------------------------------
    def reclock(self, time: T) -> IntoTime | None:
        """The IntoTime of a record at FromTime ``time``, or ``None`` (not bound yet)."""
        i = self._log.first_not_containing(time, self._compiled)
        return IntoTime(int(self._times[i])) if i < len(self) else None

    def reclock_frontier(self, frontier: Antichain[T]) -> Antichain[IntoTime]:
        """The IntoTime frontier of a FromTime frontier, element by element.

        Times not bound yet map to the remap upper (future bindings come no
        earlier than it). The empty frontier maps to the empty frontier.
        """
        # The points (all but one element of a Kafka frontier) are searched
        # at once; the others by the order of elements (docs/design.md,
        # "FromTime and IntoTime"), among the few elements that are not points.
        elements: list[Any] = list(frontier)
        part = is_partitioned(self.kind)
        points = [e for e in elements if part and e.hi == e.lo]
        rest = [e for e in elements if not (part and e.hi == e.lo)]
        c = self._compiled
        found: list[int] = []
        if points:
            found += c.first_above(np.array([e.lo for e in points], dtype=np.int64),
                                   np.array([e.offset for e in points], dtype=np.int64)).tolist()
        found += [self._log.first_not_containing(e, c) for e in rest]
        out: list[IntoTime] = []
        for i in set(found):
            if i < len(self):
                out.append(IntoTime(int(self._times[i])))
            else:
                out.extend(self.upper)
        return Antichain(out)

    def source_upper_at(self, into_upper: Antichain[IntoTime] | int) -> Antichain[T]:
        """The FromTime frontier to resume from, given the IntoTime upper ``into_upper``.

        All data at IntoTimes ``< into_upper`` is durable; that is exactly the
        data at FromTimes not in ``R(t*)`` for the latest binding ``t* <
        into_upper``. Before any binding: the first binding's frontier. The
        empty IntoTime upper (everything durable) gives the last frontier.
        """
        if not len(self):
            raise BindingError("no bindings yet: mint the initial (as_of) binding first")
        u = _upper_value(into_upper) if isinstance(into_upper, Antichain) else into_upper
        if u is None:
            if not self.is_closed:
                raise BindingError(
                    "an empty IntoTime upper needs a closed remap collection "
                    f"(upper is {self.upper!r})"
                )
            return self._frontier(len(self) - 1)
        store_upper = _upper_value(self.upper)
        if store_upper is not None and u > store_upper:
            raise BindingError(
                f"IntoTime upper {u} is beyond the remap upper {store_upper}: "
                "an output cannot be ahead of its bindings"
            )
        i = int(np.searchsorted(self._times, u, side="left"))
        return self._frontier(i - 1 if i else 0)

    # -- vectorized reclocking (data plane) ----------------------------------------
    @cached_property
    def _compiled(self) -> Compiled:
        return self._log.compile(self._times)

    def reclock_values(self, values: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Vectorized :meth:`reclock` for totally ordered times (LSNs, counters).

        Returns IntoTimes as int64, :data:`UNBOUND` (-1) where not bound yet.
        """
        if is_partitioned(self.kind):
            raise TypeError(f"use reclock_offsets for partitioned ({self.kind}) times")
        c = self._compiled
        v = np.asarray(values, dtype=np.int64)
        return c.times_of(c.first_above(np.zeros(v.shape, dtype=np.int64), v))

    def reclock_offsets(
        self, partitions: npt.ArrayLike, offsets: npt.ArrayLike
    ) -> npt.NDArray[np.int64]:
        """Vectorized :meth:`reclock` for Kafka records at ``(partition, offset)``.

        Returns IntoTimes as int64, :data:`UNBOUND` (-1) where not bound yet.
        """
        if not is_partitioned(self.kind):
            raise TypeError(f"reclock_offsets needs partitioned bindings, these are {self.kind}")
        c = self._compiled
        p = np.asarray(partitions, dtype=np.int64)
        o = np.asarray(offsets, dtype=np.int64)
        if p.shape != o.shape:
            raise ValueError(f"partitions {p.shape} and offsets {o.shape} differ in shape")
        return c.times_of(c.first_above(p, o))

    def reclock_positions(
        self, partitions: npt.ArrayLike, offsets: npt.ArrayLike
    ) -> npt.NDArray[np.int64]:
        """IntoTimes of records at their ``(_src_part, _src_offset)``
        positions, whatever the time kind (totally ordered times ignore the
        partition); :data:`UNBOUND` (-1) where not bound yet."""
        if is_partitioned(self.kind):
            return self.reclock_offsets(partitions, offsets)
        return self.reclock_values(offsets)

    def reclock_arrow(self, *columns: Any) -> Any:
        """Vectorized reclocking over Arrow arrays, returning an Arrow int64 array
        with nulls for records not bound yet.

        Kafka: ``reclock_arrow(partition_array, offset_array)``; total orders:
        ``reclock_arrow(time_array)``.
        """
        import pyarrow as pa

        arrays = [
            np.asarray(c.to_numpy(zero_copy_only=False))
            if hasattr(c, "to_numpy")
            else np.asarray(c)
            for c in columns
        ]
        if is_partitioned(self.kind):
            if len(arrays) != 2:
                raise TypeError(f"{self.kind} reclock_arrow takes (partitions, offsets)")
            res = self.reclock_offsets(arrays[0], arrays[1])
        else:
            if len(arrays) != 1:
                raise TypeError(f"{self.kind} reclock_arrow takes one time column")
            res = self.reclock_values(arrays[0])
        out: Any = pa.array(res, type=pa.int64(), mask=res == UNBOUND)
        return out


def _rebuild_bindings(
    kind: str, since: int, upper: Antichain[IntoTime], times: npt.NDArray[np.int64], log: Log,
    compiled: Compiled | None = None,
) -> Bindings[Any]:
    # A snapshot validated where it was pickled (the driver): every task that
    # unpickles the broadcast need not check it again.
    b: Bindings[Any] = Bindings._of(kind, since, upper, times, log, checked=len(times))
    if compiled is not None:
        b.__dict__["_compiled"] = compiled
    return b


def _check_times(times: npt.NDArray[np.int64], since: int, upper: int | None,
                 checked: int = 0) -> None:
    """Binding times increasing within ``[since, upper)``; those before
    ``checked`` are known to be (only the one before the rest is compared)."""
    if upper is not None and upper < since:
        raise BindingError(f"upper {upper} is below since {since}")
    n = len(times)
    if not n:
        return
    if upper is not None and int(times[-1]) >= upper:
        raise BindingError(f"binding at {int(times[-1])} is not below the upper {upper}")
    k = max(0, min(checked, n) - 1)
    tail = times[k:]
    if int(tail.min()) < since:
        raise BindingError(f"binding at {int(tail.min())} is below since {since}")
    steps = np.diff(tail)
    if len(steps) and int(steps.min()) <= 0:
        j = int(np.argmax(steps <= 0))
        raise BindingError(
            f"binding times must increase: {int(tail[j])} then {int(tail[j + 1])}")


def check_appendable(
    existing: Bindings[T], new: Sequence[Binding[T]], new_upper: Antichain[IntoTime]
) -> None:
    """Raises :class:`BindingError` unless ``new`` may follow ``existing``:
    times in ``[existing.upper, new_upper)``, increasing, frontiers monotone, and
    the upper moving forward."""
    old_u = _upper_value(existing.upper)
    if old_u is None:
        raise BindingError("the remap collection is closed (empty upper); nothing may follow")
    new_u = _upper_value(new_upper)
    if new_u is not None and new_u <= old_u:
        raise BindingError(f"the upper must advance: {old_u} -> {new_u}")
    for b in new:
        if int(b.time) < old_u:
            raise BindingError(f"binding {b!r} is below the current upper {old_u}")
    existing.extended(new, new_upper)  # full validation


def beyond(kind: str, frontier: Antichain[Any], partitions: npt.ArrayLike,
           offsets: npt.ArrayLike) -> npt.NDArray[np.bool_]:
    """Which positions ``(_src_part, _src_offset)`` the frontier still
    contains, i.e. are not yet durable where ``frontier`` is an output's
    progress. The reclocking rule with one binding ``0 -> frontier``: a
    position maps to 0 exactly when the frontier does not contain it."""
    probe: Bindings[Any] = Bindings(kind, [Binding(IntoTime(0), frontier)], upper=1)
    return np.asarray(probe.reclock_positions(partitions, offsets) == UNBOUND)
