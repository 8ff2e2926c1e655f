"""A seeded generative fault harness with an independent model.

It draws *sequences*: each one owns a few keys and makes random changes to
them (inserts, updates, deletes, hostile but valid values: unicode, quotes,
control characters, empty and long strings, extreme numbers). Sequences are
spread over one pipeline's sources, one per (envelope, sink) pair:

    none     -> Delta, Postgres log        every record once
    upsert   -> Delta, Postgres state, Kafka   the latest value per key
    debezium (keyed) -> Delta               the table's state per key

While the pipeline runs, faults are injected at random moments through
:mod:`reclock.faults` (a failed stage, a failed commit, a transient source
error). At the end every output is compared with the model: a plain Python
computation over the records the harness produced, sharing nothing with the
pipeline (no decoder, no envelope, no verify). It returns what was tried and
what was lost or doubled.

Used by ``tests/reclock/test_generative.py`` (a small budget) and by
``bench/generative_soak.py`` (a long soak).
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
from confluent_kafka import Producer

from reclock import faults

#: (source name, envelope, sink) of each lane of the pipeline.
LANES = [
    ("none_delta", "none", "file"),
    ("none_pglog", "none", "pglog"),
    ("up_delta", "upsert", "file"),
    ("up_pgstate", "upsert", "pgstate"),
    ("up_kafka", "upsert", "kafka"),
    ("dbz_delta", "debezium", "file"),
]

_HOSTILE = ["", " ", "ünïcødé ✓", "日本語", "emoji 🦀🚀", 'quo"te', "back\\slash", "tab\tnl\n",
            "\u2028line sep", "x" * 3000, "NULL", "null", "{}", "[1,2]", "ﬁ", "\u0007bell"]


def _value(rng: random.Random) -> dict[str, Any]:
    body = rng.choice(_HOSTILE) if rng.random() < 0.6 else f"v{rng.randrange(10**9)}"
    x = rng.choice([0.0, -0.0, 1e308, -2.5e-300, 3.5, 2**53 + 1.0, None])
    return {"body": body, "x": x}


@dataclass
class Lane:
    source: str
    envelope: str
    sink: str
    topic: str
    sequences: list[int] = field(default_factory=list)
    records: list[tuple[int | None, Any]] = field(default_factory=list)  # (key, value or None)


@dataclass
class Outcome:
    sequences: int = 0
    records: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    lost: int = 0
    doubled: int = 0
    wrong: int = 0
    samples: list[str] = field(default_factory=list)

    def add(self, kind: str, what: str, n: int = 1) -> None:
        setattr(self, kind, getattr(self, kind) + n)
        if len(self.samples) < 10:
            self.samples.append(f"{kind}: {what}")


def plan(seed: int, sequences: int, ops_per_sequence: int = 6) -> dict[str, Lane]:
    """Draw the sequences (deterministic in ``seed``)."""
    rng = random.Random(seed)
    run = uuid.uuid4().hex[:8]
    lanes = {name: Lane(name, env, sink, f"gen-{run}-{name}") for name, env, sink in LANES}
    order = list(lanes.values())
    for s in range(sequences):
        lane = order[s % len(order)]
        lane.sequences.append(s)
        keys = [s * 100 + j for j in range(rng.randint(1, 4))]
        live: dict[int, dict[str, Any]] = {}
        for _ in range(rng.randint(1, ops_per_sequence)):
            k = rng.choice(keys)
            if lane.envelope != "none" and k in live and rng.random() < 0.3:
                lane.records.append((k, ("delete", live.pop(k))))
            else:
                v = _value(rng)
                lane.records.append((k, ("put", v, live.get(k))))
                live[k] = v
    return lanes


def config(tmp: Path, lanes: dict[str, Lane], bootstrap: str, pg_url: str) -> str:
    out = [f"state_dir: {tmp}/state", "timestamp_interval: 200ms",
           "spark: {max_records_per_job: 400}", "sources:"]
    for lane in lanes.values():
        out.append(f"  - name: {lane.source}")
        out.append(f'    kafka: {{bootstrap_servers: "{bootstrap}", topic: {lane.topic}, '
                   "timeout: 5s}")
        out.append("    outputs:")
        out.append(f"      - name: {lane.source}")
        if lane.envelope == "debezium":
            out.append("        format: {type: json, schema: {id: int64, body: string, "
                       "x: float64}}")
            out.append("        envelope: {type: debezium, key: [id]}")
        else:
            out.append("        format: {type: json, schema: {body: string, x: float64}}")
            out.append("        key_format: {type: json, schema: {id: int64}}")
            if lane.envelope == "upsert":
                out.append("        envelope: {type: upsert, key: [id]}")
        sink = {"file": "file",
                "pglog": f'{{type: postgres, dsn: "{pg_url}", table: {lane.source}}}',
                "pgstate": f'{{type: postgres, dsn: "{pg_url}", table: {lane.source}, '
                           "mode: state, key: [id]}",
                "kafka": f'{{type: kafka, bootstrap_servers: "{bootstrap}", '
                         f"topic: {lane.topic}-out}}"}[lane.sink]
        out.append(f"        sink: {sink}")
    return "\n".join(out) + "\n"


def _encode(lane: Lane, key: int | None, op: Any) -> tuple[bytes | None, bytes | None]:
    kb = json.dumps({"id": key}).encode()
    if lane.envelope == "debezium":
        kind = op[0]
        if kind == "delete":
            ev = {"op": "d", "before": {"id": key}, "after": None}  # key-only before
        else:
            after = {"id": key, **op[1]}
            ev = {"op": "u" if op[2] is not None else "c", "before": None, "after": after}
        return kb, json.dumps(ev).encode()
    if op[0] == "delete":
        return kb, None
    return kb, json.dumps(op[1]).encode()


def produce_all(bootstrap: str, lanes: dict[str, Lane], rng: random.Random, running: Any,
                outcome: Outcome) -> None:
    """Produce every lane's records in random slices, arming a random fault
    now and then while the pipeline runs."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True})
    cursors = {name: 0 for name in lanes}
    while any(cursors[n] < len(lanes[n].records) for n in lanes):
        name = rng.choice([n for n in lanes if cursors[n] < len(lanes[n].records)])
        lane = lanes[name]
        take = rng.randint(1, 40)
        for key, op in lane.records[cursors[name]:cursors[name] + take]:
            k, v = _encode(lane, key, op)
            p.produce(lane.topic, key=k, value=v, partition=0)
        cursors[name] += take
        p.poll(0)
        if rng.random() < 0.25:
            point = rng.choice(["stage", "commit", "commit", "source"])
            faults.arm(point)
            outcome.faults[point] += 1
        time.sleep(rng.uniform(0.0, 0.15))
    assert p.flush(60) == 0


