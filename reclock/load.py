"""``reclock load FILE SOURCE OUTPUT --from PATH_OR_URL``: a one-shot load.

The command lists the files as they are now, and queues a request for the
``oneshot`` source (:mod:`reclock.sources.oneshot`); a running driver takes it up
within a tick (otherwise the next ``reclock run`` does) and lands it in the
output at one IntoTime, in one commit. A request identical to a load already
taken (same output, files with the same sizes and versions, same options) is
not queued, unless ``force``. With a driver running (or ``wait``), the
command waits for the load to be durable and reports it: the IntoTime, rows
and error rows the output holds at the load's position, files and seconds.

SIGINT (Ctrl-C) or SIGTERM cancels the load: the command asks the driver to
(:class:`reclock.sources.oneshot.ledger.Ledger` ``cancel``), waits for it to act,
prints what happened and exits with 128 + the signal. The first of the
load's tasks to see the cancel (as it starts, or between batches) fails, so
Spark aborts the job and commits nothing; the driver's next plan of the
load finds it cancelled and moves the output past its position with
nothing in it. A load already durable stays loaded (the
line says so). The same load asked again is loaded, once, at a new position.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import pyarrow.compute as pc

from reclock.core.columns import ERROR, INTO_TIME, SRC_OFFSET
from reclock.core.errors import DefiniteError

#: Seconds an interrupted ``reclock load`` waits for the driver to act on the cancel.
CANCEL_WAIT_S = 60.0


@dataclass
class LoadReport:
    #: "loaded" | "already loaded" | "already queued" | "queued" | "cancelled" |
    #: "cancel requested" (interrupted; the driver has not acted on it yet)
    state: str
    position: int | None = None
    into_time: int | None = None
    rows: int = 0
    errors: int = 0
    files: int = 0
    seconds: float = 0.0
    #: the signal that interrupted the command (its exit status is 128 + it)
    signal: int | None = None

    def line(self, output: str) -> str:
        sig = "" if self.signal is None else signal.Signals(self.signal).name
        if self.state == "cancelled":
            at = "" if self.position is None else f" (load #{self.position} holds nothing)"
            return (f"load into {output} cancelled ({sig}): nothing of it was loaded, the "
                    f"output is as it was{at}; run it again to load it")
        if self.state == "cancel requested":
            return (f"load into {output} interrupted ({sig}): cancel requested, not yet "
                    "confirmed by the driver (`reclock status`); the output holds all of it "
                    "or nothing of it")
        if self.state == "queued":
            return (f"load of {self.files} files into {output} queued: the next `reclock run` "
                    "takes it up")
        what = (f"load #{self.position} into {output} at IntoTime {self.into_time}: "
                f"{self.rows} rows, {self.errors} error rows, {self.files} files")
        if self.state == "loaded":
            late = f"not cancelled ({sig}: it was durable first): " if sig else ""
            return f"{late}loaded {what}, {self.seconds:.1f} s"
        return f"{self.state} as {what}: nothing to do (--force loads again)"


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Interrupts:
    """SIGINT and SIGTERM during :func:`load` (main thread only): before the
    request is written (``queued`` false) a signal raises
    :class:`_Interrupted`, there being nothing to undo; from then on it is
    recorded in ``got`` and the load is cancelled."""

    def __init__(self) -> None:
        self.got: list[int] = []
        self.queued = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handler)
                         for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _handler(self, signum: int, _frame: Any) -> None:
        self.got.append(signum)
        if not self.queued:
            raise _Interrupted(signum)


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
    driver runs. SIGINT or SIGTERM cancels it (:func:`_cancel`)."""
    from reclock.pipeline import Pipeline
    from reclock.sources.oneshot import OneShotSource

    pipe = Pipeline(cfg)
    try:
        with _Interrupts() as sig:
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
            queued = [r for r in conn.ledger.requests()
                      if r.get("fingerprint") == doc["fingerprint"]
                      and conn.ledger.position_of(str(r["id"])) is None]
            t0 = time.monotonic()
            sig.queued = True  # from here a signal cancels the request
            if queued and not force:
                rid = str(queued[0]["id"])
                state = "already queued"
            else:
                rid = conn.ledger.request({**doc, "force": force}, pipe.clock.now())
                state = "loaded"
            if wait is None:
                wait = driver_running(pipe.state_dir)
            deadline = time.monotonic() + timeout_s
            while not sig.got:
                if not wait:
                    return LoadReport("queued", files=nfiles)
                taken, k = conn.status_of(rid)
                if taken == "skipped" and k == -1:
                    raise DefiniteError(f"the driver refused the load: source {source!r} has "
                                        f"no output {output!r} (any longer)")
                if taken == "skipped" and k is not None:
                    return _report(pipe, src, out, conn, k, "already loaded", nfiles, 0.0)
                if taken == "loaded" and k is not None and _durable(out, k):
                    return _report(pipe, src, out, conn, k, state, nfiles,
                                   time.monotonic() - t0)
                if time.monotonic() > deadline:
                    raise DefiniteError(f"the load was not durable after {timeout_s:.0f} s",
                                        hint="it stays queued: is `reclock run` running? "
                                             "(reclock status)")
                time.sleep(0.2)
            return _cancel(pipe, src, out, conn, rid, sig, nfiles, t0)
    except _Interrupted as exc:  # before anything was queued
        return LoadReport("cancelled", signal=exc.signum)
    finally:
        pipe.close()


def _cancel(pipe: Any, src: Any, out: Any, conn: Any, rid: str, sig: _Interrupts,
            nfiles: int, t0: float) -> LoadReport:
    """Cancel request ``rid`` and wait (up to :data:`CANCEL_WAIT_S`, or until a
    second signal) for the driver to act on it: the request skipped, or its
    position found cancelled by the driver's plan (its job's tasks stop at
    their next batch, the job fails and commits nothing; the output never
    holds any of it); or the load was durable first. With no driver running,
    the next one's probe or plan acts on it."""
    first = sig.got[0]
    conn.ledger.cancel(rid, pipe.clock.now())
    deadline = time.monotonic() + CANCEL_WAIT_S
    while True:
        taken, k = conn.status_of(rid)
        if taken == "cancelled":
            return LoadReport("cancelled", k, files=nfiles, signal=first)
        if taken == "loaded" and k is not None and _durable(out, k):
            conn.ledger.forget_cancel(rid)
            report = _report(pipe, src, out, conn, k, "loaded", nfiles, time.monotonic() - t0)
            report.signal = first
            return report
        if taken == "skipped" and k is not None:  # a duplicate of a load already held
            return _report(pipe, src, out, conn, k, "already loaded", nfiles, 0.0)
        if not driver_running(pipe.state_dir):
            # the next driver skips the request (or finds its position cancelled)
            return LoadReport("cancelled", k, files=nfiles, signal=first)
        if len(sig.got) > 1 or time.monotonic() > deadline:
            return LoadReport("cancel requested", k, files=nfiles, signal=first)
        time.sleep(0.1)


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
