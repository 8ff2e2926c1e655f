"""Record formats of the Kafka sink: plain JSON, and Avro, Protobuf and JSON
Schema in Confluent's wire format through a schema registry.

Every format starts from the same *plain document* of a row: its values cast
to their plain type (:func:`reclock.sinks.kafka.plain_type`: temporal values
as integers in their unit, decimals as strings) and made JSON-able
(:func:`reclock.contracts.encoding.to_json`: binary as base64, non-finite
floats as ``"NaN"``/``"Infinity"``/``"-Infinity"``, a map as a list of
``[key, value]`` pairs). The ``json`` format writes that document as it is;
the registry formats convert it to their own values on the way out and back
to it on the way in, so that reading a record gives exactly the row that was
written. The record's schema is derived from the Arrow schema of what it
holds (:class:`Codec`):

==============  ====================  ==========================  ====================
Arrow           Avro                  Protobuf (proto3)           JSON Schema
==============  ====================  ==========================  ====================
bool            boolean               bool                        boolean
int8..int32,    int                   int32 (uint32 for uint*)    integer
uint8, uint16
int64, uint32   long                  int64 (uint32)              integer
uint64          long (larger values   uint64                      integer
                are error rows)
float16/32/64   float / double        float / double              number or "NaN",
                                                                  "Infinity", "-Infinity"
decimal(p,s)    bytes, decimal(p,s)   string                      string
string          string                string                      string
binary          bytes                 bytes                       string (base64)
date32          int, date             int32 (days)                integer (days)
timestamp ms    long, timestamp-      int64 (in the column's      integer (in the
timestamp us    millis/-micros (local-unit)                       column's unit)
                for no time zone)
timestamp s/ns, long (in the unit)    int64                       integer
date64, time,
duration
list            array                 repeated (no null items:    array
                                      an error row)
map             map (string keys),    map<k, v> (scalar keys)     array of [key, value]
                else array of
                {key, value}
struct          record                message                     object
==============  ====================  ==========================  ====================

Every field of a nullable Arrow field is optional: a union with ``null``
(default ``null``) in Avro, a proto3 ``optional`` field, ``oneOf`` with
``null`` in JSON Schema. A Protobuf list or map has no null: a null list is
written as an empty one, and reads back as an empty one.

The registry is reached through
:class:`~reclock.clients.schema_registry.RegistryHandle` (made by
:meth:`~reclock.clients.schema_registry.RegistryHandle.writer`), whose client
is made lazily in each process that serializes (executors stage, the driver
produces): a :class:`Codec` pickles as its description only.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import math
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

import pyarrow as pa

from reclock.clients.schema_registry import RegistryHandle
from reclock.contracts.encoding import is_binary, is_listlike

#: Formats the sink writes; the last three through a schema registry.
FORMATS = ("json", "avro", "protobuf", "json_schema")
REGISTRY_FORMATS = ("avro", "protobuf", "json_schema")

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_EPOCH = dt.datetime(1970, 1, 1)
_EPOCH_UTC = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class ValueRefused(ValueError):
    """A value the format cannot hold (a row that becomes an error row)."""


# -- which schemas a format can hold -------------------------------------------------------


def _base(t: pa.DataType) -> pa.DataType:
    return _base(t.value_type) if pa.types.is_dictionary(t) else t


def schema_problems(fmt: str, schema: pa.Schema) -> list[str]:
    """Why ``fmt`` cannot hold records of ``schema`` (empty: it can)."""
    out: list[str] = []
    for f in schema:
        _type_problems(fmt, f.name, f.type, out, top=True)
    return out


def _type_problems(fmt: str, name: str, t: pa.DataType, out: list[str], top: bool) -> None:
    t = _base(t)
    if fmt in ("avro", "protobuf") and not _NAME.match(name):
        out.append(f"column {name!r}: {fmt} field names are letters, digits and _, not "
                   "starting with a digit")
    if pa.types.is_null(t) and fmt == "protobuf":
        out.append(f"column {name!r}: type null has no protobuf type")
    if pa.types.is_struct(t):
        for i in range(t.num_fields):
            _type_problems(fmt, t.field(i).name, t.field(i).type, out, top=False)
    elif is_listlike(t):
        v = _base(t.value_type)
        if fmt == "protobuf" and (is_listlike(v) or pa.types.is_map(v)):
            out.append(f"column {name!r}: a protobuf repeated field cannot hold lists or maps")
        _type_problems(fmt, name, v, out, top=False)
    elif pa.types.is_map(t):
        k, v = _base(t.key_type), _base(t.item_type)
        if fmt == "protobuf" and not (pa.types.is_integer(k) or pa.types.is_string(k)
                                      or pa.types.is_large_string(k) or pa.types.is_boolean(k)):
            out.append(f"column {name!r}: protobuf map keys are integers, strings or booleans, "
                       f"not {k}")
        if fmt == "protobuf" and (is_listlike(v) or pa.types.is_map(v)):
            out.append(f"column {name!r}: protobuf map values cannot be lists or maps")
        _type_problems(fmt, name, v, out, top=False)


def _is_string(t: pa.DataType) -> bool:
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t))


# -- Avro ------------------------------------------------------------------------------------


def _temporal_avro(t: pa.DataType) -> Any:
    if pa.types.is_date32(t):
        return {"type": "int", "logicalType": "date"}
    if pa.types.is_timestamp(t) and t.unit in ("ms", "us"):
        local = "" if t.tz is not None else "local-"
        unit = "millis" if t.unit == "ms" else "micros"
        return {"type": "long", "logicalType": f"{local}timestamp-{unit}"}
    if pa.types.is_time32(t):
        return {"type": "int", "logicalType": "time-millis"} if t.unit == "ms" else "int"
    if pa.types.is_time64(t):
        return {"type": "long", "logicalType": "time-micros"} if t.unit == "us" else "long"
    return None


class _AvroNames:
    """Record names: one per distinct struct type (before and after share one)."""

    def __init__(self) -> None:
        self.by_type: dict[pa.DataType, str] = {}
        self.used: set[str] = set()

    def name(self, t: pa.DataType, hint: str) -> tuple[str, bool]:
        """The record name of struct ``t``, and whether it is new."""
        if t in self.by_type:
            return self.by_type[t], False
        # a Debezium envelope's row images are its "Value", as Debezium's own
        hint = {"before": "Value", "after": "Value"}.get(hint, hint)
        base = re.sub(r"[^A-Za-z0-9_]", "_", hint) or "Record"
        base = base[0].upper() + base[1:] if not base[0].isdigit() else "R" + base
        name, i = base, 1
        while name in self.used:
            i += 1
            name = f"{base}{i}"
        self.used.add(name)
        self.by_type[t] = name
        return name, True


def avro_type(t: pa.DataType, hint: str, names: _AvroNames) -> Any:
    """The Avro schema of (non-null) values of ``t``."""
    t = _base(t)
    if pa.types.is_null(t):
        return "null"
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_integer(t):
        return "int" if t.bit_width <= 16 or t in (pa.int32(),) else "long"
    if pa.types.is_floating(t):
        return "double" if t.bit_width == 64 else "float"
    if pa.types.is_decimal(t):
        return {"type": "bytes", "logicalType": "decimal", "precision": t.precision,
                "scale": t.scale}
    if _is_string(t):
        return "string"
    if is_binary(t):
        return "bytes"
    temporal = _temporal_avro(t)
    if temporal is not None:
        return temporal
    if pa.types.is_temporal(t) or pa.types.is_duration(t):
        return "int" if t.bit_width <= 32 else "long"
    if is_listlike(t):
        return {"type": "array", "items": _avro_nullable(t.value_field, hint, names)}
    if pa.types.is_map(t):
        item = _avro_nullable(t.item_field, hint, names)
        if _is_string(_base(t.key_type)):
            return {"type": "map", "values": item}
        entry, new = names.name(pa.struct([t.key_field, t.item_field]), f"{hint}_entry")
        if not new:
            return {"type": "array", "items": entry}
        return {"type": "array", "items": {"type": "record", "name": entry, "fields": [
            {"name": "key", "type": avro_type(t.key_type, hint, names)},
            {"name": "value", "type": item}]}}
    if pa.types.is_struct(t):
        return avro_record(pa.schema(list(t)), hint, names)
    raise ValueError(f"no Avro type for {t}")


def _avro_nullable(f: pa.Field, hint: str, names: _AvroNames) -> Any:
    inner = avro_type(f.type, hint, names)
    if not f.nullable or inner == "null":
        return inner
    return ["null", inner]


def avro_record(schema: pa.Schema, name: str, names: _AvroNames,
                namespace: str | None = None) -> Any:
    rec, new = names.name(pa.struct(list(schema)), name)
    if not new:
        return rec
    fields = []
    for f in schema:
        ft = _avro_nullable(f, f.name, names)
        entry: dict[str, Any] = {"name": f.name, "type": ft}
        if isinstance(ft, list):
            entry["default"] = None
        fields.append(entry)
    out: dict[str, Any] = {"type": "record", "name": rec, "fields": fields}
    if namespace:
        out["namespace"] = namespace
    return out


def _to_avro(v: Any, t: pa.DataType) -> Any:
    """A plain value as the Avro writer takes it."""
    if v is None:
        return None
    t = _base(t)
    if pa.types.is_decimal(t):
        return decimal.Decimal(v)
    if is_binary(t):
        return base64.b64decode(v)
    if pa.types.is_floating(t):
        return _NONFINITE[v] if isinstance(v, str) else float(v)
    if pa.types.is_integer(t) and t.bit_width == 64 and not -(2**63) <= v < 2**63:
        raise ValueRefused(f"{v} does not fit an Avro long")
    if is_listlike(t):
        return [_to_avro(x, t.value_type) for x in v]
    if pa.types.is_map(t):
        if _is_string(_base(t.key_type)):
            return {k: _to_avro(x, t.item_type) for k, x in v}
        return [{"key": _to_avro(k, t.key_type), "value": _to_avro(x, t.item_type)}
                for k, x in v]
    if pa.types.is_struct(t):
        return {t.field(i).name: _to_avro(v.get(t.field(i).name), t.field(i).type)
                for i in range(t.num_fields)}
    return v


def _from_avro(v: Any, t: pa.DataType) -> Any:
    """An Avro reader's value back to the plain value."""
    if v is None:
        return None
    t = _base(t)
    if isinstance(v, dt.datetime):
        delta = v - (_EPOCH_UTC if v.tzinfo is not None else _EPOCH)
        us = delta // dt.timedelta(microseconds=1)
        return us // 1000 if getattr(t, "unit", "us") == "ms" else us
    if isinstance(v, dt.date):
        return (v - dt.date(1970, 1, 1)).days
    if isinstance(v, dt.time):
        us = ((v.hour * 60 + v.minute) * 60 + v.second) * 1_000_000 + v.microsecond
        return us // 1000 if getattr(t, "unit", "us") == "ms" else us
    if isinstance(v, decimal.Decimal):
        return str(v)
    if isinstance(v, bytes):
        return base64.b64encode(v).decode("ascii")
    if isinstance(v, float):
        return v if math.isfinite(v) else ("NaN" if math.isnan(v) else
                                           ("Infinity" if v > 0 else "-Infinity"))
    if is_listlike(t):
        return [_from_avro(x, t.value_type) for x in v]
    if pa.types.is_map(t):
        if isinstance(v, dict):
            return [[k, _from_avro(x, t.item_type)] for k, x in v.items()]
        return [[_from_avro(e["key"], t.key_type), _from_avro(e["value"], t.item_type)]
                for e in v]
    if pa.types.is_struct(t):
        return {t.field(i).name: _from_avro(v.get(t.field(i).name), t.field(i).type)
                for i in range(t.num_fields)}
    return v


