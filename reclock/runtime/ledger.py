"""What the driver knows each output committed, kept in the remap store.

A sink keeps its progress (upper and FromTime progress) atomically with its
data, and the driver resumes from what the sinks report. A sink that
reports *nothing committed* is taken at its word: the source reads from its
start again into it. That is right for an output that is new, and wrong for
one whose progress record was removed behind reclock's back (a Kafka sink's
``<topic>.reclock-progress`` deleted by a clean-up script, a table dropped,
a backup restored, the sink pointed at another target): its rows are
written a second time, or the ones retention removed are lost, with health
``running`` and nothing said.

So the driver keeps its own record of each output's committed upper, as a
fact of the source's remap shard (``sink:<output>`` -> ``{"upper": U}``,
``U`` null once the output is complete), and at every open compares what the
sink reports with it::

    ledger upper <= sink upper       the sink holds at least what was known
                                      (it may be ahead: a crash after a commit
                                      and before the ledger's next write)
    otherwise                        IdentityChanged: the output's progress was
                                      removed or rolled back; a definite error
                                      naming the output, both uppers and the
                                      recovery

The record is written after an output's first commit (before any later
commit: from then on "nothing committed" is never believed), after a
re-snapshot's commit (which may rebuild an output whose record was lost: it
replaces what was known), at most every :data:`RECORD_EVERY_S` otherwise, and
when the source stops. Between writes it lags behind the sinks, which the
comparison allows; a rollback smaller than that lag goes unseen, a removed
record never does.

An output with a pending ``reclock resnapshot`` request is not compared: the
request is the documented way to rebuild an output whose record was lost.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from typing import Any

from reclock.contracts.remap_store import RemapStore
from reclock.contracts.sink import SinkState
from reclock.core.errors import IdentityChanged

log = logging.getLogger(__name__)

#: The ledger is written at most this often (besides first commits and re-snapshots).
RECORD_EVERY_S = 10.0

PREFIX = "sink:"

#: an output the ledger knows nothing of
UNKNOWN = object()


def _upper_text(upper: int | None) -> str:
    return "complete (empty upper)" if upper is None else f"upper {upper}"


class CommitLedger:
    """The committed uppers of one source's outputs, as the driver last recorded them."""

    def __init__(self, store: RemapStore, shard: str) -> None:
        self.store = store
        self.shard = shard
        #: output name -> the upper as durable in the store
        self.known: dict[str, int | None] = {}
        self._written_at = float("-inf")

    def read(self) -> None:
        """Load what the store holds (at every open of the source)."""
        known: dict[str, int | None] = {}
        for key, value in self.store.facts(self.shard).items():
            if key.startswith(PREFIX):
                try:
                    known[key[len(PREFIX):]] = json.loads(value)["upper"]
                except (ValueError, KeyError, TypeError):
                    log.warning("source %s: unreadable ledger entry %s=%r (ignored)",
                                self.shard, key, value)
        self.known = known

    def check(self, output: str, sink: Any, state: SinkState) -> None:
        """Raise :class:`IdentityChanged` if ``state`` (what ``sink`` reports
        for ``output`` now) is behind what the ledger knows it committed."""
        if output not in self.known:
            return
        upper = self.known[output]
        if state.progress is not None and SinkState(upper).less_equal(state):
            return
        found = "nothing committed" if state.progress is None else _upper_text(state.upper)
        raise IdentityChanged(
            f"source {self.shard!r} output {output!r}: its sink {sink!r} reports {found}, "
            f"but this pipeline committed it up to {_upper_text(upper)}: the output's "
            "progress record was removed or rolled back (a progress topic or table deleted, "
            "a backup restored, or the sink pointed at another target), so resuming from "
            "it would write its rows again or skip them",
            hint="restore the output's progress record (for a Kafka sink, the topic "
                 "<topic>.reclock-progress), or rebuild the output from the source with "
                 f"`reclock resnapshot FILE {self.shard} {output.split('.', 1)[0]}` "
                 "(every sink of the output; rows the target "
                 "already holds stay there: remove them first if they must go)")

    def record(self, states: Iterable[tuple[str, SinkState]], force: bool = False) -> None:
        """Record the outputs' committed uppers if they changed: at once when
        an output committed for the first time or ``force``, otherwise at
        most every :data:`RECORD_EVERY_S`."""
        now: dict[str, int | None] = {
            name: st.upper for name, st in states if st.progress is not None}
        changed = {n: u for n, u in now.items() if n not in self.known or self.known[n] != u}
        if not changed:
            return
        due = (force or any(n not in self.known for n in changed)
               or time.monotonic() - self._written_at >= RECORD_EVERY_S)
        if not due:
            return
        self.store.put_facts(self.shard, {
            PREFIX + n: json.dumps({"upper": u}) for n, u in changed.items()})
        self.known.update(changed)
        self._written_at = time.monotonic()

    def replace(self, output: str, state: SinkState) -> None:
        """Record ``output``'s state now, even behind what was known (an
        output rebuilt by a re-snapshot)."""
        if state.progress is None:
            return
        self.store.put_facts(self.shard, {PREFIX + output: json.dumps({"upper": state.upper})})
        self.known[output] = state.upper
