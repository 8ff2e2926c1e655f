"""Client libraries the plug points share: PostgreSQL connection strings
(:mod:`reclock.clients.postgres`: parsing, scrubbing secrets, connect
defaults; the CDC source, the table sink and the remap store use it), the
librdkafka behind confluent-kafka (:mod:`reclock.clients.librdkafka`), S3
object stores (:mod:`reclock.clients.s3`: the Delta sink's outputs on S3 and
one-shot loads from S3), and the loader of reclock's optional C extensions
(:mod:`reclock.clients.native`).

Like :mod:`reclock.core`, this room imports nothing of reclock but the core:
connectors and sinks may import it.
"""
