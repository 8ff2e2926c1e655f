"""The scale targets of issue 17, measured and printed with PASS / FAIL by one command.

One SparkSession (``local[2]``) and, for the Kafka targets, one Apache Kafka
broker (tests/kafkabroker.py), started once. Each target runs on its own
temporary state directory; ``--only`` picks some (names below), ``--quick``
shortens the measured windows. The table at the end has one row per target:
what was measured, the goal, and PASS or FAIL.

* ``partitions-2048`` -- a topic of 2,048 partitions written at ``--rate``
  records/s round-robin, a Delta output, 1 s interval: bindings per
  interval over the window (goal: one each), the output's lag p99 sampled
  every 0.5 s (goal <= 2 s), then ``reclock status`` (of the running
  pipeline), ``bindings`` and ``verify`` (once it stopped) each timed as a
  user runs them (goal < 2 s each, exit 0).
* ``retained-24h-counter`` / ``retained-24h-512`` -- the median tick time
  of a pipeline whose remap store holds a day of bindings (one per second,
  seeded through the store's API, consistent with the source), against a
  fresh store, same source and rate (goal: within 20%). The counter is a
  generator; the 512-partition source a topic holding one record per
  binding. ``--retained-512`` sets how many bindings the 512-partition run
  seeds (default 86,400; the memory they take is printed).
* ``records-8MiB`` -- 8 MiB records read with ``max_bytes_per_task`` 32 MiB
  and 64 MiB (bench/big_records_bench.py's driver): the largest Python
  worker's peak, fitted as ``a + b x task bytes`` (goal: bounded by the task
  bytes plus a constant: b <= 8, a <= 512 MiB).
* ``startup-1000`` -- parse, build and open 100 and 1,000 counter sources
  (bench/pipeline_bench.py's start-up, Spark excluded; goal: 1,000 under
  1 s, linear from 100: at most 12 x the time of 100).
* ``sources-100-1s`` / ``sources-1000-10s`` -- that many counters (20
  records/s each) at 1 s / 10 s: every output's lag sampled every 0.5 s
  over the window, p99 (goal <= 2 s / <= 20 s); small jobs share Spark jobs
  (the default), and beside it, for comparison, each source runs its own.
* ``pattern-500-topics`` -- 500 topics of 4 partitions read by one
  ``topic_pattern`` source, against one topic of 2,000 partitions, the same
  records (``--topic-records``, already written) in both: the seconds from
  the binding that bound them until the output's commits hold them all,
  from the progress log (one topic, the pattern, three times over, each
  one's best taken; goal: the pattern within 1.2x of the one topic); beside it,
  the seconds from the start (the source's open and the wait for its first
  interval boundary included: with these records, mostly those). Then, in
  each pattern run, a new matching topic gets records: seconds from their
  write until the output's commit holds them, from the progress log (goal,
  in each run: one interval plus the tick that read them, from its probe
  until its commit: that tick began within an interval of the write).
* ``keyed-10M`` -- one transaction of 10 million rows (``--quick``: 1
  million) into a keyed Postgres table, read by a ``reclock run`` of its own
  (bench/keyed_txn_bench.py): the peak resident memory of the driver's Python
  process plus its JVM while it lands (goal < 1 GiB), and every row held once
  at one IntoTime.
* ``soak-1h`` -- ``python bench/soak.py`` for an hour (``--quick``: 20
  minutes) in a process of its own: its verdict (driver RSS, RSS without
  SQLite's bounded caches, threads, file descriptors, tick time; the last
  quarter's median against the first's).

Run: ``python bench/scale_targets.py`` (about 90 minutes on 2 cores, the
soak's hour included) or
``--quick`` / ``--only partitions-2048,startup-1000``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_bench import (  # noqa: E402
    counter_source,
    logging_quiet,
    pipeline_yaml,
    read_events,
    start_up,
)

MiB = 2**20
PASS, FAIL = "PASS", "FAIL"
Row = tuple[str, str, str, str]  # target, measured, goal, verdict


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Env:
    """What the targets share: Spark, the broker (started on first use), a temp root."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        from reclock.runtime.spark import spark_session

        self.args = args
        self.root = root
        self.spark = spark_session("local[2]", "reclock-scale-targets",
                                   {"spark.sql.shuffle.partitions": "2"})
        self._kafka: Any = None
        self._pg: Any = None

    @property
    def pg(self) -> Any:
        if self._pg is None:
            from tests.pgcluster import PgCluster

            log("starting a PostgreSQL cluster ...")
            self._pg = PgCluster(wal_level="replica").start()
        return self._pg

    @property
    def kafka(self) -> Any:
        if self._kafka is None:
            from tests.kafkabroker import KafkaCluster

            log("starting a Kafka broker ...")
            self._kafka = KafkaCluster(nodes=1).start()
        return self._kafka

    def dir(self, name: str) -> Path:
        d = self.root / f"{name}-{uuid.uuid4().hex[:6]}"
        d.mkdir(parents=True)
        return d

    def close(self) -> None:
        if self._kafka is not None:
            self._kafka.close()
        if self._pg is not None:
            self._pg.stop()
        self.spark.stop()


