"""A small Confluent-compatible schema registry for the tests (a real HTTP peer).

No Confluent Schema Registry can be installed here (it is not on Maven
Central; Apicurio's is a Quarkus application that needs a build of its own),
so the tests run this one: the subset of the REST API that reclock and an
Avro producer use, with Confluent's answers and error codes::

    POST   /subjects/{s}/versions          {"schema": text}  -> {"id": n}
                                           (the same schema again: its id)
    GET    /subjects/{s}/versions          [1, 2, ...]       404 40401
    GET    /subjects/{s}/versions/{v}      {"subject", "id", "version", "schema"}
                                           (v: a number or "latest") 404 40402
    GET    /schemas/ids/{id}               {"schema": text}  404 40403
    DELETE /subjects/{s}[?permanent=true]  [1, 2, ...]: the subject's versions
                                           are gone (soft: ids still resolve;
                                           permanent: a later registration
                                           starts again at version 1)

Schema ids are global and never reused, as Confluent's are. Compatibility is
not checked (a registry set to compatibility NONE): the tests register
incompatible versions on purpose. :func:`produce_avro` writes records the way
Confluent's Avro serializer does: register the schema under the subject,
then ``0x00``, the id (4 bytes, big-endian), the Avro datum.
"""

from __future__ import annotations

import io
import json
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import fastavro


def _canonical(text: str) -> str:
    return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))


class RegistryServer:
    """The registry, listening on 127.0.0.1 (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.schemas: dict[int, str] = {}  # id -> text as registered
        self.by_text: dict[str, int] = {}  # canonical text -> id
        self.subjects: dict[str, dict[int, int]] = {}  # subject -> version -> id
        self.next_version: dict[str, int] = {}
        self.requests: list[str] = []
        reg = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, body: Any) -> None:
                payload = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _parts(self) -> tuple[list[str], dict[str, list[str]]]:
                url = urllib.parse.urlsplit(self.path)
                return ([urllib.parse.unquote(p) for p in url.path.strip("/").split("/")],
                        urllib.parse.parse_qs(url.query))

            def do_GET(self) -> None:
                reg.requests.append(f"GET {self.path}")
                parts, _ = self._parts()
                code, body = reg.get(parts)
                self._send(code, body)

            def do_POST(self) -> None:
                reg.requests.append(f"POST {self.path}")
                parts, _ = self._parts()
                n = int(self.headers.get("Content-Length") or 0)
                doc = json.loads(self.rfile.read(n) or b"{}")
                if len(parts) == 3 and parts[0] == "subjects" and parts[2] == "versions":
                    self._send(200, {"id": reg.register(parts[1], str(doc["schema"]))})
                else:
                    self._send(404, {"error_code": 404, "message": "HTTP 404 Not Found"})

            def do_DELETE(self) -> None:
                reg.requests.append(f"DELETE {self.path}")
                parts, query = self._parts()
                if len(parts) == 2 and parts[0] == "subjects":
                    code, body = reg.delete(parts[1], query.get("permanent") == ["true"])
                    self._send(code, body)
                else:
                    self._send(404, {"error_code": 404, "message": "HTTP 404 Not Found"})

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    # -- the API ---------------------------------------------------------------------------
    def register(self, subject: str, text: str) -> int:
        """Register ``text`` under ``subject``; its id (the same text: the same id)."""
        with self.lock:
            canon = _canonical(text)
            sid = self.by_text.get(canon)
            if sid is None:
                sid = max(self.schemas, default=0) + 1
                self.schemas[sid] = text
                self.by_text[canon] = sid
            versions = self.subjects.setdefault(subject, {})
            if sid not in versions.values():
                v = self.next_version.get(subject, 1)
                versions[v] = sid
                self.next_version[subject] = v + 1
            return sid

    def get(self, parts: list[str]) -> tuple[int, Any]:
        with self.lock:
            if len(parts) == 3 and parts[:2] == ["schemas", "ids"] and parts[2].isdigit():
                sid = int(parts[2])
                if sid in self.schemas:
                    return 200, {"schema": self.schemas[sid]}
                return 404, {"error_code": 40403, "message": "Schema not found"}
            if len(parts) >= 3 and parts[0] == "subjects" and parts[2] == "versions":
                versions = self.subjects.get(parts[1])
                if not versions:
                    return 404, {"error_code": 40401, "message": f"Subject '{parts[1]}' "
                                 "not found."}
                if len(parts) == 3:
                    return 200, sorted(versions)
                v = max(versions) if parts[3] == "latest" else (
                    int(parts[3]) if parts[3].isdigit() else -1)
                if v not in versions:
                    return 404, {"error_code": 40402, "message": "Version not found."}
                sid = versions[v]
                return 200, {"subject": parts[1], "version": v, "id": sid,
                             "schema": self.schemas[sid]}
            return 404, {"error_code": 404, "message": "HTTP 404 Not Found"}

    def delete(self, subject: str, permanent: bool) -> tuple[int, Any]:
        with self.lock:
            versions = self.subjects.pop(subject, None)
            if not versions:
                return 404, {"error_code": 40401, "message": f"Subject '{subject}' not found."}
            if permanent:
                self.next_version.pop(subject, None)
            return 200, sorted(versions)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@contextmanager
def registry_server() -> Iterator[RegistryServer]:
    reg = RegistryServer()
    try:
        yield reg
    finally:
        reg.close()


# -- a producer's side ---------------------------------------------------------------------------


def register(url: str, subject: str, schema: Mapping[str, Any] | str) -> int:
    """Register ``schema`` under ``subject`` over HTTP, as a producer does; its id."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    req = urllib.request.Request(
        f"{url}/subjects/{urllib.parse.quote(subject, safe='')}/versions",
        data=json.dumps({"schema": text}).encode(), method="POST",
        headers={"Content-Type": "application/vnd.schemaregistry.v1+json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return int(json.loads(resp.read())["id"])


def delete_subject(url: str, subject: str, permanent: bool = False) -> None:
    q = "?permanent=true" if permanent else ""
    req = urllib.request.Request(
        f"{url}/subjects/{urllib.parse.quote(subject, safe='')}{q}", method="DELETE")
    with urllib.request.urlopen(req, timeout=10):
        pass


def confluent_avro(schema_id: int, schema: Mapping[str, Any], record: Any) -> bytes:
    """``record`` in the Confluent wire format, written with ``schema``."""
    buf = io.BytesIO()
    buf.write(b"\x00" + schema_id.to_bytes(4, "big"))
    fastavro.schemaless_writer(buf, fastavro.parse_schema(dict(schema)), record)
    return buf.getvalue()


def avro_values(url: str, subject: str, schema: Mapping[str, Any],
                records: list[dict[str, Any]]) -> list[bytes]:
    """Records as a Confluent Avro serializer writes them (the schema
    registered under ``subject`` first)."""
    sid = register(url, subject, schema)
    return [confluent_avro(sid, schema, r) for r in records]
