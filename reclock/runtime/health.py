"""A source's health: one set of states, shared by the driver, the status
page, ``reclock status`` and the metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reclock.core.errors import DefiniteError, ReclockError, classify
from reclock.core.secrets import scrub

STARTING, RUNNING, STALLED, DROPPED, FINISHED, STOPPED = (
    "starting", "running", "stalled", "dropped", "finished", "stopped",
)
#: Every state, in the order the metrics list them.
HEALTH_STATES = (STARTING, RUNNING, STALLED, FINISHED, STOPPED, DROPPED)


@dataclass
class Health:
    """A status, and the error and hint that explain it. ``error`` and
    ``hint`` are scrubbed of secrets when the value is made: they are
    exception texts (a driver may quote its connection string), and every
    view of the pipeline shows them."""

    status: str = STARTING
    error: str | None = None
    hint: str | None = None
    since_ms: int = 0
    definite: bool = False

    def __post_init__(self) -> None:
        if self.error is not None:
            self.error = scrub(self.error)
        if self.hint is not None:
            self.hint = scrub(self.hint)

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "error": self.error, "hint": self.hint,
                "since_ms": self.since_ms, "definite": self.definite}


def described(exc: Exception) -> tuple[str, str | None, bool]:
    """What a source's health says of an error it met: the message, the
    hint, and whether the error is definite."""
    definite = isinstance(classify(exc), DefiniteError)
    hint = exc.hint if isinstance(exc, ReclockError) else None
    msg = (exc.args[0] if exc.args else str(exc)) if isinstance(
        exc, ReclockError) else f"{exc} ({'definite' if definite else 'transient'})"
    return msg, hint, definite