@contextmanager
def running(env: Env, text: str, base: Path) -> Iterator[list[Any]]:
    """``text`` run in a thread on the shared Spark session until the block ends."""
    from reclock.config import parse_config
    from tests.running import running as run_in_thread

    cfg = parse_config(text, str(base / "pipeline.yaml"), base_dir=base)
    with run_in_thread(cfg, env.spark) as runners:
        yield runners


def lags(runners: list[Any], seconds: float, every: float = 0.5) -> list[float]:
    """Every output's lag (ms), sampled every ``every`` s for ``seconds``."""
    out: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for r in runners:
            for o in r.status()["outputs"]:
                if o["lag_ms"] is not None:
                    out.append(float(o["lag_ms"]))
        time.sleep(every)
    return out


def _cpu_s(stat: Path) -> float | None:
    """User plus system CPU seconds from a ``/proc`` ``stat`` file (None if gone)."""
    try:
        text = stat.read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this process (the driver's Python; ``py:NAME``
    by thread name), of the Spark JVM, of Spark's Python workers, of the
    Kafka broker and of PostgreSQL's server processes (from /proc, the
    machine's: the benchmark runs alone; processes that exited are not
    counted)."""
    from big_records_bench import cmdline

    out = {"python": 0.0, "jvm": 0.0, "workers": 0.0}
    for t in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            comm = (t / "comm").read_text().strip()
        except OSError:
            continue
        name = "py:" + ("tokio" if "tokio" in comm else comm.rstrip("0123456789-_") or "?")
        out[name] = out.get(name, 0.0) + (_cpu_s(t / "stat") or 0.0)
    me = str(os.getpid())
    for d in Path("/proc").iterdir():
        cpu = _cpu_s(d / "stat") if d.name.isdigit() else None
        if cpu is None:
            continue
        cmd = cmdline(d.name)
        if d.name == me:
            out["python"] += cpu
        elif cmd.split(" ", 1)[0].endswith("java") and "SparkSubmit" in cmd:
            out["jvm"] += cpu
        elif "kafka.Kafka" in cmd:  # the benchmark's broker
            out["broker"] = out.get("broker", 0.0) + cpu
        elif cmd.startswith("postgres"):  # a private cluster's server processes
            out["postgres"] = out.get("postgres", 0.0) + cpu
        elif "pyspark.daemon" in cmd:
            out["workers"] += cpu
    return out


def log_cores(what: str, before: dict[str, float], seconds: float) -> None:
    """Log the CPU cores each part used since ``before`` (:func:`cpu_seconds`)."""
    used = {k: (v - before.get(k, 0.0)) / seconds for k, v in cpu_seconds().items()}
    log(f"{what}; CPU cores used: " + ", ".join(
        f"{k} {v:.2f}" for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v >= 0.01))


@contextmanager
def profiled(on: bool, what: str, top: int = 30) -> Iterator[None]:
    """With ``--profile``: every thread's CPU time in the block (yappi, from
    PyPI), the costliest functions printed to stderr."""
    if not on:
        yield
        return
    import yappi  # type: ignore[import-untyped]

    yappi.set_clock_type("cpu")
    yappi.start()
    try:
        yield
    finally:
        yappi.stop()
        stats = yappi.get_func_stats()
        stats.sort(os.environ.get("RECLOCK_PROFILE_SORT", "ttot"))  # tsub: own time
        log(f"profile of {what} (CPU seconds, all threads; tsub = own time):")
        for f in list(stats)[:top]:
            print(f"  {f.ttot:8.2f} {f.tsub:8.2f} {f.ncall:9d}  {f.module.split('/')[-1]}:"
                  f"{f.lineno} {f.name}", file=sys.stderr)
        yappi.clear_stats()


def p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99)) if xs else float("nan")


def verdict(ok: bool) -> str:
    return PASS if ok else FAIL


def kafka_yaml(state: Path, bootstrap: str, topic: str, interval: str = "1s") -> str:
    return f"""state_dir: {state}
