"""Capture and replay: how data crosses from the FromTime side to the IntoTime side.

The capture/replay protocol (docs/design.md, "Capture and replay") as a
reference model: counted capabilities (:class:`ChangeBatch`,
:class:`MutableAntichain`, like timely dataflow's progress tracking) and the
event streams built on them.
The product does not use it (its sources report frontiers, never counts), so
it lives with the tests that check the protocol's rules.

A captured stream is a sequence of events::

    Message(time, batch)        records at ``time``
    Progress([(time, delta)])   changes to the capabilities the writer holds

Starting from the minimum time with count 1, a stream is valid when

* rule ``progress-in-advance``: a Progress may only add counts at times in
  advance of (``>=``) a time whose count is positive before that event;
* rule ``message-in-advance``: a Message may only use a time in advance of a
  positive count;
* rule ``release-held``: a Progress may not release a capability the stream
  does not hold (no count goes below zero).

A Message may move arbitrarily earlier and a Progress arbitrarily later, but a
Progress that releases the last capability may not move before a Message that
needs it. Any interleaving of valid streams is valid, so streams captured from
N writers replay on M readers: :func:`interleave` merges streams (adding
``N - 1`` counts at the minimum up front), :func:`split` assigns streams to
readers, and :func:`replay` rebuilds each reader's collection and frontier;
the union over readers equals the original.
"""

from __future__ import annotations

import json
import random
from collections import Counter as Multiset
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TextIO

from reclock.core.errors import DefiniteError, InvalidTimeError
from reclock.core.frontier import Antichain
from reclock.core.time import T, time_type


class InvalidEventStream(DefiniteError):
    """A captured event stream breaks the capture/replay protocol.

    ``index`` is the position of the offending event in its stream, ``rule``
    names the broken rule.
    """

    def __init__(self, index: int, event: object, rule: str, detail: str) -> None:
        self.index = index
        self.event = event
        self.rule = rule
        super().__init__(f"event #{index} {event!r} breaks rule '{rule}': {detail}")


class ChangeBatch(Generic[T]):
    """A consolidating collection of ``(time, diff)`` updates."""

    __slots__ = ("_counts",)

    def __init__(self, updates: Iterable[tuple[T, int]] = ()) -> None:
        self._counts: dict[T, int] = {}
        self.extend(updates)

    def update(self, time: T, diff: int) -> None:
        if diff == 0:
            return
        n = self._counts.get(time, 0) + diff
        if n == 0:
            del self._counts[time]
        else:
            self._counts[time] = n

    def extend(self, updates: Iterable[tuple[T, int]]) -> None:
        for t, d in updates:
            self.update(t, d)

    def is_empty(self) -> bool:
        return not self._counts

    def __len__(self) -> int:
        return len(self._counts)

    def get(self, time: T) -> int:
        return self._counts.get(time, 0)

    def items(self) -> list[tuple[T, int]]:
        """The consolidated updates, non-zero diffs only, in canonical order."""
        return sorted(self._counts.items(), key=lambda kv: kv[0].sort_key())

    def drain(self) -> list[tuple[T, int]]:
        out = self.items()
        self._counts.clear()
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChangeBatch) and self._counts == other._counts

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ChangeBatch({self.items()!r})"


