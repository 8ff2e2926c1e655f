"""Kafka persist sink: one output is one Kafka topic, written with transactions.

Topics of an output named ``name`` writing to ``topic``::

    topic                       data records, in ``format`` (json, or avro,
                                protobuf, json_schema in Confluent's wire format,
                                schemas under <topic>-value and <topic>-key:
                                :mod:`reclock.sinks._kafka_formats`), by ``envelope``:
                                log: one per update; key = key_columns (or null),
                                value = the user columns + _into_time, _diff,
                                _src_part, _src_offset, _src_seq, _src_ts
                                upsert: per key and IntoTime that changed it;
                                key = the key columns, value = the user columns
                                + _into_time, or null (a tombstone: deleted)
                                debezium: as upsert, value = {before, after, op,
                                ts_ms, source}; a delete then a tombstone
                                headers reclock.batch=<batch>, reclock.output=<name>
    topic.reclock-errors        error rows (``_error`` set): every column, raw
                                bytes base64; key = the raw key; same headers
    topic.reclock-progress      partition 0 only: one progress record per commit,
                                key = name, value = {"batch", "prev", "upper",
                                "progress", "records", "errors", "schema",
                                "pipeline", "pipeline_state", ...}: the last two
                                name the pipeline that committed (its identity
                                and state directory, :class:`~reclock.contracts.sink.Owner`);
                                a head naming another pipeline is refused

The commit path (numbering of :mod:`reclock.contracts.sink`)::

    1. KafkaStager.stage      executors: rows -> key/value bytes (serialized
                              here, with a registry client made in the
                              process; a value the format cannot hold is an
                              error row), written to an Arrow IPC file under
                              staging_dir/<name>/. Upsert and debezium stage
                              each update's key and image with its diff,
                              IntoTime and position. Kafka transactions cannot
                              span Spark tasks, so nothing touches Kafka here.
    2. KafkaSink.commit       driver, ONE transaction of a transactional producer
                              (init_transactions once per sink object):
        a. fence: the chain head read back (below) must equal ``expected``;
           upsert, debezium: the staged updates summed per key and IntoTime
           into records (:meth:`KafkaSink._consolidated`)
        b. begin; produce every staged record tagged with a fresh batch id
        c. flush: every data record is acknowledged before ...
        d. ... the progress record {batch, prev=head's batch, upper, progress}
           is produced to progress partition 0 and flushed
        e. commit_transaction
        f. read the progress chain back: our batch must be on it
        g. delete the staged files

Everything is staged before the transaction begins, so a transaction is open
only for as long as it takes to produce and commit.

Why the progress records form a chain. On Apache Kafka, a read_committed
consumer never sees records of an aborted or unfinished transaction, and
``init_transactions`` fences an older producer with the same
``transactional.id`` (both tested against a real broker in
``tests/sinks/test_kafka_sink.py``). The development broker (librdkafka 2.16's
mock cluster, :mod:`reclock.devkafka`) does neither. Checked on 2.16.0, when
it was the test broker: its Fetch response always reports the log
end as the last stable offset and lists no aborted transactions, so a
read_committed consumer receives records of aborted transactions, of open
transactions, and of a producer SIGKILLed mid-transaction (whose transaction
is never aborted at all). Its InitProducerId also hands every producer a fresh
producer id, so a zombie with the same transactional.id keeps committing.
So reclock does not rely on the broker to say what was committed. It works it
out from the progress partition, which is a log with one total order:

* Every progress record names its own ``batch`` (a fresh random id per commit
  attempt, also carried by each of its data records in the ``reclock.batch``
  header) and ``prev``, the batch of the state it replaced (``null`` for the
  first commit).
* The valid records are a chain, and the first record to claim a head wins:
  starting from "nothing committed", a record is valid if its ``prev`` is the
  batch of the current head, and then it becomes the head. Any later record
  with the same ``prev`` lost a race (a zombie, a fenced writer) and is ignored,
  along with its data.
* A batch is *committed* when its progress record is readable (read_committed)
  and valid. The data records are flushed before the progress record is
  produced, so a readable progress record means every data record of its batch
  is readable too.

``state()`` is the head of the chain. ``read_updates()`` returns only the data
and error records whose ``reclock.batch`` is a committed batch.

What holds, precisely:

* On Apache Kafka (aborted transactions hidden, zombies fenced): every
  read_committed consumer, reclock or not, sees each committed row exactly
  once, and the chain check never rejects anything. The exception is two
  pipelines writing one output under *different* transactional ids: Kafka
  fences neither, reclock's readers take the first, and other consumers see
  both.
* On a broker that shows aborted or unfinished transactions, such as the mock:
  ``state()`` and ``read_updates()`` (and so ``reclock read`` / ``verify``)
  still show each row exactly once, and a crash or retry never duplicates or
  loses a row for them. An *external* read_committed consumer of ``topic``
  does NOT get exactly-once there. It also sees the records of attempts that
  never committed (a crash mid-transaction, a fenced zombie, a failed commit),
  and their rows appear again when the attempt is retried. Such a consumer can
  check the ``reclock.batch`` header against the progress topic itself.
* One case differs between the two: a transaction whose progress record
  reached the log but whose commit then failed (a crash or an error between
  d. and e.). Kafka aborts it and the state stays ``expected``. The mock keeps
  it readable and then it counts as committed, since all of its data is
  readable too. Either way it is all or nothing. When ``commit`` sees this
  outcome, it returns normally.

Fencing. ``commit`` checks the head against ``expected`` after its producer's
``init_transactions``: on Kafka, any older producer with the same
transactional.id is fenced by then, so the check cannot race a zombie. On the
mock, a writer that loses the race anyway finds its batch off the chain at
step f and gets :class:`~reclock.contracts.sink.SinkFenced`. Its records are left in the
topic, ignored.

Reading the chain. The sink keeps the head in memory and reads only new
progress records on each call. A new sink object reads partition 0 backwards
from its end in windows (:data:`PROGRESS_WINDOW` offsets, then larger). It
stops at an *anchor*: a record that a later record names as ``prev``, which
proves that a writer once found it to be the head. Valid records stay valid,
so the chain continues forward from the anchor. Producers always write
partition 0; a progress topic must have exactly one partition (see ``ensure``).

Operations: ``ensure`` creates the data and errors topics when they are
missing (with the cluster's defaults: clusters often disable auto-creation),
and the progress topic with one partition and no time or size retention. It
holds one small record per commit. An existing progress topic that is
compacted or has a time or size retention is refused with the fix: a vanished
chain means a lost state. ``properties`` are passed to librdkafka
unchanged (security settings, timeouts); the values of those librdkafka
marks sensitive are never logged, and are masked in the messages of errors
that quote them (:mod:`reclock.core.secrets`).
"""

from __future__ import annotations

import base64
import concurrent.futures
import functools
import importlib.metadata
import json
import logging
import os
import re
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._config import ConfigResource
from confluent_kafka.admin._resource import ResourceType
from confluent_kafka.cimpl import NewTopic
from pydantic import Field, SecretStr
from pydantic_core import InitErrorDetails

from reclock.clients.schema_registry import RegistryHandle, topic_subject
from reclock.contracts.config import KAFKA_TOPIC_PATTERN, ConfigModel, DurationMs, problem
from reclock.contracts.encoding import from_json, is_binary, is_listlike, to_json, write_ipc
from reclock.contracts.rows import REFUSED_RAW_MAX, conform, output_schema, refuse_rows
from reclock.contracts.sink import (
    Owner,
    SinkConfigBase,
    SinkContext,
    SinkError,
    SinkFenced,
    SinkPlugin,
    SinkState,
    Superseded,
)
from reclock.core.clock import Clock, SystemClock
from reclock.core.columns import (
    DIFF,
    ERROR,
    INTO_TIME,
    META_FIELDS,
    META_NAMES,
    RAW_KEY,
    RAW_VALUE,
    SRC_OFFSET,
    SRC_PART,
    SRC_SEQ,
    SRC_TS,
)
from reclock.core.errors import ReclockError, TransientError
from reclock.core.schema_change import widens
from reclock.core.secrets import KAFKA_PROPERTIES, kafka_secret_values, scrub
from reclock.sinks._fs import (
    atomic_write,
    check_descriptor,
    check_stage_args,
    check_staged_file,
    remove_staged,
    sink_os_error,
    staging_root,
    vacuum_staged,
)
from reclock.sinks._kafka_formats import (
    FORMATS,
    REGISTRY_FORMATS,
    Codec,
    ValueRefused,
    schema_problems,
)

log = logging.getLogger("reclock.sinks.kafka")
#: librdkafka's own log lines (connection failures, warnings) go here.
client_log = logging.getLogger("reclock.sinks.kafka.client")

HEADER_BATCH = "reclock.batch"
HEADER_OUTPUT = "reclock.output"
#: Version of the progress record layout.
PROGRESS_VERSION = 1
#: Offsets of the progress partition a new sink object reads back first.
PROGRESS_WINDOW = 1000
#: Default bound on one blocking Kafka operation (seconds).
DEFAULT_TIMEOUT_S = 30.0
#: Columns a data record carries after the user's columns.
DATA_META = (INTO_TIME, DIFF, SRC_PART, SRC_OFFSET, SRC_SEQ, SRC_TS)
#: How rows become records (see :class:`KafkaSink`).
ENVELOPES = ("log", "upsert", "debezium")

#: One staged record: where it goes, its key and its value, already encoded.
STAGED_SCHEMA = pa.schema(
    [
        pa.field("dest", pa.int8(), nullable=False),
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary(), nullable=False),
    ]
)
_DATA, _ERRORS = 0, 1
#: A record to produce: (_DATA or _ERRORS, key, value; None: a tombstone).
_Record = tuple[int, bytes | None, bytes | None]

#: librdkafka's default ``message.max.bytes``: the largest record a producer sends.
DEFAULT_MAX_RECORD_BYTES = 1_000_000
#: What a record adds to its key and value on the wire: headers (batch id,
#: output name), lengths, timestamps and the record batch's own header.
RECORD_OVERHEAD_BYTES = 512

_STAGED = re.compile(r"[A-Za-z0-9_.-]+-\d{5,}\.arrow")

# librdkafka properties that only a producer understands: kept out of the
# consumer's configuration so that librdkafka does not warn about them.
_PRODUCER_ONLY = frozenset(
    {
        "acks", "request.required.acks", "batch.num.messages", "batch.size",
        "compression.codec", "compression.type", "delivery.timeout.ms",
        "enable.idempotence", "linger.ms", "message.send.max.retries",
        "message.timeout.ms", "partitioner", "queue.buffering.max.kbytes",
        "queue.buffering.max.messages", "queue.buffering.max.ms", "request.timeout.ms",
        "retries", "sticky.partitioning.linger.ms", "transaction.timeout.ms",
        "transactional.id",
    }
)


def _codes(*names: str) -> frozenset[int]:
    return frozenset(int(getattr(KafkaError, n)) for n in names if hasattr(KafkaError, n))


