"""Persist sinks: make an output durable, data and upper in one atomic step.

* :mod:`reclock.sinks.base` -- the contract (:class:`~reclock.sinks.base.PersistSink`,
  :class:`~reclock.sinks.base.Stager`, :class:`~reclock.sinks.base.SinkState`).
* :mod:`reclock.sinks.delta` -- a Delta Lake table on the local filesystem.
* :mod:`reclock.sinks.console` -- prints committed updates (for trying things out).
* :mod:`reclock.sinks.kafka` -- a Kafka topic written with transactions, its progress in a
  progress topic.
* :mod:`reclock.sinks.consolidate` -- an update log read back as a collection as of a time.
"""

import os as _os

# delta-rs (reclock.sinks.delta) allocates through its own jemalloc, configured from
# this variable when the library first allocates. Its defaults (8 arenas on
# 2 cores, freed pages purged over 10 s) let a driver committing every second
# grow ~10 MiB per 100 commits that it never gave back (bench/soak.py); one
# arena that purges at once grows ~2 MiB. A value already set wins.
_os.environ.setdefault("_RJEM_MALLOC_CONF", "narenas:1,dirty_decay_ms:0,muzzy_decay_ms:0")
