"""reclock: ingest changes from Kafka and Postgres into durable outputs,
stamped with one system time (IntoTime), exactly once, resumable after a crash.

The time model lives here:

* :mod:`reclock.time` -- timestamp types (IntoTime, Lsn, Counter, Partitioned);
* :mod:`reclock.frontier` -- Antichain, MutableAntichain, ChangeBatch;
* :mod:`reclock.bindings` -- the remap collection snapshot and reclocking;
* :mod:`reclock.mint` -- the remap operator that mints bindings;
* :mod:`reclock.capture` -- the capture/replay event protocol;
* :mod:`reclock.clock` -- injected clocks;
* :mod:`reclock.errors` -- the error hierarchy.
"""

from reclock.bindings import UNBOUND, Binding, Bindings
from reclock.clock import Clock, ManualClock, SystemClock
from reclock.errors import DefiniteError, ReclockError, TransientError, UpperMismatch
from reclock.frontier import Antichain, ChangeBatch, MutableAntichain, kafka_frontier
from reclock.time import Counter, IntoTime, Lsn, Partitioned, kafka_offsets

__all__ = [
    "UNBOUND",
    "Antichain",
    "Binding",
    "Bindings",
    "ChangeBatch",
    "Clock",
    "Counter",
    "DefiniteError",
    "IntoTime",
    "Lsn",
    "ManualClock",
    "MutableAntichain",
    "Partitioned",
    "ReclockError",
    "SystemClock",
    "TransientError",
    "UpperMismatch",
    "kafka_frontier",
    "kafka_offsets",
]
