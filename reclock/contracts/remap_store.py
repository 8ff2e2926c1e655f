"""The remap store contract: durable, append-only binding shards; and how a
store declares itself (:class:`RemapStorePlugin`).

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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from reclock.core.bindings import Binding, Bindings
from reclock.core.frontier import Antichain
from reclock.core.mint import ShardStore
from reclock.core.time import IntoTime


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


class RemapStore(ShardStore, Protocol):
    """Durable binding shards, one per source: what minting needs of them
    (:class:`~reclock.core.mint.ShardStore`), and what the runtime and the
    sources keep beside the bindings."""

    url: str

    def identity(self) -> str:
        """The pipeline's identity: a short random id minted on first use and the
        same for every driver of the pipeline ever after (zombies included).
        Upstream and downstream names that must not collide with another
        pipeline's (Kafka transactional ids, consumer groups) carry it."""
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

    def read_encoded(self, shard: str) -> tuple[str, int, int | None, list[tuple[int, Any]]]:
        """What :meth:`read` gives, the frontiers left encoded (not decoded
        nor checked): ``(kind, since, upper or None, [(time, encoded)])``."""
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

    def listen(
        self, shard: str, upper: Antichain[IntoTime], timeout: float
    ) -> tuple[list[Binding[Any]], Antichain[IntoTime]]:
        """Wait up to ``timeout`` seconds for the upper to move past ``upper``;
        return the bindings appended since and the new upper (no bindings and
        the same upper on timeout)."""
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


#: The scheme of a ``remap_store`` written as a bare path: a SQLite file.
PATH_SCHEME = "sqlite"


def _as_is(url: str, base: Path) -> str:
    return url


def _accepted(url: str) -> str:
    return url


@dataclass(frozen=True)
class RemapStorePlugin:
    """How a remap store declares itself: the one value its module offers to
    the ``reclock.remap_stores`` entry point group (``sql =
    "pkg.mod:PLUGIN"``; the entry point's name is ``name``). The pipeline's
    ``remap_store`` URL picks the store that claims its scheme (the part
    before ``://``, without a ``+driver``).

    * ``open(url)`` opens the store (called once per pipeline);
    * ``check(url)`` validates a URL of one of its schemes where it is
      written (a ``ValueError`` saying what is wrong: it becomes the
      configuration error), returning it;
    * ``resolve(url, base)`` is the URL as the loaded pipeline keeps it,
      relative paths in it resolved against ``base`` (the YAML file's
      directory);
    * ``examples`` are URLs shown to a user who wrote a scheme no store claims.
    """

    name: str
    schemes: tuple[str, ...]
    open: Callable[[str], RemapStore]
    check: Callable[[str], str] = _accepted
    resolve: Callable[[str, Path], str] = _as_is
    examples: tuple[str, ...] = ()