timestamp_interval: {interval}
spark: {{master: "local[2]"}}
sources:
  - name: k
    kafka: {{bootstrap_servers: "{bootstrap}", topic: {topic}, timeout: 30s}}
    outputs:
      - {{name: k, format: {{type: json, schema: {{i: int64}}}}, sink: file}}
"""


def produce(bootstrap: str, topic: str, n: int, partitions: int, start: int = 0) -> None:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    for i in range(start, start + n):
        while True:
            try:
                p.produce(topic, value=b'{"i": %d}' % i, partition=i % partitions)
                break
            except BufferError:
                p.poll(0.05)
    assert p.flush(120) == 0


@functools.cache
def _with_bytecode() -> dict[str, str]:
    """The environment for a timed ``reclock`` command, as an installed one
    runs: with its modules' bytecode compiled (``pip install`` compiles
    them; a checkout compiles on first import unless PYTHONDONTWRITEBYTECODE
    is set, as on this machine, where compiling cost 0.3 s per command)."""
    env = dict(os.environ)
    if env.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
        subprocess.run([sys.executable, "-m", "compileall", "-q", "reclock", "sinks", "sources",
                        "remap_store"], cwd=ROOT, capture_output=True, check=False)
    return env


def cli_seconds(*args: str, profile: bool = False) -> tuple[float, int]:
    """Seconds a ``reclock`` command takes, and its exit code. With
    ``profile``, a second run under cProfile prints where it spent them."""
    env = _with_bytecode()
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "reclock.cli", *args], capture_output=True,
                       text=True, timeout=600, cwd=ROOT, env=env)
    took = time.monotonic() - t0
    if profile:
        with tempfile.NamedTemporaryFile(suffix=".prof") as f:
            subprocess.run([sys.executable, "-m", "cProfile", "-o", f.name, "-m", "reclock.cli",
                            *args], capture_output=True, timeout=600, cwd=ROOT, env=env)
            log(f"profile of reclock {args[0]} (cumulative seconds):")
            pstats.Stats(f.name, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    return took, r.returncode


# -- targets -----------------------------------------------------------------------------------
def partitions_2048(env: Env) -> list[Row]:
    k = env.kafka
    n = 2048
    topic = f"p2048-{uuid.uuid4().hex[:6]}"
    log(f"creating a topic of {n} partitions ...")
    k.create_topic(topic, n)
    d = env.dir("p2048")
    path = d / "pipeline.yaml"
    path.write_text(kafka_yaml(d / "state", k.bootstrap, topic))
    window = 30.0 if env.args.quick else 90.0
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            produce(k.bootstrap, topic, int(env.args.rate / 4), n, start=i)
            i += int(env.args.rate / 4)
            stop.wait(0.25)

    w = threading.Thread(target=writer, daemon=True)
    w.start()
    try:
        with running(env, path.read_text(), d) as runners:
            r = runners[0]
            time.sleep(20)  # warm-up: the first jobs over every partition
            b0, t0, cpu = r.status()["bindings"], time.monotonic(), cpu_seconds()
            with profiled(env.args.profile, "2,048 partitions"):
                sampled = lags(runners, window)
            b1, t1 = r.status()["bindings"], time.monotonic()
            log_cores("2,048 partitions", cpu, t1 - t0)
            # of the running pipeline
            times = {"status": cli_seconds("status", str(path), profile=env.args.profile)}
    finally:
        stop.set()
        w.join()
    per = (b1 - b0) / (t1 - t0)
    lag = p99(sampled)
    times["bindings"] = cli_seconds("bindings", str(path), "k", profile=env.args.profile)
    times["verify"] = cli_seconds("verify", str(path), profile=env.args.profile)
    rows: list[Row] = [
        ("2,048 partitions: bindings per interval", f"{per:.2f}/s", ">= 0.9/s (one each)",
         verdict(per >= 0.9)),
        ("2,048 partitions: sink lag p99", f"{lag / 1000:.1f} s", "<= 2 s", verdict(lag <= 2000)),
    ]
    for c, (s, rc) in times.items():
        rows.append((f"2,048 partitions: reclock {c}", f"{s:.1f} s (exit {rc})", "< 2 s",
                     verdict(s < 2.0 and rc == 0)))
    return rows


def _tick_median(runners: list[Any], warmup: float, window: float) -> float:
    """The median duration of the first runner's ticks that ran in the window."""
    r = runners[0]
    time.sleep(warmup)
    ticks = r.ticks
    time.sleep(window)
    new = list(r.observed.tick_ms)[-(r.ticks - ticks):] if r.ticks > ticks else []
    return statistics.median(new) if new else float("nan")


