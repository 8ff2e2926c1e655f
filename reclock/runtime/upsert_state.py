"""The key state of a keyed output: the current row per key, and the updates
a job's intents make of it.

Tasks of a keyed output (upsert, keyed debezium, keyed CDC) decode records
into *intents* (``_diff`` 1 for a value, 0 for a tombstone);
:class:`UpsertState` turns them into updates in (IntoTime, position) order
against the previous value per key. The state is always exactly the state of
the committed output: a running driver keeps it in a SQLite file it reuses
while the file's marker names the output's committed version, and rebuilds
from the output itself otherwise (:mod:`reclock.runtime.keystate`, which also
says how a job's intents are settled a few key buckets at a time, in bounded
memory).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from reclock.core.columns import (
    DIFF,
    ERROR,
    INTO_TIME,
    SRC_OFFSET,
    SRC_PART,
    SRC_SEQ,
    SRC_UNCHANGED,
    TRUNCATED,
)
from reclock.core.errors import DefiniteError
from reclock.runtime.keystate import (
    ALL,
    KeyedIntents,
    KeyStore,
    MemoryKeys,
    canonical,
    canonical_keys,
    hashable,
)


class Pending:
    """What one :meth:`UpsertState.apply` would change, kept apart from the
    state until the commit that carries its updates succeeds
    (:meth:`UpsertState.accept`). Reads fall through to the state."""

    def __init__(self, store: KeyStore, buckets: frozenset[int]) -> None:
        self._store = store
        self._base: dict[str, tuple[Any, ...]] = {}  # rows of keys looked at, read up front
        self.buckets = buckets
        self.cleared = False  # a truncate removed every key of ``buckets``
        self.changes: dict[str, tuple[Any, ...] | None] = {}

    def prefetch(self, keys: Iterable[str]) -> None:
        """Read the rows of ``keys`` (those to be looked at next) from the store."""
        if not self.cleared:
            self._base.update(self._store.lookup(
                {k for k in keys if k not in self.changes and k not in self._base}))

    def get(self, k: str) -> tuple[Any, ...] | None:
        if k in self.changes:
            return self.changes[k]
        return None if self.cleared else self._base.get(k)

    def live(self) -> Iterator[tuple[str, tuple[Any, ...]]]:
        """Every key's current row of ``buckets``, as this batch has left it so far."""
        if not self.cleared:
            for k, row in self._store.live(self.buckets):
                if k not in self.changes:
                    yield k, row
        for k, v in list(self.changes.items()):
            if v is not None:
                yield k, v

    def clear(self) -> None:
        self.cleared = True
        self.changes = {}
        self._base = {}

    def done_slice(self) -> None:
        """A slice of the intents is settled (see :class:`_WriteThrough`)."""

    def __len__(self) -> int:
        return len(self.changes) + int(self.cleared)


class _WriteThrough(Pending):
    """Changes written into the key store's open transaction after each
    slice of intents, so that memory holds one slice's keys, however many a
    round changes (:meth:`UpsertState.settle`). Lookups of later slices see
    them; :meth:`UpsertState.commit` or :meth:`UpsertState.rollback` decides."""

    def live(self) -> Iterator[tuple[str, tuple[Any, ...]]]:
        self.done_slice()
        return self._store.live(self.buckets)

    def clear(self) -> None:
        self.changes = {}
        self._base = {}
        self._store.write({}, self.buckets)

    def done_slice(self) -> None:
        self._store.write(self.changes)
        self.changes = {}
        self._base = {}


#: intents settled at once by :meth:`UpsertState.apply` and :meth:`UpsertState.settle`
SLICE_ROWS = 65_536


class _Carry:
    """What the settling of a slice leaves to the next: the last tombstone
    that removed a row, ``(its meta values, the row)``, from which a value
    of the next position takes the columns it left unsent (a key moved)."""

    def __init__(self) -> None:
        self.gone: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None


def _plain(t: pa.Table) -> bool:
    """A slice without truncations, without unchanged columns to fill, and
    with a ``_diff`` in every row."""
    diff = t.column(DIFF)
    if diff.null_count or pc.any(pc.equal(diff, TRUNCATED)).as_py():
        return False
    if SRC_UNCHANGED not in t.column_names:
        return True
    sizes = pc.list_value_length(t.column(SRC_UNCHANGED))
    return not pc.any(pc.fill_null(pc.greater(sizes, 0), False)).as_py()