#: Another producer took over this transactional id.
_FENCED_CODES = _codes("_FENCED", "PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH")
#: ... for good: a newer producer initialised the same transactional id.
_SUPERSEDED_CODES = _codes("_FENCED", "PRODUCER_FENCED")
#: Retrying cannot help: permissions, missing topics, bad records or settings.
_DEFINITE_CODES = _codes(
    "TOPIC_AUTHORIZATION_FAILED", "GROUP_AUTHORIZATION_FAILED", "CLUSTER_AUTHORIZATION_FAILED",
    "TRANSACTIONAL_ID_AUTHORIZATION_FAILED", "SASL_AUTHENTICATION_FAILED", "_AUTHENTICATION",
    "_SSL", "MSG_SIZE_TOO_LARGE", "_MSG_SIZE_TOO_LARGE", "RECORD_LIST_TOO_LARGE",
    "INVALID_RECORD", "INVALID_TOPIC_EXCEPTION", "_INVALID_ARG", "INVALID_CONFIG",
    "_UNKNOWN_TOPIC", "UNKNOWN_TOPIC_OR_PART", "_UNKNOWN_PARTITION", "POLICY_VIOLATION",
    "INVALID_TRANSACTION_TIMEOUT", "_UNSUPPORTED_FEATURE", "UNSUPPORTED_VERSION",
    "UNSUPPORTED_FOR_MESSAGE_FORMAT", "INVALID_REQUIRED_ACKS",
)
#: The brokers (or the development broker) do not implement the admin request.
_UNSUPPORTED_ADMIN = _codes("_UNSUPPORTED_FEATURE", "UNSUPPORTED_VERSION", "INVALID_REQUEST",
                            "_NOT_IMPLEMENTED")
#: A partition's leader is being elected or just moved (retried within a call).
_LEADER_MOVING_CODES = _codes("NOT_LEADER_FOR_PARTITION", "LEADER_NOT_AVAILABLE",
                              "FENCED_LEADER_EPOCH", "UNKNOWN_LEADER_EPOCH")
_MISSING_TOPIC_CODES = _codes("_UNKNOWN_TOPIC", "UNKNOWN_TOPIC_OR_PART", "_UNKNOWN_PARTITION")
_EOF = int(KafkaError._PARTITION_EOF)


# -- JSON encoding of Arrow values ---------------------------------------------------------
#
# A column is first cast to its "plain" type (temporal -> integer in its own
# unit, decimal -> string, dictionary -> value type), which JSON holds exactly;
# binary becomes base64 and non-finite floats the strings "NaN", "Infinity",
# "-Infinity". Decoding parses back to the plain type and casts to the stored
# type, so every value round-trips exactly.

def plain_type(t: pa.DataType) -> pa.DataType:
    """The type ``t`` is cast to before its values become JSON."""
    if pa.types.is_dictionary(t):
        return plain_type(t.value_type)
    if pa.types.is_date32(t) or pa.types.is_time32(t):
        return pa.int32()
    if (
        pa.types.is_timestamp(t) or pa.types.is_date64(t) or pa.types.is_time64(t)
        or pa.types.is_duration(t)
    ):
        return pa.int64()
    if pa.types.is_decimal(t):
        return pa.string()
    if pa.types.is_fixed_size_list(t):
        return pa.list_(t.value_field.with_type(plain_type(t.value_type)), t.list_size)
    if pa.types.is_large_list(t):
        return pa.large_list(t.value_field.with_type(plain_type(t.value_type)))
    if pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(plain_type(t.value_type)))
    if pa.types.is_map(t):
        return pa.map_(
            t.key_field.with_type(plain_type(t.key_type)),
            t.item_field.with_type(plain_type(t.item_type)),
        )
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(plain_type(t.field(i).type))
                          for i in range(t.num_fields)])
    return t






def _needs_walk(t: pa.DataType) -> bool:
    """Whether values of (plain) type ``t`` need converting, not just copying."""
    if is_binary(t) or pa.types.is_floating(t) or pa.types.is_map(t):
        return True
    if is_listlike(t):
        return _needs_walk(t.value_type)
    if pa.types.is_struct(t):
        return any(_needs_walk(t.field(i).type) for i in range(t.num_fields))
    return False






def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def plain_docs(data: pa.Table, schema: pa.Schema) -> dict[str, list[Any]]:
    """The plain values of each column of ``data`` (rows of ``schema``): cast
    to :func:`plain_type` and made JSON-able (see the module docstring of
    :mod:`reclock.sinks._kafka_formats`)."""
    plain = pa.schema([f.with_type(plain_type(f.type)) for f in schema])
    try:
        data = data.select(schema.names).cast(plain)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise SinkError(f"rows cannot be encoded: {exc}") from exc
    cols: dict[str, list[Any]] = {}
    for f in plain:
        values = data.column(f.name).to_pylist()
        cols[f.name] = [to_json(v, f.type) for v in values] if _needs_walk(f.type) else values
    return cols


def encode_rows(
    output: str, table: pa.Table, schema: pa.Schema, key_columns: Sequence[str] = ()
) -> pa.Table:
    """Rows of ``schema`` (an output schema) as staged JSON records
    (:data:`STAGED_SCHEMA`) of the log envelope."""
    data = conform(output, table, schema)
    user = pa.schema([f for f in schema if f.name not in META_NAMES])
    value = Codec("json", _log_value_schema(user))
    key = Codec("json", _key_schema(user, key_columns)) if key_columns else None
    encoded, refused = _encode_log(data, schema, "", value, key)
    if refused:
        raise SinkError(f"output {output!r}: rows cannot be encoded as JSON: "
                        f"{next(iter(refused.values()))}")
    return encoded


def _log_value_schema(user: pa.Schema) -> pa.Schema:
    meta = {f.name: f for f in META_FIELDS}
    return pa.schema([*user, *(meta[n] for n in DATA_META)])


def _upsert_value_schema(user: pa.Schema) -> pa.Schema:
    return pa.schema([*user, pa.field(INTO_TIME, pa.int64(), nullable=False)])


def _key_schema(user: pa.Schema, key: Sequence[str]) -> pa.Schema:
    return pa.schema([user.field(c) for c in key])


#: The ``source`` block of a Debezium-shaped record: who wrote it, and the
#: reclock position of the change (see docs/outputs.md).
DEBEZIUM_SOURCE = pa.struct([
    pa.field("version", pa.string(), nullable=False),
    pa.field("connector", pa.string(), nullable=False),
    pa.field("name", pa.string(), nullable=False),
    pa.field("ts_ms", pa.int64()),
    pa.field("snapshot", pa.string()),
    pa.field("db", pa.string()),
    pa.field("table", pa.string()),
    pa.field("into_time", pa.int64(), nullable=False),
    pa.field("src_part", pa.int32(), nullable=False),
    pa.field("src_offset", pa.int64(), nullable=False),
    pa.field("src_seq", pa.int32(), nullable=False),
])


def _debezium_schema(user: pa.Schema) -> pa.Schema:
    row = pa.struct(list(user))
    return pa.schema([
        pa.field("before", row), pa.field("after", row),
        pa.field("source", DEBEZIUM_SOURCE, nullable=False),
        pa.field("op", pa.string(), nullable=False),
        pa.field("ts_ms", pa.int64(), nullable=False),
    ])


def _refusal(exc: BaseException) -> str:
    return f"the record cannot be serialized: {type(exc).__name__}: {exc}"


#: Exceptions of a serializer that mean "this value", not "this registry".
def _value_errors() -> tuple[type[BaseException], ...]:
    from confluent_kafka.serialization import SerializationError

    return (ValueRefused, ValueError, TypeError, OverflowError, KeyError, AttributeError,
            SerializationError)


def _registry_failure(exc: BaseException) -> bool:
    """Whether ``exc`` of a serializer is the registry's (not the value's)."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    return isinstance(exc, SchemaRegistryError | OSError) or type(exc).__module__.startswith(
        ("httpx", "httpcore"))


def _registry_error(output: str, subject: str | None, exc: BaseException) -> ReclockError:
    """A registry failure as one of reclock's two tiers: a 4xx answer other
    than 408/429 is definite (incompatible schema, bad credentials), the rest
    is transient."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    text = scrub(str(exc))
    msg = f"output {output!r}: schema registry, subject {subject!r}: {text}"
    if isinstance(exc, SchemaRegistryError):
        code = int(getattr(exc, "http_status_code", 0) or 0)
        if 400 <= code < 500 and code not in (408, 429):
            return SinkError(msg, hint="check the registry's URL, credentials and the "
                                       "subject's compatibility setting (a schema change the "
                                       "subject refuses needs a new subject or topic)")
    return TransientError(msg, hint="is the schema registry reachable? retried with backoff")


def _encode_log(data: pa.Table, schema: pa.Schema, topic: str, value: Codec,
                key: Codec | None) -> tuple[pa.Table, dict[int, str]]:
    """Log envelope: every row one record (error rows to the errors topic,
    as JSON). The records, and the rows the format refused (index -> why)."""
    cols = plain_docs(data, schema)
    raw_keys = data.column(RAW_KEY).to_pylist()
    is_error = data.column(ERROR).is_valid().to_pylist()
    dest: list[int] = []
    keys: list[bytes | None] = []
    values_out: list[bytes] = []
    refused: dict[int, str] = {}
    value_names, key_names = value.schema.names, (key.schema.names if key else [])
    bad = _value_errors()
    for i, err in enumerate(is_error):
        if err:
            dest.append(_ERRORS)
            keys.append(raw_keys[i])
            values_out.append(_dumps({n: cols[n][i] for n in schema.names}))
            continue
        try:
            v = value.encode({n: cols[n][i] for n in value_names}, topic)
            k = key.encode({n: cols[n][i] for n in key_names}, topic) if key else None
        except bad as exc:
            if _registry_failure(exc):
                raise
            refused[i] = _refusal(exc)
            v, k = b"", None
        dest.append(_DATA)
        keys.append(k)
        values_out.append(v)
    return pa.Table.from_arrays(
        [pa.array(dest, pa.int8()), pa.array(keys, pa.binary()),
         pa.array(values_out, pa.binary())],
        schema=STAGED_SCHEMA,
    ), refused


def decode_rows(output: str, docs: list[dict[str, Any]], schema: pa.Schema, where: str) -> pa.Table:
    """Parsed record values back into a table of ``schema``."""
    cols = []
    for f in schema:
        pt = plain_type(f.type)
        raw = [d.get(f.name) for d in docs]
        try:
            if _needs_walk(pt):
                raw = [from_json(v, pt) for v in raw]
            arr = pa.array(raw, type=pt)
            if pt != f.type:
                arr = arr.cast(f.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, KeyError,
                TypeError, ValueError, AttributeError) as exc:
            raise SinkError(
                f"output {output!r}: column {f.name!r} in {where} does not decode as "
                f"{f.type}: {exc}",
                hint="was the output's schema changed incompatibly?",
            ) from exc
        if not f.nullable and arr.null_count:
            raise SinkError(f"output {output!r}: records in {where} lack column {f.name!r}")
        cols.append(arr)
    return pa.Table.from_arrays(cols, schema=schema)


def _encode_schema(user: pa.Schema) -> str:
    return base64.b64encode(user.serialize().to_pybytes()).decode("ascii")


def _decode_schema(text: str) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