# -- JSON Schema -----------------------------------------------------------------------------


def json_schema_type(t: pa.DataType) -> dict[str, Any]:
    """The JSON Schema of (non-null) plain values of ``t``."""
    t = _base(t)
    if pa.types.is_null(t):
        return {"type": "null"}
    if pa.types.is_boolean(t):
        return {"type": "boolean"}
    if pa.types.is_integer(t) or pa.types.is_temporal(t) or pa.types.is_duration(t):
        return {"type": "integer"}
    if pa.types.is_floating(t):
        return {"oneOf": [{"type": "number"},
                          {"type": "string", "enum": ["NaN", "Infinity", "-Infinity"]}]}
    if pa.types.is_decimal(t):
        return {"type": "string", "pattern": r"^-?[0-9]+(\.[0-9]+)?$"}
    if _is_string(t):
        return {"type": "string"}
    if is_binary(t):
        return {"type": "string", "contentEncoding": "base64"}
    if is_listlike(t):
        return {"type": "array", "items": _json_nullable(t.value_field)}
    if pa.types.is_map(t):
        return {"type": "array", "items": {
            "type": "array", "minItems": 2, "maxItems": 2,
            "prefixItems": [json_schema_type(t.key_type), _json_nullable(t.item_field)],
            "items": [json_schema_type(t.key_type), _json_nullable(t.item_field)]}}
    if pa.types.is_struct(t):
        return json_object(pa.schema(list(t)))
    raise ValueError(f"no JSON Schema type for {t}")


