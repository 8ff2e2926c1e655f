"""``reclock load FILE SOURCE OUTPUT --from PATH_OR_URL``: a one-shot load.

The command lists the files as they are now, and queues a request for the
``oneshot`` source (:mod:`sources.oneshot`); a running driver takes it up
within a tick (otherwise the next ``reclock run`` does) and lands it in the
output at one IntoTime, in one commit. A request identical to a load already
taken (same output, files with the same sizes and versions, same options) is
not queued, unless ``force``. With a driver running (or ``wait``), the
command waits for the load to be durable and reports it: the IntoTime, rows
and error rows the output holds at the load's position, files and seconds.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

import pyarrow.compute as pc

from reclock.core.columns import ERROR, INTO_TIME, SRC_OFFSET
from reclock.core.errors import DefiniteError


@dataclass
class LoadReport:
    state: str  # "loaded" | "already loaded" | "already queued" | "queued"
    position: int | None = None
    into_time: int | None = None
    rows: int = 0
    errors: int = 0
    files: int = 0
    seconds: float = 0.0

    def line(self, output: str) -> str:
        if self.state == "queued":
            return (f"load of {self.files} files into {output} queued: the next `reclock run` "
                    "takes it up")
        what = (f"load #{self.position} into {output} at IntoTime {self.into_time}: "
                f"{self.rows} rows, {self.errors} error rows, {self.files} files")
        if self.state == "loaded":
            return f"loaded {what}, {self.seconds:.1f} s"
        return f"{self.state} as {what}: nothing to do (--force loads again)"


def driver_running(state_dir: Any, fresh_s: float = 5.0) -> bool:
    """Whether a driver writes ``status.json`` (every second) now."""
    path = state_dir / "status.json"
    try:
        doc = json.loads(path.read_text())
        if time.time() - path.stat().st_mtime > fresh_s:
            return False
        os.kill(int(doc["pid"]), 0)
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def load(cfg: Any, source: str, output: str, spec: str, fmt: str | None = None,
         force: bool = False, wait: bool | None = None, timeout_s: float = 3600.0) -> LoadReport:
    """Queue a load (see the module docstring); ``wait`` None: wait when a
    driver runs."""
    from reclock.pipeline import Pipeline
    from sources.oneshot import OneShotSource

    pipe = Pipeline(cfg)
    try:
        src = pipe.source_config(source)
        if src.connector[0] != "oneshot":
            raise DefiniteError(f"source {source!r} is not a oneshot source",
                                hint="reclock load takes a source with a oneshot block")
        built = pipe.build_source(src)
        conn = built.source
        assert isinstance(conn, OneShotSource)
        try:  # a CSV output's delimiter: where its records start
            delimiter = str(getattr(src.output(output).format, "delimiter", ","))
        except KeyError:
            delimiter = ","  # no such output: describe says so
        doc = conn.describe(output, spec, fmt, delimiter=delimiter)
        out = next(o for o in built.outputs if o.name == output)
        nfiles = len(doc["files"])
        same = conn.ledger.same_as(doc["fingerprint"])
        if same is not None and not force:
            return _report(pipe, src, out, conn, same, "already loaded", nfiles, 0.0)
        queued = [r for r in conn.ledger.requests() if r.get("fingerprint") == doc["fingerprint"]
                  and conn.ledger.position_of(str(r["id"])) is None]
        t0 = time.monotonic()
        if queued and not force:
            rid = str(queued[0]["id"])
            state = "already queued"
        else:
            rid = conn.ledger.request({**doc, "force": force}, pipe.clock.now())
            state = "loaded"
        if wait is None:
            wait = driver_running(pipe.state_dir)
        if not wait:
            return LoadReport("queued", files=nfiles)
        deadline = time.monotonic() + timeout_s
        while True:
            taken, k = conn.status_of(rid)
            if taken == "skipped" and k == -1:
                raise DefiniteError(f"the driver refused the load: source {source!r} has no "
                                    f"output {output!r} (any longer)")
            if taken == "skipped" and k is not None:
                return _report(pipe, src, out, conn, k, "already loaded", nfiles, 0.0)
            if taken == "loaded" and k is not None and _durable(out, k):
                return _report(pipe, src, out, conn, k, state, nfiles, time.monotonic() - t0)
            if time.monotonic() > deadline:
                raise DefiniteError(f"the load was not durable after {timeout_s:.0f} s",
                                    hint="it stays queued: is `reclock run` running? "
                                         "(reclock status)")
            time.sleep(0.2)
    finally:
        pipe.close()


def _durable(out: Any, k: int) -> bool:
    """Whether the output's progress is past position ``k``."""
    held = out.sink.state().held("counter")
    if held is None:
        return False
    v = held.as_option()
    return v is None or int(v) > k


def _report(pipe: Any, src: Any, out: Any, conn: Any, k: int, state: str, files: int,
            seconds: float) -> LoadReport:
    updates = out.sink.read_updates()
    mine = updates.filter(pc.equal(updates.column(SRC_OFFSET), k))
    errors = mine.num_rows - mine.column(ERROR).null_count
    into = pc.max(mine.column(INTO_TIME)).as_py() if mine.num_rows else None
    if into is None:
        b = pipe.store.read(src.name)
        t = b.reclock_positions([0], [k])[0]
        into = int(t) if t >= 0 else None
    return LoadReport(state, k, into, mine.num_rows - errors, errors, files, seconds)
