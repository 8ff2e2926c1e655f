"""Peer benchmark: reclock against Spark Structured Streaming, Bytewax, Quix Streams and a
raw consumer, one Kafka topic.

One command. It starts a real Apache Kafka broker (one KRaft node in a JVM of
its own, from the jars ``tests/setup.sh`` resolves; ``--broker mock``: librdkafka's
mock cluster in this process, ``reclock.devkafka.MockKafka``, which keeps only
~5 MB per partition), produces ``--records`` JSON records of about
100 bytes (``{"id", "user", "amount", "ts", "pad"}``, key = the id) over
``--partitions`` partitions of one topic with confluent-kafka (linger and large
batches), checks that every partition holds all of its records, and then runs
each contender as a
subprocess, in its own session, reading the whole topic from the beginning
into local files with resumability on. "Durable" means, for everyone, the
Kafka offsets that a restart would not read again:

1. **reclock**: ``python -m reclock run`` on a pipeline YAML (Kafka source,
   json format with a schema, ``sink: file`` = a Delta table), ``local[2]``,
   so Spark's start-up is part of its start-up (the log splits it out).
   Durable: the progress log's ``sink_upper`` events (the offsets committed
   with the data, summed).
2. **Bytewax** (pinned, in its own virtualenv under ``--cache-dir``):
   ``bench/peers/bytewax_flow.py`` under ``python -m bytewax.run`` with
   recovery (``-r``, a snapshot every ``--interval``): KafkaSource ->
   ``json.loads`` -> ``json.dumps`` -> ``DirSink``; one contender per
   ``--bytewax-modes`` entry (one worker; two processes). Durable: the
   KafkaSource offsets in the recovery store's snapshots before the resume
   epoch (a restart truncates the files to the same epoch). Its output lines
   are visible earlier: the "visible rec/s" column.
3. **Quix Streams** (pinned, its own virtualenv): ``bench/peers/quix_app.py``,
   a stateless ``Application`` (earliest, at-least-once, a checkpoint every
   ``--interval``) in ``--quix-procs`` processes of one consumer group, JSON
   values, ``LocalFileSink`` (JSON lines, written at each checkpoint).
   Durable: the consumer group's committed offsets (committed after the sink
   flushed). The mock broker answers no ``DescribeConfigs``, which Quix calls
   for every topic; the app replaces that one start-up call (see its docstring).
4. **Spark Structured Streaming** (PySpark 4.2.0 in its own virtualenv, the
   newest Spark that delta-spark is released for; ``bench/peers/spark_streaming.py``):
   Spark's Kafka source (``spark-sql-kafka-0-10``), ``from_json`` with the
   same schema, Delta's streaming sink (``delta-spark``) with a checkpoint:
   exactly once, ``local[2]``, a ``processingTime`` trigger of ``--interval``.
   One contender per ``--spark-max-offsets`` entry (``maxOffsetsPerTrigger``;
   0 = Spark's default, one batch takes the whole backlog). Durable: the
   offsets of the last batch in the checkpoint's ``commits/``. Spark's Kafka
   client keeps its own defaults (it is not librdkafka).
5. **raw confluent-kafka** (``bench/peers/raw_consumer.py``): every partition
   assigned, ``Consumer.consume(num_messages=10000)`` in a loop, with and
   without ``json.loads`` of each value, no output: the Python floor.

Every consumer gets the same librdkafka fetch settings (``FETCH_PROPS``; see
``--librdkafka-defaults``). With librdkafka's defaults the mock broker holds
a fetch for ``fetch.wait.max.ms`` (500 ms) at the end of a partition and
librdkafka postpones fetches by ``fetch.queue.backoff.ms`` (1 s); the raw
consumer is also measured with the defaults, for reference.

Per contender it measures, on a fresh output:

- **start-up**: from launching the process to the first durable data;
- **steady state**: records/s from the first durable step holding a quarter
  of the records (``--steady-from``) to all records durable ((N - records
  durable at that step) / time), the median of ``--repeat`` runs, which go
  round-robin over the contenders so that the machine's other load hits all
  of them alike (a quarter in: past every contender's warm-up, and reclock's
  jobs read ahead of a commit cannot inflate it);
- **CPU** of the process tree in the steady phase: microseconds per record and
  cores used (``/proc`` every 0.1 s; the raw consumer: its whole run);
- **peak RSS** of the process tree (the sum over the session's processes);
- **resume after kill**: one more fresh run is SIGKILLed (the whole session)
  as soon as half the records are durable, restarted on the same state, and
  timed from the restart to the first new durable data; it runs until every
  record is durable, and the output is checked: rows, distinct ids,
  duplicates, missing ids.

The table at the end shows each contender's ratio to the fastest Python peer
(Bytewax/Quix), to Spark Structured Streaming at its best set-up and to the
raw consume rate, and PASS/MISS for the targets: reclock >= 2x the fastest
Python peer, >= 2x Spark Structured Streaming at its best, >= 70% of the raw
consume rate, and a resume after kill no slower than Spark's. A
miss does not change the exit status; a contender that cannot run is reported
with its error. Logs and progress traces stay in the temporary directory with
``--keep``.

Run: ``python bench/peer_bench.py`` (4M records in 128 partitions, about 12
minutes after the one-time virtualenv set-up of about 20 s), ``--repeat 3``
(about 25 minutes), ``--quick`` (1M records in 32 partitions),
``--skip-peers`` (reclock and the raw consumer only); see ``--help``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import re
import resource
import shlex
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from pipeline_bench import table  # noqa: E402

PEERS = ROOT / "bench" / "peers"

TOPIC = "events"
BYTEWAX_VERSION = "0.21.1"
QUIX_VERSION = "3.28.1"
SCHEMA = "{id: int64, user: string, amount: float64, ts: int64, pad: string}"
# Same for every consumer (see the module docstring and --librdkafka-defaults).
FETCH_PROPS: dict[str, Any] = {"fetch.wait.max.ms": 10, "fetch.queue.backoff.ms": 10}
MAX_PARTITION_BYTES = 4 << 20  # the mock drops the oldest data beyond ~5 MB per partition
TS0 = 1_700_000_000_000
PAD = "x" * 24
POLL_S = 0.05
RSS_EVERY_S = 0.1
TARGET_PEER_RATIO = 2.0
TARGET_RAW_SHARE = 0.7
TARGET_SPARK_RATIO = 2.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def value_of(n: int) -> bytes:
    return (f'{{"id":{n},"user":"user{n % 10007:05d}","amount":{n % 9973}.{n % 100:02d},'
            f'"ts":{TS0 + n},"pad":"{PAD}"}}').encode()


# -- reporting -------------------------------------------------------------------------
def fmt_s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def fmt_rate(r: float | None) -> str:
    return "-" if r is None else f"{r:,.0f}"


def fmt_ratio(a: float | None, b: float | None, pct: bool = False) -> str:
    if a is None or not b:
        return "-"
    return f"{a / b:.0%}" if pct else f"{a / b:.2f}x"


# -- the broker --------------------------------------------------------------------------
@dataclass
class Topic:
    bootstrap: str
    records: int
    partitions: int
    produce_s: float
    value_bytes: float
    max_partition_bytes: int


class RealBroker:
    """A real Apache Kafka broker (KRaft, one node) from the jars that
    ``tests/setup.sh`` resolves (``tests/kafkabroker.py``), with a server JVM
    (the tests' fast-start flags would slow the broker down)."""

    def __init__(self, partitions: int) -> None:
        from tests.kafkabroker import KafkaCluster, kafka_version

        self.cluster = KafkaCluster(1, partitions=partitions, jvm=(
            "-Xms1g", "-Xmx1g", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20"))
        self.cluster.start()
        self.bootstrap = self.cluster.bootstrap
        self.version = f"Apache Kafka {kafka_version()} (KRaft, one node, a JVM of its own)"
        self.pid = self.cluster.nodes[0].proc.pid  # type: ignore[union-attr]

    def create_topic(self, topic: str, partitions: int) -> None:
        self.cluster.create_topic(topic, partitions)
        self.cluster.wait_leaders(topic, partitions)

    def cpu(self) -> float:
        """The broker JVM's CPU seconds so far (it runs in a session of its own)."""
        return session_stats(self.pid)[2]

    def close(self) -> None:
        self.cluster.close()


class MockBroker:
    """librdkafka's mock cluster in this process (``reclock.devkafka``): no
    disk, no replication; it keeps only ~5 MB per partition."""

    def __init__(self) -> None:
        from reclock.devkafka import MockKafka

        self.mock = MockKafka(1)
        self.bootstrap = self.mock.bootstrap
        self.version = "librdkafka's mock broker (in the benchmark's process)"

    def create_topic(self, topic: str, partitions: int) -> None:
        self.mock.create_topic(topic, partitions)

    def cpu(self) -> float:
        return time.process_time()

    def close(self) -> None:
        self.mock.close()


#: The broker's CPU seconds so far (set by main; the mock: this whole process).
broker_cpu: Callable[[], float] = time.process_time


def start_broker(records: int, partitions: int, real: bool) -> tuple[Any, Topic]:
    from confluent_kafka import Consumer, Producer, TopicPartition

    broker = RealBroker(partitions) if real else MockBroker()
    global broker_cpu
    broker_cpu = broker.cpu
    broker.create_topic(TOPIC, partitions)
    producer = Producer({
        "bootstrap.servers": broker.bootstrap, "linger.ms": 100, "batch.size": 1_000_000,
        "batch.num.messages": 100_000, "queue.buffering.max.messages": 2_000_000,
        "queue.buffering.max.kbytes": 1_048_576, "acks": 1, "log_level": 3})
    per_part = [0] * partitions
    counts = [0] * partitions
    total = 0
    t0 = time.perf_counter()
    produce = producer.produce
    for n in range(records):
        v = value_of(n)
        k = b"%d" % n
        p = n % partitions
        per_part[p] += len(v) + len(k)
        counts[p] += 1
        total += len(v)
        while True:
            try:
                produce(TOPIC, v, k, partition=p)
                break
            except BufferError:
                producer.poll(0.05)
        if not n % 50_000:
            producer.poll(0)
    left = producer.flush(60)
    produce_s = time.perf_counter() - t0
    if left:
        raise SystemExit(f"producer: {left} records not delivered")
    # Payload plus ~20 bytes of per-record framing must stay under the mock's retention.
    max_bytes = max(b + 20 * c for b, c in zip(per_part, counts, strict=True))
    if not real and max_bytes > MAX_PARTITION_BYTES:
        raise SystemExit(
            f"{max_bytes / 2**20:.1f} MB in one partition: the mock keeps only ~5 MB per "
            f"partition; use more --partitions (>= {records * 120 // MAX_PARTITION_BYTES + 1})")
    c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "peer-bench-check"})
    for p in range(partitions):
        lo, hi = c.get_watermark_offsets(TopicPartition(TOPIC, p), timeout=10)
        if lo != 0 or hi != counts[p]:
            raise SystemExit(f"partition {p} holds offsets {lo}..{hi}, expected 0..{counts[p]}")
    c.close()
    return broker, Topic(broker.bootstrap, records, partitions, produce_s, total / records,
                         max_bytes)


# -- processes ---------------------------------------------------------------------------
TICK = os.sysconf("SC_CLK_TCK")


def session_stats(sid: int) -> tuple[list[int], int, float]:
    """The pids of the processes in session ``sid``, the sum of their RSS (bytes)
    and of their CPU time (user + system, with reaped children; seconds)."""
    pids, rss, ticks = [], 0, 0
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if int(fields[3]) == sid:  # field 6: session
            pids.append(int(entry.name))
            rss += int(fields[21]) * page  # field 24: rss in pages
            ticks += sum(int(x) for x in fields[11:15])  # fields 14-17: u/s time, children
    return pids, rss, ticks / TICK


class Proc:
    """A command in its own session; output to files in ``logdir``."""

    live: ClassVar[list[Proc]] = []  # killed on the way out, whatever happens

    def __init__(self, argv: Sequence[str], env: dict[str, str], cwd: Path, logdir: Path,
                 tag: str) -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        self.out = logdir / f"{tag}.out"
        self.err = logdir / f"{tag}.err"
        self.started = time.monotonic()
        self.started_wall = time.time()
        with self.out.open("wb") as o, self.err.open("wb") as e:
            self.popen = subprocess.Popen(list(argv), env=env, cwd=cwd, stdout=o, stderr=e,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        Proc.live.append(self)
        self.peak_rss = 0
        self.cpu = 0.0  # CPU seconds of the session at the last sample
        self._last_rss = 0.0

    def sample(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_rss >= RSS_EVERY_S:
            self._last_rss = now
            _pids, rss, cpu = session_stats(self.popen.pid)
            self.peak_rss = max(self.peak_rss, rss)
            self.cpu = max(self.cpu, cpu)

    def exited(self) -> int | None:
        return self.popen.poll()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """``sig`` to every process of the session (by pid; Spark's Python daemon
        starts its own process group, so the group alone is not enough)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)
        for pid in session_stats(self.popen.pid)[0]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM, then SIGKILL whatever is left after ``grace`` seconds."""
        if self.exited() is None:
            self.kill(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(grace)
        self.kill(signal.SIGKILL)
        self.wait_gone()

    def wait_gone(self, timeout: float = 30.0) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)
        deadline = time.monotonic() + timeout
        while session_stats(self.popen.pid)[0] and time.monotonic() < deadline:
            self.kill(signal.SIGKILL)
            time.sleep(0.1)

    def tail(self, lines: int = 6) -> str:
        text = self.err.read_text(errors="replace").strip().splitlines()
        keep = [t for t in text if t.strip() and "CONFWARN" not in t][-lines:]
        return " | ".join(t.strip() for t in keep)[-600:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- progress probes ----------------------------------------------------------------------
def bytewax_durable(recovery: Path, step: str) -> int:
    """Records covered by Bytewax's recovery store: the KafkaSource offsets of
    ``step`` in the latest snapshots before the resume epoch (the lowest worker
    frontier of the latest execution), summed. A restart resumes exactly there
    (and truncates the sink's files to the snapshots of the same epoch)."""
    fronts: list[tuple[int, int, int]] = []
    snaps: list[tuple[str, int, bytes | None]] = []
    for db in sorted(recovery.glob("part-*.sqlite3")):
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2)
            try:
                fronts += con.execute(
                    "select ex_num, worker_index, worker_frontier from fronts").fetchall()
                snaps += con.execute("select state_key, snap_epoch, ser_change from snaps "
                                     "where step_id = ?", (step,)).fetchall()
            finally:
                con.close()
        except sqlite3.Error:
            return -1  # busy or not created yet: ask again
    if not fronts:
        return 0
    ex = max(f[0] for f in fronts)
    resume = min(f[2] for f in fronts if f[0] == ex)
    best: dict[str, tuple[int, int]] = {}
    for key, epoch, ser in snaps:
        if epoch < resume and (key not in best or epoch > best[key][0]):
            offset = 0 if ser is None else pickle.loads(ser)  # our own subprocess's data
            best[key] = (epoch, max(0, int(offset or 0)))  # OFFSET_BEGINNING is -2
    return sum(offset for _epoch, offset in best.values())


class GroupCommitted:
    """The offsets committed by a consumer group, summed (asked from the broker)."""

    def __init__(self, bootstrap: str, group: str, partitions: int) -> None:
        from confluent_kafka import Consumer, TopicPartition

        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                                  "enable.auto.commit": False, "log_level": 3})
        self.tps = [TopicPartition(TOPIC, p) for p in range(partitions)]

    def __call__(self) -> int:
        from confluent_kafka import KafkaException

        try:
            got = self.consumer.committed(self.tps, timeout=5)
        except KafkaException:
            return -1
        return sum(max(0, tp.offset) for tp in got)

    def close(self) -> None:
        self.consumer.close()


class LineCounter:
    """Lines in the files under ``root`` matching ``pattern``, read incrementally;
    a file that shrank (truncated on resume) is counted again."""

    def __init__(self, root: Path, pattern: str) -> None:
        self.root = root
        self.pattern = pattern
        self.files: dict[Path, tuple[int, int]] = {}  # path -> (bytes read, lines)

    def count(self) -> int:
        for path in self.root.glob(self.pattern):
            pos, lines = self.files.get(path, (0, 0))
            try:
                size = path.stat().st_size
                if size < pos:
                    pos, lines = 0, 0
                if size > pos:
                    with path.open("rb") as f:
                        f.seek(pos)
                        data = f.read(size - pos)
                    end = data.rfind(b"\n") + 1
                    lines += data.count(b"\n", 0, end)
                    pos += end
            except FileNotFoundError:
                continue
            self.files[path] = (pos, lines)
        return sum(lines for _pos, lines in self.files.values())


def count_ids(paths: Iterator[Path], pattern: bytes) -> tuple[int, int]:
    """(rows, distinct ids) of JSON-lines files, ids found with a regex."""
    import numpy as np

    rx = re.compile(pattern)
    chunks = []
    for p in paths:
        data = p.read_bytes()
        chunks.append(np.array(rx.findall(data), dtype=np.int64))
    ids = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
    return len(ids), len(np.unique(ids))


# -- contenders ------------------------------------------------------------------------------
def _rate(first: float | None, first_count: int, done: float | None, total: int
          ) -> float | None:
    """Records/s from ``first`` (``first_count`` records there) to ``done`` (all ``total``)."""
    if first is None or done is None or done <= first or total <= first_count:
        return None
    return (total - first_count) / (done - first)


@dataclass
class Outcome:
    """One monitored run of a contender."""

    launched: float
    start_count: int = 0
    up: float | None = None  # the first durable data
    first: float | None = None  # the steady phase's start (see --steady-from)
    first_count: int = 0
    done: float | None = None
    killed_at: int | None = None
    vis_first: float | None = None  # output visible (before it is durable, for Bytewax)
    vis_first_count: int = 0
    vis_done: float | None = None
    steps: int = 0  # durable steps after the first one
    cpu_first: float = 0.0  # the session's CPU seconds at `first` and at `done`
    cpu_done: float = 0.0
    self_first: float = 0.0  # this process's (the mock broker's) CPU seconds, same moments
    self_done: float = 0.0
    peak_rss: int = 0
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def startup(self) -> float | None:
        return None if self.up is None else self.up - self.launched

    def steady(self, total: int) -> float | None:
        return _rate(self.first, self.first_count, self.done, total)

    def visible_rate(self, total: int) -> float | None:
        """Records/s from the first output visible in the files to all of it visible."""
        return _rate(self.vis_first, self.vis_first_count, self.vis_done, total)

    def steady_cpu(self, total: int) -> tuple[float, float, float] | None:
        """(CPU us per record, cores used, broker cores) from first to done."""
        if self.first is None or self.done is None or self.done <= self.first:
            return None
        if total <= self.first_count:
            return None
        wall = self.done - self.first
        cpu = self.cpu_done - self.cpu_first
        return (cpu / (total - self.first_count) * 1e6, cpu / wall,
                (self.self_done - self.self_first) / wall)


class Contender:
    name = ""
    version = ""
    slug = ""

    def __init__(self, args: argparse.Namespace, topic: Topic, props: dict[str, Any]) -> None:
        self.args = args
        self.topic = topic
        self.props = props

    def prepare(self, run: Path) -> None:
        """Fresh state in ``run``."""

    def launch(self, run: Path, tag: str) -> Proc:
        raise NotImplementedError

    def probe(self, run: Path) -> Callable[[], int]:
        """A function returning the records durable in ``run`` now (cheap, incremental)."""
        raise NotImplementedError

    def visible(self, run: Path) -> Callable[[], int] | None:
        """Records visible in the output files (durable or not); None: same as durable."""
        return None

    def verify(self, run: Path) -> tuple[int, int]:
        """(rows, distinct ids) in the output of ``run``."""
        raise NotImplementedError

    def notes(self, outcome: Outcome) -> str:
        return ""

    def close(self) -> None:
        """Release what the probes hold."""


class Reclock(Contender):
    name = "reclock"
    slug = "reclock"

    def __init__(self, args: argparse.Namespace, topic: Topic, props: dict[str, Any],
                 reader: str = "native") -> None:
        super().__init__(args, topic, props)
        from importlib.metadata import version

        self.reader = reader
        if reader != "native":  # "reclock" (the targets' row) is the default reader
            self.name = f"reclock, {reader} reader"
            self.slug = f"reclock-{reader}"
        self.version = f"{version('reclock')} (PySpark {version('pyspark')})"
        self._opens: list[int] = []  # "open" event times (ms) seen by the last probe

    def prepare(self, run: Path) -> None:
        run.mkdir(parents=True, exist_ok=True)
        a = self.args
        props = ", ".join(f"{k}: {json.dumps(v)}" for k, v in self.props.items())
        (run / "pipeline.yaml").write_text("\n".join([
            f"state_dir: {json.dumps(str(run / 'state'))}",
            f"timestamp_interval: {int(a.interval * 1000)}ms",
            "spark:",
            "  master: \"local[2]\"",
            f"  max_records_per_job: {a.reclock_job}",
            *([f"  max_records_per_task: {a.reclock_task}"] if a.reclock_task else []),
            *([f"  jobs_in_flight: {a.reclock_jobs_in_flight}"]
              if a.reclock_jobs_in_flight else []),
            "sources:",
            "  - name: events",
            "    kafka:",
            f"      bootstrap_servers: {json.dumps(self.topic.bootstrap)}",
            f"      topic: {TOPIC}",
            "      timeout: 10s",
            f"      properties: {{{props}}}",
            f"      reader: {self.reader}",
            "    outputs:",
            "      - name: events",
            f"        format: {{type: json, schema: {SCHEMA}}}",
            "        sink: file",
        ]) + "\n")

    def launch(self, run: Path, tag: str) -> Proc:
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable,
               "PYSPARK_DRIVER_PYTHON": sys.executable}
        return Proc([sys.executable, "-m", "reclock", "run", str(run / "pipeline.yaml")], env,
                    ROOT, run / "logs", tag)

    def probe(self, run: Path) -> Callable[[], int]:
        path = run / "state" / "progress.jsonl"
        state = {"pos": 0, "durable": 0}
        opens: list[int] = []
        self._opens = opens

        def poll() -> int:
            if not path.exists():
                return state["durable"]
            with path.open("rb") as f:
                f.seek(state["pos"])
                data = f.read()
            end = data.rfind(b"\n") + 1
            state["pos"] += end
            for line in data[:end].splitlines():
                if b'"sink_upper"' in line:
                    ev = json.loads(line)
                    got = sum((hi - lo + 1) * off for lo, hi, off in ev["progress"]
                              if hi is not None)
                    state["durable"] = max(state["durable"], got)
                elif b'"kind":"open"' in line:
                    opens.append(int(json.loads(line)["ts"]))
            return state["durable"]

        return poll

    def verify(self, run: Path) -> tuple[int, int]:
        import pyarrow.compute as pc
        from deltalake import DeltaTable

        t = DeltaTable(str(run / "state" / "outputs" / "events" / "events"))
        ids = t.to_pyarrow_table(columns=["id", "_error"])
        errors = ids.num_rows - ids.column("_error").null_count
        if errors:
            log(f"reclock: {errors} error rows in the output")
        return ids.num_rows, int(pc.count_distinct(ids.column("id")).as_py())

    def notes(self, outcome: Outcome) -> str:
        opens = [t for t in self._opens if t / 1000 >= outcome.extra.get("wall", 0)]
        if not opens or outcome.up is None:
            return ""
        ready = opens[0] / 1000 - outcome.extra["wall"]
        return (f"launch -> pipeline open (imports, Spark JVM, remap store, Delta table) "
                f"{ready:.2f} s; open -> first commit {outcome.startup - ready:.2f} s "
                "(the first binding, Python workers, the first job)")