def _seed(state: Path, source: str, kind: str, frontiers: Callable[[int], Any], count: int,
          text: str, base: Path) -> float:
    """``count`` bindings, one per second ending now, into the pipeline's store;
    returns the seconds it took."""
    from reclock.config import parse_config
    from reclock.core.bindings import Binding
    from reclock.core.frontier import Antichain
    from reclock.core.time import IntoTime
    from reclock.pipeline import Pipeline

    cfg = parse_config(text, str(base / "pipeline.yaml"), base_dir=base)
    pipe = Pipeline(cfg)
    t0 = time.monotonic()
    try:
        store = pipe.store
        store.create_shard(source, kind)
        now = int(time.time() * 1000) - 2000
        first = now - count * 1000
        upper = Antichain.from_elem(IntoTime(0))
        step = 2000
        for lo in range(0, count, step):
            batch = [Binding(IntoTime(first + i * 1000), frontiers(i))
                     for i in range(lo, min(count, lo + step))]
            new = Antichain.from_elem(IntoTime(int(batch[-1].time) + 1))
            store.compare_and_append(source, batch, upper, new)
            upper = new
    finally:
        pipe.close()
    return time.monotonic() - t0


def retained_counter(env: Env) -> list[Row]:
    from reclock.core.frontier import Antichain
    from reclock.core.time import Counter

    count = 86_400
    window = 20.0 if env.args.quick else 40.0
    med: dict[str, float] = {}
    held: dict[str, str] = {}
    for label in ("fresh", "seeded"):
        d = env.dir(f"ret-counter-{label}")
        text = pipeline_yaml(d / "state", [counter_source("c", 100.0)])
        if label == "seeded":
            s = _seed(d / "state", "c", "counter",
                      lambda i: Antichain.from_elem(Counter(i + 1)), count, text, d)
            log(f"seeded {count:,} counter bindings in {s:.0f}s")
        with running(env, text, d) as runners:
            med[label] = _tick_median(runners, 30.0, window)
            op = runners[0].operator
            held[label] = f"{len(op.bindings):,} of {op.retained:,}"
        log(f"counter, {label}: median tick {med[label]:.0f} ms, the driver holds "
            f"{held[label]} retained bindings")
    ratio = med["seeded"] / med["fresh"]
    return [("24 h of bindings, counter: tick time", f"{med['seeded']:.0f} ms vs "
             f"{med['fresh']:.0f} ms fresh ({ratio:.2f}x); the driver holds {held['seeded']} "
             "retained bindings", "<= 1.2x", verdict(ratio <= 1.2))]


