"""The compaction settings the lake sinks (Delta: :mod:`reclock.sinks.delta`,
Iceberg: :mod:`reclock.sinks.iceberg`) share: their defaults, the settings
a sink is built with (:class:`Compaction`) and the ``compact`` block of
their configuration (:class:`CompactConfig`, ``compact: off`` for none).
Each sink adds what is its own: how long what a compaction replaced is
kept (``retention``: a Delta table's removed files, an Iceberg table's
snapshots) and its default, and the Delta sink's child processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field as Setting

from reclock.contracts.config import ByteSize, ConfigModel, DurationMs

#: Compaction defaults (the ``compact`` block): a pass every 10 minutes when
#: at least 50 files are below 128 MiB.
COMPACT_EVERY_MS = 10 * 60_000
COMPACT_MIN_FILES = 50
COMPACT_TARGET_SIZE = 128 * 2**20
#: The first compaction pass of a sink runs this long after its first
#: maintenance call (or ``every`` after it, if shorter).
FIRST_PASS_MS = 60_000
#: At most this many files are merged by one pass, so that a pass over a
#: table that never was compacted keeps the source's tick short; the next
#: pass follows on the next tick while enough small files are left.
COMPACT_MAX_FILES = 5_000


@dataclass(frozen=True)
class Compaction:
    """When a sink's ``maintain`` compacts an output, and how long what a
    compaction replaced is kept (``retention_ms``: each sink sets its own
    default)."""

    every_ms: int = COMPACT_EVERY_MS
    min_files: int = COMPACT_MIN_FILES
    target_size: int = COMPACT_TARGET_SIZE
    retention_ms: int = 0


class CompactConfig(ConfigModel):
    """When the driver compacts an output's small files (a lake output
    commits every ``timestamp_interval``, so without compaction its table
    gathers a small file per commit and every reader slows down). Each sink
    adds ``retention`` and ``settings()``; neither changes the rows nor the
    output's upper and progress."""

    every: DurationMs = Setting(default=COMPACT_EVERY_MS, ge=1000)
    """How often the output is checked (default ``10m``). The first check runs
    a minute after the pipeline starts (or ``every`` after, if shorter)."""
    min_files: int = Setting(default=COMPACT_MIN_FILES, ge=2)
    """Compact once at least this many data files are smaller than
    ``target_size`` (default 50)."""
    target_size: ByteSize = Setting(default=COMPACT_TARGET_SIZE, ge=2**20)
    """The size of the merged files (default ``128MiB``; ``64MB``, ``1GiB`` or
    a number of bytes)."""


def compact_switch(value: Any) -> Any:
    """``compact: off`` (YAML reads it as false) or ``null``: no compaction;
    ``true``: the defaults."""
    if value is False or value is None:
        return None
    if value is True:
        return {}
    return value


def bounded_pass(candidates: list[int], live: dict[int, int], max_files: int,
                 max_rows: int) -> list[int]:
    """The files a state table's compaction pass takes: ``candidates`` in
    order, at most ``max_files`` of them, stopping before the one that would
    bring the live rows taken (``live``, by file) past ``max_rows`` (the
    first is always taken), so that no pass costs time in proportion to the
    table; the rest wait for the next pass."""
    take: list[int] = []
    rows = 0
    for i in candidates[:max_files]:
        if take and rows + live[i] > max_rows:
            break
        take.append(i)
        rows += live[i]
    return take
