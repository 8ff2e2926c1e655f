"""The ``avro`` format: Confluent-framed Avro with the schema registry client."""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import fastavro
import numpy as np
import numpy.typing as npt
import pyarrow as pa

from reclock.core.errors import DefiniteError, TransientError
from reclock.core.urls import mask_url
from reclock.formats.base import (
    DecodeResult,
    FormatError,
    _as_binary,
    _Collector,
)

I64 = npt.NDArray[np.int64]

# avro


class _SchemaMissing(DefiniteError):
    """The registry does not know a schema id a record names."""


class SchemaRegistryResolver:
    """Writer schemas from a Confluent-compatible schema registry, by id.

    ``GET {url}/schemas/ids/{id}``, cached by id for the life of the object
    (ids are immutable). A schema id the registry does not know (HTTP 404) is
    a definite fault of the records naming it; anything else (connection
    refused, timeout, 5xx) raises :class:`~reclock.core.errors.TransientError`. Basic
    auth may be given as ``http://user:secret@host``; the secret never appears
    in a message. Picklable: the cache travels with it.
    """

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise FormatError(f"registry_url must be an http(s) URL, got {mask_url(url)!r}")
        self._auth: str | None = None
        if parts.username is not None:
            user = urllib.parse.unquote(parts.username)
            secret = urllib.parse.unquote(parts.password or "")
            self._auth = "Basic " + base64.b64encode(f"{user}:{secret}".encode()).decode()
            netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
            parts = parts._replace(netloc=netloc)
        self.url = urllib.parse.urlunsplit(parts).rstrip("/")
        self.timeout = timeout
        self._schemas: dict[int, Any] = {}

    def __repr__(self) -> str:
        return f"SchemaRegistryResolver({self.url!r})"

    def _get(self, path: str) -> Any:
        req = urllib.request.Request(
            self.url + path, headers={"Accept": "application/vnd.schemaregistry.v1+json"}
        )
        if self._auth:
            req.add_header("Authorization", self._auth)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read().decode("utf-8"))
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise _SchemaMissing(f"{self.url}{path}: not found") from None
            raise TransientError(
                f"schema registry {self.url}: GET {path} answered HTTP {exc.code}",
                hint="check the registry is healthy; the source retries",
            ) from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise TransientError(
                f"schema registry {self.url}: GET {path} failed: {reason}",
                hint="check the registry is reachable from the executors; the source retries",
            ) from None
        except ValueError as exc:
            raise TransientError(
                f"schema registry {self.url}: GET {path} returned invalid JSON: {exc}"
            ) from None

    @staticmethod
    def _avro_text(body: Any, where: str) -> str:
        if not isinstance(body, dict) or not isinstance(body.get("schema"), str):
            raise TransientError(f"schema registry: {where}: no 'schema' in the answer")
        kind = body.get("schemaType", "AVRO")
        if kind != "AVRO":
            raise _SchemaMissing(f"{where} is a {kind} schema, not AVRO")
        return str(body["schema"])

    def writer_schema(self, schema_id: int) -> Any:
        """The parsed writer schema registered under ``schema_id``."""
        hit = self._schemas.get(schema_id)
        if hit is None:
            text = self._avro_text(self._get(f"/schemas/ids/{schema_id}"), f"id {schema_id}")
            try:
                hit = fastavro.parse_schema(json.loads(text))
            except Exception as exc:  # any parse failure is definite
                raise _SchemaMissing(f"schema id {schema_id} is not valid Avro: {exc}") from None
            self._schemas[schema_id] = hit
        return hit

    def latest(self, subject: str) -> str:
        """The schema text of the latest version of ``subject``."""
        quoted = urllib.parse.quote(subject, safe="")
        return self._avro_text(
            self._get(f"/subjects/{quoted}/versions/latest"), f"subject {subject!r}"
        )


_AVRO_PRIMITIVES: dict[str, pa.DataType] = {
    "null": pa.null(), "boolean": pa.bool_(), "int": pa.int32(), "long": pa.int64(),
    "float": pa.float32(), "double": pa.float64(), "bytes": pa.binary(), "string": pa.string(),
}

_Fix = Callable[[Any], Any]


