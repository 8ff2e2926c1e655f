"""The ``avro`` format: Confluent-framed Avro with the schema registry client."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import fastavro
import numpy as np
import numpy.typing as npt
import pyarrow as pa
from pydantic import AfterValidator, BeforeValidator, Field
from pydantic_core import InitErrorDetails

from reclock.clients.schema_registry import (
    Fetched,
    RegistryConfigError,
    RegistryHandle,
    SchemaMissing,
)
from reclock.contracts.config import ConfigModel, problem
from reclock.contracts.decode import (
    DecodeResult,
    DecoderOptions,
    FormatError,
    FormatPlugin,
)
from reclock.core.errors import DefiniteError, SchemaChanged
from reclock.core.urls import URL_SECRET, check_url, mask_url
from reclock.formats import avro_union as au
from reclock.formats.registry_union import decode_each

I64 = npt.NDArray[np.int64]

# avro


class _SchemaMissing(SchemaMissing):
    """A schema id names a schema that is not Avro (or not valid Avro)."""


class SchemaRegistryResolver:
    """Avro writer schemas from a Confluent-compatible schema registry, by id.

    Through :class:`~reclock.clients.schema_registry.RegistryHandle`
    (confluent-kafka's ``SchemaRegistryClient``, one per process, never
    pickled): parsed schemas are cached by id for the life of the object
    (ids are immutable) and travel with it when pickled. A schema id the
    registry does not know (HTTP 404), or that names a schema that is not
    Avro, is a definite fault of the records naming it; anything else
    (connection refused, timeout, 5xx) raises
    :class:`~reclock.core.errors.TransientError`. Basic auth may be given as
    ``http://user:secret@host``; the secret never appears in a message.

    A schema with references (named types registered under other subjects)
    is answered with the referenced definitions inlined where first used,
    so that it stands alone (:func:`_inline_references`).
    """

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        try:
            self.handle = RegistryHandle(url, timeout)
        except RegistryConfigError:
            raise FormatError(f"registry_url must be an http(s) URL, got {mask_url(url)!r}"
                              ) from None
        self.url = self.handle.url
        self._schemas: dict[int, Any] = {}
        self._texts: dict[int, str] = {}

    def __repr__(self) -> str:
        return f"SchemaRegistryResolver({self.url!r})"

    def _avro_text(self, fetched: Fetched, where: str) -> str:
        if fetched.schema_type != "AVRO":
            raise _SchemaMissing(f"{where} is a {fetched.schema_type} schema, not AVRO")
        if not fetched.references:
            return fetched.text
        deps = [dep.text for _, dep in self.handle.closure(fetched)]
        try:
            return _inline_references(fetched.text, deps)
        except (ValueError, KeyError, TypeError) as exc:
            raise _SchemaMissing(f"{where}: its references do not resolve: {exc}") from None

    def writer_schema(self, schema_id: int) -> Any:
        """The parsed writer schema registered under ``schema_id``."""
        hit = self._schemas.get(schema_id)
        if hit is None:
            text = self.writer_text(schema_id)
            try:
                hit = fastavro.parse_schema(json.loads(text))
            except Exception as exc:  # any parse failure is definite
                raise _SchemaMissing(f"schema id {schema_id} is not valid Avro: {exc}") from None
            self._schemas[schema_id] = hit
        return hit

    def versions(self, subject: str) -> dict[int, tuple[int, str]] | None:
        """``version -> (schema id, schema text)`` of every version of
        ``subject`` the registry lists now; None when it knows no such subject
        (never registered, or deleted)."""
        listed = self.handle.versions(subject)
        if listed is None:
            return None
        return {v: (sid, self._avro_text(f, f"subject {subject!r} version {v}"))
                for v, (sid, f) in listed.items()}

    def writer_text(self, schema_id: int) -> str:
        """The text of the schema registered under ``schema_id`` (cached)."""
        text = self._texts.get(schema_id)
        if text is None:
            text = self._avro_text(self.handle.schema(schema_id), f"schema id {schema_id}")
            self._texts[schema_id] = text
        return text


_NAMED = ("record", "error", "enum", "fixed")


def _full_name(name: str, namespace: str) -> str:
    return name if "." in name or not namespace else f"{namespace}.{name}"


def _inline_references(text: str, deps: Sequence[str]) -> str:
    """The Avro schema ``text`` standing alone: each named type it takes
    from the referenced schemas ``deps`` is inlined (under its full name)
    where it is first used, later uses keep the name, as Avro wants."""
    defs: dict[str, Any] = {}

    def collect(node: Any, ns: str) -> None:
        if isinstance(node, list):
            for b in node:
                collect(b, ns)
        elif isinstance(node, dict):
            t = node.get("type")
            if t in _NAMED and isinstance(node.get("name"), str):
                full = _full_name(node["name"], str(node.get("namespace") or ns))
                defs.setdefault(full, {**{k: v for k, v in node.items() if k != "namespace"},
                                       "name": full})
                inner = full.rpartition(".")[0]
                for f in node.get("fields", ()):
                    collect(f.get("type"), inner)
            elif t in ("array", "map"):
                collect(node.get("items", node.get("values")), ns)
            elif isinstance(t, (dict, list)):
                collect(t, ns)

    for dep in deps:
        collect(json.loads(dep), "")
    defined: set[str] = set()

    def inline(node: Any, ns: str) -> Any:
        if isinstance(node, str):
            if node in _AVRO_PRIMITIVES:
                return node
            for full in (_full_name(node, ns), node):
                if full in defined:
                    return full
                if full in defs:
                    defined.add(full)
                    return inline(defs[full], ns)
            return node
        if isinstance(node, list):
            return [inline(b, ns) for b in node]
        if not isinstance(node, dict):
            return node
        t = node.get("type")
        if t in _NAMED and isinstance(node.get("name"), str):
            full = _full_name(node["name"], str(node.get("namespace") or ns))
            defined.add(full)
            inner = full.rpartition(".")[0]
            out = dict(node)
            if "fields" in node:
                out["fields"] = [{**f, "type": inline(f.get("type"), inner)}
                                 for f in node["fields"]]
            return out
        if t == "array":
            return {**node, "items": inline(node.get("items"), ns)}
        if t == "map":
            return {**node, "values": inline(node.get("values"), ns)}
        return {**node, "type": inline(t, ns)}

    return json.dumps(inline(json.loads(text), ""))


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


#: ``schema_change`` of a decoder made without one
_DEFAULT_POLICY = "evolve"


class AvroDecoder:
    """``{"type": "avro", "schema": ..., "registry_url": ..., "subject": ...}``.

    * Without ``registry_url``: each record is a bare Avro datum written with
      ``schema``.
    * With ``registry_url``: each record is in the Confluent wire format
      (``0x00``, 4-byte big-endian schema id, datum). The writer schema is
      fetched by id (:class:`SchemaRegistryResolver`) and each record is
      resolved from its own writer schema into the *union* of the writer
      schemas the output takes (:mod:`reclock.formats.avro_union`): the
      format's ``schema`` if given, the schemas recorded before (``known``:
      what :meth:`fact` returned to the driver last time), every version of
      ``subject`` the registry lists now, and the ids in ``seen``. A record
      whose writer schema the union already holds is decoded; one that would
      change the union is handled by ``policy`` (the output's
      ``schema_change``): ``evolve`` raises :class:`SchemaChanged` (the driver
      re-opens with the new union), ``freeze`` decodes it into today's
      columns and counts the values of fields they lack
      (:attr:`DecodeResult.dropped`), ``fail`` raises a definite error naming
      the subject, the schema id and the change. A writer schema no union can
      hold (:class:`~reclock.formats.avro_union.Incompatible`) is a definite
      error under every policy.

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
        *,
        policy: str = _DEFAULT_POLICY,
        known: Mapping[str, Any] | None = None,
        seen: Sequence[int] = (),
        part: str = "value",
    ) -> None:
        self.allow_null = allow_null
        self.policy = policy
        self.part = part
        self.subject = subject
        self.resolver = SchemaRegistryResolver(registry_url, timeout) if registry_url else None
        if schema is None and (self.resolver is None or not subject):
            raise FormatError(
                "avro format: give 'schema' (the reader schema), or 'registry_url' "
                "with 'subject' to use the union of the subject's versions"
            )
        explicit = None if schema is None else _parsed(schema)
        #: notes for the progress log (a subject found reset)
        self.notes: list[str] = []
        self._ids: dict[int, str] = {}  # registry ids merged into the union -> text
        self._order: list[int] = []
        self._versions: dict[int, int] = {}
        self._union: Any = None
        if self.resolver is None:
            assert explicit is not None
            self._set_reader(explicit)
            return
        if explicit is not None:
            self._union = self._merged(None, explicit, "the format's schema")
        self._build(known or {}, seen)
        self._set_reader(au.to_json(self._union))

    # -- the union (driver side) -----------------------------------------------------------
    @property
    def evolving(self) -> bool:
        """Whether the columns follow a registry (re-described at every open)."""
        return self.resolver is not None

    def _where(self) -> str:
        return f"subject {self.subject!r}" if self.subject else "the records' writer schemas"

    def _merged(self, union: Any, schema: Any, label: str) -> Any:
        # a subject's versions come in order: a later one adding a required
        # field without a default is refused, as a registry's backward check
        # would; beside a declared reader schema, writers come in any order
        try:
            return au.merge(union, au.expand(schema), strict=bool(self.subject))
        except au.Incompatible as exc:
            raise DefiniteError(
                f"avro format, {self._where()}: {label} is incompatible with the schemas "
                f"before it: {exc.args[0]}",
                hint="register a compatible version (a new field needs a default or a null "
                     "branch; a type may only widen: int -> long, float -> double), or re-read "
                     "the output in the new shape (`reclock resnapshot`, or a new target)"
            ) from None

    def _take(self, sid: int, text: str, label: str) -> None:
        if sid in self._ids:
            return
        try:
            doc = json.loads(text)
        except ValueError:
            doc = text.strip()
        self._union = self._merged(self._union, doc, label)
        self._ids[sid] = text
        self._order.append(sid)

    def _build(self, known: Mapping[str, Any], seen: Sequence[int]) -> None:
        assert self.resolver is not None
        recorded = {int(k): str(v) for k, v in dict(known.get("schemas") or {}).items()}
        for sid in [int(i) for i in known.get("order") or sorted(recorded)]:
            if sid in recorded:
                self._take(sid, recorded[sid], f"schema id {sid} (taken before)")
        was = {int(k): int(v) for k, v in dict(known.get("versions") or {}).items()}
        now = self.resolver.versions(self.subject) if self.subject else {}
        if self.subject and now is None and not was and not self._ids and self._union is None:
            raise FormatError(f"avro format: schema registry {self.resolver.url} has no "
                              f"subject {self.subject!r}")
        now = now or {}
        gone = {v: sid for v, sid in was.items() if now.get(v, (None, ""))[0] != sid}
        if gone:
            # The subject was deleted (and maybe registered again): its old
            # versions are kept (recorded), its new ones must fit with them.
            said = ", ".join(f"version {v} was id {sid}, "
                             + (f"is id {now[v][0]}" if v in now else "is gone")
                             for v, sid in sorted(gone.items()))
            self.notes.append(f"schema registry subject {self.subject!r} was reset ({said})")
            try:
                for v, (sid, text) in now.items():
                    self._take(sid, text, f"version {v} (schema id {sid})")
            except DefiniteError as exc:
                raise DefiniteError(
                    f"schema registry subject {self.subject!r} was deleted and registered "
                    f"again ({said}), and its new schemas do not fit the output: "
                    f"{exc.args[0]}",
                    hint="if the subject was reset on purpose, re-read the output in its new "
                         "shape (`reclock resnapshot`, or a new target); else restore the "
                         "subject's versions") from None
        else:
            for v, (sid, text) in now.items():
                self._take(sid, text, f"version {v} (schema id {sid})")
        self._versions = {v: sid for v, (sid, _) in now.items()}
        for sid in seen:
            if sid not in self._ids:
                self._take(sid, self.resolver.writer_text(sid), f"schema id {sid}")
        if self._union is None:
            raise FormatError(f"avro format: {self._where()} has no schema yet",
                              hint="register the subject's first version")

    def fact(self) -> dict[str, Any]:
        """What identifies the union, for the driver to keep durably: the
        subject's versions (version -> schema id) and every schema taken."""
        return {"subject": self.subject, "versions": {str(v): i for v, i in
                                                      sorted(self._versions.items())},
                "order": list(self._order), "schemas": {str(i): t for i, t in self._ids.items()}}

    def _set_reader(self, parsed: Any) -> None:
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
        #: writer ids judged in this process: the reader to resolve them into
        #: (freeze: the union with them) and the fields the output lacks
        self._judged: dict[int, tuple[Any, tuple[str, ...]]] = {}

    # -- decoding (executors) --------------------------------------------------------------
    def _judge(self, sid: int, writer: Any) -> tuple[Any, tuple[str, ...]]:
        """(the reader to resolve records of writer ``sid`` into, the fields
        they carry that the output lacks); raises per the policy."""
        hit = self._judged.get(sid)
        if hit is not None:
            return hit
        if sid in self._ids:
            hit = (self._reader, ())
        else:
            assert self.resolver is not None
            text = self.resolver.writer_text(sid)
            label = f"schema id {sid}"
            try:
                doc = json.loads(text)
            except ValueError:
                doc = text.strip()
            merged = self._merged(self._union, doc, label)
            if au.canonical(merged) == au.canonical(self._union):
                hit = (self._reader, ())
            else:
                have = set(self._columns)
                new = tuple(f["name"] for f in merged.get("fields", ()) if f["name"] not in have
                            ) if isinstance(merged, dict) else ()
                what = (f"fields {list(new)} added" if new else "field types changed")
                if self.policy == "evolve":
                    exc = SchemaChanged(
                        f"avro format, {self._where()}: records written with {label} change "
                        f"the output's shape ({what}); the output evolves",
                        hint="the source re-opens and the sink takes the new shape")
                    exc.schema_id = sid
                    exc.part = self.part
                    raise exc
                if self.policy == "fail":
                    raise DefiniteError(
                        f"avro format, {self._where()}: records written with {label} change "
                        f"the output's shape ({what}) and the output's schema_change is fail",
                        hint="to take it, set schema_change: evolve (or freeze) on the output "
                             "and restart; or re-read the output in its new shape with "
                             "`reclock resnapshot`")
                hit = (fastavro.parse_schema(au.to_json(merged), named_schemas={}), new)
        self._judged[sid] = hit
        return hit

    def _read_one(self, raw: bytes) -> tuple[Any, tuple[str, ...]]:
        """One datum and the fields of it the output lacks (raises on bad
        bytes; ``_SchemaMissing``/``TransientError`` for registry faults)."""
        lacks: tuple[str, ...] = ()
        if self.resolver is not None:
            if len(raw) < 5 or raw[0] != 0:
                head = f"0x{raw[0]:02x}" if raw else "nothing"
                raise ValueError(
                    f"not in the Confluent wire format (starts with {head}, expected 0x00 "
                    "and a 4-byte schema id)"
                )
            sid = int.from_bytes(raw[1:5], "big")
            writer = self.resolver.writer_schema(sid)
            reader, lacks = self._judge(sid, writer)
            body = io.BytesIO(raw)
            body.seek(5)
            value = fastavro.schemaless_reader(body, writer, reader)
        else:
            body = io.BytesIO(raw)
            value = fastavro.schemaless_reader(body, self._reader, None)
        rest = len(raw) - body.tell()
        if rest:
            raise ValueError(f"{rest} trailing bytes after the datum")
        return value, lacks

    def decode(self, data: pa.Array) -> DecodeResult:
        def read(raw: bytes) -> tuple[Any, Sequence[str]]:
            value, lacks = self._read_one(raw)
            return (value if self._fix is None else self._fix(value)), lacks

        columns = self._columns
        return decode_each(
            data, self.schema, "avro", self.allow_null, "datum", read,
            (lambda value: [value.get(k) for k in columns]) if self._record
            else (lambda value: [value]))


