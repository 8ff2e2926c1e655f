"""Registry-encoded topics on a real Kafka broker, read through the schema
registry with real Spark: Avro, Protobuf and JSON Schema, in keys and
values, a value schema with a reference to another subject.

The records are written by confluent-kafka's own serializers
(``AvroSerializer``, ``ProtobufSerializer``, ``JSONSerializer``) against
the test registry (tests/registry.py): an independent peer of reclock's
decoders. Each output must hold exactly what was produced (the model: the
records the test built), with the column types the format promises; each
bad record (wrong magic byte, unknown schema id, corrupt bytes, a JSON value
its schema refuses) is one error row at its offset, and the rest lands. As
the subject evolves, a new optional field widens the output; an
incompatible version stalls it with a definite error naming the subject and
the way out.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from confluent_kafka.schema_registry import Schema, SchemaReference, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2

from reclock.config import load_config
from tests.registry import RegistryServer, registry_server
from tests.running import (
    all_durable,
    read_updates,
    running,
    running_again,
    stalled_with,
)
from tests.sources.test_kafka_source import produce

UTC = dt.UTC
FORMATS = ["avro", "protobuf", "json_schema"]


@pytest.fixture(scope="module")
def registry() -> Iterator[RegistryServer]:
    with registry_server() as reg:
        yield reg


# -- the pipeline ----------------------------------------------------------------------------


def _setup(tmp_path: Path, kafka: Any, registry: RegistryServer, kind: str,
           keyed: bool = True, policy: str | None = None) -> tuple[Any, str]:
    topic = f"{kind.replace('_', '-')}-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 1)
    key = (f"\n        key_format: {{type: {kind}, registry_url: \"{registry.url}\", "
           f"subject: {topic}-key}}") if keyed else ""
    extra = f"\n        schema_change: {policy}" if policy else ""
    path = tmp_path / "pipeline.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
sources:
  - name: orders
    kafka: {{bootstrap_servers: "{kafka.bootstrap}", topic: {topic}, timeout: 3s}}
    outputs:
      - name: orders
        format: {{type: {kind}, registry_url: "{registry.url}", subject: {topic}-value}}{key}
        sink: delta{extra}
""")
    return load_config(path), topic


def _output(cfg: Any) -> tuple[pa.Table, list[dict[str, Any]], list[dict[str, Any]]]:
    """(every row, data rows by _src_offset, error rows) of the output."""
    t = read_updates(cfg, "orders", "orders")
    good = t.filter(pc.is_null(t.column("_error"))).to_pylist()
    bad = t.filter(pc.invert(pc.is_null(t.column("_error")))).to_pylist()
    return t, sorted(good, key=lambda r: r["_src_offset"]), bad


# -- the producers: confluent-kafka's serializers ------------------------------------------


def _ctx(topic: str, part: MessageField) -> SerializationContext:
    return SerializationContext(topic, part)


_F = descriptor_pb2.FieldDescriptorProto
_PROTO_TYPES = {"int64": _F.TYPE_INT64, "int32": _F.TYPE_INT32, "string": _F.TYPE_STRING,
                "double": _F.TYPE_DOUBLE, "float": _F.TYPE_FLOAT, "bool": _F.TYPE_BOOL,
                "bytes": _F.TYPE_BYTES, "uint32": _F.TYPE_UINT32}


