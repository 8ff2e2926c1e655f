"""A seeded generative harness of *world changes*, with an independent model.

:mod:`tests.generative` draws faults of the pipeline's own steps (a failed
stage or commit, a crash); this one draws changes of the world around it, with
the driver running and with it stopped, and checks that each ends with every
record once or with a definite error naming the object, which the harness
answers with the documented recovery:

    change                      lanes                       what must happen
    topic deleted, re-created   a named topic               the source stalls (IdentityChanged),
                                                            `reclock accept-recreated`, the new
                                                            topic read from its first record
    topic deleted, re-created   a topic_pattern             a new member, read from its first
                                                            record, without a stall
    partitions added            append lanes (JSON, Avro)   read from offset 0
    progress topic deleted      the Kafka sink lane         the source stalls (IdentityChanged),
                                                            `reclock resnapshot` rebuilds the output
    key-state file damaged      keyed lanes (Kafka, CDC)    rebuilt from the output
    values moving between keys  a state table keyed by      one row per key, always
                                [id, body], bodies a few
                                addresses ids pass around
    a new registry schema       an Avro lane (Confluent     every record once, each field on
    version: an optional field  wire format, the test       every record that carried it, null
    added, int -> long          registry)                   on the others; promoted values exact
    a column added (with or     Postgres CDC -> Delta: a    keyed: the output gains the column,
    without a default),         table keyed by its primary  null on rows written before; a drop
    dropped, renamed, widened   key, one with REPLICA       keeps the column, null on rows written
    (int -> bigint)             IDENTITY FULL (a diff log)  later; a rename keeps the output's
                                                            name; a widening widens it. FULL: a
                                                            drop, or an added column with a
                                                            default, stalls the source naming
                                                            the table and column; the way out its
                                                            error names (drop the output and the
                                                            source's state) re-reads the table

A topic is deleted only once its lane's output holds every record written to
it (records deleted before they are read are gone with the topic, which the
source says in its log: they are nobody's to land). Postgres changes are
written in random transactions of one to five changes; a DDL statement is
written alone or inside one of them, and is followed by at least one change
of its table (the source notices a change of shape while running at the
next relation message); new columns, and renamed ones, get names no column
of the output has had. A registry version is registered and then used by
the producer (mostly the newest; an old producer's records with an earlier
one now and then). The rules followed are those of docs/schema-changes.md,
two changes of one column with no change of the table read in between
(added or widened, then dropped or renamed) included.

The model is a plain computation over what the harness produced. A Kafka
record is known by where Kafka put it (topic id, partition, offset: from the
producer's delivery reports): an append lane holds each record once at its
position, a keyed lane the latest value per key, and records a sink cannot
store are error rows at their positions. An output's ``_src_part`` is mapped
to (topic id, partition) through what the source recorded in the remap
store (its coordinate names and topic records); the mapping is the only thing
read from reclock's own state, and a wrong one shows as lost and unexpected
rows. A Postgres lane keeps two plain dicts per key: the table's row upstream
(by today's column names) and the row as the output must show it (by the
output's column names, which the rules of docs/schema-changes.md give:
a renamed column keeps its output name, a dropped one stays, an added one
is null on rows written before it), compared with the output consolidated
per key.

Used by ``tests/reclock/test_generative.py`` and ``bench/generative_soak.py``.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import Producer, TopicCollection

from tests.generative import KAFKA_SINK_MAX, Outcome, _norm, _row, _value, refuses
from tests.registry import confluent_avro, register

#: Kafka lanes: (lane, envelope, topic naming, sink, value format)
LANES = [
    ("app_delta", "none", "topic", "file", "json"),
    ("pat_pglog", "none", "pattern", "pglog", "json"),
    ("up_delta", "upsert", "topic", "file", "json"),
    ("up_pgstate", "upsert", "topic", "pgstate", "json"),
    ("up_kafka", "upsert", "topic", "kafka", "json"),
    ("mv_pgstate", "upsert", "topic", "pgstate", "json"),
    ("avro_delta", "none", "topic", "file", "avro"),
]

#: Postgres CDC lanes into Delta: (lane = source = table = output, replica identity)
PG_LANES = [("ddl_key", "key"), ("ddl_full", "full")]

#: The values of the ``mv_pgstate`` lane: a few addresses that move between
#: keys (unique per key at a time is not promised upstream: the state table is
#: keyed by ``[id, body]``, which contains the upsert key).
EMAILS = [f"user{i}@example.com" for i in range(6)]

_DDL = ("add_column", "drop_column", "rename_column", "widen_column")

#: which changes each lane can be drawn for
CHANGES: dict[str, tuple[str, ...]] = {
    "app_delta": ("recreate", "add_partitions"),
    "pat_pglog": ("recreate", "add_partitions"),
    "up_delta": ("recreate", "damage_keys"),
    "up_pgstate": ("recreate", "damage_keys"),
    "up_kafka": ("delete_progress", "damage_keys"),
    "mv_pgstate": ("recreate", "damage_keys"),
    "avro_delta": ("new_version", "new_version", "add_partitions"),
    "ddl_key": (*_DDL, "damage_keys"),
    "ddl_full": _DDL,
}


@dataclass
class Lane:
    """A Kafka lane: a topic (or a pattern's topics) into one output."""

    name: str
    envelope: str
    naming: str  # topic or pattern
    sink: str
    topic: str
    fmt: str = "json"  # json or avro (Confluent wire format through the registry)
    #: (key, ("put", value, existed) | ("delete",)) in the order produced
    records: list[tuple[int, tuple[Any, ...]]] = field(default_factory=list)
    #: where each produced record went: (topic id, partition, offset)
    at: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    cursor: int = 0  # records produced so far
    partitions: int = 1
    topic_id: str = ""
    incarnations: list[str] = field(default_factory=list)
    #: Avro: the subject's versions (schema, id) in the order registered, the
    #: optional fields added so far, whether score is long, and each record
    #: as written (its fields; one its writer schema lacks is absent)
    versions: list[tuple[dict[str, Any], int]] = field(default_factory=list)
    fields: list[str] = field(default_factory=list)
    promoted: bool = False
    sent: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def keyed(self) -> bool:
        return self.envelope != "none"

    @property
    def subject(self) -> str:
        return f"{self.topic}-value"

    def refuses(self, value: dict[str, Any]) -> bool:
        return refuses(self.sink, value)

    def columns(self) -> list[str]:
        """The user columns the model speaks of."""
        return ["id", "name", "score", *self.fields] if self.fmt == "avro" else ["id", "body", "x"]

    def expected(self, i: int) -> tuple[Any, ...]:
        """The row record ``i`` must be (an append lane)."""
        if self.fmt == "avro":
            return tuple(self.sent[i].get(c) for c in self.columns())
        k, op = self.records[i]
        return _row(k, op[1])


def avro_schema(fields: list[str], promoted: bool) -> dict[str, Any]:
    """A version of the Avro lane's value schema: ``fields`` are the optional
    fields added so far (each with the default null), ``promoted``: score
    promoted from int to long."""
    return {"type": "record", "name": "World", "fields": [
        {"name": "id", "type": "long"}, {"name": "name", "type": "string"},
        {"name": "score", "type": "long" if promoted else "int"},
        *({"name": f, "type": ["null", "string"], "default": None} for f in fields)]}


@dataclass
class Col:
    """A column of a Postgres lane's table, as the output knows it."""

    out: str  # the output's name for it
    up: str | None  # its name upstream now; None: dropped
    kind: str  # int, bigint, text, float


@dataclass
class PgLane:
    """A Postgres table (keyed by its primary key, or REPLICA IDENTITY FULL)
    into a Delta output, with the model of both."""

    name: str
    identity: str  # key or full
    records: list[tuple[int, tuple[Any, ...]]] = field(default_factory=list)
    cursor: int = 0
    cols: list[Col] = field(default_factory=lambda: [
        Col("n", "n", "int"), Col("m", "m", "int"), Col("body", "body", "text"),
        Col("x", "x", "float")])
    #: the table upstream: key -> {column name now: value}
    table: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: what the output must hold: key -> {output column: value} (absent: null)
    out: dict[int, dict[str, Any]] = field(default_factory=dict)
    fresh: int = 0  # new column names: c1, c2, ... (never one the output has had)
    touches: int = 0  # changes made beyond the drawn records (after a DDL)
    #: output columns whose change the rules refuse (a diff log's), since the last re-read
    refused: list[str] = field(default_factory=list)
    stalled: bool = False  # the refusal was seen: re-read at the next start
    #: the DDL statements made, in order (named when a wait fails)
    ddls: list[str] = field(default_factory=list)

    @property
    def full(self) -> bool:
        return self.identity == "full"

    def live(self) -> list[Col]:
        return [c for c in self.cols if c.up is not None]

    def new_name(self) -> str:
        self.fresh += 1
        return f"c{self.fresh}"

    def draw(self, c: Col, r: random.Random) -> Any:
        if r.random() < 0.1:
            return None
        if c.kind == "int":
            return r.randint(-2**31, 2**31 - 1)
        if c.kind == "bigint":
            return r.choice([r.randint(-2**31, 2**31 - 1), 2**40 + r.randrange(1000),
                             -2**62 - r.randrange(1000), 2**63 - 1])
        if c.kind == "float":
            return _value(r, pg_text=True)["x"]
        return _value(r, pg_text=True)["body"]

    def reread(self) -> None:
        """The output re-read in the table's shape now (a new snapshot)."""
        self.cols = [Col(c.up, c.up, c.kind) for c in self.live() if c.up is not None]
        self.out = {k: dict(v) for k, v in self.table.items()}
        self.refused, self.stalled = [], False


def plan(seed: int, sequences: int, ops_per_sequence: int = 6
         ) -> tuple[dict[str, Lane], dict[str, PgLane]]:
    """Draw the lanes' records (deterministic in ``seed``): Kafka records
    with their values; Postgres changes with a seed for their values, drawn
    when written (the columns are those of the table then). A table's
    sequences are interleaved (each one's changes in its order), so that
    rows written before a change of the table's shape are changed after it."""
    rng = random.Random(seed)
    run = uuid.uuid4().hex[:8]
    lanes = {n: Lane(n, env, naming, sink, f"world-{run}-{n}", fmt)
             for n, env, naming, sink, fmt in LANES}
    tables = {n: PgLane(n, ident) for n, ident in PG_LANES}
    order: list[Lane | PgLane] = [*lanes.values(), *tables.values()]
    pending: dict[str, list[list[tuple[int, tuple[Any, ...]]]]] = {n: [] for n in tables}
    for s in range(sequences):
        lane = order[s % len(order)]
        keyed = isinstance(lane, PgLane) or lane.keyed
        keys = [s * 100 + j for j in range(rng.randint(1, 4))]
        live: dict[int, Any] = {}
        ops: list[tuple[int, tuple[Any, ...]]] = []
        for _ in range(rng.randint(1, ops_per_sequence)):
            k = rng.choice(keys)
            if keyed and k in live and rng.random() < 0.3:
                ops.append((k, ("delete",)))
                live.pop(k)
                continue
            if isinstance(lane, PgLane):
                v: Any = rng.randrange(2**32)
            else:
                v = _value(rng, pg_text=False)
                if lane.name == "mv_pgstate":  # an address another key may have had
                    v["body"] = rng.choice(EMAILS)
            ops.append((k, ("put", v, k in live)))
            live[k] = v
        if isinstance(lane, PgLane):
            pending[lane.name].append(ops)
        else:
            lane.records.extend(ops)
    for name, seqs in pending.items():
        while seqs:  # the next change of a sequence drawn by how many it has left
            at = rng.choices(range(len(seqs)), [len(x) for x in seqs])[0]
            tables[name].records.append(seqs[at].pop(0))
            if not seqs[at]:
                seqs.pop(at)
    return lanes, tables


def config(tmp: Path, lanes: dict[str, Lane], tables: dict[str, PgLane], bootstrap: str,
           pg_url: str, registry_url: str) -> str:
    out = [f"state_dir: {tmp}/state", "timestamp_interval: 200ms",
           "spark: {max_records_per_job: 400}", "sources:"]
    for lane in lanes.values():
        out.append(f"  - name: {lane.name}")
        what = (f"topic: {lane.topic}" if lane.naming == "topic"
                else f'topic_pattern: "{lane.topic}(-.*)?"')
        out.append(f'    kafka: {{bootstrap_servers: "{bootstrap}", {what}, timeout: 5s}}')
        out.append("    outputs:")
        out.append(f"      - name: {lane.name}")
        if lane.fmt == "avro":
            out.append(f'        format: {{type: avro, registry_url: "{registry_url}", '
                       f"subject: {lane.subject}}}")
        else:
            out.append("        format: {type: json, schema: {body: string, x: float64}}")
            out.append("        key_format: {type: json, schema: {id: int64}}")
        if lane.keyed:
            out.append("        envelope: {type: upsert, key: [id]}")
        state_key = "[id, body]" if lane.name == "mv_pgstate" else "[id]"
        sink = {"file": "file",
                "pglog": f'{{type: postgres, dsn: "{pg_url}", table: {lane.name}_out}}',
                "pgstate": f'{{type: postgres, dsn: "{pg_url}", table: {lane.name}_out, '
                           f"mode: state, key: {state_key}}}",
                "kafka": f'{{type: kafka, bootstrap_servers: "{bootstrap}", '
                         f"topic: {lane.topic}-out, "
                         f"properties: {{message.max.bytes: {KAFKA_SINK_MAX}}}}}"}[lane.sink]
        out.append(f"        sink: {sink}")
    for t in tables.values():
        out.append(f"  - name: {t.name}")
        out.append(f'    postgres: {{dsn: "{pg_url}", tables: [{t.name}], timeout: 10s}}')
        out.append(f"    outputs: [{{name: {t.name}, sink: file}}]")
    return "\n".join(out) + "\n"


def _topic_id(admin: Any, topic: str) -> str:
    return str(admin.describe_topics(TopicCollection([topic]))[topic].result().topic_id)


_SQL_TYPE = {"int": "int", "bigint": "bigint", "text": "text", "float": "double precision"}


class World:
    """The lanes' topics and tables, a producer that learns where each record
    went, a Postgres writer, and the changes applied to them."""

    def __init__(self, lanes: dict[str, Lane], tables: dict[str, PgLane], kafka: Any,
                 pg_url: str, registry_url: str, rng: random.Random) -> None:
        self.lanes, self.tables, self.kafka, self.rng = lanes, tables, kafka, rng
        self.registry_url = registry_url
        self.producer = Producer({"bootstrap.servers": kafka.bootstrap, "linger.ms": 5,
                                  "enable.idempotence": True,
                                  "message.max.bytes": 1_000_000})
        self.pg: psycopg.Connection[Any] = psycopg.connect(pg_url)

    def close(self) -> None:
        self.producer.flush(10)
        self.pg.close()

    # -- Kafka -----------------------------------------------------------------------------
    def create(self, lane: Lane, partitions: int) -> None:
        self.kafka.create_topic(lane.topic, partitions)
        lane.partitions = partitions
        lane.topic_id = _topic_id(self.kafka.admin(), lane.topic)
        lane.incarnations.append(lane.topic_id)
        if lane.fmt == "avro" and not lane.versions:
            self.new_version(lane)

    def new_version(self, lane: Lane) -> str:
        """Register the Avro lane's next version (the first: id, name, score
        int; then an optional field added, or score promoted to long);
        returns what changed."""
        what = "first"
        if lane.versions:
            if not lane.promoted and self.rng.random() < 0.4:
                lane.promoted, what = True, "promoted"
            else:
                lane.fields.append(f"f{len(lane.fields) + 1}")
                what = "field added"
        schema = avro_schema(list(lane.fields), lane.promoted)
        lane.versions.append((schema, register(self.registry_url, lane.subject, schema)))
        return what

    def _avro(self, lane: Lane, i: int, key: int, value: dict[str, Any]) -> bytes:
        """Record ``i`` written with the newest version, or now and then an
        earlier one (an old producer); what it carries is kept in ``sent``."""
        r = self.rng
        v = len(lane.versions) - 1 if r.random() < 0.8 else r.randrange(len(lane.versions))
        schema, sid = lane.versions[v]
        names = {f["name"]: f["type"] for f in schema["fields"]}
        score = (r.choice([2**40 + i, -2**62 - i, 2**63 - 1, i]) if names["score"] == "long"
                 else r.randint(-2**31, 2**31 - 1))
        rec: dict[str, Any] = {"id": key, "name": value["body"], "score": score}
        for f in names:
            if f.startswith("f"):
                rec[f] = r.choice([None, f"{f}-{i}", value["body"]])
        lane.sent[i] = rec
        return confluent_avro(sid, schema, rec)

    def produce(self, lane: Lane, n: int) -> None:
        """The lane's next ``n`` records, flushed, with their positions."""
        upto = min(len(lane.records), lane.cursor + max(n, 0))
        for i in range(lane.cursor, upto):
            key, op = lane.records[i]
            kb = json.dumps({"id": key}).encode()
            if op[0] == "delete":
                vb = None
            elif lane.fmt == "avro":
                vb = self._avro(lane, i, key, op[1])
            else:
                vb = json.dumps(op[1]).encode()
            # a keyed lane keeps every key in partition 0 (its order is per partition)
            part = 0 if lane.keyed else self.rng.randrange(lane.partitions)

            def delivered(err: Any, msg: Any, i: int = i, tid: str = lane.topic_id) -> None:
                assert err is None, err
                lane.at[i] = (tid, msg.partition(), msg.offset())

            self.producer.produce(lane.topic, key=kb, value=vb, partition=part,
                                  on_delivery=delivered)
        assert self.producer.flush(60) == 0
        lane.cursor = upto

    def recreate(self, lane: Lane) -> None:
        self.kafka.delete_topic(lane.topic)
        self.create(lane, self.rng.randint(1, 2) if not lane.keyed else 1)
        self._known(lane)

    def add_partitions(self, lane: Lane) -> None:
        lane.partitions += 1
        self.kafka.add_partitions(lane.topic, lane.partitions)
        self._known(lane)

    def _known(self, lane: Lane) -> None:
        """Wait until the producer's metadata has the lane's topic as it is now."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            t = self.producer.list_topics(lane.topic, timeout=5).topics.get(lane.topic)
            if t is not None and t.error is None and len(t.partitions) == lane.partitions:
                return
            time.sleep(0.1)
        raise AssertionError(f"the producer never saw {lane.topic} with {lane.partitions} "
                             "partitions")

    # -- Postgres --------------------------------------------------------------------------
    def create_table(self, t: PgLane) -> None:
        cols = ", ".join(f"{c.up} {_SQL_TYPE[c.kind]}" for c in t.live())
        with self.pg.transaction():
            self.pg.execute(f"create table {t.name} (id bigint primary key, {cols})")
            if t.full:
                self.pg.execute(f"alter table {t.name} replica identity full")

    def _change(self, t: PgLane, key: int, op: tuple[Any, ...]) -> None:
        """One drawn change, in the open transaction, and in the model."""
        if op[0] == "delete":
            self.pg.execute(f"delete from {t.name} where id = %s", (key,))
            t.table.pop(key, None)
            t.out.pop(key, None)
            return
        r = random.Random(op[1])
        live = t.live()
        vals = {c.up: t.draw(c, r) for c in live if c.up is not None}
        names = ", ".join(vals)
        self.pg.execute(
            f"insert into {t.name} (id, {names}) values (%s{', %s' * len(vals)}) "
            f"on conflict (id) do update set "
            + ", ".join(f"{n} = excluded.{n}" for n in vals), (key, *vals.values()))
        t.table[key] = vals
        # every output column: live ones as written, dropped ones null from now on
        t.out[key] = {c.out: (vals[c.up] if c.up is not None else None) for c in t.cols}

    def _next(self, t: PgLane, n: int, touch: bool = False) -> list[tuple[int, tuple[Any, ...]]]:
        """The table's next ``n`` drawn changes; ``touch``: at least one (a
        change beyond the drawn ones when they are all written: a row the
        table holds changed, or a new one)."""
        ops = t.records[t.cursor:t.cursor + n]
        t.cursor += len(ops)
        if touch and not ops:
            t.touches += 1
            key = (self.rng.choice(sorted(t.table)) if t.table
                   else 10_000_000 + t.touches)
            ops = [(key, ("put", self.rng.randrange(2**32), key in t.table))]
        return ops

    def write(self, t: PgLane, n: int) -> None:
        """The table's next ``n`` changes, in transactions of one to five."""
        left = n
        while left > 0 and t.cursor < len(t.records):
            ops = self._next(t, min(left, self.rng.randint(1, 5)))
            left -= len(ops)
            with self.pg.transaction():
                for key, op in ops:
                    self._change(t, key, op)

    def ddl(self, t: PgLane, kind: str) -> tuple[str, str | None]:
        """A change of the table's shape (``kind``, or adding a column when
        the table has nothing ``kind`` applies to), alone in its
        transaction or among changes of rows, followed by at least one
        change of a row. Returns what was done, and the output column the
        rules refuse the change of (a diff log's drop, or a column added
        to it with a default), if any."""
        r = self.rng
        live = [c for c in t.live() if c.up is not None]
        ints = [c for c in live if c.kind == "int"]
        if kind == "drop_column" and len(live) < 2:
            kind = "add_column"  # (the table keeps a column besides its key)
        if kind == "widen_column" and not ints:
            kind = "add_column"
        among = r.random() < 0.5  # among changes of rows in one transaction, or alone
        before = self._next(t, r.randint(0, 2)) if among else []
        after = self._next(t, r.randint(1, 2), touch=True)
        refused: str | None = None

        def alter(stmt: str) -> None:
            t.ddls.append(stmt)
            self.pg.execute(stmt)

        with self.pg.transaction():
            for key, op in before:
                self._change(t, key, op)
            if kind == "add_column":
                name, typ = t.new_name(), r.choice(["int", "text"])
                default = None
                if r.random() < 0.3:
                    default = 7 * t.fresh if typ == "int" else f"d{t.fresh}"
                alter(f"alter table {t.name} add column {name} {typ}"
                      + ("" if default is None else f" default {default!r}"))
                t.cols.append(Col(name, name, typ))
                for row in t.table.values():  # upstream holds the default; the output
                    row[name] = default        # nothing yet: null on earlier rows
                if default is not None:
                    kind = "add_column_default"
                    if t.full:
                        refused = name
            elif kind == "drop_column":
                c = r.choice(live)
                assert c.up is not None
                alter(f"alter table {t.name} drop column {c.up}")
                for row in t.table.values():
                    row.pop(c.up, None)
                c.up = None
                if t.full:
                    refused = c.out
            elif kind == "rename_column":
                c = r.choice(live)
                assert c.up is not None
                new = t.new_name()
                alter(f"alter table {t.name} rename column {c.up} to {new}")
                for row in t.table.values():
                    row[new] = row.pop(c.up, None)
                c.up = new
            elif kind == "widen_column":
                c = r.choice(ints)
                alter(f"alter table {t.name} alter column {c.up} type bigint")
                c.kind = "bigint"
            else:
                raise AssertionError(kind)
            for key, op in after if among else []:
                self._change(t, key, op)
        if not among:
            with self.pg.transaction():
                for key, op in after:
                    self._change(t, key, op)
        if refused is not None:
            t.refused.append(refused)
        return kind, refused