# -- executor side ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Envelope:
    """How rows become records: ``kind`` (log, upsert, debezium), the record
    format and its registry, the subjects, and the key (see :class:`KafkaSink`).
    Picklable: the codecs make their registry clients on first use."""

    kind: str = "log"
    format: str = "json"
    registry: RegistryHandle | None = None
    topic: str = ""
    key: tuple[str, ...] = ()
    value_subject: str | None = None
    key_subject: str | None = None
    namespace: str = "reclock"
    #: Debezium ``source`` fields that name the output
    source_name: str = ""

    def codecs(self, user: pa.Schema) -> tuple[Codec, Codec | None]:
        """The value codec and the key codec (None: records without key) of
        an output whose user columns are ``user``."""
        if self.kind == "log":
            value_schema = _log_value_schema(user)
        elif self.kind == "upsert":
            value_schema = _upsert_value_schema(user)
        else:
            value_schema = _debezium_schema(user)
        name = "Envelope" if self.kind == "debezium" else "Value"
        value = Codec(self.format, value_schema, registry=self.registry,
                      subject=self.value_subject, name=name, namespace=self.namespace)
        if not self.key:
            return value, None
        key = Codec(self.format, _key_schema(user, self.key), registry=self.registry,
                    subject=self.key_subject, name="Key", namespace=self.namespace, is_key=True)
        return value, key


#: One staged update of a keyed envelope (upsert, debezium): its key and
#: image already encoded, and what consolidation needs.
KEYED_STAGED_SCHEMA = pa.schema([
    *STAGED_SCHEMA,
    pa.field("diff", pa.int64()),
    pa.field("into", pa.int64()),
    pa.field("part", pa.int32()),
    pa.field("offset", pa.int64()),
    pa.field("seq", pa.int32()),
    pa.field("ts", pa.int64()),
])