class _AvroMapper:
    """Avro schema -> Arrow type, plus the fix-ups Arrow needs on fastavro's
    Python values (only ``uuid`` -> ``str`` today)."""

    def __init__(self, named: Mapping[str, Any]) -> None:
        self.named = named
        self.visiting: set[str] = set()

    def arrow(self, s: Any) -> tuple[pa.DataType, _Fix | None]:
        if isinstance(s, str):
            if s in _AVRO_PRIMITIVES:
                return _AVRO_PRIMITIVES[s], None
            if s in self.visiting:
                raise FormatError(f"avro format: recursive type {s!r} is not supported")
            if s not in self.named:
                raise FormatError(f"avro format: unknown type name {s!r}")
            return self.arrow(self.named[s])
        if isinstance(s, list):
            branches = [b for b in s if b != "null"]
            if not branches:
                return pa.null(), None
            if len(branches) > 1:
                raise FormatError(
                    f"avro format: union {json.dumps(s)[:80]} has several non-null "
                    "branches; only [\"null\", T] unions map to a column"
                )
            return self.arrow(branches[0])
        if not isinstance(s, dict):
            raise FormatError(f"avro format: unexpected schema node {s!r}")
        t = s.get("type")
        logical = s.get("logicalType")
        if t in ("record", "error"):
            name = s.get("name", "")
            self.visiting.add(name)
            fields = []
            fixes: dict[str, _Fix] = {}
            for f in s["fields"]:
                ft, fx = self.arrow(f["type"])
                fields.append(pa.field(f["name"], ft, nullable=True))
                if fx:
                    fixes[f["name"]] = fx
            self.visiting.discard(name)
            return pa.struct(fields), _RecordFix(fixes) if fixes else None
        if t == "enum":
            return pa.string(), None
        if t == "fixed":
            if logical == "decimal":
                return _avro_decimal(s), None
            return pa.binary(int(s["size"])), None
        if t == "array":
            it, ifx = self.arrow(s["items"])
            return pa.list_(it), _ListFix(ifx) if ifx else None
        if t == "map":
            vt, vfx = self.arrow(s["values"])
            return pa.map_(pa.string(), vt), _MapFix(vfx) if vfx else None
        if isinstance(t, str) and t in _AVRO_PRIMITIVES:
            match (t, logical):
                case ("int", "date"):
                    return pa.date32(), None
                case ("int", "time-millis"):
                    return pa.time32("ms"), None
                case ("long", "time-micros"):
                    return pa.time64("us"), None
                case ("long", "timestamp-millis"):
                    return pa.timestamp("ms", tz="UTC"), None
                case ("long", "timestamp-micros"):
                    return pa.timestamp("us", tz="UTC"), None
                case ("long", "timestamp-nanos"):
                    return pa.timestamp("ns", tz="UTC"), None
                case ("long", "local-timestamp-millis"):
                    return pa.timestamp("ms"), None
                case ("long", "local-timestamp-micros"):
                    return pa.timestamp("us"), None
                case ("long", "local-timestamp-nanos"):
                    return pa.timestamp("ns"), None
                case ("bytes", "decimal"):
                    return _avro_decimal(s), None
                case ("string", "uuid"):
                    return pa.string(), _UuidFix()
            return _AVRO_PRIMITIVES[t], None
        return self.arrow(t)


def _avro_decimal(s: Mapping[str, Any]) -> pa.DataType:
    p, sc = int(s["precision"]), int(s.get("scale", 0))
    return pa.decimal128(p, sc) if p <= 38 else pa.decimal256(p, sc)


class _UuidFix:
    def __call__(self, v: Any) -> Any:
        return None if v is None else str(v)


@dataclass(frozen=True)
class _RecordFix:
    fixes: dict[str, _Fix]

    def __call__(self, v: Any) -> Any:
        if v is None:
            return None
        return {k: (self.fixes[k](x) if k in self.fixes else x) for k, x in v.items()}


@dataclass(frozen=True)
class _ListFix:
    item: _Fix

    def __call__(self, v: Any) -> Any:
        return None if v is None else [self.item(x) for x in v]


@dataclass(frozen=True)
class _MapFix:
    value: _Fix

    def __call__(self, v: Any) -> Any:
        return None if v is None else {k: self.value(x) for k, x in v.items()}