# -- reading the outputs and mapping positions ---------------------------------------------


def _sink(cfg: Any, lane: str) -> Any:
    from reclock.pipeline import Pipeline

    pipe = Pipeline(cfg)
    src = pipe.source_config(lane)
    return pipe, pipe.sink(src, src.output(lane))


def updates(cfg: Any, lane: str) -> pa.Table:
    pipe, sink = _sink(cfg, lane)
    try:
        return sink.read_updates()
    finally:
        sink.close()
        pipe.close()


def _progress(cfg: Any, lane: str) -> str | None:
    pipe, sink = _sink(cfg, lane)
    try:
        return sink.state().progress  # type: ignore[no-any-return]
    finally:
        sink.close()
        pipe.close()


def durable_records(cfg: Any, lane: str) -> int:
    """How many records the lane's output has read (its progress' offsets,
    summed over every partition id: earlier incarnations keep theirs)."""
    from reclock.core.frontier import Antichain
    from reclock.core.time import kafka_offsets

    p = _progress(cfg, lane)
    return 0 if p is None else sum(kafka_offsets(Antichain.decode_json("kafka", p))[0].values())


def durable_lsn(cfg: Any, lane: str) -> int:
    """The LSN a Postgres lane's output holds every change before (0: nothing yet)."""
    from reclock.core.frontier import Antichain

    p = _progress(cfg, lane)
    if p is None:
        return 0
    f = Antichain.decode_json("lsn", p)
    return min((int(t) for t in f.elements), default=1 << 64)


