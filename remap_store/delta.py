"""How a shard's bindings are stored: each frontier as what changed since the
previous binding, with a whole frontier every so often.

A row's text is either a whole frontier, the canonical JSON list of its
encoded elements (``[...]``, also the form of every row of an older
store), or a change
against the binding before it in the shard (``{"-": [removed], "+": [added]}``,
elements as encoded). The first row of a shard is always whole (compaction
rewrites the consolidated head whole), and so is every
:data:`CHECKPOINT`-th row, and any row whose change would not be shorter
than the whole frontier: a reader starting anywhere goes back at most
``CHECKPOINT - 1`` rows to the last whole one, and a store never grows by
more than the whole frontiers would take.

At 2,048 Kafka partitions of which a few move per interval, a binding takes
a few dozen bytes instead of 27 KB. Pure functions; :mod:`reclock.remap_store.sql`
does the reading and writing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from reclock.core.frontier_log import Log, builder

#: A whole frontier at least every this many rows.
CHECKPOINT = 64

#: Encoded elements keyed by a hashable form of themselves.
State = dict[Any, Any]


def _key(e: Any) -> Any:
    # Kafka's and GTID's elements encode as [lo, hi, offset]; total orders
    # as an int or a string
    return tuple(e) if isinstance(e, list) else e


def is_whole(text: str) -> bool:
    return text.lstrip()[:1] == "["


def state_of(encoded: list[Any]) -> State:
    return {_key(e): e for e in encoded}


class Chain:
    """Rows read in time order: the frontier after each. A whole row is kept
    as its list (keyed only when a change row follows), and changes apply in
    place: reading a shard of whole rows costs what it did before changes."""

    def __init__(self, state: State | None = None, since_whole: int = 0) -> None:
        """``state``: the frontier of the row before the first applied (a
        copy is kept), ``since_whole`` rows after the last whole one."""
        self._whole: list[Any] | None = None
        self._keyed: State | None = None if state is None else dict(state)
        #: Rows applied since the last whole one (0: the last was whole).
        self.since_whole = since_whole

    def apply(self, text: str) -> None:
        value = json.loads(text)
        if isinstance(value, list):
            self._whole, self._keyed = value, None
            self.since_whole = 0
            return
        if not isinstance(value, dict) or (self._whole is None and self._keyed is None):
            raise ValueError(f"a change row with no whole frontier before it: {text[:80]!r}")
        if self._keyed is None:
            self._keyed = state_of(self._whole or [])
        self._whole = None
        self.since_whole += 1
        for e in value.get("-", ()):
            self._keyed.pop(_key(e), None)
        for e in value.get("+", ()):
            self._keyed[_key(e)] = e

    def elements(self) -> list[Any]:
        """The current frontier's encoded elements (a fresh list)."""
        if self._whole is not None:
            return list(self._whole)
        return list((self._keyed or {}).values())

    def state(self) -> State | None:
        """The current frontier keyed (None before any row)."""
        if self._whole is None and self._keyed is None:
            return None
        return dict(self._keyed) if self._keyed is not None else state_of(self._whole or [])


def build(kind: str, rows: Iterable[tuple[int, str]]) -> tuple[list[int], Log]:
    """The times and the frontier log (:mod:`reclock.core.frontier_log`) of
    rows in time order, the first whole: a change row is taken as the
    change it is, and a whole row as its difference from the frontier
    before it, so that no whole frontier is made per row. Each is checked
    against the one before it as it is taken."""
    b = builder(kind)
    times: list[int] = []
    for t, text in rows:
        value = json.loads(text)
        if isinstance(value, list):
            b.add_encoded(value)
        elif isinstance(value, dict) and times:
            b.add_change(value.get("-", ()), value.get("+", ()))
        else:
            raise ValueError(f"a change row with no whole frontier before it: {text[:80]!r}")
        times.append(t)
    return times, b.log()


def decode(rows: Iterable[tuple[int, str]]) -> Iterator[tuple[int, list[Any]]]:
    """``(time, encoded frontier)`` of rows in time order, the first whole."""
    chain = Chain()
    for t, text in rows:
        chain.apply(text)
        yield t, chain.elements()


class Writer:
    """The texts of successive frontiers appended after ``state`` (the last
    stored frontier, None for an empty shard) and ``since_whole`` rows after
    the last whole one."""

    def __init__(self, state: State | None, since_whole: int) -> None:
        self.state = state
        self.since_whole = since_whole

    def text(self, encoded: list[Any]) -> str:
        whole = json.dumps(encoded, separators=(",", ":"))
        cur = state_of(encoded)
        prev = self.state
        self.state = cur
        if prev is None or self.since_whole + 1 >= CHECKPOINT:
            self.since_whole = 0
            return whole
        change = json.dumps({"-": [e for k, e in prev.items() if k not in cur],
                             "+": [e for k, e in cur.items() if k not in prev]},
                            separators=(",", ":"))
        if len(change) >= len(whole):
            self.since_whole = 0
            return whole
        self.since_whole += 1
        return change
