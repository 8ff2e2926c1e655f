"""Kafka source: FromTime is the partitioned offset.

Driver side (:class:`KafkaSource`)::

    probe()        metadata refreshed every tick (new partitions show up within
                   one interval) + last stable offsets (read_committed) of every
                   partition that has a leader -> kafka frontier
    plan(lo, hi)   one task per partition range, split when large; ranges that
                   retention already removed are a definite error (checked
                   against earliest offsets read every 30 s; the reader's
                   out-of-range error catches what a stale reading misses)
    acknowledge(f) commit f's offsets to the consumer group (monitoring and
                   retention only; reclock never resumes from them)

Executor side (:class:`KafkaReader`): a task assigns its partition at the
range's first offset and reads until the consumer's position reaches the
range's end, with ``isolation.level=read_committed``; exactly the records in
``[start, end)``, on every retry (offsets are immutable; transaction markers
and aborted records leave gaps that every retry skips the same way).
Consumers are cached per worker process and reused across tasks.

The reader runs below Python when it can: ``reclock.sources._kafka_native`` (a C
extension built at install, optional) consumes through the same librdkafka
and appends each record's offset, timestamp, key and value straight into
Arrow buffers, instead of a Python ``Message`` per record and lists of its
fields. Both readers obey the same range rules and raise the same errors;
without a C compiler at install time the pure-Python one is used.

The frontier holds one point per partition known so far, plus "every higher
partition from offset 0": a partition that appears later is covered from its
first record. A partition that temporarily has no leader keeps its last
known offset. Frontiers never go backwards: offsets below the last bound ones
mean the topic was deleted and recreated, a definite error.

Several topics (``topics`` or ``topic_pattern``): the FromTime is
partitioned by (topic, partition), which needs "every partition above the
known ones" per topic and "every topic not known yet" (docs/design.md,
"FromTime and IntoTime"). Here each (topic, partition) gets a dense id from
the remap store the first time it is seen (durable before a binding names
it, never reused), and the frontier is the one-topic frontier over ids: a
point per id, and "every id from N on, at offset 0". A topic or partition
seen later always gets an id from N on, so that one element stands for both
of those, and bindings, reclocking and planning work on ids as on
partitions. Tasks read ranges of several topics at once; rows carry the
id in ``_src_part`` and the topic and partition in ``_topic`` and
``_partition``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, ClassVar, Literal, cast

import numpy as np
import pyarrow as pa
from confluent_kafka import (
    Consumer,
    ConsumerGroupTopicPartitions,
    IsolationLevel,
    KafkaError,
    KafkaException,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._listoffsets import OffsetSpec
from pydantic import Field
from pydantic_core import InitErrorDetails

from reclock.contracts.config import (
    KAFKA_TOPIC_PATTERN,
    ConfigModel,
    DurationMs,
    Name,
    problem,
)
from reclock.contracts.source import (
    ConnectorConfig,
    OutputSpec,
    ReadTask,
    SourceBase,
    SourceContext,
    SourcePlugin,
)
from reclock.core.clock import Clock
from reclock.core.columns import SRC_OFFSET, SRC_PART, SRC_SEQ, SRC_TS
from reclock.core.errors import DefiniteError, FrontierRegression, TransientError
from reclock.core.frontier import Antichain, kafka_frontier
from reclock.core.secrets import KAFKA_PROPERTIES, redact_kafka_properties
from reclock.core.time import Partitioned, kafka_offsets
from reclock.sources.kafka_identity import TopicIdentities, TopicRecord, recreated

BATCH = 50_000
#: plan() checks ranges against earliest offsets read at most this often
EARLIEST_EVERY_S = 30.0
BATCH_BYTES = 256 << 20  # a native batch's keys and values (its offsets are 32-bit)

log = logging.getLogger(__name__)
_native: Any = None  # reclock.sources._kafka_native once loaded; False if it cannot be


def native_reader() -> Any:
    """The C range reader's module with librdkafka loaded, or None where the
    extension was not built (no compiler at install) or cannot load."""
    global _native
    if _native is None:
        try:
            from reclock.clients.librdkafka import library_path
            from reclock.clients.native import load_extension

            mod = load_extension("reclock.sources", "_kafka_native")
            if mod is None:
                raise ImportError("reclock.sources._kafka_native was not built (no C compiler?)")
            mod.load(library_path())
            _native = mod
        except (ImportError, RuntimeError, OSError) as exc:
            log.warning("the native Kafka reader is unavailable (%s); reading in Python", exc)
            _native = False
    return _native or None


def _conf_str(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def redact_properties(props: dict[str, Any]) -> dict[str, Any]:
    """``props`` for display: the properties librdkafka marks sensitive as
    ``***`` (:data:`reclock.core.secrets.KAFKA_SENSITIVE_PROPERTIES`)."""
    return redact_kafka_properties(props)


def _client_conf(bootstrap: str, properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    # Connection errors surface as health statuses; keep librdkafka from
    # printing every reconnect attempt (override with properties.log_level).
    conf: dict[str, Any] = {"bootstrap.servers": bootstrap, "log_level": 2}
    conf.update({k: v for k, v in properties.items()})
    conf.update(extra)
    return conf


def _spec(name: str, *args: Any) -> Any:
    """An ``OffsetSpec`` (its constructors are untyped)."""
    return getattr(OffsetSpec, name)(*args)


_STALE_METADATA = frozenset({
    KafkaError._UNKNOWN_PARTITION, KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.FENCED_LEADER_EPOCH, KafkaError.UNKNOWN_LEADER_EPOCH,
    KafkaError.LEADER_NOT_AVAILABLE, KafkaError._NOENT,
})


#: Metadata errors of a topic that does not exist (deleted, or never made).
_MISSING_TOPIC = (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC)


def _transient(what: str, exc: BaseException) -> TransientError:
    return TransientError(f"{what}: {exc}", hint="is the Kafka broker reachable? reclock retries")


#: A range as readers take it: (partition id, start, end, topic, Kafka
#: partition); the id is what the rows' ``_src_part`` holds (the Kafka
#: partition itself for a one-topic source).
Range = tuple[int, int, int, str, int]


@dataclass(frozen=True)
class KafkaReader:
    """Executor side: reads one partition range per task."""

    bootstrap: str
    topic: str
    properties: tuple[tuple[str, Any], ...]
    timeout_s: float
    native: bool = True  # the C reader where it is available
    batch: int = BATCH
    headers: bool = False  # a ``headers`` column (HEADERS_TYPE) beside key and value
    #: a multi-topic source: task ranges name their topics (``(id, start, end,
    #: topic, partition)``) and rows get ``_topic`` and ``_partition`` columns
    multi: bool = False
    #: a multi-topic source with an output per topic: each topic's output
    #: index (empty: every record goes to output 0)
    routes: tuple[tuple[str, int], ...] = ()

    def _conf(self) -> dict[str, Any]:
        # A task reads a known range and stops at its end: a short fetch wait
        # keeps the last fetch of a range (and the first of the next, on this
        # cached consumer) from waiting out librdkafka's 500 ms long poll.
        # Users may override both.
        props = {"fetch.wait.max.ms": 10, "fetch.queue.backoff.ms": 10, **dict(self.properties)}
        return _client_conf(
            self.bootstrap, props,
            **{"group.id": "reclock-reader", "enable.auto.commit": False,
               "enable.auto.offset.store": False, "isolation.level": "read_committed",
               "auto.offset.reset": "error", "enable.partition.eof": False,
               "fetch.max.bytes": 52428800})

    def _consumer(self, native: Any) -> tuple[Any, set[str]]:
        """The thread's cached consumer, and the topics whose metadata it has
        (:meth:`_learn_topics`)."""
        # One per thread: a consumer serves one read at a time (a Spark worker
        # reads on one thread; on the driver, sources replaying for a
        # re-snapshot and verify's re-reads each read on their own thread).
        key = (self.bootstrap, self.properties, native is not None, threading.get_ident())
        with _CACHE_LOCK:
            cached = _CONSUMERS.get(key)
            if cached is None:
                if native is None:
                    c = Consumer(self._conf())
                else:
                    try:
                        c = native.Reader({k: _conf_str(v) for k, v in self._conf().items()})
                    except ValueError as exc:
                        raise DefiniteError(f"Kafka consumer configuration: {exc}",
                                            hint="check the source's kafka.properties") from None
                cached = _CONSUMERS[key] = (c, set())
            return cached

    def _learn_topics(self, c: Any, known: set[str], native: bool, topics: set[str]) -> None:
        """Fetch every topic's metadata into the consumer's cache when it is
        about to read a topic it has not met (once per topic and consumer):
        librdkafka fetches a partition of a topic it has no metadata of only
        after its periodic topic scan, about 0.8 s after the assignment on a
        local broker, against milliseconds with the metadata cached (a new
        topic of a ``topic_pattern`` source: bench/README.md,
        "scale_targets.py"). A failure is left to the read,
        which then waits as it would have."""
        if topics <= known:  # (only this thread uses the consumer and its set)
            return
        timeout = max(1, int(min(self.timeout_s, 10.0) * 1000))
        if native:
            failed = c.learn(timeout) is not None
        else:
            try:
                c.list_topics(timeout=timeout / 1000)
                failed = False
            except KafkaException:
                failed = True
        if not failed:
            known |= topics

    def _ranges(self, spec: Any) -> list[Range]:
        """A task's ranges: ``(id, start, end)`` triples read the source's one
        topic at partition ``id``; ranges that name their topic and partition
        (several topics, or a re-created topic's partitions) as they say."""
        if spec and isinstance(spec[0], int):
            spec = (spec,)
        return [(int(r[0]), int(r[1]), int(r[2]), str(r[3]), int(r[4])) if len(r) == 5
                else (int(r[0]), int(r[1]), int(r[2]), self.topic, int(r[0])) for r in spec]

    def read(self, task: ReadTask) -> Iterator[tuple[int, pa.RecordBatch]]:
        ranges = [r for r in self._ranges(task.spec) if r[2] > r[1]]
        if not ranges:
            return
        where = {c: (t, p) for c, _b, _e, t, p in ranges}
        native = native_reader() if self.native else None
        c, known = self._consumer(native)
        self._learn_topics(c, known, native is not None, {t for _c, _b, _e, t, _p in ranges})
        if native is not None:
            err = c.assign(self.topic, ranges, self.headers)
            if err is not None:
                raise _transient(f"assigning {_names(ranges)}",
                                 KafkaException(KafkaError(err[0], err[1])))
            try:
                yield from self._routed(self._read_native(c, ranges, where), where)
            finally:
                c.unassign()
        else:
            c.assign([TopicPartition(t, p, b) for _c, b, _e, t, p in ranges])
            try:
                yield from self._routed(self._read_ranges(c, ranges, where), where)
            finally:
                with contextlib.suppress(KafkaException):
                    c.unassign()

    def _routed(self, batches: Iterator[tuple[int, pa.RecordBatch]],
                where: dict[int, tuple[str, int]]) -> Iterator[tuple[int, pa.RecordBatch]]:
        """A multi-topic source's rows with their ``_topic`` and ``_partition``,
        each to its topic's output."""
        if not self.multi:
            yield from batches
            return
        ids = np.array(sorted(where), dtype=np.int64)
        topics = sorted({t for t, _p in where.values()})
        topic_of = np.array([topics.index(where[int(c)][0]) for c in ids], dtype=np.int32)
        partition_of = np.array([where[int(c)][1] for c in ids], dtype=np.int32)
        names = pa.array(topics, pa.string())
        route = dict(self.routes)
        for _i, batch in batches:
            at = np.searchsorted(ids, batch.column(SRC_PART).to_numpy(zero_copy_only=False))
            tix = topic_of[at]
            batch = batch.append_column(TOPIC, names.take(pa.array(tix))).append_column(
                PARTITION, pa.array(partition_of[at], pa.int32()))
            if not route:
                yield 0, batch
                continue
            for k in np.unique(tix):
                rows = np.flatnonzero(tix == k)
                part = (batch if len(rows) == batch.num_rows
                        else batch.take(pa.array(rows, pa.int64())))
                yield route[topics[int(k)]], part

    def _fail(self, at: tuple[str, int], pos: int, err: KafkaError) -> Exception:
        topic, partition = at
        code = err.code()
        if code in (KafkaError.OFFSET_OUT_OF_RANGE, KafkaError._AUTO_OFFSET_RESET):
            return DefiniteError(
                f"topic {topic!r} partition {partition}: offsets from {pos} "
                "were removed (retention) before they were read",
                hint="raise the topic's retention or re-create the source")
        if code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION,
                    KafkaError._UNKNOWN_TOPIC):
            return DefiniteError(f"topic {topic!r} partition {partition} "
                                 "no longer exists", hint="was the topic deleted?")
        return _transient(f"reading {topic}[{partition}]", KafkaException(err))

    def _idle(self, at: tuple[str, int], pos: int, end: int) -> TransientError:
        return TransientError(
            f"topic {at[0]!r} partition {at[1]}: no records between "
            f"offsets {pos} and {end} after {self.timeout_s:.0f}s",
            hint="the broker may be unavailable; the task is retried")

    def _read_native(self, r: Any, ranges: list[Range], where: dict[int, tuple[str, int]]
                     ) -> Iterator[tuple[int, pa.RecordBatch]]:
        """All of a task's ranges at once: their partitions are assigned
        together, so librdkafka fetches them together."""
        left = [rg[:3] for rg in ranges]
        idle_since = time.monotonic()
        while left:
            # A poll returns when it holds max_messages or after its timeout:
            # ask for no more than the ranges can still deliver, and wait
            # briefly (transaction markers take offsets but deliver nothing).
            want = sum(e - pos for _p, pos, e in left)
            received, err = r.poll(min(10_000, self.batch, want), 50)
            if err is not None:
                code, text, part = err
                at = {p: pos for p, pos, _e in left}
                part = part if part in at else left[0][0]
                raise self._fail(where[part], at[part], KafkaError(code, text))
            if r.pending >= self.batch or r.pending_bytes >= BATCH_BYTES:
                yield 0, _native_batch(r.take(), self.headers)
            if received:
                idle_since = time.monotonic()
            left = r.advance()
            if left and not received and time.monotonic() - idle_since > self.timeout_s:
                c, pos, end = left[0]
                raise self._idle(where[c], pos, end)
        if r.pending:
            yield 0, _native_batch(r.take(), self.headers)

    def _read_ranges(self, c: Consumer, ranges: list[Range], where: dict[int, tuple[str, int]]
                     ) -> Iterator[tuple[int, pa.RecordBatch]]:
        """The Python reader: the same rules as the C one (all of a task's
        partitions assigned together), a ``Message`` per record."""
        pos = {p: b for p, b, _e, _t, _k in ranges}
        end = {p: e for p, _b, e, _t, _k in ranges}
        coord = {tk: p for p, tk in where.items()}
        parts: list[int] = []
        offsets: list[int] = []
        keys: list[bytes | None] = []
        values: list[bytes | None] = []
        stamps: list[int | None] = []
        headers: list[list[tuple[str, bytes | None]]] | None = [] if self.headers else None
        left = list(pos)
        idle_since = time.monotonic()
        while left:
            want = sum(end[p] - pos[p] for p in left)
            msgs = c.consume(num_messages=min(10_000, self.batch, want), timeout=0.05)
            for m in msgs:
                err = m.error()
                p = coord.get((m.topic() or "", m.partition() or 0), -1)
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        continue
                    p = p if p in pos else left[0]
                    raise self._fail(where[p], pos[p], err)
                if p not in pos or pos[p] >= end[p]:
                    continue
                off = m.offset() or 0
                if off >= end[p]:
                    pos[p] = end[p]
                    continue
                if off < pos[p]:
                    continue
                parts.append(p)
                offsets.append(off)
                keys.append(m.key())
                values.append(m.value())
                ts_type, ts = m.timestamp()
                stamps.append(ts if ts_type else None)
                if headers is not None:
                    headers.append(cast("list[tuple[str, bytes | None]]", m.headers() or []))
                pos[p] = off + 1
                if len(offsets) >= self.batch:
                    yield 0, _batch(parts, offsets, keys, values, stamps, headers)
                    parts, offsets, keys, values, stamps = [], [], [], [], []
                    headers = [] if self.headers else None
            if msgs:
                idle_since = time.monotonic()
            left = [p for p in left if pos[p] < end[p]]
            if left:
                # Transaction markers and aborted records are never delivered:
                # the consumer's position tells how far each log was read.
                for tp in c.position([TopicPartition(*where[p]) for p in left]):
                    if tp.offset >= 0:
                        p = coord[(tp.topic, tp.partition)]
                        pos[p] = max(pos[p], min(tp.offset, end[p]))
                left = [p for p in left if pos[p] < end[p]]
                if left and not msgs and time.monotonic() - idle_since > self.timeout_s:
                    raise self._idle(where[left[0]], pos[left[0]], end[left[0]])
        if offsets:
            yield 0, _batch(parts, offsets, keys, values, stamps, headers)


