"""A seeded generative fault harness with an independent model.

It draws *sequences*: each one owns a few keys and makes random changes to
them (inserts, updates, deletes, hostile values: unicode, quotes, control
characters, NUL, empty, long and oversized strings, extreme numbers).
Sequences are spread over one pipeline's *lanes*, each a source, an envelope
and a sink:

    kafka     none     -> Delta, Postgres log             every record once
    kafka     upsert   -> Delta, Postgres state, Kafka,   the latest value per key
                          Iceberg state, Delta state
    kafka     debezium -> Delta (keyed)                   the table's state per key
    postgres  CDC      -> Delta (keyed by the primary key), the table's state per key
                          Iceberg state, Delta state
    generator counter  -> Postgres log                    every counter value once

Some values are ones the lane's sink cannot store: a NUL character for
PostgreSQL, a record over the Kafka sink's ``message.max.bytes``. The model
says they land in the error collection at their position, and that a keyed
output's key keeps its previous value. The generator's every 7th record is
malformed JSON: an error row too.

Faults, in one of two modes:

* ``run`` (in process): while the pipeline runs in a thread of this process,
  failures are armed at random moments through :mod:`reclock.faults` (a
  failed stage, a failed commit, a transient source error).
* ``run_killed`` (``reclock run`` in processes of its own): each driver
  process is started with a random ``RECLOCK_CRASH_AT`` crash point (SIGKILL
  at a step of the commit path; a Delta state lane's commit points first,
  :func:`crash_deck`) and ``RECLOCK_FAIL_AT`` failures (stage,
  commit, source, rows the sink refuses, hung tasks, damaged key-state
  files: every point of ``reclock.faults``), and is SIGKILLed from outside
  at a random moment if it lives that long. The Postgres lane is left out of
  this mode: an injected refusal there could not be matched to the change it
  refused (SIGKILLs of CDC are the Postgres kill test's subject).

At the end every output is compared with the model: a plain Python
computation over the records the harness produced, position by position,
sharing nothing with the pipeline (no decoder, no envelope, no verify). A row
that the pipeline refused by injection is excused by its position, and only
when its error names the injection. It returns what was tried and what was
lost, doubled or wrong.

Used by ``tests/reclock/test_generative.py`` (small budgets) and by
``bench/generative_soak.py`` (a long soak).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
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
from confluent_kafka import Producer

from reclock import faults

#: (lane name, source, envelope, sink).
LANES = [
    ("none_delta", "kafka", "none", "file"),
    ("none_pglog", "kafka", "none", "pglog"),
    ("up_delta", "kafka", "upsert", "file"),
    ("up_pgstate", "kafka", "upsert", "pgstate"),
    ("up_kafka", "kafka", "upsert", "kafka"),
    ("dbz_delta", "kafka", "debezium", "file"),
    ("cdc_delta", "pg", "cdc", "file"),
    ("gen_pglog", "gen", "none", "pglog"),
    ("up_icestate", "kafka", "upsert", "icestate"),
    ("cdc_icestate", "pg", "cdc", "icestate"),
    ("up_deltastate", "kafka", "upsert", "deltastate"),
    ("cdc_deltastate", "pg", "cdc", "deltastate"),
]

#: The Kafka sink's ``message.max.bytes`` in the harness; bodies are either
#: well under it or well over it.
KAFKA_SINK_MAX = 20_000
OVERSIZED = "o" * 25_000
GEN_BAD_EVERY = 7
INJECTED = "injected refusal"

_HOSTILE = ["", " ", "ünïcødé ✓", "日本語", "emoji 🦀🚀", 'quo"te', "back\\slash", "tab\tnl\n",
            "\u2028line sep", "x" * 3000, "NULL", "null", "{}", "[1,2]", "ﬁ", "\u0007bell",
            "nul\x00inside", "\x00", OVERSIZED]


def _value(rng: random.Random, pg_text: bool) -> dict[str, Any]:
    """A random value; ``pg_text``: one PostgreSQL text can hold (no NUL)."""
    body = rng.choice(_HOSTILE) if rng.random() < 0.6 else f"v{rng.randrange(10**9)}"
    if pg_text and "\x00" in body:
        body = body.replace("\x00", "0")
    x = rng.choice([0.0, -0.0, 1e308, -2.5e-300, 3.5, 2**53 + 1.0, None])
    return {"body": body, "x": x}


def refuses(sink: str, value: dict[str, Any]) -> bool:
    """The model's rule: what a lane's sink (``pglog``, ``pgstate``,
    ``kafka``, ``file``) cannot store of a value."""
    if sink in ("pglog", "pgstate"):
        return "\x00" in value["body"]
    if sink == "kafka":
        return len(value["body"].encode()) > KAFKA_SINK_MAX
    return False


@dataclass
class Lane:
    name: str
    source: str  # kafka, pg, gen
    envelope: str  # none, upsert, debezium, cdc
    sink: str  # file, pglog, pgstate, kafka, icestate, deltastate
    topic: str
    sequences: list[int] = field(default_factory=list)
    #: kafka: the record at offset i; pg: the i-th change; (key, ("put", value) or ("delete",))
    records: list[tuple[int, tuple[Any, ...]]] = field(default_factory=list)
    gen_records: int = 0

    @property
    def keyed(self) -> bool:
        return self.envelope != "none"

    def refuses(self, value: dict[str, Any]) -> bool:
        """The model's rule: what this lane's sink cannot store."""
        return refuses(self.sink, value)

    def expected_errors(self) -> set[int]:
        """Positions (offsets) the model says land in the error collection."""
        if self.source == "gen":
            return {n for n in range(self.gen_records) if n % GEN_BAD_EVERY == GEN_BAD_EVERY - 1}
        return {i for i, (_, op) in enumerate(self.records)
                if op[0] == "put" and self.refuses(op[1])}


@dataclass
class Outcome:
    sequences: int = 0
    records: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    lost: int = 0
    doubled: int = 0
    wrong: int = 0
    refused: int = 0  # error rows the model expected (sink rules, malformed input)
    excused: int = 0  # error rows of injected refusals
    samples: list[str] = field(default_factory=list)

    def add(self, kind: str, what: str, n: int = 1) -> None:
        setattr(self, kind, getattr(self, kind) + n)
        if len(self.samples) < 10:
            self.samples.append(f"{kind}: {what}")


def plan(seed: int, sequences: int, lanes: list[str] | None = None,
         ops_per_sequence: int = 6, gen_records: int = 3000) -> dict[str, Lane]:
    """Draw the sequences (deterministic in ``seed``)."""
    rng = random.Random(seed)
    run = uuid.uuid4().hex[:8]
    picked = [x for x in LANES if lanes is None or x[0] in lanes]
    out = {name: Lane(name, src, env, sink, f"gen-{run}-{name}")
           for name, src, env, sink in picked}
    order = [x for x in out.values() if x.source != "gen"]
    for lane in out.values():
        if lane.source == "gen":
            lane.gen_records = gen_records
    for s in range(sequences):
        lane = order[s % len(order)]
        lane.sequences.append(s)
        keys = [s * 100 + j for j in range(rng.randint(1, 4))]
        live: dict[int, dict[str, Any]] = {}
        for _ in range(rng.randint(1, ops_per_sequence)):
            k = rng.choice(keys)
            if lane.keyed and k in live and rng.random() < 0.3:
                lane.records.append((k, ("delete",)))
                live.pop(k)
            else:
                v = _value(rng, pg_text=lane.source == "pg")
                lane.records.append((k, ("put", v, k in live)))
                live[k] = v
    return out


_PG_TABLE = "create table {t} (id bigint primary key, body text, x double precision)"


def config(tmp: Path, lanes: dict[str, Lane], bootstrap: str, pg_url: str,
           own_spark: bool = False) -> str:
    out = [f"state_dir: {tmp}/state", "timestamp_interval: 200ms"]
    if own_spark:
        out += ["spark:", "  master: local[2]", "  max_records_per_job: 400", "  conf:",
                '    spark.driver.extraJavaOptions: "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"']
    else:
        out.append("spark: {max_records_per_job: 400}")
    out.append("sources:")
    for lane in lanes.values():
        out.append(f"  - name: {lane.name}")
        if lane.source == "pg":
            out.append(f'    postgres: {{dsn: "{pg_url}", tables: [{lane.name}], timeout: 10s}}')
        elif lane.source == "gen":
            out.append(f"    generator: {{kind: counter, rate: 2000, max_records: "
                       f"{lane.gen_records}, bad_every: {GEN_BAD_EVERY}}}")
        else:
            out.append(f'    kafka: {{bootstrap_servers: "{bootstrap}", topic: {lane.topic}, '
                       "timeout: 5s}")
        out.append("    outputs:")
        out.append(f"      - name: {lane.name}")
        if lane.source == "gen":
            out.append("        format: {type: json, schema: {n: int64}}")
        elif lane.envelope == "debezium":
            out.append("        format: {type: json, schema: {id: int64, body: string, "
                       "x: float64}}")
            out.append("        envelope: {type: debezium, key: [id]}")
        elif lane.source == "kafka":
            out.append("        format: {type: json, schema: {body: string, x: float64}}")
            out.append("        key_format: {type: json, schema: {id: int64}}")
            if lane.envelope == "upsert":
                out.append("        envelope: {type: upsert, key: [id]}")
        sink = {"file": "file",
                "pglog": f'{{type: postgres, dsn: "{pg_url}", table: {lane.name}_out}}',
                "pgstate": f'{{type: postgres, dsn: "{pg_url}", table: {lane.name}_out, '
                           "mode: state, key: [id]}",
                "kafka": f'{{type: kafka, bootstrap_servers: "{bootstrap}", '
                         f"topic: {lane.topic}-out, "
                         f"properties: {{message.max.bytes: {KAFKA_SINK_MAX}}}}}",
                "icestate": f"{{type: iceberg, catalog: {{type: sql, uri: 'sqlite:///{tmp}/"
                            f"iceberg.db', warehouse: '{tmp}/warehouse'}}, "
                            f"table: gen.{lane.name}, mode: state, key: [id]}}",
                "deltastate": "{type: delta, mode: state, key: [id]}"}[lane.sink]
        out.append(f"        sink: {sink}")
    return "\n".join(out) + "\n"


def _encode(lane: Lane, key: int, op: tuple[Any, ...]) -> tuple[bytes, bytes | None]:
    kb = json.dumps({"id": key}).encode()
    if lane.envelope == "debezium":
        if op[0] == "delete":
            ev = {"op": "d", "before": {"id": key}, "after": None}  # key-only before
        else:
            ev = {"op": "u" if op[2] else "c", "before": None, "after": {"id": key, **op[1]}}
        return kb, json.dumps(ev).encode()
    if op[0] == "delete":
        return kb, None
    return kb, json.dumps(op[1]).encode()


def _pg_apply(c: psycopg.Connection[Any], lane: Lane, ops: list[tuple[int, tuple[Any, ...]]]
              ) -> None:
    with c.transaction():
        for key, op in ops:
            if op[0] == "delete":
                c.execute(f"delete from {lane.name} where id = %s", (key,))
            else:
                c.execute(f"insert into {lane.name} values (%s, %s, %s) on conflict (id) do "
                          "update set body = excluded.body, x = excluded.x",
                          (key, op[1]["body"], op[1]["x"]))


class Feed:
    """Writes every lane's records upstream in random slices (Kafka records to
    the lane's topic, Postgres changes as random transactions), calling
    ``between`` after each slice."""

    def __init__(self, lanes: dict[str, Lane], bootstrap: str, pg_url: str,
                 rng: random.Random) -> None:
        self.lanes, self.rng = lanes, rng
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5,
                                  "enable.idempotence": True,
                                  "message.max.bytes": 2 * len(OVERSIZED)})
        self.pg_url = pg_url
        self.cursors = {n: 0 for n, x in lanes.items() if x.source != "gen"}
        self.pg: psycopg.Connection[Any] | None = None
        if any(x.source == "pg" for x in lanes.values()):
            self.pg = psycopg.connect(pg_url)

    def prepare(self, admin: Any) -> None:
        """Create the topics and tables; write a fifth of each Postgres lane's
        changes before the pipeline starts (its snapshot holds them)."""
        for lane in self.lanes.values():
            if lane.source == "kafka":
                admin.create_topic(lane.topic, 1)
            elif lane.source == "pg" and self.pg is not None:
                with self.pg.transaction():
                    self.pg.execute(_PG_TABLE.format(t=lane.name))
                head = len(lane.records) // 5
                self._pg_slices(lane, head)

    def _pg_slices(self, lane: Lane, upto: int) -> None:
        assert self.pg is not None
        while self.cursors[lane.name] < upto:
            at = self.cursors[lane.name]
            n = min(upto - at, self.rng.randint(1, 5))
            _pg_apply(self.pg, lane, lane.records[at:at + n])
            self.cursors[lane.name] = at + n

    def run(self, between: Callable[[], None] = lambda: None, pause: float = 0.15) -> None:
        lanes, rng = self.lanes, self.rng
        while any(self.cursors[n] < len(lanes[n].records) for n in self.cursors):
            name = rng.choice([n for n in self.cursors if self.cursors[n] < len(lanes[n].records)])
            lane = lanes[name]
            take = rng.randint(1, 40)
            at = self.cursors[name]
            if lane.source == "pg":
                self._pg_slices(lane, min(len(lane.records), at + take))
            else:
                for key, op in lane.records[at:at + take]:
                    k, v = _encode(lane, key, op)
                    self.producer.produce(lane.topic, key=k, value=v, partition=0)
                self.cursors[name] = at + take
                self.producer.poll(0)
            between()
            time.sleep(rng.uniform(0.0, pause))
        assert self.producer.flush(60) == 0

    def close(self) -> None:
        if self.pg is not None:
            self.pg.close()


def _arm_randomly(rng: random.Random, outcome: Outcome) -> Callable[[], None]:
    def between() -> None:
        if rng.random() < 0.25:
            point = rng.choice(["stage", "commit", "commit", "source"])
            faults.arm(point)
            outcome.faults[point] += 1
    return between


# -- the model -----------------------------------------------------------------------------


def _norm(x: Any) -> Any:
    return None if x is None else float(x)


def _row(key: int, value: dict[str, Any]) -> tuple[Any, ...]:
    return (key, value["body"], _norm(value["x"]))


def compare(lane: Lane, updates: pa.Table, outcome: Outcome) -> None:
    """The lane's output (its update log, read back) against the model."""
    from reclock.contracts.consolidate import consolidate

    errs = updates.filter(pc.invert(pc.is_null(updates.column("_error"))))
    ok = updates.filter(pc.is_null(updates.column("_error")))
    expected = lane.expected_errors()
    injected: set[int] = set()
    positioned = lane.source != "pg"  # a Postgres change's position is its LSN
    seen: Counter[int] = Counter()
    for off, reason in zip(errs.column("_src_offset").to_pylist(),
                           errs.column("_error").to_pylist(), strict=True):
        seen[off] += 1
        if positioned and INJECTED in reason and off not in expected:
            injected.add(off)
        elif not positioned or off not in expected:
            outcome.add("wrong", f"{lane.name}: offset {off} refused: {reason[:120]}")
    for off, n in seen.items():
        if n > 1:
            outcome.add("doubled", f"{lane.name}: error row for offset {off} x{n}", n - 1)
    for off in expected - set(seen):
        outcome.add("lost", f"{lane.name}: offset {off} should be an error row")
    outcome.refused += len(expected & set(seen))
    outcome.excused += len(injected)
    excused = expected | injected

    if lane.source == "gen":
        got = Counter(zip(ok.column("_src_offset").to_pylist(), ok.column("n").to_pylist(),
                          strict=True))
        want = Counter({(n, n): 1 for n in range(lane.gen_records) if n not in excused})
        _counts(lane, got, want, outcome)
        return
    if not lane.keyed:
        got = Counter((r["_src_offset"], (r["id"], r["body"], _norm(r["x"])))
                      for r in ok.select(["_src_offset", "id", "body", "x"]).to_pylist())
        want = Counter({(i, _row(k, op[1])): 1 for i, (k, op) in enumerate(lane.records)
                        if i not in excused})
        _counts(lane, got, want, outcome)
        return
    state: dict[int, tuple[Any, ...]] = {}
    for i, (k, op) in enumerate(lane.records):
        if i in excused:
            continue  # refused: the key keeps its previous row
        if op[0] == "delete":
            state.pop(k, None)
        else:
            state[k] = _row(k, op[1])
    held: dict[int, list[tuple[Any, ...]]] = {}
    for r in consolidate(ok, None, ["id", "body", "x"]).to_pylist():
        n = int(r["_count"])
        held.setdefault(r["id"], []).extend([(r["id"], r["body"], _norm(r["x"]))] * max(n, 0))
        if n < 0:
            outcome.add("wrong", f"{lane.name}: key {r['id']} retracted more than held")
    for k in set(state) | set(held):
        w, g = state.get(k), held.get(k, [])
        if w is None and g:
            outcome.add("doubled", f"{lane.name}: deleted key {k} still holds {g[:2]!r}")
        elif w is not None and not g:
            outcome.add("lost", f"{lane.name}: key {k} (latest {w!r})")
        elif w is not None and g != [w]:
            outcome.add("wrong", f"{lane.name}: key {k} holds {g[:2]!r}, latest {w!r}")


