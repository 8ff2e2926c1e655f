"""One driver per pipeline: the state directory's lock and, with a PostgreSQL
remap store, the store's advisory lock. A second claim is refused with the
holder's pid, host and start; a holder killed with SIGKILL holds nothing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from reclock.core.errors import AlreadyRunning
from reclock.runtime.lock import DriverLock, holder_info
from remap_store.sql import SqlRemapStore

HOLD = """
import sys, time
from pathlib import Path
from reclock.runtime.lock import DriverLock
DriverLock.acquire(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_claim_names_the_holder_and_a_release_frees_it(tmp_path: Path) -> None:
    first = DriverLock.acquire(tmp_path)
    with pytest.raises(AlreadyRunning) as err:
        DriverLock.acquire(tmp_path)  # another open file: flock excludes it too
    assert f"as pid {os.getpid()} on host {socket.gethostname()} since 20" in str(err.value)
    assert str(tmp_path / "driver.lock") in str(err.value)
    assert err.value.holder is not None and err.value.holder["pid"] == os.getpid()
    first.release()
    first.release()  # twice is harmless
    with DriverLock.acquire(tmp_path):
        pass


def test_a_lock_left_by_kill_9_is_taken_over(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(AlreadyRunning, match=f"as pid {proc.pid} "):
            DriverLock.acquire(tmp_path)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    # The file still names the dead holder; the kernel dropped its lock.
    assert f'"pid": {proc.pid}' in (tmp_path / "driver.lock").read_text()
    with DriverLock.acquire(tmp_path):
        assert f'"pid": {os.getpid()}' in (tmp_path / "driver.lock").read_text()


def test_the_postgres_store_excludes_drivers_with_different_state_dirs(pg_url: str) -> None:
    """Two drivers on two hosts share only the store: its advisory lock
    refuses the second; it goes with the holder's session."""
    a, b = SqlRemapStore(pg_url), SqlRemapStore(pg_url)
    try:
        release = a.lock_driver({**holder_info(), "host": "host-a"})
        assert release is not None
        with pytest.raises(AlreadyRunning,
                           match=r"on host host-a since .* \(advisory lock in the remap store"):
            b.lock_driver(holder_info())
        release()
        release_b = b.lock_driver(holder_info())
        assert release_b is not None
        # The holder's session dies (a killed driver, a dropped connection):
        # the server drops its lock and a successor takes it.
        with psycopg.connect(pg_url, autocommit=True) as c:
            c.execute("SELECT pg_terminate_backend(pid) FROM pg_locks "
                      "WHERE locktype = 'advisory' AND pid <> pg_backend_pid() "
                      "AND database = (SELECT oid FROM pg_database "
                      "WHERE datname = current_database())")
        deadline = time.monotonic() + 30
        while True:
            try:
                release_a = a.lock_driver(holder_info())
                break
            except AlreadyRunning:
                assert time.monotonic() < deadline, "the dead session's lock was not dropped"
                time.sleep(0.2)
        assert release_a is not None
        release_a()
        release_b()
    finally:
        a.close()
        b.close()


def test_the_sqlite_store_leaves_it_to_the_state_dir(tmp_path: Path) -> None:
    store = SqlRemapStore(f"sqlite:///{tmp_path}/remap.db")
    try:
        assert store.lock_driver(holder_info()) is None
    finally:
        store.close()
