"""The ``json_schema`` format: Confluent-framed JSON through a schema registry."""

from __future__ import annotations

import datetime as dt
import json
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

import pyarrow as pa
from jsonschema import Draft7Validator
from jsonschema.validators import validator_for
from pydantic import AfterValidator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from reclock.clients.schema_registry import Fetched
from reclock.contracts.config import ConfigModel
from reclock.contracts.decode import DecoderOptions, FormatError, FormatPlugin
from reclock.core.urls import URL_SECRET, check_url
from reclock.formats.registry_union import BadSchema, RegistryDecoder

_Conv = Callable[[Any], Any]
_INT64 = (-(2**63), 2**63 - 1)


def _text(v: Any) -> str:
    return json.dumps(v, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def _kind(v: Any) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number",
                                      str: "string", list: "array", dict: "object"
                                      }.get(type(v), type(v).__name__)


def _integer(v: Any) -> Any:
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)  # JSON Schema: 1.0 is an integer
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"expected an integer, got {_kind(v)} {_text(v)[:40]}")
    if not _INT64[0] <= v <= _INT64[1]:
        raise ValueError(f"integer {v} is out of the int64 range")
    return v


def _number(v: Any) -> Any:
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ValueError(f"expected a number, got {_kind(v)} {_text(v)[:40]}")
    return float(v)


def _boolean(v: Any) -> Any:
    if v is not None and not isinstance(v, bool):
        raise ValueError(f"expected a boolean, got {_kind(v)} {_text(v)[:40]}")
    return v


def _string(v: Any) -> Any:
    if v is not None and not isinstance(v, str):
        raise ValueError(f"expected a string, got {_kind(v)} {_text(v)[:40]}")
    return v


def _date_time(v: Any) -> Any:
    if v is None:
        return None
    _string(v)
    try:
        t = dt.datetime.fromisoformat(v)
    except ValueError:
        raise ValueError(f"{v[:40]!r} is not an RFC 3339 date-time") from None
    return t.replace(tzinfo=dt.UTC) if t.tzinfo is None else t.astimezone(dt.UTC)


def _date(v: Any) -> Any:
    if v is None:
        return None
    _string(v)
    try:
        return dt.date.fromisoformat(v)
    except ValueError:
        raise ValueError(f"{v[:40]!r} is not a date (YYYY-MM-DD)") from None


def _json_text(v: Any) -> Any:
    return None if v is None else _text(v)


def _null(v: Any) -> Any:
    if v is not None:
        raise ValueError(f"expected null, got {_kind(v)}")
    return None


_SIMPLE: dict[str, tuple[pa.DataType, _Conv]] = {
    "integer": (pa.int64(), _integer), "number": (pa.float64(), _number),
    "boolean": (pa.bool_(), _boolean), "string": (pa.string(), _string),
    "null": (pa.null(), _null),
}