class MutableAntichain(Generic[T]):
    """Counts per time, and the frontier of the times whose count is positive.

    Counts may go negative transiently (updates arriving out of order), but
    only positive counts hold the frontier back. :meth:`update_iter` applies
    updates and returns the discrete changes of the frontier.
    """

    __slots__ = ("_counts", "_frontier")

    def __init__(self, initial: Iterable[tuple[T, int]] = ()) -> None:
        self._counts: ChangeBatch[T] = ChangeBatch(initial)
        self._frontier: Antichain[T] = self._rebuild()

    @classmethod
    def new_bottom(cls, bottom: T) -> MutableAntichain[T]:
        """Starts with count 1 at ``bottom`` (a source's minimum capability)."""
        return cls([(bottom, 1)])

    def _rebuild(self) -> Antichain[T]:
        return Antichain(t for t, c in self._counts.items() if c > 0)

    def frontier(self) -> Antichain[T]:
        return self._frontier

    def less_equal(self, time: T) -> bool:
        """True when the frontier contains ``time``."""
        return self._frontier.less_equal_time(time)

    def less_than(self, time: T) -> bool:
        return self._frontier.less_than_time(time)

    def count_for(self, time: T) -> int:
        return self._counts.get(time)

    def is_empty(self) -> bool:
        return self._frontier.is_empty()

    def counts(self) -> list[tuple[T, int]]:
        return self._counts.items()

    def update_iter(self, updates: Iterable[tuple[T, int]]) -> list[tuple[T, int]]:
        """Apply ``updates``; return the frontier's changes, consolidated.

        The frontier is recomputed only when an update could move it: a
        positive count at a time not already beyond the frontier, or a
        decrement at a time on the frontier.
        """
        rebuild = False
        for t, d in updates:
            if d == 0:
                continue
            before = self._counts.get(t)
            self._counts.update(t, d)
            after = before + d
            if (before > 0) != (after > 0):
                if after > 0:
                    # A newly positive time moves the frontier unless a time
                    # already on the frontier is <= it.
                    if not self._frontier.less_equal_time(t):
                        rebuild = True
                elif t in self._frontier.elements:
                    rebuild = True
        if not rebuild:
            return []
        old = self._frontier
        new = self._rebuild()
        self._frontier = new
        changes: ChangeBatch[T] = ChangeBatch()
        for t in old:
            changes.update(t, -1)
        for t in new:
            changes.update(t, 1)
        return changes.items()

    def __repr__(self) -> str:
        return f"MutableAntichain(frontier={self._frontier!r}, counts={self._counts.items()!r})"



@dataclass(frozen=True, slots=True)
class Message(Generic[T]):
    """Records ``batch`` at ``time``."""

    time: T
    batch: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Progress(Generic[T]):
    """Capability changes ``(time, delta)``."""

    updates: tuple[tuple[T, int], ...]


Event = Message[Any] | Progress[Any]


@dataclass
class StreamState(Generic[T]):
    """What a validator or a reader holds after some events."""

    capabilities: MutableAntichain[T]
    collection: Multiset[tuple[Any, Any]] = field(default_factory=Multiset)
    events: int = 0


def _start(minimum: T, count: int = 1) -> MutableAntichain[T]:
    return MutableAntichain([(minimum, count)])


def _apply(state: StreamState[T], index: int, ev: Event) -> None:
    caps = state.capabilities
    if isinstance(ev, Message):
        if not caps.less_equal(ev.time):
            raise InvalidEventStream(
                index,
                ev,
                "message-in-advance",
                f"no held capability <= {ev.time!r} (frontier {caps.frontier()!r})",
            )
        for rec in ev.batch:
            state.collection[(rec, ev.time)] += 1
    elif isinstance(ev, Progress):
        for t, d in ev.updates:
            if d > 0 and not caps.less_equal(t):
                raise InvalidEventStream(
                    index,
                    ev,
                    "progress-in-advance",
                    f"adds {d} at {t!r}, not in advance of a held capability "
                    f"(frontier {caps.frontier()!r})",
                )
        caps.update_iter(ev.updates)
        for t, d in ev.updates:
            if d < 0 and caps.count_for(t) < 0:
                raise InvalidEventStream(
                    index,
                    ev,
                    "release-held",
                    f"releases {-d} at {t!r} but only held {caps.count_for(t) - d}",
                )
    else:
        raise InvalidEventStream(index, ev, "event-type", "neither Message nor Progress")
    state.events += 1


def validate(events: Iterable[Event], minimum: T, initial_count: int = 1) -> StreamState[T]:
    """Check ``events`` against the protocol; return the final state.

    Raises :class:`~reclock.core.errors.InvalidEventStream` naming the first
    offending event, its index and the rule it breaks.
    """
    state: StreamState[T] = StreamState(_start(minimum, initial_count))
    for i, ev in enumerate(events):
        _apply(state, i, ev)
    return state