def _counts(lane: Lane, got: Counter[Any], want: Counter[Any], outcome: Outcome) -> None:
    for item, n in want.items():
        if got[item] < n:
            outcome.add("lost", f"{lane.name}: {item!r}"[:200], n - got[item])
        elif got[item] > n:
            outcome.add("doubled", f"{lane.name}: {item!r}"[:200], got[item] - n)
    for item, n in got.items():
        if item not in want:
            outcome.add("wrong", f"{lane.name}: unexpected {item!r}"[:200], n)


# -- reading the pipeline's durable state from outside --------------------------------------


class Outputs:
    """The lanes' outputs, read through their sinks (from this process,
    whichever process drives the pipeline)."""

    def __init__(self, cfg: Any, lanes: dict[str, Lane]) -> None:
        from reclock.pipeline import Pipeline

        self.cfg, self.lanes = cfg, lanes
        self.pipe = Pipeline(cfg)
        self.sinks = {}
        for lane in lanes.values():
            src = self.pipe.source_config(lane.name)
            self.sinks[lane.name] = self.pipe.sink(src, src.output(lane.name))
        self.targets: dict[str, int] = {}

    def caught_up(self, name: str) -> bool:
        """Whether the lane's output holds everything written upstream."""
        from reclock.core.frontier import Antichain
        from reclock.core.time import kafka_offsets

        lane = self.lanes[name]
        p = self.sinks[name].state().progress
        if p is None:
            return False
        if lane.source == "kafka":
            got = sum(kafka_offsets(Antichain.decode_json("kafka", p))[0].values())
            return got >= len(lane.records)
        kind = "counter" if lane.source == "gen" else "lsn"
        frontier = Antichain.decode_json(kind, p)
        if not frontier.elements:
            return True  # finished
        want = lane.gen_records if lane.source == "gen" else self.targets[name]
        return min(int(t) for t in frontier.elements) >= want

    def pending(self) -> list[str]:
        return [n for n in self.lanes if not self.caught_up(n)]

    def compare(self, outcome: Outcome) -> None:
        for lane in self.lanes.values():
            compare(lane, self.sinks[lane.name].read_updates(), outcome)

    def close(self) -> None:
        self.pipe.close()