_NAMES = [SRC_PART, SRC_OFFSET, SRC_SEQ, SRC_TS, "key", "value"]
#: A multi-topic source's rows: the record's topic and Kafka partition
#: (``_src_part`` holds the source's partition id, see KafkaSource).
TOPIC = "_topic"
PARTITION = "_partition"
MULTI_FIELDS = [pa.field(TOPIC, pa.string()), pa.field(PARTITION, pa.int32())]
#: A record's headers, in order, duplicates kept; a header's value may be null.
HEADERS = "headers"
HEADERS_TYPE = pa.list_(pa.struct([pa.field("key", pa.string(), nullable=False),
                                   pa.field("value", pa.binary())]))


def _batch(parts: list[int], offsets: list[int], keys: list[bytes | None],
           values: list[bytes | None], stamps: list[int | None],
           headers: list[list[tuple[str, bytes | None]]] | None = None) -> pa.RecordBatch:
    n = len(offsets)
    cols = [pa.array(parts, pa.int32()), pa.array(offsets, pa.int64()),
            pa.array([0] * n, pa.int32()), pa.array(stamps, pa.int64()),
            pa.array(keys, pa.binary()), pa.array(values, pa.binary())]
    if headers is None:
        return pa.RecordBatch.from_arrays(cols, names=_NAMES)
    hdrs = pa.array([[{"key": k, "value": v} for k, v in h] for h in headers], HEADERS_TYPE)
    return pa.RecordBatch.from_arrays([*cols, hdrs], names=[*_NAMES, HEADERS])


