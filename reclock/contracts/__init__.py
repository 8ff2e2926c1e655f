"""The contracts: what the runtime and the plug-ins share, and all a plug-in
imports of reclock besides the kernel (:mod:`reclock.core`).

One module per plug point, each with the contract, the base of the plug-in's
configuration model and the value a plug-in declares itself with:

* :mod:`~reclock.contracts.source` -- a source (driver and executor halves),
  :class:`~reclock.contracts.source.ConnectorConfig`,
  :class:`~reclock.contracts.source.SourcePlugin`;
* :mod:`~reclock.contracts.sink` -- a persist sink (commit and staging),
  :class:`~reclock.contracts.sink.SinkConfigBase`,
  :class:`~reclock.contracts.sink.SinkPlugin`;
* :mod:`~reclock.contracts.decode` -- a format's decoder, the screening
  machinery formats share, :class:`~reclock.contracts.decode.FormatPlugin`;
* :mod:`~reclock.contracts.envelope` -- an envelope, the row builders
  envelopes share, :class:`~reclock.contracts.envelope.EnvelopePlugin`;
* :mod:`~reclock.contracts.remap_store` -- a remap store,
  :class:`~reclock.contracts.remap_store.RemapStorePlugin`.

And what they all use: :mod:`~reclock.contracts.config` (the configuration
base: :class:`~reclock.contracts.config.ConfigModel`,
:func:`~reclock.contracts.config.problem`, durations, sizes, names, secrets),
:mod:`~reclock.contracts.rows` (an output's stored schema, refused rows),
:mod:`~reclock.contracts.consolidate` (an update log read back as a
collection), :mod:`~reclock.contracts.state_table` (the settings and the
per-key rule of state tables, ``mode: state``) and
:mod:`~reclock.contracts.encoding` (Arrow values as JSON).

The contracts import the kernel (and :mod:`reclock.clients`) only; the
runtime finds the plug-ins through :mod:`reclock.registry`.
"""