@dataclass(frozen=True)
class KafkaStager:
    """Encodes rows and writes them to a staging file (picklable; no
    connection: the registry client is made on first use in each process).

    ``root`` is this output's staging directory, which the driver must be able
    to read; ``schema`` the output schema the rows are conformed to.
    """

    name: str
    root: str
    schema: pa.Schema
    key_columns: tuple[str, ...] = ()
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    envelope: Envelope = field(default_factory=Envelope)
    #: this process's codecs, made on first use (never pickled)
    _codecs: tuple[Codec, Codec | None] | None = field(default=None, repr=False, compare=False,
                                                       hash=False)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_codecs"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__["_codecs"] = None

    def codecs(self) -> tuple[Codec, Codec | None]:
        if self._codecs is None:
            user = pa.schema([f for f in self.schema if f.name not in META_NAMES])
            env = self.envelope
            if env.kind == "log" and self.key_columns and not env.key:
                env = Envelope(**{**env.__dict__, "key": self.key_columns})
            object.__setattr__(self, "_codecs", env.codecs(user))
        assert self._codecs is not None
        return self._codecs

    def stage(self, batch_id: str, part: int, table: pa.Table) -> list[dict[str, Any]]:
        """Write ``table`` to ``<root>/<batch_id>-<part:05d>.arrow``.

        Returns one descriptor: ``path`` (relative to the root), ``rows`` (data
        records), ``errors`` (error records) and ``size`` (bytes). Restaging the
        same ``(batch_id, part)`` replaces the file.
        """
        check_stage_args(batch_id, part)
        if table.num_rows == 0:
            return []
        data = conform(self.name, table, self.schema)
        encoded, refused = self._encode(data)
        if refused:
            data = self._refuse(data, refused)
            encoded, _ = self._encode(data)
        name = f"{batch_id}-{part:05d}.arrow"
        target = os.path.join(self.root, name)  # (a str: see reclock.sinks._fs._temp_of)
        try:
            os.makedirs(self.root, exist_ok=True)
            size = atomic_write(target, partial(write_ipc, encoded))
        except OSError as exc:
            raise sink_os_error(self.name, target, exc) from exc
        errors = int(pc.sum(pc.equal(encoded.column("dest"), _ERRORS)).as_py() or 0)
        return [{"path": name, "rows": encoded.num_rows - errors, "errors": errors,
                 "size": size}]

    def screen(self, table: pa.Table) -> pa.Table:
        """Records the format cannot hold, or larger than the producer's
        ``message.max.bytes``, become error rows (their content cut); the
        rest stay."""
        if table.num_rows == 0:
            return table
        data = conform(self.name, table, self.schema)
        _, refused = self._encode(data)
        return self._refuse(data, refused) if refused else table

    def _refuse(self, data: pa.Table, refused: dict[int, str]) -> pa.Table:
        # Bad input is data: a record the format cannot hold or the producer
        # cannot send is an error row (its content cut), and the rest lands.
        mask = [i in refused for i in range(data.num_rows)]
        return refuse_rows(data, mask, {i: refused.get(i, "") for i in range(data.num_rows)},
                           raw_max=min(REFUSED_RAW_MAX, self.max_record_bytes // 4))

    def _encode(self, data: pa.Table) -> tuple[pa.Table, dict[int, str]]:
        """The encoded records, and the rows refused (index -> why): those the
        format cannot hold, and those too large to send."""
        value, key = self.codecs()
        try:
            if self.envelope.kind == "log":
                encoded, refused = _encode_log(data, self.schema, self.envelope.topic, value, key)
            else:
                encoded, refused = self._encode_keyed(data, value, key)
        except ReclockError:
            raise
        except Exception as exc:
            if _registry_failure(exc):
                raise _registry_error(self.name, self.envelope.value_subject, exc) from exc
            raise
        sizes = pc.add(pc.fill_null(pc.binary_length(encoded.column("key")), 0),
                       pc.binary_length(encoded.column("value")))
        limit = self.max_record_bytes - RECORD_OVERHEAD_BYTES
        if self.envelope.kind == "debezium":
            # an update carries the row twice (before and after)
            sizes = pc.multiply(sizes, 2)
        for i, big in enumerate(pc.greater(sizes, limit).to_pylist()):
            if big and i not in refused and encoded.column("dest")[i].as_py() == _DATA:
                refused[i] = (f"the record is larger than the producer's message.max.bytes "
                              f"({self.max_record_bytes:,} bytes, headers included)")
        return encoded, refused

    def _encode_keyed(self, data: pa.Table, value: Codec, key: Codec | None
                      ) -> tuple[pa.Table, dict[int, str]]:
        """Upsert and Debezium envelopes: each update staged with its encoded
        key and image (upsert: the record's value; Debezium: the row's plain
        JSON, which the driver puts into the event), for the driver to sum
        per key and IntoTime (see :meth:`KafkaSink.commit`)."""
        assert key is not None
        schema, topic = self.schema, self.envelope.topic
        cols = plain_docs(data, schema)
        user = [f.name for f in schema if f.name not in META_NAMES]
        raw_keys = data.column(RAW_KEY).to_pylist()
        is_error = data.column(ERROR).is_valid().to_pylist()
        into = data.column(INTO_TIME).to_pylist()
        out: dict[str, list[Any]] = {f.name: [] for f in KEYED_STAGED_SCHEMA}
        refused: dict[int, str] = {}
        bad = _value_errors()
        debezium = self.envelope.kind == "debezium"
        for i, err in enumerate(is_error):
            if err:
                out["dest"].append(_ERRORS)
                out["key"].append(raw_keys[i])
                out["value"].append(_dumps({n: cols[n][i] for n in schema.names}))
                for c in ("diff", "into", "part", "offset", "seq", "ts"):
                    out[c].append(None)
                continue
            row = {n: cols[n][i] for n in user}
            try:
                k = key.encode({n: cols[n][i] for n in key.schema.names}, topic)
                if debezium:
                    # the event as a consumer would get it for an insert:
                    # what cannot be serialized fails here, in the task
                    value.encode(_event(None, row, "c", into[i], self.envelope,
                                        (0, 0, 0, None)), topic)
                    v = _dumps(row)
                else:
                    v = value.encode({**row, INTO_TIME: into[i]}, topic)
            except bad as exc:
                if _registry_failure(exc):
                    raise
                refused[i] = _refusal(exc)
                k, v = None, b""
            out["dest"].append(_DATA)
            out["key"].append(k)
            out["value"].append(v)
            out["diff"].append(cols[DIFF][i])
            out["into"].append(into[i])
            out["part"].append(cols[SRC_PART][i])
            out["offset"].append(cols[SRC_OFFSET][i])
            out["seq"].append(cols[SRC_SEQ][i])
            out["ts"].append(cols[SRC_TS][i])
        return pa.table(out, schema=KEYED_STAGED_SCHEMA), refused


def _show_key(codec: Codec | None, key: bytes, topic: str) -> str:
    """A record key, decoded for a message when it can be."""
    try:
        return repr(codec.decode(key, topic)) if codec is not None else repr(key)
    except Exception:  # only for a message: the bytes then
        return repr(key)


@functools.lru_cache(maxsize=1)
def _version() -> str:
    try:
        return importlib.metadata.version("reclock")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _op(before: dict[str, Any] | None, after: dict[str, Any] | None,
        pos: tuple[int, int, int, int | None]) -> str:
    """A Debezium event's ``op``: ``r`` (read) for a row a snapshot read, as
    Debezium marks the rows of its snapshots; else ``c`` (no row before),
    ``u`` (a row before and after) or ``d`` (no row after).

    A snapshot's rows are those at a negative ``_src_part``
    (:mod:`reclock.core.columns`): a CDC source's snapshot chunks (Postgres:
    ``-1 - chunk``), and what ``reclock resnapshot`` inserts. Only an event
    that inserts a row is a read: a key whose row a re-snapshot found
    changed (``u``) or gone (``d``) is a change a consumer must apply as
    such."""
    if before is not None and after is not None:
        return "u"
    if after is None:
        return "d"
    return "r" if pos[0] < 0 else "c"


def _event(before: dict[str, Any] | None, after: dict[str, Any] | None, op: str, into: int,
           env: Envelope, pos: tuple[int, int, int, int | None]) -> dict[str, Any]:
    """A Debezium-shaped change event (plain document); ``source.snapshot``
    is ``"false"`` (:meth:`KafkaSink._consolidated` marks the reads)."""
    part, offset, seq, ts = pos
    return {
        "before": before, "after": after, "op": op, "ts_ms": into,
        "source": {"version": _version(), "connector": "reclock",
                   "name": env.source_name, "ts_ms": ts, "snapshot": "false",
                   "db": env.source_name.partition(".")[0],
                   "table": env.source_name.partition(".")[2] or env.source_name,
                   "into_time": into, "src_part": part, "src_offset": offset,
                   "src_seq": seq},
    }


# -- the progress chain -------------------------------------------------------------------------


@dataclass(frozen=True)
class ProgressRecord:
    """One progress record read back from partition 0 of the progress topic."""

    offset: int
    batch: str
    prev: str | None
    state: SinkState
    records: int = 0
    errors: int = 0
    schema: str | None = None  # base64 Arrow IPC of the user schema
    #: the pipeline that committed it (None: written before owners were recorded)
    pipeline: str | None = None
    pipeline_state: str | None = None
    #: the data topic's Kafka topic id when it was committed (None: written
    #: before topic ids were recorded): the state counts that topic's records
    topic_id: str | None = None

    def user_schema(self) -> pa.Schema | None:
        return None if self.schema is None else _decode_schema(self.schema)


def _progress_value(
    name: str, batch: str, prev: str | None, new: SinkState, records: int, errors: int,
    schema: str | None, owner: Owner | None = None, topic_id: str | None = None,
) -> bytes:
    doc = {
        "v": PROGRESS_VERSION, "output": name, "batch": batch, "prev": prev,
        "upper": new.upper, "progress": new.progress, "records": records, "errors": errors,
        "schema": schema,
    }
    if owner is not None:
        doc["pipeline"] = owner.pipeline
        doc["pipeline_state"] = owner.state
    if topic_id is not None:
        doc["topic_id"] = topic_id
    return _dumps(doc)


def parse_progress(output: str, topic: str, offset: int, value: bytes | None) -> ProgressRecord:
    """A progress record of ``output``; SinkError if it is not one."""
    try:
        doc = json.loads(value or b"")
        if doc.get("v") != PROGRESS_VERSION:
            raise ValueError(f"unknown version {doc.get('v')!r}")
        batch, prev = doc["batch"], doc["prev"]
        upper, progress = doc["upper"], doc["progress"]
        records, errors, schema = doc.get("records", 0), doc.get("errors", 0), doc.get("schema")
        pipeline, pipeline_state = doc.get("pipeline"), doc.get("pipeline_state")
        topic_id = doc.get("topic_id")
        ok = (
            isinstance(batch, str) and (prev is None or isinstance(prev, str))
            and (upper is None or (isinstance(upper, int) and not isinstance(upper, bool)))
            and (progress is None or isinstance(progress, str))
            and isinstance(records, int) and isinstance(errors, int)
            and (schema is None or isinstance(schema, str))
            and (pipeline is None or isinstance(pipeline, str))
            and (pipeline_state is None or isinstance(pipeline_state, str))
            and (topic_id is None or isinstance(topic_id, str))
        )
        if not ok:
            raise TypeError("a field has the wrong type")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SinkError(
            f"output {output!r}: progress record at {topic}[0]@{offset} is corrupt: {exc}",
            hint="something other than reclock wrote this key to the progress topic",
        ) from exc
    return ProgressRecord(offset, batch, prev, SinkState(upper, progress), records, errors, schema,
                          pipeline, pipeline_state, topic_id)


def _forward(
    head: ProgressRecord | None, records: Sequence[ProgressRecord]
) -> list[ProgressRecord]:
    """The records that extend the chain from ``head`` (``None``: nothing committed)."""
    out = []
    cur = None if head is None else head.batch
    for r in records:
        if r.prev == cur:
            out.append(r)
            cur = r.batch
    return out


def resolve_chain(
    records: Sequence[ProgressRecord], complete: bool
) -> list[ProgressRecord] | None:
    """The valid records among ``records`` (one output's, in offset order).

    ``complete`` says ``records`` reach back to the start of the partition.
    Returns ``None`` when the records read so far do not decide (read further
    back). See the module docstring for the rule and the anchor.
    """
    named = {r.prev for r in records if r.prev is not None}
    for i, anchor in enumerate(records):
        if anchor.batch not in named:
            continue
        # Backwards from the anchor along prev: its ancestors, all valid.
        by_batch: dict[str, ProgressRecord] = {}
        for r in records[:i]:
            by_batch.setdefault(r.batch, r)
        before: list[ProgressRecord] = []
        cur = anchor
        while cur.prev is not None and cur.prev in by_batch:
            p = by_batch[cur.prev]
            if p.offset >= cur.offset:
                break
            before.append(p)
            cur = p
        before.reverse()
        return [*before, anchor, *_forward(anchor, records[i + 1 :])]
    if not complete:
        return None
    if not records:
        return []
    if records[0].prev is None:
        return _forward(None, records)
    # The oldest record left points at one that is gone (retention): trust it.
    log.warning(
        "progress record at offset %d follows batch %s, which is no longer in the topic; "
        "trusting it as the start of the chain", records[0].offset, records[0].prev,
    )
    return [records[0], *_forward(records[0], records[1:])]


@dataclass
class _Chain:
    """What this sink object knows of the chain: its head, how far it has read,
    and the batches read lately (``seen``: all; ``recent``: the valid ones)."""

    head: ProgressRecord | None
    next: int
    recent: deque[str] = field(default_factory=lambda: deque(maxlen=256))
    seen: deque[str] = field(default_factory=lambda: deque(maxlen=256))

    def extend(self, records: Sequence[ProgressRecord], upto: int) -> None:
        self.seen.extend(r.batch for r in records)
        for r in _forward(self.head, records):
            self.head = r
            self.recent.append(r.batch)
        self.next = upto


# -- driver side ----------------------------------------------------------------------------


class _Failed(Exception):
    """Internal: a step of the transaction failed; ``error`` is what to raise."""

    def __init__(self, error: ReclockError) -> None:
        super().__init__(str(error))
        self.error = error


class KafkaSink:
    """A :class:`~reclock.contracts.sink.PersistSink` writing to a Kafka topic (see module doc).

    ``staging_dir`` is a directory the executors write and the driver reads
    (in local mode, the state directory). ``timeout_s`` bounds each blocking
    Kafka call. ``clock`` (seconds since the epoch) only decides file ages for
    :meth:`vacuum_orphans`.
    """

    holds_state = False  # envelope log: an update log; upsert and debezium: the current rows

    def __init__(
        self,
        name: str,
        *,
        bootstrap_servers: str,
        topic: str,
        staging_dir: str | Path,
        progress_topic: str | None = None,
        transactional_id: str | None = None,
        format: str = "json",
        key_columns: Sequence[str] = (),
        properties: Mapping[str, Any] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        clock: Clock | None = None,
        owner: Owner | None = None,
        envelope: str = "log",
        key: Sequence[str] = (),
        registry: RegistryHandle | None = None,
        subject: str | None = None,
        key_subject: str | None = None,
    ) -> None:
        if format not in FORMATS:
            raise SinkError(f"output {name!r}: format {format!r} is not supported; one of "
                            f"{list(FORMATS)}")
        if format in REGISTRY_FORMATS and registry is None:
            raise SinkError(f"output {name!r}: format {format!r} needs a schema registry",
                            hint="give the sink registry: {url: http://registry:8081}")
        if envelope not in ENVELOPES:
            raise SinkError(f"output {name!r}: envelope {envelope!r} is not supported; one of "
                            f"{list(ENVELOPES)}")
        if envelope != "log" and not key:
            raise SinkError(f"output {name!r}: envelope {envelope} needs the key columns",
                            hint="give the sink key: [column, ...] (the output's upstream key)")
        if envelope != "log" and key_columns:
            raise SinkError(f"output {name!r}: key_columns is for envelope log; envelope "
                            f"{envelope} keys its records by key", hint="use key: [...] only")
        self.name = name
        self.owner = owner
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.errors_topic = f"{topic}.reclock-errors"
        self.progress_topic = progress_topic or f"{topic}.reclock-progress"
        self.transactional_id = transactional_id or f"reclock-{name}"
        self.format = format
        self.envelope = envelope
        self.holds_state = envelope != "log"
        self.key = tuple(key)
        self.key_columns = tuple(key_columns) if envelope == "log" else self.key
        self.registry = registry
        self.value_subject = subject or topic_subject(topic)
        self.key_subject = key_subject or topic_subject(topic, is_key=True)
        self.staging_root = staging_root(staging_dir, name)
        self.timeout_s = timeout_s
        self._properties = dict(properties or {})
        self._clock: Clock = clock or SystemClock()  # ms; file ages compare in seconds
        self._key = name.encode()
        self._user: pa.Schema | None = None  # from ensure()
        self._producer: Any = None
        self._consumer: Any = None
        self._chain: _Chain | None = None
        #: the progress topic's id when the chain was first read
        self._progress_id: str | None = None
        #: the data topic's id, read by ensure (None: not known)
        self._data_id: str | None = None

    def _redact(self, text: str) -> str:
        """``text`` scrubbed of the sensitive properties' values (librdkafka
        quotes invalid values in its messages) and of every secret the
        process knows (:func:`reclock.core.secrets.scrub`)."""
        return scrub(text, kafka_secret_values(self._properties))

    def __repr__(self) -> str:
        # Never the properties: they may hold credentials.
        return (f"KafkaSink({self.name!r}, topic={self.topic!r}, "
                f"bootstrap_servers={self.bootstrap_servers!r})")

    # -- schema ----------------------------------------------------------------------------
    def ensure(self, user_schema: pa.Schema) -> None:
        """Check the schema (no clash with reclock's columns, key columns exist)
        and that it agrees with the schema of the last commit, if any: columns
        may be added or dropped, and widen (int -> long), not change type
        otherwise. The schema is recorded by the next commit, with its rows.
        Creates the output's topics that are missing, and refuses a progress
        topic that could lose records (see :meth:`_provision_topics`)."""
        output_schema(user_schema)
        self._provision_topics()
        self._data_id = self._topic_id(self.topic)
        missing = [c for c in self.key_columns if user_schema.get_field_index(c) < 0]
        if missing:
            raise SinkError(
                f"output {self.name!r}: key columns {missing} are not columns of the output",
                hint=f"choose key columns among {user_schema.names}",
            )
        self._check_format(user_schema)
        head = self._catch_up()
        stored = head.user_schema() if head is not None else None
        if stored is not None:
            # a widened type (int -> long) reads the earlier records' JSON
            # exactly; the next commit records the new schema with its rows
            clashes = [
                f"column {f.name!r}: stored {stored.field(f.name).type}, wanted {f.type}"
                for f in user_schema
                if stored.get_field_index(f.name) >= 0
                and not widens(stored.field(f.name).type, f.type)
            ]
            if clashes:
                raise SinkError(
                    f"output {self.name!r} on topic {self.topic!r}: the schema differs from "
                    "the last commit's: " + "; ".join(clashes),
                    hint="write to a new topic, or keep the column types",
                )
        self._user = user_schema
        self._register(user_schema)

    def _envelope(self) -> Envelope:
        ns = re.sub(r"[^A-Za-z0-9_]", "_", self.topic)
        return Envelope(self.envelope, self.format, self.registry, self.topic,
                        self.key if self.envelope != "log" else self.key_columns,
                        self.value_subject, self.key_subject,
                        f"reclock.{ns}" if not ns[0].isdigit() else f"reclock._{ns}", self.name)

    def _check_format(self, user: pa.Schema) -> None:
        """The format can hold the output's records (field names, types)."""
        value, key = self._envelope().codecs(user)
        problems = schema_problems(self.format, value.schema)
        if key is not None:
            problems += schema_problems(self.format, key.schema)
        if problems:
            raise SinkError(f"output {self.name!r}: format {self.format} cannot hold its "
                            "records: " + "; ".join(dict.fromkeys(problems)),
                            hint="rename or cast the columns in the output (rename: ...), or "
                                 "write another format")
        if self.envelope != "log":
            nested = [c for c in self.key if pa.types.is_nested(user.field(c).type)]
            if nested:
                raise SinkError(f"output {self.name!r}: key columns {nested} are lists, maps "
                                "or structs", hint="key the records by scalar columns")

    def _register(self, user: pa.Schema) -> None:
        """Register the value and key schemas in the registry now, on the
        driver: a registry that refuses one (an incompatible change, bad
        credentials) stops the output here, before any row is staged."""
        if self.format not in REGISTRY_FORMATS:
            return
        value, key = self._envelope().codecs(user)
        for codec in (value, key):
            if codec is None:
                continue
            try:
                sid = codec.register(self.topic)
            except Exception as exc:
                raise _registry_error(self.name, codec.subject, exc) from exc
            log.info("output %r: schema id %d under subject %r", self.name, sid, codec.subject)

    # -- topics ------------------------------------------------------------------------------
    #: The progress topic's settings: one partition, nothing deleted by time or size.
    PROGRESS_CONFIG: ClassVar[dict[str, str]] = {
        "cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "-1"}

    def _admin(self) -> AdminClient:
        conf = {k: v for k, v in self._client_conf(producer=False).items()
                if k in ("bootstrap.servers", "client.id", "logger") or k.startswith(
                    ("security.", "sasl.", "ssl.", "socket.", "broker."))}
        return AdminClient(conf)

    def _provision_topics(self) -> None:
        """Clusters often disable auto-creation: create the data, errors and
        progress topics that are missing (the data and errors topics with the
        cluster's defaults, the progress topic with :data:`PROGRESS_CONFIG`
        and one partition). A progress topic that exists must have one
        partition and no compaction, time or size retention: a vanished chain
        is a lost state, so anything else is refused with the fix."""
        admin = self._admin()
        try:
            md = admin.list_topics(timeout=self.timeout_s)
        except KafkaException as exc:
            raise self._error(exc.args[0], "list the topics of the cluster for", None) from exc
        missing = [t for t in (self.topic, self.errors_topic, self.progress_topic)
                   if t not in md.topics or md.topics[t].error is not None]
        replication = max(1, min(3, len(md.brokers)))
        new = [NewTopic(t, num_partitions=1 if t == self.progress_topic else -1,
                        replication_factor=replication if t == self.progress_topic else -1,
                        config=dict(self.PROGRESS_CONFIG) if t == self.progress_topic else {})
               for t in missing]
        if new:
            futures = admin.create_topics(new, operation_timeout=self.timeout_s,
                                          request_timeout=self.timeout_s)
            for topic, fut in futures.items():
                try:
                    fut.result()
                    log.info("output %r: created topic %r", self.name, topic)
                except KafkaException as exc:
                    err = exc.args[0]
                    if err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                        continue
                    if err.code() in _UNSUPPORTED_ADMIN:
                        log.warning("output %r: the brokers cannot create topics (%s); "
                                    "relying on auto-creation", self.name, err.str())
                        return
                    raise self._error(err, "create", f"topic {topic!r}") from exc
        self._check_progress_topic(admin)

    def _check_progress_topic(self, admin: AdminClient) -> None:
        topic = self.progress_topic
        try:
            md = admin.list_topics(topic, timeout=self.timeout_s)
            fut = admin.describe_configs([ConfigResource(ResourceType.TOPIC, topic)],
                                         request_timeout=self.timeout_s)
            configs = next(iter(fut.values())).result()
        except KafkaException as exc:
            err = exc.args[0]
            if err.code() in _UNSUPPORTED_ADMIN:
                return  # e.g. the development broker: nothing to check against
            raise self._error(err, "describe", f"topic {topic!r}") from exc
        wrong: list[str] = []
        tmd = md.topics.get(topic)
        if tmd is not None and tmd.error is None and len(tmd.partitions) != 1:
            wrong.append(f"{len(tmd.partitions)} partitions (needs 1)")
        for key, want in self.PROGRESS_CONFIG.items():
            entry = configs.get(key)
            have = None if entry is None else entry.value
            if key == "cleanup.policy":
                if have is not None and "compact" in have:
                    wrong.append(f"cleanup.policy={have} (compaction drops progress records)")
            elif have is not None and have != want:
                wrong.append(f"{key}={have}")
        if wrong:
            raise SinkError(
                f"output {self.name!r}: progress topic {topic!r} could lose the output's "
                f"state: {', '.join(wrong)}",
                hint=f"set retention.ms=-1, retention.bytes=-1, cleanup.policy=delete on "
                     f"{topic!r} (kafka-configs.sh --alter --entity-type topics --entity-name "
                     f"{topic} --add-config retention.ms=-1,retention.bytes=-1), or delete it "
                     "and let reclock create it with one partition, if it holds no progress "
                     "yet; or name another progress_topic")

    def _user_schema(self, head: ProgressRecord | None) -> pa.Schema | None:
        if self._user is not None:
            return self._user
        return head.user_schema() if head is not None else None

    def stager(self) -> KafkaStager:
        user = self._user_schema(self._catch_up() if self._user is None else None)
        if user is None:
            raise SinkError(f"output {self.name!r}: schema unknown", hint="call ensure() first")
        limit = self._properties.get("message.max.bytes", DEFAULT_MAX_RECORD_BYTES)
        try:
            max_bytes = int(limit)
        except (TypeError, ValueError):
            raise SinkError(f"output {self.name!r}: message.max.bytes must be a number of "
                            "bytes") from None
        return KafkaStager(self.name, str(self.staging_root), output_schema(user),
                           self.key_columns, max_bytes, self._envelope())

    # -- state -----------------------------------------------------------------------------
    def state(self) -> SinkState:
        """The head of the progress chain; ``SinkState()`` if nothing was committed."""
        head = self._catch_up()
        self._check_owner(head)
        return self._held(head)

    def _held(self, head: ProgressRecord | None) -> SinkState:
        """The state the chain's ``head`` says, if it counts the records of
        the data topic there now: a head committed to a data topic deleted
        since (maybe made again: another topic id) holds nothing, its records
        being gone; the driver compares that with what it committed."""
        if head is None:
            return SinkState()
        if head.topic_id is None or self._data_id is None or head.topic_id == self._data_id:
            return head.state  # (a head from before topic ids: adopted with the topic)
        log.warning("output %r: topic %r was deleted (now topic id %s, was %s) since its last "
                    "commit (upper %s): the records its state counted are gone", self.name,
                    self.topic, self._data_id, head.topic_id, head.state.upper)
        return SinkState()

    def _check_owner(self, head: ProgressRecord | None) -> None:
        """:class:`~reclock.contracts.sink.OutputOwned` when another pipeline committed
        the head of the chain."""
        if self.owner is not None and head is not None:
            self.owner.check(self.name, f"topic {self.topic!r}", head.pipeline,
                             head.pipeline_state)

    def _catch_up(self) -> ProgressRecord | None:
        """Read the progress records appended since the last call; the chain's head."""
        lo, hi = self._watermarks(self.progress_topic, 0)
        ch = self._chain
        if ch is not None and ch.next > hi:
            now = self._progress_topic_id()
            if now != self._progress_id:
                # Deleted (and maybe re-created): the state read from it is
                # gone. Fenced: the driver reads the output's state afresh
                # (ensure makes the topic again), and compares it with what it
                # knows was committed.
                self._chain = None
                self._progress_id = now
                raise SinkFenced(
                    f"output {self.name!r}: progress topic {self.progress_topic!r} was deleted"
                    + ("" if now is None else " and re-created")
                    + f" (its end is offset {hi}, offsets up to {ch.next} were read from it)",
                    hint="the output's state is read again")
            # Never trust a shorter log than we have read: after a leader
            # change the new leader's end can lag for a moment.
            raise TransientError(
                f"output {self.name!r}: progress topic {self.progress_topic!r} ends at offset "
                f"{hi}, but offsets up to {ch.next} were read from it before",
                hint="retried: a new partition leader may lag for a moment",
            )
        if ch is None:
            self._progress_id = self._progress_topic_id()
        if ch is None or ch.next < lo:
            # New sink object, or retention removed records we had not read.
            ch = self._chain = self._load_chain(lo, hi)
        elif ch.next < hi:
            ch.extend(self._read_progress(ch.next, hi), hi)
        return ch.head

    def _progress_topic_id(self) -> str | None:
        """The progress topic's Kafka topic id (None: it does not exist), to
        tell a topic deleted or re-created from a partition leader that lags."""
        return self._topic_id(self.progress_topic)

    def _topic_id(self, topic: str) -> str | None:
        """``topic``'s Kafka topic id (None: it does not exist)."""
        from confluent_kafka import TopicCollection

        admin = self._admin()  # (held until the answer: a dropped client cancels it)
        try:
            fut = admin.describe_topics(TopicCollection([topic]),
                                        request_timeout=self.timeout_s)[topic]
            return str(fut.result(timeout=self.timeout_s + 5).topic_id)
        except KafkaException as exc:
            if exc.args and getattr(exc.args[0], "code", lambda: None)() in _MISSING_TOPIC_CODES:
                return None
            raise self._error(exc.args[0], "describe", topic, transient=True) from exc
        except concurrent.futures.TimeoutError as exc:
            raise TransientError(f"output {self.name!r}: describing topic {topic!r} timed "
                                 "out", hint="is the Kafka broker reachable? reclock retries"
                                 ) from exc

    def _load_chain(self, lo: int, hi: int) -> _Chain:
        """The chain from the end of the progress partition, read back in widening windows."""
        span = PROGRESS_WINDOW
        while True:
            start = max(lo, hi - span)
            records = self._read_progress(start, hi)
            valid = resolve_chain(records, complete=start == lo)
            if valid is not None:
                break
            span *= 8
        if not valid and lo > 0:
            log.warning("output %r: progress topic %r starts at offset %d and holds no record of "
                        "this output; if it was ever committed, its state has expired",
                        self.name, self.progress_topic, lo)
        ch = _Chain(valid[-1] if valid else None, hi)
        ch.recent.extend(r.batch for r in valid)
        ch.seen.extend(r.batch for r in records)
        return ch

    def _read_progress(self, start: int, end: int) -> list[ProgressRecord]:
        out = []
        for msg in self._scan(self.progress_topic, {0: (start, end)}):
            if msg.key() == self._key:
                out.append(parse_progress(self.name, self.progress_topic, msg.offset(),
                                          msg.value()))
        return out

    # -- commit ------------------------------------------------------------------------------
    def commit(self, staged: list[dict[str, Any]], expected: SinkState, new: SinkState) -> None:
        """Make ``staged`` visible and move the state ``expected -> new``.

        1. Check the request: ``new`` does not go backwards; every descriptor
           names a staged file that is still there with its staged size.
        2. Unless the chain's head was committed by another pipeline
           (:class:`~reclock.contracts.sink.OutputOwned`, before anything else), the
           transactional producer (``init_transactions`` on first use:
           on Kafka this fences older producers with our transactional.id).
        3. Fence: read the chain's head; unless its state is ``expected``,
           :class:`SinkFenced` and nothing is written.
        4. begin_transaction; produce every staged record with headers
           ``reclock.batch`` (a fresh id) and ``reclock.output``; flush, and
           check every record was acknowledged.
        5. Produce the progress record (``prev`` = the head's batch) to
           partition 0 of the progress topic; flush.
        6. commit_transaction.
        7. Read the chain back: our batch must be on it, else :class:`SinkFenced`
           (a concurrent writer won; our records are ignored by reclock).
        8. Delete the staged files.

        A failure in 4.-6. aborts the transaction (best effort) and discards
        the producer. Then, if the progress record may have reached the log,
        the chain is consulted: a batch on it is committed (see the module
        docstring) and ``commit`` returns normally. Otherwise the error is
        raised: :class:`TransientError` when the broker may recover,
        :class:`SinkError` when it will not (permissions, missing topics,
        oversized records), :class:`SinkFenced` when another producer took
        over the transactional id.
        """
        if not expected.less_equal(new):
            raise ValueError(f"output {self.name!r}: upper would go backwards {expected} -> {new}")
        files = [self._check_descriptor(d) for d in staged]
        # Another pipeline's output: refused before our producer's
        # init_transactions, which would fence the owner's producer when the
        # two share a transactional id (one set in both configurations).
        self._check_owner(self._catch_up())
        producer = self._transactional_producer()
        head = self._catch_up()
        self._check_owner(head)
        actual = self._held(head)
        if actual != expected:
            raise SinkFenced(
                f"output {self.name!r}: durable state on {self.progress_topic!r} is {actual}, "
                f"expected {expected}; nothing was written",
                hint="another pipeline committed this output; re-read its state",
            )
        user = self._user_schema(head)
        schema = None if user is None else _encode_schema(user)
        # upsert and debezium: summed per key and IntoTime before the
        # transaction opens (updates that do not fit a key fail here)
        records = (self._read_staged(files) if self.envelope == "log"
                   else self._consolidated(files, user or pa.schema([])))
        self._step("checked")
        batch = uuid.uuid4().hex
        progress_sent = False
        try:
            try:
                producer.begin_transaction()
                rows, errors = self._produce_staged(producer, records, batch)
                self._step("data_flushed")
                progress_sent = True
                value = _progress_value(self.name, batch, None if head is None else head.batch,
                                        new, rows, errors, schema, self.owner, self._data_id)
                self._produce_flushed(producer, [(self.progress_topic, 0, self._key, value)],
                                      batch, "the progress record")
                self._step("progress_produced")
                producer.commit_transaction(self.timeout_s)
            except KafkaException as exc:
                raise _Failed(self._error(exc.args[0], "commit a transaction to")) from exc
        except _Failed as failed:
            self._abandon_producer()
            if not (progress_sent and self._committed_anyway(batch, failed.error)):
                raise failed.error from failed.__cause__
        except BaseException:
            self._abandon_producer()
            raise
        self._step("committed")
        self._verify_on_chain(batch)
        remove_staged(self.name, files, log)

    def _step(self, step: str, count: int = 0) -> None:
        """Called at each step of :meth:`commit`: ``checked``, ``produced``
        (after each staged record, with the count so far), ``data_flushed``,
        ``progress_produced``, ``committed``. Does nothing; tests override it
        to crash or to take the broker down at a precise point."""

    def _check_descriptor(self, d: dict[str, Any]) -> str:
        name = check_descriptor(self.name, "Kafka", d, _STAGED, {"size": int, "rows": int})
        path = os.path.join(self.staging_root, name)
        check_staged_file(self.name, path, d["size"])
        return path

    def _read_staged(self, files: list[str]) -> Iterator[_Record]:
        """The staged records as they were staged: (dest, key, value)."""
        for path in files:
            table = self._read_file(path)
            yield from zip(table.column("dest").to_pylist(), table.column("key").to_pylist(),
                           table.column("value").to_pylist(), strict=True)

    def _read_file(self, path: str) -> pa.Table:
        try:
            with pa.memory_map(str(path)) as source:
                return pa.ipc.open_file(source).read_all()
        except (OSError, pa.ArrowInvalid) as exc:
            raise SinkError(f"output {self.name!r}: cannot read staged file {path}: {exc}",
                            hint="restage the batch") from exc

    def _consolidated(self, files: list[str], user: pa.Schema) -> list[_Record]:
        """Upsert and Debezium envelopes: the records of the staged updates.

        Per IntoTime, in time order, the updates of each key are summed (equal
        images add up, zeros drop out, as in :mod:`reclock.contracts.consolidate`);
        what remains is at most one image retracted (the key's old row) and one
        inserted (its new row), each once. Upsert: the new row as the key's
        value, or a tombstone (null value) when only the old one is left.
        Debezium: an event ``r`` (a new row a snapshot read: :func:`_op`),
        ``c`` (no old row), ``u`` (both) or ``d`` (no new row, then a
        tombstone); the reads carry ``source.snapshot`` ``"true"``, the
        commit's last one ``"last"`` (a CDC table's snapshot is read in one
        job, so it lands in one commit), every other event ``"false"``, as
        Debezium's snapshots mark theirs. Anything else (a key left with two rows, or a
        row counted twice) is a SinkError naming the key, the IntoTime and the
        positions: the output's upstream key must be part of the sink's key
        (checked when the configuration is loaded). Error rows pass as staged."""
        errors: list[_Record] = []
        # (into, key) -> image -> [count, position]
        groups: dict[tuple[int, bytes], dict[bytes, list[Any]]] = {}
        for path in files:
            t = self._read_file(path)
            cols = {c: t.column(c).to_pylist() for c in t.column_names}
            for i, dest in enumerate(cols["dest"]):
                if dest == _ERRORS:
                    errors.append((dest, cols["key"][i], cols["value"][i]))
                    continue
                images = groups.setdefault((cols["into"][i], cols["key"][i]), {})
                pos = (cols["part"][i], cols["offset"][i], cols["seq"][i], cols["ts"][i])
                slot = images.setdefault(cols["value"][i], [0, pos])
                slot[0] += cols["diff"][i]
                if cols["diff"][i] > 0:
                    slot[1] = pos  # an insertion's position names the change
        out = list(errors)
        env = self._envelope()
        value_codec, key_codec = env.codecs(user)
        events: list[tuple[bytes, dict[str, Any]]] = []  # debezium: (key, event), in order
        for (into, key), images in sorted(groups.items(), key=lambda kv: kv[0][0]):
            live = {v: c for v, c in images.items() if c[0] != 0}
            if not live:
                continue  # the key's row is what it was: nothing to write
            plus = [v for v, c in live.items() if c[0] == 1]
            minus = [v for v, c in live.items() if c[0] == -1]
            if len(plus) + len(minus) != len(live) or len(plus) > 1 or len(minus) > 1:
                where = ", ".join(f"{c[0]:+d} at {c[1][0]}:{c[1][1]}:{c[1][2]}"
                                  for c in live.values())
                raise SinkError(
                    f"output {self.name!r}: the updates of key "
                    f"{_show_key(key_codec, key, self.topic)} at IntoTime {into} do not leave "
                    f"it one row ({where}); nothing was written",
                    hint="the sink's key must contain the output's upstream key (the "
                         "envelope's key, or a CDC table's primary key)")
            if self.envelope == "upsert":
                out.append((_DATA, key, plus[0] if plus else None))
                continue
            before = json.loads(minus[0]) if minus else None
            after = json.loads(plus[0]) if plus else None
            pos = live[plus[0] if plus else minus[0]][1]
            events.append((key, _event(before, after, _op(before, after, pos), into, env, pos)))
        reads = [doc for _, doc in events if doc["op"] == "r"]
        for doc in reads:
            doc["source"]["snapshot"] = "true"
        if reads:
            reads[-1]["source"]["snapshot"] = "last"
        for key, doc in events:
            op = doc["op"]
            try:
                value = value_codec.encode(doc, self.topic)
            except _value_errors() as exc:
                if _registry_failure(exc):
                    raise _registry_error(self.name, self.value_subject, exc) from exc
                out.append((_ERRORS, key, self._event_error(doc, _refusal(exc))))
                continue
            if len(value) + len(key) > self._max_record_bytes() - RECORD_OVERHEAD_BYTES:
                why = (f"the record is larger than the producer's message.max.bytes "
                       f"({self._max_record_bytes():,} bytes, headers included)")
                out.append((_ERRORS, key, self._event_error(doc, why)))
                continue
            out.append((_DATA, key, value))
            if op == "d":
                out.append((_DATA, key, None))  # Debezium's tombstones.on.delete
        return out

    def _event_error(self, doc: dict[str, Any], why: str) -> bytes:
        """An error record for a Debezium event that cannot be written: the
        row's position and IntoTime, the reason, what it held (cut)."""
        src = doc["source"]
        raw = _dumps({"before": doc["before"], "after": doc["after"]})
        limit = min(REFUSED_RAW_MAX, self._max_record_bytes() // 4)
        return _dumps({INTO_TIME: src["into_time"], DIFF: 1, SRC_PART: src["src_part"],
                       SRC_OFFSET: src["src_offset"], SRC_SEQ: src["src_seq"],
                       SRC_TS: src["ts_ms"], ERROR: why, RAW_KEY: None,
                       RAW_VALUE: base64.b64encode(raw[:limit]).decode("ascii")})

    def _max_record_bytes(self) -> int:
        try:
            return int(self._properties.get("message.max.bytes", DEFAULT_MAX_RECORD_BYTES))
        except (TypeError, ValueError):
            return DEFAULT_MAX_RECORD_BYTES

    def _produce_staged(self, producer: Any,
                        records: Iterable[_Record],
                        batch: str) -> tuple[int, int]:
        """Produce every record; flush; return (data records, error records)."""
        failures: list[Any] = []

        def delivered(err: Any, msg: Any) -> None:
            if err is not None:
                failures.append(err)

        headers = [(HEADER_BATCH, batch.encode()), (HEADER_OUTPUT, self._key)]
        counts = [0, 0]
        for produced, (dest, key, value) in enumerate(records, start=1):
            topic = self.errors_topic if dest == _ERRORS else self.topic
            self._produce(producer, topic, None, key, value, headers, delivered)
            counts[dest] += 1
            self._step("produced", produced)
            if failures:
                break  # the transaction is lost anyway; stop adding to it
        self._flush(producer, failures, "data records")
        return counts[_DATA], counts[_ERRORS]

    def _produce_flushed(
        self, producer: Any, records: list[tuple[str, int, bytes, bytes]], batch: str, what: str
    ) -> None:
        failures: list[Any] = []

        def delivered(err: Any, msg: Any) -> None:
            if err is not None:
                failures.append(err)

        headers = [(HEADER_BATCH, batch.encode()), (HEADER_OUTPUT, self._key)]
        for topic, partition, key, value in records:
            self._produce(producer, topic, partition, key, value, headers, delivered)
        self._flush(producer, failures, what)

    def _produce(
        self, producer: Any, topic: str, partition: int | None, key: bytes | None,
        value: bytes | None, headers: list[tuple[str, bytes]],
        on_delivery: Callable[[Any, Any], None],
    ) -> None:
        kwargs: dict[str, Any] = {"key": key, "headers": headers, "on_delivery": on_delivery}
        if partition is not None:
            kwargs["partition"] = partition
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                producer.produce(topic, value, **kwargs)
                break
            except BufferError:  # local queue full: let deliveries drain it
                if time.monotonic() > deadline:
                    raise _Failed(TransientError(
                        f"output {self.name!r}: producer queue full for {self.timeout_s:g} s "
                        f"writing to {topic!r}",
                        hint="the brokers are slow or unreachable",
                    )) from None
                producer.poll(0.05)
        producer.poll(0)

    def _flush(self, producer: Any, failures: list[Any], what: str) -> None:
        remaining = producer.flush(self.timeout_s)
        if failures:
            raise _Failed(self._error(failures[0], f"deliver {what} to"))
        if remaining:
            raise _Failed(TransientError(
                f"output {self.name!r}: {remaining} {what} not acknowledged within "
                f"{self.timeout_s:g} s by {self.bootstrap_servers}",
                hint="the brokers are slow or unreachable; the commit will be retried",
            ))

    def _committed_anyway(self, batch: str, error: ReclockError) -> bool:
        """After a failed commit whose progress record was produced: is the
        batch on the chain? On Kafka, when the commit went through although
        the call failed (a timeout); on a broker that shows aborted
        transactions (the mock), also when it was aborted. See the module
        docstring."""
        try:
            self._catch_up()
        except ReclockError as exc:
            log.info("output %r: cannot tell whether batch %s committed: %s", self.name, batch, exc)
            return False
        if self._chain is not None and batch in self._chain.recent:
            log.warning(
                "output %r: committing batch %s failed (%s), but its progress record is "
                "readable and on the chain: it counts as committed", self.name, batch, error,
            )
            return True
        return False

    def _verify_on_chain(self, batch: str) -> None:
        """Step 7: read back until our progress record is readable; it must be valid."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._catch_up()
            ch = self._chain
            if ch is not None and batch in ch.recent:
                return
            if ch is not None and batch in ch.seen:
                raise SinkFenced(
                    f"output {self.name!r}: batch {batch} was committed to Kafka, but another "
                    f"writer's commit from the same state came first on "
                    f"{self.progress_topic!r}; reclock ignores this batch's records",
                    hint="two pipelines write this output; stop one of them",
                )
            if time.monotonic() > deadline:
                # commit_transaction succeeded, so it is committed; the record
                # is not readable yet (markers still being written): the next
                # state() shows it.
                log.warning("output %r: batch %s committed but not readable after %g s",
                            self.name, batch, self.timeout_s)
                return
            time.sleep(0.02)

    # -- reading ---------------------------------------------------------------------------
    def read_updates(self, as_of: int | None = None) -> pa.Table:
        """Committed rows (data and error records of committed batches) with
        ``_into_time <= as_of`` (all if ``None``), as :func:`output_schema`.

        Reads the whole progress partition to learn the committed batches, then
        the data and errors topics from their beginning to their end. Without
        :meth:`ensure`, the user schema is the one the last commit recorded.
        A :class:`SinkError` when a committed batch's records are not all there
        (the topic was thinned by retention, compaction or delete-records).

        Envelopes upsert and debezium keep the current rows, not the update
        log (as a Postgres ``mode: state`` table): the records are folded by
        key (a tombstone or a ``d`` event removes the key), and each key's
        current row is returned once, whatever ``as_of`` is, with ``_diff`` 1,
        ``_into_time`` the IntoTime it last changed at and provenance zero;
        the error rows up to ``as_of`` follow. A compacted data topic is fine
        for them: compaction keeps every key's last record.
        """
        lo, hi = self._watermarks(self.progress_topic, 0)
        valid = resolve_chain(self._read_progress(lo, hi), complete=True) or []
        if lo > 0:
            log.warning("output %r: progress topic %r starts at offset %d (retention): records "
                        "of batches committed before it cannot be verified and are left out",
                        self.name, self.progress_topic, lo)
        user = self._user_schema(valid[-1] if valid else None)
        schema = output_schema(user) if user is not None else pa.schema(META_FIELDS)
        if not valid:
            return schema.empty_table()
        committed = {r.batch: r for r in valid}
        tables = []
        user_schema = pa.schema([f for f in schema if f.name not in META_NAMES])
        value_codec, _ = self._envelope().codecs(user_schema)
        for topic, what in ((self.topic, "records"), (self.errors_topic, "errors")):
            docs: list[dict[str, Any]] = []
            seen: dict[str, int] = {}
            state: dict[bytes | None, dict[str, Any]] = {}  # upsert, debezium: key -> row
            keyed = what == "records" and self.envelope != "log"
            for msg in self._scan_topic(topic):
                batch = _header(msg, HEADER_BATCH)
                if batch is None or batch not in committed:
                    continue
                seen[batch] = seen.get(batch, 0) + 1
                where = f"{topic}[{msg.partition()}]@{msg.offset()}"
                if keyed:
                    self._fold(state, msg.key(), msg.value(), value_codec, where)
                    continue
                docs.append(self._decode(value_codec if what == "records" else None,
                                         msg.value(), where))
            if keyed:
                # the current rows (each once, where the key last changed)
                docs = [{**row, DIFF: 1, SRC_PART: 0, SRC_OFFSET: 0, SRC_SEQ: 0}
                        for row in state.values()]
            short = [(r, seen.get(r.batch, 0), r.records if what == "records" else r.errors)
                     for r in valid]
            short = [x for x in short if x[1] != x[2]]
            if keyed:
                short = []  # a compacted topic keeps each key's last record: enough
            if short:
                # A committed batch whose records are not all there: the topic
                # was thinned behind the sink's back (time or size retention,
                # compaction, delete-records). The update log is incomplete;
                # rebuilding a key state from it, or auditing it, would be wrong.
                r, got, want = short[0]
                raise SinkError(
                    f"output {self.name!r}: topic {topic!r} holds {got} of the {want} {what} "
                    f"that committed batch {r.batch} wrote ({len(short)} batches differ): "
                    "records were removed behind reclock's back (retention, compaction or "
                    "delete-records), so the output's update log is incomplete",
                    hint=f"keep the whole log: kafka-configs.sh --alter --entity-type topics "
                         f"--entity-name {topic} --add-config retention.ms=-1,"
                         "retention.bytes=-1,cleanup.policy=delete; to start the output over, "
                         "delete its data, errors and progress topics")
            if docs:
                tables.append(decode_rows(self.name, docs, schema, repr(topic)))
        if not tables:
            return schema.empty_table()
        table = pa.concat_tables(tables)
        if as_of is not None:
            keep = pc.less_equal(table.column(INTO_TIME), as_of)
            if self.holds_state:  # the current rows whatever as_of is; errors up to it
                keep = pc.or_(keep, pc.is_null(table.column(ERROR)))
            table = table.filter(keep)
        return table

    def _decode(self, codec: Codec | None, value: bytes | None, where: str) -> dict[str, Any]:
        """A record's plain document (``codec`` None: an error record, JSON)."""
        try:
            if value is None:
                raise ValueError("a record without value")
            return (codec or Codec("json", pa.schema([]))).decode(value, self.topic)
        except Exception as exc:
            if _registry_failure(exc):
                raise _registry_error(self.name, self.value_subject, exc) from exc
            raise SinkError(f"output {self.name!r}: record {where} does not decode as "
                            f"{self.format if codec else 'json'}: {exc}") from exc

    def _fold(self, state: dict[bytes | None, dict[str, Any]], key: bytes | None,
              value: bytes | None, codec: Codec, where: str) -> None:
        """Apply one upsert or Debezium record to ``state`` (key -> current row)."""
        if value is None:  # a tombstone
            state.pop(key, None)
            return
        doc = self._decode(codec, value, where)
        if self.envelope == "upsert":
            state[key] = doc
            return
        after = doc.get("after")
        if doc.get("op") == "d" or after is None:
            state.pop(key, None)
        else:
            state[key] = {**after, INTO_TIME: doc.get("ts_ms")}

    def _scan_topic(self, topic: str) -> list[Any]:
        """Every readable record of ``topic``, all partitions; [] if it does not exist."""
        consumer = self._reader()
        try:
            md = consumer.list_topics(topic, timeout=self.timeout_s)
        except KafkaException as exc:
            raise self._error(exc.args[0], "list partitions of", topic) from exc
        tmd = md.topics.get(topic)
        if tmd is None or (tmd.error is not None and tmd.error.code() in _MISSING_TOPIC_CODES):
            return []
        if tmd.error is not None:
            raise self._error(tmd.error, "list partitions of", topic)
        ranges = {p: self._watermarks(topic, p) for p in sorted(tmd.partitions)}
        return self._scan(topic, ranges)

    # -- Kafka plumbing -----------------------------------------------------------------------
    def _client_conf(self, producer: bool) -> dict[str, Any]:
        conf: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap_servers,
            "client.id": f"reclock-{self.name}",
            "logger": client_log,
        }
        if producer:
            conf["linger.ms"] = 5
            if self.envelope != "log":
                # a key's partition as Java producers (Kafka Streams, Connect)
                # choose it, so that topics keyed alike are co-partitioned
                conf["partitioner"] = "murmur2_random"
            conf.update(self._properties)
            conf["transactional.id"] = self.transactional_id
            conf["enable.idempotence"] = True
            # A topic deleted behind the sink's back must not come back by
            # itself with the cluster's defaults when the producer asks for
            # it (brokers auto-create by default): a progress topic so made
            # has the wrong shape, and a data topic the wrong partitions.
            # The sink creates its topics (ensure) and notices them gone.
            conf["allow.auto.create.topics"] = False
        else:
            # The reader stops at the end of a partition: no point in the
            # broker holding an empty fetch open for long.
            conf["fetch.wait.max.ms"] = 10
            conf.update({k: v for k, v in self._properties.items() if k not in _PRODUCER_ONLY})
            conf.update({
                "group.id": f"reclock-{self.name}-reader",  # never joined nor committed
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "enable.partition.eof": True,
                "auto.offset.reset": "earliest",
            })
        return conf

    def _transactional_producer(self) -> Any:
        if self._producer is not None:
            return self._producer
        try:
            producer = Producer(self._client_conf(producer=True))
        except (KafkaException, ValueError, TypeError) as exc:
            # confluent-kafka's messages name the property, never its value.
            raise SinkError(f"output {self.name!r}: invalid Kafka producer settings: "
                            f"{self._redact(_config_reason(exc))}") from None
        try:
            producer.init_transactions(self.timeout_s)
        except KafkaException as exc:
            with _quiet():
                producer.purge()
            raise self._error(exc.args[0], "initialize transactions on") from exc
        self._producer = producer
        return producer

    def _abandon_producer(self) -> None:
        """Abort the open transaction if the broker lets us, and drop the
        producer: the next commit starts from a fresh one (on Kafka its
        init_transactions aborts whatever this one left open)."""
        producer, self._producer = self._producer, None
        if producer is None:
            return
        with _quiet():
            producer.abort_transaction(min(self.timeout_s, 5.0))
        with _quiet():
            producer.purge()
            producer.flush(0)

    def _reader(self) -> Any:
        if self._consumer is None:
            try:
                self._consumer = Consumer(self._client_conf(producer=False))
            except (KafkaException, ValueError, TypeError) as exc:
                raise SinkError(f"output {self.name!r}: invalid Kafka consumer settings: "
                                f"{self._redact(_config_reason(exc))}") from None
        return self._consumer

    def _watermarks(self, topic: str, partition: int) -> tuple[int, int]:
        """(log start, end readable with read_committed); (0, 0) for a missing topic."""
        tp = TopicPartition(topic, partition)
        deadline = time.monotonic() + self.timeout_s
        attempt = 0
        while True:
            attempt += 1
            try:
                lo, hi = self._reader().get_watermark_offsets(tp, timeout=self.timeout_s,
                                                              cached=False)
                return int(lo), int(hi)
            except KafkaException as exc:
                err = exc.args[0]
                if err.code() in _LEADER_MOVING_CODES and time.monotonic() < deadline:
                    # A topic just created, or a leader that just moved: the
                    # client refreshes its metadata on this error; ask again.
                    time.sleep(0.1)
                    continue
                if err.code() not in _MISSING_TOPIC_CODES:
                    raise self._error(err, "read offsets of", f"{topic}[{partition}]") from exc
                # librdkafka also says "unknown partition" when it has no
                # metadata yet (brokers down, or just back): only the brokers
                # can say that a topic is missing. Asking them refreshes the
                # metadata, so a topic that exists is worth one more try.
                exists = self._topic_exists(topic)
                if exists is False:
                    return 0, 0
                if exists is None or attempt >= 2:
                    raise self._error(err, "read offsets of", f"{topic}[{partition}]",
                                      transient=True) from exc

    def _topic_exists(self, topic: str) -> bool | None:
        """Whether the brokers know ``topic``; ``None`` if they cannot be asked."""
        try:
            md = self._reader().list_topics(topic, timeout=self.timeout_s)
        except KafkaException:
            return None
        tmd = md.topics.get(topic)
        if tmd is None:
            return None
        if tmd.error is None:
            return True
        return False if tmd.error.code() in _MISSING_TOPIC_CODES else None

    def _scan(self, topic: str, ranges: dict[int, tuple[int, int]]) -> list[Any]:
        """Records of ``topic`` in ``[start, end)`` for each ``partition: (start, end)``.

        Reads until every partition reached its end (an end-of-partition event
        or a record at or past it: the last offsets may be transaction
        markers, which the consumer skips). Fails with TransientError after
        ``timeout_s`` without progress.
        """
        todo = {p: r for p, r in ranges.items() if r[0] < r[1]}
        if not todo:
            return []
        consumer = self._reader()
        out: list[Any] = []
        try:
            consumer.assign([TopicPartition(topic, p, start) for p, (start, _) in todo.items()])
            deadline = time.monotonic() + self.timeout_s
            while todo:
                # poll() returns at the first record; consume(.., 0) then takes
                # what is already fetched without waiting for a full batch.
                first = consumer.poll(0.2)
                msgs = [] if first is None else [first, *consumer.consume(1000, 0)]
                if msgs:
                    deadline = time.monotonic() + self.timeout_s
                for msg in msgs:
                    p = msg.partition()
                    err = msg.error()
                    if err is not None:
                        if err.code() == _EOF:
                            if p in todo and msg.offset() >= todo[p][1]:
                                del todo[p]
                            continue
                        raise self._error(err, "read", f"{topic}[{p}]")
                    if p not in todo:
                        continue
                    end = todo[p][1]
                    if msg.offset() < end:
                        out.append(msg)
                    if msg.offset() >= end - 1:
                        del todo[p]
                if todo and time.monotonic() > deadline:
                    where = ", ".join(f"{topic}[{p}] up to {e}" for p, (_, e) in todo.items())
                    raise TransientError(
                        f"output {self.name!r}: no progress reading {where} for "
                        f"{self.timeout_s:g} s from {self.bootstrap_servers}",
                        hint="the brokers are slow or unreachable",
                    )
        except KafkaException as exc:
            raise self._error(exc.args[0], "read", topic) from exc
        finally:
            with _quiet():
                consumer.unassign()
        return out

    def _error(
        self, err: Any, doing: str, where: str | None = None, transient: bool = False
    ) -> ReclockError:
        """A KafkaError as one of reclock's two tiers (see module docstring).
        ``transient``: a missing topic or partition is not definite here."""
        code = err.code() if hasattr(err, "code") else None
        text = self._redact(err.str() if hasattr(err, "str") else str(err))
        name = err.name() if hasattr(err, "name") else "?"
        target = where or f"topic {self.topic!r}"
        msg = f"output {self.name!r}: cannot {doing} {target}: {text} ({name})"
        if code in _SUPERSEDED_CODES:
            return Superseded(
                msg, hint=f"another reclock driver initialised transactional.id "
                          f"{self.transactional_id!r} after this one (the same pipeline, "
                          "started again?); this driver stops writing the output")
        if code in _FENCED_CODES:
            return SinkFenced(msg, hint=f"another producer with transactional.id "
                                        f"{self.transactional_id!r} took over; re-read the state")
        if code in _MISSING_TOPIC_CODES:
            if transient:
                return TransientError(msg + " (no metadata: are the brokers reachable?)",
                                      hint="retried with backoff")
            return SinkError(msg, hint="create the topic (reclock creates none), or let the "
                                       "brokers auto-create topics")
        if code in _DEFINITE_CODES:
            return SinkError(msg, hint="check the topic, the record size and the client's "
                                       "permissions and credentials")
        if hasattr(err, "fatal") and err.fatal():
            return SinkError(msg + " (fatal producer error)",
                             hint="the producer cannot continue; see the broker's logs")
        return TransientError(msg, hint="the brokers are unreachable or busy; retried with backoff")

    # -- maintenance ---------------------------------------------------------------------------
    def vacuum_orphans(self, grace_seconds: float = 6 * 3600.0) -> list[str]:
        """Delete staged files older than ``grace_seconds`` (left by failed
        commits and abandoned jobs); return their names."""
        return vacuum_staged(self.name, self.staging_root, _STAGED, grace_seconds,
                             self._clock.now() / 1000.0)

    def maintain(self, now_ms: int) -> dict[str, int]:
        """Nothing to maintain: a topic's retention is the broker's."""
        return {}

    def close(self) -> None:
        """Flush nothing (every commit is complete or abandoned); release clients."""
        self._abandon_producer()
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            with _quiet():
                consumer.close()


def _header(msg: Any, name: str) -> str | None:
    for k, v in msg.headers() or ():
        if k == name and v is not None:
            return bytes(v).decode("utf-8", "replace")
    return None


def _config_reason(exc: BaseException) -> str:
    err = exc.args[0] if exc.args else exc
    return str(err.str() if hasattr(err, "str") else err)


class _quiet:
    """``with _quiet():`` -- ignore Kafka errors of best-effort clean-up calls."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: Any) -> bool:
        return et is not None and issubclass(et, KafkaException | RuntimeError | BufferError)


# -- configuration ----------------------------------------------------------------


class RegistryConfig(ConfigModel):
    """A Confluent-compatible schema registry (the sink registers its record
    schemas there)."""

    url: str = Field(pattern=r"^https?://")
    """``http(s)://host:port``."""
    username: str | None = None
    """Basic authentication's user (with ``password``)."""
    password: SecretStr | None = None
    """Basic authentication's password (``${REGISTRY_PASSWORD}``); never printed."""
    ca_location: str | None = None
    """A CA certificate file for an https registry."""
    timeout: DurationMs = Field(default=int(DEFAULT_TIMEOUT_S * 1000), gt=0)
    """Bound on one registry request."""

    def registry(self) -> RegistryHandle:
        return RegistryHandle.writer(
            self.url, user=self.username,
            password=None if self.password is None else self.password.get_secret_value(),
            ca_location=self.ca_location, timeout=self.timeout / 1000.0)


class KafkaSinkConfig(SinkConfigBase):
    """A Kafka topic written exactly once: each commit is one Kafka transaction
    holding the rows and the output's progress record (on
    ``<topic>.reclock-progress``). Error rows go to ``<topic>.reclock-errors``.
    reclock creates no topics."""

    type: Literal["kafka"] = "kafka"
    """``kafka``."""
    bootstrap_servers: str = Field(min_length=1)
    """``host:port[,host:port...]``."""
    topic: str = Field(min_length=1, max_length=249, pattern=KAFKA_TOPIC_PATTERN)
    """The data topic."""
    progress_topic: str | None = Field(default=None, pattern=KAFKA_TOPIC_PATTERN)
    """Where commits record the output's progress (default
    ``<topic>.reclock-progress``); must not be compacted away."""
    transactional_id: str | None = None
    """Default ``reclock-<pipeline id>-<source>.<output>``: the pipeline id is
    minted once in the remap store, so two pipelines with equal source and
    output names never fence each other, and every driver of one pipeline
    (a zombie too) uses the same id, so the broker fences the older."""
    key_columns: tuple[str, ...] = ()
    """With ``envelope: log``: columns whose values form the record key
    (default: no key)."""
    format: Literal["json", "avro", "protobuf", "json_schema"] = "json"
    """How records are written: ``json`` (plain JSON, no registry), or
    ``avro``, ``protobuf``, ``json_schema`` in Confluent's wire format with the
    schema registered in ``registry``."""
    registry: RegistryConfig | None = None
    """The schema registry of the ``avro``, ``protobuf`` and ``json_schema`` formats."""
    subject: str | None = Field(default=None, min_length=1)
    """The value schema's subject (default ``<topic>-value``)."""
    key_subject: str | None = Field(default=None, min_length=1)
    """The key schema's subject (default ``<topic>-key``)."""
    envelope: Literal["log", "upsert", "debezium"] = "log"
    """``log``: every update is a record (value: the row, ``_into_time``,
    ``_diff`` and provenance). ``upsert``: the current row per ``key``: a
    changed key's new row as its value, a deleted key a tombstone (null
    value). ``debezium``: per changed key an event ``{before, after, op,
    ts_ms, source}``, a delete followed by a tombstone."""
    key: tuple[str, ...] = ()
    """With ``envelope: upsert`` or ``debezium``: the record key's columns.
    They must contain the output's upstream key
    (:func:`~reclock.contracts.config.state_key_problem`), as a Postgres
    ``mode: state`` table's key."""
    properties: Annotated[dict[str, str | int | float | bool], KAFKA_PROPERTIES] = Field(
        default_factory=dict)
    """Extra librdkafka producer settings; the values of the properties
    librdkafka marks sensitive are never printed."""
    timeout: DurationMs = Field(default=int(DEFAULT_TIMEOUT_S * 1000), gt=0)
    """Bound on one blocking broker call (a flush, a commit, a metadata or
    offset request); past it the output reports a transient stall and the
    commit is retried."""

    TARGET: ClassVar[str] = "topic"

    @classmethod
    def target_of(cls, raw: Mapping[str, Any]) -> tuple[str, ...] | None:
        if not isinstance(raw.get("topic"), str):
            return None
        servers = ",".join(sorted(str(raw.get("bootstrap_servers", "")).split(",")))
        return ("kafka", servers, str(raw["topic"]))

    @classmethod
    def state_key_of(cls, raw: Mapping[str, Any]) -> tuple[str, ...] | None:
        key = raw.get("key")
        if (raw.get("envelope") not in ("upsert", "debezium") or not isinstance(key, Sequence)
                or isinstance(key, str)):
            return None
        return tuple(str(k) for k in key)

    @classmethod
    def check_raw(cls, data: Mapping[str, Any]) -> list[InitErrorDetails]:
        out = []
        env = data.get("envelope")
        if env in ("upsert", "debezium") and not data.get("key"):
            out.append(problem(("key",), f"required with envelope: {env}"))
        if env in ("upsert", "debezium") and data.get("key_columns"):
            out.append(problem(("key_columns",), f"is for envelope: log; envelope {env} keys "
                                                 "its records by key"))
        if data.get("format") in REGISTRY_FORMATS and not data.get("registry"):
            out.append(problem(("registry",), f"required with format: {data.get('format')} "
                                              "(registry: {url: http://host:8081})"))
        return out

    def build(self, ctx: SinkContext) -> KafkaSink:
        return KafkaSink(
            ctx.name, bootstrap_servers=self.bootstrap_servers, topic=self.topic,
            staging_dir=ctx.state_dir / "staging", progress_topic=self.progress_topic,
            transactional_id=self.transactional_id or f"reclock-{ctx.identity}-{ctx.name}",
            key_columns=self.key_columns, properties=dict(self.properties),
            timeout_s=self.timeout / 1000.0, owner=ctx.owner, format=self.format,
            envelope=self.envelope, key=self.key,
            registry=None if self.registry is None else self.registry.registry(),
            subject=self.subject, key_subject=self.key_subject)


PLUGIN = SinkPlugin(name="kafka", config=KafkaSinkConfig)