def pack_ranges(pieces: list[tuple[int, int, int]], max_task: int
                ) -> list[tuple[tuple[int, int, int], ...]]:
    """Partition ranges packed into as few tasks as ``max_task`` allows, of
    even size: a task reads several partitions (a Spark task costs tens of
    milliseconds however little it reads), and a range larger than a task's
    room is split across consecutive tasks, so a partition appears at most
    once per task. Deterministic: a re-planned job gets the same tasks."""
    total = sum(e - b for _p, b, e in pieces)
    if total <= 0:
        return []
    n = -(-total // max(1, max_task))
    size = -(-total // n)
    tasks: list[tuple[tuple[int, int, int], ...]] = []
    current: list[tuple[int, int, int]] = []
    room = size
    for p, b, e in pieces:
        while b < e:
            take = min(e - b, room)
            current.append((p, b, b + take))
            b += take
            room -= take
            if room == 0:
                tasks.append(tuple(current))
                current, room = [], size
    if current:
        tasks.append(tuple(current))
    return tasks


def task_ranges(spec: Any) -> list[tuple[int, int, int]]:
    """A task's ``(partition id, start, end)`` ranges: its spec is a tuple of
    them (or one such triple), or of a multi-topic source's
    ``(id, start, end, topic, partition)``."""
    if spec and isinstance(spec[0], int):
        return [(int(spec[0]), int(spec[1]), int(spec[2]))]
    return [(int(r[0]), int(r[1]), int(r[2])) for r in spec]


def _spec_topics(spec: Any, topic: str) -> set[str]:
    """The topics a task's spec reads (its one topic's ranges name none)."""
    if spec and isinstance(spec[0], int):
        return {topic}
    return {str(r[3]) if len(r) == 5 else topic for r in spec}


def _names(ranges: list[Range]) -> str:
    topics: dict[str, list[int]] = {}
    for _c, _b, _e, t, p in ranges:
        topics.setdefault(t, []).append(p)
    return ", ".join(f"{t}{ps}" for t, ps in topics.items())


def _native_batch(taken: tuple[Any, ...], headers: bool = False) -> pa.RecordBatch:
    """A RecordBatch over the buffers of ``Reader.take()`` (no copy)."""
    (n, parts, offs, stamps, stamp_valid, stamp_nulls, key_offs, key_data, key_valid,
     key_nulls, value_offs, value_data, value_valid, value_nulls, nh, list_offs, name_offs,
     name_data, hv_offs, hv_data, hv_valid, hv_nulls) = taken

    def col(t: pa.DataType, nulls: int, valid: bytes, *bufs: bytes) -> pa.Array:
        validity = pa.py_buffer(valid) if nulls else None
        return pa.Array.from_buffers(t, n, [validity, *map(pa.py_buffer, bufs)],
                                     null_count=nulls)

    # (from buffers: pa.array() of a numpy array would import pandas in the worker)
    cols = [col(pa.int32(), 0, b"", parts), col(pa.int64(), 0, b"", offs),
            col(pa.int32(), 0, b"", bytes(4 * n)),
            col(pa.int64(), stamp_nulls, stamp_valid, stamps),
            col(pa.binary(), key_nulls, key_valid, key_offs, key_data),
            col(pa.binary(), value_nulls, value_valid, value_offs, value_data)]
    if not headers:
        return pa.RecordBatch.from_arrays(cols, names=_NAMES)
    names = pa.Array.from_buffers(pa.string(), nh, [None, pa.py_buffer(name_offs),
                                                    pa.py_buffer(name_data)])
    names.validate(full=True)  # header keys are UTF-8 strings
    values = pa.Array.from_buffers(
        pa.binary(), nh, [pa.py_buffer(hv_valid) if hv_nulls else None, pa.py_buffer(hv_offs),
                          pa.py_buffer(hv_data)], null_count=hv_nulls)
    pairs = pa.StructArray.from_arrays([names, values], fields=list(HEADERS_TYPE.value_type))
    hdrs = pa.Array.from_buffers(HEADERS_TYPE, n, [None, pa.py_buffer(list_offs)],
                                 children=[pairs])
    return pa.RecordBatch.from_arrays([*cols, hdrs], names=[*_NAMES, HEADERS])


#: (Consumer or native Reader, the topics whose metadata it has) per thread
_CONSUMERS: dict[Any, tuple[Any, set[str]]] = {}
_CACHE_LOCK = threading.Lock()


def _described(admin: AdminClient, topics: Sequence[str], timeout_s: float) -> dict[str, Any]:
    """The descriptions (partitions, leaders, topic id) of those of
    ``topics`` that exist; the first other error raises."""
    futs = admin.describe_topics(TopicCollection(list(topics)), request_timeout=timeout_s)
    found = {}
    for name, fut in futs.items():
        try:
            found[name] = fut.result(timeout=timeout_s + 5)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if not (isinstance(err, KafkaError) and err.code() in _MISSING_TOPIC):
                raise
    return found


@dataclass
class KafkaSource(SourceBase):
    """Driver side of a Kafka topic, or of several (see the module docstring)."""

    name: str
    bootstrap: str
    topic: str  # one topic; "" with topics or pattern
    clock: Clock
    group_id: str | None = None
    start: str = "earliest"
    #: with start "offsets": next offset per partition, or per (topic,
    #: partition) for a multi-topic source
    start_offsets: dict[Any, int] = field(default_factory=dict)
    start_timestamp: int | None = None
    properties: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 10.0
    output_names: list[str] = field(default_factory=list)
    native: bool = True  # tasks read with the C reader where it is built
    commit_offsets: bool = True  # acknowledge by committing to the consumer group
    include_headers: bool = False  # the output gets a headers column
    topics: tuple[str, ...] = ()  # several topics, by name
    pattern: str | None = None  # every topic whose whole name matches
    #: a multi-topic source with an output per topic: topic -> output name
    #: (in the order of ``topics``); None: one output for every topic
    topic_outputs: dict[str, str] | None = None
    #: ``names -> {name: id}``: the store's dense coordinate ids (SourceContext)
    coordinates: Any = None
    #: the source's durable facts (reclock.contracts.source.Facts): its topics' identities
    facts: Any = None

    kind = Partitioned.KIND
    replayable = True
    plan_again = True
    can_resnapshot = True  # by replay, while retention holds the records
    first_task_records: int | None = 4  # a record may be as large as the broker allows

    def __post_init__(self) -> None:
        self.group = self.group_id or f"reclock-{self.name}"
        self._admin: AdminClient | None = None
        self._consumer: Consumer | None = None
        self._initial: Antichain[Partitioned] | None = None
        self._known: dict[int, int] = {}  # last probed offsets: never go backwards
        # earliest offsets retention kept, per partition, read at most every
        # EARLIEST_EVERY_S by plan(): a list of 2,048 partitions' offsets
        # each tick cost as much as the probe's
        self._earliest: dict[int, int] = {}
        self._earliest_at = float("-inf")
        self.multi = bool(self.topics or self.pattern)
        self._regex = re.compile(self.pattern) if self.pattern else None
        # a multi-topic source's partition ids: (topic, partition) <-> id
        self._ids: dict[tuple[str, int], int] = {}
        self._pairs: dict[int, tuple[str, int]] = {}
        self._present: set[str] = set()  # topics in the last metadata
        self._gone: list[str] = []  # listed topics seen before and deleted since
        # Topic identities (sources/kafka_identity.py): the records kept in
        # the facts, the ids the last probe found, and the partition ids of
        # topics' earlier incarnations (several topics; one topic: the ids
        # below the current incarnation's base).
        self.identities = TopicIdentities(self.name, self.facts)
        self._seen_ids: dict[str, str] = {}
        self._retired: set[int] = set()
        self._base = 0
        #: listed topics re-created and not accepted: topic -> its error
        self._replaced: dict[str, DefiniteError] = {}
        if self.multi and self.coordinates is None:
            raise DefiniteError(f"source {self.name!r}: a Kafka source over several topics "
                                "numbers their partitions in the remap store; it has none here")
        if self.topic_outputs is None and len(self.output_names or ["x"]) != 1:
            raise DefiniteError(
                f"source {self.name!r}: a Kafka source has one output, got {self.output_names}",
                hint="several topics can each have an output of their own: set "
                "output_per_topic" if self.multi else None)

    def __repr__(self) -> str:
        what = (f"topic={self.topic!r}" if not self.multi else
                f"topics={list(self.topics)!r}" if self.topics else f"pattern={self.pattern!r}")
        return (f"KafkaSource({self.name!r}, {what}, "
                f"properties={redact_properties(self.properties)})")

    @property
    def described(self) -> str:
        """What the source reads, for messages."""
        if not self.multi:
            return f"topic {self.topic!r}"
        return (f"topics {list(self.topics)!r}" if self.topics
                else f"topics matching {self.pattern!r}")

    # -- clients ----------------------------------------------------------------------
    @property
    def admin(self) -> AdminClient:
        if self._admin is None:
            self._admin = AdminClient(_client_conf(self.bootstrap, self.properties))
        return self._admin

    @property
    def consumer(self) -> Consumer:
        if self._consumer is None:
            self._consumer = Consumer(_client_conf(
                self.bootstrap, self.properties,
                **{"group.id": self.group, "enable.auto.commit": False,
                   "isolation.level": "read_committed", "allow.auto.create.topics": False}))
        return self._consumer

    def outputs(self) -> list[OutputSpec]:
        fields = [pa.field(HEADERS, HEADERS_TYPE)] if self.include_headers else []
        if self.multi:
            fields += MULTI_FIELDS
        extra = pa.schema(fields) if fields else None
        if self.topic_outputs is not None:
            return [OutputSpec(o, extra=extra) for o in self.topic_outputs.values()]
        return [OutputSpec(self.output_names[0] if self.output_names else self.topic,
                           extra=extra)]

    # -- partition ids ------------------------------------------------------------------
    # One topic: a partition's id is the partition. Several: each (topic,
    # partition) gets the next dense id from the remap store the first time it
    # is seen (durably, before a binding names it), so the frontier's "every
    # id from N on, at offset 0" covers every partition of every topic not
    # seen yet, new topics and new partitions of known topics alike.
    def _topic_partition(self, pid: int) -> tuple[str, int]:
        """The topic and Kafka partition of a partition id (of a one-topic
        source: in the incarnation whose ids hold it)."""
        if self.multi:
            return self._pairs.get(pid, ("?", pid))
        rec = self.identities.get(self.topic)
        base = max((b for b in (rec.bases if rec else (0,)) if b <= pid), default=0)
        return self.topic, pid - base

    def _tp(self, pid: int, offset: int | None = None) -> TopicPartition:
        topic, p = self._topic_partition(pid)
        return TopicPartition(topic, p) if offset is None else TopicPartition(topic, p, offset)

    def _pid(self, tp: TopicPartition) -> int:
        return (self._ids[(tp.topic, tp.partition)] if self.multi
                else self._base + int(tp.partition))

    def _where(self, pid: int) -> str:
        topic, p = self._topic_partition(pid)
        old = " (before the topic was re-created)" if self._is_retired(pid) else ""
        return f"topic {topic!r}{old} partition {p}"

    def _is_retired(self, pid: int) -> bool:
        """Whether ``pid`` is a partition of a topic's earlier incarnation."""
        return pid in self._retired if self.multi else pid < self._base

    def _coordinate(self, topic: str, partition: int) -> str:
        """The coordinate name of a partition of ``topic``'s current
        incarnation: ``[topic, p]`` for the first, ``[topic, p, id]`` after."""
        rec = self.identities.get(topic)
        if rec is None or rec.incarnation == 0:
            return json.dumps([topic, partition])
        return json.dumps([topic, partition, rec.current])

    def _learn(self, pairs: Sequence[tuple[str, int]] = ()) -> None:
        """Ids for ``pairs`` of their topics' current incarnations (new ones
        assigned in the store), and every id the store holds (another
        driver may have assigned some); ids of earlier incarnations are
        retired."""
        if pairs and all(pr in self._ids for pr in pairs):
            return
        got = self.coordinates([self._coordinate(t, p) for t, p in pairs])
        for name, pid in got.items():
            t, p, *inc = json.loads(name)
            rec = self.identities.get(t)
            if inc and (rec is None or inc[0] not in rec.ids):
                self.identities.load()  # another driver took up a new incarnation
                rec = self.identities.get(t)
            current = (rec.incarnation == 0 if rec is not None else True) if not inc else (
                rec is not None and inc[0] == rec.current)
            self._pairs[pid] = (t, p)
            if current:
                self._ids[(t, p)] = pid
                self._retired.discard(pid)
            else:
                self._retired.add(pid)
                if self._ids.get((t, p)) == pid:
                    del self._ids[(t, p)]

    def _matches(self, topic: str) -> bool:
        if self._regex is not None:
            return not topic.startswith("__") and self._regex.fullmatch(topic) is not None
        return topic in self.topics

    # -- metadata and offsets -----------------------------------------------------------
    def _describe(self, topics: Sequence[str]) -> dict[str, Any]:
        """The metadata of those of ``topics`` that exist (a Metadata request
        that never creates a topic): partitions with their leaders, and the
        topic id."""
        if not topics:
            return {}
        for attempt in (1, 2):
            try:
                # (the first try briefly: a client stuck on a broker that went
                # away times out, and a new one answers within milliseconds)
                return _described(self.admin, topics,
                                  self.timeout_s if attempt == 2 else min(self.timeout_s, 3.0))
            except (KafkaException, concurrent.futures.TimeoutError) as exc:
                # The admin client waits for the broker it takes for the
                # controller: after that broker went away (a failover, a
                # restart) a new client finds the one that answers now.
                self._admin = None
                if attempt == 2:
                    raise _transient(f"source {self.name!r}: metadata of {self.described}",
                                     exc) from None
        raise AssertionError("unreachable")

    def _identify(self, topic: str, topic_id: str) -> bool:
        """Compare ``topic``'s id with its record (sources/kafka_identity.py):
        a topic seen for the first time is recorded; a new id is a new
        incarnation where the pattern or the user accepted it (True: the
        caller re-maps its partition ids), and otherwise the definite error
        of a re-created topic."""
        rec = self.identities.get(topic)
        if rec is None:
            self.identities.put(topic, TopicRecord((topic_id,)))
            self._seen_ids[topic] = topic_id
            return False
        if topic_id == rec.current:
            self._seen_ids[topic] = topic_id
            return False
        if rec.accept != topic_id:  # accepted meanwhile (`reclock accept-recreated`)?
            self.identities.load()
            rec = self.identities.get(topic) or rec
        if self.pattern is not None:
            base = 0
        elif rec.accept == topic_id:
            base = int(rec.accept_base or 0)
        else:
            raise recreated(self.name, topic, rec.current, topic_id,
                            per_output=self.multi)
        log.warning("source %s: topic %r was re-created (topic id %s -> %s): its records "
                    "are read from its first one", self.name, topic, rec.current, topic_id)
        self.identities.put(topic, rec.advanced(topic_id, base))
        self._seen_ids[topic] = topic_id
        return True

    def _partitions(self) -> tuple[list[int], list[int]]:
        """All partition ids, and those with a leader (readable now)."""
        if self.multi:
            return self._multi_partitions()
        t = self._describe([self.topic]).get(self.topic)
        if t is None or not t.partitions:
            raise DefiniteError(
                f"source {self.name!r}: topic {self.topic!r} does not exist (deleted?)",
                hint="re-create the topic, or drop the source with `reclock drop`")
        self._identify(self.topic, str(t.topic_id))
        rec = self.identities.get(self.topic)
        self._base = rec.bases[-1] if rec is not None else 0
        ids = sorted(self._base + p.id for p in t.partitions)
        return ids, [self._base + p.id for p in t.partitions
                     if p.leader is not None and p.leader.id >= 0]

    def _multi_partitions(self) -> tuple[list[int], list[int]]:
        try:
            md = self.consumer.list_topics(timeout=self.timeout_s)
        except KafkaException as exc:
            raise _transient(f"source {self.name!r}: metadata of {self.described}", exc
                             ) from None
        found = {}
        for name, t in md.topics.items():
            if not self._matches(name) or not t.partitions or (
                    t.error is not None and t.error.code() in _MISSING_TOPIC):
                continue
            if t.error is not None:
                raise _transient(f"source {self.name!r}: topic {name!r}", KafkaException(t.error))
            found[name] = t
        # the topics' ids (a second request: list_topics does not give them)
        described = self._describe(sorted(found))
        found = {n: t for n, t in found.items() if n in described}
        for name in sorted(found):
            try:
                if self._identify(name, str(described[name].topic_id)):
                    for pr in [pr for pr in self._ids if pr[0] == name]:
                        self._retired.add(self._ids.pop(pr))
            except DefiniteError as exc:  # a listed topic re-created: its output's error
                self._replaced[name] = exc
                del found[name]
            else:
                self._replaced.pop(name, None)
        known = {t for t, _p in self._pairs.values()}
        if self.topics:
            # a listed topic never seen is a mistake of the configuration; one
            # seen before and gone now was deleted: an error of its outputs only
            absent = [n for n in self.topics if n not in found and n not in known]
            if absent:
                raise DefiniteError(
                    f"source {self.name!r}: topics {absent} do not exist",
                    hint="create them, or correct the source's topics")
        self._present = set(found)
        self._gone = sorted(known - set(found) - set(self._replaced)) if self.topics else []
        pairs = [(n, p) for n in sorted(found) for p in sorted(found[n].partitions)]
        self._learn(pairs)
        ids = sorted(self._ids[pr] for pr in pairs)
        live = [self._ids[(n, p)] for n, p in pairs if found[n].partitions[p].leader >= 0]
        return ids, sorted(live)

    def output_errors(self) -> dict[int, DefiniteError]:
        """A deleted topic of ``topics``: a definite error of its output (of
        the one output, when they share it); the other topics go on. (A
        pattern's topics come and go: a deleted one just keeps its offsets.)"""
        if not self._gone and not self._replaced:
            return {}
        hint = ("the output holds everything read from it and nothing more can come; "
                "remove the topic from topics (and its output), or re-create it")
        if self.topic_outputs is None:
            # the one output of every topic: the first re-created topic's
            # error (it names the recovery), else the deleted ones'
            if self._replaced:
                return {0: self._replaced[min(self._replaced)]}
            return {0: DefiniteError(f"source {self.name!r}: topics {self._gone} were deleted",
                                     hint=hint)}
        errors: dict[str, DefiniteError] = {
            t: DefiniteError(f"source {self.name!r}: topic {t!r} was deleted", hint=hint)
            for t in self._gone}
        errors.update(self._replaced)
        index = {t: i for i, t in enumerate(self.topic_outputs)}
        return {index[t]: e for t, e in errors.items() if t in index}

    def _id_count(self, ids: Sequence[int]) -> int:
        """How many partition ids the frontier gives a point (every id below)."""
        return max([*ids, *self._known, *self._pairs, -1]) + 1

    def _list_offsets(self, partitions: list[int], spec: Any, allow_missing: bool = False
                      ) -> dict[int, int]:
        """Offsets per partition; -1 (none at that time) only with ``allow_missing``."""
        if not partitions:
            return {}
        req = {self._tp(p): spec for p in partitions}
        for attempt in (1, 2):
            try:
                futs = self.admin.list_offsets(req, isolation_level=IsolationLevel.READ_COMMITTED,
                                               request_timeout=self.timeout_s)
                got = {self._pid(tp): f.result().offset for tp, f in futs.items()}
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if attempt == 1 and isinstance(err, KafkaError) and err.code() in _STALE_METADATA:
                    # The admin client's cached metadata is stale: partitions were
                    # added, or a leader moved or restarted (a new leader epoch).
                    # librdkafka keeps asking with the old epoch, so start afresh.
                    self._admin = None
                    continue
                raise _transient(f"source {self.name!r}: offsets of {self.described}", exc
                                 ) from None
            if not allow_missing and any(o < 0 for o in got.values()):
                # A partition whose leader just went away answers no offset
                # (-1001) without an error; the client's metadata is stale.
                self._admin = None
                if attempt == 1:
                    continue
                raise TransientError(f"source {self.name!r}: the broker gave no offset for "
                                     f"{self.described}: {got}",
                                     hint="a partition leader is moving; reclock retries")
            return got
        raise AssertionError("unreachable")

    def initial_frontier(self) -> Antichain[Partitioned]:
        """The configured start, read once (at construction of the source's
        first binding) and never patched afterwards."""
        if self._initial is None:
            ids, live = self._partitions()
            if self.start == "latest":
                offsets = self._list_offsets(live, _spec('latest'))
            elif self.start == "timestamp":
                assert self.start_timestamp is not None
                found = self._list_offsets(live, _spec('for_timestamp', self.start_timestamp),
                                           allow_missing=True)
                ends = self._list_offsets(live, _spec('latest'))
                offsets = {p: (o if o >= 0 else ends[p]) for p, o in found.items()}
            else:
                offsets = self._list_offsets(live, _spec('earliest'))
                # a reading of the earliest offsets like any other: the
                # first plan need not ask again (verify's re-read plans at once)
                self._earliest.update(offsets)
                self._earliest_at = time.monotonic()
                if self.start == "offsets":
                    if self.multi:
                        self._learn(list(self.start_offsets))
                    offsets.update({self._ids[k] if self.multi else k: o
                                    for k, o in self.start_offsets.items()})
            initial: Antichain[Partitioned] = kafka_frontier(
                offsets, partitions=self._id_count(ids))
            self._initial = initial
        return self._initial

    def retained(self) -> Antichain[Partitioned]:
        """The earliest offsets retention kept, per partition."""
        ids, live = self._partitions()
        kept: Antichain[Partitioned] = kafka_frontier(
            self._list_offsets(live, _spec('earliest')), partitions=self._id_count(ids))
        return kept

    def open(self, resume: Antichain[Partitioned], bound: Antichain[Partitioned],
             held: Sequence[Antichain[Partitioned] | None] = (),
             resnapshot: Sequence[int] = ()) -> None:
        self._known, above = kafka_offsets(bound)
        self.identities.load()  # as durable now (a new incarnation accepted meanwhile?)
        if self.multi:
            self._learn()
            return
        rec = self.identities.get(self.topic)
        if rec is not None and rec.accept is not None:
            # An accepted incarnation's ids start above every id a binding named.
            first = max(above or 0, max(self._known, default=-1) + 1)
            if int(rec.accept_base or 0) < first:
                self.identities.put(self.topic, replace(rec, accept_base=first))
        self._base = rec.bases[-1] if rec is not None else 0

    def probe(self) -> Antichain[Partitioned]:
        ids, live = self._partitions()
        latest = self._list_offsets(live, _spec('latest'))
        for p, o in latest.items():
            prev = self._known.get(p)
            if prev is not None and o < prev:
                raise FrontierRegression(
                    f"source {self.name!r}: {self._where(p)} went back from "
                    f"offset {prev} to {o}",
                    hint="the topic was deleted and re-created; drop and re-create the source")
        for p, o in latest.items():
            self._known[p] = o
        probed: Antichain[Partitioned] = kafka_frontier(self._known,
                                                        partitions=self._id_count(ids))
        return probed

    # -- planning -----------------------------------------------------------------------
    def _earliest_offsets(self, partitions: Mapping[int, Any]) -> dict[int, int]:
        """The earliest offsets of ``partitions`` as last read: again when
        one is new or the reading is :data:`EARLIEST_EVERY_S` old. Retention
        that removed records since is met by the reader instead (its
        consumer's out-of-range error is the same definite error)."""
        now = time.monotonic()
        if now - self._earliest_at >= EARLIEST_EVERY_S or any(
                p not in self._earliest for p in partitions):
            self._earliest.update(self._list_offsets(sorted(partitions), _spec('earliest')))
            self._earliest_at = now
        return self._earliest

    def plan(
        self, lower: Antichain[Partitioned], upper: Antichain[Partitioned], max_task: int,
        max_job: int,
    ) -> tuple[list[ReadTask], Antichain[Partitioned]]:
        lo, lo_above = kafka_offsets(lower)
        hi, _ = kafka_offsets(upper)
        ranges: dict[int, tuple[int, int]] = {}
        for p, end in hi.items():
            begin = lo.get(p, 0 if lo_above is not None and p >= lo_above else end)
            if end > begin:
                if self._unreadable(p):
                    log.warning("source %s: %s: offsets %d..%d were bound but not read before "
                                "the topic was deleted and re-created; they went with it",
                                self.name, self._where(p), begin, end - 1)
                    continue
                ranges[p] = (begin, end)
        if ranges:
            earliest = self._earliest_offsets(ranges)
            for p, (begin, _end) in ranges.items():
                first = earliest.get(p, 0)
                if first > begin:
                    raise DefiniteError(
                        f"source {self.name!r}: {self._where(p)}: offsets "
                        f"{begin}..{first - 1} were removed by retention before they were read",
                        hint="raise the topic's retention (or the pipeline's throughput); "
                        "re-create the source to skip the lost records")
        # The job's share of each partition: chunks of max_task taken round-robin
        # across partitions until the job budget is spent.
        cursor = {p: b for p, (b, _e) in ranges.items()}
        budget = max_job
        progress = True
        while budget > 0 and progress:
            progress = False
            for p in sorted(ranges):
                b, e = cursor[p], ranges[p][1]
                if b >= e or budget <= 0:
                    continue
                stop = min(e, b + max_task, b + budget)
                budget -= stop - b
                cursor[p] = stop
                progress = True
        pieces = [(p, ranges[p][0], cursor[p]) for p in sorted(ranges) if cursor[p] > ranges[p][0]]
        packed: list[tuple[Any, ...]] = list(pack_ranges(pieces, max_task))
        if self.multi:
            if any(p not in self._pairs for p in ranges):
                self._learn()  # ids another driver assigned
            packed = [tuple((p, b, e, *self._pairs[p]) for p, b, e in spec) for spec in packed]
        elif self._base:  # a re-created topic's partitions are not their ids
            packed = [tuple((p, b, e, self.topic, p - self._base) for p, b, e in spec)
                      for spec in packed]
        tasks = [ReadTask(self.name, i, spec, sum(e - b for _p, b, e in task_ranges(spec)))
                 for i, spec in enumerate(packed)]
        if all(cursor[p] == ranges[p][1] for p in ranges):
            return tasks, upper
        # Partly read: every partition at its upper, except where the budget ran out.
        reached = {**hi, **cursor}
        return tasks, kafka_frontier(reached, partitions=max([*reached, -1]) + 1)

    def _unreadable(self, pid: int) -> bool:
        """Whether ``pid``'s records can no longer be read: a partition of a
        topic's earlier incarnation, or of a listed topic re-created and not
        accepted (reading it would read the new topic's records)."""
        return self._is_retired(pid) or (
            self.multi and self._pairs.get(pid, ("", 0))[0] in self._replaced)

    def unreadable(self, parts: Sequence[int]) -> dict[int, str]:
        """See :meth:`reclock.contracts.source.Source.unreadable` (after a probe or
        :meth:`retained`: the topics' metadata and identities are known)."""
        if self.multi:
            self._learn()  # ids of earlier incarnations another driver assigned
        out: dict[int, str] = {}
        for p in parts:
            topic, kp = self._topic_partition(p)
            if self._is_retired(p):
                out[p] = (f"topic {topic!r} partition {kp} before the topic was deleted and "
                          "re-created: its records went with it")
            elif self.multi and topic in self._replaced:
                out[p] = (f"topic {topic!r} was deleted and re-created and not accepted: the "
                          "records at these offsets now are the new topic's")
            elif self.multi and p in self._pairs and topic not in self._present:
                out[p] = f"topic {topic!r} was deleted"
        return out

    def reader(self) -> KafkaReader:
        routes = tuple((t, i) for i, t in enumerate(self.topic_outputs or ()))
        return KafkaReader(self.bootstrap, self.topic, tuple(sorted(self.properties.items())),
                           self.timeout_s, native=self.native, headers=self.include_headers,
                           multi=self.multi, routes=routes)

    def confirm(self, tasks: Sequence[ReadTask]) -> None:
        """After a job's tasks read: each topic they read still has the id
        the probe that bound their ranges found. A topic deleted and
        re-created in between handed over the new topic's records at the old
        one's positions: the job fails (nothing it read is committed), and
        the next probe meets the new id (sources/kafka_identity.py). Reads
        all happened before this check, so an id unchanged now was the id
        they read."""
        topics = sorted({t for task in tasks for t in _spec_topics(task.spec, self.topic)}
                        & set(self._seen_ids))
        if not topics:
            return
        found = {t: str(d.topic_id) for t, d in self._describe(topics).items()}
        changed = {t: (self._seen_ids[t], found.get(t)) for t in topics
                   if found.get(t) != self._seen_ids[t]}
        if changed:
            raise TransientError(
                f"source {self.name!r}: topics were replaced while a job read them: "
                + ", ".join(f"{t!r} (topic id {old} -> {new})" for t, (old, new)
                            in sorted(changed.items())),
                hint="nothing the job read is committed; the source reads again once its "
                "probe has met the new topic")

    def accept_replaced(self, name: str, bound: Antichain[Partitioned] | None = None) -> str:
        """``reclock accept-recreated``: the topic ``name`` as it is now
        becomes the current incarnation at the next open (its partitions get
        ids above every id of ``bound``, the last bound frontier)."""
        if not (name == self.topic or name in self.topics or self._matches(name)):
            raise DefiniteError(f"source {self.name!r} does not read topic {name!r}",
                                hint=f"it reads {self.described}")
        found = self._describe([name]).get(name)
        above = 0
        if bound is not None:
            offsets, top = kafka_offsets(bound)
            above = max(top or 0, max(offsets, default=-1) + 1)
        return self.identities.accept(name, None if found is None else str(found.topic_id),
                                      above)

    # -- acknowledgement ----------------------------------------------------------------------
    def acknowledge(self, frontier: Antichain[Partitioned]) -> None:
        offsets, _ = kafka_offsets(frontier)
        if self.multi:  # not a deleted topic's (the commit would fail every time)
            offsets = {p: o for p, o in offsets.items()
                       if p in self._pairs and self._pairs[p][0] in self._present
                       and p not in self._retired}
        else:  # not an earlier incarnation's (they name the new topic's partitions)
            offsets = {p: o for p, o in offsets.items() if p >= self._base}
        if not offsets or not self.commit_offsets:
            return
        tps = [self._tp(p, o) for p, o in sorted(offsets.items())]
        # Through the AdminClient (OffsetCommit for a group with no members), so
        # that the wait is bounded: a consumer's synchronous commit waits ~45 s
        # for a coordinator while the broker is away, and the tick with it.
        try:
            futs = self.admin.alter_consumer_group_offsets(
                [ConsumerGroupTopicPartitions(self.group, tps)],
                request_timeout=self.timeout_s)
            for fut in futs.values():
                fut.result(timeout=self.timeout_s + 5)
        except (KafkaException, concurrent.futures.TimeoutError) as exc:
            self._admin = None  # a new client next time (see _describe)
            raise _transient(f"source {self.name!r}: committing offsets to group "
                             f"{self.group!r}", exc) from None

    def committed(self) -> dict[int, int]:
        """The consumer group's committed offsets by partition id (for status
        and tests)."""
        ids, _ = self._partitions()
        res = self.consumer.committed([self._tp(p) for p in ids], timeout=self.timeout_s)
        return {self._pid(tp): tp.offset for tp in res if tp.offset >= 0}

    def close(self) -> None:
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                self._consumer.close()
            self._consumer = None
        self._admin = None


# -- configuration ----------------------------------------------------------------


class KafkaStartOffset(ConfigModel):
    """One partition's start position."""

    topic: str | None = Field(default=None, min_length=1, max_length=249,
                              pattern=KAFKA_TOPIC_PATTERN)
    """The partition's topic: required with ``topics`` or ``topic_pattern``,
    not allowed with ``topic``."""
    partition: int = Field(ge=0)
    """Partition id."""
    offset: int = Field(ge=0)
    """The first offset to ingest."""


TopicName = Annotated[str, Field(min_length=1, max_length=249, pattern=KAFKA_TOPIC_PATTERN)]


def output_for_topic(topic: str) -> str:
    """The output name a topic gets by default with ``output_per_topic``:
    each character an output name cannot hold becomes ``_``, and a name that
    does not start with a letter gets a ``t_`` in front."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", topic)
    return (name if name[:1].isalpha() else "t_" + name)[:63]


class KafkaConfig(ConnectorConfig):
    """Kafka topics; the FromTime is the partitioned offset (one coordinate per
    partition; partitions, and with several topics topics, that appear later
    are covered from offset 0)."""

    RAW_RECORDS: ClassVar[bool] = True

    bootstrap_servers: str = Field(min_length=1)
    """``host:port[,host:port...]``."""
    topic: TopicName | None = None
    """The topic to ingest (exactly one of ``topic``, ``topics`` and
    ``topic_pattern``)."""
    topics: tuple[TopicName, ...] | None = Field(default=None, min_length=1)
    """Several topics by name, read as one source: one FromTime over all
    their partitions, so that every binding covers them all at once. Rows get
    ``_topic`` and ``_partition`` columns (``_src_part`` holds the source's
    own id of the partition)."""
    topic_pattern: str | None = Field(default=None, min_length=1)
    """Every topic whose whole name matches this regular expression (Python
    syntax; internal topics starting with ``__`` never match), like Spark's
    ``subscribePattern`` or Kafka Connect's ``topics.regex``. A topic created
    later is read from its first record within one interval; a deleted one
    keeps its last offsets. One output for every topic."""
    output_per_topic: bool = False
    """With ``topics``: an output per topic (named by ``topic_outputs``, or
    after the topic: each character outside letters, digits, ``_`` and ``-``
    becomes ``_``, and ``t_`` goes in front of a name that does not start with
    a letter). ``false``: one output for all of them."""
    topic_outputs: dict[TopicName, Name] = Field(default_factory=dict)
    """With ``output_per_topic``: ``{topic: output name}`` where the rule's
    name does not suit."""
    group_id: str | None = None
    """Consumer group that the durable offsets are committed to (for monitoring
    and retention only; reclock never resumes from it). Default
    ``reclock-<pipeline id>-<source name>`` (see the Kafka sink's
    ``transactional_id``)."""
    start: Literal["earliest", "latest", "offsets", "timestamp"] = "earliest"
    """Where a new source starts (fixed when it first starts): ``earliest``,
    ``latest``, ``offsets`` (see ``start_offsets``) or ``timestamp`` (see
    ``start_timestamp``)."""
    start_offsets: tuple[KafkaStartOffset, ...] = ()
    """With ``start: offsets``: ``[{partition: 0, offset: 42}, ...]``; partitions
    not listed start at their earliest available offset."""
    start_timestamp: int | None = Field(default=None, ge=0)
    """With ``start: timestamp``: milliseconds since the epoch; each partition
    starts at its first record at or after it."""
    properties: Annotated[dict[str, str | int | float | bool], KAFKA_PROPERTIES] = Field(
        default_factory=dict)
    """Extra librdkafka settings passed straight to every client (for example
    ``security.protocol``, ``sasl.username``, ``sasl.password``); the values
    of the properties librdkafka marks sensitive are never printed."""
    timeout: DurationMs = 10_000
    """Timeout of metadata and offset requests, and of a read task waiting for
    its range."""
    commit_offsets: bool = True
    """Commit the durable offsets (the resumption frontier) to ``group_id``, so
    that Kafka's own tools show the source's lag. ``false``: reclock never
    writes to a consumer group (no group ACL needed); it resumes from its own
    state either way."""
    reader: Literal["native", "python"] = "native"
    """How Spark tasks read their ranges: ``native`` (a C reader filling Arrow
    buffers straight from librdkafka; the pure-Python reader, with a warning,
    where the extension was not built) or ``python`` (a confluent-kafka
    ``Consumer``). Both read exactly the same records."""
    include_headers: bool = False
    """Give the output a ``headers`` column: each record's headers as a list
    of ``{key: string, value: binary}`` in their order, duplicates kept, a
    null value kept null (Materialize's ``INCLUDE HEADERS``, Spark's
    ``includeHeaders``). Not with the ``debezium`` envelope."""

    @classmethod
    def check_raw(cls, data: Mapping[str, Any]) -> list[InitErrorDetails]:
        start = data.get("start", "earliest")
        out = []
        given = [k for k in ("topic", "topics", "topic_pattern") if data.get(k) is not None]
        if len(given) != 1:
            out.append(problem(("topic",), "give exactly one of topic, topics and "
                                f"topic_pattern (got {given or 'none'})"))
        multi = bool(given) and given[0] != "topic"
        pattern = data.get("topic_pattern")
        if isinstance(pattern, str):
            try:
                re.compile(pattern)
            except re.error as exc:
                out.append(problem(("topic_pattern",), f"not a regular expression: {exc}"))
        if data.get("output_per_topic") and data.get("topics") is None:
            out.append(problem(("output_per_topic",), "needs topics (a list of names): a "
                                "pattern's topics share one output", on_key=True))
        if data.get("topic_outputs") and not data.get("output_per_topic"):
            out.append(problem(("topic_outputs",), "only applies to output_per_topic: true",
                                on_key=True))
        for topic in data.get("topic_outputs") or ():
            if isinstance(data.get("topics"), list | tuple) and topic not in data["topics"]:
                out.append(problem(("topic_outputs", topic), "not one of topics"))
        if data.get("output_per_topic") and isinstance(data.get("topics"), list | tuple):
            names = dict(data.get("topic_outputs") or {})
            seen: dict[str, str] = {}
            for t in data["topics"]:
                if not isinstance(t, str):
                    continue
                o = names.get(t) or output_for_topic(t)
                if o in seen:
                    out.append(problem(("topic_outputs",), f"topics {seen[o]!r} and {t!r} "
                                        f"would both write output {o!r}; name one in "
                                        "topic_outputs"))
                seen[o] = t
        for i, so in enumerate(data.get("start_offsets") or ()):
            if isinstance(so, Mapping) and (so.get("topic") is None) == multi:
                out.append(problem(("start_offsets", i), "needs its topic with topics or "
                                    "topic_pattern" if multi else "takes no topic with topic"))
        if start == "offsets" and not data.get("start_offsets"):
            out.append(problem(("start_offsets",), "required with start: offsets"))
        if start == "timestamp" and data.get("start_timestamp") is None:
            out.append(problem(("start_timestamp",), "required with start: timestamp"))
        if data.get("start_offsets") and start != "offsets":
            out.append(problem(("start_offsets",), "only applies to start: offsets",
                                on_key=True))
        if data.get("start_timestamp") is not None and start != "timestamp":
            out.append(problem(("start_timestamp",), "only applies to start: timestamp",
                                on_key=True))
        return out

    def per_topic(self) -> dict[str, str] | None:
        """topic -> output name with ``output_per_topic``; None otherwise."""
        if not self.output_per_topic or not self.topics:
            return None
        return {t: self.topic_outputs.get(t) or output_for_topic(t) for t in self.topics}

    @classmethod
    def output_problem(cls, data: Mapping[str, Any], outputs: Sequence[str]
                       ) -> tuple[str, str] | None:
        topics = data.get("topics")
        if data.get("output_per_topic") and isinstance(topics, list | tuple):
            names = dict(data.get("topic_outputs") or {})
            want = [names.get(t) or output_for_topic(t) for t in topics if isinstance(t, str)]
            missing = [o for o in want if o not in outputs]
            unknown = [o for o in outputs if o not in want]
            if not missing and not unknown:
                return None
            said = "; ".join(
                ([f"no entry under outputs for {missing}"] if missing else [])
                + ([f"no topic feeds {unknown}"] if unknown else []))
            return (f"with output_per_topic its topics have the outputs {want}: {said}",
                    "give each topic's output an entry under outputs (its name: the topic's, "
                    "or topic_outputs), and no other")
        if len(outputs) != 1:
            return (f"a Kafka source has one output, got {list(outputs)}",
                    "keep one output, and give it a list of sinks (sinks: [...]) to land it "
                    "in several places; to split several topics into an output each, list "
                    "them under topics with output_per_topic: true")
        return None

    def build(self, name: str, ctx: SourceContext) -> KafkaSource:
        return KafkaSource(
            name, self.bootstrap_servers, self.topic or "", ctx.clock,
            group_id=self.group_id or f"reclock-{ctx.identity}-{name}",
            start=self.start,
            start_offsets={((s.topic, s.partition) if s.topic else s.partition): s.offset
                           for s in self.start_offsets},
            start_timestamp=self.start_timestamp, properties=dict(self.properties),
            timeout_s=self.timeout / 1000.0, output_names=list(ctx.output_names),
            native=self.reader == "native", commit_offsets=self.commit_offsets,
            include_headers=self.include_headers, topics=tuple(self.topics or ()),
            pattern=self.topic_pattern, topic_outputs=self.per_topic(),
            coordinates=ctx.coordinates, facts=ctx.facts,
        )


PLUGIN = SourcePlugin(name="kafka", config=KafkaConfig, rank=2)