class _Mapper:
    """A JSON Schema node -> (Arrow type, JSON value -> Arrow-ready value),
    following ``$ref`` into the document (``#/...``) and into referenced
    schemas (by their reference name, ``name`` or ``name#/...``)."""

    def __init__(self, root: Any, docs: Mapping[str, Any], where: str) -> None:
        self.root = root
        self.docs = docs
        self.where = where
        self.visiting: list[str] = []

    def _resolve(self, ref: str, doc: Any) -> tuple[Any, Any]:
        base, _, pointer = ref.partition("#")
        if base:
            target = self.docs.get(base)
            if target is None:  # a relative name resolved against nothing: try its tail
                target = self.docs.get(urllib.parse.urlsplit(base).path.rsplit("/", 1)[-1])
            if target is None:
                raise BadSchema(f"{self.where}: $ref {ref!r} names no referenced schema")
            doc = target
        node = doc
        for part in [p for p in pointer.split("/") if p]:
            part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
            try:
                node = node[int(part)] if isinstance(node, list) else node[part]
            except (KeyError, IndexError, ValueError, TypeError):
                raise BadSchema(f"{self.where}: $ref {ref!r} does not resolve") from None
        return node, doc

    def node(self, s: Any, doc: Any) -> tuple[pa.DataType, _Conv]:
        if s is True or s == {}:
            return pa.string(), _json_text
        if not isinstance(s, dict):
            raise BadSchema(f"{self.where}: unexpected schema node {_text(s)[:60]}")
        if "$ref" in s:
            ref = str(s["$ref"])
            key = f"{id(doc)}:{ref}"
            if key in self.visiting:
                raise BadSchema(f"{self.where}: $ref {ref!r} is recursive; a recursive schema "
                                "does not map to columns")
            target, tdoc = self._resolve(ref, doc)
            self.visiting.append(key)
            try:
                return self.node(target, tdoc)
            finally:
                self.visiting.pop()
        for comb in ("oneOf", "anyOf"):
            if comb in s and isinstance(s[comb], list):
                branches = [b for b in s[comb] if not (isinstance(b, dict)
                                                       and b.get("type") == "null")]
                if len(branches) == 1:
                    return self.node(branches[0], doc)
                return pa.string(), _json_text
        t = s.get("type")
        if isinstance(t, list):
            kinds = [k for k in t if k != "null"]
            if len(kinds) == 1:
                return self.node({**s, "type": kinds[0]}, doc)
            if not kinds:
                return _SIMPLE["null"]
            if set(kinds) == {"integer", "number"}:
                return _SIMPLE["number"]
            return pa.string(), _json_text
        if t is None:
            if "properties" in s:
                t = "object"
            elif "items" in s:
                t = "array"
            elif "enum" in s and all(isinstance(e, str) for e in s["enum"]):
                t = "string"
            else:
                return pa.string(), _json_text
        if t == "string":
            fmt = s.get("format")
            if fmt == "date-time":
                return pa.timestamp("us", tz="UTC"), _date_time
            if fmt == "date":
                return pa.date32(), _date
        if t in _SIMPLE:
            return _SIMPLE[t]
        if t == "array":
            items = s.get("items")
            if not isinstance(items, dict):
                return pa.string(), _json_text
            it, iconv = self.node(items, doc)

            def read_list(v: Any) -> Any:
                if v is None:
                    return None
                if not isinstance(v, list):
                    raise ValueError(f"expected an array, got {_kind(v)}")
                return [iconv(x) for x in v]

            return pa.list_(it), read_list
        if t == "object":
            props = s.get("properties")
            extra = s.get("additionalProperties")
            if not props and isinstance(extra, dict) and extra:
                vt, vconv = self.node(extra, doc)

                def read_map(v: Any) -> Any:
                    if v is None:
                        return None
                    if not isinstance(v, dict):
                        raise ValueError(f"expected an object, got {_kind(v)}")
                    return [(k, vconv(x)) for k, x in v.items()]

                return pa.map_(pa.string(), vt), read_map
            if not isinstance(props, dict) or not props:
                return pa.string(), _json_text
            fields, read = self.properties(props, doc)
            return pa.struct(fields), read
        raise BadSchema(f"{self.where}: unsupported type {t!r}")

    def properties(self, props: Mapping[str, Any], doc: Any
                   ) -> tuple[list[pa.Field], Callable[[Any], Any]]:
        fields: list[pa.Field] = []
        convs: list[tuple[str, _Conv]] = []
        for name, sub in props.items():
            t, conv = self.node(sub, doc)
            fields.append(pa.field(name, t, nullable=True))
            convs.append((name, conv))

        def read(v: Any) -> Any:
            if v is None:
                return None
            if not isinstance(v, dict):
                raise ValueError(f"expected an object, got {_kind(v)}")
            out = {}
            for name, conv in convs:
                try:
                    out[name] = conv(v.get(name))
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
            return out

        return fields, read


