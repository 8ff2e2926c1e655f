"""The progress log: every frontier change as one JSON line.

Events (``kind``): ``binding`` (a new binding or remap upper), ``read`` (the
data plane's read frontier), ``sink_upper`` (an output's durable upper and
progress), ``resume`` (the resumption frontier and what was acknowledged
upstream), ``health`` (status changes), ``open`` (a source started),
``keys_rebuilt`` (a keyed output's key state rebuilt from the output:
``output``, ``file``, ``reason``, ``rows`` read; a ``reason`` starting
``damaged:`` is a damaged key file thrown away). Each line
carries ``ts`` (wall clock ms) and ``source``. The file rotates at
``max_bytes`` (one previous generation kept as ``.1``), so it never grows
without bound; ``reclock status`` shows its tail. Every string of an event is
scrubbed of secrets before it is kept or written (errors quote upstream
messages).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections import deque
from pathlib import Path
from typing import Any, BinaryIO

from reclock.core.clock import Clock, SystemClock
from reclock.core.secrets import scrub_json


class ProgressLog:
    def __init__(
        self, path: Path | None, clock: Clock | None = None, max_bytes: int = 64 << 20
    ) -> None:
        self.path = path
        self.clock = clock or SystemClock()
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self.recent: deque[dict[str, Any]] = deque(maxlen=2000)
        # kept open between lines (a driver starting a thousand sources logs
        # a thousand lines at once); each line is written through at once
        self._file: BinaryIO | None = None
        self._size = 0
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, source: str, kind: str, **fields: Any) -> None:
        event = scrub_json({"ts": self.clock.now(), "source": source, "kind": kind, **fields})
        line = (json.dumps(event, separators=(",", ":"), default=str) + "\n").encode()
        with self._lock:
            self.recent.append(event)
            if self.path is None:
                return
            try:
                if self._file is None or self._size > self.max_bytes:
                    self._reopen()
                assert self._file is not None
                self._file.write(line)
                self._size += len(line)
            except OSError:
                # The log is for observation; losing a line never stops ingestion.
                self._close()

    def _reopen(self) -> None:
        """Open the file for appending, rotating it first when it is over
        ``max_bytes``."""
        assert self.path is not None
        self._close()
        if self.path.exists() and self.path.stat().st_size > self.max_bytes:
            os.replace(self.path, self.path.with_suffix(self.path.suffix + ".1"))
        self._file = self.path.open("ab", buffering=0)
        self._size = os.fstat(self._file.fileno()).st_size

    def _close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()

    def close(self) -> None:
        with self._lock:
            self._close()


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