def _same_rows(cols: list[pa.Array], a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]
               ) -> np.ndarray[Any, Any]:
    """Whether the rows at ``a`` and at ``b`` of ``cols`` are equal in every
    column, as :func:`~reclock.runtime.keystate.hashable` compares values:
    nulls equal nulls, NaN equals NaN (and -0.0 0.0); nested values compared
    in Python."""
    out = np.ones(len(a), bool)
    if not len(a):
        return out
    ia, ib = pa.array(a), pa.array(b)
    for col in cols:
        x, y = col.take(ia), col.take(ib)
        typ = col.type
        if (pa.types.is_integer(typ) or pa.types.is_string(typ) or pa.types.is_boolean(typ)
                or pa.types.is_large_string(typ) or pa.types.is_binary(typ)
                or pa.types.is_large_binary(typ) or pa.types.is_temporal(typ)
                or pa.types.is_decimal(typ) or pa.types.is_floating(typ)):
            try:
                eq = pc.equal(x, y)
            except pa.ArrowNotImplementedError:  # (intervals): compared in Python below
                pass
            else:
                if pa.types.is_floating(typ):
                    eq = pc.or_(eq, pc.and_(pc.is_nan(x), pc.is_nan(y)))
                eq = pc.or_(pc.fill_null(eq, False), pc.and_(pc.is_null(x), pc.is_null(y)))
                out &= eq.to_numpy(zero_copy_only=False)
                continue
        out &= np.fromiter((hashable(p) == hashable(q) for p, q in
                            zip(x.to_pylist(), y.to_pylist(), strict=True)),
                           bool, count=len(a))
    return out


