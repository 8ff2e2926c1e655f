"""Named crash points for fault-injection tests.

The commit path calls :func:`crash_point` at each step. When the environment
variable ``RECLOCK_CRASH_AT`` names that point (``point`` or
``point:probability``, several separated by commas) the process kills itself
with SIGKILL there, exactly as ``kill -9`` would: no cleanup, no flush. With no
variable set this costs one dictionary lookup.

Points, in commit order: ``after_mint``, ``after_stage``, ``after_sink_commit``
(between outputs), ``after_upper_advance``, ``after_acknowledge``.
"""

from __future__ import annotations

import os
import random
import signal

POINTS = (
    "after_mint",
    "after_stage",
    "after_sink_commit",
    "after_upper_advance",
    "after_acknowledge",
)


def _parse(spec: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, prob = item.partition(":")
        if name not in POINTS:
            raise ValueError(f"RECLOCK_CRASH_AT: unknown crash point {name!r}; one of {POINTS}")
        out[name] = float(prob) if prob else 1.0
    return out


_SPEC = _parse(os.environ.get("RECLOCK_CRASH_AT", ""))
_RNG = random.Random(os.environ.get("RECLOCK_CRASH_SEED"))


def crash_point(name: str) -> None:
    """SIGKILL this process here if ``RECLOCK_CRASH_AT`` asks for it."""
    if not _SPEC:
        return
    p = _SPEC.get(name)
    if p is not None and _RNG.random() < p:
        os.kill(os.getpid(), signal.SIGKILL)