def venv_python(cache: Path, name: str, spec: str, dist: str, version: str
                ) -> tuple[Path | None, str]:
    """A virtualenv ``cache/<name>-<version>`` with ``spec`` installed (reused when the
    pinned version is there). Returns (its python, "") or (None, the error)."""
    venv = cache / f"{name}-{version}"
    py = venv / "bin" / "python"
    check = [str(py), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"]
    if py.exists():
        got = subprocess.run(check, capture_output=True, text=True)
        if got.returncode == 0 and got.stdout.strip() == version:
            return py, ""
    log(f"creating {venv} and installing {spec} ...")
    t0 = time.perf_counter()
    cache.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)],
                       capture_output=True, text=True)
    if r.returncode == 0:
        r = subprocess.run([str(py), "-m", "pip", "install", "-q",
                            "--disable-pip-version-check", spec],
                           capture_output=True, text=True)
    if r.returncode != 0:
        err = [t for t in (r.stderr + r.stdout).splitlines()
               if t.strip() and "is ignored: it is neither" not in t]
        return None, f"pip install {spec} failed: {' | '.join(err[-3:])}"
    log(f"installed {spec} in {time.perf_counter() - t0:.0f} s")
    return py, ""


def venv_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def kafka_versions(py: Path | str) -> str:
    r = subprocess.run([str(py), "-c", "import confluent_kafka as c, importlib.metadata as m; "
                        "print(m.version('confluent-kafka'), c.libversion()[0])"],
                       capture_output=True, text=True)
    parts = r.stdout.split()
    return f"confluent-kafka {parts[0]}, librdkafka {parts[1]}" if len(parts) == 2 else "?"


