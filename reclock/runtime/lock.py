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
  :meth:`remap_store.sql.SqlRemapStore.lock_driver`).

The lock is a courtesy, not the guarantee: a driver that loses its store
session (a network partition) loses its advisory lock while it still runs,
and a successor may start. That zombie is fenced by the commits, as before;
``RECLOCK_SKIP_DRIVER_LOCK=1`` runs without the lock to rehearse exactly that.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

from reclock.core.errors import AlreadyRunning

LOCK_FILE = "driver.lock"


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
