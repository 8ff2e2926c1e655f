"""One driver per pipeline.

A second ``reclock run`` of the same pipeline would only take turns with the
first -- the remap store's compare-and-append and the sinks' fenced commits
keep the data correct -- but the user asked for one pipeline, not two drivers
fencing each other. So a driver holds a lock for its life:

* an exclusive ``flock`` on ``STATE_DIR/driver.lock``, which names the holder
  (pid, host, start time) for the refusal message. The kernel drops the lock
  when its process dies, however it dies: a lock left behind by ``kill -9``
  is no lock, and the next driver takes it over at once.
* with a PostgreSQL remap store, also a session advisory lock keyed on the
  pipeline's identity (minted once in the store), so that two drivers with
  different state directories on different hosts exclude each other too (see
  :meth:`reclock.remap_store.sql.SqlRemapStore.lock_driver`).

The store's lock is held for the driver's life and re-checked
(:class:`LockWatch`): an advisory lock lives in a database session, and a
server restart or a network cut ends the session and the lock with it, while
the driver runs on. Every :data:`LOCK_CHECK_S` a thread of its own asks the
session; when it is gone it takes the lock again on a new one. A commit
finding the last confirmation older than two such periods (the process was
frozen: a paused VM) asks first. While the lock is not held (or a check has
not answered for :data:`LOCK_STALE_S`) no source commits -- no binding is
appended, no sink commits -- and each source's health says which lock was
lost and why
(:class:`~reclock.core.errors.LockLost`, a stall). A driver that took the
lock meanwhile keeps it: this one then stops for good with
:class:`~reclock.core.errors.LockTaken`, naming that driver's pid and host
from the record it wrote in the store.

The lock is still not the guarantee: between a lost session and the next
check a driver may commit once more, and a successor may have started.
Such a zombie is fenced by the commits (docs/design.md, "Identity and
ownership");
``RECLOCK_SKIP_DRIVER_LOCK=1`` runs without the lock to rehearse exactly that.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reclock.contracts.remap_store import StoreLock
from reclock.core.errors import AlreadyRunning, LockLost, LockTaken, ReclockError

LOCK_FILE = "driver.lock"
#: How often a driver asks whether it still holds the store's lock.
LOCK_CHECK_S = 1.0
#: A check that has not answered for this long counts as a lost lock (a
#: connection that went silent).
LOCK_STALE_S = 10.0

log = logging.getLogger("reclock")


def holder_info() -> dict[str, Any]:
    """What a lock records about its holder."""
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "since": dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace(
                "+00:00", "Z")}


class DriverLock:
    """The state directory's lock, held from :meth:`acquire` to :meth:`release`."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, state_dir: Path) -> DriverLock:
        """Take the lock or raise :class:`AlreadyRunning` naming its holder."""
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise AlreadyRunning(holder, f"lock {path}") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder_info()) + "\n").encode(), 0)
        os.fsync(fd)
        return cls(path, fd)

    def release(self) -> None:
        """Unlock. The file stays: removing it would let a driver that opened
        the old file and one that creates a new file both hold "the" lock."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the last descriptor drops the flock

    def __enter__(self) -> DriverLock:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        raw = os.pread(fd, 4096, 0)
        value = json.loads(raw) if raw.strip() else None
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


class LockWatch:
    """Re-checks a store's driver lock (:class:`~reclock.contracts.remap_store.StoreLock`)
    every ``every_s`` on a thread of its own, from :meth:`start` to
    :meth:`stop`; :meth:`require` is the gate each commit passes (see the
    module docstring). ``monotonic`` is the clock ages are measured on."""

    def __init__(self, lock: StoreLock, *, every_s: float = LOCK_CHECK_S,
                 stale_s: float = LOCK_STALE_S,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.lock = lock
        self.every_s = every_s
        self.stale_s = stale_s
        self._now = monotonic
        self._confirmed = monotonic()
        #: builds the error a commit meets now (None: the lock is held)
        self._failure: Callable[[], ReclockError] | None = None
        #: the lock was taken by another driver: final
        self.taken: LockTaken | None = None
        self._mu = threading.Lock()  # one check at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="driver-lock", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.check()
            if self.taken is not None:
                return  # for good: nothing to take again

    def check(self) -> None:
        """Ask the lock once (the thread does, every ``every_s``)."""
        with self._mu:
            self._check()

    def _check(self) -> None:
        if self.taken is not None:
            return
        try:
            why = self.lock.check()
        except LockTaken as exc:
            log.error("%s", exc)
            self.taken = taken = exc
            self._failure = lambda: LockTaken(taken.holder, taken.where, taken.why)
            return
        except LockLost as exc:
            if self._failure is None:
                log.warning("%s", exc)
            where, lost = exc.where, exc.why
            self._failure = lambda: LockLost(where, lost)
            return
        except Exception as exc:  # a bug in the check: not held as far as we know
            log.warning("driver lock: checking it failed: %s", exc)
            where, text = self.lock.where, f"checking it failed ({exc})"
            self._failure = lambda: LockLost(where, text)
            return
        if why is not None or self._failure is not None:
            log.warning("driver lock (%s) held again (it was lost: %s)", self.lock.where,
                        why or "not confirmed")
        self._failure = None
        self._confirmed = self._now()

    def require(self) -> None:
        """Return when the lock is held; else raise what a commit meets:
        :class:`~reclock.core.errors.LockLost` (wait: it may be taken again)
        or :class:`~reclock.core.errors.LockTaken` (stop).

        A confirmation older than two check periods (the thread was held
        up, or the whole process was frozen while a successor may have
        started) is renewed here, before anything commits; a check that
        does not answer within ``stale_s`` counts as not held."""
        if self._failure is None and self._now() - self._confirmed > 2 * self.every_s:
            if not self._mu.acquire(timeout=self.stale_s):
                raise LockLost(self.lock.where, f"not confirmed for {self.stale_s:.0f} s (the "
                               "store does not answer)")
            try:
                if self._now() - self._confirmed > 2 * self.every_s:
                    self._check()
            finally:
                self._mu.release()
        failure = self._failure
        if failure is not None:
            raise failure()
