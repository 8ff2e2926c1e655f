"""The ``protobuf`` format: Confluent-framed Protobuf through a schema registry."""

from __future__ import annotations

import base64
import datetime as dt
import json
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

import pyarrow as pa
from google.protobuf import (
    any_pb2,
    api_pb2,
    descriptor_pb2,
    descriptor_pool,
    duration_pb2,
    empty_pb2,
    field_mask_pb2,
    json_format,
    message_factory,
    source_context_pb2,
    struct_pb2,
    timestamp_pb2,
    type_pb2,
    wrappers_pb2,
)
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from pydantic import AfterValidator

from reclock.clients.schema_registry import Fetched
from reclock.contracts.config import ConfigModel
from reclock.contracts.decode import DecoderOptions, FormatError, FormatPlugin
from reclock.core.urls import URL_SECRET, check_url
from reclock.formats.registry_union import BadSchema, RegistryDecoder

# the well-known types a schema may import without a reference: in the
# default pool once their modules are imported
_WELL_KNOWN = (any_pb2, api_pb2, duration_pb2, empty_pb2, field_mask_pb2, source_context_pb2,
               struct_pb2, timestamp_pb2, type_pb2, wrappers_pb2)
try:  # Confluent's own (confluent/meta.proto, decimal): imported by schemas its tools write
    from confluent_kafka.schema_registry.confluent import meta_pb2  # noqa: F401
    from confluent_kafka.schema_registry.confluent.type import decimal_pb2  # noqa: F401
except ImportError:  # pragma: no cover - shipped with confluent-kafka[protobuf]
    pass

_Conv = Callable[[Any], Any]

_F = FieldDescriptor
_SCALARS: dict[int, pa.DataType] = {
    _F.TYPE_INT32: pa.int32(), _F.TYPE_SINT32: pa.int32(), _F.TYPE_SFIXED32: pa.int32(),
    _F.TYPE_INT64: pa.int64(), _F.TYPE_SINT64: pa.int64(), _F.TYPE_SFIXED64: pa.int64(),
    _F.TYPE_UINT32: pa.uint32(), _F.TYPE_FIXED32: pa.uint32(),
    _F.TYPE_UINT64: pa.uint64(), _F.TYPE_FIXED64: pa.uint64(),
    _F.TYPE_BOOL: pa.bool_(), _F.TYPE_STRING: pa.string(), _F.TYPE_BYTES: pa.binary(),
    _F.TYPE_DOUBLE: pa.float64(), _F.TYPE_FLOAT: pa.float32(),
}
_WRAPPERS: dict[str, pa.DataType] = {
    "google.protobuf.DoubleValue": pa.float64(), "google.protobuf.FloatValue": pa.float32(),
    "google.protobuf.Int64Value": pa.int64(), "google.protobuf.UInt64Value": pa.uint64(),
    "google.protobuf.Int32Value": pa.int32(), "google.protobuf.UInt32Value": pa.uint32(),
    "google.protobuf.BoolValue": pa.bool_(), "google.protobuf.StringValue": pa.string(),
    "google.protobuf.BytesValue": pa.binary(),
}
_JSON_TYPES = ("google.protobuf.Struct", "google.protobuf.Value", "google.protobuf.ListValue")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def _same(v: Any) -> Any:
    return v