class AvroDecoder:
    """``{"type": "avro", "schema": ..., "registry_url": ..., "subject": ...}``.

    * Without ``registry_url``: each record is a bare Avro datum written with
      ``schema``.
    * With ``registry_url``: each record is in the Confluent wire format
      (``0x00``, 4-byte big-endian schema id, datum). The writer schema is
      fetched by id (:class:`SchemaRegistryResolver`) and resolved against the
      reader schema: ``schema`` if given, else the latest version of
      ``subject``, fetched once when the decoder is built.

    The columns are the fields of the top-level record (one column ``value``
    if the schema is not a record): nested records -> struct, arrays -> list,
    maps -> map, ``["null", T]`` -> nullable T, enums -> string, bytes ->
    binary, fixed -> fixed-size binary, logical dates/times/timestamps/decimals
    -> the Arrow logical types. A datum that does not read (or leaves
    trailing bytes) is an error row with fastavro's message.
    """

    def __init__(
        self,
        schema: str | Mapping[str, Any] | list[Any] | None = None,
        registry_url: str | None = None,
        subject: str | None = None,
        allow_null: bool = False,
        timeout: float = 10.0,
    ) -> None:
        self.allow_null = allow_null
        self.resolver = SchemaRegistryResolver(registry_url, timeout) if registry_url else None
        if schema is None:
            if self.resolver is None or not subject:
                raise FormatError(
                    "avro format: give 'schema' (the reader schema), or 'registry_url' "
                    "with 'subject' to use the subject's latest schema"
                )
            schema = self.resolver.latest(subject)
        parsed: Any = schema
        if isinstance(schema, str):
            try:
                parsed = json.loads(schema)
            except ValueError:
                parsed = schema.strip()  # a bare primitive name such as string
        elif isinstance(schema, Mapping):
            parsed = dict(schema)
        named: dict[str, Any] = {}
        try:
            self._reader = fastavro.parse_schema(parsed, named_schemas=named)
        except Exception as exc:  # fastavro raises many types
            raise FormatError(f"avro format: invalid schema: {exc}") from None
        arrow, fix = _AvroMapper(named).arrow(self._reader)
        if isinstance(self._reader, dict) and self._reader.get("type") in ("record", "error"):
            self.schema = pa.schema(list(arrow))
            self._columns = [f.name for f in arrow]
            self._record = True
        else:
            self.schema = pa.schema([pa.field("value", arrow)])
            self._columns = ["value"]
            self._record = False
        self._fix = fix

    def _read_one(self, raw: bytes) -> Any:
        """One datum (raises on bad bytes; ``_SchemaMissing``/``TransientError``
        for registry faults)."""
        if self.resolver is not None:
            if len(raw) < 5 or raw[0] != 0:
                head = f"0x{raw[0]:02x}" if raw else "nothing"
                raise ValueError(
                    f"not in the Confluent wire format (starts with {head}, expected 0x00 "
                    "and a 4-byte schema id)"
                )
            writer = self.resolver.writer_schema(int.from_bytes(raw[1:5], "big"))
            body = io.BytesIO(raw)
            body.seek(5)
            value = fastavro.schemaless_reader(body, writer, self._reader)
        else:
            body = io.BytesIO(raw)
            value = fastavro.schemaless_reader(body, self._reader, None)
        rest = len(raw) - body.tell()
        if rest:
            raise ValueError(f"{rest} trailing bytes after the datum")
        return value

    def decode(self, data: pa.Array) -> DecodeResult:
        data = _as_binary(data)
        c = _Collector(self.schema, "avro")
        for i, raw in enumerate(data.to_pylist()):
            if raw is None:
                c.null(i, self.allow_null)
                continue
            try:
                value = self._read_one(raw)
                if self._fix is not None:
                    value = self._fix(value)
            except TransientError:
                raise
            except _SchemaMissing as exc:
                c.error(i, f"avro: {exc}")
                continue
            except Exception as exc:  # bad bytes fail in many ways
                msg = str(exc)
                c.error(i, f"avro: {type(exc).__name__}: {msg}" if msg else
                        f"avro: {type(exc).__name__} (truncated or corrupt datum)")
                continue
            c.row(i, [value.get(k) for k in self._columns] if self._record else [value])
        return c.result()


