"""A small Confluent-compatible schema registry for the tests (a real HTTP peer).

No Confluent Schema Registry can be installed here (it is not on Maven
Central; Apicurio's is a Quarkus application that needs a build of its own),
so the tests run this one: the subset of the REST API that reclock,
confluent-kafka's ``SchemaRegistryClient`` and its serializers
(``AvroSerializer``, ``ProtobufSerializer``, ``JSONSerializer``) and
deserializers use, for the three schema types, with Confluent's answers and
error codes::

    POST   /subjects/{s}/versions          {"schema": text, "schemaType"?, "references"?}
                                           -> {"id": n} (the same schema again: its id)
                                           422 42201 (an unknown schemaType, a reference
                                           to a subject version that does not exist)
    POST   /subjects/{s}[?deleted=true]    lookup: {"subject", "id", "version", "schema",
                                           "schemaType"?, "references"?}
                                           404 40401 (no subject) / 40403 (not in it)
    GET    /subjects                       ["s", ...]
    GET    /subjects/{s}/versions          [1, 2, ...]       404 40401
    GET    /subjects/{s}/versions/{v}[?deleted=true]
                                           {"subject", "id", "version", "schema",
                                           "schemaType"?, "references"?}
                                           (v: a number or "latest") 404 40401 / 40402
    GET    /subjects/{s}/versions/{v}/referencedby
                                           [ids of the schemas referring to it]
    GET    /schemas/ids/{id}               {"schema", "schemaType"?, "references"?} 404 40403
    GET    /schemas/ids/{id}/versions      [{"subject", "version"}, ...]
    GET    /schemas/types                  ["AVRO", "JSON", "PROTOBUF"]
    GET    /associations/...               404 (none: the serializers then name the
                                           subject by their strategy, topic-value)
    DELETE /subjects/{s}[?permanent=true]  [1, 2, ...]: the subject's versions
                                           are gone (soft: ids still resolve,
                                           and ``?deleted=true`` still finds the
                                           versions; permanent: a later
                                           registration starts again at version 1)

As Confluent's, ``schemaType`` is left out of answers for AVRO (the default)
and ``references`` when there are none; a reference is ``{"name", "subject",
"version"}`` (the name being what the schema calls the other one: a
Protobuf import path, a JSON Schema ``$ref`` URI). Query parameters
``format``, ``normalize``, ``offset``, ``limit`` are accepted and
ignored: a schema is answered as it was registered. (Confluent's Python
Protobuf serializer registers a base64 ``FileDescriptorProto``, which is
also what ``format=serialized`` answers with, so that is what readers ask for
and get; a ``.proto`` text registered here is answered as text.)

With ``auth=(user, password)`` every request must carry that basic auth,
else 401 (as a registry with authentication answers).

Schema ids are global and never reused, as Confluent's are: the same schema
(type, text, references) gets the same id under any subject. Compatibility
is not checked (a registry set to compatibility NONE): the tests register
incompatible versions on purpose. :func:`avro_values` writes records the way
Confluent's Avro serializer does: register the schema under the subject,
then ``0x00``, the id (4 bytes, big-endian), the Avro datum.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import fastavro

TYPES = ("AVRO", "JSON", "PROTOBUF")


def _canonical(kind: str, text: str) -> str:
    if kind == "PROTOBUF":
        return text.strip()
    try:
        return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return text.strip()  # an Avro primitive name such as "string"


def _refs(raw: Any) -> tuple[tuple[str, str, int], ...]:
    return tuple((str(r["name"]), str(r["subject"]), int(r["version"])) for r in raw or ())


def _version(raw: str) -> int | None:
    return int(raw) if raw.isdigit() else None


def _missing(code: int, message: str) -> tuple[int, Any]:
    return 404, {"error_code": code, "message": message}


_NOT_FOUND = (404, {"error_code": 404, "message": "HTTP 404 Not Found"})


class RegistryServer:
    """The registry, listening on 127.0.0.1 (see the module docstring)."""

    def __init__(self, auth: tuple[str, str] | None = None) -> None:
        self.lock = threading.Lock()
        #: basic auth (user, password) every request must carry, else 401
        self.auth = auth
        #: id -> (schemaType, text as registered, references)
        self.schemas: dict[int, tuple[str, str, tuple[tuple[str, str, int], ...]]] = {}
        self.by_key: dict[tuple[str, str, tuple[tuple[str, str, int], ...]], int] = {}
        self.subjects: dict[str, dict[int, int]] = {}  # subject -> version -> id
        self.deleted: dict[str, dict[int, int]] = {}  # soft-deleted: subject -> version -> id
        self.next_version: dict[str, int] = {}
        self.requests: list[str] = []
        reg = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, answer: tuple[int, Any]) -> None:
                code, body = answer
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

            def _refused(self) -> bool:
                if reg.auth is None:
                    return False
                want = "Basic " + base64.b64encode(":".join(reg.auth).encode()).decode()
                if self.headers.get("Authorization") == want:
                    return False
                self._send((401, {"error_code": 401, "message": "Unauthorized"}))
                return True

            def do_GET(self) -> None:
                reg.requests.append(f"GET {self.path}")
                if self._refused():
                    return
                parts, query = self._parts()
                self._send(reg.get(parts, query.get("deleted") == ["true"]))

            def do_POST(self) -> None:
                reg.requests.append(f"POST {self.path}")
                if self._refused():
                    return
                parts, query = self._parts()
                n = int(self.headers.get("Content-Length") or 0)
                doc = json.loads(self.rfile.read(n) or b"{}")
                if len(parts) == 3 and parts[0] == "subjects" and parts[2] == "versions":
                    self._send(reg.post_version(parts[1], doc))
                elif len(parts) == 2 and parts[0] == "subjects":
                    self._send(reg.lookup(parts[1], doc, query.get("deleted") == ["true"]))
                else:
                    self._send(_NOT_FOUND)

            def do_DELETE(self) -> None:
                reg.requests.append(f"DELETE {self.path}")
                if self._refused():
                    return
                parts, query = self._parts()
                if len(parts) == 2 and parts[0] == "subjects":
                    self._send(reg.delete(parts[1], query.get("permanent") == ["true"]))
                else:
                    self._send(_NOT_FOUND)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    # -- the API ---------------------------------------------------------------------------
    def register(self, subject: str, text: str, schema_type: str = "AVRO",
                 references: Any = ()) -> int:
        """Register ``text`` under ``subject``; its id (the same schema: the same id).

        ``references``: ``{"name", "subject", "version"}`` mappings (or
        triples); each must name a registered subject version."""
        refs = tuple((str(r[0]), str(r[1]), int(r[2])) if isinstance(r, (tuple, list))
                     else (str(r["name"]), str(r["subject"]), int(r["version"]))
                     for r in references)
        with self.lock:
            for name, ref_subject, v in refs:
                if self._version_id(ref_subject, v, deleted=True) is None:
                    raise KeyError(f"reference {name!r}: no version {v} of subject "
                                   f"{ref_subject!r}")
            key = (schema_type, _canonical(schema_type, text), refs)
            sid = self.by_key.get(key)
            if sid is None:
                sid = max(self.schemas, default=0) + 1
                self.schemas[sid] = (schema_type, text, refs)
                self.by_key[key] = sid
            versions = self.subjects.setdefault(subject, {})
            if sid not in versions.values():
                v = max(self.next_version.get(subject, 1),
                        max(self.deleted.get(subject, {}), default=0) + 1)
                versions[v] = sid
                self.next_version[subject] = v + 1
            return sid

    def post_version(self, subject: str, doc: Mapping[str, Any]) -> tuple[int, Any]:
        kind = str(doc.get("schemaType") or "AVRO")
        if kind not in TYPES:
            return 422, {"error_code": 42201, "message": f"Invalid schema type {kind}"}
        try:
            return 200, {"id": self.register(subject, str(doc["schema"]), kind,
                                             doc.get("references") or ())}
        except KeyError as exc:
            return 422, {"error_code": 42201, "message": f"Invalid schema: {exc.args[0]}"}

    def _schema_body(self, sid: int) -> dict[str, Any]:
        kind, text, refs = self.schemas[sid]
        body: dict[str, Any] = {"schema": text}
        if kind != "AVRO":
            body["schemaType"] = kind
        if refs:
            body["references"] = [{"name": n, "subject": s, "version": v} for n, s, v in refs]
        return body

    def _version_id(self, subject: str, v: int, deleted: bool) -> int | None:
        sid = self.subjects.get(subject, {}).get(v)
        if sid is None and deleted:
            sid = self.deleted.get(subject, {}).get(v)
        return sid

    def _version_body(self, subject: str, v: int, sid: int) -> dict[str, Any]:
        return {"subject": subject, "version": v, "id": sid, **self._schema_body(sid)}

    def lookup(self, subject: str, doc: Mapping[str, Any], deleted: bool) -> tuple[int, Any]:
        kind = str(doc.get("schemaType") or "AVRO")
        key = (kind, _canonical(kind, str(doc.get("schema", ""))), _refs(doc.get("references")))
        with self.lock:
            versions = dict(self.subjects.get(subject, {}))
            if deleted:
                versions = {**self.deleted.get(subject, {}), **versions}
            if not versions:
                return _missing(40401, f"Subject '{subject}' not found.")
            sid = self.by_key.get(key)
            for v, vid in sorted(versions.items()):
                if vid == sid:
                    return 200, self._version_body(subject, v, vid)
            return _missing(40403, "Schema not found")

    def get(self, parts: list[str], deleted: bool = False) -> tuple[int, Any]:
        with self.lock:
            if parts == ["schemas", "types"]:
                return 200, list(TYPES)
            if parts == ["subjects"]:
                return 200, sorted(s for s, vs in self.subjects.items() if vs)
            if len(parts) >= 3 and parts[:2] == ["schemas", "ids"] and parts[2].isdigit():
                sid = int(parts[2])
                if sid not in self.schemas:
                    return _missing(40403, "Schema not found")
                if len(parts) == 3:
                    return 200, self._schema_body(sid)
                if parts[3:] == ["versions"]:
                    return 200, [{"subject": s, "version": v}
                                 for s, vs in sorted(self.subjects.items())
                                 for v, i in sorted(vs.items()) if i == sid]
                return _NOT_FOUND
            if len(parts) >= 3 and parts[0] == "subjects" and parts[2] == "versions":
                subject = parts[1]
                versions = dict(self.subjects.get(subject, {}))
                if deleted:
                    versions = {**self.deleted.get(subject, {}), **versions}
                if not versions:
                    return _missing(40401, f"Subject '{subject}' not found.")
                if len(parts) == 3:
                    return 200, sorted(versions)
                v = (max(self.subjects.get(subject) or versions) if parts[3] == "latest"
                     else _version(parts[3]))
                if v is None or v not in versions:
                    return _missing(40402, "Version not found.")
                sid = versions[v]
                if len(parts) == 4:
                    return 200, self._version_body(subject, v, sid)
                if parts[4:] == ["referencedby"]:
                    return 200, sorted(i for i, (_, _, refs) in self.schemas.items()
                                       if any(s == subject and rv == v for _, s, rv in refs))
            return _NOT_FOUND

    def delete(self, subject: str, permanent: bool) -> tuple[int, Any]:
        with self.lock:
            versions = self.subjects.pop(subject, None)
            if permanent:
                # Confluent's permanent delete follows a soft one; here
                # either forgets the subject's versions for good
                gone = versions or self.deleted.pop(subject, None)
                self.deleted.pop(subject, None)
                self.next_version.pop(subject, None)
                if not gone:
                    return _missing(40401, f"Subject '{subject}' not found.")
                return 200, sorted(gone)
            if not versions:
                return _missing(40401, f"Subject '{subject}' not found.")
            self.deleted.setdefault(subject, {}).update(versions)
            return 200, sorted(versions)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@contextmanager
def registry_server(auth: tuple[str, str] | None = None) -> Iterator[RegistryServer]:
    reg = RegistryServer(auth)
    try:
        yield reg
    finally:
        reg.close()


# -- a producer's side ---------------------------------------------------------------------------


def register(url: str, subject: str, schema: Mapping[str, Any] | str,
             schema_type: str = "AVRO", references: Sequence[Mapping[str, Any]] = ()) -> int:
    """Register ``schema`` under ``subject`` over HTTP, as a producer does; its id.

    ``references``: ``{"name", "subject", "version"}`` mappings."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    body: dict[str, Any] = {"schema": text}
    if schema_type != "AVRO":
        body["schemaType"] = schema_type
    if references:
        body["references"] = [dict(r) for r in references]
    req = urllib.request.Request(
        f"{url}/subjects/{urllib.parse.quote(subject, safe='')}/versions",
        data=json.dumps(body).encode(), method="POST",
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
