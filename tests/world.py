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
    partitions added            append lanes                read from offset 0
    progress topic deleted      the Kafka sink lane         the source stalls (IdentityChanged),
                                                            `reclock resnapshot` rebuilds the output
    key-state file damaged      keyed lanes                 rebuilt from the output
    values moving between keys  a state table keyed by      one row per key, always
                                [id, body], bodies a few
                                addresses ids pass around

A topic is deleted only once its lane's output holds every record written to
it (records deleted before they are read are gone with the topic, which the
source says in its log: they are nobody's to land).

The model is a plain computation over the records the harness produced, each
known by where Kafka put it (topic id, partition, offset: from the
producer's delivery reports): an append lane holds each record once at its
position, a keyed lane the latest value per key, and records a sink cannot
store are error rows at their positions. An output's ``_src_part`` is mapped
to (topic id, partition) through what the source recorded in the remap
store (its coordinate names and topic records); the mapping is the only thing
read from reclock's own state, and a wrong one shows as lost and unexpected
rows.

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

import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import Producer, TopicCollection

from tests.generative import KAFKA_SINK_MAX, OVERSIZED, Outcome, _norm, _row, _value, refuses

#: (lane, envelope, topic naming, sink)
LANES = [
    ("app_delta", "none", "topic", "file"),
    ("pat_pglog", "none", "pattern", "pglog"),
    ("up_delta", "upsert", "topic", "file"),
    ("up_pgstate", "upsert", "topic", "pgstate"),
    ("up_kafka", "upsert", "topic", "kafka"),
    ("mv_pgstate", "upsert", "topic", "pgstate"),
]

#: The values of the ``mv_pgstate`` lane: a few addresses that move between
#: keys (unique per key at a time is not promised upstream: the state table is
#: keyed by ``[id, body]``, which contains the upsert key).
EMAILS = [f"user{i}@example.com" for i in range(6)]

#: which changes each lane can be drawn for
CHANGES: dict[str, tuple[str, ...]] = {
    "app_delta": ("recreate", "add_partitions"),
    "pat_pglog": ("recreate", "add_partitions"),
    "up_delta": ("recreate", "damage_keys"),
    "up_pgstate": ("recreate", "damage_keys"),
    "up_kafka": ("delete_progress", "damage_keys"),
    "mv_pgstate": ("recreate", "damage_keys"),
}


@dataclass
class Lane:
    name: str
    envelope: str
    naming: str  # topic or pattern
    sink: str
    topic: str
    #: (key, ("put", value, existed) | ("delete",)) in the order produced
    records: list[tuple[int, tuple[Any, ...]]] = field(default_factory=list)
    #: where each produced record went: (topic id, partition, offset)
    at: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    cursor: int = 0  # records produced so far
    partitions: int = 1
    topic_id: str = ""
    incarnations: list[str] = field(default_factory=list)

    @property
    def keyed(self) -> bool:
        return self.envelope != "none"

    def refuses(self, value: dict[str, Any]) -> bool:
        return refuses(self.sink, value)


def plan(seed: int, sequences: int, ops_per_sequence: int = 6) -> dict[str, Lane]:
    """Draw the lanes' records (deterministic in ``seed``)."""
    rng = random.Random(seed)
    run = uuid.uuid4().hex[:8]
    lanes = {n: Lane(n, env, naming, sink, f"world-{run}-{n}")
             for n, env, naming, sink in LANES}
    order = list(lanes.values())
    for s in range(sequences):
        lane = order[s % len(order)]
        keys = [s * 100 + j for j in range(rng.randint(1, 4))]
        live: dict[int, dict[str, Any]] = {}
        for _ in range(rng.randint(1, ops_per_sequence)):
            k = rng.choice(keys)
            if lane.keyed and k in live and rng.random() < 0.3:
                lane.records.append((k, ("delete",)))
                live.pop(k)
            else:
                v = _value(rng, pg_text=False)
                if lane.name == "mv_pgstate":  # an address another key may have had
                    v["body"] = rng.choice(EMAILS)
                lane.records.append((k, ("put", v, k in live)))
                live[k] = v
    return lanes


def config(tmp: Path, lanes: dict[str, Lane], bootstrap: str, pg_url: str) -> str:
    out = [f"state_dir: {tmp}/state", "timestamp_interval: 200ms",
           "spark: {max_records_per_job: 400}", "sources:"]
    for lane in lanes.values():
        out.append(f"  - name: {lane.name}")
        what = (f"topic: {lane.topic}" if lane.naming == "topic"
                else f'topic_pattern: "{lane.topic}(-.*)?"')
        out.append(f'    kafka: {{bootstrap_servers: "{bootstrap}", {what}, timeout: 5s}}')
        out.append("    outputs:")
        out.append(f"      - name: {lane.name}")
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
    return "\n".join(out) + "\n"


def _topic_id(admin: Any, topic: str) -> str:
    return str(admin.describe_topics(TopicCollection([topic]))[topic].result().topic_id)


class World:
    """The lanes' topics, a producer that learns where each record went, and
    the changes applied to them."""

    def __init__(self, lanes: dict[str, Lane], kafka: Any, rng: random.Random) -> None:
        self.lanes, self.kafka, self.rng = lanes, kafka, rng
        self.producer = Producer({"bootstrap.servers": kafka.bootstrap, "linger.ms": 5,
                                  "enable.idempotence": True,
                                  "message.max.bytes": 2 * len(OVERSIZED)})

    def create(self, lane: Lane, partitions: int) -> None:
        self.kafka.create_topic(lane.topic, partitions)
        lane.partitions = partitions
        lane.topic_id = _topic_id(self.kafka.admin(), lane.topic)
        lane.incarnations.append(lane.topic_id)

    def produce(self, lane: Lane, n: int) -> None:
        """The lane's next ``n`` records, flushed, with their positions."""
        upto = min(len(lane.records), lane.cursor + n)
        for i in range(lane.cursor, upto):
            key, op = lane.records[i]
            kb = json.dumps({"id": key}).encode()
            vb = None if op[0] == "delete" else json.dumps(op[1]).encode()
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


def durable_records(cfg: Any, lane: str) -> int:
    """How many records the lane's output has read (its progress' offsets,
    summed over every partition id: earlier incarnations keep theirs)."""
    from reclock.core.frontier import Antichain
    from reclock.core.time import kafka_offsets

    pipe, sink = _sink(cfg, lane)
    try:
        p = sink.state().progress
    finally:
        sink.close()
        pipe.close()
    return 0 if p is None else sum(kafka_offsets(Antichain.decode_json("kafka", p))[0].values())


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
    from sinks.consolidate import consolidate

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
        rows = ok.select(["id", "body", "x"]).to_pylist()
        ok_pos = [p for p, e in zip(pos, err, strict=True) if e is None]
        got = Counter((p, (r["id"], r["body"], _norm(r["x"]))) for p, r in zip(
            ok_pos, rows, strict=True))
        want = Counter({(lane.at[i], _row(k, op[1])): 1 for i, k, op in produced
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
        rows = [(r["id"], r["body"], _norm(r["x"]), 1) for r in ok.to_pylist()]
    else:
        rows = [(r["id"], r["body"], _norm(r["x"]), int(r["_count"]))
                for r in consolidate(ok, None, ["id", "body", "x"]).to_pylist()]
    for k, body, x, n in rows:
        held.setdefault(k, []).extend([(k, body, x)] * max(n, 0))
        if n < 0:
            outcome.add("wrong", f"{lane.name}: key {k} retracted more than held")
    for k in set(state) | set(held):
        w, g = state.get(k), held.get(k, [])
        if w is None and g:
            outcome.add("doubled", f"{lane.name}: deleted key {k} still holds {g[:2]!r}")
        elif w is not None and not g:
            outcome.add("lost", f"{lane.name}: key {k} (latest {w!r})")
        elif w is not None and g != [w]:
            outcome.add("wrong", f"{lane.name}: key {k} holds {g[:2]!r}, latest {w!r}")


# -- the run -------------------------------------------------------------------------------


@dataclass
class Change:
    kind: str
    lane: str
    running: bool


def draw(rng: random.Random, phases: int, per_phase: int) -> list[list[Change]]:
    """Per phase, the changes made in it: the first phase's while running
    only (there is nothing to change before the first start)."""
    out = []
    for ph in range(phases):
        changes = []
        for _ in range(per_phase):
            lane = rng.choice(list(CHANGES))
            changes.append(Change(rng.choice(CHANGES[lane]), lane,
                                  running=ph == 0 or rng.random() < 0.5))
        out.append(changes)
    return out


def run(tmp: Path, spark: Any, kafka: Any, pg_url: str, seed: int, sequences: int,
        phases: int = 3, per_phase: int = 3, timeout: float = 90.0) -> Outcome:
    """``sequences`` drawn from ``seed`` written over ``phases`` runs of an
    in-process driver, with world changes drawn per phase while it runs and
    while it is stopped; each stall a change must cause is waited for and
    answered with its recovery; at the end every output is compared with the
    model."""
    from reclock.cli import main
    from reclock.config import load_config
    from tests.running import running, wait_for

    rng = random.Random(seed * 7 + 3)
    lanes = plan(seed, sequences)
    outcome = Outcome(sequences=sequences, records=sum(len(x.records) for x in lanes.values()))
    world = World(lanes, kafka, rng)
    for lane in lanes.values():
        world.create(lane, 1)
    path = tmp / "world.yaml"
    path.write_text(config(tmp, lanes, kafka.bootstrap, pg_url))
    cfg = load_config(path)
    keys_dir = tmp / "state" / "keys"
    changes = draw(rng, phases, per_phase)

    def caught_up(names: list[str] | None = None) -> None:
        names = names or list(lanes)
        wait_for(lambda: all(durable_records(cfg, n) >= lanes[n].cursor for n in names),
                 timeout, lambda: "caught up: " + str(
                     {n: (durable_records(cfg, n), lanes[n].cursor) for n in names}))

    def stalled(runners: list[Any], lane: str) -> None:
        r = next(x for x in runners if x.name == lane)
        wait_for(lambda: r.health.status == "stalled" and r.health.definite
                 and (r.health.error or "").startswith("IdentityChanged"), timeout,
                 lambda: f"{lane}: the definite error, health {r.health}")
        outcome.faults[f"stalled {lane}"] += 1

    def apply(c: Change, runners: list[Any] | None) -> Callable[[list[Any]], None] | None:
        """Make change ``c``; returns what to do once the driver runs (wait
        for the stall it must cause and recover), if anything."""
        lane = lanes[c.lane]
        outcome.faults[f"{c.kind} {'running' if c.running else 'stopped'}"] += 1
        if c.kind == "recreate":
            if runners is not None:
                caught_up([c.lane])  # nothing unread goes with the topic
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
                caught_up([c.lane])  # (the sink made its topics, and committed)
            kafka.delete_topic(f"{lane.topic}-out.reclock-progress")

            def rebuild(rs: list[Any], name: str = c.lane) -> None:
                stalled(rs, name)
                assert main(["resnapshot", str(path), name, name]) == 0
            return rebuild
        if c.kind == "damage_keys":
            f = keys_dir / c.lane / f"{c.lane}.sqlite"
            if f.exists() and f.stat().st_size > 8192:
                with open(f, "r+b") as fh:  # a stretch in the middle overwritten
                    fh.seek(f.stat().st_size // 2)
                    fh.write(bytes(rng.randrange(256) for _ in range(4096)))
            return None
        raise AssertionError(c.kind)

    per_phase_records = {n: -(-len(x.records) // phases) for n, x in lanes.items()}
    try:
        for phase in changes:
            # made while the driver is stopped (the previous phase ended caught up)
            recover = [then for c in phase if not c.running
                       if (then := apply(c, None)) is not None]
            with running(cfg, spark) as runners:
                for then in recover:
                    then(runners)
                live = [c for c in phase if c.running]
                slices = len(live) + 2
                for s in range(slices):
                    for n, lane in lanes.items():
                        world.produce(lane, -(-per_phase_records[n] // slices))
                    if s < len(live):
                        then = apply(live[s], runners)
                        if then is not None:
                            then(runners)
                caught_up()
    finally:
        world.producer.flush(10)
    for lane in lanes.values():
        compare(cfg, lane, outcome)
    return outcome