def retained_512(env: Env) -> list[Row]:
    from reclock.core.frontier import kafka_frontier

    k = env.kafka
    parts, count = 512, env.args.retained_512
    window = 20.0 if env.args.quick else 40.0
    topic = f"r512-{uuid.uuid4().hex[:6]}"
    k.create_topic(topic, parts)
    produce(k.bootstrap, topic, count, parts)
    med: dict[str, float] = {}
    rss: dict[str, float] = {}
    for label in ("fresh", "seeded"):
        d = env.dir(f"ret-512-{label}")
        text = kafka_yaml(d / "state", k.bootstrap, topic)
        if label == "seeded":
            offsets = dict.fromkeys(range(parts), 0)

            def frontier(i: int, offsets: dict[int, int] = offsets) -> Any:
                offsets[i % parts] += 1
                return kafka_frontier(offsets, partitions=parts)

            s = _seed(d / "state", "k", "kafka", frontier, count, text, d)
            log(f"seeded {count:,} bindings of {parts} partitions in {s:.0f}s")
        rss0 = _rss_mib()
        with running(env, text, d) as runners:
            med[label] = _tick_median(runners, 40.0, window)
            rss[label] = _rss_mib() - rss0
            op = runners[0].operator
        log(f"512 partitions, {label}: median tick {_ms(med[label], window)}, driver RSS "
            f"{rss[label]:+.0f} MiB, the driver holds {len(op.bindings):,} of "
            f"{op.retained:,} retained bindings")
    ratio = med["seeded"] / med["fresh"]
    scope = "24 h" if count >= 86_400 else f"{count:,} bindings ({count / 3600:.1f} h)"
    return [(f"{scope}, 512 partitions: tick time", f"{_ms(med['seeded'], window)} vs "
             f"{_ms(med['fresh'], window)} fresh ({ratio:.2f}x); driver RSS "
             f"{rss['seeded']:+.0f} MiB vs {rss['fresh']:+.0f}", "<= 1.2x",
             verdict(ratio <= 1.2 and count >= 86_400))]


def _ms(median: float, window: float) -> str:
    """A median tick, or that no tick ended in the window (NaN)."""
    return f"{median:.0f} ms" if median == median else f"no tick ended in {window:.0f} s"


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB


def records_8mib(env: Env) -> list[Row]:
    k = env.kafka
    topic = f"big-{uuid.uuid4().hex[:6]}"
    k.create_topic(topic, 1, config={"max.message.bytes": str(9 * MiB)})
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": k.bootstrap, "message.max.bytes": 9 * MiB})
    for i in range(64):
        p.produce(topic, value=json.dumps({"id": i, "body": "x" * (8 * MiB - 40)}).encode())
        p.poll(0)
    assert p.flush(120) == 0
    peak: dict[int, float] = {}
    for mib in (32, 64):
        d = env.dir(f"big-{mib}")
        env_ = {**os.environ, "PYSPARK_PYTHON": sys.executable, "BENCH_TREE": str(ROOT),
                "PYTHONPATH": str(ROOT)}
        out = subprocess.run([sys.executable, str(ROOT / "bench" / "big_records_bench.py"),
                              "--records", "64", "--child", k.bootstrap, topic, f"{mib}MiB",
                              str(d)], capture_output=True, text=True, env=env_, timeout=1800)
        if out.returncode:
            raise RuntimeError(out.stderr[-2000:])
        peak[mib] = json.loads(out.stdout.strip().splitlines()[-1])["worker"]
        log(f"8 MiB records, {mib} MiB tasks: largest worker {peak[mib]:.0f} MiB")
    b = (peak[64] - peak[32]) / 32
    a = peak[32] - b * 32
    return [("8 MiB records: largest worker", f"{peak[32]:.0f} MiB @ 32 MiB tasks, "
             f"{peak[64]:.0f} MiB @ 64 MiB: {a:.0f} MiB + {b:.1f} x task", "<= 512 MiB + 8 x task",
             verdict(a <= 512 and b <= 8))]


def startup_1000(env: Env) -> list[Row]:
    took = {}
    for n in (100, 1000):
        d = env.dir(f"startup-{n}")
        text = pipeline_yaml(d / "state", [counter_source(f"c{i}", 10.0) for i in range(n)])
        s = start_up(text, d, env.spark)
        took[n] = s.framework
        s.pipe.close()
        log(f"start-up of {n} sources: {took[n]:.2f}s")
    ratio = took[1000] / took[100]
    return [("1,000 sources: framework start-up", f"{took[1000]:.2f} s (100: {took[100]:.2f} s,"
             f" x{ratio:.1f})", "< 1 s, <= 12x of 100",
             verdict(took[1000] < 1.0 and ratio <= 12))]


