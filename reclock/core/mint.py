"""Minting: the remap operator, driver side.

Every ``timestamp_interval`` the driver probes a source's *upstream* frontier
(Kafka high watermarks, Postgres flush LSN, the generator's counter) and hands
it to :meth:`RemapOperator.mint`, which appends ``t -> frontier`` to the remap
store with ``t = now`` rounded down to the interval::

    probe --frontier--> mint --compare_and_append--> store --read back--> bindings

Rules:

1. The first binding maps the source's initial frontier (its configured start
   position, fixed at construction) to ``as_of``, so the collection is never
   empty.
2. Never mint ahead of the clock: ``t <= now``, and nothing is minted at a time
   the store already decided (``t < upper``).
3. When behind, one binding covers everything available (no catch-up series).
4. An unchanged frontier only advances the upper (no new binding); a finished
   source binds the empty frontier and closes the shard (empty upper).
5. A frontier that went backwards is a definite error
   (:class:`~reclock.core.errors.FrontierRegression`); nothing is appended.
6. Only bindings read back from the store are used: after every append,
   successful or not, the operator re-reads the store from its last known
   upper. A lost race (:class:`~reclock.core.errors.UpperMismatch`) is absorbed:
   the winner's bindings are read back and the next tick carries on. The
   append and its read back are one store call
   (:meth:`ShardStore.append_and_read_from`: one
   transaction where the append succeeded).
7. A tick starts from the bindings read back after the last append, not from
   a read of its own: an append is fenced on the upper, so one built on a
   view another writer has moved past fails and reads back instead (rule 6).
   The view is never ahead of the store, so a probe behind its last binding
   is behind the store's too (rule 5 stays true). A read per tick would be a
   third of a hundred sources' store transactions.
8. The operator holds what its run still reads, not the retained history:
   :meth:`RemapOperator.hold_from` forgets the bindings before the latest one
   earlier than the outputs' least upper (where they resume: it only moves
   forwards within a run). The store keeps the history for ``reclock
   verify``; an operator opening the shard again reads all of it. Held, a
   day of 1 s bindings would be 26 MiB of driver memory per source, copied
   by every tick.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol

from reclock.core.bindings import Binding, Bindings
from reclock.core.clock import Clock
from reclock.core.errors import FrontierRegression
from reclock.core.frontier import Antichain
from reclock.core.time import IntoTime, T

#: what :meth:`ShardStore.read_from` gives: the bindings at times ``>= lower``,
#: the upper and the since
ReadFrom = tuple[list[Binding[Any]], Antichain[IntoTime], IntoTime]


class ShardStore(Protocol):
    """What minting needs of a remap store: binding shards, appended to with
    a compare-and-append on their upper. The whole store contract, with what
    the runtime keeps beside the bindings, is
    :class:`reclock.contracts.remap_store.RemapStore`."""

    def create_shard(self, shard: str, kind: str) -> None:
        """Create ``shard`` for FromTime ``kind`` with ``since = upper = 0`` if absent.

        Idempotent; raises :class:`~reclock.core.errors.BindingError` when the shard
        exists with a different kind."""
        ...

    def read(self, shard: str, as_of: int | None = None) -> Bindings[Any]:
        """A snapshot of the shard.

        With ``as_of``, only bindings at times ``<= as_of`` and the upper
        ``as_of + 1`` (if that is below the shard's upper): the collection as
        it was known at IntoTime ``as_of``. Raises
        :class:`~reclock.core.errors.SinceViolation` for ``as_of < since``.
        """
        ...

    def read_from(
        self, shard: str, lower: int
    ) -> tuple[list[Binding[Any]], Antichain[IntoTime], IntoTime]:
        """Bindings at times ``>= lower``, the current upper and the current
        since (incremental sync; a since that moved means compacted history)."""
        ...

    def append_and_read_from(
        self,
        shard: str,
        bindings: Sequence[Binding[Any]],
        expected_upper: Antichain[IntoTime],
        new_upper: Antichain[IntoTime],
    ) -> tuple[bool, ReadFrom]:
        """:meth:`~reclock.contracts.remap_store.RemapStore.compare_and_append`
        (append ``bindings`` and move the upper ``expected -> new``, only if
        the upper is still ``expected_upper``), then :meth:`read_from` the expected
        upper (what was appended after it, ours or a winner's):
        ``(appended, read)``. An :class:`~reclock.core.errors.UpperMismatch`
        is not raised: ``appended`` is False and the read shows the winner's
        bindings. Other errors of the append raise, as there. Where the
        append succeeded the read may run in its transaction (the minting
        tick's read back: one transaction instead of two); it is still a read
        of what the store holds."""
        ...

    def compact(self, shard: str, new_since: int) -> int:
        """Advance ``since`` to ``new_since`` and consolidate history below it.

        ``new_since`` must be below the upper; moving since backwards is a
        no-op. Callers pass at most the resumption frontier minus one step.
        Returns how many bindings the shard holds fewer now (0 for a no-op).
        """
        ...


class RemapOperator(Generic[T]):
    """Mints bindings for one source into one remap store shard."""

    def __init__(
        self,
        store: ShardStore,
        shard: str,
        kind: str,
        *,
        initial_frontier: Antichain[T],
        clock: Clock,
        timestamp_interval_ms: int = 1000,
        as_of: int | None = None,
        snapshot: Bindings[T] | None = None,
    ) -> None:
        """``snapshot``: the shard as just read from the store after
        creating it (:meth:`~reclock.contracts.remap_store.RemapStore.open_shards`, for
        many sources at once); without it, the shard is created and read here."""
        if timestamp_interval_ms <= 0:
            raise ValueError(f"timestamp_interval must be positive, got {timestamp_interval_ms} ms")
        self.store = store
        self.shard = shard
        self.kind = kind
        self.clock = clock
        self.interval = timestamp_interval_ms
        self.initial_frontier = initial_frontier
        self.as_of = as_of
        self.lost_races = 0
        if snapshot is None or snapshot.kind != kind:
            store.create_shard(shard, kind)
            snapshot = store.read(shard)
        self._bindings: Bindings[T] = snapshot
        #: bindings the store holds for the shard (more than :attr:`bindings`
        #: once :meth:`hold_from` forgot some), and its since as last read
        self.retained = len(snapshot)
        self.store_since = int(snapshot.since)

    # -- reading back ---------------------------------------------------------
    @property
    def bindings(self) -> Bindings[T]:
        """The bindings read back from the store (never ones held only in memory)."""
        return self._bindings

    def sync(self) -> Bindings[T]:
        """Re-read what was appended to the store since our last known upper."""
        cur = self._bindings
        u = cur.upper.as_option()
        if u is None:
            return cur
        return self._absorb(*self.store.read_from(self.shard, int(u)))

    def _absorb(self, new: list[Binding[T]], upper: Antichain[IntoTime],
                since: IntoTime) -> Bindings[T]:
        """Take a read from our last known upper (:meth:`sync`)."""
        cur = self._bindings
        if upper != cur.upper or new:
            if int(since) > int(cur.since):  # compacted past what we hold
                self._bindings = self.store.read(self.shard)
                self.retained = len(self._bindings)
            else:
                self._bindings = cur.extended(new, upper)
                self.retained += len(new)
        self.store_since = max(self.store_since, int(since))
        return self._bindings

    def hold_from(self, into_upper: int) -> None:
        """Forget the bindings before the latest one earlier than
        ``into_upper``, the outputs' least upper (rule 8)."""
        self._bindings = self._bindings.held_from(into_upper)

    def compact(self, new_since: int) -> None:
        """Compact the stored shard to ``new_since`` (the held bindings stay)."""
        self.retained -= self.store.compact(self.shard, new_since)
        self.store_since = max(self.store_since, new_since)

    def _append(
        self, new: list[Binding[T]], expected: Antichain[IntoTime], new_upper: Antichain[IntoTime]
    ) -> bool:
        """Append, then read back from ``expected`` (our last known upper: the
        mint appends after the bindings it holds), in one store call."""
        ok, read = self.store.append_and_read_from(self.shard, new, expected, new_upper)
        if not ok:
            self.lost_races += 1
        self._absorb(*read)
        return ok

    # -- minting --------------------------------------------------------------
    def binding_time(self) -> int:
        """``now`` rounded down to the timestamp interval."""
        now = self.clock.now()
        return now - now % self.interval

    def mint(self, probe: Callable[[], Antichain[T]] | Antichain[T]) -> Bindings[T]:
        """One tick: bind the upstream frontier at the current time.

        ``probe`` is compared with the last binding read back from the store
        (rule 7): a frontier behind it means the upstream really went
        backwards, not that another writer got ahead. Returns the bindings as
        read back from the store.
        """
        b = self._bindings
        if b.is_closed:
            return b
        t = self.binding_time()
        if not len(b):
            as_of = t if self.as_of is None else self.as_of
            upper = int(b.upper.elements[0])
            as_of = max(as_of, upper)
            self._append(
                [Binding(IntoTime(as_of), self.initial_frontier)],
                b.upper,
                Antichain.from_elem(IntoTime(as_of + 1)),
            )
            b = self._bindings
            if b.is_closed:
                return b
        upper = int(b.upper.elements[0])
        if t < upper:
            return b  # already decided up to here; never mint ahead of the clock
        probed = probe() if callable(probe) else probe
        last = b.last.frontier if b.last is not None else self.initial_frontier
        if not last.less_equal(probed):
            raise FrontierRegression(
                f"source {self.shard!r}: probed frontier {probed!r} is behind the last "
                f"binding {last!r}",
                hint="the upstream went backwards (a recreated topic or restored database?); "
                "recreate the source to start over",
            )
        new: list[Binding[Any]] = [] if probed == last else [Binding(IntoTime(t), probed)]
        new_upper: Antichain[IntoTime] = (
            Antichain.empty() if probed.is_empty() else Antichain.from_elem(IntoTime(t + 1))
        )
        self._append(new, b.upper, new_upper)
        return self._bindings