class Bytewax(Contender):
    def __init__(self, args: argparse.Namespace, topic: Topic, props: dict[str, Any],
                 py: Path, mode: str) -> None:
        super().__init__(args, topic, props)
        self.py = py
        self.version = f"{BYTEWAX_VERSION} ({kafka_versions(py)})"
        if not re.fullmatch(r"[pw][1-9]\d*", mode):
            raise SystemExit(f"--bytewax-modes: {mode!r} is not w<N> or p<N>")
        self.procs = int(mode[1:]) if mode.startswith("p") else 1
        self.workers = int(mode[1:]) if mode.startswith("w") else 1
        self.name = (f"Bytewax {self.procs} processes" if self.procs > 1
                     else f"Bytewax {self.workers} worker" + "s" * (self.workers > 1))
        self.slug = f"bytewax_{mode}"

    def prepare(self, run: Path) -> None:
        (run / "out").mkdir(parents=True, exist_ok=True)
        (run / "recovery").mkdir(parents=True, exist_ok=True)
        subprocess.run([str(self.py), "-m", "bytewax.recovery", str(run / "recovery"),
                        str(self.procs * self.workers)], check=True, env=venv_env())

    def launch(self, run: Path, tag: str) -> Proc:
        env = venv_env()
        env.update(PEER_BOOTSTRAP=self.topic.bootstrap, PEER_TOPIC=TOPIC,
                   PEER_OUT=str(run / "out"), PEER_FILES=str(self.args.bytewax_files),
                   PEER_BATCH=str(self.args.bytewax_batch), PEER_PROPS=json.dumps(self.props))
        snapshot = str(max(1, round(self.args.interval)))  # whole seconds only
        base = [str(self.py), "-m", "bytewax.run", "bytewax_flow:flow",
                "-r", str(run / "recovery"), "-s", snapshot, "-b", "0"]
        if self.procs == 1:
            return Proc([*base, "-w", str(self.workers)], env, PEERS, run / "logs", tag)
        addresses = ";".join(f"127.0.0.1:{free_port()}" for _ in range(self.procs))
        cmds = [shlex.join([*base, "-i", str(i), "-a", addresses]) for i in range(self.procs)]
        script = " & ".join(cmds) + " & wait"
        return Proc(["bash", "-c", script], env, PEERS, run / "logs", tag)

    def probe(self, run: Path) -> Callable[[], int]:
        """The Kafka offsets in the recovery store's snapshots (see ``bytewax_durable``)."""
        rec = run / "recovery"
        return lambda: bytewax_durable(rec, "peer_bench.kafka")

    def visible(self, run: Path) -> Callable[[], int] | None:
        return LineCounter(run / "out", "part_*").count

    def verify(self, run: Path) -> tuple[int, int]:
        return count_ids((run / "out").glob("part_*"), rb'"id": (\d+)')

    def notes(self, outcome: Outcome) -> str:
        how = (f"{self.procs} processes x 1 worker" if self.procs > 1
               else f"1 process x {self.workers} worker(s)")
        return (f"python -m bytewax.run, {how}, DirSink {self.args.bytewax_files} files, "
                f"KafkaSource batch_size {self.args.bytewax_batch}, snapshot every "
                f"{max(1, round(self.args.interval))} s")


