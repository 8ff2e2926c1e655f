"""Counts the fault-injection and bad-input tests report at the end of a run
(kill points tried, inputs tried, records checked), printed by
``pytest_terminal_summary`` in ``tests/conftest.py`` whatever the capture
settings."""

from __future__ import annotations

from collections import defaultdict

TALLY: dict[str, dict[str, int]] = defaultdict(dict)


def count(suite: str, **numbers: int) -> None:
    """Add ``numbers`` (name -> count) to ``suite``'s line of the summary."""
    line = TALLY[suite]
    for k, v in numbers.items():
        line[k] = line.get(k, 0) + int(v)
