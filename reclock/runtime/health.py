"""A source's health: one set of states, shared by the driver, the status
page, ``reclock status`` and the metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STARTING, RUNNING, STALLED, DROPPED, FINISHED, STOPPED = (
    "starting", "running", "stalled", "dropped", "finished", "stopped",
)
#: Every state, in the order the metrics list them.
HEALTH_STATES = (STARTING, RUNNING, STALLED, FINISHED, STOPPED, DROPPED)


@dataclass
class Health:
    status: str = STARTING
    error: str | None = None
    hint: str | None = None
    since_ms: int = 0
    definite: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "error": self.error, "hint": self.hint,
                "since_ms": self.since_ms, "definite": self.definite}