def many_sources(env: Env, n: int, interval: str, goal_ms: float) -> list[Row]:
    """The lag p99 of ``n`` counters, with small jobs sharing Spark jobs (the
    default) and, side by side, each source's job its own (the goal is on
    the first)."""
    from reclock.contracts.config import parse_duration

    rows: list[Row] = []
    for shared in (True, False):
        d = env.dir(f"sources-{n}")
        text = pipeline_yaml(d / "state", [counter_source(f"c{i}", 20.0) for i in range(n)],
                             interval=interval)
        if env.args.sink == "postgres":  # each source's output a table of its own
            parts = text.split("        sink: file")
            text = parts[0] + "".join(
                f'        sink: {{type: postgres, dsn: "{env.pg.url}", table: c{i}_{d.name[-6:]}}}'
                + part for i, part in enumerate(parts[1:]))
        if not shared:
            text = text.replace("spark:\n", "spark:\n  shared_jobs_max_records: 0\n", 1)
        window = 30.0 if env.args.quick else 90.0
        with running(env, text, d) as runners:
            time.sleep(30.0)  # every source open and past its first commits
            ticks, cpu, t0 = sum(r.ticks for r in runners), cpu_seconds(), time.monotonic()
            with profiled(env.args.profile and shared, f"{n} sources"):
                sampled = lags(runners, window)
            took = time.monotonic() - t0
            log_cores(f"{n} sources ({'shared' if shared else 'a job each'}): "
                      f"{(sum(r.ticks for r in runners) - ticks) / took:.1f} ticks/s (due: "
                      f"{n * 1000 / parse_duration(interval):.0f}/s)", cpu, took)
        lag = p99(sampled)
        how = "shared jobs" if shared else "a job each (shared_jobs_max_records: 0)"
        if env.args.sink != "file":
            how += f", {env.args.sink} sinks"
        rows.append((f"{n:,} sources at {interval}: lag p99, {how}",
                     f"{lag / 1000:.1f} s ({len(sampled):,} samples)",
                     f"<= {goal_ms / 1000:.0f} s" if shared else "(for comparison)",
                     verdict(lag <= goal_ms) if shared else "-"))
    return rows


def pattern_yaml(state: Path, bootstrap: str, pattern: str) -> str:
    return kafka_yaml(state, bootstrap, "x").replace(
        "topic: x,", f"topic_pattern: {json.dumps(pattern)},")


def _caught_up(runners: list[Any], total: int, limit: float) -> float:
    """Seconds until the first output holds ``total`` records."""
    from tests.running import durable

    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if sum(durable(runners[0]).values()) >= total:
            return time.monotonic() - t0
        time.sleep(0.1)
    raise TimeoutError(f"not caught up with {total:,} records in {limit:.0f}s")


def _committed(state: Path, total: int) -> tuple[int, list[dict[str, Any]]]:
    """From the progress log: the wall-clock ms of the ``sink_upper`` event
    whose rows, added up from the log's start, reach ``total``, and the
    binding events before it."""
    rows = 0
    bindings: list[dict[str, Any]] = []
    for ev in read_events(state):
        if ev["kind"] == "binding":
            bindings.append(ev)
        elif ev["kind"] == "sink_upper":
            rows += int(ev.get("rows") or 0)
            if rows >= total:
                return int(ev["ts"]), bindings
    raise ValueError(f"the progress log of {state} does not show {total:,} rows committed")


def _bound_to_durable(state: Path, total: int) -> float:
    """Seconds from the binding that bound the records (the source's second:
    the first maps its start position, so nothing commits before the second)
    until its output's commits hold ``total`` rows: the catch-up itself,
    without the source's open and the wait for its first interval boundary
    after it."""
    ts, bindings = _committed(state, total)
    bound = [b for b in bindings if b.get("time") is not None][1]
    return (ts - int(bound["ts"])) / 1000


def _new_topic_landed(state: Path, written: float, total: int) -> tuple[float, float]:
    """From the progress log: (seconds from ``written`` -- the wall clock
    when a new topic's records were written -- until the output's commits
    held ``total`` rows, seconds of the tick that read them: from the start
    of the probe of the binding it read up to, the last one minted before
    that commit, until the commit). The goal, one interval plus one job,
    says that tick began within an interval of the records: its probe saw
    the new topic."""
    ts, bindings = _committed(state, total)
    bound = int(bindings[-1]["ts"]) - int(bindings[-1].get("mint_ms") or 0)
    return ts / 1000 - written, (ts - bound) / 1000