def _targets(lanes: dict[str, Lane], pg_url: str) -> dict[str, int]:
    if not any(x.source == "pg" for x in lanes.values()):
        return {}
    from tests.sources.cdc import flushed_lsn

    at = flushed_lsn(pg_url)
    return {n: at for n, x in lanes.items() if x.source == "pg"}


def _start(tmp: Path, kafka: Any, pg_url: str, seed: int, sequences: int,
           lanes: list[str] | None, own_spark: bool) -> tuple[dict[str, Lane], Feed, Any, Outcome]:
    from reclock.config import load_config

    drawn = plan(seed, sequences, lanes)
    outcome = Outcome(sequences=sequences, records=sum(
        len(x.records) + x.gen_records for x in drawn.values()))
    feed = Feed(drawn, kafka.bootstrap, pg_url, random.Random(seed * 7919 + 1))
    feed.prepare(kafka)
    path = tmp / "gen.yaml"
    path.write_text(config(tmp, drawn, kafka.bootstrap, pg_url, own_spark))
    return drawn, feed, load_config(path), outcome


def run(tmp: Path, spark: Any, kafka: Any, pg_url: str, seed: int, sequences: int,
        timeout: float = 240.0, lanes: list[str] | None = None) -> Outcome:
    """One in-process pipeline run over ``sequences`` drawn from ``seed``, with
    stage, commit and source failures armed at random moments. ``pg_url``
    must be a database with ``wal_level=logical`` for the Postgres lane."""
    from tests.running import running, wait_for

    drawn, feed, cfg, outcome = _start(tmp, kafka, pg_url, seed, sequences, lanes, False)
    outputs = None
    try:
        with running(cfg, spark) as runners:
            feed.run(_arm_randomly(random.Random(seed), outcome))
            outputs = Outputs(cfg, drawn)
            outputs.targets = _targets(drawn, pg_url)
            wait_for(lambda: not outputs.pending(), timeout,
                     lambda: f"caught up: pending {outputs.pending()}; " + str(
                         {r.name: (r.health.status, r.health.error) for r in runners}))
        outputs.compare(outcome)
    finally:
        faults.disarm()
        feed.close()
        if outputs is not None:
            outputs.close()
    return outcome