def _json_nullable(f: pa.Field) -> dict[str, Any]:
    inner = json_schema_type(f.type)
    if not f.nullable or inner == {"type": "null"}:
        return inner
    return {"oneOf": [{"type": "null"}, inner]}


def json_object(schema: pa.Schema, title: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object",
                           "properties": {f.name: _json_nullable(f) for f in schema},
                           "additionalProperties": False}
    required = [f.name for f in schema if not f.nullable]
    if required:
        out["required"] = required
    if title is not None:
        out = {"$schema": "http://json-schema.org/draft-07/schema#", "title": title, **out}
    return out


# -- Protobuf --------------------------------------------------------------------------------


# FieldDescriptorProto's type and label numbers (descriptor.proto)
_PB_DOUBLE, _PB_FLOAT, _PB_INT64, _PB_UINT64, _PB_INT32 = 1, 2, 3, 4, 5
_PB_BOOL, _PB_STRING, _PB_MESSAGE, _PB_BYTES, _PB_UINT32 = 8, 9, 11, 12, 13
_PB_OPTIONAL, _PB_REPEATED = 1, 3


def _pb_scalar(t: pa.DataType) -> int:
    t = _base(t)
    if pa.types.is_boolean(t):
        return _PB_BOOL
    if pa.types.is_integer(t):
        if pa.types.is_unsigned_integer(t):
            return _PB_UINT64 if t.bit_width == 64 else _PB_UINT32
        return _PB_INT64 if t.bit_width == 64 else _PB_INT32
    if pa.types.is_floating(t):
        return _PB_DOUBLE if t.bit_width == 64 else _PB_FLOAT
    if pa.types.is_decimal(t) or _is_string(t):
        return _PB_STRING
    if is_binary(t):
        return _PB_BYTES
    if pa.types.is_temporal(t) or pa.types.is_duration(t):
        return _PB_INT32 if t.bit_width <= 32 else _PB_INT64
    raise ValueError(f"no protobuf scalar type for {t}")


