"""Clocks are injected: code that needs "now" takes a :class:`Clock`.

``SystemClock`` reads the wall clock; tests drive a :class:`ManualClock` by
hand instead of sleeping.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Milliseconds since the Unix epoch."""

    def now(self) -> int: ...


class SystemClock:
    """The wall clock, in milliseconds."""

    def now(self) -> int:
        return time.time_ns() // 1_000_000


class ManualClock:
    """A clock that only moves when told to (thread-safe)."""

    def __init__(self, start_ms: int = 0) -> None:
        self._now = start_ms
        self._lock = threading.Lock()

    def now(self) -> int:
        with self._lock:
            return self._now

    def advance(self, ms: int) -> int:
        if ms < 0:
            raise ValueError("a clock does not go backwards")
        with self._lock:
            self._now += ms
            return self._now

    def set(self, ms: int) -> None:
        with self._lock:
            if ms < self._now:
                raise ValueError(f"a clock does not go backwards: {self._now} -> {ms}")
            self._now = ms
