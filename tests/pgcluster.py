"""A private PostgreSQL cluster with ``wal_level=logical`` for the tests.

The tests start their own cluster from the PostgreSQL server binaries
(Debian's, ``RECLOCK_PG_BINDIR`` or ``PATH``; tests/setup.sh installs them)
on a free port, with trust auth on 127.0.0.1, in a temporary directory owned
by the ``postgres`` user (initdb refuses to run as root). It is stopped and
removed at the end.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", path))


def _bin(name: str) -> str:
    """A server binary: ``RECLOCK_PG_BINDIR``, else the newest Debian install
    (``/usr/lib/postgresql/N/bin``), else ``PATH`` (as tests/setup.sh finds it)."""
    bindir = os.environ.get("RECLOCK_PG_BINDIR")
    if bindir and os.access(os.path.join(bindir, name), os.X_OK):
        return os.path.join(bindir, name)
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=_version_key)
    if found:
        return found[-1]
    on_path = shutil.which(name)
    if on_path:
        return on_path
    raise RuntimeError(f"PostgreSQL server binary {name!r} not found: run tests/setup.sh, "
                       "or set RECLOCK_PG_BINDIR to the directory that holds it")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres(args: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *args]
    return args


class PgCluster:
    """``start()`` -> ``url``; ``restart()`` (a database restart); ``stop()``."""

    def __init__(self, wal_level: str = "logical") -> None:
        self.wal_level = wal_level
        self.dir = Path(tempfile.mkdtemp(prefix="reclock-pg-"))
        self.data = self.dir / "data"
        self.port = _free_port()
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> PgCluster:
        subprocess.run(
            _as_postgres([_bin("initdb"), "-D", str(self.data), "-U", "postgres",
                          "--auth=trust", "-E", "UTF8", "--no-sync"]),
            check=True, capture_output=True,
        )
        with (self.data / "postgresql.conf").open("a") as f:
            f.write(
                f"\nport = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.dir}'\nwal_level = {self.wal_level}\n"
                "max_replication_slots = 20\nmax_wal_senders = 20\nfsync = off\n"
                "max_connections = 300\n"
                "synchronous_commit = off\nfull_page_writes = off\n"
            )
        with (self.data / "pg_hba.conf").open("a") as f:
            f.write("host replication all 127.0.0.1/32 trust\n")
        self._pg_ctl("start")
        return self

    def _pg_ctl(self, action: str) -> None:
        mode = ["-m", "fast"] if action != "start" else []
        subprocess.run(
            _as_postgres([_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"),
                          "-w", "-t", "60", action, *mode]),
            check=True, capture_output=True,
        )
        if action in ("start", "restart"):
            deadline = time.monotonic() + 30
            while True:
                try:
                    with psycopg.connect(self.url, connect_timeout=2) as c:
                        c.execute("select 1")
                    return
                except psycopg.OperationalError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)

    def restart(self) -> None:
        self._pg_ctl("restart")

    @contextlib.contextmanager
    def down(self) -> Iterator[None]:
        """The server stopped (fast: sessions cut) for the block, then
        started again on its data: an outage as long as the test needs, not
        one a busy client may miss between two calls."""
        self._pg_ctl("stop")
        try:
            yield
        finally:
            self._pg_ctl("start")

    def stop(self) -> None:
        try:
            self._pg_ctl("stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
