"""The built-in source connectors: readers that emit data in their native time
(FromTime), each declaring itself with one
:class:`~reclock.contracts.source.SourcePlugin` (``PLUGIN``, beside its
configuration block's model), registered in the ``reclock.sources`` entry
point group. The contract is :mod:`reclock.contracts.source`."""