def pattern_500(env: Env) -> list[Row]:
    k = env.kafka
    run = uuid.uuid4().hex[:6]
    total = env.args.topic_records // 2 if env.args.quick else env.args.topic_records
    one = f"one{run}"
    log("creating one topic of 2,000 partitions and 500 topics of 4 ...")
    k.create_topic(one, 2000)
    produce(k.bootstrap, one, total, 2000)
    topics = [f"pt{run}-{i:03d}" for i in range(500)]
    for i, t in enumerate(topics):
        k.create_topic(t, 4)
        produce(k.bootstrap, t, total // 500, 4, start=i * (total // 500))
    pattern = f"pt{run}-.*"
    secs: dict[str, float] = {}
    work: dict[str, float] = {}  # label -> seconds from the binding to durable, the best
    new_topic: list[tuple[float, float]] = []  # (seconds, median tick) per pattern run
    # one topic, 500 topics, three times over: each one's best. The first run
    # warms Spark's Python workers up, and so, partly, does the second (its
    # first job can take 1.2 s against 0.13 s later): a single run of either
    # would measure the warm-up, not the pattern. These catch-ups take half a
    # second, and one in two or three on a 2-core machine comes 0.1 s slower
    # or faster than the rest (the one topic 0.39, 0.49 and 0.50 s; the
    # pattern 0.50, 0.51, 0.51 s): best of two leaves the ratio to chance
    # (1.15x-1.35x), best of three less so.
    runs = (("one topic", lambda st: kafka_yaml(st, k.bootstrap, one)),
            ("500 topics", lambda st: pattern_yaml(st, k.bootstrap, pattern))) * 3
    for label, text_of in runs:
        d = env.dir(f"pattern-{label[:3]}")
        with running(env, text_of(d / "state"), d) as runners:
            # (a later pattern run also reads the earlier runs' new topics)
            want = total + (1000 * len(new_topic) if label == "500 topics" else 0)
            took = _caught_up(runners, want, 900)
            secs[label] = min(took, secs.get(label, took))
            bound = _bound_to_durable(d / "state", want)
            work[label] = min(bound, work.get(label, bound))
            log(f"{label}: {total:,} records in {took:.1f}s ({bound:.2f} s from their binding)")
            if label != "500 topics":
                continue
            time.sleep(3)
            new = f"pt{run}-new{len(new_topic)}"
            k.create_topic(new, 4)
            produce(k.bootstrap, new, 1000, 4)
            written = time.time()
            want = total + 1000 * (len(new_topic) + 1)
            _caught_up(runners, want, 120)
            tick = float(runners[0].status()["tick_ms"] or 0) / 1000
            t_new, job = _new_topic_landed(d / "state", written, want)
            new_topic.append((t_new, job))
            log(f"a new topic: {t_new:.2f} s, its tick {job:.2f} s (median tick {tick:.2f} s)")
    ratio = work["500 topics"] / work["one topic"]
    rate = {lbl: total / s for lbl, s in work.items()}
    return [
        ("500-topic pattern: throughput, binding to durable",
         f"{work['500 topics']:.2f} s vs {work['one topic']:.2f} s one topic ({ratio:.2f}x; "
         f"{rate['500 topics']:,.0f} vs {rate['one topic']:,.0f} records/s)", "<= 1.2x",
         verdict(ratio <= 1.2)),
        ("500-topic pattern: catch-up from the start",
         f"{secs['500 topics']:.1f} s vs {secs['one topic']:.1f} s one topic "
         f"({secs['500 topics'] / secs['one topic']:.2f}x; the source's open and its first "
         "interval boundary included)", "(for comparison)", "-"),
        ("500-topic pattern: a new topic", " and ".join(
            f"{t:.2f} s" for t, _ in new_topic) + " from its records written to committed",
         "<= 1 s interval + its tick (" + " and ".join(f"{j:.2f} s" for _, j in new_topic)
         + ")", verdict(all(t <= 1.0 + j for t, j in new_topic))),
    ]


def keyed_10m(env: Env) -> list[Row]:
    """bench/keyed_txn_bench.py's measurement (its own driver process)."""
    from keyed_txn_bench import GIB, measure

    from tests.pgcluster import PgCluster

    rows = 1_000_000 if env.args.quick else 10_000_000
    log(f"keyed: one transaction of {rows:,} rows ...")
    cluster = PgCluster().start()
    try:
        r = measure(cluster.url, rows, "now", "32MiB", env.dir("keyed"), 3600)
    finally:
        cluster.stop()
    peak = r["driver"] + r["jvm"]
    return [(f"{rows // 1_000_000}M-row keyed transaction",
             f"landed in {r['land_s']:.0f} s at one IntoTime ({r['times'] == 1}); driver "
             f"{r['driver'] / MiB:.0f} MiB + JVM {r['jvm'] / MiB:.0f} MiB, largest worker "
             f"{r['worker'] / MiB:.0f} MiB", "driver RSS < 1 GiB",
             verdict(peak < GIB and r["times"] == 1))]


def soak_1h(env: Env) -> list[Row]:
    """bench/soak.py in a process of its own (an hour; ``--quick``: 20
    minutes), its verdict rows."""
    from soak import _key_budget, verdict_rows

    minutes = 20 if env.args.quick else 60
    out = env.dir("soak") / "samples.jsonl"
    log(f"soak: {minutes} minutes ...")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--minutes",
                           str(minutes), "--every", "60", "--warmup", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=minutes * 60 + 900,
                          env={**os.environ, "PYSPARK_PYTHON": sys.executable})
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    # its start-against-end summary and verdict, the profile behind the rows
    summary_at = done.stdout.find("\nstart (minute")
    sys.stderr.write(done.stdout[summary_at:] if summary_at >= 0 else done.stdout[-4000:])
    samples = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return [(f"{minutes}-minute soak: {label}", got, goal, verdict(ok))
            for label, got, goal, ok in verdict_rows(samples, 3.0, _key_budget(None))]


