"""Postgres CDC: logical replication with the ``pgoutput`` plugin.

* :mod:`sources.postgres.source` -- the source (driver side) and its reader
  (executor side): slot, publication, snapshot hand-off, acknowledgement;
* :mod:`sources.postgres.catalog` -- catalog reads and server checks;
* :mod:`sources.postgres.types` -- PostgreSQL types as Arrow types, text
  values as Arrow arrays;
* :mod:`sources.postgres.pgoutput` -- the wire format: replication stream
  frames and pgoutput messages, parsed into immutable values.
"""
