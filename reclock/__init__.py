"""reclock: ingest changes from Kafka and Postgres into durable outputs,
stamped with one system time (IntoTime), exactly once, resumable after a crash.

The time model lives here:

* :mod:`reclock.core.time` -- timestamp types (IntoTime, Lsn, Counter, Partitioned,
  Gtid);
* :mod:`reclock.core.frontier` -- Antichain and the Kafka frontier helpers;
* :mod:`reclock.core.bindings` -- the remap collection snapshot and reclocking;
* :mod:`reclock.core.mint` -- the remap operator that mints bindings;
* :mod:`reclock.core.clock` -- injected clocks;
* :mod:`reclock.core.errors` -- the error hierarchy.
"""

from reclock import _allocator  # noqa: F401  (first: Arrow's pool options, before pyarrow loads)
from reclock.core.bindings import UNBOUND, Binding, Bindings
from reclock.core.clock import Clock, ManualClock, SystemClock
from reclock.core.errors import DefiniteError, ReclockError, TransientError, UpperMismatch
from reclock.core.frontier import Antichain, kafka_frontier
from reclock.core.time import (
    Counter,
    Gtid,
    IntoTime,
    Lsn,
    Partitioned,
    is_partitioned,
    kafka_offsets,
)

__all__ = [
    "UNBOUND",
    "Antichain",
    "Binding",
    "Bindings",
    "Clock",
    "Counter",
    "DefiniteError",
    "Gtid",
    "IntoTime",
    "Lsn",
    "ManualClock",
    "Partitioned",
    "ReclockError",
    "SystemClock",
    "TransientError",
    "UpperMismatch",
    "is_partitioned",
    "kafka_frontier",
    "kafka_offsets",
]
