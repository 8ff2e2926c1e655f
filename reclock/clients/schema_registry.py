"""A Confluent-compatible schema registry, through confluent-kafka's client.

The registry formats (``avro``, ``protobuf``, ``json_schema``) read writer
schemas by id, list a subject's versions and follow schema references through
:class:`RegistryHandle`. It wraps
:class:`confluent_kafka.schema_registry.SchemaRegistryClient` and keeps the
guarantees the formats rely on:

* **The URL is checked** when the handle is made (``http``/``https`` with a
  host: :class:`RegistryConfigError`, a definite error). Basic auth comes from
  the URL's userinfo (``https://user:secret@registry:8081``, percent-encoded)
  or from ``user``/``password``; it is handed to the client as
  ``basic.auth.user.info``, so the client's URL holds no secret, and no
  message, ``repr`` or log line shows the secret.
* **Definite vs transient**: a schema id, subject or version the registry
  does not know (HTTP 404) raises :class:`SchemaMissing` (definite: the
  records naming it are bad, or the format names a subject that does not
  exist); a 401/403 raises :class:`RegistryRefused` (definite: the
  credentials need fixing); anything else (connection refused, timeout,
  5xx, an answer that is not JSON) raises
  :class:`~reclock.core.errors.TransientError`, which the data plane
  retries. The client itself retries a request twice, briefly, first.
* **Picklable, the client made where it is used**: a handle pickles as
  its settings and the schemas it fetched (ids are immutable, so the cache
  is exact and travels to Spark tasks); its ``SchemaRegistryClient`` (an
  HTTP session) is made lazily, in the process that first needs it (on an
  executor: only when a record names a schema the cache lacks), and never
  pickled.
* **Caching**: schemas by id and referenced versions are cached for the life
  of the handle (both are immutable in a registry); a subject's version
  *list* is read afresh at every :meth:`RegistryHandle.versions` call (the
  driver re-reads it at every open), through a client of its own so that
  no cached answer of an earlier open hides a reset subject.

The Kafka sink writes through the same handle (:meth:`RegistryHandle.writer`):
it registers its record schemas (:meth:`RegistryHandle.register`,
:meth:`RegistryHandle.lookup`) and serializes with confluent-kafka's own
serializers (:meth:`RegistryHandle.serializer`, under a subject it names
itself, by default Confluent's TopicNameStrategy: :func:`topic_subject`),
on a client shared by every handle of the same settings in the process
(:meth:`RegistryHandle.shared_client`: the client caches registrations, so
a task's codecs do not ask the registry again for a schema another task of
the process registered). The writing calls raise the client's own errors
(``SchemaRegistryError``, httpx's): the sink sorts them into its own
definite and transient errors. An https registry's CA file is
``ca_location``.
"""

from __future__ import annotations

import os
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from reclock.core.errors import DefiniteError, TransientError
from reclock.core.secrets import register as register_secret

T = TypeVar("T")

#: the request retries of the readers' client (the data plane retries beyond them)
READ_RETRIES: Mapping[str, int] = MappingProxyType(
    {"max.retries": 2, "retries.wait.ms": 100, "retries.max.wait.ms": 1000})
#: no retry settings: the client's own (3 retries, 1 s to 20 s apart), the writer's
CLIENT_DEFAULT_RETRIES: Mapping[str, int] = MappingProxyType({})
#: the schema types of the registry, by the sink's format names
SCHEMA_TYPES: Mapping[str, str] = MappingProxyType(
    {"avro": "AVRO", "json_schema": "JSON", "protobuf": "PROTOBUF"})


class RegistryConfigError(DefiniteError, ValueError):
    """A registry setting that cannot work (not an http(s) URL, ...)."""


class SchemaMissing(DefiniteError):
    """The registry does not know a schema id, subject or version (HTTP 404)."""


class RegistryRefused(DefiniteError):
    """The registry refused the credentials (HTTP 401/403)."""


@dataclass(frozen=True)
class Reference:
    """A schema reference: ``name`` is what the referring schema calls the
    other one (a Protobuf import path, a JSON Schema ``$ref`` URI)."""

    name: str
    subject: str
    version: int


