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
from typing import Any

import psycopg
import pytest

from reclock.core.errors import AlreadyRunning, LockLost, LockTaken
from reclock.remap_store.sql import SqlRemapStore
from reclock.runtime.lock import DriverLock, holder_info
from tests.running import wait_for

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
        lock_a = a.lock_driver({**holder_info(), "host": "host-a"})
        assert lock_a is not None
        with pytest.raises(AlreadyRunning,
                           match=r"on host host-a since .* \(advisory lock in the remap store"):
            b.lock_driver(holder_info())
        lock_a.release()
        lock_b = b.lock_driver(holder_info())
        assert lock_b is not None
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
                lock_a = a.lock_driver(holder_info())
                break
            except AlreadyRunning:
                assert time.monotonic() < deadline, "the dead session's lock was not dropped"
                time.sleep(0.2)
        assert lock_a is not None
        lock_a.release()
        lock_b.release()
    finally:
        a.close()
        b.close()


def test_the_sqlite_store_leaves_it_to_the_state_dir(tmp_path: Path) -> None:
    store = SqlRemapStore(f"sqlite:///{tmp_path}/remap.db")
    try:
        assert store.lock_driver(holder_info()) is None
    finally:
        store.close()


def _kill_sessions_holding_advisory_locks(url: str) -> None:
    """End every other session of the database holding an advisory lock
    (what a server restart does to a driver's lock session), and wait until
    they are gone (termination is asynchronous)."""
    held = ("SELECT pid FROM pg_locks WHERE locktype = 'advisory' "
            "AND pid <> pg_backend_pid() AND database = (SELECT oid FROM pg_database "
            "WHERE datname = current_database())")
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(f"SELECT pg_terminate_backend(pid) FROM ({held}) h")
        wait_for(lambda: c.execute(held).fetchone() is None, 30,
                 "the terminated sessions to end")


def test_the_store_lock_is_held_again_after_a_server_restart(cdc_url: str,
                                                             pg_logical: Any) -> None:
    """The advisory lock lives in a session: a restart of the server ends
    it. ``check`` notices, says it was lost while the server is down, takes
    it again once it is back (saying why it had been lost), and a second
    driver is refused again, naming the first."""
    a, b = SqlRemapStore(cdc_url), SqlRemapStore(cdc_url)
    try:
        lock = a.lock_driver({**holder_info(), "host": "host-a"})
        assert lock is not None and lock.check() is None
        with pg_logical.down():
            with pytest.raises(LockLost, match="its session ended") as lost:
                lock.check()
            assert lock.where in str(lost.value)
            with pytest.raises(LockLost, match="cannot be taken again yet"):
                lock.check()  # still down: not held, still ours to take
        why = lock.check()
        assert why is not None and "its session ended" in why
        assert lock.check() is None
        with pytest.raises(AlreadyRunning, match="on host host-a since"):
            b.lock_driver(holder_info())
        lock.release()
    finally:
        a.close()
        b.close()


def test_a_store_lock_taken_meanwhile_stays_with_its_taker(cdc_url: str) -> None:
    """The first driver's session ends; a second driver takes the lock
    before the first asks again. The second keeps it: the first's check is
    a definite error naming the second from the store's record, and stays
    so."""
    a, b = SqlRemapStore(cdc_url), SqlRemapStore(cdc_url)
    try:
        lock_a = a.lock_driver({**holder_info(), "host": "host-a"})
        assert lock_a is not None
        _kill_sessions_holding_advisory_locks(cdc_url)
        lock_b = b.lock_driver({"pid": 4242, "host": "host-b", "since": "2026-01-01T00:00:00Z"})
        assert lock_b is not None
        with pytest.raises(LockTaken, match=r"now held by pid 4242 on host host-b") as taken:
            lock_a.check()
        assert taken.value.holder is not None and taken.value.holder["host"] == "host-b"
        assert "its session ended" in str(taken.value)
        with pytest.raises(LockTaken):
            lock_a.check()
        assert lock_b.check() is None  # the taker keeps it
        lock_a.release()
        lock_b.release()
    finally:
        a.close()
        b.close()


def test_a_commit_after_a_freeze_asks_the_lock_first(cdc_url: str) -> None:
    """The gate (``LockWatch.require``) with its checking thread not
    started and its clock driven by hand: within two check periods of the
    last confirmation it trusts it; past them (the process was frozen) it
    asks the store before anything commits, and meets the successor."""
    from reclock.runtime.lock import LockWatch

    a, b = SqlRemapStore(cdc_url), SqlRemapStore(cdc_url)
    now = [100.0]
    try:
        lock_a = a.lock_driver({**holder_info(), "host": "host-a"})
        assert lock_a is not None
        watch = LockWatch(lock_a, every_s=1.0, monotonic=lambda: now[0])
        watch.require()
        _kill_sessions_holding_advisory_locks(cdc_url)
        lock_b = b.lock_driver({"pid": 4343, "host": "host-b", "since": "2026-01-02T00:00:00Z"})
        assert lock_b is not None
        now[0] += 1.5
        watch.require()  # confirmed 1.5 s ago: no check (the thread's job)
        now[0] += 1.0
        with pytest.raises(LockTaken, match="now held by pid 4343 on host host-b"):
            watch.require()
        assert watch.taken is not None
        with pytest.raises(LockTaken):
            watch.require()  # for good
        lock_a.release()
        lock_b.release()
    finally:
        a.close()
        b.close()
