"""A private MariaDB server with a row-format binary log, for the tests.

The tests start their own server from Debian's packages (``mariadbd`` and
``mariadb-install-db``; tests/setup.sh installs them) in a temporary
directory, on a free port of 127.0.0.1 with its socket beside its data, run as
the ``mysql`` user when the tests run as root. It writes its binary log in
ROW format with full row images and metadata (what the ``mysql`` source
needs), and is stopped and removed at the end. One server per test run; each
test takes a database of its own (``database()``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pymysql


def _bin(name: str) -> str:
    for path in (f"/usr/sbin/{name}", f"/usr/bin/{name}"):
        if os.access(path, os.X_OK):
            return path
    found = shutil.which(name)
    if found:
        return found
    raise RuntimeError(f"MariaDB binary {name!r} not found: run tests/setup.sh "
                       "(Debian's mariadb-server package)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MariaDB:
    """``start()`` -> ``url`` (root, no password); ``connect()``; ``stop()``."""

    def __init__(self, **settings: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="reclock-mariadb-"))
        self.data = self.dir / "data"
        self.socket = self.dir / "mysqld.sock"
        self.port = _free_port()
        self.settings = {
            "log-bin": str(self.dir / "data" / "binlog"), "binlog-format": "ROW",
            "binlog-row-image": "FULL", "binlog-row-metadata": "FULL", "server-id": "1",
            **settings}
        self.url = f"mysql://root@127.0.0.1:{self.port}/"
        self.proc: subprocess.Popen[bytes] | None = None
        self.user = "mysql" if os.geteuid() == 0 else None
        if self.user:
            shutil.chown(self.dir, self.user, self.user)

    def _install(self, user: list[str]) -> None:
        """The system tables. A failure says what the tool printed (a CI run
        once failed here with its output hidden): the first is printed to
        stderr and retried once on a fresh data directory, a second raises."""
        for attempt in (1, 2):
            shutil.rmtree(self.data, ignore_errors=True)
            r = subprocess.run([_bin("mariadb-install-db"), "--no-defaults", *user,
                                f"--datadir={self.data}",
                                "--auth-root-authentication-method=normal", "--skip-test-db"],
                               capture_output=True, check=False)
            if r.returncode == 0:
                return
            out = (r.stdout + r.stderr).decode(errors="replace")[-3000:]
            if attempt == 2:
                raise RuntimeError(f"mariadb-install-db failed twice (exit {r.returncode}): {out}")
            print(f"mariadb-install-db failed (exit {r.returncode}); once more: {out}",
                  file=sys.stderr, flush=True)

    def start(self) -> MariaDB:
        user = ["--user=" + self.user] if self.user else []
        self._install(user)
        args = [_bin("mariadbd"), "--no-defaults", *user, f"--datadir={self.data}",
                f"--socket={self.socket}", f"--port={self.port}", "--bind-address=127.0.0.1",
                f"--pid-file={self.dir / 'mysqld.pid'}", f"--log-error={self.dir / 'error.log'}",
                "--innodb-flush-log-at-trx-commit=0", "--sync-binlog=0",
                "--innodb-buffer-pool-size=64M", "--innodb-log-file-size=48M",
                "--skip-name-resolve", "--max-connections=300",
                *(f"--{k}={v}" for k, v in self.settings.items())]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.connect().close()
                return self
            except pymysql.err.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.dir / "error.log").read_text(errors="replace")[-2000:]
                    self.stop()
                    raise RuntimeError(f"mariadbd did not start: {log}") from None
                time.sleep(0.1)

    def connect(self, database: str | None = None, **kw: Any) -> pymysql.Connection[Any]:
        return pymysql.connect(host="127.0.0.1", port=self.port, user="root",
                               database=database, autocommit=True, charset="utf8mb4", **kw)

    def execute(self, *statements: str, database: str | None = None) -> list[tuple[Any, ...]]:
        """Run statements; the last one's rows."""
        rows: list[tuple[Any, ...]] = []
        with self.connect(database) as conn, conn.cursor() as cur:
            for s in statements:
                cur.execute(s)
                rows = list(cur.fetchall())
        return rows

    def database(self) -> tuple[str, str]:
        """A fresh database: ``(name, url)``."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        self.execute(f"CREATE DATABASE `{name}`")
        return name, f"{self.url}{name}"

    def stop(self) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
