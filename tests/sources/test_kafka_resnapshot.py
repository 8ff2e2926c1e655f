"""``reclock resnapshot`` of Kafka and generator outputs (a replay of what
retention holds, :mod:`reclock.runtime.replay`): outputs damaged behind
reclock's back by another Delta writer end equal to what their topic says
while producers keep writing; an undamaged output gets no correction; what
retention removed stays as it was held. The expected contents come from a
plain consumer of the topics and a few lines of Python (the model), not from
reclock's own consolidation, and ``verify`` is clean afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from confluent_kafka import Producer
from deltalake import DeltaTable

from reclock import faults
from reclock.config import load_config
from reclock.pipeline import Pipeline
from reclock.runtime.resnapshot import Requests
from reclock.verify import verify_pipeline
from tests.kafkabroker import kafka_end, read_committed
from tests.running import durable, read_updates, running, wait_for

pytestmark = pytest.mark.integration

PIPELINE = """
state_dir: {tmp}/state
timestamp_interval: 250ms
sources:
  - name: log
    kafka: {{bootstrap_servers: "{bootstrap}", topic: {log}, timeout: 5s}}
    outputs:
      - name: log
        format: {{type: json, schema: {{id: int64, body: string}}}}
        sink: file
  - name: kv
    kafka: {{bootstrap_servers: "{bootstrap}", topic: {kv}, timeout: 5s}}
    outputs:
      - name: kv
        format: {{type: json, schema: {{body: string}}}}
        key_format: {{type: json, schema: {{id: int64}}}}
        envelope: {{type: upsert, key: [id]}}
        sink: file
  - name: gen
    generator: {{kind: counter, rate: 400}}
    outputs:
      - {{name: n, format: {{type: json, schema: {{n: int64}}}}, sink: file}}
