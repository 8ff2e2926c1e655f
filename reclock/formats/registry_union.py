"""What the ``protobuf`` and ``json_schema`` formats share: records in
Confluent's wire format, writer schemas from a schema registry by id, and
an output whose columns are the *union* of the writer schemas it takes.

Each writer schema maps to an Arrow schema (the format's part). The
output's columns are those Arrow schemas merged (:func:`merge`): the
fields of the first, then each field a later one adds; a field's type may
widen to the narrowest type that holds both exactly
(:func:`reclock.core.schema_change.wider`: ``int32`` -> ``int64``,
``uint32`` -> ``uint64`` or ``int64``, ``float32`` -> ``float64``,
``int32`` -> ``float64``; a struct, list or map field by field, ``null`` ->
anything), and
anything else is :class:`Incompatible`. A removed field stays (null in the
records that lack it). This is the rule the ``avro`` format applies to Avro
writer schemas (:mod:`reclock.formats.avro_union`), said in Arrow terms.

:class:`RegistryDecoder` is the decoder both formats are: built on the
driver from the union of the schemas taken before (``known``, what
:meth:`RegistryDecoder.fact` returned last time), every version of the
subject the registry lists now, and the ids records named (``seen``); on
the executors it reads each record with its own writer schema and judges a
writer the union lacks by the output's ``schema_change`` policy (evolve:
:class:`~reclock.core.errors.SchemaChanged`, the driver re-opens with the
wider union; freeze: today's columns, the values of new fields counted as
dropped; fail: a definite error). A record that does not decode (not the
wire format, an unknown id, bad bytes, a value its schema refuses) is an
error row with the reason.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import pyarrow as pa

from reclock.clients.schema_registry import Fetched, RegistryConfigError, RegistryHandle
from reclock.clients.schema_registry import SchemaMissing as SchemaMissing
from reclock.contracts.decode import Collector, DecodeResult, FormatError, as_binary
from reclock.core.errors import DefiniteError, SchemaChanged, TransientError
from reclock.core.schema_change import wider
from reclock.core.urls import mask_url


class Incompatible(ValueError):
    """Two writer schemas no one column type holds."""


class BadSchema(SchemaMissing):
    """A registered schema the format cannot read (another type, not valid,
    a reference that does not resolve): definite for the records naming it."""


def merge_type(a: pa.DataType, b: pa.DataType, where: str) -> pa.DataType:
    """The type that holds both ``a`` and ``b`` (see the module docstring)."""
    if a.equals(b):
        return a
    if pa.types.is_null(a):
        return b
    if pa.types.is_null(b):
        return a
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        return pa.struct(merge_fields(list(a), list(b), where + "."))
    if pa.types.is_list(a) and pa.types.is_list(b):
        return pa.list_(merge_type(a.value_type, b.value_type, where + "[]"))
    if pa.types.is_map(a) and pa.types.is_map(b):
        return pa.map_(merge_type(a.key_type, b.key_type, where + "{key}"),
                       merge_type(a.item_type, b.item_type, where + "{value}"))
    both = wider(a, b)  # the runtime's own rule, so that the sink widens alike
    if both is not None:
        return both
    raise Incompatible(f"field {where!r} is {b} here and {a} before, and no type holds both")


def merge_fields(a: Sequence[pa.Field], b: Sequence[pa.Field], prefix: str = ""
                 ) -> list[pa.Field]:
    have = {f.name: i for i, f in enumerate(a)}
    out = list(a)
    for f in b:
        i = have.get(f.name)
        if i is None:
            out.append(pa.field(f.name, f.type, nullable=True))
        else:
            out[i] = pa.field(f.name, merge_type(out[i].type, f.type, prefix + f.name),
                              nullable=True)
    return out


def merge(a: pa.Schema | None, b: pa.Schema) -> pa.Schema:
    """The union of two writer schemas' columns (``a`` None: ``b``)."""
    if a is None:
        return pa.schema([pa.field(f.name, f.type, nullable=True) for f in b])
    return pa.schema(merge_fields(list(a), list(b)))


def schema_text(schema: pa.Schema) -> str:
    """``schema`` as text, for the driver's durable facts."""
    return base64.b64encode(schema.serialize().to_pybytes()).decode("ascii")


def schema_of(text: str) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


class Writer(Protocol):
    """One writer schema, ready to read records (made per process)."""

    #: the columns a record of it fills
    schema: pa.Schema

    def read(self, payload: bytes) -> dict[str, Any]:
        """The record's column values (raises on a record that does not
        decode: the message is its reason)."""
        ...


def frame(raw: bytes) -> tuple[int, bytes]:
    """(schema id, payload) of a record in Confluent's wire format."""
    if len(raw) < 5:
        raise ValueError(f"too short for the Confluent wire format ({len(raw)} bytes; expected "
                         "0x00, a 4-byte schema id and the record)")
    if raw[0] != 0:
        head = f"0x{raw[0]:02x}"
        raise ValueError(f"not in the Confluent wire format (starts with {head}, expected 0x00 "
                         "and a 4-byte schema id)")
    return int.from_bytes(raw[1:5], "big"), raw[5:]


