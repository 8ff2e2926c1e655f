"""Postgres CDC: logical replication with the ``pgoutput`` plugin.

* :mod:`reclock.sources.postgres.source` -- the source (driver side) and its reader
  (executor side): slot, publication, snapshot hand-off, acknowledgement;
* :mod:`reclock.sources.postgres.catalog` -- catalog reads and server checks;
* :mod:`reclock.sources.postgres.types` -- PostgreSQL types as Arrow types, text
  values as Arrow arrays;
* :mod:`reclock.sources.postgres.pgoutput` -- the wire format: replication stream
  frames and pgoutput messages, parsed into immutable values.
"""