def crash_deck(rng: random.Random, lanes: dict[str, Lane]) -> list[str]:
    """The crash points the drivers are started with, dealt in this order:
    the Delta state commit's first when a lane has a Delta state output
    (only such a lane passes them; a small budget of drivers would rarely
    draw them from all the points), then the others shuffled."""
    state = [p for p in faults.STATE_POINTS
             if any(x.sink == "deltastate" for x in lanes.values())]
    rest = [p for p in faults.POINTS if p not in faults.STATE_POINTS]
    rng.shuffle(rest)
    return state + rest


def _driver_env(rng: random.Random, outcome: Outcome, seed: int, deck: list[str]
                ) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RECLOCK_CRASH_AT", None)
    env.pop("RECLOCK_FAIL_AT", None)
    if rng.random() < 0.7 and deck:
        point = deck.pop(0)
        # (a state commit point is passed once per commit of one lane: fewer
        # times than the others in a driver's few seconds)
        p = 0.5 if point in faults.STATE_POINTS else rng.choice([0.05, 0.1, 0.2])
        env["RECLOCK_CRASH_AT"] = f"{point}:{p}"
        env["RECLOCK_CRASH_SEED"] = str(seed)
        outcome.faults[f"crash-point {point}"] += 1
    fails = [p for p in faults.FAIL_POINTS if rng.random() < 0.5]
    if fails:
        env["RECLOCK_FAIL_AT"] = ",".join(f"{p}:{rng.randint(1, 2)}" for p in fails)
        for p in fails:
            outcome.faults[p] += 1
    return env


