"""``reclock resnapshot``: requests to read one output again from scratch.

A request is a file ``<state_dir>/resnapshot/<source>/<output>.json`` holding
when it was made. The running driver looks for requests between ticks, so a
request made while it runs is taken up within a tick, and one made while it
is down at the next start. The driver re-opens the source with the output
named (:meth:`reclock.contracts.source.Source.open`'s ``resnapshot``): a Postgres source
exports a new snapshot for it, and the job that covers the snapshot point
commits, in one step, the snapshot's rows and the retraction of everything
the output held before (see :meth:`SourceRunner._replaced`), all at the
snapshot point's IntoTime. A source that can read its records again (Kafka,
generators) is replayed instead, and the next commit of the output carries
the correction (:mod:`reclock.runtime.replay`).

The request is removed only after that commit, and only if it is still the
one that was taken up (a newer request starts over). A crash in between
leaves the request: the next run takes another snapshot, and replacing an
output by its table's current contents twice changes nothing the second time.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

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
