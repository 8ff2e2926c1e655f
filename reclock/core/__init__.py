"""The time kernel: error classes, clocks, the stored column layout, the time
types, frontiers, bindings and minting (with what minting needs of a store,
:class:`~reclock.core.mint.ShardStore`). It imports nothing else of reclock;
the contracts (:mod:`reclock.contracts`) and every plug-in build on it."""
