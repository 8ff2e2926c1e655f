"""The built-in envelopes: how decoded records become updates (see
:mod:`reclock.contracts.envelope` for the contract): ``none`` (append),
``upsert`` (by key, the latest value wins) and ``debezium`` (change events),
each in its own module with its configuration model and its one
:class:`~reclock.contracts.envelope.EnvelopePlugin` (``PLUGIN``), registered
in the ``reclock.envelopes`` entry point group."""
