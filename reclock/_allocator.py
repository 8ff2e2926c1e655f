"""Arrow's memory pool settings for a reclock driver, set before pyarrow loads
(on import: ``reclock/__init__`` imports this module first).

pyarrow's Linux wheels allocate through a bundled mimalloc (v3), which reads
its options from ``MIMALLOC_*`` environment variables once, when the library
loads. With its defaults, pages a thread freed are handed back to the system
a second later, and only when that thread calls the allocator again; Arrow's
I/O and CPU pool threads that merged a compaction pass then sit idle holding
what they freed, and each arena is committed eagerly. With those defaults a
driver's resident set grows in steps at each compaction pass (an hour of
``bench/soak.py`` saw Arrow's pool go 22 -> 134 MiB and end at 49 MiB). In
the driver:

* ``purge_delay`` 0: freed pages go back at once;
* ``arena_eager_commit`` 0: an arena's memory is committed as it is used.

On a loop of twelve dataset merges like a compaction pass (400 files, 32
read ahead) the resident set after the last pass is 312 MiB with the
defaults (152 after ``release_unused``) and 124 MiB with these (121 after).
The price: such merges take up to 1.8x as long, and a compaction pass's tick
in a one-hour soak 1.03-1.15x (``bench/arrow_pool_bench.py``; bench/README.md,
"arrow_pool_bench.py", gives the date and machine).

Only the driver: Spark's Python workers decode every record through Arrow
and keep the library's defaults (their memory is bounded by the task size),
so the variables are removed again once pyarrow has loaded and a child (the
Spark JVM, its workers, any subprocess) does not inherit them. A variable the
user set is left as it is; ``RECLOCK_ARROW_ALLOCATOR=default`` keeps every
default.
"""

from __future__ import annotations

import os
import sys

#: mimalloc options for the driver process (see the module docstring)
DRIVER_MIMALLOC = {"MIMALLOC_PURGE_DELAY": "0", "MIMALLOC_ARENA_EAGER_COMMIT": "0"}

#: what :func:`configure` set in this process (and :func:`settle` removed
#: from the environment again), for reports (``bench/soak.py``)
APPLIED: dict[str, str] = {}


def configure() -> None:
    """Set :data:`DRIVER_MIMALLOC` for this process if pyarrow has not loaded
    yet, this is not a Spark Python worker, and the user did not opt out."""
    if ("pyarrow" in sys.modules or "PYTHON_WORKER_FACTORY_SECRET" in os.environ
            or os.environ.get("RECLOCK_ARROW_ALLOCATOR") == "default"):
        return
    for name, value in DRIVER_MIMALLOC.items():
        if name not in os.environ:
            os.environ[name] = value
            APPLIED[name] = value


def settle() -> None:
    """Load pyarrow (mimalloc reads its options then) and remove the
    variables :func:`configure` set, so that child processes do not inherit
    them. Called once, right after :func:`configure`."""
    if not APPLIED:
        return
    import pyarrow  # noqa: F401  (loads the library: mimalloc reads its options)

    for name in APPLIED:
        os.environ.pop(name, None)


configure()
settle()