def _proto_classes(tag: str, value_fields: list[tuple[str, str]],
                   with_address: bool = True) -> tuple[type[Any], type[Any]]:
    """(Key, Order) message classes of fresh .proto files (no protoc here:
    the files are built as descriptors): ``tag`` names their package;
    ``value_fields`` (name, type) are Order's fields after ``id``, a type
    being a scalar name or ``address``, ``timestamp``, ``state`` (an enum),
    ``tags`` (repeated string), ``qty`` (map<string, int32>)."""
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
    pkg = f"shop{tag}"
    deps = ["google/protobuf/timestamp.proto"]
    if with_address:
        addr = descriptor_pb2.FileDescriptorProto(name=f"{pkg}/address.proto", package=pkg,
                                                  syntax="proto3")
        a = addr.message_type.add(name="Address")
        a.field.add(name="city", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
        a.field.add(name="zip", number=2, type=_F.TYPE_INT32, label=_F.LABEL_OPTIONAL)
        pool.Add(addr)
        deps.insert(0, addr.name)
    f = descriptor_pb2.FileDescriptorProto(name=f"{pkg}/order.proto", package=pkg,
                                           syntax="proto3", dependency=deps)
    e = f.enum_type.add(name="State")
    e.value.add(name="NEW", number=0)
    e.value.add(name="PAID", number=1)
    m = f.message_type.add(name="Order")
    m.field.add(name="id", number=1, type=_F.TYPE_INT64, label=_F.LABEL_OPTIONAL)
    for n, (name, kind) in enumerate(value_fields, start=2):
        fd = m.field.add(name=name, number=n, label=_F.LABEL_OPTIONAL)
        if kind == "address":
            fd.type, fd.type_name = _F.TYPE_MESSAGE, f".{pkg}.Address"
        elif kind == "timestamp":
            fd.type, fd.type_name = _F.TYPE_MESSAGE, ".google.protobuf.Timestamp"
        elif kind == "state":
            fd.type, fd.type_name = _F.TYPE_ENUM, f".{pkg}.State"
        elif kind == "tags":
            fd.type, fd.label = _F.TYPE_STRING, _F.LABEL_REPEATED
        elif kind == "qty":
            entry = m.nested_type.add(name="QtyEntry")
            entry.options.map_entry = True
            entry.field.add(name="key", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
            entry.field.add(name="value", number=2, type=_F.TYPE_INT32, label=_F.LABEL_OPTIONAL)
            fd.type, fd.type_name, fd.label = (_F.TYPE_MESSAGE, f".{pkg}.Order.QtyEntry",
                                               _F.LABEL_REPEATED)
        elif kind.startswith("optional "):
            fd.type, fd.proto3_optional = _PROTO_TYPES[kind.split()[1]], True
            fd.oneof_index = len(m.oneof_decl)
            m.oneof_decl.add(name=f"_{name}")
        else:
            fd.type = _PROTO_TYPES[kind]
    pool.Add(f)
    key = descriptor_pb2.FileDescriptorProto(name=f"{pkg}/key.proto", package=pkg,
                                             syntax="proto3")
    k = key.message_type.add(name="Key")
    k.field.add(name="order_id", number=1, type=_F.TYPE_INT64, label=_F.LABEL_OPTIONAL)
    pool.Add(key)
    return (message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{pkg}.Key")),
            message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{pkg}.Order")))


def _proto_serializers(client: SchemaRegistryClient, tag: str, fields: list[tuple[str, str]]
                       ) -> tuple[Callable[[dict[str, Any]], Any], Callable[[dict[str, Any]], Any],
                                  Any, Any]:
    key_cls, order_cls = _proto_classes(tag, fields)
    conf = {"use.deprecated.format": False}

    def build_value(r: dict[str, Any]) -> Any:
        o = order_cls(id=r["id"])
        for name, value in r.items():
            if name == "id" or value is None:
                continue
            if name == "ship_to":
                o.ship_to.city, o.ship_to.zip = value["city"], value["zip"]
            elif name == "at":
                o.at.FromDatetime(value)
            elif name == "tags":
                o.tags.extend(value)
            elif name == "qty":
                o.qty.update(value)
            else:
                setattr(o, name, value)
        return o

    return (lambda r: key_cls(order_id=r["order_id"]), build_value,
            ProtobufSerializer(key_cls, client, conf), ProtobufSerializer(order_cls, client, conf))


def _produce(kafka: Any, topic: str, pairs: list[tuple[bytes | None, bytes | None]]) -> None:
    produce(kafka.bootstrap, topic, [(0, k, v) for k, v in pairs])


# -- the three formats, landed ---------------------------------------------------------------

AT = [dt.datetime(2024, 5, 1, 12, 0, i, 250000, tzinfo=UTC) for i in range(4)]
#: what the producers write: the key, then the value (None: left unset)
ROWS = [
    ({"order_id": 10 + i}, {
        "id": 10 + i, "ship_to": {"city": f"c{i}", "zip": 1000 + i}, "at": AT[i],
        "tags": [f"t{j}" for j in range(i)], "price": 1.5 * i, "note": None if i % 2 else f"n{i}",
    }) for i in range(4)
]


def _avro(client: SchemaRegistryClient, topic: str) -> tuple[Any, Any]:
    address = {"type": "record", "name": "Address", "namespace": "shop", "fields": [
        {"name": "city", "type": "string"}, {"name": "zip", "type": "int"}]}
    client.register_schema(f"{topic}-address", Schema(json.dumps(address), "AVRO"))
    value = {"type": "record", "name": "Order", "namespace": "shop", "fields": [
        {"name": "id", "type": "long"}, {"name": "ship_to", "type": "shop.Address"},
        {"name": "at", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "tags", "type": {"type": "array", "items": "string"}},
        {"name": "price", "type": "double"},
        {"name": "note", "type": ["null", "string"], "default": None}]}
    key = {"type": "record", "name": "Key", "namespace": "shop",
           "fields": [{"name": "order_id", "type": "long"}]}
    ref = [SchemaReference("shop.Address", f"{topic}-address", 1)]
    return (AvroSerializer(client, json.dumps(key)),
            AvroSerializer(client, Schema(json.dumps(value), "AVRO", ref)))


def _json(client: SchemaRegistryClient, topic: str) -> tuple[Any, Any]:
    address = {"type": "object", "properties": {"city": {"type": "string"},
                                                "zip": {"type": "integer"}},
               "required": ["city"]}
    client.register_schema(f"{topic}-address", Schema(json.dumps(address), "JSON"))
    value = {"type": "object", "properties": {
        "id": {"type": "integer"}, "ship_to": {"$ref": "address.json"},
        "at": {"type": "string", "format": "date-time"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "price": {"type": "number"}, "note": {"type": ["string", "null"]}},
        "required": ["id", "price"]}
    key = {"type": "object", "properties": {"order_id": {"type": "integer"}},
           "required": ["order_id"]}
    ref = [SchemaReference("address.json", f"{topic}-address", 1)]
    return (JSONSerializer(json.dumps(key), client),
            JSONSerializer(Schema(json.dumps(value), "JSON", ref), client))


def _as_json(r: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.isoformat() if isinstance(v, dt.datetime) else v) for k, v in r.items()}


PROTO_FIELDS = [("ship_to", "address"), ("at", "timestamp"), ("tags", "tags"),
                ("price", "double"), ("note", "optional string"), ("state", "state"),
                ("qty", "qty"), ("n", "uint32"), ("ratio", "float"), ("ok", "bool"),
                ("raw", "bytes")]


def _proto_extra(i: int) -> dict[str, Any]:
    return {"state": i % 2, "qty": {f"k{i}": i}, "n": 4_000_000_000 + i, "ratio": 0.5 * i,
            "ok": bool(i % 2), "raw": bytes([i, 255])}


@pytest.mark.parametrize("kind", FORMATS)
def test_a_registry_encoded_topic_lands_with_its_types(
        tmp_path: Path, spark: Any, kafka: Any, registry: RegistryServer, kind: str) -> None:
    cfg, topic = _setup(tmp_path, kafka, registry, kind)
    client = SchemaRegistryClient({"url": registry.url})
    kctx, vctx = _ctx(topic, MessageField.KEY), _ctx(topic, MessageField.VALUE)
    rows = [(k, dict(v)) for k, v in ROWS]
    if kind == "avro":
        ks, vs = _avro(client, topic)
        pairs = [(ks(k, kctx), vs(v, vctx)) for k, v in rows]
    elif kind == "json_schema":
        ks, vs = _json(client, topic)
        pairs = [(ks(k, kctx), vs(_as_json(v), vctx)) for k, v in rows]
    else:
        for i, (_, v) in enumerate(rows):
            v.update(_proto_extra(i))
        mk, mv, ks, vs = _proto_serializers(client, uuid.uuid4().hex[:6], PROTO_FIELDS)
        pairs = [(ks(mk(k), kctx), vs(mv(v), vctx)) for k, v in rows]
    good_key, good_value = pairs[0]
    sid = int.from_bytes(good_value[1:5], "big")
    bad = [
        (good_key, b"\x01" + good_value[1:]),                              # wrong magic byte
        (good_key, b"\x00" + (999).to_bytes(4, "big") + good_value[5:]),  # unknown schema id
        (good_key, good_value[:5] + b"\xff\xff\xff\xff"),                  # corrupt body
        (b"\x00\x00", good_value),                                         # a bad key
    ]
    if kind == "json_schema":  # a value its schema's types refuse
        bad.append((good_key, good_value[:5] + json.dumps(
            {"id": "eleven", "price": 1.0}).encode()))
    _produce(kafka, topic, pairs[:2] + bad + pairs[2:])
    n = len(pairs) + len(bad)
    with running(cfg, spark) as runners:
        all_durable(runners, n)
    table, good, errors = _output(cfg)
    # every good record once, each column holding what the producer wrote
    cols = ["order_id", *rows[0][1]]
    model = [{"order_id": k["order_id"], **v} for k, v in rows]
    for m in model:
        if kind == "protobuf":  # an enum lands as its value's name
            m["state"] = ["NEW", "PAID"][m["state"]]
    got = [{c: r[c] for c in cols} for r in good]
    for r in got:
        if kind == "protobuf":
            r["qty"] = dict(r["qty"])
    assert [r["_src_offset"] for r in good] == [0, 1, *range(2 + len(bad), n)]
    assert got == model
    # each bad record one error row, at its offset, with its reason
    reasons = {r["_src_offset"]: r["_error"] for r in errors}
    assert sorted(reasons) == list(range(2, 2 + len(bad)))
    assert reasons[2].startswith(f"value: {kind}: ")
    assert "not in the Confluent wire format (starts with 0x01" in reasons[2]
    assert "/schemas/ids/999: not found" in reasons[3]
    assert reasons[4].startswith(f"value: {kind}: ") and "Confluent" not in reasons[4]
    assert reasons[5].startswith(f"key: {kind}: ValueError: ")
    assert "Confluent wire format" in reasons[5]
    if kind == "json_schema":
        assert "violates its schema at id" in reasons[6] and "'eleven'" in reasons[6]
    # the columns' types, as stored and read back
    types = {f.name: f.type for f in table.schema}
    assert types["order_id"] == pa.int64() and types["id"] == pa.int64()
    assert pa.types.is_timestamp(types["at"]) and types["at"].tz in ("UTC", "+00:00")
    assert types["tags"] in (pa.list_(pa.string()), pa.large_list(pa.string()))
    assert pa.types.is_struct(types["ship_to"])
    assert {f.name: f.type for f in types["ship_to"]} == {
        "city": pa.string(), "zip": pa.int64() if kind == "json_schema" else pa.int32()}
    assert types["price"] == pa.float64() and types["note"] == pa.string()
    if kind == "protobuf":
        assert types["state"] == pa.string() and pa.types.is_map(types["qty"])
        assert types["ratio"] == pa.float32() and types["ok"] == pa.bool_()
        assert types["raw"] == pa.binary()
    assert sid in registry.schemas


# -- evolution ---------------------------------------------------------------------------------


def _evolving_producer(client: SchemaRegistryClient, kind: str, topic: str, version: str
                       ) -> Callable[[dict[str, Any]], bytes]:
    """A value serializer of ``version``: v1 (id, name, score), v2 (adds an
    optional email), bad (score becomes a string)."""
    vctx = _ctx(topic, MessageField.VALUE)
    if kind == "json_schema":
        props: dict[str, Any] = {"id": {"type": "integer"}, "name": {"type": "string"},
                                 "score": {"type": "integer"}}
        if version == "v2":
            props["email"] = {"type": ["string", "null"]}
        if version == "bad":
            props["score"] = {"type": "string"}
        ser = JSONSerializer(json.dumps({"type": "object", "properties": props,
                                         "required": ["id"]}), client)
        return lambda r: ser(r, vctx)  # type: ignore[no-any-return]
    fields = [("name", "string"), ("score", "int64" if version != "bad" else "string")]
    if version == "v2":
        fields.append(("email", "optional string"))
    _, order_cls = _proto_classes(f"evo{uuid.uuid4().hex[:6]}", fields, with_address=False)
    pser = ProtobufSerializer(order_cls, client, {"use.deprecated.format": False})
    return lambda r: pser(order_cls(**{k: v for k, v in r.items() if v is not None}),  # type: ignore[no-any-return]
                          vctx)


@pytest.mark.parametrize("kind", ["protobuf", "json_schema"])
def test_a_new_optional_field_evolves_the_output(
        tmp_path: Path, spark: Any, kafka: Any, registry: RegistryServer, kind: str) -> None:
    cfg, topic = _setup(tmp_path, kafka, registry, kind, keyed=False)
    client = SchemaRegistryClient({"url": registry.url})
    v1 = [{"id": i, "name": f"n{i}", "score": i} for i in range(3)]
    v2 = [{"id": i, "name": f"n{i}", "score": i, "email": f"{i}@x" if i % 2 else None}
          for i in range(3, 6)]
    ser1 = _evolving_producer(client, kind, topic, "v1")
    _produce(kafka, topic, [(None, ser1(r)) for r in v1])
    with running(cfg, spark) as runners:
        all_durable(runners, 3)
        ser2 = _evolving_producer(client, kind, topic, "v2")
        _produce(kafka, topic, [(None, ser2(r)) for r in v2])
        all_durable(runners, 6)
        running_again(runners)
    # stopped and started again (the union rebuilt from what was recorded),
    # an old producer's v1 record and a v2 one land too
    later = [{"id": 6, "name": "old", "score": 6}, {"id": 7, "name": "new", "score": 7,
                                                     "email": "7@x"}]
    _produce(kafka, topic, [(None, ser1(later[0])), (None, ser2(later[1]))])
    with running(cfg, spark) as runners:
        all_durable(runners, 8)
    table, good, bad = _output(cfg)
    assert bad == []
    cols = ["id", "name", "score", "email"]
    assert [{c: r[c] for c in cols} for r in good] == [
        {c: r.get(c) for c in cols} for r in v1 + v2 + later]
    assert table.schema.field("email").type == pa.string()


@pytest.mark.parametrize("kind", ["protobuf", "json_schema"])
def test_an_incompatible_version_is_a_definite_error(
        tmp_path: Path, spark: Any, kafka: Any, registry: RegistryServer, kind: str) -> None:
    cfg, topic = _setup(tmp_path, kafka, registry, kind, keyed=False)
    client = SchemaRegistryClient({"url": registry.url})
    ser1 = _evolving_producer(client, kind, topic, "v1")
    _produce(kafka, topic, [(None, ser1({"id": 1, "name": "a", "score": 1}))])
    with running(cfg, spark) as runners:
        all_durable(runners, 1)
        bad = _evolving_producer(client, kind, topic, "bad")
        _produce(kafka, topic, [(None, bad({"id": 2, "name": "b", "score": "x"}))])
        h = stalled_with(runners, f"'{topic}-value'", "'score'", "no type holds both",
                         "resnapshot")
        assert h.definite
    _, good, errors = _output(cfg)
    assert [r["id"] for r in good] == [1] and errors == []  # what was accepted stays


# -- the decoders alone (no Spark): policies, faults, pickling ---------------------------------


def _rows(res: Any) -> dict[int, dict[str, Any]]:
    return dict(zip(res.ok.tolist(), res.table.to_pylist(), strict=True))


def _errors(res: Any) -> dict[int, str]:
    return dict(zip(res.errors.tolist(), res.reasons, strict=True))


def _spec(kind: str, url: str, subject: str) -> dict[str, Any]:
    return {"type": kind, "registry_url": url, "subject": subject}


@pytest.mark.parametrize("kind", ["protobuf", "json_schema"])
def test_a_writer_the_union_lacks_follows_the_policy(registry: RegistryServer, kind: str
                                                     ) -> None:
    from reclock.core.errors import DefiniteError, SchemaChanged
    from reclock.registry import make_decoder

    topic = f"unit-{uuid.uuid4().hex[:8]}"
    client = SchemaRegistryClient({"url": registry.url})
    ser1 = _evolving_producer(client, kind, topic, "v1")
    one = ser1({"id": 1, "name": "a", "score": 1})
    spec = _spec(kind, registry.url, f"{topic}-value")
    frozen = make_decoder(spec, policy="freeze", part="key")
    failing = make_decoder(spec, policy="fail")
    evolving = make_decoder(spec, part="key")
    assert frozen.schema.names == ["id", "name", "score"]
    two = _evolving_producer(client, kind, topic, "v2")({"id": 2, "name": "b", "score": 2,
                                                         "email": "b@x"})
    sid = int.from_bytes(two[1:5], "big")
    data = pa.array([one, two], pa.binary())
    res = frozen.decode(data)
    assert _rows(res) == {0: {"id": 1, "name": "a", "score": 1},
                          1: {"id": 2, "name": "b", "score": 2}}
    assert res.dropped == {"email": 1}
    with pytest.raises(DefiniteError, match=r"schema id \d+ change the output's shape "
                                            r"\(fields \['email'\] added\).*is fail"):
        failing.decode(data)
    with pytest.raises(SchemaChanged) as changed:
        evolving.decode(data)
    assert changed.value.schema_id == sid and changed.value.part == "key"
    # the driver's next open takes it in; the fact rebuilds it without the registry's list
    wider = make_decoder(spec, seen=[sid])
    assert wider.schema.names == ["id", "name", "score", "email"]
    fact = wider.fact()  # type: ignore[attr-defined]
    again = make_decoder(spec, known=fact)
    assert again.schema == wider.schema
    assert _rows(again.decode(data))[1]["email"] == "b@x"


def test_pickled_decoders_keep_their_schemas_and_make_their_own_client(
        registry: RegistryServer) -> None:
    import pickle

    from reclock.registry import make_decoder

    topic = f"unit-{uuid.uuid4().hex[:8]}"
    client = SchemaRegistryClient({"url": registry.url})
    _, mv, _, vs = _proto_serializers(client, uuid.uuid4().hex[:6], PROTO_FIELDS)
    row = {**ROWS[0][1], **_proto_extra(1)}
    record = vs(mv(row), _ctx(topic, MessageField.VALUE))
    dec = make_decoder(_spec("protobuf", registry.url, f"{topic}-value"))
    assert _rows(dec.decode(pa.array([record], pa.binary())))[0]["state"] == "PAID"
    before = len(registry.requests)
    clone = pickle.loads(pickle.dumps(dec))  # descriptor pools and classes are not pickled
    got = _rows(clone.decode(pa.array([record], pa.binary())))[0]
    assert got["ship_to"] == {"city": "c0", "zip": 1000} and dict(got["qty"]) == {"k1": 1}
    # the schema and its reference travelled with it: nothing asked again
    assert registry.requests[before:] == []


@pytest.mark.parametrize("kind", ["avro", "protobuf", "json_schema"])
def test_registry_faults_are_transient_unless_definite(kind: str) -> None:
    from reclock.clients.schema_registry import RegistryRefused
    from reclock.contracts.decode import FormatError
    from reclock.core.errors import TransientError
    from reclock.registry import make_decoder

    subject = "t-value"
    with registry_server(auth=("ann", "s3cr:et")) as reg:
        url = reg.url.replace("http://", "http://ann:s3cr%3Aet@")
        client = SchemaRegistryClient({"url": url})
        value = {"type": "object", "properties": {"id": {"type": "integer"}}}
        if kind == "protobuf":
            _, order_cls = _proto_classes(uuid.uuid4().hex[:6], [], with_address=False)
            record = ProtobufSerializer(order_cls, client, {"use.deprecated.format": False})(
                order_cls(id=5), _ctx("t", MessageField.VALUE))
        elif kind == "json_schema":
            record = JSONSerializer(json.dumps(value), client)({"id": 5},
                                                             _ctx("t", MessageField.VALUE))
        else:
            record = AvroSerializer(client, json.dumps({
                "type": "record", "name": "R", "fields": [{"name": "id", "type": "long"}]}))(
                {"id": 5}, _ctx("t", MessageField.VALUE))
        spec = _spec(kind, url, subject)
        dec = make_decoder(spec)  # basic auth from the URL
        assert "s3cr" not in repr(dec.__dict__)
        assert _rows(dec.decode(pa.array([record], pa.binary()))) == {0: {"id": 5}}
        # a schema id the registry does not know: an error row naming it
        unknown = record[:1] + (777).to_bytes(4, "big") + record[5:]
        assert _errors(dec.decode(pa.array([unknown], pa.binary())))[0].endswith(
            "/schemas/ids/777: not found")
        # wrong credentials: definite, naming the fix, never the password
        with pytest.raises(RegistryRefused) as refused:
            make_decoder(_spec(kind, reg.url.replace("http://", "http://ann:wrong@"), subject))
        assert "HTTP 401" in str(refused.value) and "wrong" not in str(refused.value)
        assert "password" in (refused.value.hint or "")
        with pytest.raises(FormatError) as bad_url:
            make_decoder(_spec(kind, "ftp://ann:s3cret@host", subject))
        assert "s3cret" not in str(bad_url.value)
    # the registry gone: transient (the source retries), the password never shown
    with pytest.raises(TransientError) as gone:
        dec.decode(pa.array([unknown], pa.binary()))
    assert "s3cr" not in str(gone.value) and "GET /schemas/ids/777 failed" in str(gone.value)


def test_a_schema_of_another_type_or_message_is_an_error_row(registry: RegistryServer) -> None:
    from reclock.registry import make_decoder

    topic = f"unit-{uuid.uuid4().hex[:8]}"
    client = SchemaRegistryClient({"url": registry.url})
    vctx = _ctx(topic, MessageField.VALUE)
    # a JSON Schema of a non-object: one column value; an integer beyond int64
    js = JSONSerializer(json.dumps({"type": "array", "items": {"type": "integer"}}), client)
    ok, big = js([1, 2], vctx), js([1], vctx)[:5] + b"[18446744073709551616]"
    dec = make_decoder(_spec("json_schema", registry.url, f"{topic}-value"))
    assert dec.schema == pa.schema([pa.field("value", pa.list_(pa.int64()))])
    avro = AvroSerializer(client, json.dumps("long"))(3, _ctx(f"{topic}x", MessageField.VALUE))
    res = dec.decode(pa.array([ok, big, avro], pa.binary()))
    assert _rows(res) == {0: {"value": [1, 2]}}
    errs = _errors(res)
    assert "out of the int64 range" in errs[1]
    assert errs[2].endswith("is a AVRO schema, not JSON")
    # a Protobuf record of another message than the output reads
    pool = descriptor_pool.DescriptorPool()
    f = descriptor_pb2.FileDescriptorProto(name=f"two{topic}.proto", package="two",
                                           syntax="proto3")
    for name in ("A", "B"):
        m = f.message_type.add(name=name)
        m.field.add(name=name.lower(), number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
    pool.Add(f)
    a_cls, b_cls = (message_factory.GetMessageClass(pool.FindMessageTypeByName(f"two.{n}"))
                    for n in ("A", "B"))
    conf = {"use.deprecated.format": False}
    pctx = _ctx(f"{topic}p", MessageField.VALUE)
    a = ProtobufSerializer(a_cls, client, conf)(a_cls(a="x"), pctx)
    b = ProtobufSerializer(b_cls, client, conf)(b_cls(b="y"), pctx)
    first = make_decoder(_spec("protobuf", registry.url, f"{topic}p-value"))
    res = first.decode(pa.array([a, b], pa.binary()))
    assert _rows(res) == {0: {"a": "x"}}
    assert "the record is a two.B, the output reads two.A" in _errors(res)[1]
    second = make_decoder({**_spec("protobuf", registry.url, f"{topic}p-value"),
                           "message": "two.B"})
    assert _rows(second.decode(pa.array([b], pa.binary()))) == {0: {"b": "y"}}


def test_a_reset_subject_is_noted_and_refused_when_it_no_longer_fits(
        registry: RegistryServer) -> None:
    from reclock.core.errors import DefiniteError
    from reclock.registry import make_decoder
    from tests.registry import delete_subject

    topic = f"unit-{uuid.uuid4().hex[:8]}"
    subject = f"{topic}-value"
    client = SchemaRegistryClient({"url": registry.url})
    _evolving_producer(client, "json_schema", topic, "v1")({"id": 1, "name": "a", "score": 1})
    fact = make_decoder(_spec("json_schema", registry.url, subject)).fact()  # type: ignore[attr-defined]
    # deleted and registered again with a schema that fits: taken, and noted
    delete_subject(registry.url, subject, permanent=True)
    client.clear_caches()
    _evolving_producer(client, "json_schema", topic, "v2")({"id": 2, "name": "b", "score": 2})
    again = make_decoder(_spec("json_schema", registry.url, subject), known=fact)
    assert again.schema.names == ["id", "name", "score", "email"]
    assert any(f"subject {subject!r} was reset (version 1 was id" in n
               for n in again.notes)  # type: ignore[attr-defined]
    # ... with one that does not: refused, naming the reset and the way out
    delete_subject(registry.url, subject, permanent=True)
    client.clear_caches()
    _evolving_producer(client, "json_schema", topic, "bad")({"id": 3, "name": "c", "score": "x"})
    with pytest.raises(DefiniteError, match=rf"subject {subject!r} was deleted and registered "
                                            r"again .*'score'") as refused:
        make_decoder(_spec("json_schema", registry.url, subject), known=fact)
    assert "resnapshot" in (refused.value.hint or "")