class _ProtoBuilder:
    """Messages of one .proto file, one per distinct struct type."""

    def __init__(self, package: str) -> None:
        from google.protobuf import descriptor_pb2

        self.package = package
        self.file = descriptor_pb2.FileDescriptorProto(syntax="proto3", package=package)
        self.by_type: dict[pa.DataType, str] = {}
        self.names = _AvroNames()

    def message(self, schema: pa.Schema, hint: str) -> str:
        """The full name of the message of ``schema`` (made on first use)."""
        st = pa.struct(list(schema))
        if st in self.by_type:
            return self.by_type[st]
        name, _ = self.names.name(st, hint)
        full = f".{self.package}.{name}"
        self.by_type[st] = full
        msg = self.file.message_type.add(name=name)
        for number, f in enumerate(schema, start=1):
            self._field(msg, f, number)
        return full

    def _field(self, msg: Any, f: pa.Field, number: int) -> None:
        t = _base(f.type)
        fd = msg.field.add(name=f.name, number=number, json_name=f.name)
        if pa.types.is_struct(t):
            fd.type, fd.type_name = _PB_MESSAGE, self.message(pa.schema(list(t)), f.name)
            fd.label = _PB_OPTIONAL
        elif is_listlike(t):
            fd.label = _PB_REPEATED
            v = _base(t.value_type)
            if pa.types.is_struct(v):
                fd.type, fd.type_name = _PB_MESSAGE, self.message(pa.schema(list(v)), f.name)
            else:
                fd.type = _pb_scalar(v)
        elif pa.types.is_map(t):
            entry_name = "".join(p.capitalize() for p in f.name.split("_")) + "Entry"
            entry = msg.nested_type.add(name=entry_name)
            entry.options.map_entry = True
            self._plain(entry, "key", t.key_type, 1)
            v = _base(t.item_type)
            vf = entry.field.add(name="value", number=2, json_name="value",
                                 label=_PB_OPTIONAL)
            if pa.types.is_struct(v):
                vf.type, vf.type_name = _PB_MESSAGE, self.message(pa.schema(list(v)), f.name)
            else:
                vf.type = _pb_scalar(v)
            fd.label, fd.type = _PB_REPEATED, _PB_MESSAGE
            fd.type_name = f"{self.by_type_name(msg)}.{entry_name}"
        else:
            fd.type, fd.label = _pb_scalar(t), _PB_OPTIONAL
            if f.nullable:
                # proto3 ``optional``: a synthetic oneof gives the field presence
                fd.proto3_optional = True
                fd.oneof_index = len(msg.oneof_decl)
                msg.oneof_decl.add(name=f"_{f.name}")

    def _plain(self, msg: Any, name: str, t: pa.DataType, number: int) -> None:
        msg.field.add(name=name, number=number, json_name=name, label=_PB_OPTIONAL,
                      type=_pb_scalar(t))

    def by_type_name(self, msg: Any) -> str:
        return f".{self.package}.{msg.name}"

    def message_class(self, full: str, file_name: str) -> Any:
        from google.protobuf import descriptor_pool, message_factory

        self.file.name = file_name
        # oneof indexes must follow the real fields: proto3 optional oneofs
        # were added as the fields came, which is the order protoc uses too
        pool = descriptor_pool.DescriptorPool()
        pool.Add(self.file)
        return message_factory.GetMessageClass(pool.FindMessageTypeByName(full[1:]))


