"""The built-in persist sinks: make an output durable, data and upper in one
atomic step (the contract: :mod:`reclock.contracts.sink`). Each declares
itself with one :class:`~reclock.contracts.sink.SinkPlugin` (``PLUGIN``),
registered in the ``reclock.sinks`` entry point group.

* :mod:`reclock.sinks.delta` -- ``delta`` (alias ``file``): a Delta Lake table
  in a local directory or under ``s3://``.
* :mod:`reclock.sinks.console` -- ``console``: prints committed updates (for
  trying things out).
* :mod:`reclock.sinks.kafka` -- ``kafka``: a Kafka topic written with
  transactions, its progress in a progress topic.
* :mod:`reclock.sinks.postgres` -- ``postgres``: a PostgreSQL table.

``_fs``, ``_store``, ``_apart``: what the built-in sinks share (files,
object storage, work in a child process).
"""

import os as _os

# delta-rs (reclock.sinks.delta) allocates through its own jemalloc, configured from
# this variable when the library first allocates. Its defaults (8 arenas on
# 2 cores, freed pages purged over 10 s) let a driver committing every second
# grow ~10 MiB per 100 commits that it never gave back (bench/soak.py); one
# arena that purges at once grows ~2 MiB. A value already set wins.
_os.environ.setdefault("_RJEM_MALLOC_CONF", "narenas:1,dirty_decay_ms:0,muzzy_decay_ms:0")