TARGETS: dict[str, Callable[[Env], list[Row]]] = {
    "partitions-2048": partitions_2048,
    "retained-24h-counter": retained_counter,
    "retained-24h-512": retained_512,
    "keyed-10M": keyed_10m,
    "records-8MiB": records_8mib,
    "startup-1000": startup_1000,
    "sources-100-1s": lambda env: many_sources(env, 100, "1s", 2000),
    "sources-1000-10s": lambda env: many_sources(env, 1000, "10s", 20_000),
    "pattern-500-topics": pattern_500,
    "soak-1h": soak_1h,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated target names")
    ap.add_argument("--quick", action="store_true", help="shorter measured windows")
    ap.add_argument("--rate", type=float, default=8000.0,
                    help="records/s into the 2,048-partition topic")
    ap.add_argument("--profile", action="store_true",
                    help="print where the 2,048-partition run spends CPU (yappi from PyPI)")
    ap.add_argument("--topic-records", type=int, default=400_000,
                    help="records in the one topic, and in the 500 topics together")
    ap.add_argument("--sink", choices=["file", "postgres"], default="file",
                    help="the many-sources targets' sinks (file: a Delta table each; "
                         "postgres: a table each, in a private cluster)")
    ap.add_argument("--retained-512", type=int, default=86_400,
                    help="bindings seeded for the 512-partition run")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        ap.error(f"unknown targets {unknown}; known: {', '.join(TARGETS)}")
    logging_quiet()
    root = Path(tempfile.mkdtemp(prefix="reclock-scale-"))
    env = Env(args, root)
    rows: list[Row] = []
    try:
        for name in names:
            log(f"target {name} ...")
            t0 = time.monotonic()
            try:
                rows += TARGETS[name](env)
            except Exception as exc:  # one target failing does not stop the others
                rows.append((name, f"error: {type(exc).__name__}: {str(exc)[:160]}", "", FAIL))
            log(f"target {name} took {time.monotonic() - t0:.0f}s")
    finally:
        env.close()
        shutil.rmtree(root, ignore_errors=True)
    widths = [max(len(r[i]) for r in [("target", "measured", "goal", "verdict"), *rows])
              for i in range(4)]
    print()
    print(f"reclock scale targets{' (--quick)' if args.quick else ''}: local[2], "
          f"{os.cpu_count()} CPUs")
    for r in [("target", "measured", "goal", "verdict"), *rows]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