SPARK_PEER_VERSION = "4.2.0"  # the newest Spark that delta-spark is released for
SPARK_PEER_PACKAGES = ("io.delta:delta-spark_2.13:4.4.0,"
                       f"org.apache.spark:spark-sql-kafka-0-10_2.13:{SPARK_PEER_VERSION}")


def spark_peer_jars(py: Path, cache: Path) -> list[str]:
    """The connector jars (delta-spark, spark-sql-kafka and what they need),
    resolved once from Maven Central into ``cache/ivy`` by a session that
    only resolves (``spark_streaming.py --resolve``)."""
    ivy = cache / "ivy"
    jars = sorted(str(j) for j in (ivy / "jars").glob("*.jar"))
    if any("delta-spark" in j for j in jars) and any("spark-sql-kafka" in j for j in jars):
        return jars
    log(f"resolving {SPARK_PEER_PACKAGES} into {ivy} ...")
    r = subprocess.run([str(py), str(PEERS / "spark_streaming.py"), "--resolve",
                        "--bootstrap", "-", "--topic", "-", "--out", "-", "--checkpoint", "-",
                        "--packages", SPARK_PEER_PACKAGES, "--ivy", str(ivy)],
                       capture_output=True, text=True, env=venv_env())
    if r.returncode != 0:
        raise RuntimeError(f"resolving the Spark connectors failed: {r.stderr[-600:]}")
    return sorted(str(j) for j in (ivy / "jars").glob("*.jar"))


