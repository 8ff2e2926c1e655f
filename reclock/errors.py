"""The error hierarchy: one root, two tiers.

* :class:`TransientError` -- the world may fix itself (a broker is down, a
  database restarts, another writer moved an upper). Callers stall, report the
  health status, and retry with backoff. Never closes a frontier.
* :class:`DefiniteError` -- retrying cannot help (a record does not decode, a
  topic was recreated, a stream breaks the capture protocol). Recorded against
  the record or the output; the message names the object and says what to do.

Every message names *what* was wrong and *where*; secrets never appear in one.
"""

from __future__ import annotations


class ReclockError(Exception):
    """Root of every error raised on purpose by reclock."""

    hint: str | None = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        if hint is not None:
            self.hint = hint

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base} (hint: {self.hint})" if self.hint else base


class TransientError(ReclockError):
    """A fault that may go away by itself: stall, report, retry with backoff."""


class DefiniteError(ReclockError):
    """A fault that retrying cannot fix: record it where it belongs and go on."""


class InvalidTimeError(DefiniteError, ValueError):
    """A timestamp or frontier could not be decoded or is out of range."""


class InvalidEventStream(DefiniteError):
    """A captured event stream breaks the capture/replay protocol.

    ``index`` is the position of the offending event in its stream, ``rule``
    names the broken rule.
    """

    def __init__(self, index: int, event: object, rule: str, detail: str) -> None:
        self.index = index
        self.event = event
        self.rule = rule
        super().__init__(f"event #{index} {event!r} breaks rule '{rule}': {detail}")


class BindingError(DefiniteError):
    """Bindings that would break monotonicity or the half-open interval rules."""


class FrontierRegression(BindingError):
    """A source's probed frontier went backwards (e.g. a recreated Kafka topic)."""


class UpperMismatch(TransientError):
    """``compare_and_append`` found the store's upper elsewhere than expected.

    ``actual`` carries the upper the store really has, so the writer can re-read
    what the other writer appended and carry on from there.
    """

    def __init__(self, shard: str, expected: object, actual: object) -> None:
        self.shard = shard
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"remap shard {shard!r}: expected upper {expected}, found {actual}",
            hint="another writer appended bindings; re-read the store and continue",
        )


class SinceViolation(DefiniteError):
    """A read or compaction asked for history below a shard's ``since``."""


class ShardNotFound(DefiniteError):
    """The remap store holds no shard of that name."""


class Reopen(TransientError):
    """The source must be opened again: durable state re-read, outputs
    described anew (an upstream schema change to evolve into, a lost snapshot
    to take again). The driver re-opens and carries on from durable state."""
