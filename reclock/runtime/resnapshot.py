"""``reclock resnapshot``: requests to read one output again from scratch.

A request is a file ``<state_dir>/resnapshot/<source>/<output>.json`` holding
when it was made. The running driver looks for requests between ticks, so a
request made while it runs is taken up within a tick, and one made while it
is down at the next start. The driver re-opens the source with the output
named (:meth:`reclock.contracts.source.Source.open`'s ``resnapshot``): a Postgres source
exports a new snapshot for it, and the job that covers the snapshot point
commits, in one step, the snapshot's rows and the retraction of everything
the output held before (see :meth:`Resnapshots.replaced`), all at the
snapshot point's IntoTime. A source that can read its records again (Kafka,
generators) is replayed instead, and the next commit of the output carries
the correction (:mod:`reclock.runtime.replay`).

:class:`Requests` keeps the requests (files); :class:`Resnapshots` is the
runner's room for them: the requests it took up at the last open, the
correction an output's commit carries, and the request's end.

The request is removed only after that commit, and only if it is still the
one that was taken up (a newer request starts over). A crash in between
leaves the request: the next run takes another snapshot, and replacing an
output by its table's current contents twice changes nothing the second time.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from reclock.contracts.consolidate import COUNT, consolidate
from reclock.contracts.rows import output_schema
from reclock.contracts.sink import SinkState
from reclock.core.bindings import Bindings
from reclock.core.columns import DIFF, INTO_TIME, RESNAPSHOT_PART, SRC_OFFSET, SRC_PART, SRC_SEQ
from reclock.core.errors import DefiniteError, Reopen
from reclock.runtime.replay import heal
from reclock.runtime.site import OutputRuntime, Site
from reclock.runtime.upsert_state import UpsertState

log = logging.getLogger("reclock.driver")

#: Seconds after which :meth:`Requests.changed` says yes whatever the directory shows.
RELIST_S = 5.0


class Requests:
    """The resnapshot requests of one source."""

    def __init__(self, state_dir: Path, source: str) -> None:
        self.dir = state_dir / "resnapshot" / source  # names are identifiers (config)
        self._seen: tuple[int, int] | None = (-1, -1)  # never seen
        self._listed = 0.0

    def _file(self, output: str) -> Path:
        return self.dir / f"{output}.json"

    def request(self, output: str, now_ms: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self._file(output).with_suffix(".tmp")
        tmp.write_text(json.dumps({"output": output, "requested_ms": now_ms}))
        os.replace(tmp, self._file(output))

    def changed(self) -> bool:
        """Whether the requests may have changed since the last call: the
        directory's modification time changes with every file made or
        removed in it, so a driver asks this cheaply every tick and lists the
        files only then (and every :data:`RELIST_S` anyway: two changes within
        the file system's clock granularity can leave the time as it was)."""
        try:
            st = self.dir.stat()
            seen: tuple[int, int] | None = (st.st_mtime_ns, st.st_ino)
        except OSError:
            seen = None
        now = time.monotonic()
        if seen == self._seen and now - self._listed < RELIST_S:
            return False
        self._seen, self._listed = seen, now
        return True

    def pending(self) -> dict[str, int]:
        """Output name -> when it was requested (ms)."""
        out: dict[str, int] = {}
        try:
            entries = list(self.dir.glob("*.json"))
        except OSError:
            return out
        for f in entries:
            try:
                doc = json.loads(f.read_text())
                out[str(doc["output"])] = int(doc["requested_ms"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # half-written or foreign: ignored
        return out

    def done(self, output: str, requested_ms: int) -> None:
        """Remove the request, unless a newer one replaced it meanwhile."""
        if self.pending().get(output) == requested_ms:
            self._file(output).unlink(missing_ok=True)


class Resnapshots:
    """The resnapshot requests of one running source: those taken up by
    the last open (output index -> when it was requested), and what an
    output's commit does for them."""

    def __init__(self, site: Site, requests: Requests | None) -> None:
        self.site = site
        #: ``reclock resnapshot`` requests (None: not taken)
        self.requests = requests
        self.taken: dict[int, int] = {}
        #: slots of the outputs taken that committed their replacement (an
        #: output's request ends once each of its sinks did)
        self.replaced_slots: set[int] = set()

    def requested(self) -> dict[int, int]:
        """The pending resnapshot requests of this source's outputs."""
        if self.requests is None or not self.site.source.can_resnapshot:
            return {}
        self.requests.changed()  # what is listed now is seen
        index = {o.name: o.index for o in self.site.outputs}
        return {index[n]: t for n, t in self.requests.pending().items() if n in index}

    def take(self) -> None:
        """At open: take up the pending requests."""
        self.taken = self.requested()
        self.replaced_slots = set()

    def new(self) -> bool:
        """Whether a request was made that the last open did not take up
        (asked every tick: cheap while the directory stays as it was)."""
        return (self.requests is not None and self.requests.changed()
                and bool(self.requested().items() - self.taken.items()))

    def replacing(self, out: OutputRuntime, snapshots: frozenset[int], cur: SinkState) -> bool:
        """Whether this commit of ``out`` replaces what it holds: a job with
        its snapshot's chunks, or (a source that reads its records again)
        the output's first commit since the open."""
        return out.index in self.taken and out.slot not in self.replaced_slots and (
            out.index in snapshots or (self.site.source.replayable and cur.upper is not None))

    def correction(self, b: Bindings[Any], out: OutputRuntime, cur: SinkState,
                   keys: UpsertState | None) -> pa.Table:
        """What a replacing commit of ``out`` stages before its job's rows: a
        replay's correction at the output's upper (a keyed output's key
        state becomes the replay's), or the retraction of what it holds
        (:meth:`replaced`). A correction that cannot be done drops the
        request and re-opens (:class:`~reclock.core.errors.Reopen`)."""
        if not self.site.source.replayable:
            return self.replaced(b, out)
        # the correction at the output's upper, before this job's rows
        assert cur.upper is not None
        try:
            extra, healed = heal(self.site.source, out, b, cur.upper)
        except DefiniteError as exc:
            # It cannot be done (retention removed what it needs
            # meanwhile, ...): the request goes, and the output
            # goes on from its durable state (its key state too).
            self.refused(out, exc)
            raise Reopen(f"source {self.site.name!r}: output {out.name!r} was not "
                         "re-snapshotted", hint=exc.hint) from exc
        if healed is not None and keys is not None:
            keys.take(healed)
        return extra

    def replaced(self, b: Bindings[Any], out: OutputRuntime) -> pa.Table:
        """What a re-snapshotted output retracts, at its snapshot's position
        and IntoTime: everything it holds, read back and consolidated (a row
        held ``n`` times is retracted ``n`` times; a row a damaged log holds
        ``-1`` times is put back once). Its snapshot's rows then insert the
        table's contents (a keyed output's key state starts empty for them:
        see :meth:`~reclock.runtime.keyed.KeyedState.open`), so the output
        holds exactly the snapshot and its log stays a valid history
        whatever was done to it behind our back."""
        pos = self.site.source.snapshot_position(out.index)
        if pos is None:
            raise AssertionError(f"output {out.name!r}: a snapshot job without its snapshot")
        into = int(b.reclock_positions(np.array([pos[0]]), np.array([pos[1]]))[0])
        schema = output_schema(out.user_schema)
        held = out.sink.read_updates()
        # (a column the output gained since its last commit is not in the
        # sink yet: the rows it holds hold it null)
        names = [n for n in out.user_schema.names if n in held.column_names]
        counts = consolidate(held, None, names)
        n = counts.num_rows
        cols: dict[str, Any] = {c: counts.column(c) for c in names}
        cols.update({
            INTO_TIME: pa.array(np.full(n, into, np.int64)),
            DIFF: pc.negate(counts.column(COUNT)),
            SRC_PART: pa.array(np.full(n, RESNAPSHOT_PART, np.int32)),
            SRC_OFFSET: pa.array(np.full(n, pos[1], np.int64)),
            SRC_SEQ: pa.array(np.arange(n, dtype=np.int32)),
        })
        return pa.table({f.name: cols[f.name] if f.name in cols else pa.nulls(n, f.type)
                         for f in schema}).cast(schema)

    def refused(self, out: OutputRuntime, exc: DefiniteError) -> None:
        """A re-snapshot that cannot be done: its request is removed, said why."""
        name = self.site.name
        log.error("source %s: output %s cannot be re-snapshotted: %s (%s); the request is "
                  "dropped", name, out.name, exc, exc.hint)
        self.site.events.log(name, "resnapshot", outputs=[out.name], state="failed",
                             error=str(exc.args[0] if exc.args else exc), hint=exc.hint)
        requested = self.taken.pop(out.index, None)
        if self.requests is not None and requested is not None:
            self.requests.done(out.name, requested)

    def done(self, out: OutputRuntime) -> None:
        """``out`` committed its replacement: its request ends."""
        self.replaced_slots.add(out.slot)
        if self.requests is None or any(
                o.index == out.index and o.slot not in self.replaced_slots
                for o in self.site.outputs):
            return
        self.requests.done(out.name, self.taken.pop(out.index))
        self.site.events.log(self.site.name, "resnapshot", outputs=[out.name],
                             state="committed")
        log.warning("source %s: output %s re-snapshotted", self.site.name, out.name)