def _to_pb(msg: Any, doc: Mapping[str, Any], schema: pa.Schema) -> None:
    for f in schema:
        v = doc.get(f.name)
        if v is None:
            continue
        t = _base(f.type)
        if pa.types.is_struct(t):
            _to_pb(getattr(msg, f.name), v, pa.schema(list(t)))
        elif is_listlike(t):
            target = getattr(msg, f.name)
            vt = _base(t.value_type)
            for x in v:
                if x is None:
                    raise ValueRefused(f"column {f.name!r}: a protobuf list cannot hold a null "
                                       "item")
                if pa.types.is_struct(vt):
                    _to_pb(target.add(), x, pa.schema(list(vt)))
                else:
                    target.append(_pb_value(x, vt))
        elif pa.types.is_map(t):
            target = getattr(msg, f.name)
            vt = _base(t.item_type)
            for k, x in v:
                if x is None:
                    raise ValueRefused(f"column {f.name!r}: a protobuf map cannot hold a null "
                                       "value")
                if pa.types.is_struct(vt):
                    _to_pb(target[k], x, pa.schema(list(vt)))
                else:
                    target[k] = _pb_value(x, vt)
        else:
            setattr(msg, f.name, _pb_value(v, t))


def _pb_value(v: Any, t: pa.DataType) -> Any:
    t = _base(t)
    if is_binary(t):
        return base64.b64decode(v)
    if pa.types.is_floating(t):
        return _NONFINITE[v] if isinstance(v, str) else float(v)
    return v