class SparkStreaming(Contender):
    """Spark Structured Streaming (``bench/peers/spark_streaming.py``): the
    Kafka source, ``from_json``, Delta's streaming sink with a checkpoint."""

    def __init__(self, args: argparse.Namespace, topic: Topic, props: dict[str, Any],
                 py: Path, max_offsets: int) -> None:
        super().__init__(args, topic, props)
        self.py = py
        self.max_offsets = max_offsets
        self.jars = spark_peer_jars(py, args.cache_dir)
        delta = next((Path(j).name for j in self.jars if "delta-spark" in j), "?")
        self.version = f"PySpark {SPARK_PEER_VERSION}, {delta.removesuffix('.jar')}"
        self.name = ("Spark Structured Streaming" if not max_offsets else
                     f"Spark Structured Streaming, maxOffsetsPerTrigger {max_offsets:,}")
        self.slug = f"sss_{max_offsets}"

    def prepare(self, run: Path) -> None:
        run.mkdir(parents=True, exist_ok=True)

    def launch(self, run: Path, tag: str) -> Proc:
        env = venv_env()
        env.update(PYSPARK_PYTHON=str(self.py), PYSPARK_DRIVER_PYTHON=str(self.py))
        argv = [str(self.py), str(PEERS / "spark_streaming.py"),
                "--bootstrap", self.topic.bootstrap, "--topic", TOPIC,
                "--out", str(run / "out"), "--checkpoint", str(run / "checkpoint"),
                "--trigger", str(self.args.interval), "--max-offsets", str(self.max_offsets),
                "--jars", ",".join(self.jars)]
        return Proc(argv, env, run, run / "logs", tag)

    def probe(self, run: Path) -> Callable[[], int]:
        """The offsets of the last committed micro-batch: Delta's streaming sink
        commits batch N's data with app transaction N before the checkpoint
        records ``commits/N``; a restart resumes after the last ``commits/N``
        (and a batch whose data is in the table but not in ``commits/`` is
        planned again with the same offsets and skipped by the sink)."""
        ckpt = run / "checkpoint"
        state = {"batch": -1, "durable": 0}

        def poll() -> int:
            try:
                names = os.listdir(ckpt / "commits")
            except FileNotFoundError:
                return state["durable"]
            done = max((int(n) for n in names if n.isdigit()), default=-1)
            if done > state["batch"]:
                try:
                    lines = (ckpt / "offsets" / str(done)).read_text().splitlines()
                    offsets = json.loads(lines[2])[TOPIC]
                except (OSError, IndexError, ValueError, KeyError):
                    return state["durable"]
                state["batch"] = done
                state["durable"] = sum(int(v) for v in offsets.values())
            return state["durable"]

        return poll

    def verify(self, run: Path) -> tuple[int, int]:
        import pyarrow.compute as pc
        from deltalake import DeltaTable

        ids = DeltaTable(str(run / "out")).to_pyarrow_table(columns=["id"]).column("id")
        return len(ids), int(pc.count_distinct(ids).as_py())

    def notes(self, outcome: Outcome) -> str:
        limit = (f"maxOffsetsPerTrigger {self.max_offsets:,}" if self.max_offsets
                 else "no maxOffsetsPerTrigger (a batch takes the whole backlog)")
        return (f"local[2], processingTime {self.args.interval:g} s, {limit}, Delta streaming "
                "sink with a checkpoint (exactly once), spark.sql.shuffle.partitions 2, "
                "spark.databricks.delta.snapshotPartitions 2; Spark's Kafka client, its defaults")


class Quix(Contender):
    name = "Quix Streams"
    slug = "quix"

    def __init__(self, args: argparse.Namespace, topic: Topic, props: dict[str, Any],
                 py: Path) -> None:
        super().__init__(args, topic, props)
        self.py = py
        self.version = f"{QUIX_VERSION} ({kafka_versions(py)})"
        self._groups: dict[Path, GroupCommitted] = {}

    def prepare(self, run: Path) -> None:
        (run / "out").mkdir(parents=True, exist_ok=True)

    def launch(self, run: Path, tag: str) -> Proc:
        cmds = []
        for i in range(self.args.quix_procs):
            cmds.append([str(self.py), str(PEERS / "quix_app.py"),
                         "--bootstrap", self.topic.bootstrap, "--topic", TOPIC,
                         "--out", str(run / "out"), "--group", f"quix_{run.name}",
                         "--commit-interval", str(self.args.interval),
                         "--state-dir", str(run / f"state{i}"), "--props", json.dumps(self.props)])
        if len(cmds) == 1:
            return Proc(cmds[0], venv_env(), run, run / "logs", tag)
        script = " & ".join(shlex.join(c) for c in cmds) + " & wait"
        return Proc(["bash", "-c", script], venv_env(), run, run / "logs", tag)

    def probe(self, run: Path) -> Callable[[], int]:
        """The offsets committed by the app's consumer group (Quix commits after
        its sinks flushed, at each checkpoint)."""
        if run not in self._groups:
            self._groups[run] = GroupCommitted(self.topic.bootstrap, f"quix_{run.name}",
                                               self.topic.partitions)
        return self._groups[run]

    def close(self) -> None:
        for g in self._groups.values():
            g.close()

    def verify(self, run: Path) -> tuple[int, int]:
        return count_ids((run / "out").glob(f"{TOPIC}/*/*.jsonl"), rb'"_value":\{"id":(\d+)')

    def notes(self, outcome: Outcome) -> str:
        return (f"{self.args.quix_procs} process(es) in one consumer group, LocalFileSink json, "
                f"commit_interval {self.args.interval:g} s, at-least-once, "
                "TopicAdmin.inspect_topics replaced (the mock cannot DescribeConfigs)")