class Capture(Generic[T]):
    """Records what a writer presents: data at held times, capability changes.

    ``send`` records a message; ``downgrade`` moves the held frontier forward
    (emitting the discrete changes as Progress); ``close`` releases everything.
    """

    def __init__(self, minimum: T) -> None:
        self.events: list[Event] = []
        self._caps: MutableAntichain[T] = _start(minimum)

    @property
    def frontier(self) -> Antichain[T]:
        return self._caps.frontier()

    def send(self, time: T, batch: Sequence[Any]) -> None:
        if not self._caps.less_equal(time):
            raise InvalidEventStream(
                len(self.events),
                Message(time, tuple(batch)),
                "message-in-advance",
                f"writer no longer holds a capability <= {time!r}",
            )
        if batch:
            self.events.append(Message(time, tuple(batch)))

    def downgrade(self, frontier: Antichain[T]) -> None:
        if not self._caps.frontier().less_equal(frontier):
            raise InvalidEventStream(
                len(self.events),
                frontier,
                "progress-in-advance",
                f"cannot move the frontier back from {self._caps.frontier()!r}",
            )
        updates: ChangeBatch[T] = ChangeBatch()
        for t in frontier:
            updates.update(t, 1)
        for t, c in self._caps.counts():
            updates.update(t, -c)
        changes = updates.items()
        if changes:
            self._caps.update_iter(changes)
            self.events.append(Progress(tuple(changes)))

    def close(self) -> None:
        self.downgrade(Antichain.empty())


def interleave(
    streams: Sequence[Sequence[Event]], minimum: T, seed: int | None = None
) -> list[Event]:
    """One valid stream from ``streams``: a random interleaving (each stream's
    own order kept), preceded by the ``N - 1`` extra counts at the minimum that
    N writers' initial capabilities add up to."""
    rng = random.Random(seed)
    out: list[Event] = []
    n = len(streams)
    if n != 1:
        out.append(Progress(((minimum, n - 1),)))
    cursors = [0] * n
    live = [i for i in range(n) if streams[i]]
    while live:
        k = rng.randrange(len(live))
        i = live[k]
        out.append(streams[i][cursors[i]])
        cursors[i] += 1
        if cursors[i] == len(streams[i]):
            live.pop(k)
    return out


def split(streams: Sequence[Sequence[Event]], readers: int) -> list[list[Sequence[Event]]]:
    """Assign captured streams to ``readers`` readers (stream ``i`` to reader
    ``i % readers``). A reader may get none."""
    if readers <= 0:
        raise ValueError("need at least one reader")
    out: list[list[Sequence[Event]]] = [[] for _ in range(readers)]
    for i, s in enumerate(streams):
        out[i % readers].append(s)
    return out


def replay(
    streams: Sequence[Sequence[Event]], minimum: T, seed: int | None = None
) -> StreamState[T]:
    """Replay ``streams`` on one reader: validate their interleaving and return
    the collection ``{(record, time): count}`` and the capability counts."""
    return validate(interleave(streams, minimum, seed), minimum)


def combine(states: Sequence[StreamState[T]], minimum: T) -> StreamState[T]:
    """The union of several readers' replays: collections added up, capability
    counts summed (each reader started from one count at the minimum)."""
    caps: MutableAntichain[T] = MutableAntichain()
    coll: Multiset[tuple[Any, Any]] = Multiset()
    for s in states:
        caps.update_iter(s.capabilities.counts())
        coll.update(s.collection)
    return StreamState(caps, coll, sum(s.events for s in states))


# -- files ----------------------------------------------------------------------
def encode_event(ev: Event) -> dict[str, Any]:
    if isinstance(ev, Message):
        return {"message": {"time": ev.time.encode(), "batch": list(ev.batch)}}
    return {"progress": [[t.encode(), d] for t, d in ev.updates]}


def decode_event(kind: str, value: dict[str, Any]) -> Event:
    ty = time_type(kind)
    if "message" in value:
        m = value["message"]
        return Message(ty.decode(m["time"]), tuple(_freeze(r) for r in m["batch"]))
    if "progress" in value:
        return Progress(tuple((ty.decode(t), int(d)) for t, d in value["progress"]))
    raise InvalidTimeError(f"not a captured event: {value!r}")


def _freeze(value: Any) -> Any:
    """JSON lists back into (hashable) tuples."""
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def write_events(events: Iterable[Event], out: TextIO) -> None:
    """Captured events as JSON lines (records must be JSON-serializable)."""
    for ev in events:
        out.write(json.dumps(encode_event(ev), separators=(",", ":")) + "\n")


def read_events(kind: str, lines: Iterable[str]) -> list[Event]:
    out: list[Event] = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append(decode_event(kind, json.loads(line)))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise InvalidTimeError(f"captured event on line {n}: {exc}") from None
    return out