def _from_pb(msg: Any, schema: pa.Schema) -> dict[str, Any]:
    out: dict[str, Any] = {}
    present = msg.DESCRIPTOR.fields_by_name
    for f in schema:
        t = _base(f.type)
        if f.name not in present:  # a column the writer's schema did not have
            out[f.name] = None
            continue
        if pa.types.is_struct(t):
            st = pa.schema(list(t))
            out[f.name] = _from_pb(getattr(msg, f.name), st) if msg.HasField(f.name) else None
        elif is_listlike(t):
            vt = _base(t.value_type)
            out[f.name] = [_from_pb(x, pa.schema(list(vt))) if pa.types.is_struct(vt)
                           else _plain_pb(x, vt) for x in getattr(msg, f.name)]
        elif pa.types.is_map(t):
            vt = _base(t.item_type)
            m = getattr(msg, f.name)
            out[f.name] = [[k, _from_pb(m[k], pa.schema(list(vt))) if pa.types.is_struct(vt)
                            else _plain_pb(m[k], vt)] for k in sorted(m)]
        elif f.nullable and not msg.HasField(f.name):
            out[f.name] = None
        else:
            out[f.name] = _plain_pb(getattr(msg, f.name), t)
    return out


def _plain_pb(v: Any, t: pa.DataType) -> Any:
    if isinstance(v, bytes):
        return base64.b64encode(v).decode("ascii")
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    return v


# -- the codec -------------------------------------------------------------------------------


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