def _parsed(schema: str | Mapping[str, Any] | list[Any]) -> Any:
    if isinstance(schema, str):
        try:
            return json.loads(schema)
        except ValueError:
            return schema.strip()  # a bare primitive name such as string
    if isinstance(schema, Mapping):
        return dict(schema)
    return schema


def _registry_url(url: str | None) -> str | None:
    """A schema registry URL reads alike everywhere (see :func:`check_url`)."""
    if url is not None:
        check_url(url, ("http", "https"), what="the registry URL",
                  example="host:8081")
    return url


def _avro_schema(value: Any) -> Any:
    """An inline Avro schema: a JSON string or a mapping, stored as JSON text."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return json.dumps(value, sort_keys=True)
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            raise ValueError("expected an Avro schema as a JSON string or a mapping") from None
        return value
    raise ValueError("expected an Avro schema as a JSON string or a mapping")


class AvroFormat(ConfigModel):
    """Avro records. Without ``registry_url`` each record is a bare Avro datum
    written with ``schema``. With ``registry_url`` each record is in the
    Confluent wire format (magic byte, schema id): the writer schema is fetched
    by id, and the reader schema is ``schema`` or the latest version of
    ``subject``."""

    type: Literal["avro"] = "avro"
    """``avro``."""
    schema_: Annotated[str | None, BeforeValidator(_avro_schema)] = Field(
        default=None, alias="schema"
    )
    """The (reader) Avro schema, inline: a JSON string or a YAML mapping (stored
    as JSON text)."""
    registry_url: Annotated[str | None, AfterValidator(_registry_url), URL_SECRET] = None
    """A Confluent-compatible schema registry, e.g. ``http://registry:8081``;
    basic auth as ``https://user:password@registry:8081`` (the password
    percent-encoded where it holds reserved characters, and never printed)."""
    subject: str | None = None
    """With ``registry_url`` and no ``schema``: read with this subject's latest
    schema (e.g. ``orders-value``)."""

    @classmethod
    def check_raw(cls, data: Mapping[str, Any]) -> list[InitErrorDetails]:
        schema, url, subject = (data.get(k) for k in ("schema", "registry_url", "subject"))
        if schema is None and (url is None or subject is None):
            return [problem((), "expected 'schema', or 'registry_url' with 'subject'")]
        if subject is not None and url is None:
            return [problem(("subject",), "only applies with 'registry_url'", on_key=True)]
        return []


def _decoder(spec: Mapping[str, Any], options: DecoderOptions) -> AvroDecoder:
    return AvroDecoder(
        spec.get("schema"), registry_url=spec.get("registry_url"), subject=spec.get("subject"),
        allow_null=options.allow_null, timeout=float(spec.get("timeout", 10.0)),
        policy=options.policy, known=options.known, seen=options.seen, part=options.part,
    )


#: (``timeout``, the registry's, is for specs written in code)
PLUGIN = FormatPlugin(name="avro", config=AvroFormat, decoder=_decoder, extra_keys=("timeout",))