class UpsertState:
    """The current value per key of one upsert output (see module docstring),
    kept in a :class:`~reclock.runtime.keystate.KeyStore` (a dictionary
    unless given one).

    :meth:`apply` computes updates without touching the state; the state
    changes only when the caller accepts them (:meth:`accept`) after the commit that
    carries them succeeded. A failed stage or commit, or an error in the
    middle of ``apply``, leaves the state exactly as it was."""

    def __init__(self, user_columns: list[str], key: tuple[str, ...],
                 store: KeyStore | None = None) -> None:
        missing = [k for k in key if k not in user_columns]
        if missing:
            raise DefiniteError(f"upsert key columns {missing} are not among {user_columns}")
        self.columns = user_columns
        self.key = key
        self._kidx = [user_columns.index(k) for k in key]
        self.store: KeyStore = MemoryKeys() if store is None else store

    def _key_of(self, row: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(hashable(row[i]) for i in self._kidx)

    def _canonical(self, row: tuple[Any, ...]) -> str:
        return canonical(row[i] for i in self._kidx)

    @property
    def rows(self) -> dict[tuple[Any, ...], tuple[Any, ...]]:
        """Every committed key's row, by key (read whole: for models and tests)."""
        return {self._key_of(row): row for _k, row in self.store.live(ALL)}

    @classmethod
    def rebuild(cls, updates: pa.Table, user_columns: list[str], key: tuple[str, ...],
                store: KeyStore | None = None, marker: str | None = None) -> UpsertState:
        """The state of an output's committed update log (written to
        ``store`` from empty, and committed there with ``marker``).
        Whatever ``store`` held is thrown away first, its file too: a
        damaged file is never written into."""
        st = cls(user_columns, key, store)
        st.store.discard()
        new: dict[str, tuple[Any, ...]] = {}

        def dup(row: tuple[Any, ...], times: str = "more than once") -> DefiniteError:
            st.store.rollback()
            return DefiniteError(
                f"upsert output holds key {st._key_of(row)!r} {times}: it was not written "
                "by this envelope", hint="write the upsert output to a new path")

        def flush() -> None:  # in chunks: a key must not be there yet
            there = st.store.lookup(new)
            if there:
                raise dup(new[next(iter(there))])
            st.store.write(dict(new))
            new.clear()

        if updates.num_rows:
            ok = updates.filter(pc.is_null(updates.column(ERROR)))
            for row, n in st.store.net_rows(_log_chunks(ok, user_columns)):
                k = st._canonical(row)
                if n != 1 or k in new:
                    raise dup(row, f"{n} times" if n != 1 else "more than once")
                new[k] = row
                if len(new) >= 50_000:
                    flush()
        flush()
        st.store.commit(marker)
        return st

    def apply(self, intents: pa.Table, schema: pa.Schema,
              buckets: frozenset[int] = ALL) -> tuple[pa.Table, Pending]:
        """Updates for ``intents`` (rows of ``schema`` with ``_diff`` 1 = value,
        0 = tombstone, ``TRUNCATED`` = every key of ``buckets``); returns
        them and the :class:`Pending` changes to :meth:`accept` once they are
        committed. The state itself is not touched. ``intents`` must hold
        every intent of the keys of ``buckets`` (and only of those)."""
        pending = Pending(self.store, buckets)
        tables = list(self._updates(intents, schema, pending))
        return pa.concat_tables([schema.empty_table(), *tables]), pending

    def _updates(self, intents: pa.Table, schema: pa.Schema, pending: Pending,
                 vectorised: bool = False) -> Iterator[pa.Table]:
        """The updates of ``intents`` against ``pending``, slice by slice of
        :data:`SLICE_ROWS` intents in (IntoTime, position) order.
        ``vectorised``: a slice without truncations or unchanged columns is
        settled in whole columns (:meth:`_slice_columns`); any other slice,
        and every slice when not, intent by intent (:meth:`_slice_rows`).
        Both give the same updates and the same changes."""
        order = pc.sort_indices(intents, sort_keys=[
            (INTO_TIME, "ascending"), (SRC_PART, "ascending"),
            (SRC_OFFSET, "ascending"), (SRC_SEQ, "ascending")])
        carry = _Carry()
        for lo in range(0, len(order), SLICE_ROWS):
            t = intents.take(order[lo:lo + SLICE_ROWS])
            out = (self._slice_columns(t, schema, pending, carry)
                   if vectorised and _plain(t) else None)
            yield out if out is not None else self._slice_rows(t, schema, pending, carry)
            pending.done_slice()

    def _slice_rows(self, t: pa.Table, schema: pa.Schema, pending: Pending, carry: _Carry
                    ) -> pa.Table:
        """The updates of one slice of intents (in position order), intent by
        intent: the reference for :meth:`_slice_columns`, and the way of
        slices with truncations or unchanged columns."""
        names = schema.names
        ncols = len(self.columns)
        meta_names = names[ncols:]
        di = meta_names.index(DIFF)
        gone = carry.gone  # the last tombstone that removed a row
        data = {n: t.column(n).to_pylist() for n in names}
        unchanged = (t.column(SRC_UNCHANGED).to_pylist()
                     if SRC_UNCHANGED in t.column_names else None)
        rows = [tuple(vals) for vals in zip(*(data[c] for c in self.columns), strict=True)]
        keys = [None if data[ERROR][i] is not None or data[DIFF][i] == TRUNCATED
                else self._canonical(rows[i]) for i in range(t.num_rows)]
        pending.prefetch(k for k in keys if k is not None)
        out: list[tuple[Any, ...]] = []
        for i in range(t.num_rows):
            meta = [data[n][i] for n in meta_names]
            if data[ERROR][i] is not None:
                out.append(rows[i] + tuple(meta))
                continue
            if data[DIFF][i] == TRUNCATED:  # every key goes, at this one position
                m = list(meta)
                m[di] = -1
                for _k, had in pending.live():
                    out.append(had + tuple(m))
                pending.clear()
                gone = None
                continue
            row = rows[i]
            k = keys[i]
            assert k is not None
            old = pending.get(k)
            delete = data[DIFF][i] == 0
            if unchanged is not None and unchanged[i] and not delete:
                row = self._fill(row, unchanged[i], old, gone, meta, meta_names)
            new = None if delete else row
            if delete and old is not None:
                gone = (tuple(meta), old)
            if old is new or (old is not None and new is not None
                              and hashable(old) == hashable(new)):
                continue
            if old is not None:
                m = list(meta)
                m[di] = -1
                out.append(old + tuple(m))
            if new is not None:
                m = list(meta)
                m[di] = 1
                out.append(new + tuple(m))
            pending.changes[k] = new
        carry.gone = gone
        cols: list[Any] = list(zip(*out, strict=True)) if out else [[] for _ in names]
        return pa.Table.from_arrays(
            [pa.array(list(c), type=f.type) for c, f in zip(cols, schema, strict=True)],
            schema=schema)


    def _slice_columns(self, t: pa.Table, schema: pa.Schema, pending: Pending,
                       carry: _Carry) -> pa.Table | None:
        """The updates of one slice of intents (in position order, without
        truncations or unchanged columns) computed in whole columns: the
        same updates and changes as :meth:`_slice_rows`, which settles one
        intent after the other. None (and nothing changed): the store's
        rows of the slice's keys do not convert to the columns' types, and
        the slice is to be settled intent by intent.

        Each intent's previous value is that of the intent before it of the
        same key in the slice, or, for a key's first intent, its row in the
        state (read for all of the slice's keys at once). An intent changes
        its key unless both values are absent, or present and equal (in the
        sense of :func:`~reclock.runtime.keystate.hashable`); equality is
        transitive, so comparing with the previous intent decides as
        comparing with the key's value at that point would. A changing
        intent retracts the value its key held (that of the last changing
        intent before it, or the state's) and inserts its own."""
        n = t.num_rows
        ncols = len(self.columns)
        user_fields = list(schema)[:ncols]
        diff = t.column(DIFF).to_numpy(zero_copy_only=False).astype(np.int64)
        err = t.column(ERROR).is_valid().to_numpy(zero_copy_only=False)
        okidx = np.flatnonzero(~err)
        ok = t.take(okidx) if len(okidx) < n else t
        keys = canonical_keys(ok, self.key)
        enc = pa.array(keys, pa.string()).dictionary_encode()
        codes = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        uniq: list[str] = enc.dictionary.to_pylist()
        pending.prefetch(uniq)
        base = [pending.get(k) for k in uniq]
        have = [i for i, row in enumerate(base) if row is not None]
        bpos = np.full(len(uniq), -1, np.int64)
        bpos[have] = np.arange(len(have))
        try:  # every user column: the slice's values, then the state's rows
            cols = [pa.concat_arrays([
                t.column(c).cast(f.type).combine_chunks(),
                pa.array([base[i][j] for i in have], type=f.type)])  # type: ignore[index]
                for j, (c, f) in enumerate(zip(self.columns, user_fields, strict=True))]
        except (pa.ArrowException, ValueError, TypeError, OverflowError):
            return None
        present = diff != 0  # a value; 0: a tombstone
        # intents of the same key together, in position order (t indices)
        by = np.argsort(codes, kind="stable")
        s_t = okidx[by]
        g = codes[by]
        m = len(s_t)
        first = np.ones(m, bool)
        first[1:] = g[1:] != g[:-1]
        start = np.maximum.accumulate(np.where(first, np.arange(m), 0))
        b_src = np.where(bpos[g] >= 0, n + bpos[g], -1)  # the state's row, or none
        prev = np.r_[-1, s_t[:-1]][:m]
        was = np.where(first, b_src, np.where(present[prev], prev, -1))
        now = present[s_t]
        both = np.flatnonzero(now & (was >= 0))
        same = np.zeros(m, bool)
        same[both] = _same_rows(cols, was[both], s_t[both])
        changes = (now | (was >= 0)) & ~same
        # the last changing intent before each, of its key (else: the state's row)
        last = np.maximum.accumulate(np.where(changes, np.arange(m), -1))
        before = np.r_[-1, last[:-1]][:m]
        held = np.where(before >= start, s_t[np.maximum(before, 0)], -1)
        old = np.where(before >= start, np.where(present[held], held, -1), b_src)
        # a tombstone that removed a row: what an update that moved its row takes
        gone = np.flatnonzero(~now & (old >= 0))
        if len(gone):
            j = gone[np.argmax(s_t[gone])]
            carry.gone = (tuple(t.slice(int(s_t[j]), 1).select(schema.names[ncols:])
                                .to_pylist()[0].values()),
                          tuple(c[int(old[j])].as_py() for c in cols))
        # the key changes: each key's last changing intent
        last_of = np.flatnonzero(np.r_[first[1:], True][:m] & (last >= start))
        fin = last[last_of]
        at = pa.array(s_t[fin])
        fin_rows = zip(*(t.column(c).take(at).to_pylist() for c in self.columns), strict=True)
        fin_keys = [uniq[i] for i in g[fin].tolist()]
        pending.changes.update(zip(fin_keys, (row if p else None for row, p in zip(
            fin_rows, present[s_t[fin]].tolist(), strict=True)), strict=True))
        # the updates, in position order: each intent's retraction, then its
        # insertion (or an error row as it came)
        retract = np.full(n, -1, np.int64)
        retract[s_t] = np.where(changes, old, -1)
        insert = err.copy()
        insert[s_t] = changes & now
        user_src = np.empty(2 * n, np.int64)
        user_src[0::2] = retract
        user_src[1::2] = np.arange(n)
        diffs = np.empty(2 * n, np.int64)
        diffs[0::2] = -1
        diffs[1::2] = np.where(err, diff, 1)
        keep = np.empty(2 * n, bool)
        keep[0::2] = retract >= 0
        keep[1::2] = insert
        src = pa.array(user_src[keep])
        meta_src = pa.array(np.repeat(np.arange(n), 2)[keep])
        arrays: list[pa.Array] = [c.take(src) for c in cols]
        for f in list(schema)[ncols:]:
            arrays.append(pa.array(diffs[keep], pa.int64()) if f.name == DIFF
                          else t.column(f.name).cast(f.type).take(meta_src).combine_chunks())
        return pa.Table.from_arrays(arrays, schema=schema)

    def _fill(self, row: tuple[Any, ...], cols: list[int], old: tuple[Any, ...] | None,
              gone: tuple[tuple[Any, ...], tuple[Any, ...]] | None, meta: list[Any],
              meta_names: list[str]) -> tuple[Any, ...]:
        """``row`` with the columns at ``cols`` (left unchanged upstream and
        not sent) taken from the key's current row, or, when the change moved
        the key, from the row its tombstone just removed."""
        src = old
        if src is None and gone is not None:
            at = [meta_names.index(n) for n in (INTO_TIME, SRC_PART, SRC_OFFSET)]
            seq = meta_names.index(SRC_SEQ)
            then, row_gone = gone
            if [then[j] for j in at] == [meta[j] for j in at] and then[seq] == meta[seq] - 1:
                src = row_gone
        if src is None:
            names = [self.columns[j] for j in cols]
            raise DefiniteError(
                f"upsert key {self._key_of(row)!r}: an update left columns {names} unchanged "
                "without sending them, and the output holds no current row for the key",
                hint="the output must hold the whole table (take a snapshot), or use "
                     "REPLICA IDENTITY FULL upstream")
        keep = set(cols)
        return tuple(src[j] if j in keep else v for j, v in enumerate(row))

    def settle(self, intents: KeyedIntents, schema: pa.Schema, budget: int,
               vectorised: bool = True) -> Iterator[pa.Table]:
        """Settle a job's intents a few key buckets at a time (at most
        ``budget`` bytes of intents each, see :meth:`KeyedIntents.rounds`),
        a slice at a time: yields the updates of each slice, and writes its
        key changes into the store's open transaction once the caller has
        taken them (staged them for the commit: :meth:`commit` after it, or
        :meth:`rollback`). ``vectorised``: slices are settled in whole
        columns where they can be (see :meth:`_updates`); False: intent by
        intent (the reference, for tests and benchmarks)."""
        for buckets in intents.rounds(budget):
            yield from self._updates(intents.read(buckets, schema), schema,
                                     _WriteThrough(self.store, buckets), vectorised)

    def commit(self, marker: str | None) -> None:
        """Every staged change becomes the state (their updates were committed)."""
        self.store.commit(marker)

    def rollback(self) -> None:
        """Forget every staged change (their updates were not committed)."""
        self.store.rollback()

    def take(self, other: UpsertState) -> None:
        """Stage ``other``'s rows as the whole state (a replay's)."""
        self.store.write({}, ALL)
        self.store.write(dict(other.store.live(ALL)))

    def accept(self, pending: Pending) -> None:
        """Take the changes of an :meth:`apply` whose updates were committed."""
        self.store.write(pending.changes, pending.buckets if pending.cleared else frozenset())
        self.commit(self.store.marker)


def _log_chunks(ok: pa.Table, user_columns: list[str]
                ) -> Iterator[list[tuple[str, tuple[Any, ...], int]]]:
    """An update log's rows in chunks of ``(canonical row, row, diff)``. A
    column the log does not hold yet (the output evolves with its next
    commit) is null in every row, as it reads once added."""
    for batch in ok.to_batches(max_chunksize=65_536):
        diffs = batch.column(DIFF).to_pylist()
        names = set(batch.schema.names)
        cols = [batch.column(c).to_pylist() if c in names else [None] * batch.num_rows
                for c in user_columns]
        rows = [tuple(vals) for vals in zip(*cols, strict=True)]
        yield [(canonical(row), row, int(d)) for row, d in zip(rows, diffs, strict=True)]
