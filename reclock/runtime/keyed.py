"""Keyed state: the key stores of a source's keyed outputs.

A keyed output (the upsert envelope, keyed CDC) settles each job's intents
against the state of its keys: what the output holds per key as of its
committed version. That state is derived from the output, and it changes
only once the commit that carries its updates succeeded (settling writes
into the key store's open transaction, committed after the sink commit):

* at open, :meth:`KeyedState.open` reuses a key store saved for the
  output's committed version (its *marker*), or rebuilds it from the output;
* in the commit path, :meth:`KeyedState.settle` turns intents into updates,
  :meth:`KeyedState.save` commits the key store with the marker of the
  output's new version, and :meth:`KeyedState.failed` rolls it back;
* a store met damaged anywhere is thrown away and the source re-opens, which
  rebuilds it (:meth:`KeyedState.lost`).

Tasks may write large intents to files of a spill directory under
``keys_dir`` (:func:`spill_dir`); only jobs in flight write there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from reclock.contracts.rows import output_schema
from reclock.contracts.sink import SinkState
from reclock.core.errors import DefiniteError, ReclockError, Reopen
from reclock.runtime.keystate import (
    KeyedIntents,
    KeyStateDamaged,
    KeyStore,
    MemoryKeys,
    SqliteKeys,
)
from reclock.runtime.settings import Settings
from reclock.runtime.site import OutputRuntime, Site
from reclock.runtime.upsert_state import UpsertState

log = logging.getLogger("reclock.driver")


def key_marker(out: OutputRuntime, state: SinkState) -> str:
    """What a keyed output's key store is the state of: the output's
    committed version (its upper and progress) and the shape of its rows."""
    return json.dumps({"upper": state.upper, "progress": state.progress,
                       "columns": [f"{f.name}:{f.type}" for f in out.user_schema],
                       "key": list(out.upsert_key or ())}, sort_keys=True)


def remove_spilled(intents: list[KeyedIntents]) -> None:
    """Remove the files tasks wrote for a job's intents (settled or not)."""
    for k in intents:
        for path in k.files():
            with contextlib.suppress(OSError):
                os.unlink(path)


def spill_dir(settings: Settings) -> Path | None:
    """Where tasks write large intents (None: they return them)."""
    d = settings.keys_dir
    return None if d is None or not settings.spill_intents else d / "spill"