def partition_ids(cfg: Any, lane: Lane) -> dict[int, tuple[str, int]]:
    """The source's partition id -> (topic id, partition), from what it
    recorded in the remap store."""
    from reclock.pipeline import Pipeline

    pipe = Pipeline(cfg)
    try:
        facts = pipe.store.facts(lane.name) if lane.name in pipe.store.shards() else {}
        rec = json.loads(facts.get(f"kafka.topic:{lane.topic}", '{"ids": [], "bases": []}'))
        coords = pipe.store.coordinates(lane.name)
    finally:
        pipe.close()
    ids, bases = rec["ids"], rec.get("bases") or [0] * len(rec["ids"])
    out: dict[int, tuple[str, int]] = {}
    if lane.naming == "topic":
        for k, tid in enumerate(ids):
            top = bases[k + 1] if k + 1 < len(bases) else 1 << 20
            for pid in range(bases[k], top):
                out[pid] = (tid, pid - bases[k])
        return out
    for name, pid in coords.items():
        _t, p, *inc = json.loads(name)
        out[pid] = (inc[0] if inc else ids[0], p)
    return out


def compare(cfg: Any, lane: Lane, outcome: Outcome) -> None:
    """The lane's output against the model (see the module docstring)."""
    from reclock.contracts.consolidate import consolidate

    t = updates(cfg, lane.name)
    where = partition_ids(cfg, lane)
    pos = [(*where.get(p, ("?", -1)), o) for p, o in zip(
        t.column("_src_part").to_pylist(), t.column("_src_offset").to_pylist(), strict=True)]
    err = t.column("_error").to_pylist()
    expected_errors = {lane.at[i] for i, (_k, op) in enumerate(lane.records[:lane.cursor])
                       if op[0] == "put" and lane.refuses(op[1])}
    seen = Counter(p for p, e in zip(pos, err, strict=True) if e is not None)
    for p, n in seen.items():
        if p not in expected_errors:
            outcome.add("wrong", f"{lane.name}: unexpected error row at {p}")
        elif n > 1:
            outcome.add("doubled", f"{lane.name}: error row at {p} x{n}", n - 1)
    for p in expected_errors - set(seen):
        outcome.add("lost", f"{lane.name}: no error row at {p}")
    outcome.refused += len(expected_errors & set(seen))
    ok = t.filter(pc.is_null(t.column("_error")))
    produced = [(i, k, op) for i, (k, op) in enumerate(lane.records[:lane.cursor])]
    if not lane.keyed:
        cols = lane.columns()
        extra = [c for c in ok.column_names if not c.startswith("_") and c not in cols]
        if extra:
            outcome.add("wrong", f"{lane.name}: output columns {extra} no record carried")
        have = {c: ok.column(c).to_pylist() if c in ok.column_names else [None] * ok.num_rows
                for c in cols}
        rows = [tuple(have[c][j] for c in cols) for j in range(ok.num_rows)]
        if lane.fmt == "json":
            rows = [(a, b, _norm(x)) for a, b, x in rows]
        ok_pos = [p for p, e in zip(pos, err, strict=True) if e is None]
        got = Counter(zip(ok_pos, rows, strict=True))
        want = Counter({(lane.at[i], lane.expected(i)): 1 for i, k, op in produced
                        if not lane.refuses(op[1])})
        for item, n in want.items():
            if got[item] < n:
                outcome.add("lost", f"{lane.name}: {item!r}"[:200], n - got[item])
            elif got[item] > n:
                outcome.add("doubled", f"{lane.name}: {item!r}"[:200], got[item] - n)
        for item, n in got.items():
            if item not in want:
                outcome.add("wrong", f"{lane.name}: unexpected {item!r}"[:200], n)
        return
    state: dict[int, tuple[Any, ...]] = {}
    for _i, k, op in produced:
        if op[0] == "delete":
            state.pop(k, None)
        elif not lane.refuses(op[1]):  # refused: the key keeps its previous row
            state[k] = _row(k, op[1])
    held: dict[int, list[tuple[Any, ...]]] = {}
    if lane.sink == "pgstate":
        counted = [(r["id"], r["body"], _norm(r["x"]), 1) for r in ok.to_pylist()]
    else:
        counted = [(r["id"], r["body"], _norm(r["x"]), int(r["_count"]))
                   for r in consolidate(ok, None, ["id", "body", "x"]).to_pylist()]
    for k, body, x, n in counted:
        held.setdefault(k, []).extend([(k, body, x)] * max(n, 0))
        if n < 0:
            outcome.add("wrong", f"{lane.name}: key {k} retracted more than held")
    _per_key(lane.name, state, held, outcome)


