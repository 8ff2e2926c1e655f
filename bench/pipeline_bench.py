"""Pipeline benchmark: start-up of many sources, end-to-end throughput, freshness.

One command, one SparkSession (``local[2]``, created before anything is timed),
three parts, each on its own temporary state directory:

1. **Start-up of ``--sources`` sources** (100 counter generators, one json
   output each, file sinks). Framework time only, Spark start-up excluded:
   (a) ``parse_config``; (b) ``Pipeline`` + remap store + ``build_source`` and
   a ``SourceRunner`` per source; (c) every runner's ``open()`` (remap shard,
   Delta table creation / check, sink state), in one thread per runner like
   ``run()`` does, on a fresh state directory and again on restart (the same
   directory after data was committed); (d) from starting the runner loops
   until every source completed its first tick, and until the first / 50% /
   90% / all sources committed data (Spark jobs included, reported apart; gives
   up after ``--first-data-timeout``). Target: (a)+(b)+(c) under one second
   for 100 sources, fresh and restart separately. A per-step breakdown of a
   sequential ``open()`` and a cProfile of the costliest calls are printed
   when a target is missed (or with ``--profile``).
2. **Throughput** into the file sink: a counter generator (json values with a
   schema) and an ``orders`` generator (two typed outputs), ``max_records``
   records at a rate that is never the limit, under a few
   ``spark.max_records_per_job`` / ``max_records_per_task`` settings. Records/s
   come from the progress log: from the first binding (and from the first
   binding that covers data) to the last output closing.
3. **Freshness**: a counter at fixed rates; per record, the time from its
   generation (``_src_ts``) to the progress-log ``sink_upper`` event whose
   progress frontier first passes it (durable); p50 / p99 / max over the
   records generated in the measured window, and the achieved ingestion rate.

Run: ``python bench/pipeline_bench.py`` (about 7 minutes on 2 cores) or
``python bench/pipeline_bench.py --quick`` (about 4 minutes); see ``--help``.
Missing a target does not change the exit status; an error in a part does (1).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

TARGET_STARTUP_S = 1.0  # (a)+(b)+(c) for 100 sources
JSON_SCHEMA = "{n: int64, payload: string, even: bool}"
MASTER = "local[2]"
LAZY_MODULES = ("reclock.config", "reclock.formats", "reclock.pipeline",
                "reclock.runtime.driver",
                "reclock.remap_store.sql", "reclock.sinks.delta", "reclock.sources.generator",
                "deltalake")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def checkout(rev: str, into: Path) -> Iterator[Path]:
    """This repository's code at ``rev``, checked out with ``git worktree``
    at ``into`` (for a "before" variant: put it first on ``PYTHONPATH``)."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(into), rev],
                   check=True, capture_output=True)
    try:
        yield into
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(into)],
                       check=False, capture_output=True)