# -- measuring ----------------------------------------------------------------------------------
def monitor(c: Contender, run: Path, tag: str, target: int, kill_at: int | None = None,
            timeout: float = 600.0) -> tuple[Outcome, Proc]:
    """Launch ``c`` on ``run`` and watch its durable progress until ``target``
    records are durable, or until ``kill_at`` records are durable (then SIGKILL
    the whole session)."""
    probe = c.probe(run)
    start = probe()
    while start < 0:
        time.sleep(POLL_S)
        start = probe()
    visible = c.visible(run) if kill_at is None and start == 0 else None
    proc = c.launch(run, tag)
    out = Outcome(proc.started, start_count=start)
    out.extra["wall"] = proc.started_wall
    durable = start
    trace: list[tuple[float, int, int]] = []
    out.extra["trace"] = trace
    while True:
        now = time.monotonic()
        got = probe()
        before, durable = durable, (got if got >= 0 else durable)  # -1: the store was busy
        seen = durable if visible is None else visible()
        if not trace or trace[-1][1:] != (durable, seen):
            trace.append((round(now - proc.started, 3), durable, seen))
        proc.sample()
        if out.up is None and durable > start:
            out.up = now
        if out.first is None and durable > start and (
                durable - start >= c.args.steady_from * (target - start)):
            out.first, out.first_count = now, durable
            proc.sample(force=True)
            out.cpu_first, out.self_first = proc.cpu, broker_cpu()
        elif out.first is not None and durable > before:
            out.steps += 1
        if out.vis_first is None and seen > start and (
                seen - start >= c.args.steady_from * (target - start)):
            out.vis_first, out.vis_first_count = now, seen
        if out.vis_done is None and seen >= target:
            out.vis_done = now
        if kill_at is not None and durable >= kill_at:
            proc.sample(force=True)
            proc.kill(signal.SIGKILL)
            proc.wait_gone()
            out.killed_at = durable
            break
        if durable >= target:
            out.done = now
            proc.sample(force=True)
            out.cpu_done, out.self_done = proc.cpu, broker_cpu()
            break
        rc = proc.exited()
        if rc is not None:
            out.error = f"exited with {rc}: {proc.tail()}"
            break
        if now - proc.started > timeout:
            out.error = f"timed out after {timeout:.0f} s with {durable:,} durable: {proc.tail()}"
            break
        time.sleep(POLL_S)
    out.peak_rss = proc.peak_rss
    with (run / "logs" / f"{tag}.trace.json").open("w") as f:
        json.dump({"columns": ["s since launch", "durable", "visible"], "trace": trace}, f)
    return out, proc


@dataclass
class Result:
    name: str
    version: str
    rates: list[float | None] = field(default_factory=list)
    vis_rates: list[float | None] = field(default_factory=list)
    startups: list[float | None] = field(default_factory=list)
    cpus: list[tuple[float, float, float] | None] = field(default_factory=list)
    few_steps: bool = False  # a steady phase of fewer than 3 durable steps
    resume: Outcome | None = None
    restart_count: int = 0
    kill_rows: tuple[int, int] | None = None
    full_rows: tuple[int, int] | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    peak_rss: int = 0
    totals: list[float | None] = field(default_factory=list)  # launch -> all durable, s

    @property
    def total(self) -> float | None:
        return self._median(self.totals)

    @staticmethod
    def _median(values: list[float | None]) -> float | None:
        good = [v for v in values if v is not None]
        return statistics.median(good) if good else None

    @property
    def rate(self) -> float | None:
        return self._median(self.rates)

    @property
    def vis_rate(self) -> float | None:
        return self._median(self.vis_rates)

    @property
    def startup(self) -> float | None:
        return self._median(self.startups)

    @property
    def cpu(self) -> str:
        """Median CPU us/record and cores of the steady phases."""
        good = [c for c in self.cpus if c is not None]
        if not good:
            return "-"
        us = statistics.median(c[0] for c in good)
        cores = statistics.median(c[1] for c in good)
        return f"{us:.2f} ({cores:.1f})"


def full_run(c: Contender, res: Result, base: Path, n: int, i: int) -> None:
    """One run on a fresh output until every record is durable."""
    run = base / f"{c.slug}_full{i}"
    c.prepare(run)
    log(f"{c.name}: full run {i + 1} ...")
    out, proc = monitor(c, run, "full", n, timeout=120 + n / 5_000)
    proc.stop()
    res.peak_rss = max(res.peak_rss, out.peak_rss)
    if out.error:
        res.error = out.error
        log(f"{c.name}: {out.error}")
        return
    res.full_rows = c.verify(run)
    res.rates.append(out.steady(n))
    res.vis_rates.append(out.visible_rate(n))
    res.startups.append(out.startup)
    res.totals.append(None if out.done is None else out.done - out.launched)
    res.cpus.append(out.steady_cpu(n))
    res.few_steps |= out.steps < 3
    log(f"{c.name}: start-up {fmt_s(out.startup)} s, steady {fmt_rate(out.steady(n))} "
        f"rec/s (steady from {out.first_count:,} durable), output visible "
        f"{fmt_rate(out.visible_rate(n))} rec/s, peak RSS {out.peak_rss / 2**20:,.0f} MB, "
        f"output rows/distinct {res.full_rows[0]:,}/{res.full_rows[1]:,}")
    note = c.notes(out)
    if note and i == 0:
        res.notes.append(note)