class RegistryDecoder:
    """A decoder of registry-framed records into the union of their writer
    schemas (see the module docstring). Subclasses name the format
    (``name``, the registry's ``schema_type``) and build a :class:`Writer`
    from a registered schema (:meth:`writer`)."""

    name = ""
    schema_type = ""
    #: the ``format`` to ask the registry for schemas in
    registry_format: str | None = None

    def __init__(self, registry_url: str, subject: str, *, allow_null: bool = False,
                 timeout: float = 10.0, policy: str = "evolve",
                 known: Mapping[str, Any] | None = None, seen: Sequence[int] = (),
                 part: str = "value") -> None:
        try:
            self.registry = RegistryHandle(registry_url, timeout, fmt=self.registry_format)
        except RegistryConfigError:
            raise FormatError(f"{self.name} format: registry_url must be an http(s) URL, got "
                              f"{mask_url(registry_url)!r}") from None
        self.subject = subject
        self.allow_null = allow_null
        self.policy = policy
        self.part = part
        #: notes for the progress log (a subject found reset)
        self.notes: list[str] = []
        self._arrows: dict[int, pa.Schema] = {}  # ids in the union -> their columns
        self._order: list[int] = []
        self._versions: dict[int, int] = {}
        self._union: pa.Schema | None = None
        self._writers: dict[int, Writer] = {}
        self._judged: dict[int, tuple[str, ...]] = {}
        self._build(known or {}, seen)
        assert self._union is not None
        self.schema: pa.Schema = self._union

    # -- what a format provides --------------------------------------------------------------
    def writer(self, schema_id: int, fetched: Fetched) -> Writer:
        """A :class:`Writer` of ``fetched``, the schema registered as
        ``schema_id`` (raises :class:`BadSchema` for one it cannot read)."""
        raise NotImplementedError

    # -- pickling: writers hold generated classes, made again where needed ----------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_writers"] = {}
        state["_judged"] = {}
        return state

    @property
    def evolving(self) -> bool:
        """The columns follow a registry (re-described at every open)."""
        return True

    # -- the union (driver side) -----------------------------------------------------------
    def _writer_of(self, sid: int) -> Writer:
        hit = self._writers.get(sid)
        if hit is None:
            fetched = self.registry.schema(sid)
            if fetched.schema_type != self.schema_type:
                raise BadSchema(f"schema id {sid} is a {fetched.schema_type} schema, not "
                                f"{self.schema_type}")
            hit = self._writers[sid] = self.writer(sid, fetched)
        return hit

    def _merged(self, union: pa.Schema | None, schema: pa.Schema, label: str) -> pa.Schema:
        try:
            return merge(union, schema)
        except Incompatible as exc:
            raise DefiniteError(
                f"{self.name} format, subject {self.subject!r}: {label} is incompatible with "
                f"the schemas before it: {exc.args[0]}",
                hint="register a compatible version (add optional fields; a type may only "
                     "widen: int32 -> int64, float -> double), or re-read the output in the "
                     "new shape (`reclock resnapshot`, or a new target)") from None

    def _take(self, sid: int, schema: pa.Schema, label: str) -> None:
        if sid in self._arrows:
            return
        self._union = self._merged(self._union, schema, label)
        self._arrows[sid] = schema
        self._order.append(sid)

    def _take_id(self, sid: int, label: str) -> None:
        if sid not in self._arrows:
            try:
                schema = self._writer_of(sid).schema
            except SchemaMissing as exc:
                raise DefiniteError(f"{self.name} format, subject {self.subject!r}: {label}: "
                                    f"{exc.args[0]}",
                                    hint="register a schema this format can read") from None
            self._take(sid, schema, label)

    def _build(self, known: Mapping[str, Any], seen: Sequence[int]) -> None:
        if known.get("format") != self.name:
            known = {}  # another format's union (the output's format was changed)
        recorded = {int(k): schema_of(str(v)) for k, v in dict(known.get("arrow") or {}).items()}
        for sid in [int(i) for i in known.get("order") or sorted(recorded)]:
            if sid in recorded:
                self._take(sid, recorded[sid], f"schema id {sid} (taken before)")
        was = {int(k): int(v) for k, v in dict(known.get("versions") or {}).items()}
        now = self.registry.versions(self.subject)
        if now is None and not was and not self._arrows:
            raise FormatError(f"{self.name} format: schema registry {self.registry.url} has no "
                              f"subject {self.subject!r}",
                              hint="register the subject's first version, or correct 'subject'")
        ids = {v: sid for v, (sid, _) in (now or {}).items()}
        gone = {v: sid for v, sid in was.items() if ids.get(v) != sid}
        said = ", ".join(f"version {v} was id {sid}, "
                         + (f"is id {ids[v]}" if v in ids else "is gone")
                         for v, sid in sorted(gone.items()))
        if gone:
            self.notes.append(f"schema registry subject {self.subject!r} was reset ({said})")
        try:
            for v, sid in sorted(ids.items()):
                self._take_id(sid, f"version {v} (schema id {sid})")
        except DefiniteError as exc:
            if not gone:
                raise
            raise DefiniteError(
                f"schema registry subject {self.subject!r} was deleted and registered again "
                f"({said}), and its new schemas do not fit the output: {exc.args[0]}",
                hint="if the subject was reset on purpose, re-read the output in its new "
                     "shape (`reclock resnapshot`, or a new target); else restore the "
                     "subject's versions") from None
        self._versions = ids
        for sid in seen:
            self._take_id(int(sid), f"schema id {sid}")
        if self._union is None:
            raise FormatError(f"{self.name} format: subject {self.subject!r} has no schema yet",
                              hint="register the subject's first version")

    def fact(self) -> dict[str, Any]:
        """What identifies the union, for the driver to keep durably: the
        subject's versions (version -> schema id) and the columns of every
        schema taken (so that a later open needs no registry to rebuild it)."""
        return {"subject": self.subject, "format": self.name,
                "versions": {str(v): i for v, i in sorted(self._versions.items())},
                "order": list(self._order),
                "arrow": {str(i): schema_text(s) for i, s in self._arrows.items()}}

    # -- decoding (executors) --------------------------------------------------------------
    def _judge(self, sid: int, writer: Writer) -> tuple[str, ...]:
        """The top-level fields records of writer ``sid`` carry that the
        output lacks; raises per the policy when the writer would change the
        output's shape."""
        hit = self._judged.get(sid)
        if hit is not None:
            return hit
        lacks: tuple[str, ...] = ()
        if sid not in self._arrows:
            label = f"schema id {sid}"
            merged = self._merged(self._union, writer.schema, label)
            if not merged.equals(self.schema):
                have = set(self.schema.names)
                new = tuple(n for n in merged.names if n not in have)
                what = f"fields {list(new)} added" if new else "field types changed"
                if self.policy == "evolve":
                    exc = SchemaChanged(
                        f"{self.name} format, subject {self.subject!r}: records written with "
                        f"{label} change the output's shape ({what}); the output evolves",
                        hint="the source re-opens and the sink takes the new shape")
                    exc.schema_id = sid
                    exc.part = self.part
                    raise exc
                if self.policy == "fail":
                    raise DefiniteError(
                        f"{self.name} format, subject {self.subject!r}: records written with "
                        f"{label} change the output's shape ({what}) and the output's "
                        "schema_change is fail",
                        hint="to take it, set schema_change: evolve (or freeze) on the output "
                             "and restart; or re-read the output in its new shape with "
                             "`reclock resnapshot`")
                lacks = new
        self._judged[sid] = lacks
        return lacks

    def decode(self, data: pa.Array) -> DecodeResult:
        columns = self.schema.names

        def read(raw: bytes) -> tuple[Any, Sequence[str]]:
            sid, payload = frame(raw)
            writer = self._writer_of(sid)
            lacks = self._judge(sid, writer)
            return writer.read(payload), lacks

        return decode_each(data, self.schema, self.name, self.allow_null, "record", read,
                           lambda value: [value.get(k) for k in columns])