class KeyedState:
    """The key stores of one source's keyed outputs, by output."""

    def __init__(self, site: Site) -> None:
        self.site = site
        self._stores: dict[int, KeyStore] = {}
        #: keyed outputs whose key store met damage and was thrown away: why
        #: (reported by the rebuild at the next open)
        self._damage: dict[int, str] = {}
        #: keyed outputs whose key state was rebuilt for damage and has not
        #: been committed since (damage again: the disk is suspect)
        self._healing: set[int] = set()

    def open(self, out: OutputRuntime, resnapshot: bool) -> str:
        """Set up a keyed output's key state for its committed version:
        ``reset``, ``reused`` or ``rebuilt`` (from the output, with an event
        saying why). A store found damaged (when its file was opened, which
        checks it, or while the driver ran) is rebuilt, never reused.
        ``resnapshot``: the output is re-snapshotted from scratch."""
        name = self.site.name
        key = out.upsert_key
        assert key is not None
        store = self.store(out)
        damage = self._damage.pop(out.slot, None) or store.discarded
        store.discarded = None
        columns = [f.name for f in out.user_schema]
        marker = key_marker(out, out.state)
        if resnapshot:
            # Read again from scratch: the snapshot's rows start from no
            # keys (what the output holds now is retracted as a whole,
            # however damaged: see Resnapshots.replaced); a replay's
            # correction brings its own key state (see Resnapshots.correction).
            # A damaged output's key state cannot be rebuilt: it is not needed.
            if damage is not None:
                log.warning("source %s: output %s: key state file %s was damaged (%s): "
                            "emptied for the re-snapshot", name, out.key,
                            store.location, damage)
            store.reset()
            out.upsert = UpsertState(columns, key, store)
            return "reset"
        if damage is None:
            store.rollback()
            if store.marker == marker:
                # the stored state is that of the output's committed version
                out.upsert = UpsertState(columns, key, store)
                return "reused"
        if damage is not None:
            why = f"damaged: {damage}"
        elif store.location is None:
            why = "the key state is kept in memory"
        elif store.marker is None:
            why = "no key state saved yet"
        else:  # a crash between the output's commit and the key state's, ...
            why = "the saved key state is not that of the output's committed version"
        # the key state is exactly that of the committed output
        updates = out.sink.read_updates()
        out.upsert = UpsertState.rebuild(updates, columns, key, store, marker)
        if damage is not None:
            self._healing.add(out.slot)
        (log.warning if damage is not None else log.info)(
            "source %s: output %s: key state rebuilt from %d rows of the output (%s)%s",
            name, out.key, updates.num_rows, why,
            "" if store.location is None else f" in {store.location}")
        self.site.events.log(name, "keys_rebuilt", output=out.name, sink=out.sink_name,
                             file=store.location,
                             reason=why, rows=updates.num_rows)
        return "rebuilt"

    def lost(self, out: OutputRuntime, exc: KeyStateDamaged, during: str) -> ReclockError:
        """A keyed output's key store met damage ``during`` a step: the store
        is thrown away (its file deleted), and the source re-opens, which
        rebuilds the key state from the output and reads the job again
        (key state changes only after the sink commit: a job that was not
        committed is settled again against the rebuilt state, one that was
        is in the output it is rebuilt from). The error to raise: a
        :class:`~reclock.core.errors.Reopen`, or a definite error when the
        state rebuilt for damage is damaged again before any commit."""
        name = self.site.name
        store = self._stores.pop(out.slot, None)
        if store is not None:
            store.remove()
        self.site.opened = False  # whatever is raised: the next round re-opens
        self._damage[out.slot] = f"{exc.reason} (met while {during})"
        log.error("source %s: output %s: key state file %s is damaged (%s, met while %s): "
                  "deleted; the source re-opens and rebuilds it from the output",
                  name, out.key, exc.path, exc.reason, during)
        if out.slot in self._healing:
            return DefiniteError(
                f"source {name!r}: {out.label}: its key state file {exc.path} "
                f"is damaged again ({exc.reason}), before any commit since it was rebuilt "
                "for damage", hint="check the disk under state_dir (or move state_dir to "
                "another disk); the key state is rebuilt from the output at each retry")
        return Reopen(f"source {name!r}: {out.label}: key state file "
                      f"{exc.path} is damaged ({exc.reason}): it is rebuilt from the output",
                      hint="nothing to do: the job in progress is read again")

    def store(self, out: OutputRuntime) -> KeyStore:
        """The key store of a keyed output (made once per runner)."""
        store = self._stores.get(out.slot)
        if store is None:
            d = self.site.settings.keys_dir
            store = MemoryKeys() if d is None else SqliteKeys(d / f"{out.key}.sqlite",
                                                                 self.site.settings.key_cache)
            self._stores[out.slot] = store
        return store

    def settle(self, out: OutputRuntime, keys: UpsertState, intents: KeyedIntents
               ) -> Iterator[pa.Table]:
        """The updates of a job's intents for a keyed output, settled a few
        key buckets at a time, writing the key changes into the key store's
        open transaction; yielded in pieces of up to ``spark.max_bytes_per_stage``
        (the caller stages each before the next is settled)."""
        settings = self.site.settings
        held: list[pa.Table] = []
        rows, spent, t0 = 0, 0.0, time.perf_counter()  # (staging excluded)
        for updates in keys.settle(intents, output_schema(out.user_schema),
                                   settings.spark.max_bytes_per_settle):
            held.append(updates)
            rows += updates.num_rows
            if sum(t.nbytes for t in held) >= settings.spark.max_bytes_per_stage:
                spent += time.perf_counter() - t0
                yield pa.concat_tables(held)
                t0 = time.perf_counter()
                held = []
        spent += time.perf_counter() - t0
        log.debug("source %s: output %s: %d updates settled in %.2f s",
                  self.site.name, out.key, rows, spent)
        if held:
            yield pa.concat_tables(held)

    def failed(self, out: OutputRuntime, keys: UpsertState, exc: BaseException) -> None:
        """A stage or commit of a keyed output failed with ``exc``: its key
        store's open transaction is rolled back, so its state is that of the
        committed output again. Damage met while settling or rolling back is
        raised as :meth:`lost` says; otherwise the caller raises ``exc``."""
        damage, during = (exc, "settling a job") if isinstance(
            exc, KeyStateDamaged) else (None, "rolling back a failed commit")
        try:
            keys.rollback()
        except KeyStateDamaged as found:
            damage = damage or found
        if damage is not None:
            raise self.lost(out, damage, during) from exc

    def save(self, out: OutputRuntime, keys: UpsertState, new: SinkState) -> None:
        """The sink committed ``new``: the key store's open transaction is
        committed as the state of that version."""
        try:
            keys.commit(key_marker(out, new))
        except KeyStateDamaged as exc:
            raise self.lost(out, exc, "saving the key state") from exc
        except Exception as exc:  # the output moved: its key state is read again
            raise Reopen(f"source {self.site.name!r}: {out.label}: the key state "
                         f"could not be saved ({exc})") from exc
        self._healing.discard(out.slot)

    def clear_spill(self) -> None:
        """Remove intents that tasks wrote for jobs no longer wanted (a
        crash, an abandoned job): only jobs in flight write there."""
        d = spill_dir(self.site.settings)
        if d is not None and d.exists():
            shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        """Close every key store (the runner ends)."""
        for store in self._stores.values():
            try:
                store.close()
            except Exception:
                log.debug("closing a key store failed", exc_info=True)
        self._stores = {}