def _per_key(name: str, state: dict[int, Any], held: dict[int, list[Any]],
             outcome: Outcome) -> None:
    for k in set(state) | set(held):
        w, g = state.get(k), held.get(k, [])
        if w is None and g:
            outcome.add("doubled", f"{name}: deleted key {k} still holds {g[:2]!r}")
        elif w is not None and not g:
            outcome.add("lost", f"{name}: key {k} (latest {w!r})")
        elif w is not None and g != [w]:
            outcome.add("wrong", f"{name}: key {k} holds {g[:2]!r}, latest {w!r}"[:300])


def compare_table(cfg: Any, t: PgLane, outcome: Outcome) -> None:
    """A Postgres lane's output against its model: the output's columns,
    a widened column's type, and per key the one row it holds."""
    from reclock.contracts.consolidate import consolidate

    u = updates(cfg, t.name)
    for e in u.filter(pc.is_valid(u.column("_error"))).column("_error").to_pylist():
        outcome.add("wrong", f"{t.name}: error row {e[:160]!r}")
    ok = u.filter(pc.is_null(u.column("_error")))
    user = [c for c in ok.column_names if not c.startswith("_")]
    want_cols = ["id", *(c.out for c in t.cols)]
    if sorted(user) != sorted(want_cols):
        outcome.add("wrong", f"{t.name}: output columns {sorted(user)}, the model's "
                             f"{sorted(want_cols)}")
    for c in t.cols:
        if c.kind == "bigint" and c.out in user and ok.schema.field(c.out).type != pa.int64():
            outcome.add("wrong", f"{t.name}: widened column {c.out!r} is "
                                 f"{ok.schema.field(c.out).type}")
    cols = [c for c in want_cols if c in user]
    kinds = {c.out: c.kind for c in t.cols}

    def norm(c: str, v: Any) -> Any:
        return _norm(v) if kinds.get(c) == "float" else v

    held: dict[int, list[tuple[Any, ...]]] = {}
    for r in consolidate(ok, None, cols).to_pylist():
        n = int(r["_count"])
        row = tuple(norm(c, r.get(c)) for c in want_cols)
        held.setdefault(r["id"], []).extend([row] * max(n, 0))
        if n < 0:
            outcome.add("wrong", f"{t.name}: key {r['id']} retracted more than held: {row!r}"
                        [:300])
    state = {k: (k, *(norm(c, v.get(c)) for c in want_cols[1:])) for k, v in t.out.items()}
    _per_key(t.name, state, held, outcome)