def decode_each(data: pa.Array, schema: pa.Schema, name: str, allow_null: bool, what: str,
                read: Callable[[bytes], tuple[Any, Sequence[str]]],
                row: Callable[[Any], list[Any]]) -> DecodeResult:
    """Decode each record of ``data`` with ``read`` (a value and the fields
    the output lacks, whose values are dropped and counted), its row by
    ``row``. How a registry format's record fails: a transient error, a
    schema change and a definite error (an incompatible writer schema, a
    change the policy refuses) stop the batch; a schema the registry does not
    know and bad bytes make the record an error row, named ``name``; ``what``
    names the unit in that message ("datum", "record")."""
    data = as_binary(data)
    c = Collector(schema, name)
    dropped: dict[str, int] = {}
    for i, raw in enumerate(data.to_pylist()):
        if raw is None:
            c.null(i, allow_null)
            continue
        try:
            value, lacks = read(raw)
        except (TransientError, SchemaChanged):
            raise
        except SchemaMissing as exc:
            c.error(i, f"{name}: {exc.args[0]}")
            continue
        except DefiniteError:
            raise  # an incompatible writer schema, or a change the policy refuses
        except Exception as exc:  # bad bytes fail in many ways
            msg = str(exc)
            c.error(i, f"{name}: {type(exc).__name__}: {msg}" if msg else
                    f"{name}: {type(exc).__name__} (truncated or corrupt {what})")
            continue
        for k in lacks:
            if isinstance(value, dict) and value.get(k) is not None:
                dropped[k] = dropped.get(k, 0) + 1
        c.row(i, row(value))
    res = c.result()
    return dataclasses.replace(res, dropped=dropped) if dropped else res