def model(lane: Lane) -> dict[int, Any]:
    """What the lane's output must hold. none: Counter of (key, body, x) per
    record; keyed: key -> (body, x) of the latest value."""
    if lane.envelope == "none":
        return dict(Counter((k, op[1]["body"], op[1]["x"]) for k, op in lane.records))
    state: dict[int, Any] = {}
    for k, op in lane.records:
        if op[0] == "delete":
            state.pop(k, None)  # type: ignore[arg-type]
        else:
            state[k] = (op[1]["body"], op[1]["x"])  # type: ignore[index]
    return state


def _norm(x: Any) -> Any:
    return None if x is None else float(x)


def compare(lane: Lane, updates: Any, outcome: Outcome) -> None:
    """The lane's output (its update log, read back) against the model."""
    from sinks.consolidate import consolidate

    ok = updates.filter(pc.is_null(updates.column("_error")))
    errors = updates.num_rows - ok.num_rows
    if errors:
        outcome.add("wrong", f"{lane.source}: {errors} error rows for valid records")
    want = model(lane)
    if lane.envelope == "none":
        got = Counter((r["id"], r["body"], _norm(r["x"])) for r in ok.select(
            ["id", "body", "x"]).to_pylist())
        exp = Counter({(k, b, _norm(x)): n for (k, b, x), n in want.items()})
        for item, n in exp.items():
            if got[item] < n:
                outcome.add("lost", f"{lane.source}: {item!r}", n - got[item])
            elif got[item] > n:
                outcome.add("doubled", f"{lane.source}: {item!r}", got[item] - n)
        for item, n in got.items():
            if item not in exp:
                outcome.add("wrong", f"{lane.source}: unexpected {item!r}", n)
        return
    rows = consolidate(ok, None, ["id", "body", "x"]).to_pylist()
    held: dict[int, list[tuple[Any, Any]]] = {}
    for r in rows:
        held.setdefault(r["id"], []).extend([(r["body"], _norm(r["x"]))] * int(r["_count"]))
        if int(r["_count"]) < 0:
            outcome.add("wrong", f"{lane.source}: key {r['id']} retracted more than held")
    for k in set(want) | set(held):
        w = want.get(k)
        g = held.get(k, [])
        if w is None and g:
            outcome.add("doubled", f"{lane.source}: deleted key {k} still holds {g[:2]!r}")
        elif w is not None and not g:
            outcome.add("lost", f"{lane.source}: key {k} (latest {w!r})")
        elif w is not None and (len(g) != 1 or g[0] != (w[0], _norm(w[1]))):
            outcome.add("wrong", f"{lane.source}: key {k} holds {g[:2]!r}, latest {w!r}")


def run(tmp: Path, spark: Any, kafka: Any, pg_url: str, seed: int, sequences: int,
        timeout: float = 240.0) -> Outcome:
    """One pipeline run over ``sequences`` drawn from ``seed``."""
    from reclock.config import load_config
    from reclock.pipeline import Pipeline
    from tests.running import running, wait_for

    rng = random.Random(seed * 7919 + 1)
    lanes = plan(seed, sequences)
    outcome = Outcome(sequences=sequences, records=sum(len(x.records) for x in lanes.values()))
    for lane in lanes.values():
        kafka.create_topic(lane.topic, 1)
    path = tmp / "gen.yaml"
    path.write_text(config(tmp, lanes, kafka.bootstrap, pg_url))
    cfg = load_config(path)
    try:
        with running(cfg, spark) as runners:
            produce_all(kafka.bootstrap, lanes, rng, runners, outcome)
            ends = {n: len(x.records) for n, x in lanes.items()}

            def durable(r: Any) -> int:
                from reclock.frontier import Antichain
                from reclock.time import kafka_offsets

                p = r.outputs[0].state.progress
                return 0 if p is None else sum(
                    kafka_offsets(Antichain.decode_json("kafka", p))[0].values())

            wait_for(lambda: all(durable(r) >= ends[r.name] for r in runners), timeout,
                     lambda: str({r.name: (durable(r), ends[r.name], r.health.status,
                                           r.health.error) for r in runners}))
    finally:
        faults.disarm()
    pipe = Pipeline(cfg)
    try:
        for lane in lanes.values():
            src = pipe.source_config(lane.source)
            compare(lane, pipe.sink(src, src.output(lane.source)).read_updates(), outcome)
    finally:
        pipe.close()
    return outcome