# -- reporting -------------------------------------------------------------------------
def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]],
          left: Sequence[int] = (0,)) -> str:
    """A plain-text table under ``title`` (none when empty); columns not in
    ``left`` are right-aligned. Shared by every benchmark in this folder."""
    cells = [[str(c) for c in header], *[["" if c is None else str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def render(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([*([title] if title else []), render(cells[0]), rule,
                      *(render(r) for r in cells[1:])])


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f}"


def rate(n: float, seconds: float | None) -> str:
    return "-" if not seconds or seconds <= 0 else f"{n / seconds:,.0f}"


# -- configuration text ----------------------------------------------------------------------
def q(path: Path) -> str:
    """A path as a YAML string (JSON strings are YAML)."""
    return json.dumps(str(path))


def counter_source(name: str, rate_: float, max_records: int | None = None,
                   interval: str | None = None) -> str:
    gen = f"kind: counter, rate: {rate_:g}"
    if max_records is not None:
        gen += f", max_records: {max_records}"
    lines = [f"  - name: {name}", f"    generator: {{{gen}}}"]
    if interval:
        lines.append(f"    timestamp_interval: {interval}")
    lines += ["    outputs:",
              "      - name: value",
              f"        format: {{type: json, schema: {JSON_SCHEMA}}}",
              "        sink: file"]
    return "\n".join(lines)


def orders_source(name: str, rate_: float, max_records: int) -> str:
    return "\n".join([
        f"  - name: {name}",
        f"    generator: {{kind: orders, rate: {rate_:g}, max_records: {max_records}}}",
        "    outputs:",
        "      - {name: customers, sink: file}",
        "      - {name: orders, sink: file}",
    ])


def pipeline_yaml(state: Path, sources: list[str], interval: str = "1s",
                  job: int | None = None, task: int | None = None) -> str:
    spark = [f"  master: {json.dumps(MASTER)}"]
    if job is not None:
        spark.append(f"  max_records_per_job: {job}")
    if task is not None:
        spark.append(f"  max_records_per_task: {task}")
    return "\n".join([f"state_dir: {q(state)}", f"timestamp_interval: {interval}", "spark:",
                      *spark, "sources:", *sources]) + "\n"


# -- progress log --------------------------------------------------------------------------
def read_events(state_dir: Path, source: str | None = None) -> list[dict[str, Any]]:
    out = []
    path = state_dir / "progress.jsonl"
    for p in (path.with_suffix(".jsonl.1"), path):
        if not p.exists():
            continue
        for line in p.read_text(encoding="utf-8").splitlines():
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if source is None or ev.get("source") == source:
                out.append(ev)
    return out


# -- instrumentation (process-wide patches, restored on exit) ---------------------------------
@dataclass
class Job:
    wall: float
    tasks: list[float]
    records: int


@dataclass
class Instrument:
    """Times ``SourceRunner.tick``, ``RemapOperator.mint``, the Spark job
    (``reclock.runtime.jobs.run_job``) and ``DeltaSink.commit`` in every thread."""

    durations: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    jobs: list[Job] = field(default_factory=list)
    _restore: list[tuple[Any, str, Any]] = field(default_factory=list)

    def __enter__(self) -> Instrument:
        import reclock.runtime.driver as drv
        import reclock.runtime.jobs as jobs
        from reclock.core.mint import RemapOperator
        from reclock.sinks.delta import DeltaSink

        self._patch(drv.SourceRunner, "tick", "tick")
        self._patch(RemapOperator, "mint", "mint")
        self._patch(DeltaSink, "commit", "commit")
        orig = jobs.run_job

        def run_job(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            res = orig(*a, **k)
            self.jobs.append(Job(time.perf_counter() - t0, [r.seconds for r in res],
                                 sum(r.records for r in res)))
            return res

        self._restore.append((jobs, "run_job", orig))
        jobs.run_job = run_job  # type: ignore[assignment]
        return self

    def _patch(self, owner: Any, name: str, label: str) -> None:
        orig = owner.__dict__[name]
        acc = self.durations[label]

        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                acc.append(time.perf_counter() - t0)

        self._restore.append((owner, name, orig))
        setattr(owner, name, wrapper)

    def __exit__(self, *exc: object) -> None:
        for owner, name, orig in reversed(self._restore):
            setattr(owner, name, orig)
        self._restore.clear()

    def mean(self, label: str) -> float | None:
        d = self.durations.get(label)
        return statistics.fmean(d) if d else None

    def summary(self) -> dict[str, Any]:
        jobs = self.jobs
        return {
            "ticks": len(self.durations.get("tick", [])),
            "tick": self.mean("tick"),
            "mint": self.mean("mint"),
            "commits": len(self.durations.get("commit", [])),
            "commit": self.mean("commit"),
            "commit_total": sum(self.durations.get("commit", [])),
            "jobs": len(jobs),
            "job": statistics.fmean(j.wall for j in jobs) if jobs else None,
            "job_total": sum(j.wall for j in jobs),
            "task_max": statistics.fmean(max(j.tasks, default=0.0) for j in jobs) if jobs else None,
            "task_sum": sum(sum(j.tasks) for j in jobs),
            "tasks": sum(len(j.tasks) for j in jobs),
            "records": sum(j.records for j in jobs),
        }


def spark_noop_job(spark: Any, repeat: int = 7) -> float:
    """Median wall time of an empty 2-task Python job (after a warm-up)."""
    sc = spark.sparkContext

    def job() -> None:
        sc.parallelize([0, 1], 2).mapPartitions(lambda it: [sum(1 for _ in it)]).collect()

    job()
    job()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        job()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# =========================================================================================
# Part 1: start-up
# =========================================================================================
@dataclass
class Startup:
    parse: float
    store: float  # Pipeline + state dir + progress log + remap store (engine, create_all)
    build: float  # build_source + SourceRunner per source
    open: float
    pipe: Any
    runners: list[Any]

    @property
    def framework(self) -> float:
        return self.parse + self.store + self.build + self.open


def open_all(runners: list[Any], threaded: bool) -> None:
    if not threaded:
        for r in runners:
            r.open()
        return
    errors: list[BaseException] = []

    def target(r: Any) -> None:
        try:
            r.open()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(r,), name=f"open-{r.name}")
               for r in runners]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} runners failed to open; first: {errors[0]!r}")


def start_up(text: str, base_dir: Path, spark: Any, *, threaded: bool = True,
             do_open: bool = True) -> Startup:
    """Parse, build and open like ``run()`` does (without starting the loops)."""
    from reclock.config import parse_config
    from reclock.pipeline import Pipeline
    from reclock.runtime.driver import SourceRunner
    from reclock.runtime.progress_log import ProgressLog

    t0 = time.perf_counter()
    cfg = parse_config(text, "pipeline.yaml", base_dir=base_dir)
    t1 = time.perf_counter()
    pipe = Pipeline(cfg)
    pipe.state_dir.mkdir(parents=True, exist_ok=True)
    events = ProgressLog(cfg.progress_log_path, pipe.clock)
    store = pipe.store
    t2 = time.perf_counter()
    built = [pipe.build_source(src) for src in cfg.sources]
    shards = pipe.open_shards(built)  # as run() does
    runners = [SourceRunner(b.source, b.outputs, store, spark, pipe.clock,
                            pipe.settings(b.config), events, bindings=shards.get(b.config.name))
               for b in built]
    t3 = time.perf_counter()
    if do_open:
        open_all(runners, threaded)
    t4 = time.perf_counter()
    return Startup(t1 - t0, t2 - t1, t3 - t2, t4 - t3, pipe, runners)


def close_startup(s: Startup, timeout: float = 60.0) -> None:
    for r in s.runners:
        r.stop()
    for r in s.runners:
        r.join(timeout)
    stuck = [r.name for r in s.runners if r.alive]
    s.pipe.close()
    if stuck:
        raise RuntimeError(f"runners still alive after {timeout}s: {stuck[:5]}")


@dataclass
class FirstData:
    first_tick: float | None  # every runner completed a tick (s since the loops started)
    times: dict[str, float]  # source -> first commit with rows (s since the loops started)
    records: dict[str, int]  # source -> records read by the end
    total: int
    waited: float
    error: str | None = None

    def quantile(self, q: float) -> float | None:
        """Time until ``q`` of all sources committed data (None: not reached)."""
        need = max(1, int(np.ceil(q * self.total)))
        ts = sorted(self.times.values())
        return ts[need - 1] if len(ts) >= need else None


def first_data(runners: list[Any], timeout: float) -> FirstData:
    """Start the runner loops (already open) and wait until every output of
    every runner committed rows, or ``timeout``."""
    t0 = time.perf_counter()
    for r in runners:
        r.start()
    tick_all: float | None = None
    times: dict[str, float] = {}
    error = None
    while True:
        now = time.perf_counter() - t0
        if tick_all is None and all(r.health.status != "starting" for r in runners):
            tick_all = now
        for r in runners:
            if r.name not in times and all(o.rows > 0 for o in r.outputs):
                times[r.name] = now
        if len(times) == len(runners):
            break
        dead = [r for r in runners if not r.alive]
        if dead:
            error = f"{dead[0].name} stopped: {dead[0].health.as_dict()}"
            break
        if now > timeout:
            stalled = [r for r in runners if r.health.status == "stalled"]
            error = (f"timeout after {timeout:.0f}s" + (
                f"; e.g. {stalled[0].name}: {stalled[0].health.error}" if stalled else ""))
            break
        time.sleep(0.02)
    return FirstData(tick_all, times, {r.name: r.records for r in runners}, len(runners),
                     time.perf_counter() - t0, error)


def starvation_line(label: str, fd: FirstData) -> str:
    names = sorted(fd.records)
    k = max(1, len(names) // 10)
    low = sum(fd.records[x] for x in names[:k])
    high = sum(fd.records[x] for x in names[-k:])
    total = sum(fd.records.values()) or 1
    return (f"(d) {label}: {len(fd.times)}/{fd.total} sources committed data within "
            f"{fd.waited:.0f}s; records read: {names[0]}..{names[k - 1]} {low / total:.0%}, "
            f"{names[-k]}..{names[-1]} {high / total:.0%} of {total:,}; per source min "
            f"{min(fd.records.values()):,} / median {int(statistics.median(fd.records.values())):,}"
            f" / max {max(fd.records.values()):,}" + (f" [{fd.error}]" if fd.error else ""))


def open_breakdown(s: Startup) -> tuple[float, dict[str, tuple[int, float]]]:
    """Sequential ``open()`` of every runner with its steps timed (instance
    wrappers, no profiler overhead). Returns (total, {step: (calls, seconds)})."""
    acc: dict[str, list[float]] = defaultdict(list)
    restore: list[tuple[Any, str]] = []

    def wrap(obj: Any, name: str, label: str) -> None:
        orig = getattr(obj, name)
        bucket = acc[label]

        def w(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                bucket.append(time.perf_counter() - t0)

        setattr(obj, name, w)
        restore.append((obj, name))

    store = s.pipe.store
    wrap(store, "create_shard", "remap store: create_shard")
    wrap(store, "read", "remap store: read (RemapOperator init)")
    wrap(store, "read_from", "remap store: read_from (sync)")
    wrap(store, "since", "remap store: since (sync)")
    for r in s.runners:
        for o in r.outputs:
            wrap(o.sink, "ensure", "sink: ensure (Delta create/check)")
            wrap(o.sink, "state", "sink: state (Delta load + txn)")
    wrap(s.runners[0].events, "log", "progress log")
    try:
        t0 = time.perf_counter()
        open_all(s.runners, threaded=False)
        total = time.perf_counter() - t0
    finally:
        for obj, name in restore:
            with contextlib.suppress(AttributeError):
                delattr(obj, name)
    return total, {k: (len(v), sum(v)) for k, v in acc.items()}


def short_name(func: tuple[str, int, str]) -> str:
    file, line, name = func
    if file == "~":
        return name
    for marker in ("site-packages/", "/work/main/", "lib/python3.11/"):
        if marker in file:
            file = file.split(marker, 1)[1]
            break
    return f"{file}:{line}({name})"


def profile_rows(fn: Callable[[], None], n: int = 12) -> tuple[float, list[list[str]],
                                                               list[list[str]]]:
    """cProfile ``fn``; (wall, top by self time, top project/library calls by cumulative)."""
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    fn()
    pr.disable()
    wall = time.perf_counter() - t0
    st = pstats.Stats(pr).stats  # type: ignore[attr-defined]
    items = [(short_name(f), v[1], v[2], v[3]) for f, v in st.items()]

    def row(it: tuple[str, int, float, float]) -> list[str]:
        name, calls, tt, ct = it
        return [name, f"{calls:,}", ms(tt), ms(ct), f"{ct / calls * 1000:.2f}"]

    by_self = sorted(items, key=lambda x: -x[2])[:n]
    interesting = ("reclock/", "sinks/", "remap_store/", "sources/", "deltalake/",
                   "is_deltatable", "create_deltalake", "sqlite3.Connection")
    skip = ("driver.py:", "contextlib")
    by_cum = sorted((it for it in items if any(m in it[0] for m in interesting)
                     and not any(s in it[0] for s in skip)), key=lambda x: -x[3])[:n]
    return wall, [row(i) for i in by_self], [row(i) for i in by_cum]


def part1(args: argparse.Namespace, spark: Any, tmp: Path) -> list[str]:
    n = args.sources
    sources = [counter_source(f"s{i:03d}", 1000) for i in range(n)]
    out: list[str] = []
    fresh: list[Startup] = []
    main_dir = tmp / "startup"
    text_main = pipeline_yaml(main_dir / "state", sources)
    # (a)(b)(c) on fresh state dirs; the last one is kept for (d) and the restart.
    for i in range(args.repeat):
        d = tmp / f"startup-fresh-{i}" if i < args.repeat - 1 else main_dir
        d.mkdir(parents=True, exist_ok=True)
        text = text_main if d == main_dir else pipeline_yaml(d / "state", sources)
        s = start_up(text, d, spark)
        log(f"  fresh #{i + 1}: parse {ms(s.parse)} ms, store {ms(s.store)} ms, "
            f"build {ms(s.build)} ms, open {ms(s.open)} ms -> {ms(s.framework)} ms")
        fresh.append(s)
        if d != main_dir:
            close_startup(s)
            shutil.rmtree(d, ignore_errors=True)
    keep = fresh[-1]
    log(f"  (d) fresh: starting {n} runner loops, waiting for every first commit with data ...")
    with Instrument() as ins_fresh:
        fd_fresh = first_data(keep.runners, args.first_data_timeout)
    close_startup(keep)
    log("  " + starvation_line("fresh", fd_fresh))

    restart: list[Startup] = []
    for i in range(args.repeat):
        s = start_up(text_main, main_dir, spark)
        log(f"  restart #{i + 1}: parse {ms(s.parse)} ms, store {ms(s.store)} ms, "
            f"build {ms(s.build)} ms, open {ms(s.open)} ms -> {ms(s.framework)} ms")
        restart.append(s)
        if i < args.repeat - 1:
            close_startup(s)
    keep = restart[-1]
    log("  (d) restart: waiting for every first commit with data ...")
    with Instrument() as ins_restart:
        fd_restart = first_data(keep.runners, args.first_data_timeout)
    close_startup(keep)
    log("  " + starvation_line("restart", fd_restart))

    def med(xs: list[Startup], f: Callable[[Startup], float]) -> float:
        return statistics.median(f(x) for x in xs)

    def mn(xs: list[Startup], f: Callable[[Startup], float]) -> float:
        return min(f(x) for x in xs)

    steps: list[tuple[str, Callable[[Startup], float]]] = [
        ("(a) parse_config", lambda s: s.parse),
        ("(b1) Pipeline + remap store (engine, create_all) + progress log", lambda s: s.store),
        (f"(b2) build_source + SourceRunner x {n}", lambda s: s.build),
        (f"(c) open() x {n}, one thread each (like run())", lambda s: s.open),
        ("(a)+(b)+(c) framework start-up", lambda s: s.framework),
    ]
    rows = [[label, ms(med(fresh, f)), ms(mn(fresh, f)), ms(med(restart, f)), ms(mn(restart, f))]
            for label, f in steps]

    def fd_row(label: str, get: Callable[[FirstData], float | None]) -> list[str]:
        return [label, ms(get(fd_fresh)), "", ms(get(fd_restart)), ""]

    rows.append(fd_row("(d) loops started -> every source ticked once",
                       lambda f: f.first_tick))
    for label, qq in (("the first source", 1 / n), ("50% of sources", 0.5),
                      ("90% of sources", 0.9), ("every source", 1.0)):
        rows.append(fd_row(f"(d) loops started -> {label} committed data",
                           lambda f, qq=qq: f.quantile(qq)))
    out.append(table(
        f"Part 1: start-up of {n} counter sources (ms; Spark start-up excluded; "
        f"median and min of {args.repeat})",
        ["step", "fresh med", "fresh min", "restart med", "restart min"], rows))
    lines = [starvation_line(label, fd) for label, fd in
             (("fresh", fd_fresh), ("restart", fd_restart))]
    if any(len(fd.times) < fd.total for fd in (fd_fresh, fd_restart)):
        lines.append("    (sources missing data while others commit every tick: with "
                     "spark.scheduler.mode=FAIR and one pool per source, Spark breaks ties "
                     "between idle pools by pool name, so under overload the lowest names "
                     "win every free slot; compare --spark-conf spark.scheduler.mode=FIFO)")
    out.append("\n".join(lines))
    fresh_ok = med(fresh, lambda s: s.framework) < TARGET_STARTUP_S
    restart_ok = med(restart, lambda s: s.framework) < TARGET_STARTUP_S
    out.append(
        f"target (a)+(b)+(c) < {TARGET_STARTUP_S:.0f} s for {n} sources: "
        f"fresh {'PASS' if fresh_ok else 'FAIL'} ({ms(med(fresh, lambda s: s.framework))} ms), "
        f"restart {'PASS' if restart_ok else 'FAIL'} "
        f"({ms(med(restart, lambda s: s.framework))} ms)")
    dt = [["fresh", *tick_cols(ins_fresh)], ["restart", *tick_cols(ins_restart)]]
    out.append(table(f"(d) where the time went while {n} sources ran their first ticks "
                     f"(all threads, ms)", TICK_HEADER, dt))

    # Breakdown of a sequential open (a fresh dir, and a restart on the main dir).
    d = tmp / "startup-breakdown"
    d.mkdir()
    s_fresh = start_up(pipeline_yaml(d / "state", sources), d, spark, do_open=False)
    tot_f, br_f = open_breakdown(s_fresh)
    close_startup(s_fresh)
    s_re = start_up(text_main, main_dir, spark, do_open=False)
    tot_r, br_r = open_breakdown(s_re)
    close_startup(s_re)
    labels = list(dict.fromkeys([*br_f, *br_r]))
    rows = []
    for label in labels:
        cf, sf = br_f.get(label, (0, 0.0))
        cr, sr = br_r.get(label, (0, 0.0))
        rows.append([label, cf, ms(sf), f"{sf / max(cf, 1) * 1000:.2f}",
                     cr, ms(sr), f"{sr / max(cr, 1) * 1000:.2f}"])
    rest_f = tot_f - sum(v[1] for v in br_f.values())
    rest_r = tot_r - sum(v[1] for v in br_r.values())
    rows.append(["other (RemapOperator, source.open, ...)", "", ms(rest_f), "", "", ms(rest_r), ""])
    rows.append([f"sequential open() x {n}, total", n, ms(tot_f), f"{tot_f / n * 1000:.2f}",
                 n, ms(tot_r), f"{tot_r / n * 1000:.2f}"])
    out.append(table("open() breakdown, sequential (fresh | restart): calls, ms, ms/call",
                     ["step", "calls", "fresh ms", "ms/call", "calls", "restart ms", "ms/call"],
                     rows))

    if args.profile or not (fresh_ok and restart_ok):
        header = ["function", "calls", "self ms", "cum ms", "cum ms/call"]
        prof_dir = tmp / "startup-profile"
        prof_dir.mkdir()
        for label, text, dd in (("fresh", pipeline_yaml(prof_dir / "state", sources), prof_dir),
                                ("restart", text_main, main_dir)):
            holder: list[Startup] = []
            wall, by_self, by_cum = profile_rows(
                partial(lambda t, p, h: h.append(start_up(t, p, spark, threaded=False)),
                        text, dd, holder))
            close_startup(holder[0])
            out.append(table(f"cProfile, {label}: (a)+(b)+(c) sequential, {ms(wall)} ms "
                             "under the profiler -- top self time", header, by_self))
            out.append(table(f"cProfile, {label}: top cumulative (project, deltalake, sqlite)",
                             header, by_cum))
    return out


TICK_HEADER = ["run", "ticks", "tick ms", "mint ms", "jobs", "job ms", "task ms (max/job)",
               "commits", "commit ms"]


def tick_cols(ins: Instrument) -> list[str]:
    s = ins.summary()
    return [s["ticks"], ms(s["tick"]), ms(s["mint"]), s["jobs"], ms(s["job"]), ms(s["task_max"]),
            s["commits"], ms(s["commit"])]


# =========================================================================================
# Part 2: throughput
# =========================================================================================
@dataclass
class Throughput:
    kind: str
    job: int
    task: int
    records: int
    wall: float | None = None  # the run() call
    first_binding: float | None = None  # first binding -> last output closed (s)
    data_binding: float | None = None  # first binding covering data -> closed (s)
    rows_ok: bool = False
    inst: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def expected_rows(kind: str, n: int) -> dict[str, int]:
    if kind == "counter":
        return {"value": n}
    customers = (n + 4) // 5  # counter values divisible by 5
    return {"customers": customers, "orders": n - customers}


def throughput_run(args: argparse.Namespace, spark: Any, tmp: Path, kind: str, n: int,
                   job: int, task: int) -> Throughput:
    from deltalake import DeltaTable

    from reclock.config import parse_config
    from reclock.pipeline import run

    res = Throughput(kind, job, task, n)
    d = Path(tempfile.mkdtemp(prefix=f"tp-{kind}-", dir=tmp))
    name = kind
    src = (counter_source(name, 10_000_000, n) if kind == "counter"
           else orders_source(name, 10_000_000, n))
    cfg = parse_config(pipeline_yaml(d / "state", [src], job=job, task=task), "p.yaml",
                       base_dir=d)
    try:
        with Instrument() as ins:
            t0 = time.perf_counter()
            runners = run(cfg, spark=spark, duration=args.timeout, out=None,
                          install_signals=False)
            res.wall = time.perf_counter() - t0
        res.inst = ins.summary()
        bad = [r for r in runners if r.health.status != "finished"]
        if bad:
            res.error = f"not finished within {args.timeout}s: {bad[0].health.as_dict()}"
            return res
        events = read_events(d / "state", name)
        bindings = [e for e in events if e["kind"] == "binding"]
        closed = [e["ts"] for e in events if e["kind"] == "sink_upper" and e["upper"] is None]
        outs = expected_rows(kind, n)
        if not bindings or len(closed) < len(outs):
            res.error = f"progress log incomplete: {len(bindings)} bindings, {len(closed)} closed"
            return res
        end = max(closed)
        res.first_binding = (end - bindings[0]["ts"]) / 1000
        data = next((e for e in bindings if e["frontier"] != [0]), None)
        res.data_binding = None if data is None else (end - data["ts"]) / 1000
        got = {o: DeltaTable(str(d / "state" / "outputs" / name / o)).to_pyarrow_dataset()
               .count_rows() for o in outs}
        res.rows_ok = got == outs
        if not res.rows_ok:
            res.error = f"row counts {got}, expected {outs}"
    except Exception as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        log(traceback.format_exc())
    finally:
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)
    return res


def part2(args: argparse.Namespace, spark: Any, tmp: Path) -> list[str]:
    n = args.records
    results: list[Throughput] = []
    log("  warm-up (untimed): 50,000 records of each generator, so that the Python "
        "workers have imported the data plane")
    for kind in ("counter", "orders"):
        w = throughput_run(args, spark, tmp, kind, 50_000, *args.settings[0])
        if w.error:
            raise RuntimeError(f"warm-up run of {kind} failed: {w.error}")
    for kind in ("counter", "orders"):
        for job, task in args.settings:
            log(f"  {kind}: {n:,} records, max_records_per_job {job:,}, "
                f"max_records_per_task {task:,} ...")
            r = throughput_run(args, spark, tmp, kind, n, job, task)
            log(f"    -> {rate(n, r.data_binding)} rec/s (data binding -> closed), "
                f"{rate(n, r.first_binding)} rec/s (first binding -> closed)"
                + (f" ERROR {r.error}" if r.error else ""))
            results.append(r)
    rows = []
    for r in results:
        i = r.inst
        tasks = i.get("tasks") or 0
        rows.append([
            r.kind, f"{r.job:,}/{r.task:,}",
            f"{i.get('jobs', 0)}x{tasks // max(i.get('jobs', 1), 1)}",
            f"{r.wall:.1f}" if r.wall else "-",
            f"{r.first_binding:.2f}" if r.first_binding else "-",
            rate(n, r.first_binding), rate(n, r.data_binding),
            f"{i.get('job_total', 0):.2f}", f"{i.get('task_sum', 0):.2f}",
            f"{i.get('commit_total', 0):.2f}",
            f"{i['task_sum'] / n * 1e6:.2f}" if i.get("task_sum") else "-",
            "ok" if r.rows_ok else (r.error or "?"),
        ])
    out = [table(
        f"Part 2: throughput into the file sink, {n:,} source records, {MASTER} "
        "(rec/s = source records per second)",
        ["generator", "job/task", "jobs x tasks", "run() s", "1st bind->closed s",
         "rec/s (1st bind)", "rec/s (data bind)", "job wall s", "task sum s", "commit s",
         "task us/rec", "rows"], rows, left=(0, 1, 11))]
    best: dict[str, Throughput] = {}
    for r in results:
        if r.error or not r.data_binding:
            continue
        if r.kind not in best or r.data_binding < (best[r.kind].data_binding or 1e18):
            best[r.kind] = r
    lines = []
    for kind, r in best.items():
        lines.append(f"best {kind}: {rate(n, r.data_binding)} rec/s with max_records_per_job "
                     f"{r.job:,}, max_records_per_task {r.task:,} "
                     f"({rate(n, r.first_binding)} rec/s counting from the first binding)")
    for kind, r in best.items():
        default = next((x for x in results if x.kind == kind and (x.job, x.task) ==
                        tuple(args.settings[0]) and x.data_binding), None)
        if default is not None and r.data_binding and default is not r:
            lines.append(f"best / first setting ({default.job:,}/{default.task:,}), {kind}: "
                         f"{(default.data_binding or 0) / r.data_binding:.2f}x")
    if "counter" in best and "orders" in best:
        c, o = best["counter"].data_binding, best["orders"].data_binding
        if c and o:
            lines.append(f"orders / counter throughput (best settings): {c / o:.2f}x")
    out.append("\n".join(lines))
    return out


# =========================================================================================
# Part 3: freshness
# =========================================================================================
@dataclass
class Fresh:
    rate: float
    interval_ms: int
    records: int = 0
    censored: int = 0
    p50: float | None = None
    p99: float | None = None
    max: float | None = None
    achieved: float | None = None
    bind_to_durable_p50: float | None = None
    inst: dict[str, Any] = field(default_factory=dict)
    tick_row: list[str] = field(default_factory=list)
    error: str | None = None


def freshness_run(args: argparse.Namespace, spark: Any, tmp: Path, rate_: float,
                  interval_ms: int) -> Fresh:
    from reclock.config import parse_config
    from reclock.pipeline import run
    from reclock.sinks.delta import DeltaSink

    res = Fresh(rate_, interval_ms)
    d = Path(tempfile.mkdtemp(prefix=f"fresh-{int(rate_)}-{interval_ms}-", dir=tmp))
    name = "fresh"
    cfg = parse_config(pipeline_yaml(d / "state", [counter_source(name, rate_)],
                                     interval=f"{interval_ms}ms"), "p.yaml", base_dir=d)
    warm, window = args.warmup, args.window
    tail = max(3.0, 3 * interval_ms / 1000)
    try:
        with Instrument() as ins:
            start_ms = time.time_ns() // 1_000_000
            runners = run(cfg, spark=spark, duration=warm + window + tail, out=None,
                          install_signals=False)
        res.inst = ins.summary()
        res.tick_row = tick_cols(ins)
        bad = [r for r in runners if r.health.status not in ("stopped", "running")]
        if bad:
            res.error = f"source ended {bad[0].health.as_dict()}"
        events = read_events(d / "state", name)
        ups = [e for e in events if e["kind"] == "sink_upper" and e["output"] == "value"]
        if not ups:
            res.error = "no sink_upper events"
            return res
        inf = np.iinfo(np.int64).max
        ev_ts = np.array([e["ts"] for e in ups], dtype=np.int64)
        ev_prog = np.array([e["progress"][0] if e["progress"] else inf for e in ups],
                           dtype=np.int64)
        if (np.diff(ev_prog) < 0).any():
            res.error = "progress frontier went backwards in the log"
            return res
        t = DeltaSink(f"{name}.value", d / "state" / "outputs" / name / "value").read_updates()
        off = t.column("_src_offset").to_numpy()
        src = t.column("_src_ts").to_numpy()
        if len(np.unique(off)) != len(off):
            res.error = "duplicate records in the output"
        w0 = start_ms + int(warm * 1000)
        w1 = w0 + int(window * 1000)
        # Generation time is a function of the counter: ts(n) = c + n * 1000 / rate.
        c = float(np.median(src - off * 1000.0 / rate_))
        n_lo = int(np.ceil((w0 - c) * rate_ / 1000))
        n_hi = int(np.floor((w1 - c) * rate_ / 1000))  # inclusive
        sel = (src >= w0) & (src <= w1)
        off_w, src_w = off[sel], src[sel]
        idx = np.searchsorted(ev_prog, off_w, side="right")
        if (idx >= len(ev_ts)).any():
            res.error = "a record in the output has no sink_upper event past it"
            return res
        fresh = (ev_ts[idx] - src_w).astype(np.float64)
        # Records generated in the window but not durable by the end (falling
        # behind): their freshness is at least (last event - generation).
        expected = max(0, n_hi - n_lo + 1)
        res.censored = max(0, expected - len(off_w) - 1)  # +-1 for rounding at the edges
        if res.censored:
            missing_ts = c + np.arange(n_hi - res.censored + 1, n_hi + 1) * 1000.0 / rate_
            fresh = np.concatenate([fresh, ev_ts[-1] - missing_ts])
        res.records = len(off_w)
        if len(fresh):
            res.p50, res.p99 = (float(x) / 1000 for x in np.percentile(fresh, [50, 99]))
            res.max = float(fresh.max()) / 1000

        def progress_at(ts_ms: int) -> int:
            i = int(np.searchsorted(ev_ts, ts_ms, side="right")) - 1
            return 0 if i < 0 else int(min(ev_prog[i], n_hi + 10 * rate_))

        res.achieved = (progress_at(w1) - progress_at(w0)) / window
        # Mint -> durable: from each binding event to the first commit past its frontier.
        lat = []
        for e in events:
            if e["kind"] != "binding" or not e.get("frontier"):
                continue
            if not (w0 <= e["ts"] <= w1):
                continue
            j = int(np.searchsorted(ev_prog, e["frontier"][0], side="left"))
            if j < len(ev_ts):
                lat.append(ev_ts[j] - e["ts"])
        res.bind_to_durable_p50 = float(np.median(lat)) / 1000 if lat else None
    except Exception as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        log(traceback.format_exc())
    finally:
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)
    return res


def part3(args: argparse.Namespace, spark: Any, tmp: Path) -> list[str]:
    results = []
    for rate_, interval in args.fresh_cases:
        log(f"  rate {rate_:,.0f}/s, timestamp_interval {interval} ms: "
            f"{args.warmup:.0f}s warm-up + {args.window:.0f}s measured ...")
        r = freshness_run(args, spark, tmp, rate_, interval)
        log(f"    -> p50 {ms(r.p50)} ms, p99 {ms(r.p99)} ms, max {ms(r.max)} ms, "
            f"achieved {r.achieved or 0:,.0f}/s" + (f" ERROR {r.error}" if r.error else ""))
        results.append(r)
    rows = []
    for r in results:
        behind = r.censored > 0 or (r.achieved or 0) < 0.95 * r.rate
        rows.append([
            f"{r.rate:,.0f}", r.interval_ms, f"{r.records:,}", ms(r.p50),
            (">=" if r.censored else "") + ms(r.p99), (">=" if r.censored else "") + ms(r.max),
            f"{r.p99 * 1000 / r.interval_ms:.2f}" if r.p99 else "-",
            ms(r.bind_to_durable_p50), f"{r.achieved or 0:,.0f}",
            ("BEHIND" if behind else "ok") + (f" ({r.censored:,} not durable)" if r.censored
                                               else "") + (f"; {r.error}" if r.error else ""),
        ])
    out = [table(
        f"Part 3: freshness = durable (progress-log sink_upper ts) - generated (_src_ts), "
        f"records generated in a {args.window:.0f}s window after {args.warmup:.0f}s warm-up",
        ["rate/s", "interval ms", "records", "p50 ms", "p99 ms", "max ms", "p99/interval",
         "mint->durable p50 ms", "achieved rec/s", "status"], rows, left=(9,))]
    out.append(table("Part 3: per tick (ms, means over the whole run incl. warm-up)",
                     ["rate/s @ interval", *TICK_HEADER[1:]],
                     [[f"{r.rate:,.0f} @ {r.interval_ms}ms", *r.tick_row] for r in results]))
    return out


# =========================================================================================
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="shorter run: 1 repeat, 300k records, 2 freshness rates, 8s windows")
    ap.add_argument("--parts", default="1,2,3", help="which parts to run, e.g. 1,3")
    ap.add_argument("--sources", type=int, default=100, help="part 1: number of sources")
    ap.add_argument("--repeat", type=int, help="part 1: fresh/restart repeats (3; quick 1)")
    ap.add_argument("--records", type=int,
                    help="part 2: records per run (2,000,000; quick 300,000)")
    ap.add_argument("--settings", default="1000000/200000,1000000/500000,4000000/1000000",
                    help="part 2: max_records_per_job/max_records_per_task pairs")
    ap.add_argument("--rates", help="part 3: rates at a 1s interval (1000,10000,100000; "
                                     "quick 1000,10000); 10000 also runs at 250ms")
    ap.add_argument("--warmup", type=float, help="part 3: warm-up seconds (5; quick 3)")
    ap.add_argument("--window", type=float, help="part 3: measured seconds (20; quick 8)")
    ap.add_argument("--timeout", type=float, default=600.0, help="part 2: per run, seconds")
    ap.add_argument("--first-data-timeout", type=float,
                    help="part 1 (d): seconds to wait for every source's first data "
                    "(120; quick 60)")
    ap.add_argument("--profile", action="store_true",
                    help="part 1: always print the cProfile tables")
    ap.add_argument("--spark-conf", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Spark setting for the session (repeatable), for experiments")
    ap.add_argument("--keep", action="store_true", help="keep the temporary state directories")
    args = ap.parse_args(argv)
    args.repeat = args.repeat or (1 if args.quick else 3)
    args.first_data_timeout = args.first_data_timeout or (60.0 if args.quick else 120.0)
    args.records = args.records or (300_000 if args.quick else 2_000_000)
    args.warmup = args.warmup if args.warmup is not None else (3.0 if args.quick else 5.0)
    args.window = args.window if args.window is not None else (8.0 if args.quick else 20.0)
    rates = [float(x) for x in (args.rates or ("1000,10000" if args.quick
                                               else "1000,10000,100000")).split(",")]
    args.fresh_cases = [(r, 1000) for r in rates] + [(10000.0, 250)]
    try:
        args.settings = [tuple(int(x) for x in s.split("/")) for s in args.settings.split(",")]
        args.parts = {int(p) for p in args.parts.split(",")}
    except ValueError:
        ap.error("--settings is JOB/TASK[,JOB/TASK...]; --parts is e.g. 1,2,3")
    try:
        args.spark_conf = dict(kv.split("=", 1) for kv in args.spark_conf)
    except ValueError:
        ap.error("--spark-conf is KEY=VALUE")
    if args.sources < 1 or args.repeat < 1 or args.records < 1:
        ap.error("--sources, --repeat and --records must be >= 1")
    return args


@contextlib.contextmanager
def temp_root(keep: bool) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="reclock-pipeline-bench-"))
    try:
        yield d
    finally:
        if keep:
            log(f"kept {d}")
        else:
            shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging_quiet()
    t0 = time.perf_counter()
    for module in LAZY_MODULES:  # the framework's modules, some imported lazily at build time
        importlib.import_module(module)

    import_s = time.perf_counter() - t0
    from reclock.runtime.spark import spark_session

    log(f"imports (not timed below): {ms(import_s)} ms; starting Spark {MASTER} ...")
    t0 = time.perf_counter()
    spark = spark_session(MASTER, "reclock-bench",
                          {"spark.sql.shuffle.partitions": "2", **args.spark_conf})
    spark_s = time.perf_counter() - t0
    noop = spark_noop_job(spark)
    log(f"Spark session in {spark_s:.1f}s; an empty 2-task Python job takes {ms(noop)} ms")
    report: list[str] = []
    failed = False
    parts: list[tuple[int, str, Callable[[argparse.Namespace, Any, Path], list[str]]]] = [
        (1, "start-up", part1), (2, "throughput", part2), (3, "freshness", part3)]
    with temp_root(args.keep) as tmp:
        for num, label, fn in parts:
            if num not in args.parts:
                continue
            log(f"part {num}: {label}")
            t1 = time.perf_counter()
            try:
                report += fn(args, spark, tmp)
            except Exception:
                failed = True
                report.append(f"Part {num} ({label}) FAILED:\n{traceback.format_exc()}")
                log(report[-1])
            log(f"part {num} took {time.perf_counter() - t1:.0f}s")
    spark.stop()
    print()
    print(f"reclock pipeline benchmark{' (--quick)' if args.quick else ''}: {MASTER}, "
          f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}; Spark session start-up "
          f"{spark_s:.1f}s (excluded); empty 2-task Spark job {ms(noop)} ms; "
          f"imports {ms(import_s)} ms (excluded)"
          + (f"; extra Spark conf {args.spark_conf}" if args.spark_conf else ""))
    for block in report:
        print()
        print(block)
    return 1 if failed else 0


def logging_quiet() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


if __name__ == "__main__":
    sys.exit(main())