def _timestamp(m: Any) -> Any:
    return _EPOCH + dt.timedelta(seconds=m.seconds, microseconds=m.nanos // 1000)


def _duration(m: Any) -> Any:
    return dt.timedelta(seconds=m.seconds, microseconds=int(m.nanos / 1000))


def _wrapped(m: Any) -> Any:
    return m.value


def _as_json(m: Any) -> Any:
    return json.dumps(json_format.MessageToDict(m), separators=(",", ":"), sort_keys=True)


class _Mapper:
    """A message descriptor -> (Arrow struct type, message -> dict)."""

    def __init__(self) -> None:
        self.visiting: set[str] = set()

    def message(self, desc: Descriptor) -> tuple[pa.DataType, _Conv]:
        name = desc.full_name
        if name == "google.protobuf.Timestamp":
            return pa.timestamp("us", tz="UTC"), _timestamp
        if name == "google.protobuf.Duration":
            return pa.duration("us"), _duration
        if name in _WRAPPERS:
            return _WRAPPERS[name], _wrapped
        if name in _JSON_TYPES:
            return pa.string(), _as_json
        if name in self.visiting:
            raise BadSchema(f"message {name} is recursive; a recursive message does not map "
                            "to columns")
        self.visiting.add(name)
        fields: list[pa.Field] = []
        convs: list[tuple[str, FieldDescriptor, _Conv, bool]] = []
        for f in desc.fields:
            t, conv = self.field(f)
            fields.append(pa.field(f.name, t, nullable=True))
            # a field with presence (a message, proto3 optional, a oneof
            # member, proto2) unset is null; a plain proto3 scalar its default
            presence = (not f.is_repeated) and f.has_presence
            convs.append((f.name, f, conv, presence))
        self.visiting.discard(name)

        def read(m: Any) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for fname, _f, conv, presence in convs:
                if presence and not m.HasField(fname):
                    out[fname] = None
                else:
                    out[fname] = conv(getattr(m, fname))
            return out

        return pa.struct(fields), read

    def field(self, f: FieldDescriptor) -> tuple[pa.DataType, _Conv]:
        mt = f.message_type
        if mt is not None and mt.GetOptions().map_entry:
            kt, kconv = self.single(mt.fields_by_name["key"])
            vt, vconv = self.single(mt.fields_by_name["value"])

            def read_map(m: Any) -> list[tuple[Any, Any]]:
                return [(kconv(k), vconv(v)) for k, v in m.items()]

            return pa.map_(kt, vt), read_map
        t, conv = self.single(f)
        if f.is_repeated:
            def read_list(m: Any) -> list[Any]:
                return [conv(x) for x in m]

            return pa.list_(t), read_list
        return t, conv

    def single(self, f: FieldDescriptor) -> tuple[pa.DataType, _Conv]:
        if f.type in (_F.TYPE_MESSAGE, _F.TYPE_GROUP):
            return self.message(f.message_type)
        if f.type == _F.TYPE_ENUM:
            names: dict[int, str] = {int(v.number): str(v.name) for v in f.enum_type.values}

            def read_enum(n: int) -> str:
                return names.get(n, str(n))  # an unknown number (open enums) as its digits

            return pa.string(), read_enum
        t = _SCALARS.get(f.type)
        if t is None:  # pragma: no cover - every scalar type is listed
            raise BadSchema(f"field {f.full_name}: unsupported Protobuf type {f.type}")
        return t, _same


def _file(name: str, text: str, where: str) -> descriptor_pb2.FileDescriptorProto:
    try:
        proto = descriptor_pb2.FileDescriptorProto.FromString(
            base64.b64decode(text.encode("ascii"), validate=True))
    except Exception:
        raise BadSchema(f"{where} is not a serialized FileDescriptorProto (the registry should "
                        "answer format=serialized with one)") from None
    proto.name = name
    return proto


class ProtobufWriter:
    """One registered Protobuf schema: a descriptor pool holding it, the
    files it references and the well-known types; the message the output
    reads, and its columns."""

    def __init__(self, decoder: ProtobufDecoder, sid: int, fetched: Fetched) -> None:
        where = f"schema id {sid}"
        self.pool = descriptor_pool.DescriptorPool()
        added: set[str] = set()
        refs = list(decoder.registry.closure(fetched))
        named = {ref.name for ref, _ in refs}

        def builtin(name: str) -> None:
            if name in added or name in named:
                return
            try:
                fd = descriptor_pool.Default().FindFileByName(name)
            except KeyError:
                raise BadSchema(f"{where} imports {name!r}, which is neither a reference nor a "
                                "well-known type") from None
            for dep in fd.dependencies:
                builtin(dep.name)
            proto = descriptor_pb2.FileDescriptorProto()
            fd.CopyToProto(proto)
            self.pool.Add(proto)
            added.add(name)

        def add(proto: descriptor_pb2.FileDescriptorProto) -> None:
            for dep in proto.dependency:
                builtin(dep)
            try:
                self.pool.Add(proto)
            except Exception as exc:
                raise BadSchema(f"{where}: file {proto.name!r} does not build: {exc}") from None
            added.add(proto.name)

        for ref, dep in refs:
            add(_file(ref.name, dep.text, f"{where}: reference {ref.name!r}"))
        main = _file(f"reclock/schema-{sid}.proto", fetched.text, where)
        add(main)
        self.proto = main
        self._paths: dict[tuple[int, ...], str] = {}
        if decoder.message:
            try:
                self.desc = self.pool.FindMessageTypeByName(decoder.message)
            except KeyError:
                raise BadSchema(f"{where} has no message {decoder.message!r}") from None
        else:
            if not main.message_type:
                raise BadSchema(f"{where} defines no message")
            first = main.message_type[0].name
            self.desc = self.pool.FindMessageTypeByName(
                f"{main.package}.{first}" if main.package else first)
        t, self._read = _Mapper().message(self.desc)
        self.schema = pa.schema(list(t))
        self._class: type[Message] | None = None

    def _message(self, indexes: list[int]) -> str:
        """The full name of the message the message-index path names (the
        index of a top-level message, then of nested ones)."""
        key = tuple(indexes)
        hit = self._paths.get(key)
        if hit is None:
            node: Any = self.proto
            names = [self.proto.package] if self.proto.package else []
            for k in indexes:
                msgs = node.message_type if node is self.proto else node.nested_type
                if not 0 <= k < len(msgs):
                    raise ValueError(f"message index {indexes} names no message of the schema")
                node = msgs[k]
                names.append(node.name)
            hit = self._paths[key] = ".".join(names)
        return hit

    def read(self, payload: bytes) -> dict[str, Any]:
        indexes, pos = _indexes(payload)
        name = self._message(indexes)
        if name != self.desc.full_name:
            raise ValueError(f"the record is a {name}, the output reads {self.desc.full_name}")
        if self._class is None:
            self._class = message_factory.GetMessageClass(self.desc)
        msg = self._class()
        body = payload[pos:]
        if msg.ParseFromString(body) != len(body):
            raise ValueError("trailing bytes after the message")
        out: dict[str, Any] = self._read(msg)
        return out


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated message-index array")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _zigzag(data: bytes, pos: int) -> tuple[int, int]:
    n, pos = _varint(data, pos)
    return (n >> 1) ^ -(n & 1), pos


def _indexes(payload: bytes) -> tuple[list[int], int]:
    """The message-index array after the schema id (zigzag varints: a count,
    then the path; a count of 0 is ``[0]``, the first message) and where the
    message starts."""
    count, pos = _zigzag(payload, 0)
    if count == 0:
        return [0], pos
    if count < 0 or count > 100:
        raise ValueError(f"message-index array of length {count}")
    out = []
    for _ in range(count):
        k, pos = _zigzag(payload, pos)
        out.append(k)
    return out, pos


class ProtobufDecoder(RegistryDecoder):
    """``{"type": "protobuf", "registry_url": ..., "subject": ..., "message": ...}``.

    Each record is in Confluent's Protobuf wire format: ``0x00``, the 4-byte
    schema id, the message-index array, the message. The writer schema is
    fetched by id as a serialized ``FileDescriptorProto`` (with the files
    it imports: references to other subjects, or well-known types), built
    into a descriptor pool, and the record parsed with the message class it
    generates. The output reads one message type: ``message`` (a full name,
    ``shop.Order``), else the first message of the schema; a record of
    another message is an error row.

    Columns are the message's fields (see :mod:`~reclock.formats.registry_union`
    for how versions combine): int32/sint32/sfixed32 -> int32, the 64-bit
    ones -> int64, uint32/fixed32 -> uint32, uint64/fixed64 -> uint64, bool,
    string, bytes -> binary, double -> float64, float -> float32, enum ->
    string (its value's name; an unknown number as its digits), a message
    -> struct, repeated -> list, map -> map, ``google.protobuf.Timestamp``
    -> ``timestamp[us, UTC]``, ``Duration`` -> ``duration[us]``, the wrapper
    types -> their nullable scalar, ``Struct``/``Value``/``ListValue`` ->
    their JSON text. A field with presence (a message, ``optional``, a
    ``oneof`` member) that is unset is null; a plain proto3 scalar holds its
    default, as Protobuf reads it.
    """

    name = "protobuf"
    schema_type = "PROTOBUF"
    registry_format = "serialized"

    def __init__(self, registry_url: str, subject: str, message: str | None = None,
                 **kwargs: Any) -> None:
        self.message = message.lstrip(".") if message else None
        super().__init__(registry_url, subject, **kwargs)

    def writer(self, schema_id: int, fetched: Fetched) -> ProtobufWriter:
        return ProtobufWriter(self, schema_id, fetched)


def _registry_url(url: str) -> str:
    check_url(url, ("http", "https"), what="the registry URL", example="host:8081")
    return url


class ProtobufFormat(ConfigModel):
    """Protobuf records in Confluent's wire format, read through a schema
    registry: the writer schema is fetched by the id each record carries,
    and the output's columns are the union of the subject's versions."""

    type: Literal["protobuf"] = "protobuf"
    """``protobuf``."""
    registry_url: Annotated[str, AfterValidator(_registry_url), URL_SECRET]
    """A Confluent-compatible schema registry, e.g. ``http://registry:8081``;
    basic auth as ``https://user:password@registry:8081`` (the password
    percent-encoded where it holds reserved characters, and never printed)."""
    subject: str
    """The subject whose versions make the columns (e.g. ``orders-value``)."""
    message: str | None = None
    """The message type the output reads, by full name (``shop.Order``);
    default: the first message of the schema (what Confluent's serializers
    write for a top-level message)."""


def _decoder(spec: Mapping[str, Any], options: DecoderOptions) -> ProtobufDecoder:
    url, subject = spec.get("registry_url"), spec.get("subject")
    if not isinstance(url, str) or not isinstance(subject, str):
        raise FormatError("protobuf format: give 'registry_url' and 'subject'")
    return ProtobufDecoder(
        url, subject, spec.get("message"), allow_null=options.allow_null,
        timeout=float(spec.get("timeout", 10.0)), policy=options.policy, known=options.known,
        seen=options.seen, part=options.part)


#: (``timeout``, the registry's, is for specs written in code)
PLUGIN = FormatPlugin(name="protobuf", config=ProtobufFormat, decoder=_decoder,
                      extra_keys=("timeout",))
