"""Faults on demand: named crash points, and named failure points.

The commit path calls :func:`crash_point` at each step. When the environment
variable ``RECLOCK_CRASH_AT`` names that point (``point`` or
``point:probability``, several separated by commas) the process kills itself
with SIGKILL there, exactly as ``kill -9`` would: no cleanup, no flush. With no
variable set this costs one dictionary lookup.

Points, in commit order: ``after_mint``, ``after_stage``, ``state_before_log``
and ``state_logged`` (inside the commit of a Delta state table,
:data:`STATE_POINTS`: its key index's transaction is open and the log entry
not yet written; the log entry is written and the index transaction not yet
committed), ``after_sink_commit`` (between outputs), ``after_upper_advance``,
``after_acknowledge``. Maintenance
points (:data:`MAINTENANCE_POINTS`, passed only when an output compacts its
files between ticks): ``mid_compaction`` (the compacted files are written, the
Delta commit that swaps them in is not) and ``after_compaction`` (that commit
is durable, nothing after it ran). Error-table points
(:data:`ERROR_TABLE_POINTS`, passed only by a commit of a state output with
error rows, into a sink that keeps them in a table of their own):
``after_errors_commit`` (the errors table's commit is durable, the state
table's is not).

``RECLOCK_FAIL_AT`` injects a *failure* instead, once (``point``) or ``n``
times (``point:n``), several separated by commas: the running pipeline meets a
:class:`InjectedFault` (a transient error) at that step, exactly as it would
meet a full disk or a broker that went away, and must recover from it with
nothing lost and nothing doubled. A user or an operator rehearsing an
incident reproduces each fault from the command line::

    RECLOCK_FAIL_AT=stage,commit:2 reclock run pipeline.yaml

``RECLOCK_KILL_WORKER=PATH`` kills the Python worker process of one task with
SIGKILL, once: the first task to finish staging its files creates ``PATH``
(exclusively) and kills its own process before its result leaves it, as the
operating system's OOM killer would. Its files are staged, its result never
arrives, and Spark fails the job. Every other task, and every later run,
finds ``PATH`` there and goes on. ``RECLOCK_KILL_WORKER=shared:PATH`` kills
only in a Spark job that several sources' small jobs share. The variable
must reach the workers (on a running session: ``SparkContext.environment``,
which starts workers of their own for the jobs started after it is set).

``RECLOCK_SKIP_DRIVER_LOCK=1`` runs a driver without the one-driver lock
(:mod:`reclock.runtime.lock`), as a driver that lost its store session would
go on running: the way to rehearse a zombie, which the commits must fence.

Failure points: ``source`` (the source's probe of its upstream frontier),
``stage`` (the driver stages the updates of a keyed output), ``commit`` (just
before a sink commit), ``refuse`` (a task's sink refuses the first row it
stages, which lands in the error collection as a row the sink could not
store; counted per process, so each Spark worker process refuses ``n``),
``hang`` (a task stops for :data:`HANG_S` seconds, as one whose job never
finishes; counted per process too), ``damage_keys`` (just before the driver
settles a job of a keyed output, 32 KiB of its key-state file (pages of
keys from the middle of the table) are overwritten with random bytes, as by
a failing disk: the settle meets the damage, and the key state is rebuilt
from the output).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

from reclock.core.errors import TransientError

#: The crash points of a Delta state table's commit (``mode: state``, see
#: :mod:`reclock.sinks.delta_state`): passed only by pipelines with such an
#: output.
STATE_POINTS = (
    "state_before_log",
    "state_logged",
)

POINTS = (
    "after_mint",
    "after_stage",
    *STATE_POINTS,
    "after_sink_commit",
    "after_upper_advance",
    "after_acknowledge",
)

#: Crash points of output maintenance (compaction): apart from :data:`POINTS`,
#: which the kill tests cycle through on every run, since they are passed only
#: when a compaction is due.
MAINTENANCE_POINTS = (
    "mid_compaction",
    "after_compaction",
)

#: Crash points of a state commit with error rows (see the module docstring).
ERROR_TABLE_POINTS = ("after_errors_commit",)


def _items(var: str, spec: str, known: tuple[str, ...], what: str) -> list[tuple[str, str]]:
    """``name`` or ``name:arg`` items of a comma-separated ``spec``."""
    out = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, arg = item.partition(":")
        if name not in known:
            raise ValueError(f"{var}: unknown {what} {name!r}; one of {known}")
        out.append((name, arg))
    return out


def _parse(spec: str) -> dict[str, float]:
    return {name: float(p) if p else 1.0
            for name, p in _items("RECLOCK_CRASH_AT", spec,
                                  POINTS + MAINTENANCE_POINTS + ERROR_TABLE_POINTS, "crash point")}


_SPEC = _parse(os.environ.get("RECLOCK_CRASH_AT", ""))
_RNG = random.Random(os.environ.get("RECLOCK_CRASH_SEED"))


def crash_point(name: str) -> None:
    """SIGKILL this process here if ``RECLOCK_CRASH_AT`` asks for it."""
    if not _SPEC:
        return
    p = _SPEC.get(name)
    if p is not None and _RNG.random() < p:
        os.kill(os.getpid(), signal.SIGKILL)


FAIL_POINTS = ("source", "stage", "commit", "refuse", "hang", "damage_keys")

#: Seconds a task stops at ``hang`` (see :func:`hang_point`).
HANG_S = 8.0


class InjectedFault(TransientError):
    """A failure injected by ``RECLOCK_FAIL_AT``."""


def _parse_fail(spec: str) -> dict[str, int]:
    return {name: int(n) if n else 1
            for name, n in _items("RECLOCK_FAIL_AT", spec, FAIL_POINTS, "failure point")}


_FAILS = _parse_fail(os.environ.get("RECLOCK_FAIL_AT", ""))
_FAILS_LOCK = threading.Lock()


def arm(spec: str) -> None:
    """Arm failure points as ``RECLOCK_FAIL_AT`` would (for tests in-process)."""
    parsed = _parse_fail(spec)
    with _FAILS_LOCK:
        _FAILS.update(parsed)


def take(name: str) -> bool:
    """Whether a failure is armed at ``name``; uses it up."""
    if not _FAILS:
        return False
    with _FAILS_LOCK:
        left = _FAILS.get(name, 0)
        if left <= 0:
            return False
        _FAILS[name] = left - 1
        if _FAILS[name] == 0:
            del _FAILS[name]
    return True


def fail_point(name: str) -> None:
    """Raise :class:`InjectedFault` here while ``RECLOCK_FAIL_AT`` has
    failures left for this point."""
    if not take(name):
        return
    raise InjectedFault(f"injected failure at {name!r} (RECLOCK_FAIL_AT)",
                        hint="a rehearsed fault: the pipeline retries")


def hang_point(name: str) -> None:
    """Stop here for :data:`HANG_S` seconds while ``RECLOCK_FAIL_AT`` has
    failures left for ``name`` (``hang``): a task that makes no progress, as
    one whose result a driver out of memory never takes in."""
    if take(name):
        time.sleep(HANG_S)


def kill_worker_point(sources: int) -> None:
    """SIGKILL this (Spark worker) process once per ``RECLOCK_KILL_WORKER``
    marker file: the first caller to create the file dies. ``sources``: how
    many sources' tasks the job runs (``shared:`` needs more than one)."""
    marker = os.environ.get("RECLOCK_KILL_WORKER")
    if not marker:
        return
    if marker.startswith("shared:"):
        if sources < 2:
            return
        marker = marker.removeprefix("shared:")
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    os.write(fd, f"{os.getpid()}\n".encode())
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def disarm() -> None:
    """Clear every armed failure point."""
    with _FAILS_LOCK:
        _FAILS.clear()


def driver_lock_skipped() -> bool:
    """``RECLOCK_SKIP_DRIVER_LOCK=1``: run without the one-driver lock."""
    return os.environ.get("RECLOCK_SKIP_DRIVER_LOCK", "") == "1"
