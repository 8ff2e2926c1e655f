"""The remap store contract: durable, append-only binding shards.

A store holds one *shard* per source: the source's remap collection, with a
``since`` (history below it is consolidated) and an ``upper`` (bindings at all
times below it are final; the empty upper means the source finished)::

    since <= binding times < upper          [since, upper) is half-open

Writers only ever append with :meth:`RemapStore.compare_and_append`: "append
these bindings and move the upper from ``expected_upper`` to ``new_upper``
only if the upper is still ``expected_upper``". Two writers racing on a shard
therefore serialize: the loser gets :class:`~reclock.core.errors.UpperMismatch`
carrying the actual upper, re-reads what the winner appended, and carries on.
Nothing that reaches readers is ever rewritten, except by compaction below
``since``, which preserves ``R(t)`` for every ``t >= since``.

Readers (the driver's remap operator, ``reclock bindings``) use
:meth:`RemapStore.read` for a snapshot and :meth:`RemapStore.listen` to wait
for the upper to move. Executors never talk to the store: they get a
:class:`~reclock.core.bindings.Bindings` snapshot.

A store must never block indefinitely: every call either completes or raises
(:class:`~reclock.core.errors.TransientError` for a store that is unreachable).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from reclock.core.bindings import Binding, Bindings
from reclock.core.frontier import Antichain
from reclock.core.time import IntoTime

#: what :meth:`RemapStore.read_from` gives: the bindings at times ``>= lower``,
#: the upper and the since
ReadFrom = tuple[list[Binding[Any]], Antichain[IntoTime], IntoTime]


class StoreLock(Protocol):
    """A driver's claim on its pipeline held in the store
    (:meth:`RemapStore.lock_driver`), for the driver's whole life."""

    #: which lock this is, for messages (no secret in it)
    where: str

    def check(self) -> str | None:
        """Whether the claim still holds, asked every few seconds. ``None``:
        held all along. When it was lost (the store restarted, the session
        ended) it is taken again here: the reason it was lost is returned
        once it is held again. Raises :class:`~reclock.core.errors.LockLost`
        while it cannot be taken again (the store is unreachable), and
        :class:`~reclock.core.errors.LockTaken` naming the holder when
        another driver took it meanwhile (that one keeps it). Never blocks
        for long (a connect timeout)."""
        ...

    def release(self) -> None:
        """Give the claim up (idempotent)."""
        ...


