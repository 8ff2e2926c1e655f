"""Persist sinks: make an output durable, data and upper in one atomic step.

* :mod:`sinks.base` -- the contract (:class:`~sinks.base.PersistSink`,
  :class:`~sinks.base.Stager`, :class:`~sinks.base.SinkState`).
* :mod:`sinks.delta` -- a Delta Lake table on the local filesystem.
* :mod:`sinks.console` -- prints committed updates (for trying things out).
* :mod:`sinks.kafka` -- a Kafka topic written with transactions, its progress in a
  progress topic.
* :mod:`sinks.consolidate` -- an update log read back as a collection as of a time.
"""
