"""Postgres CDC: logical replication with the ``pgoutput`` plugin.

* :mod:`sources.postgres.pgoutput` -- the wire format: replication stream
  frames and pgoutput messages, parsed into immutable values.
"""
