"""Housekeeping of one source, between its ticks.

At the end of a tick none of the source's jobs is in flight and none of its
commits under way, so cleaning up cannot race them:

* :meth:`Housekeeping.compact` -- the remap store's since follows the
  resumption frontier (tick step 6), keeping ``remap_retention`` of history
  for ``reclock verify``;
* :meth:`Housekeeping.vacuum` -- the outputs' orphaned staged files;
* :meth:`Housekeeping.maintain` -- each sink's own upkeep when due (a file
  output merges its small files), then free memory handed back.

Housekeeping never stalls the source: a failure is logged and tried again.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from reclock.core.bindings import Bindings
from reclock.core.mint import RemapOperator
from reclock.runtime.memory import release_free_memory, release_if_idle
from reclock.runtime.site import Site, min_upper, upper_value

log = logging.getLogger("reclock.driver")

#: The stored bindings are compacted (history behind
#: ``housekeeping.remap_retention`` consolidated) every this many ticks.
COMPACT_EVERY_TICKS = 60


class Housekeeping:
    """What one source cleans up between ticks (see the module)."""

    def __init__(self, site: Site) -> None:
        self.site = site
        # The first vacuum one to two periods after start, at a random point:
        # a thousand sources started together otherwise vacuumed together,
        # every period (each vacuum's first pass reads its table, in a child).
        self._vacuumed_at = time.monotonic() + random.uniform(
            0.0, site.settings.housekeeping.vacuum_every / 1000.0)

    def compact(self, operator: RemapOperator[Any], b: Bindings[Any], tick: int) -> None:
        """Compact the stored bindings every :data:`COMPACT_EVERY_TICKS` (``tick``:
        the tick's number); hold in memory only those from where the outputs
        resume on, every tick (the store keeps ``remap_retention`` of history
        for ``reclock verify``)."""
        settings = self.site.settings
        u = min_upper([o.state for o in self.site.outputs])
        if u is None or not len(b):
            return
        operator.hold_from(u)
        if tick % COMPACT_EVERY_TICKS:
            return
        # At most the resumption frontier minus one step, and keep the
        # retention window of history.
        target = min(u - 1, self.site.clock.now() - settings.housekeeping.remap_retention)
        store_upper = upper_value(b.upper)
        if target > operator.store_since and (store_upper is None or target < store_upper):
            operator.compact(target)

    def vacuum(self) -> None:
        """Every ``vacuum_every_s``, delete the outputs' orphaned staged files
        (failed commits, discarded jobs). Here, between ticks, none of this
        source's jobs is in flight, so an unreferenced file older than
        ``orphan_grace_s`` can no longer be committed by this driver; a zombie
        driver's commit of a deleted file fails cleanly and is retried."""
        site = self.site
        now = time.monotonic()
        if now - self._vacuumed_at < site.settings.housekeeping.vacuum_every / 1000.0:
            return
        self._vacuumed_at = now
        for out in site.outputs:
            if out.parked_until is not None:
                continue  # (a parked sink is left alone until it is back)
            try:
                removed = out.sink.vacuum_orphans(site.settings.housekeeping.orphan_grace / 1000.0)
            except Exception as exc:  # housekeeping never stalls the source
                log.warning("source %s output %s: vacuuming staged files failed: %s",
                            site.name, out.key, exc)
                continue
            if removed:
                log.info("source %s output %s: removed %d orphaned staged files",
                         site.name, out.key, len(removed))
                site.events.log(site.name, "vacuum", output=out.key, files=len(removed))

    def maintain(self) -> None:
        """Each output's own upkeep (:meth:`~reclock.contracts.sink.PersistSink.maintain`:
        the sink decides when it is due), here between ticks where none of
        this source's jobs is in flight and none of its commits under way, so
        a compaction never races this driver's commits."""
        site = self.site
        now = site.clock.now()
        did = False
        for out in site.outputs:
            if out.parked_until is not None:
                continue
            try:
                done = out.sink.maintain(now)
            except Exception as exc:  # housekeeping never stalls the source
                log.warning("source %s output %s: maintenance failed: %s",
                            site.name, out.key, exc)
                continue
            if done:
                site.events.log(site.name, "maintain", output=out.key, **done)
                did = True
        if site.settings.housekeeping.release_memory:
            if did:
                release_free_memory()
            else:
                release_if_idle()