class Codec:
    """Records of one Arrow ``schema`` (plain documents) in format ``fmt``,
    under ``subject`` of ``registry`` for the registry formats; ``name`` is
    the record's name (Avro record, Protobuf message, JSON Schema title),
    ``namespace`` the Avro namespace and Protobuf package. Picklable: the
    registry client and the serializers are made on first use in each
    process."""

    def __init__(self, fmt: str, schema: pa.Schema, *, registry: RegistryHandle | None = None,
                 subject: str | None = None, name: str = "Value",
                 namespace: str = "reclock", is_key: bool = False) -> None:
        if fmt in REGISTRY_FORMATS and (registry is None or subject is None):
            raise ValueError(f"format {fmt} needs a registry and a subject")
        self.fmt, self.schema, self.registry, self.subject = fmt, schema, registry, subject
        self.name, self.namespace, self.is_key = name, namespace, is_key
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    # -- schema -----------------------------------------------------------------------------
    def avro_schema(self) -> dict[str, Any]:
        return dict(avro_record(self.schema, self.name, _AvroNames(), self.namespace))

    def json_schema(self) -> dict[str, Any]:
        return json_object(self.schema, self.name)

    def _message_class(self) -> Any:
        cls = getattr(self._local, "cls", None)
        if cls is None:
            b = _ProtoBuilder(self.namespace)
            full = b.message(self.schema, self.name)
            slug = re.sub(r"[^A-Za-z0-9_.-]", "_", self.subject or self.name)
            cls = self._local.cls = b.message_class(full, f"{slug}.proto")
        return cls

    def schema_text(self) -> str:
        """The schema as the registry holds it (for Protobuf, the serialized
        file descriptor in base64, as confluent-kafka registers it)."""
        if self.fmt == "avro":
            return json.dumps(self.avro_schema())
        if self.fmt == "json_schema":
            return json.dumps(self.json_schema())
        if self.fmt == "protobuf":
            return base64.b64encode(
                self._message_class().DESCRIPTOR.file.serialized_pb).decode("ascii")
        raise ValueError(f"format {self.fmt} has no registry schema")

    # -- serializers ------------------------------------------------------------------------
    def _ctx(self, topic: str) -> Any:
        from confluent_kafka.serialization import MessageField, SerializationContext

        return SerializationContext(topic, MessageField.KEY if self.is_key else MessageField.VALUE)

    def _serializer(self) -> Callable[[Any, Any], bytes]:
        ser = getattr(self._local, "ser", None)
        if ser is not None:
            return ser  # type: ignore[no-any-return]
        assert self.registry is not None and self.subject is not None
        if self.fmt == "avro":
            schema: Any = json.dumps(self.avro_schema())
        elif self.fmt == "json_schema":
            schema = json.dumps(self.json_schema())
        else:
            schema = self._message_class()
        ser = self._local.ser = self.registry.serializer(self.fmt, schema, self.subject)
        return ser

    def _deserializer(self) -> Callable[[Any, Any], Any]:
        de = getattr(self._local, "de", None)
        if de is not None:
            return de  # type: ignore[no-any-return]
        assert self.registry is not None
        if self.fmt == "protobuf":
            de = self._protobuf_reader(self.registry)
        else:
            de = self.registry.deserializer(self.fmt)
        self._local.de = de
        return de

    def _protobuf_reader(self, registry: RegistryHandle) -> Callable[[Any, Any], Any]:
        """Protobuf records are parsed with the message class of the schema
        that wrote them (from the registry, by the record's schema id), so a
        record written before the columns changed reads by field name."""
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

        client = registry.shared_client()
        readers: dict[int, Any] = {}

        def read(data: bytes, ctx: Any) -> Any:
            if len(data) < 5 or data[0] != 0:
                raise ValueError("not in Confluent's wire format")
            sid = int.from_bytes(data[1:5], "big")
            if sid not in readers:
                text = client.get_schema(sid, fmt="serialized").schema_str
                if text is None:
                    raise ValueError(f"schema id {sid}: the registry answered no schema text")
                fd = descriptor_pb2.FileDescriptorProto.FromString(base64.b64decode(text))
                pool = descriptor_pool.DescriptorPool()
                pool.Add(fd)
                cls = message_factory.GetMessageClass(
                    pool.FindMessageTypeByName(f"{fd.package}.{fd.message_type[0].name}"))
                readers[sid] = registry.deserializer("protobuf", cls)
            return readers[sid](data, ctx)

        return read

    def register(self, topic: str) -> int:
        """Register the schema under the subject (the driver does this before
        any record is staged, so an incompatible schema is refused at once);
        its id. Registry errors are raised as the client raises them."""
        assert self.registry is not None and self.subject is not None
        if self.fmt == "protobuf":
            # the serializer registers it: the same call the producer makes
            self._serializer()(self._message_class()(), self._ctx(topic))
            return self.registry.lookup(self.subject, self.schema_text(), self.fmt)
        return self.registry.register(self.subject, self.schema_text(), self.fmt)

    def encode(self, doc: Mapping[str, Any], topic: str) -> bytes:
        """The record of plain document ``doc``; :class:`ValueRefused` (or
        the serializer's own ValueError, TypeError, SerializationError) for
        a value the format cannot hold."""
        if self.fmt == "json":
            return _dumps(doc)
        if self.fmt == "avro":
            obj: Any = _to_avro(dict(doc), pa.struct(list(self.schema)))
        elif self.fmt == "json_schema":
            obj = dict(doc)
        else:
            obj = self._message_class()()
            _to_pb(obj, doc, self.schema)
        out = self._serializer()(obj, self._ctx(topic))
        assert out is not None
        return out

    def decode(self, data: bytes, topic: str) -> dict[str, Any]:
        """The plain document of a record this codec (or an earlier version of
        its schema) wrote."""
        if self.fmt == "json":
            doc = json.loads(data)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            return doc
        obj = self._deserializer()(data, self._ctx(topic))
        if self.fmt == "avro":
            return dict(_from_avro(obj, pa.struct(list(self.schema))))
        if self.fmt == "json_schema":
            return dict(obj)
        return _from_pb(obj, self.schema)
