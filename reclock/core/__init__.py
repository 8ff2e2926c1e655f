"""The time kernel: error classes, clocks, the stored column layout, the time
types, frontiers, bindings and minting. It imports nothing else of reclock;
connectors import only this and :mod:`reclock.config.base`."""