class RemapStore(Protocol):
    """Durable binding shards, one per source."""

    url: str

    def identity(self) -> str:
        """The pipeline's identity: a short random id minted on first use and the
        same for every driver of the pipeline ever after (zombies included).
        Upstream and downstream names that must not collide with another
        pipeline's (Kafka transactional ids, consumer groups) carry it."""
        ...

    def create_shard(self, shard: str, kind: str) -> None:
        """Create ``shard`` for FromTime ``kind`` with ``since = upper = 0`` if absent.

        Idempotent; raises :class:`~reclock.core.errors.BindingError` when the shard
        exists with a different kind."""
        ...

    def open_shards(self, kinds: Mapping[str, str]) -> dict[str, Bindings[Any]]:
        """For each ``shard -> kind``: :meth:`create_shard`, then :meth:`read`,
        in a few transactions for all of them (a driver starting many
        sources). Shards that :meth:`create_shard` would refuse (another kind
        stored) are left out of the result."""
        ...

    def shards(self) -> list[str]:
        """Names of the shards in the store."""
        ...

    def kind(self, shard: str) -> str:
        """The FromTime kind of ``shard``."""
        ...

    def upper(self, shard: str) -> Antichain[IntoTime]:
        """The shard's upper (empty: closed)."""
        ...

    def since(self, shard: str) -> IntoTime:
        """The shard's since."""
        ...

    def read(self, shard: str, as_of: int | None = None) -> Bindings[Any]:
        """A snapshot of the shard.

        With ``as_of``, only bindings at times ``<= as_of`` and the upper
        ``as_of + 1`` (if that is below the shard's upper): the collection as
        it was known at IntoTime ``as_of``. Raises
        :class:`~reclock.core.errors.SinceViolation` for ``as_of < since``.
        """
        ...

    def read_encoded(self, shard: str) -> tuple[str, int, int | None, list[tuple[int, Any]]]:
        """What :meth:`read` gives, the frontiers left encoded (not decoded
        nor checked): ``(kind, since, upper or None, [(time, encoded)])``."""
        ...

    def read_from(
        self, shard: str, lower: int
    ) -> tuple[list[Binding[Any]], Antichain[IntoTime], IntoTime]:
        """Bindings at times ``>= lower``, the current upper and the current
        since (incremental sync; a since that moved means compacted history)."""
        ...

    def compare_and_append(
        self,
        shard: str,
        bindings: Sequence[Binding[Any]],
        expected_upper: Antichain[IntoTime],
        new_upper: Antichain[IntoTime],
    ) -> None:
        """Atomically append ``bindings`` and move the upper ``expected -> new``.

        Requires the binding times to lie in ``[expected_upper, new_upper)``,
        increase, and keep the frontiers monotone after the last stored
        binding (:class:`~reclock.core.errors.BindingError` otherwise). Raises
        :class:`~reclock.core.errors.UpperMismatch` with the actual upper when the
        shard's upper is not ``expected_upper``; nothing is written then.
        """
        ...

    def append_and_read_from(
        self,
        shard: str,
        bindings: Sequence[Binding[Any]],
        expected_upper: Antichain[IntoTime],
        new_upper: Antichain[IntoTime],
    ) -> tuple[bool, ReadFrom]:
        """:meth:`compare_and_append`, then :meth:`read_from` the expected
        upper (what was appended after it, ours or a winner's):
        ``(appended, read)``. An :class:`~reclock.core.errors.UpperMismatch`
        is not raised: ``appended`` is False and the read shows the winner's
        bindings. Other errors of the append raise, as there. Where the
        append succeeded the read may run in its transaction (the minting
        tick's read back: one transaction instead of two); it is still a read
        of what the store holds."""
        ...

    def listen(
        self, shard: str, upper: Antichain[IntoTime], timeout: float
    ) -> tuple[list[Binding[Any]], Antichain[IntoTime]]:
        """Wait up to ``timeout`` seconds for the upper to move past ``upper``;
        return the bindings appended since and the new upper (no bindings and
        the same upper on timeout)."""
        ...

    def compact(self, shard: str, new_since: int) -> int:
        """Advance ``since`` to ``new_since`` and consolidate history below it.

        ``new_since`` must be below the upper; moving since backwards is a
        no-op. Callers pass at most the resumption frontier minus one step.
        Returns how many bindings the shard holds fewer now (0 for a no-op).
        """
        ...

    def coordinates(self, shard: str, names: Sequence[str] = ()) -> dict[str, int]:
        """Every coordinate name of ``shard`` with its id, after giving each of
        ``names`` not known yet the next free id (0, 1, 2, ... in the order
        given). Ids are dense, assigned once and never changed or reused, in
        one transaction with every other assigner (a zombie driver's too):
        a multi-topic Kafka source's partition ids, ``["topic", partition]``
        -> id, so that "every id from N on, at offset 0" covers every
        (topic, partition) not known yet. Ids must be durable before any
        binding names them; assigning before minting does that."""
        ...

    def facts(self, shard: str) -> dict[str, str]:
        """What the shard's state depends on besides its bindings, as
        :meth:`put_facts` left it: key -> JSON text. Keys are namespaced by
        who writes them (``kafka.topic:<name>``: the topic's identity;
        ``sink:<output>``: the output's last committed state known to the
        driver). A shard with none (or none yet) gives ``{}``."""
        ...

    def put_facts(self, shard: str, facts: Mapping[str, str | None]) -> None:
        """Set each key of ``facts`` to its value (``None`` removes it), in
        one transaction. Facts are durable once this returns, and are dropped
        with the shard. A fact an identity check relies on is written before
        anything that depends on it (a binding naming a new topic's
        partitions, a commit after an output's first)."""
        ...

    def drop_shard(self, shard: str) -> None:
        """Remove the shard and its bindings (``reclock drop`` with cleanup)."""
        ...

    def lock_driver(self, holder: dict[str, Any]) -> StoreLock | None:
        """Claim the pipeline for one driver where the store is shared between
        hosts: returns the claim, or ``None`` when the store needs no lock
        of its own (a file store: the state directory's lock covers it).
        Raises :class:`~reclock.core.errors.AlreadyRunning` with the holder's
        record when another driver holds it."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...