"""


class Writers:
    """Producers of both topics, record ``n`` a pure function of ``n``:
    ``log`` gets ``{id, body}`` (every 97th value not JSON), ``kv`` keys
    ``{id: n % 150}`` with a body, every 13th a tombstone, every 101st a
    value that is not JSON."""

    def __init__(self, bootstrap: str, log: str, kv: str) -> None:
        self.p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
        self.log, self.kv = log, kv
        self.n = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def write(self, count: int) -> None:
        for _ in range(count):
            n, self.n = self.n, self.n + 1
            value = b"{broken" if n % 97 == 5 else json.dumps(
                {"id": n, "body": f"b{n}"}).encode()
            self.p.produce(self.log, value=value, partition=n % 3)
            key = json.dumps({"id": n % 150}).encode()
            kv = None if n % 13 == 0 else b"nope" if n % 101 == 7 else json.dumps(
                {"body": f"v{n}"}).encode()
            self.p.produce(self.kv, key=key, value=kv, partition=(n % 150) % 3)
        assert self.p.flush(30) == 0

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                self.write(40)
                self._stop.wait(0.05)
        self._stop.clear()
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.p.flush(30)


# -- the model: what each output must hold, from a plain consumer of its topic ----------------
def model_log(messages: list[Any], skip: set[tuple[int, int]] = frozenset()  # type: ignore[assignment]
              ) -> tuple[Counter[tuple[Any, ...]], set[tuple[int, int]]]:
    """The rows of every decodable record (but those at ``skip``) and the
    positions of the others."""
    rows: Counter[tuple[Any, ...]] = Counter()
    bad = set()
    for m in messages:
        if (m.partition(), m.offset()) in skip:
            continue
        try:
            v = json.loads(m.value())
        except ValueError:
            bad.add((m.partition(), m.offset()))
            continue
        rows[(v["id"], v["body"])] += 1
    return rows, bad


def model_kv(bootstrap: str, topic: str) -> tuple[dict[int, str], set[tuple[int, int]]]:
    """The latest body per key (a tombstone removes it, an undecodable value
    leaves it as it was) and the positions of the undecodable values."""
    state: dict[int, str] = {}
    bad = set()
    for m in sorted(read_committed(bootstrap, topic), key=lambda m: (m.partition(), m.offset())):
        k = json.loads(m.key())["id"]
        if m.value() is None:
            state.pop(k, None)
            continue
        try:
            state[k] = json.loads(m.value())["body"]
        except ValueError:
            bad.add((m.partition(), m.offset()))
    return state, bad


def held(t: pa.Table, cols: list[str]) -> tuple[Counter[tuple[Any, ...]], set[tuple[int, int]]]:
    """Rows net of their diffs, and where the error rows stand (a correction
    codes its partition: -1 - p, or -2**31 + p)."""
    ok = t.filter(pc.is_null(t.column("_error")))
    net: Counter[tuple[Any, ...]] = Counter()
    for r in ok.select([*cols, "_diff"]).to_pylist():
        net[tuple(r[c] for c in cols)] += r["_diff"]
    errs = t.filter(pc.is_valid(t.column("_error")))

    def part(p: int) -> int:
        return p if p >= 0 else -1 - p if p >= -(2**30) else p + 2**31

    where = {(part(p), o) for p, o in zip(errs.column("_src_part").to_pylist(),
                                         errs.column("_src_offset").to_pylist(), strict=True)}
    return +net, where


def corrections(t: pa.Table) -> pa.Table:
    return t.filter(pc.less(t.column("_src_part"), 0))


def _verified(cfg: Any) -> dict[str, Any]:
    return {r.source: r for r in verify_pipeline(cfg)}


@pytest.fixture
def disarmed() -> Any:
    yield
    faults.disarm()  # whatever the test left armed



def damage(path: Path, change: Any) -> None:
    """``change(DeltaTable)`` by another Delta writer, taken again when a
    concurrent commit of the pipeline wins the race (delta-rs raises
    CommitFailedError: the change must be re-read against the new data)."""
    from deltalake.exceptions import CommitFailedError

    for attempt in range(20):
        try:
            change(DeltaTable(str(path)))
            return
        except CommitFailedError:
            if attempt == 19:
                raise
            time.sleep(0.1)

def test_resnapshot_replays_kafka_and_generator_outputs(
        tmp_path: Path, spark: Any, kafka: Any, disarmed: None) -> None:
    log, kv = f"log-{uuid.uuid4().hex[:6]}", f"kv-{uuid.uuid4().hex[:6]}"
    kafka.create_topic(log, 3)
    kafka.create_topic(kv, 3)
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(tmp=tmp_path, bootstrap=kafka.bootstrap, log=log, kv=kv))
    cfg = load_config(path)
    outputs = tmp_path / "state" / "outputs"
    w = Writers(kafka.bootstrap, log, kv)
    w.write(1500)
    requests = {s: Requests(tmp_path / "state", s) for s in ("log", "kv", "gen")}

    def request(source: str, output: str) -> None:
        pipe = Pipeline(cfg)
        try:
            pipe.request_resnapshot(source, output)
        finally:
            pipe.close()

    def caught_up(runners: list[Any]) -> None:
        ends = {n: {p: kafka_end(kafka.bootstrap, t, p) for p in range(3)}
                for n, t in (("log", log), ("kv", kv))}
        wait_for(lambda: all(durable(r) == ends[r.name] for r in runners[:2]), 90,
                 lambda: f"the Kafka outputs to catch up: {[durable(r) for r in runners]}")

    def equal_to_topics() -> None:
        want, want_bad = model_log(read_committed(kafka.bootstrap, log))
        got, got_bad = held(read_updates(cfg, "log", "log"), ["id", "body"])
        assert got == want and got_bad == want_bad
        kv_want, kv_bad = model_kv(kafka.bootstrap, kv)
        kv_got, kv_got_bad = held(read_updates(cfg, "kv", "kv"), ["id", "body"])
        assert kv_got == Counter(kv_want.items()) and kv_got_bad == kv_bad

    def gen_once() -> None:
        counts, _ = held(read_updates(cfg, "gen", "n"), ["n"])
        assert sorted(counts.elements()) == [(i,) for i in range(len(counts))]

    with running(cfg, spark) as runners:
        caught_up(runners)
        equal_to_topics()
        # Damage behind reclock's back: another Delta writer deletes and changes rows.
        damage(outputs / "log" / "log", lambda t: t.delete("id % 7 = 0 OR _error IS NOT NULL"))
        damage(outputs / "log" / "log",
               lambda t: t.update(predicate="id = 3", updates={"body": "'damaged'"}))
        damage(outputs / "kv" / "kv", lambda t: t.delete("id % 5 = 0"))
        damage(outputs / "kv" / "kv",
               lambda t: t.update(predicate="id = 2", updates={"body": "'damaged'"}))
        # (the generator commits every interval: this writer may lose a race)
        damage(outputs / "gen" / "n", lambda t: t.delete("n % 3 = 1"))
        with pytest.raises(AssertionError):
            equal_to_topics()
        with pytest.raises(AssertionError):
            gen_once()

        # Ask for all three while the producers write; the CLI for one of them.
        w.start()
        cli = subprocess.run([sys.executable, "-m", "reclock.cli", "resnapshot", str(path),
                              "log", "log"], capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0 and "re-snapshot requested" in cli.stdout, cli.stderr
        request("kv", "kv")
        request("gen", "n")
        # and meet a transient source error, failed stages and failed commits
        faults.arm("source:1,stage:2,commit:3")
        wait_for(lambda: not any(r.pending() for r in requests.values()), 90,
                 lambda: f"the resnapshots: {[r.health for r in runners]}")
        time.sleep(1)
        w.stop()
        assert not any(faults.take(p) for p in ("source", "stage", "commit"))  # all met
        caught_up(runners)
        assert all(r.health.status == "running" for r in runners), [r.health for r in runners]
        equal_to_topics()
        gen_once()
        # Each correction sits at one IntoTime.
        for src, out in (("log", "log"), ("kv", "kv"), ("gen", "n")):
            c = corrections(read_updates(cfg, src, out))
            assert c.num_rows > 0 and len(set(c.column("_into_time").to_pylist())) == 1, out
        # An output that is not damaged gets no correction at all.
        first = corrections(read_updates(cfg, "log", "log")).num_rows
        request("log", "log")
        wait_for(lambda: not requests["log"].pending(), 60, "the second resnapshot")
        assert corrections(read_updates(cfg, "log", "log")).num_rows == first
    reports = _verified(cfg)
    for name in ("log", "kv", "gen"):
        assert reports[name].ok, [(o.output, o.breaches, o.samples)
                                  for o in reports[name].outputs]
    assert reports["log"].complete_checked >= 1500

    # Retention removes partition 0's first 100 records; rows held for them
    # stay as they are (even damaged: nothing says otherwise), the rest heals.
    everything = read_committed(kafka.bootstrap, log)
    kafka.delete_records(log, 0, 100)
    damage(outputs / "log" / "log", lambda t: t.delete("id % 11 = 0"))
    lost = {(m.partition(), m.offset()) for m in everything
            if m.partition() == 0 and m.offset() < 100 and m.value()[:1] == b"{"
            and m.value() != b"{broken" and json.loads(m.value())["id"] % 11 == 0}
    assert lost
    request("log", "log")
    with running(cfg, spark) as runners:
        wait_for(lambda: not requests["log"].pending(), 60, "the resnapshot after retention")
    del w.p  # the producer goes before the broker does (end of the session)
    got, _ = held(read_updates(cfg, "log", "log"), ["id", "body"])
    want, _ = model_log(everything, skip=lost)
    assert got == want
