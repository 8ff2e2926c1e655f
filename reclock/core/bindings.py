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
:meth:`Bindings.reclock_arrow`) compile the snapshot once into per-partition
bound arrays and answer with one binary search per record.

**Resumption.** :meth:`Bindings.source_upper_at` turns an IntoTime upper (all
data at times ``< u`` is durable) into the FromTime frontier to resume from:
``R`` of the latest binding before ``u``; before any binding, the first
binding's frontier (the source's initial frontier at ``as_of``; data before it
is never read).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Generic

import numpy as np
import numpy.typing as npt

from reclock.core.errors import BindingError, SinceViolation
from reclock.core.frontier import Antichain
from reclock.core.time import IntoTime, T, is_partitioned, time_type

INT64_MAX = np.iinfo(np.int64).max
#: Sentinel in vectorized results: the record is not bound yet (it waits).
UNBOUND = -1


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
    """An immutable, picklable snapshot of one source's remap collection."""

    kind: str
    since: IntoTime
    upper: Antichain[IntoTime]
    _bs: tuple[Binding[T], ...] | None
    #: (:meth:`from_encoded`) the frontiers as stored, decoded on first use
    _enc: Sequence[list[Any]] | None
    _times: list[int]

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
        time_type(kind)  # validates the kind
        bs = tuple(bindings)
        if upper is None:
            upper_ac: Antichain[IntoTime] = (
                Antichain.from_elem(IntoTime(int(bs[-1].time) + 1))
                if bs
                else Antichain.from_elem(IntoTime(since))
            )
        elif isinstance(upper, Antichain):
            upper_ac = upper
        else:
            upper_ac = Antichain.from_elem(IntoTime(upper))
        since_t = IntoTime(since)
        _validate(kind, bs, since_t, upper_ac, _checked)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "_bs", bs)
        object.__setattr__(self, "_enc", None)
        object.__setattr__(self, "since", since_t)
        object.__setattr__(self, "upper", upper_ac)
        object.__setattr__(self, "_times", [int(b.time) for b in bs])

    @classmethod
    def from_encoded(
        cls, kind: str, rows: Sequence[tuple[int, list[Any]]], *, since: int = 0,
        upper: Antichain[IntoTime] | int | None = None,
    ) -> Bindings[Any]:
        """The snapshot of stored bindings: ``(time, frontier as
        :meth:`Antichain.encode` gave it)``, in time order. A Kafka shard's
        frontiers of points and "every higher partition" elements are
        compiled straight into the reclocking arrays, checked there
        (times increasing within ``[since, upper)``, every partition's bound
        never moving back), and decoded into :class:`Binding` objects only
        when asked for: ``reclock verify`` at 2,048 partitions reclocks
        every row and never looks at a frontier (decoding and comparing 100
        of them took 1.2 s). Anything else is decoded and validated as
        before, which names what is wrong."""
        if upper is None and rows:  # as the constructor makes it: just after the last
            upper = int(rows[-1][0]) + 1
        fast = (_compile_encoded([t for t, _ in rows], [e for _, e in rows])
                if is_partitioned(kind) and rows else None)
        if fast is None or not _fast_valid(fast, int(since), upper):
            return cls(kind, [Binding(IntoTime(t), Antichain.decode(kind, e)) for t, e in rows],
                       since=since, upper=upper)
        b: Bindings[Any] = cls(kind, [], since=since, upper=upper)
        object.__setattr__(b, "_bs", None)
        object.__setattr__(b, "_enc", [e for _, e in rows])
        object.__setattr__(b, "_times", [int(t) for t, _ in rows])
        b.__dict__["_compiled"] = fast
        return b

    @property
    def bindings(self) -> tuple[Binding[T], ...]:
        bs = self._bs
        if bs is None:
            enc = self._enc
            assert enc is not None
            bs = tuple(Binding(IntoTime(t), Antichain.decode(self.kind, e))
                       for t, e in zip(self._times, enc, strict=True))
            object.__setattr__(self, "_bs", bs)
            object.__setattr__(self, "_enc", None)
        return bs

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Bindings is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        # Ship the compiled arrays along when they exist, so that a broadcast
        # snapshot is compiled once on the driver rather than in every task.
        compiled = self.__dict__.get("_compiled")
        return (
            _rebuild_bindings,
            (self.kind, self.bindings, int(self.since), self.upper, compiled),
        )

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Bindings)
            and self.kind == other.kind
            and self.since == other.since
            and self.upper == other.upper
            and self.bindings == other.bindings
        )

    def __hash__(self) -> int:
        return hash((self.kind, self.since, self.upper, self.bindings))

    def __len__(self) -> int:
        return len(self._times)

    def __repr__(self) -> str:
        return (
            f"Bindings({self.kind}, since={int(self.since)}, upper={self.upper!r}, "
            f"{list(self.bindings)!r})"
        )

    # -- derived snapshots ----------------------------------------------------
    def extended(self, new: Sequence[Binding[T]], new_upper: Antichain[IntoTime]) -> Bindings[T]:
        """This snapshot plus bindings appended after it, with the new upper."""
        return Bindings(
            self.kind, self.bindings + tuple(new), since=int(self.since), upper=new_upper,
            _checked=len(self.bindings),
        )

    def covering(self, lower: Antichain[T]) -> Bindings[T]:
        """The bindings a job reading from ``lower`` needs: every position
        ``lower`` contains reclocks as it does here. Bindings whose frontier
        ``lower`` has passed (a prefix: frontiers are monotone) are left out,
        so a job ships what its range needs, not the whole retained history."""
        bs = self.bindings
        k = len(bs)
        while k > 0 and not bs[k - 1].frontier.less_equal(lower):
            k -= 1
        if k == 0:
            return self
        return Bindings(self.kind, bs[k:], since=int(self.since), upper=self.upper,
                        _checked=len(bs) - k)

    def held_from(self, into_upper: int) -> Bindings[T]:
        """The bindings from the latest one before ``into_upper`` on: what
        :meth:`source_upper_at` of ``into_upper`` or later, and the reclocking
        of every position it gives, still read. Equal to :meth:`compacted`
        to that binding's time (nothing to consolidate: the older ones go)."""
        i = bisect.bisect_left(self._times, into_upper) - 1
        if i <= 0:
            return self
        if self._bs is None:  # still as stored: the rest need not be decoded
            assert self._enc is not None
            return Bindings.from_encoded(self.kind, list(zip(self._times[i:], self._enc[i:],
                                                             strict=True)),
                                         since=self._times[i], upper=self.upper)
        bs = self.bindings
        return Bindings(self.kind, bs[i:], since=self._times[i], upper=self.upper,
                        _checked=len(bs) - i)

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
        return Bindings(
            self.kind, compact_bindings(self.bindings, new_since), since=new_since, upper=self.upper
        )

    # -- the frontier as of a time ---------------------------------------------
    @property
    def is_closed(self) -> bool:
        """True when the source finished: the upper is the empty frontier."""
        return self.upper.is_empty()

    @property
    def last(self) -> Binding[T] | None:
        return self.bindings[-1] if self.bindings else None

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
        i = bisect.bisect_right(self._times, into_time)
        return self.bindings[i - 1].frontier if i else None

    # -- reclocking -------------------------------------------------------------
    def _first_not_containing(self, time: T) -> int:
        """Index of the least binding whose frontier does not contain ``time``."""
        lo, hi = 0, len(self.bindings)
        # Monotone bindings: "R(t_i) contains time" holds for a prefix of i.
        while lo < hi:
            mid = (lo + hi) // 2
            if self.bindings[mid].frontier.less_equal_time(time):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def reclock(self, time: T) -> IntoTime | None:
        """The IntoTime of a record at FromTime ``time``, or ``None`` (not bound yet)."""
        i = self._first_not_containing(time)
        return self.bindings[i].time if i < len(self.bindings) else None

    def reclock_frontier(self, frontier: Antichain[T]) -> Antichain[IntoTime]:
        """The IntoTime frontier of a FromTime frontier, element by element.

        Times not bound yet map to the remap upper (future bindings come no
        earlier than it). The empty frontier maps to the empty frontier.
        """
        # The bindings the frontier has passed contain each of its elements
        # (monotone frontiers): the search starts after them. A commit's
        # frontier is near the newest bindings, and at 2,048 partitions each
        # element's search was a dozen containment checks.
        b = self.covering(frontier) if len(self.bindings) > 4 else self
        out: list[IntoTime] = []
        for f in frontier:
            t = b.reclock(f)
            if t is not None:
                out.append(t)
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
        if not self.bindings:
            raise BindingError("no bindings yet: mint the initial (as_of) binding first")
        u = _upper_value(into_upper) if isinstance(into_upper, Antichain) else into_upper
        if u is None:
            if not self.is_closed:
                raise BindingError(
                    "an empty IntoTime upper needs a closed remap collection "
                    f"(upper is {self.upper!r})"
                )
            return self.bindings[-1].frontier
        store_upper = _upper_value(self.upper)
        if store_upper is not None and u > store_upper:
            raise BindingError(
                f"IntoTime upper {u} is beyond the remap upper {store_upper}: "
                "an output cannot be ahead of its bindings"
            )
        i = bisect.bisect_left(self._times, u)
        return self.bindings[i - 1].frontier if i else self.bindings[0].frontier

    # -- vectorized reclocking (data plane) ----------------------------------------
    @cached_property
    def _compiled(self) -> _Compiled:
        return _compile(self)

    def reclock_values(self, values: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Vectorized :meth:`reclock` for totally ordered times (LSNs, counters).

        Returns IntoTimes as int64, :data:`UNBOUND` (-1) where not bound yet.
        """
        if is_partitioned(self.kind):
            raise TypeError(f"use reclock_offsets for partitioned ({self.kind}) times")
        c = self._compiled
        v = np.asarray(values, dtype=np.int64)
        idx = np.searchsorted(c.bounds[0], v, side="right")
        return c.times_ext[idx]

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
        if p.size == 0 or c.nb == 0:
            return np.full(p.shape, UNBOUND, dtype=np.int64)
        pc = np.minimum(p, c.rest_row)
        pmin, pmax = int(pc.min()), int(pc.max())
        if pmin == pmax:
            # One partition: the common case for a task reading one range.
            idx = np.searchsorted(c.bounds[pmin], o, side="right")
            return c.times_ext[idx]
        if c.flat is not None:
            keys = pc * c.stride + np.minimum(o, c.clip)
            flat_idx: npt.NDArray[np.int64] = np.searchsorted(c.flat, keys, side="right")
            res: npt.NDArray[np.int64] = c.times_ext[flat_idx - pc * c.nb]
            return res
        out = np.empty(p.shape, dtype=np.int64)
        for part in np.unique(pc):
            mask = pc == part
            out[mask] = c.times_ext[np.searchsorted(c.bounds[part], o[mask], side="right")]
        return out

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
    kind: str,
    bindings: tuple[Binding[Any], ...],
    since: int,
    upper: Antichain[IntoTime],
    compiled: _Compiled | None = None,
) -> Bindings[Any]:
    # A snapshot validated where it was pickled (the driver): every task that
    # unpickles the broadcast need not walk it again.
    b: Bindings[Any] = Bindings(kind, bindings, since=since, upper=upper,
                                _checked=len(bindings))
    if compiled is not None:
        b.__dict__["_compiled"] = compiled
    return b


def compact_bindings(bindings: Sequence[Binding[T]], new_since: int) -> tuple[Binding[T], ...]:
    """Consolidate bindings before ``new_since``: the latest of them moves to
    ``new_since``, older ones go; later ones stay as they are."""
    times = [int(b.time) for b in bindings]
    i = bisect.bisect_right(times, new_since)
    if i == 0:
        return tuple(bindings)
    head = bindings[i - 1]
    return (Binding(IntoTime(new_since), head.frontier), *bindings[i:])


def _validate(
    kind: str, bs: tuple[Binding[Any], ...], since: IntoTime, upper: Antichain[IntoTime],
    checked: int = 0,
) -> None:
    """The bindings' invariants; the first ``checked`` are known to hold them
    among themselves, so only the others are checked (each against the one
    before it), and the upper against the last."""
    ty = time_type(kind)
    u = _upper_value(upper)
    if u is not None and u < int(since):
        raise BindingError(f"upper {u} is below since {int(since)}")
    checked = max(0, min(checked, len(bs)))
    if checked and u is not None and int(bs[checked - 1].time) >= u:
        raise BindingError(f"binding {bs[checked - 1]!r} is not below the upper {u}")
    prev: Binding[Any] | None = bs[checked - 1] if checked else None
    for b in bs[checked:]:
        if not isinstance(b, Binding):
            raise BindingError(f"not a Binding: {b!r}")
        for e in b.frontier:
            if not isinstance(e, ty):
                raise BindingError(f"binding {b!r}: element {e!r} is not a {kind} time")
        if int(b.time) < int(since):
            raise BindingError(f"binding {b!r} is below since {int(since)}")
        if u is not None and int(b.time) >= u:
            raise BindingError(f"binding {b!r} is not below the upper {u}")
        if prev is not None:
            if int(b.time) <= int(prev.time):
                raise BindingError(
                    f"binding times must increase: {int(prev.time)} then {int(b.time)}"
                )
            if not prev.frontier.less_equal(b.frontier):
                raise BindingError(f"bindings must be monotone: {prev!r} is not <= {b!r}")
        prev = b


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


@dataclass(frozen=True)
class _Compiled:
    """Bound arrays: ``bounds[p][i]`` is the least offset of partition ``p`` that
    ``R(t_i)`` contains (``INT64_MAX`` when none); rows are non-decreasing."""

    nb: int
    bounds: npt.NDArray[np.int64]  # shape (rows, nb)
    times_ext: npt.NDArray[np.int64]  # binding times, then UNBOUND
    rest_row: int  # partitions >= rest_row all share this row
    stride: int
    clip: int
    flat: npt.NDArray[np.int64] | None  # flattened keys for one global search


def _compile(b: Bindings[Any]) -> _Compiled:
    nb = len(b.bindings)
    times_ext = np.empty(nb + 1, dtype=np.int64)
    times_ext[:nb] = b._times
    times_ext[nb] = UNBOUND
    if not is_partitioned(b.kind):
        bounds = np.full((1, nb), INT64_MAX, dtype=np.int64)
        for i, bd in enumerate(b.bindings):
            e = bd.frontier.as_option()
            if e is not None:
                bounds[0, i] = int(e)
        return _Compiled(nb, bounds, times_ext, 0, 0, 0, None)
    # points (one per partition of a Kafka frontier) in one numpy call; the
    # few other elements (every partition above, intervals) span rows
    parts: list[int] = []
    rows: list[int] = []
    offsets: list[int] = []
    spans: list[tuple[int, int | None, int, int]] = []  # lo, hi, binding, offset
    for i, bd in enumerate(b.bindings):
        for e in bd.frontier:
            if e.hi == e.lo:
                parts.append(e.lo)
                rows.append(i)
                offsets.append(e.offset)
            else:
                spans.append((e.lo, e.hi, i, e.offset))
    return _compile_partitioned(times_ext, parts, rows, offsets, spans)


def _compile_encoded(times: list[int], encoded: Sequence[Any]) -> _Compiled | None:
    """:func:`_compile` of partitioned frontiers as stored (lists of ``[lo,
    hi, offset]``), without making their elements; ``None`` unless every
    element is a valid point (``hi == lo``) or "every partition from
    ``lo``" (``hi`` null) with non-negative integers. The checks and the
    columns are C loops (``map``, ``zip``, numpy): 2,049 elements a binding
    at 2,048 partitions."""
    nb = len(encoded)
    times_ext = np.empty(nb + 1, dtype=np.int64)
    times_ext[:nb] = times
    times_ext[nb] = UNBOUND
    parts: list[Any] = []
    rows: list[Any] = []
    offsets: list[Any] = []
    spans: list[tuple[int, int | None, int, int]] = []
    none = type(None)
    for i, enc in enumerate(encoded):
        if type(enc) is not list:
            return None
        if not enc:
            continue
        if set(map(type, enc)) != {list} or set(map(len, enc)) != {3}:
            return None
        los, his, offs = zip(*enc, strict=True)
        if set(map(type, los)) != {int} or set(map(type, offs)) != {int} \
                or not set(map(type, his)) <= {int, none}:
            return None  # (a bool, float or text anywhere)
        lo = np.array(los, dtype=np.int64)
        off = np.array(offs, dtype=np.int64)
        if lo.min() < 0 or off.min() < 0:
            return None
        if his.count(None):
            unbounded = np.fromiter((h is None for h in his), dtype=bool, count=len(his))
            point = ~unbounded
            hi = np.array([h for h in his if h is not None], dtype=np.int64)
            spans += [(int(a), None, i, int(b))
                      for a, b in zip(lo[unbounded], off[unbounded], strict=True)]
            lo, off = lo[point], off[point]
        else:
            hi = np.array(his, dtype=np.int64)
        if not np.array_equal(hi, lo):  # an interval of partitions: the general path
            return None
        parts.append(lo)
        rows.append(np.full(len(lo), i, dtype=np.int64))
        offsets.append(off)
    # The order of frontiers is that of their elements (DESIGN.md): a later
    # frontier's "every partition from lo" element needs an earlier one at
    # or below it; an earlier point is not enough, although it may hold the
    # same positions. (The points are checked by the bounds, in _fast_valid.)
    above: dict[int, list[tuple[int, int]]] = {}
    for lo_, _hi, i, off_ in spans:
        above.setdefault(i, []).append((lo_, off_))
    for i, mine in above.items():
        if i > 0 and not all(any(a <= lo_ and b <= off_ for a, b in above.get(i - 1, ()))
                             for lo_, off_ in mine):
            return None
    return _compile_partitioned(times_ext, parts, rows, offsets, spans)


def _fast_valid(c: _Compiled, since: int, upper: Antichain[IntoTime] | int | None) -> bool:
    """:func:`_validate` on compiled bindings: times increasing within
    ``[since, upper)``, and each frontier at or beyond the one before it:
    no partition's least contained offset ever moves back (with the
    unbounded elements' check in :func:`_compile_encoded`, that is the
    order of frontiers)."""
    times = c.times_ext[:c.nb]
    u = upper if upper is None or isinstance(upper, int) else _upper_value(upper)
    if times[0] < since or (u is not None and (times[-1] >= u or u < since)):
        return False
    return bool(np.all(np.diff(times) > 0) and np.all(c.bounds[:, 1:] >= c.bounds[:, :-1]))


def _ints(xs: list[Any]) -> npt.NDArray[np.int64]:
    """One int64 array of ints, or of int64 arrays."""
    if xs and isinstance(xs[0], np.ndarray):
        return np.concatenate(xs)
    return np.array(xs, dtype=np.int64)


def _compile_partitioned(
    times_ext: npt.NDArray[np.int64], parts: list[Any], rows: list[Any], offsets: list[Any],
    spans: list[tuple[int, int | None, int, int]],
) -> _Compiled:
    nb = len(times_ext) - 1
    p_a = _ints(parts)
    top = max(int(p_a.max()) if p_a.size else 0,
              max((max(lo, hi or 0) for lo, hi, _i, _o in spans), default=0))
    rest = top + 1
    bounds = np.full((rest + 1, nb), INT64_MAX, dtype=np.int64)
    if p_a.size:
        np.minimum.at(bounds, (p_a, _ints(rows)), _ints(offsets))
    for lo, hi, i, off in spans:
        seg = bounds[lo : (rest if hi is None else hi) + 1, i]
        np.minimum(seg, off, out=seg)
    finite = bounds[bounds != INT64_MAX]
    clip = int(finite.max()) + 1 if finite.size else 0
    stride = clip + 2
    flat: npt.NDArray[np.int64] | None = None
    if nb and (rest + 1) * stride < (1 << 62) and (rest + 1) * nb <= 50_000_000:
        capped = np.minimum(bounds, clip + 1)
        flat = (capped + (np.arange(rest + 1, dtype=np.int64) * stride)[:, None]).reshape(-1)
    return _Compiled(nb, bounds, times_ext, rest, stride, clip, flat)


def beyond(kind: str, frontier: Antichain[Any], partitions: npt.ArrayLike,
           offsets: npt.ArrayLike) -> npt.NDArray[np.bool_]:
    """Which positions ``(_src_part, _src_offset)`` the frontier still
    contains, i.e. are not yet durable where ``frontier`` is an output's
    progress. The reclocking rule with one binding ``0 -> frontier``: a
    position maps to 0 exactly when the frontier does not contain it."""
    probe: Bindings[Any] = Bindings(kind, [Binding(IntoTime(0), frontier)], upper=1)
    return np.asarray(probe.reclock_positions(partitions, offsets) == UNBOUND)
