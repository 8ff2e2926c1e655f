"""A local S3 endpoint for the tests (moto's server, from PyPI), and a proxy in
front of it that can kill a driver in the middle of a Delta commit.

:class:`S3Server` runs ``python -m moto.server`` on a free loopback port for
the whole test run; :meth:`S3Server.bucket` makes a fresh bucket per test.
moto enforces S3's conditional writes (``If-None-Match: *``), which delta-rs
uses to commit, so two committers of one version fence each other here as on
AWS.

:class:`CommitTrap` is a TCP proxy. It forwards bytes both ways and watches
the requests for a Delta commit: a ``PUT`` of ``_delta_log/<20 digits>.json``.
When :meth:`CommitTrap.arm` armed it, the next commit request is met with one
of:

* ``"kill_before"`` -- SIGKILL the driver, the request never reaches S3;
* ``"kill_after"`` -- forward it, and SIGKILL the driver once S3 has answered,
  before the answer reaches it (the commit is durable; the driver never knew);
* ``"drop_answer"`` -- forward it and hang up on the driver instead of giving
  it S3's answer: the driver lives on with an ambiguous commit.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress

KEY_ID, SECRET = "reclock-test", "reclock-test-secret-9f3a"
REGION = "us-east-1"
_COMMIT = re.compile(rb"PUT /[^ ]*_delta_log/\d{20}\.json[ ?]")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes] | None, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"moto server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port} after {timeout} s")


class S3Server:
    """moto's S3 server on loopback."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, self.proc)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def client(self) -> object:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=KEY_ID,
                            aws_secret_access_key=SECRET, region_name=REGION)

    def bucket(self) -> str:
        name = f"reclock-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)  # type: ignore[attr-defined]
        return name

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The ``AWS_*`` variables a driver reads (``endpoint``: a proxy's)."""
        return {"AWS_ENDPOINT_URL": endpoint or self.endpoint, "AWS_ACCESS_KEY_ID": KEY_ID,
                "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": REGION}

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        out: list[str] = []
        pages = self.client().get_paginator("list_objects_v2")  # type: ignore[attr-defined]
        for page in pages.paginate(Bucket=bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class CommitTrap:
    """A loopback proxy to ``port`` that springs on Delta commit requests."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._mode: str | None = None
        self._pid: int | None = None
        self.sprung: list[str] = []  # modes that fired, in order
        self.commits_seen = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, mode: str | None, pid: int | None = None) -> None:
        """Spring ``mode`` on the next commit request (``None``: disarm)."""
        assert mode in (None, "kill_before", "kill_after", "drop_answer"), mode
        with self._lock:
            self._mode, self._pid = mode, pid

    def _take(self) -> tuple[str | None, int | None]:
        with self._lock:
            self.commits_seen += 1
            mode, pid = self._mode, self._pid
            self._mode = None
            if mode is not None:
                self.sprung.append(mode)
            return mode, pid

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream), 5)
            except OSError:
                client.close()
                continue
            state: dict[str, str | int | None] = {"mode": None, "pid": None}
            threading.Thread(target=self._requests, args=(client, server, state),
                             daemon=True).start()
            threading.Thread(target=self._answers, args=(server, client, state),
                             daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket,
                  state: dict[str, str | int | None]) -> None:
        with suppress(OSError):
            while data := client.recv(65536):
                if _COMMIT.search(data):
                    mode, pid = self._take()
                    if mode == "kill_before" and pid is not None:
                        os.kill(pid, signal.SIGKILL)
                        break
                    state["mode"], state["pid"] = mode, pid
                server.sendall(data)
        _close(client, server)

    def _answers(self, server: socket.socket, client: socket.socket,
                 state: dict[str, str | int | None]) -> None:
        with suppress(OSError):
            while data := server.recv(65536):
                mode, pid = state["mode"], state["pid"]
                if mode == "kill_after" and isinstance(pid, int):
                    os.kill(pid, signal.SIGKILL)
                    break
                if mode == "drop_answer":
                    break
                client.sendall(data)
        _close(client, server)

    def close(self) -> None:
        self._closed = True
        self.listener.close()


def _close(*socks: socket.socket) -> None:
    for s in socks:
        with suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        with suppress(OSError):
            s.close()


@contextmanager
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    try:
        yield server
    finally:
        server.close()
