"""The progress log: every frontier change as one JSON line.

Events (``kind``): ``binding`` (a new binding or remap upper), ``read`` (the
data plane's read frontier), ``sink_upper`` (an output's durable upper and
progress), ``resume`` (the resumption frontier and what was acknowledged
upstream), ``health`` (status changes), ``open`` (a source started). Each line
carries ``ts`` (wall clock ms) and ``source``. The file rotates at
``max_bytes`` (one previous generation kept as ``.1``), so it never grows
without bound; ``reclock status`` shows its tail.
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from pathlib import Path
from typing import Any

from reclock.core.clock import Clock, SystemClock


class ProgressLog:
    def __init__(
        self, path: Path | None, clock: Clock | None = None, max_bytes: int = 64 << 20
    ) -> None:
        self.path = path
        self.clock = clock or SystemClock()
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self.recent: deque[dict[str, Any]] = deque(maxlen=2000)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, source: str, kind: str, **fields: Any) -> None:
        event = {"ts": self.clock.now(), "source": source, "kind": kind, **fields}
        line = json.dumps(event, separators=(",", ":"), default=str)
        with self._lock:
            self.recent.append(event)
            if self.path is None:
                return
            try:
                if self.path.exists() and self.path.stat().st_size > self.max_bytes:
                    os.replace(self.path, self.path.with_suffix(self.path.suffix + ".1"))
                with self.path.open("a", encoding="utf-8") as f:
                    f.write(line + "\n")
            except OSError:
                # The log is for observation; losing a line never stops ingestion.
                pass


def tail(path: Path, n: int = 20, source: str | None = None) -> list[dict[str, Any]]:
    """The last ``n`` events (optionally of one source)."""
    if not path.exists():
        return []
    out: deque[dict[str, Any]] = deque(maxlen=n)
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line after a crash
            if source is None or ev.get("source") == source:
                out.append(ev)
    return list(out)