def run_killed(tmp: Path, kafka: Any, pg_url: str, seed: int, sequences: int,
               restarts: int = 5, timeout: float = 300.0, lanes: list[str] | None = None
               ) -> Outcome:
    """``sequences`` drawn from ``seed`` through ``reclock run`` processes:
    ``restarts`` of them with random crash points and failures armed, each
    SIGKILLed from outside at a random moment if it lives that long, while
    the records are written; then a clean one until the outputs caught up,
    stopped with SIGTERM. Every lane but the Postgres one by default."""
    from tests.running import close_driver, start_driver, stop_driver, wait_exit, wait_running

    lanes = lanes or [n for n, src, _, _ in LANES if src != "pg"]
    drawn, feed, cfg, outcome = _start(tmp, kafka, pg_url, seed, sequences, lanes, True)
    path = tmp / "gen.yaml"
    rng = random.Random(seed * 31 + 7)
    done = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            feed.run(pause=0.4)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            done.set()

    writer = threading.Thread(target=write, daemon=True)
    outputs = None
    deck = crash_deck(rng, drawn)
    try:
        writer.start()
        for i in range(restarts):
            proc = start_driver(path, _driver_env(rng, outcome, seed * 100 + i, deck))
            try:
                rc = wait_exit(proc, rng.uniform(3.0, 12.0))
                if rc is None:
                    outcome.faults["sigkill"] += 1
                elif rc == -signal.SIGKILL:
                    outcome.faults["crash-point exit"] += 1
            finally:
                close_driver(proc)
        done.wait(timeout)
        writer.join(5)
        assert not errors, errors
        outputs = Outputs(cfg, drawn)
        proc = start_driver(path)
        try:
            wait_running(tmp / "state", proc)
            deadline = time.monotonic() + timeout
            while outputs.pending() and time.monotonic() < deadline:
                assert proc.poll() is None, "the clean driver exited"
                time.sleep(0.5)
        finally:
            rc, err = stop_driver(proc)
        assert rc == 0, f"the clean driver exited {rc}: {err[-3000:]}"
        if outputs.pending():
            outcome.add("lost", f"outputs never caught up: {outputs.pending()}")
        outputs.compare(outcome)
    finally:
        feed.close()
        if outputs is not None:
            outputs.close()
    return outcome