def kill_run(c: Contender, res: Result, base: Path, n: int) -> None:
    """SIGKILL at half durable, restart, run to the end, check the output."""
    timeout = 120 + n / 5_000
    run = base / f"{c.slug}_kill"
    c.prepare(run)
    log(f"{c.name}: kill/resume run: SIGKILL at >= {n // 2:,} durable ...")
    first, proc = monitor(c, run, "before_kill", n, kill_at=n // 2, timeout=timeout)
    res.peak_rss = max(res.peak_rss, first.peak_rss)
    if first.error or first.killed_at is None:
        proc.stop()
        res.error = f"kill run: {first.error}"
        log(f"{c.name}: {res.error}")
        return
    res.restart_count = first.killed_at
    out, proc = monitor(c, run, "after_kill", n, timeout=timeout)
    proc.stop()
    res.resume = out
    res.peak_rss = max(res.peak_rss, out.peak_rss)
    res.kill_rows = c.verify(run)
    if isinstance(c, Reclock) and c.notes(out):
        res.notes.append("restart after the kill: " + c.notes(out))
    if out.error:
        res.error = f"after restart: {out.error}"
    log(f"{c.name}: killed at {first.killed_at:,} durable; restart -> first new durable data "
        f"{fmt_s(out.startup)} s; output rows/distinct {res.kill_rows[0]:,}/{res.kill_rows[1]:,}")


def raw_run(res: Result, base: Path, topic: Topic, props: dict[str, Any], parse: bool,
            tag: str, steady_from: float) -> None:
    argv = [sys.executable, str(PEERS / "raw_consumer.py"), "--bootstrap", topic.bootstrap,
            "--topic", TOPIC, "--partitions", str(topic.partitions),
            "--records", str(topic.records), "--props", json.dumps(props),
            "--steady-from", str(steady_from)]
    if parse:
        argv.append("--json")
    log(f"{res.name} ...")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    self_before = broker_cpu()
    proc = Proc(argv, venv_env(), ROOT, base / "raw", tag)
    deadline = proc.started + 120 + topic.records / 5_000
    while proc.exited() is None and time.monotonic() < deadline:
        proc.sample()
        time.sleep(POLL_S)
    proc.stop(grace=1)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    wall = time.monotonic() - proc.started
    res.peak_rss = max(res.peak_rss, proc.peak_rss)
    try:
        got = json.loads(proc.out.read_text().strip().splitlines()[-1])
    except (IndexError, ValueError):
        res.error = f"no result: {proc.tail()}"
        return
    def at(wall: float) -> float:
        return proc.started + (wall - proc.started_wall)

    out = Outcome(proc.started, up=at(got["first"]), first=at(got["mark"]),
                  first_count=got["mark_n"], done=at(got["done"]))
    res.rates.append(out.steady(topic.records))
    res.vis_rates.append(out.steady(topic.records))
    res.startups.append(out.startup)
    # the whole process (start-up included), approximately the same as its steady phase
    res.cpus.append((cpu / topic.records * 1e6, cpu / wall,
                     (broker_cpu() - self_before) / wall))
    log(f"{res.name}: {fmt_rate(out.steady(topic.records))} rec/s, first message after "
        f"{fmt_s(out.startup)} s")


# -- main ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--records", type=int, default=4_000_000, help="records in the topic")
    ap.add_argument("--partitions", type=int, default=128,
                    help="partitions of the topic (the mock keeps ~5 MB per partition)")
    ap.add_argument("--quick", action="store_true", help="1M records in 32 partitions")
    ap.add_argument("--skip-peers", action="store_true",
                    help="reclock and the raw consumer only (no virtualenvs)")
    ap.add_argument("--only", default="raw,reclock,spark,bytewax,quix",
                    help="comma-separated subset of raw,reclock,spark,bytewax,quix")
    ap.add_argument("--broker", choices=("real", "mock"), default="real",
                    help="real: an Apache Kafka broker (KRaft) from tests/setup.sh's jars; "
                    "mock: librdkafka's mock cluster in this process (~5 MB per partition)")
    ap.add_argument("--spark-max-offsets", default="auto",
                    help="Spark Structured Streaming set-ups, each a contender: "
                    "maxOffsetsPerTrigger values, 0 = Spark's default (no limit); auto: "
                    "0, a sixteenth and a quarter of --records")
    ap.add_argument("--no-kill", action="store_true", help="skip the kill/resume runs")
    ap.add_argument("--repeat", type=int, default=1,
                    help="full runs per contender (the median steady rate is reported)")
    ap.add_argument("--interval", type=float, default=1.0,
                    help="seconds: reclock timestamp_interval, Bytewax snapshot interval "
                    "(whole seconds only, rounded), Quix commit_interval")
    ap.add_argument("--reclock-job", type=int, default=None,
                    help="reclock spark.max_records_per_job (None: a sixteenth of --records, "
                    "so that there are many commits to time)")
    ap.add_argument("--steady-from", type=float, default=0.25,
                    help="the steady phase starts at the first durable step holding this "
                    "share of the records (every contender alike)")
    ap.add_argument("--reclock-task", type=int, default=None,
                    help="reclock spark.max_records_per_task (default: reclock's own)")
    ap.add_argument("--reclock-jobs-in-flight", type=int, default=None,
                    help="reclock spark.jobs_in_flight (default: reclock's own)")
    ap.add_argument("--reclock-readers", default="native",
                    help="reclock's Kafka readers to run, each a contender: native (the C "
                    "reader, the default) and/or python")
    ap.add_argument("--bytewax-modes", default="w1,p2",
                    help="Bytewax set-ups, each a contender: w<N>: one process with N workers; "
                    "p<N>: N processes of one worker each")
    ap.add_argument("--bytewax-files", type=int, default=4, help="DirSink files")
    ap.add_argument("--bytewax-batch", type=int, default=1_000,
                    help="KafkaSource batch_size (messages per consume call)")
    ap.add_argument("--quix-procs", type=int, default=2,
                    help="Quix Streams processes in one consumer group")
    ap.add_argument("--librdkafka-defaults", action="store_true",
                    help=f"do not give every consumer {FETCH_PROPS}")
    ap.add_argument("--cache-dir", type=Path,
                    default=Path.home() / ".cache" / "reclock-peer-bench",
                    help="where the peers' virtualenvs live")
    ap.add_argument("--keep", action="store_true", help="keep the outputs and logs")
    args = ap.parse_args(argv)
    if args.quick:
        args.records, args.partitions = 1_000_000, 32
    if args.reclock_job is None:
        args.reclock_job = max(1, args.records // 16)
    args.only = {s.strip().lower() for s in args.only.split(",") if s.strip()}
    if args.skip_peers:
        args.only -= {"bytewax", "quix", "spark"}
    if args.spark_max_offsets == "auto":
        args.spark_max_offsets = f"0,{args.records // 16},{args.records // 4}"
    args.spark_max_offsets = [int(x) for x in args.spark_max_offsets.split(",") if x.strip()]
    return args


def machine() -> str:
    load = os.getloadavg()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} CPUs, {mem:.0f} GB, Python {sys.version.split()[0]}, "
            f"load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    props = {} if args.librdkafka_defaults else dict(FETCH_PROPS)
    log(f"machine: {machine()}")
    pys: dict[str, Path] = {}
    failed: dict[str, str] = {}
    for key, name, spec, dist, version in (
            ("bytewax", "bytewax", f"bytewax[kafka]=={BYTEWAX_VERSION}", "bytewax",
             BYTEWAX_VERSION),
            ("quix", "quixstreams", f"quixstreams=={QUIX_VERSION}", "quixstreams",
             QUIX_VERSION),
            ("spark", "pyspark", f"pyspark=={SPARK_PEER_VERSION}", "pyspark",
             SPARK_PEER_VERSION)):
        if key in args.only:
            py, err = venv_python(args.cache_dir, name, spec, dist, version)
            if py is None:
                failed[key] = err
            else:
                pys[key] = py
    log(f"producing {args.records:,} records into {args.partitions} partitions ...")
    broker, topic = start_broker(args.records, args.partitions, args.broker == "real")
    log(f"{broker.version} {topic.bootstrap}: {topic.records:,} records of "
        f"{topic.value_bytes:.0f} B in {topic.produce_s:.1f} s "
        f"({topic.records / topic.produce_s:,.0f}/s); largest "
        f"partition {topic.max_partition_bytes / 2**20:.2f} MB (payload + framing estimate)")
    base = Path(tempfile.mkdtemp(prefix="peerbench_"))  # no '-': Quix's FileSink rejects it
    results: list[Result] = []
    raws: list[tuple[Result, dict[str, Any], bool, str]] = []
    try:
        if "raw" in args.only:
            versions = kafka_versions(sys.executable)
            raws.append((Result("raw consume", versions), props, False, "consume"))
            raws.append((Result("raw consume + json.loads", versions), props, True, "json"))
            if props:
                raws.append((Result("raw consume (librdkafka defaults)", versions), {}, False,
                             "defaults"))
        contenders: list[Contender] = []
        if "reclock" in args.only:
            for reader in args.reclock_readers.split(","):
                contenders.append(Reclock(args, topic, props, reader.strip()))
        if "bytewax" in pys:
            for mode in args.bytewax_modes.split(","):
                contenders.append(Bytewax(args, topic, props, pys["bytewax"], mode.strip()))
        if "quix" in pys:
            contenders.append(Quix(args, topic, props, pys["quix"]))
        if "spark" in pys:
            try:
                for m in args.spark_max_offsets:
                    contenders.append(SparkStreaming(args, topic, props, pys["spark"], m))
            except RuntimeError as exc:
                failed["spark"] = str(exc)
        measured = [Result(c.name, c.version) for c in contenders]
        results = [r for r, *_ in raws] + measured
        # Round-robin, so that the machine's other load hits every contender alike.
        for i in range(args.repeat):
            for res, p, parse, tag in raws:
                if res.error is None and (i == 0 or tag != "defaults"):
                    raw_run(res, base, topic, p, parse, f"{tag}{i}", args.steady_from)
            for c, res in zip(contenders, measured, strict=True):
                if res.error is None:
                    guarded(c, res, full_run, c, res, base, topic.records, i)
        if not args.no_kill:
            for c, res in zip(contenders, measured, strict=True):
                if res.error is None:
                    guarded(c, res, kill_run, c, res, base, topic.records)
        for c in contenders:
            c.close()
        for key, err in failed.items():
            results.append(Result({"bytewax": "Bytewax", "quix": "Quix Streams",
                                   "spark": "Spark Structured Streaming"}[key], "-", error=err))
        report(args, topic, props, results, broker.version)
    finally:
        for proc in Proc.live:
            proc.kill(signal.SIGKILL)
            proc.wait_gone(10)
        if args.keep:
            log(f"outputs and logs kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
        broker.close()
    return 0


def guarded(c: Contender, res: Result, fn: Callable[..., None], *a: Any) -> None:
    """Run ``fn``; an exception is reported in the table, and the others go on."""
    try:
        fn(*a)
    except Exception as exc:
        log(f"{c.name}: {type(exc).__name__}: {exc}")
        res.error = f"{type(exc).__name__}: {exc}"


def report(args: argparse.Namespace, topic: Topic, props: dict[str, Any],
           results: list[Result], broker: str) -> None:
    n = topic.records
    peers = [r.rate for r in results if r.name.startswith(("Bytewax", "Quix")) and r.rate]
    fastest_peer = max(peers) if peers else None
    sparks = [r.rate for r in results if r.name.startswith("Spark") and r.rate]
    best_spark = max(sparks) if sparks else None
    raw = next((r.rate for r in results if r.name == "raw consume"), None)
    rows = []
    for r in results:
        out = "-"
        if r.kill_rows is not None:
            rows_, distinct = r.kill_rows
            out = f"{rows_:,} / {distinct:,} / {rows_ - distinct:,} / {n - distinct:,}"
        elif r.full_rows is not None:
            rows_, distinct = r.full_rows
            out = f"{rows_:,} / {distinct:,} / {rows_ - distinct:,} / {n - distinct:,} (no kill)"
        resume = "-"
        if r.resume is not None:
            resume = f"{fmt_s(r.resume.startup)} (killed at {r.restart_count / n:.0%})"
        rows.append([
            r.name, r.version, fmt_s(r.startup), fmt_s(r.total),
            fmt_rate(r.rate) + (" *" if r.few_steps and r.rate else ""), fmt_rate(r.vis_rate),
            fmt_ratio(r.rate, fastest_peer), fmt_ratio(r.rate, best_spark),
            fmt_ratio(r.rate, raw, pct=True), r.cpu,
            f"{r.peak_rss / 2**20:,.0f}" if r.peak_rss else "-", resume, out,
        ])
    print()
    print(f"Peer benchmark, {time.strftime('%Y-%m-%d %H:%M')}: {n:,} JSON records of "
          f"~{topic.value_bytes:.0f} B in {topic.partitions} partitions of one topic on "
          f"{broker}")
    print(f"machine: {machine()}")
    print(f"every consumer: {props or 'librdkafka defaults'}; durability interval "
          f"{args.interval:g} s (reclock timestamp_interval, Bytewax snapshots, Quix commits)")
    print()
    print(table("", ["contender", "version", "start-up s", "all durable s", "steady rec/s",
                 "visible rec/s", "vs fastest peer", "vs best Spark", "vs raw",
                 "CPU us/rec (cores)", "peak RSS MB",
                 "resume after kill s", "output after kill: rows / distinct / dups / missing"],
                rows, left=(0, 1)))
    if any(r.few_steps and r.rate for r in results):
        print("* fewer than 3 durable steps after the first one: too few records to time "
              "the steady state well (use more --records)")
    print()
    for r in results:
        if len(r.rates) > 1:
            print(f"{r.name}: steady rec/s of the {len(r.rates)} runs: "
                  + ", ".join(fmt_rate(x) for x in r.rates))
        broker = [c[2] for c in r.cpus if c is not None]
        if broker:
            print(f"{r.name}: the broker used "
                  f"{statistics.median(broker):.2f} cores meanwhile")
        for note in r.notes:
            print(f"{r.name}: {note}")
        if r.error:
            print(f"{r.name}: DID NOT COMPLETE: {r.error}")
    rc = next((r for r in results if r.name == "reclock"), None)
    if rc is not None:
        print()
        if rc.rate is None:
            print("targets: reclock did not produce a steady-state rate")
            return
        if fastest_peer:
            ok = rc.rate >= TARGET_PEER_RATIO * fastest_peer
            print(f"target reclock >= {TARGET_PEER_RATIO:g}x the fastest peer: "
                  f"{'PASS' if ok else 'MISS'} ({rc.rate / fastest_peer:.2f}x)")
        else:
            print("target reclock >= 2x the fastest peer: no peer rate (not run or failed)")
        if best_spark:
            ok = rc.rate >= TARGET_SPARK_RATIO * best_spark
            print(f"target reclock >= {TARGET_SPARK_RATIO:g}x Spark Structured Streaming at "
                  f"its best: {'PASS' if ok else 'MISS'} ({rc.rate / best_spark:.2f}x)")
        if raw:
            ok = rc.rate >= TARGET_RAW_SHARE * raw
            print(f"target reclock >= {TARGET_RAW_SHARE:.0%} of the raw consume rate: "
                  f"{'PASS' if ok else 'MISS'} ({rc.rate / raw:.0%})")
        spark_resumes = [r.resume.startup for r in results if r.name.startswith("Spark")
                         and r.resume is not None and r.resume.startup is not None]
        if rc.resume is not None and rc.resume.startup is not None and spark_resumes:
            ok = rc.resume.startup <= min(spark_resumes)
            print(f"target reclock's resume after kill <= Spark Structured Streaming's: "
                  f"{'PASS' if ok else 'MISS'} ({rc.resume.startup:.2f} s against "
                  f"{min(spark_resumes):.2f} s)")


if __name__ == "__main__":
    sys.exit(main())