@dataclass(frozen=True)
class Fetched:
    """A registered schema: its type (``AVRO``, ``PROTOBUF``, ``JSON``), its
    text as the registry answered it, and its references."""

    schema_type: str
    text: str
    references: tuple[Reference, ...] = ()


def topic_subject(topic: str, is_key: bool = False) -> str:
    """The subject of a topic's value (or key) schema by Confluent's
    TopicNameStrategy: ``<topic>-value``, ``<topic>-key``."""
    return f"{topic}-{'key' if is_key else 'value'}"


def _quote(subject: str) -> str:
    return urllib.parse.quote(subject, safe="")


def _id(value: Any) -> int:
    if not isinstance(value, int):
        raise TransientError(f"schema registry: an answer without a schema id ({value!r})")
    return value


class RegistryHandle:
    """Settings of one registry, and the schemas fetched from it (see the
    module docstring)."""

    def __init__(self, url: str, timeout: float = 10.0, *, user: str | None = None,
                 password: str | None = None, fmt: str | None = None,
                 ca_location: str | None = None,
                 retries: Mapping[str, int] = READ_RETRIES) -> None:
        try:
            parts = urllib.parse.urlsplit(url)
            ok = parts.scheme in ("http", "https") and bool(parts.hostname)
            port_ok = parts.port is None or 0 < parts.port < 65536
        except ValueError:
            ok = port_ok = False
        if not ok or not port_ok:
            raise RegistryConfigError(
                "the registry URL must be an http(s) URL with a host",
                hint="write it as http://registry:8081 (basic auth as "
                     "https://user:password@registry:8081)")
        if parts.username is not None:
            if user is not None:
                raise RegistryConfigError(
                    "the registry credentials are given twice (in the URL and as user)",
                    hint="keep one of them")
            user = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "")
            host = parts.hostname or ""
            if ":" in host:
                host = f"[{host}]"
            parts = parts._replace(netloc=host + (f":{parts.port}" if parts.port else ""))
        if password:
            register_secret([password])
        #: the registry's URL, without credentials (for messages)
        self.url = urllib.parse.urlunsplit(parts).rstrip("/")
        self.timeout = float(timeout)
        #: the ``format`` schemas are asked in: ``serialized`` for Protobuf (a
        #: base64 ``FileDescriptorProto``, what a reader needs; a registry
        #: answers .proto text otherwise), None for the others
        self.fmt = fmt
        #: a CA certificate file (or directory) for an https registry
        self.ca_location = ca_location
        #: the client's request retries (its ``max.retries``, ``retries.*``)
        self.retries = dict(retries)
        self._user = user
        self._password = password
        self._client: SchemaRegistryClient | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._by_id: dict[int, Fetched] = {}
        self._by_version: dict[tuple[str, int], tuple[int, Fetched]] = {}

    def __repr__(self) -> str:
        return f"RegistryHandle({self.url!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None  # an HTTP session: made again where it is needed
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- the client (per process) ----------------------------------------------------------
    @classmethod
    def writer(cls, url: str, *, user: str | None = None, password: str | None = None,
               ca_location: str | None = None, timeout: float = 30.0) -> RegistryHandle:
        """A handle to register schemas and serialize records with (the Kafka
        sink's): the client's own request retries (the sink's data plane
        retries beyond them), ``timeout`` in whole seconds, at least one."""
        return cls(url, max(1, int(timeout)), user=user, password=password,
                   ca_location=ca_location, retries=CLIENT_DEFAULT_RETRIES)

    def _conf(self) -> dict[str, Any]:
        conf: dict[str, Any] = {"url": self.url, "timeout": self.timeout, **self.retries}
        if self._user is not None:
            conf["basic.auth.user.info"] = f"{self._user}:{self._password or ''}"
        if self.ca_location is not None:
            conf["ssl.ca.location"] = self.ca_location
        return conf

    def client(self) -> SchemaRegistryClient:
        """The handle's client in this process (made on first use; a forked
        process makes its own: an HTTP session is not shared)."""
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                self._client = SchemaRegistryClient(self._conf())
                self._pid = os.getpid()
            return self._client

    def shared_client(self) -> SchemaRegistryClient:
        """This process's client of the handle's settings, one for every
        handle with the same settings (made on first use; a forked process
        makes its own). The writers use it: its caches of registrations and
        ids then serve every codec of the process."""
        key = (os.getpid(), tuple(sorted(self._conf().items())))
        with _shared_lock:
            client = _shared.get(key)
            if client is None:
                client = _shared[key] = SchemaRegistryClient(self._conf())
            return client

    def _call(self, path: str, fn: Callable[[], T]) -> T:
        """``fn()`` (the client's ``GET path``), its failures sorted into
        definite and transient ones."""
        try:
            return fn()
        except SchemaRegistryError as exc:
            code = exc.http_status_code
            said = self._scrub(str(exc.error_message))
            if code == 404:
                raise SchemaMissing(f"{self.url}{path}: not found") from None
            if code in (401, 403):
                raise RegistryRefused(
                    f"schema registry {self.url}: GET {path} was refused (HTTP {code}: {said})",
                    hint="check the registry user and password (in registry_url as "
                         "https://user:password@host)") from None
            raise TransientError(
                f"schema registry {self.url}: GET {path} answered HTTP {code}: {said}",
                hint="check the registry is healthy; the source retries") from None
        except (SchemaMissing, RegistryRefused, TransientError):
            raise
        except Exception as exc:  # httpx's transport errors, bad JSON, ...
            said = self._scrub(str(exc)) or type(exc).__name__
            raise TransientError(
                f"schema registry {self.url}: GET {path} failed: {said}",
                hint="check the registry is reachable from the driver and the executors; "
                     "the source retries") from None

    def _scrub(self, text: str) -> str:
        if self._password:
            text = text.replace(self._password, "***")
            quoted = urllib.parse.quote(self._password, safe="")
            if quoted != self._password:
                text = text.replace(quoted, "***")
        return text

    @staticmethod
    def _fetched(schema: Any) -> Fetched:
        text = schema.schema_str
        if not isinstance(text, str):
            raise TransientError("schema registry: an answer without a schema text")
        refs = tuple(Reference(str(r.name), str(r.subject), int(r.version))
                     for r in schema.references or ())
        return Fetched(str(schema.schema_type or "AVRO"), text, refs)

    # -- the API ---------------------------------------------------------------------------
    def schema(self, schema_id: int) -> Fetched:
        """The schema registered under ``schema_id`` (cached)."""
        hit = self._by_id.get(schema_id)
        if hit is None:
            client = self.client()
            got = self._call(f"/schemas/ids/{schema_id}",
                             lambda: client.get_schema(schema_id, fmt=self.fmt))
            hit = self._by_id[schema_id] = self._fetched(got)
        return hit

    def version(self, subject: str, version: int) -> tuple[int, Fetched]:
        """(id, schema) of ``version`` of ``subject``, soft-deleted versions
        included (a reference keeps naming them; cached)."""
        hit = self._by_version.get((subject, version))
        if hit is None:
            client = self.client()
            got = self._call(f"/subjects/{_quote(subject)}/versions/{version}",
                             lambda: client.get_version(subject, version, True, self.fmt))
            hit = (_id(got.schema_id), self._fetched(got.schema))
            self._by_version[(subject, version)] = hit
            self._by_id.setdefault(hit[0], hit[1])
        return hit

    def versions(self, subject: str) -> dict[int, tuple[int, Fetched]] | None:
        """``version -> (schema id, schema)`` of every version of ``subject``
        the registry lists now; None when it knows no such subject (never
        registered, or deleted). Read afresh, not from a cache."""
        with SchemaRegistryClient(self._conf()) as fresh:
            try:
                listed = self._call(f"/subjects/{_quote(subject)}/versions",
                                    lambda: fresh.get_versions(subject))
            except SchemaMissing:
                return None
            if not isinstance(listed, list):
                raise TransientError(f"schema registry {self.url}: subject {subject!r}: "
                                     "the version list is not a list")
            out: dict[int, tuple[int, Fetched]] = {}
            for v in sorted(int(x) for x in listed):
                try:
                    got = self._call(f"/subjects/{_quote(subject)}/versions/{v}",
                                     lambda v=v: fresh.get_version(subject, v, False,  # type: ignore[misc]
                                                                   self.fmt))
                except SchemaMissing:
                    continue  # deleted meanwhile
                sid, fetched = _id(got.schema_id), self._fetched(got.schema)
                self._by_id.setdefault(sid, fetched)
                out[v] = (sid, fetched)
            return out

    def closure(self, fetched: Fetched) -> Iterator[tuple[Reference, Fetched]]:
        """The schemas ``fetched`` refers to, transitively, each once, the
        referred-to before the referring (the order a Protobuf descriptor
        pool needs)."""
        done: set[str] = set()

        def walk(refs: tuple[Reference, ...]) -> Iterator[tuple[Reference, Fetched]]:
            for ref in refs:
                if ref.name in done:
                    continue
                done.add(ref.name)
                _, dep = self.version(ref.subject, ref.version)
                yield from walk(dep.references)
                yield ref, dep

        yield from walk(fetched.references)

    # -- the writers' API ------------------------------------------------------------------
    def register(self, subject: str, text: str, fmt: str) -> int:
        """Register schema ``text`` of format ``fmt`` (``avro``, ``protobuf``,
        ``json_schema``) under ``subject``; its id. The client's errors are
        raised as it raises them."""
        from confluent_kafka.schema_registry import Schema

        return int(self.shared_client().register_schema(subject,
                                                        Schema(text, SCHEMA_TYPES[fmt])))

    def lookup(self, subject: str, text: str, fmt: str) -> int:
        """The id of schema ``text`` of format ``fmt``, registered under
        ``subject`` (the client's errors as it raises them: a 404 when it is
        not)."""
        from confluent_kafka.schema_registry import Schema

        got = self.shared_client().lookup_schema(subject, Schema(text, SCHEMA_TYPES[fmt]))
        return _id(got.schema_id)

    def serializer(self, fmt: str, schema: Any, subject: str) -> Callable[[Any, Any], bytes]:
        """confluent-kafka's serializer of ``fmt``, on the shared client: it
        registers ``schema`` (the Avro or JSON Schema text; for Protobuf, the
        message class) under ``subject`` whatever the topic, on its first
        record, and writes Confluent's wire format."""
        conf: dict[str, Any] = {"auto.register.schemas": True,
                                "subject.name.strategy": lambda ctx, rec: subject}
        client = self.shared_client()
        if fmt == "avro":
            from confluent_kafka.schema_registry.avro import AvroSerializer

            return AvroSerializer(client, schema, conf=conf)  # type: ignore[no-any-return]
        if fmt == "json_schema":
            from confluent_kafka.schema_registry.json_schema import JSONSerializer

            return JSONSerializer(schema, client, conf=conf)  # type: ignore[no-any-return]
        if fmt == "protobuf":
            from confluent_kafka.schema_registry.protobuf import ProtobufSerializer

            return ProtobufSerializer(  # type: ignore[no-any-return]
                schema, client, {**conf, "use.deprecated.format": False})
        raise ValueError(f"format {fmt} has no registry serializer")

    def deserializer(self, fmt: str, message_class: Any = None) -> Callable[[Any, Any], Any]:
        """confluent-kafka's deserializer of ``fmt`` on the shared client: the
        writer's schema by the id each record carries (Protobuf: records of
        ``message_class``)."""
        client = self.shared_client()
        if fmt == "avro":
            from confluent_kafka.schema_registry.avro import AvroDeserializer

            return AvroDeserializer(client)  # type: ignore[no-any-return]
        if fmt == "json_schema":
            from confluent_kafka.schema_registry.json_schema import JSONDeserializer

            return JSONDeserializer(None, schema_registry_client=client)  # type: ignore[no-any-return]
        if fmt == "protobuf":
            from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer

            return ProtobufDeserializer(  # type: ignore[no-any-return]
                message_class, {"use.deprecated.format": False}, client)
        raise ValueError(f"format {fmt} has no registry deserializer")


_shared: dict[tuple[int, tuple[tuple[str, Any], ...]], SchemaRegistryClient] = {}
_shared_lock = threading.Lock()