# -- the run -------------------------------------------------------------------------------


@dataclass
class Change:
    kind: str
    lane: str
    running: bool


def draw(rng: random.Random, phases: int, per_phase: int) -> list[list[Change]]:
    """Per phase, the changes made in it (each a lane and a kind, drawn
    among the pairs :data:`CHANGES` allows, every kind at least once when
    there is room for all): the first phase's while running only (there is
    nothing to change before the first start)."""
    pairs = [(lane, kind) for lane, kinds in CHANGES.items() for kind in kinds]
    # every kind of change at least once when there is room, the rest at random
    kinds = sorted({kind for _lane, kind in pairs})
    picked = [rng.choice([p for p in pairs if p[1] == k]) for k in kinds]
    picked = picked[:phases * per_phase]
    picked += [rng.choice(pairs) for _ in range(phases * per_phase - len(picked))]
    rng.shuffle(picked)
    return [[Change(kind, lane, running=ph == 0 or rng.random() < 0.5)
             for lane, kind in picked[ph * per_phase:(ph + 1) * per_phase]]
            for ph in range(phases)]


def run(tmp: Path, spark: Any, kafka: Any, pg_url: str, registry_url: str, seed: int,
        sequences: int, phases: int = 3, per_phase: int = 4, timeout: float = 90.0
        ) -> Outcome:
    """``sequences`` drawn from ``seed`` written over ``phases`` runs of an
    in-process driver, with world changes drawn per phase while it runs and
    while it is stopped; each stall a change must cause is waited for and
    answered with its recovery; at the end every output is compared with the
    model. ``pg_url``: a database with ``wal_level=logical`` (the CDC lanes'
    tables, and the Postgres sinks' tables); ``registry_url``: a schema
    registry (tests/registry.py) for the Avro lane."""
    from reclock.cli import main
    from reclock.config import load_config
    from tests.running import running, wait_for
    from tests.sources.cdc import drop_source_state, flushed_lsn

    rng = random.Random(seed * 7 + 3)
    lanes, tables = plan(seed, sequences)
    outcome = Outcome(sequences=sequences, records=sum(len(x.records) for x in lanes.values())
                      + sum(len(t.records) for t in tables.values()))
    world = World(lanes, tables, kafka, pg_url, registry_url, rng)
    for lane in lanes.values():
        world.create(lane, 1)
    drawn = {n: len(x.records) for n, x in lanes.items()}
    drawn.update({n: len(t.records) for n, t in tables.items()})

    def due(name: str, phase: int, part: int, parts: int) -> int:
        """How many of the lane's records are written by the end of ``part``
        of ``parts`` of ``phase``: each phase writes its share, in even
        parts (records a change wrote early are counted)."""
        lo, hi = drawn[name] * phase // phases, drawn[name] * (phase + 1) // phases
        return lo + (hi - lo) * (part + 1) // parts

    for t in tables.values():  # the first start's snapshot holds rows
        world.create_table(t)
        world.write(t, due(t.name, 0, 0, 2))
    path = tmp / "world.yaml"
    path.write_text(config(tmp, lanes, tables, kafka.bootstrap, pg_url, registry_url))
    cfg = load_config(path)
    state = tmp / "state"
    changes = draw(rng, phases, per_phase)

    def caught_up(runners: list[Any]) -> None:
        names = list(lanes)
        target = flushed_lsn(pg_url)
        pg = [n for n, t in tables.items() if not t.refused]  # (a refused one is stalled)

        def done() -> bool:
            stuck = {r.name: r.health for r in runners if r.name in pg
                     and r.health.status == "stalled" and r.health.definite}
            assert not stuck, f"a definite error no change called for: {stuck}; DDL " + str(
                {n: t.ddls for n, t in tables.items()})
            return (all(durable_records(cfg, n) >= lanes[n].cursor for n in names)
                    and all(durable_lsn(cfg, n) >= target for n in pg))

        wait_for(done, timeout,
                 lambda: "caught up: " + str(
                     {n: (durable_records(cfg, n), lanes[n].cursor) for n in names})
                 + f" {({n: (durable_lsn(cfg, n), target) for n in pg})}; health "
                 + str({r.name: r.health for r in runners if r.health.status != "running"})
                 + "; DDL " + str({n: t.ddls for n, t in tables.items()}))

    def opened(runners: list[Any]) -> None:
        """Every table's output holds its snapshot: the source described the
        table (its column history starts there) before any change made now."""
        wait_for(lambda: all(durable_lsn(cfg, n) > 0 for n in tables), timeout,
                 lambda: f"snapshots: {({n: durable_lsn(cfg, n) for n in tables})}; health "
                 + str({r.name: r.health for r in runners if r.name in tables})
                 + "; DDL " + str({n: t.ddls for n, t in tables.items()}))

    def stalled(runners: list[Any], lane: str) -> None:
        r = next(x for x in runners if x.name == lane)
        wait_for(lambda: r.health.status == "stalled" and r.health.definite
                 and (r.health.error or "").startswith("IdentityChanged"), timeout,
                 lambda: f"{lane}: the definite error, health {r.health}")
        outcome.faults[f"stalled {lane}"] += 1

    def refused(runners: list[Any], t: PgLane) -> None:
        """The diff-log table's refused change: a definite error naming the
        table, a column the rules refuse the change of, and the way out."""
        if t.stalled:
            return  # (an earlier refusal since the last re-read stalled it)
        r = next(x for x in runners if x.name == t.name)

        def named() -> bool:
            h = r.health
            err = h.error or ""
            return (h.status == "stalled" and h.definite and f'"public"."{t.name}"' in err
                    and any(repr(c) in err for c in t.refused)
                    and "drop the output and" in (h.hint or "") and "snapshot" in (h.hint or ""))

        wait_for(named, timeout, lambda: f"{t.name}: a definite error naming the table, one of "
                                         f"{t.refused} and the way out; health {r.health}; "
                                         f"DDL {t.ddls}")
        t.stalled = True
        outcome.faults[f"refused {t.name}"] += 1

    def apply(c: Change, runners: list[Any] | None) -> Callable[[list[Any]], None] | None:
        """Make change ``c``; returns what to do once the driver runs (wait
        for the stall it must cause and recover), if anything."""
        when = "running" if c.running else "stopped"
        if c.lane in tables:
            t = tables[c.lane]
            if c.kind == "damage_keys":
                kind, stall = c.kind, None
                _damage(keys_dir / c.lane / f"{c.lane}.sqlite", rng)
            else:
                kind, stall = world.ddl(t, c.kind)
                t.ddls[-1] += f" ({when})"
            outcome.faults[f"{kind} {c.lane} {when}"] += 1
            if stall is None or t.stalled:
                return None

            def wait_refused(rs: list[Any], t: PgLane = t) -> None:
                refused(rs, t)
            return wait_refused
        lane = lanes[c.lane]
        if c.kind == "new_version":
            what = world.new_version(lane)
            outcome.faults[f"new_version ({what}) {when}"] += 1
            if runners is None:  # the producer uses it while the driver is stopped
                world.produce(lane, 3)
            return None
        outcome.faults[f"{c.kind} {when}"] += 1
        if c.kind == "recreate":
            if runners is not None:
                caught_up_kafka([c.lane])  # nothing unread goes with the topic
            world.recreate(lane)
            if lane.naming == "pattern":
                return None

            def accept(rs: list[Any], name: str = c.lane, topic: str = lane.topic) -> None:
                stalled(rs, name)
                assert main(["accept-recreated", str(path), name, topic]) == 0
            return accept
        if c.kind == "add_partitions":
            world.add_partitions(lane)
            return None
        if c.kind == "delete_progress":
            if runners is not None:
                caught_up_kafka([c.lane])  # (the sink made its topics, and committed)
            kafka.delete_topic(f"{lane.topic}-out.reclock-progress")

            def rebuild(rs: list[Any], name: str = c.lane) -> None:
                stalled(rs, name)
                assert main(["resnapshot", str(path), name, name]) == 0
            return rebuild
        if c.kind == "damage_keys":
            _damage(keys_dir / c.lane / f"{c.lane}.sqlite", rng)
            return None
        raise AssertionError(c.kind)

    def caught_up_kafka(names: list[str]) -> None:
        wait_for(lambda: all(durable_records(cfg, n) >= lanes[n].cursor for n in names),
                 timeout, lambda: "caught up: " + str(
                     {n: (durable_records(cfg, n), lanes[n].cursor) for n in names}))

    def reread() -> None:
        """The way out of each refused change seen: drop the output and the
        source's state; the next start reads the table in its shape now."""
        for t in tables.values():
            if t.stalled:
                drop_source_state(cfg, t.name)
                t.reread()
                outcome.faults[f"re-read {t.name}"] += 1

    keys_dir = state / "keys"
    try:
        for ph, phase in enumerate(changes):
            # made while the driver is stopped (the previous phase ended caught up,
            # but for a table whose refused change is re-read now)
            recover = [then for c in phase if not c.running
                       if (then := apply(c, None)) is not None]
            reread()
            with running(cfg, spark) as runners:
                opened(runners)
                for then in recover:
                    then(runners)
                live = [c for c in phase if c.running]
                slices = len(live) + 2
                for s in range(slices):
                    for n, lane in lanes.items():
                        world.produce(lane, due(n, ph, s, slices) - lane.cursor)
                    for n, t in tables.items():
                        world.write(t, due(n, ph, s, slices) - t.cursor)
                    if s < len(live):
                        then = apply(live[s], runners)
                        if then is not None:
                            then(runners)
                caught_up(runners)
        if any(t.stalled for t in tables.values()):  # refused in the last phase
            reread()
            with running(cfg, spark) as runners:
                opened(runners)
                caught_up(runners)
    finally:
        world.close()
    for lane in lanes.values():
        compare(cfg, lane, outcome)
    for t in tables.values():
        compare_table(cfg, t, outcome)
    return outcome


def _damage(f: Path, rng: random.Random) -> None:
    """A stretch in the middle of a key-state file overwritten."""
    if f.exists() and f.stat().st_size > 8192:
        with open(f, "r+b") as fh:
            fh.seek(f.stat().st_size // 2)
            fh.write(bytes(rng.randrange(256) for _ in range(4096)))