class JsonSchemaWriter:
    """One registered JSON Schema: its validator (references resolved
    through the registry) and its columns: the top-level object's
    properties, or one column ``value`` for a schema of another type."""

    def __init__(self, decoder: JsonSchemaDecoder, sid: int, fetched: Fetched) -> None:
        where = f"schema id {sid}"
        try:
            root = json.loads(fetched.text)
            docs = {ref.name: json.loads(dep.text)
                    for ref, dep in decoder.registry.closure(fetched)}
        except ValueError as exc:
            raise BadSchema(f"{where} is not valid JSON: {exc}") from None
        try:
            registry: Registry[Any] = Registry().with_resources(
                (name, Resource.from_contents(doc, default_specification=DRAFT7))
                for name, doc in docs.items())
            # no $schema: draft 7, as Confluent's serializers assume
            cls = validator_for(root, default=Draft7Validator)
            cls.check_schema(root)
            self.validator = cls(root, registry=registry)
        except Exception as exc:
            raise BadSchema(f"{where} is not a valid JSON Schema: {exc}") from None
        mapper = _Mapper(root, docs, where)
        t, conv = mapper.node(root, root)
        self._object = pa.types.is_struct(t)
        self.schema = pa.schema(list(t)) if self._object else pa.schema([pa.field("value", t)])
        self._conv = conv

    def read(self, payload: bytes) -> dict[str, Any]:
        doc = json.loads(payload.decode("utf-8"))
        err = next(iter(self.validator.iter_errors(doc)), None)
        if err is not None:
            at = "/".join(str(p) for p in err.absolute_path)
            raise ValueError(f"the value violates its schema{' at ' + at if at else ''}: "
                             f"{err.message[:200]}")
        if self._object:
            out: dict[str, Any] = self._conv(doc)
            return out
        return {"value": self._conv(doc)}


class JsonSchemaDecoder(RegistryDecoder):
    """``{"type": "json_schema", "registry_url": ..., "subject": ...}``.

    Each record is in Confluent's JSON Schema wire format: ``0x00``, the
    4-byte schema id, the JSON document. The writer schema is fetched by id
    (with the schemas its ``$ref`` names through references), the document
    validated against it (a document it refuses is an error row naming the
    place and the rule), and converted into the columns.

    Columns are the top-level object's properties (one column ``value`` for
    a schema of another type; see :mod:`~reclock.formats.registry_union` for
    how versions combine): integer -> int64, number -> float64, boolean ->
    bool, string -> string (``format: date-time`` -> ``timestamp[us, UTC]``,
    ``format: date`` -> date32), object with properties -> struct, object
    with only ``additionalProperties`` -> map<string, T>, array -> list,
    ``["T", "null"]`` and a ``oneOf``/``anyOf`` of T and null -> T;
    anything no one type holds (a union of types, an object without
    properties) -> its JSON text. Every column is nullable: a property not
    ``required`` may be absent; a required one that is absent fails
    validation.
    """

    name = "json_schema"
    schema_type = "JSON"

    def writer(self, schema_id: int, fetched: Fetched) -> JsonSchemaWriter:
        return JsonSchemaWriter(self, schema_id, fetched)


def _registry_url(url: str) -> str:
    check_url(url, ("http", "https"), what="the registry URL", example="host:8081")
    return url


class JsonSchemaFormat(ConfigModel):
    """JSON documents in Confluent's JSON Schema wire format, read through a
    schema registry: each validated against the writer schema its id names,
    the output's columns the union of the subject's versions."""

    type: Literal["json_schema"] = "json_schema"
    """``json_schema``."""
    registry_url: Annotated[str, AfterValidator(_registry_url), URL_SECRET]
    """A Confluent-compatible schema registry, e.g. ``http://registry:8081``;
    basic auth as ``https://user:password@registry:8081`` (the password
    percent-encoded where it holds reserved characters, and never printed)."""
    subject: str
    """The subject whose versions make the columns (e.g. ``orders-value``)."""


def _decoder(spec: Mapping[str, Any], options: DecoderOptions) -> JsonSchemaDecoder:
    url, subject = spec.get("registry_url"), spec.get("subject")
    if not isinstance(url, str) or not isinstance(subject, str):
        raise FormatError("json_schema format: give 'registry_url' and 'subject'")
    return JsonSchemaDecoder(
        url, subject, allow_null=options.allow_null, timeout=float(spec.get("timeout", 10.0)),
        policy=options.policy, known=options.known, seen=options.seen, part=options.part)


#: (``timeout``, the registry's, is for specs written in code)
PLUGIN = FormatPlugin(name="json_schema", config=JsonSchemaFormat, decoder=_decoder,
                      extra_keys=("timeout",))
