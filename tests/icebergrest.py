"""Iceberg REST catalogs for the tests.

:class:`IcebergRestServer` is Apache Iceberg's own REST catalog server, the
one the ``apache/iceberg-rest-fixture`` image runs
(``org.apache.iceberg.rest.RESTCatalogServer``, Iceberg 1.11.0), over a JDBC
catalog on SQLite: a real peer, whose requirement checks are Iceberg's
(``CatalogHandlers``), not ours. Its jars come from Maven Central through
``tests/iceberg-rest/pom.xml``; ``tests/setup.sh`` resolves them once into
``$RECLOCK_CACHE/iceberg-rest/libs``. It checks no credentials.

:class:`RestCatalog` is an in-process HTTP server that speaks the part of the
REST catalog API a writer uses (config, namespaces, create, load and commit
tables), over a pyiceberg SQL catalog on SQLite, and records the requests.

A commit (``POST .../tables/{table}``) checks the request's requirements
against the table's current metadata and applies its updates, as a REST
catalog does: a requirement that does not hold is ``409`` (pyiceberg's
``CommitFailedException``). Every request must carry ``Authorization:
Bearer <token>`` (``401`` otherwise), so a test sees the sink's credentials
arrive.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote


def libs_dir() -> Path:
    """The REST catalog server's jars, as tests/setup.sh left them."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    cache = Path(os.environ.get("RECLOCK_CACHE") or Path(base) / "reclock")
    libs = cache / "iceberg-rest" / "libs"
    if not any(libs.glob("iceberg-open-api-*-test-fixtures.jar")):
        raise RuntimeError(f"Apache Iceberg's REST catalog server is not in {libs}: run "
                           "`bash tests/setup.sh` (it resolves tests/iceberg-rest/pom.xml "
                           "with Maven)")
    return libs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class IcebergRestServer:
    """Iceberg's ``RESTCatalogServer`` in a JVM of its own on a free port,
    its catalog (a SQLite file) and warehouse in a temporary directory:
    ``start()`` -> ``url``; ``close()`` stops it and removes the directory.
    Tests share one server per run: each uses tables of its own names."""

    MAIN = "org.apache.iceberg.rest.RESTCatalogServer"
    #: Starts fast (C1 only), small heap: a catalog of a few small tables.
    JVM = ("-Xms64m", "-Xmx384m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="reclock-iceberg-rest-"))
        self.warehouse = self.dir / "warehouse"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.dir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> IcebergRestServer:
        libs = libs_dir()
        self.warehouse.mkdir()
        # The server reads its catalog's properties from CATALOG_* variables
        # (the prefix dropped, "__" -> "-", "_" -> ".", lowercased), as the
        # image documents: these make catalog-impl=JdbcCatalog, uri, warehouse
        # and rest.port.
        env = {k: v for k, v in os.environ.items() if not k.startswith("CATALOG_")}
        env.update({"CATALOG_CATALOG__IMPL": "org.apache.iceberg.jdbc.JdbcCatalog",
                    "CATALOG_URI": f"jdbc:sqlite:{self.dir / 'catalog.db'}",
                    "CATALOG_JDBC_STRICT__MODE": "true",
                    "CATALOG_WAREHOUSE": str(self.warehouse),
                    "CATALOG_REST_PORT": str(self.port)})
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                ["java", *self.JVM, "-Djava.awt.headless=true", "-cp", f"{libs}/*", self.MAIN],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Iceberg's REST catalog server exited with "
                                   f"{self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/config", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"Iceberg's REST catalog server did not answer on "
                                   f"{self.url} within {timeout} s")
            time.sleep(0.2)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class RestCatalog:
    """The server (``url``) and what it saw (``requests``: method and path)."""

    def __init__(self, root: Path, token: str) -> None:
        from pyiceberg.catalog.sql import SqlCatalog

        self.token = token
        self.backing = SqlCatalog("rest-backing", uri=f"sqlite:///{root}/rest.db",
                                  warehouse=f"file://{root}/warehouse")
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()  # one request at a time: commits are compare-and-swap
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode() if body is not None else b""
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                server.requests.append((method, self.path))
                if self.headers.get("Authorization") != f"Bearer {server.token}":
                    self._send(401, _error(401, "NotAuthorizedException", "bad token"))
                    return
                with server._lock:
                    try:
                        code, out = server.route(method, self.path.split("?")[0], body)
                    except Exception as exc:  # a bug of this server: an answer, not a hang-up
                        code, out = 500, _error(500, type(exc).__name__, repr(exc))
                self._send(code, out)

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def do_HEAD(self) -> None:
                self._handle("HEAD")

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    def route(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        from pyiceberg.catalog.rest import CreateTableRequest
        from pyiceberg.exceptions import (
            CommitFailedException,
            NamespaceAlreadyExistsError,
            NoSuchTableError,
        )
        from pyiceberg.table import CommitTableRequest

        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts[:2] == ["v1", "config"]:
            return 200, {"defaults": {}, "overrides": {}}
        if parts[:2] != ["v1", "namespaces"]:
            return 404, _error(404, "NoSuchEndpoint", path)
        rest = parts[2:]
        if not rest and method == "POST":
            req = json.loads(body)
            try:
                self.backing.create_namespace(tuple(req["namespace"]), req.get("properties", {}))
            except NamespaceAlreadyExistsError as exc:
                return 409, _error(409, "AlreadyExistsException", str(exc))
            return 200, {"namespace": req["namespace"], "properties": {}}
        ns = tuple(rest[0].split("\x1f"))
        if rest[1:2] != ["tables"]:
            return 404, _error(404, "NoSuchEndpoint", path)
        if len(rest) == 2 and method == "POST":
            req = {"location": None, "partition-spec": None, "write-order": None,
                   **json.loads(body)}
            create = CreateTableRequest.model_validate(req)
            table = self.backing.create_table(
                (*ns, create.name), schema=create.table_schema, location=create.location,
                properties=create.properties)
            return 200, _loaded(table)
        ident = (*ns, rest[2])
        try:
            table = self.backing.load_table(ident)
        except NoSuchTableError as exc:
            return 404, _error(404, "NoSuchTableException", str(exc))
        if method in ("GET", "HEAD"):
            return (204, None) if method == "HEAD" else (200, _loaded(table))
        commit = CommitTableRequest.model_validate_json(body)
        try:
            resp = self.backing.commit_table(table, commit.requirements, commit.updates)
        except CommitFailedException as exc:
            return 409, _error(409, "CommitFailedException", str(exc))
        return 200, {"metadata-location": resp.metadata_location,
                     "metadata": json.loads(resp.metadata.model_dump_json())}

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self.backing.engine.dispose()


def _loaded(table: Any) -> dict[str, Any]:
    return {"metadata-location": table.metadata_location,
            "metadata": json.loads(table.metadata.model_dump_json()), "config": {}}


def _error(code: int, kind: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code}}


@contextmanager
def rest_catalog(root: Path, token: str = "test-token-4b1d") -> Iterator[RestCatalog]:
    server = RestCatalog(root, token)
    try:
        yield server
    finally:
        server.close()
