"""The status of one running source: what ``status.json``, ``/status.json``,
``/metrics`` and the status page show of it.

:meth:`Status.document` reads the runner (its frontiers, health, outputs
and counts) without taking part in its tick: it is asked from other threads,
every second and more, so what is costly to compute from a frontier is
remembered while the frontier is the same object (:meth:`Status.memo`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from reclock.core.frontier import Antichain, frontier_distance
from reclock.runtime.health import STALLED, Health
from reclock.runtime.site import upper_value

if TYPE_CHECKING:
    from reclock.runtime.driver import SourceRunner

log = logging.getLogger("reclock.driver")


class Status:
    """Observation of one source's runner (see the module)."""

    def __init__(self, runner: SourceRunner) -> None:
        self.runner = runner
        #: the source's health (set by the run loop)
        self.health = Health(since_ms=runner.site.clock.now())
        #: When the runner was made: an output that has committed nothing
        #: yet lags from here (so a lag alert fires for it too).
        self.started_ms = runner.site.clock.now()
        self._samples: deque[tuple[float, int]] = deque(maxlen=64)
        #: how long the last ticks took (ms; opening the source included)
        self.tick_ms: deque[float] = deque(maxlen=64)
        self._memos: dict[str, tuple[tuple[Any, ...], Any]] = {}  # see memo
        self._memo_lock = threading.Lock()

    def set_health(self, status: str, error: str | None = None, hint: str | None = None,
                   definite: bool = False) -> None:
        """The source's health is ``status`` now (with the error met, its
        hint, and whether it is definite): logged as an event when it
        changes, and said once in the log when the source stalls."""
        h, name = self.health, self.runner.name
        if (h.status, h.error) != (status, error):
            self.health = Health(status, error, hint, self.runner.site.clock.now(), definite)
            self.runner.events.log(name, "health", status=status, error=error, hint=hint)
            if status == STALLED:  # (said once per change of the error, as it happens)
                log.warning("source %s: stalled (%s): %s%s", name,
                            "definite" if definite else "retried", error,
                            f" (hint: {hint})" if hint else "")

    @property
    def rate(self) -> float:
        """Records per second over the last ~10 s of wall time."""
        records = self.runner.records
        now = time.monotonic()
        self._samples.append((now, records))
        while len(self._samples) > 2 and now - self._samples[0][0] > 10:
            self._samples.popleft()
        t0, r0 = self._samples[0]
        return (records - r0) / (now - t0) if now - t0 > 0.5 else 0.0

    def memo(self, key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
        """``compute()``, remembered while the frontiers in ``key`` are the
        same objects (frontiers never change; a tick makes new ones): status
        is asked for every second and more, and a Kafka frontier of 2,048
        partitions takes milliseconds to encode."""
        with self._memo_lock:
            hit = self._memos.get(key[0])
            if hit is not None and len(hit[0]) == len(key) and all(
                    a is b for a, b in zip(hit[0][1:], key[1:], strict=True)):
                return hit[1]
        value = compute()
        with self._memo_lock:
            self._memos[key[0]] = (key, value)
        return value

    def encoded(self, name: str, f: Antichain[Any] | None) -> Any:
        """``f.encode()``; the status field ``name`` remembers its last one."""
        return None if f is None else self.memo((f"encode:{name}", f), f.encode)

    def document(self) -> dict[str, Any]:
        """The source's status dict (see ``reclock status``)."""
        r = self.runner
        source = r.source
        b = r.operator.bindings if r.operator is not None else None
        now = r.site.clock.now()
        snapshots = r.snapshots.status(source.snapshot_sizes())
        outs = []
        for o in r.outputs:
            outs.append({
                "name": o.name, "upper": o.state.upper,
                # None: closed (complete, no lag); 0: nothing committed yet
                "lag_ms": (None if o.state.upper is None
                           else max(0, now - (o.state.upper or self.started_ms))),
                "rows": o.rows, "errors": o.errors, "health": o.health.as_dict(),
                **({"dropped_values": dict(o.dropped.counts)} if o.dropped.counts else {}),
                # the initial snapshot's rows read and in all (None: none in this run)
                "snapshot": snapshots.get(o.index),
            })
        enc = self.encoded
        read_from, probe = r.read_from, r.last_probe
        return {
            "source": r.name,
            "kind": source.kind,
            "health": self.health.as_dict(),
            "probe": enc("probe", probe),
            "bound": (None if b is None or b.last is None
                      else enc("bound", b.last.frontier)),
            "remap_upper": None if b is None else upper_value(b.upper),
            "bindings": 0 if r.operator is None else r.operator.retained,
            "read_from": enc("read_from", read_from),
            "resume": enc("resume", r.resume),
            "records": r.records,
            "records_per_s": round(self.rate, 1),
            "lag_records": self.memo(("distance", read_from, probe),
                                     lambda: frontier_distance(source.kind, read_from, probe)),
            "job_seconds": round(r.jobs.seconds, 3),
            # the median of the last 64 ticks (mint, read, commit, acknowledge)
            "tick_ms": (round(sorted(self.tick_ms)[len(self.tick_ms) // 2], 1)
                        if self.tick_ms else None),
            "outputs": outs,
        }
