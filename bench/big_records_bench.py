"""Big Kafka records: the memory of Spark's Python workers when tasks are cut
by records only (an earlier revision) and by bytes as well
(``spark.max_bytes_per_task``),
side by side in one run.

It starts one Apache Kafka broker (tests/kafkabroker.py), writes ``--records``
records of ``--size`` bytes into one partition of one topic, and then, for
each variant in a fresh driver process (``local[2]``, a Delta output of the
records as JSON ``{id, body}``), reads the whole topic while sampling every
100 ms the resident memory of the processes under the driver: the largest
single Python worker, all Python workers together, the JVM and the driver.

* **before** -- the code before tasks were cut by bytes (``--before``, a git
  revision checked out into a temporary worktree): a task reads up to
  ``max_records_per_task`` (200,000) records, so the whole topic in one task;
* **by bytes** -- this tree, ``max_bytes_per_task: 64MiB`` (the default): a
  few records per task until the first tasks report their size, then 64 MiB
  of records per task.

It prints one row per variant: peak memory, the largest task (records), the
number of jobs and tasks, and the seconds to read everything; the last row
the ratios. Run: ``python bench/big_records_bench.py`` (``--help``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 2**20


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    return kids


def _rss(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except OSError:
        return 0


def cmdline(pid: int | str) -> str:
    """The process's command line, arguments joined by spaces ('' if gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


class Sampler:
    """Peak resident memory of a process (``driver``: this one unless
    ``root`` names another) and of its descendants, by kind."""

    def __init__(self, root: int | None = None) -> None:
        self.root = os.getpid() if root is None else root
        self.peak = {"worker": 0, "workers": 0, "jvm": 0, "driver": 0}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        me = self.root
        while not self._stop.is_set():
            kids = _children()
            todo, seen = list(kids.get(me, [])), []
            while todo:
                p = todo.pop()
                seen.append(p)
                todo.extend(kids.get(p, []))
            cmds = {p: cmdline(p) for p in seen}
            jvms = {p for p, c in cmds.items() if "java" in c.split(" ")[0]}
            # (the JVM's class path names pyspark too: it is not a worker)
            workers = [_rss(p) for p, c in cmds.items() if "pyspark" in c and p not in jvms]
            jvm = sum(_rss(p) for p in jvms)
            now = {"worker": max(workers, default=0), "workers": sum(workers), "jvm": jvm,
                   "driver": _rss(me)}
            for k, v in now.items():
                self.peak[k] = max(self.peak[k], v)
            self._stop.wait(0.1)

    def __enter__(self) -> Sampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def child(bootstrap: str, topic: str, records: int, task_bytes: str, work: Path) -> None:
    tree = os.environ.get("BENCH_TREE")
    if tree:
        sys.path.insert(0, tree)  # the code under test (this file imports nothing of it before)
    from reclock.config import load_config
    from reclock.pipeline import run
    from tests.running import durable

    path = work / "pipeline.yaml"
    path.write_text(f"""
state_dir: {work}/state
timestamp_interval: 1s
spark:
  master: local[2]
{f"  max_bytes_per_task: {task_bytes}" if task_bytes != "-" else ""}
sources:
  - name: big
    kafka: {{bootstrap_servers: "{bootstrap}", topic: {topic}, timeout: 30s}}
    outputs:
      - {{name: big, format: {{type: json, schema: {{id: int64, body: string}}}}, sink: file}}
""")
    cfg = load_config(path)
    stop = threading.Event()
    runners: list[Any] = []
    t = threading.Thread(target=run, kwargs=dict(cfg=cfg, stop=stop, out=None,
                                                  install_signals=False,
                                                  on_ready=runners.extend))
    with Sampler() as s:
        t.start()
        while not runners:
            time.sleep(0.05)
        started = time.monotonic()
        while durable(runners[0]).get(0, 0) < records:
            if not t.is_alive():
                raise SystemExit("the pipeline stopped")
            time.sleep(0.1)
        seconds = time.monotonic() - started
        stop.set()
        t.join()
    reads = [e for e in map(json.loads, (work / "state" / "progress.jsonl").read_text()
                            .splitlines()) if e["kind"] == "read" and e["records"]]
    print(json.dumps({**{k: v / MiB for k, v in s.peak.items()}, "seconds": seconds,
                      "jobs": len(reads), "tasks": sum(e.get("tasks", 0) for e in reads),
                      "largest": max(e.get("largest_task", 0) for e in reads)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=96)
    ap.add_argument("--size", type=int, default=8, help="MiB per record (default 8)")
    ap.add_argument("--before", default="480816c",
                    help="git revision of the code before tasks were cut by bytes")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        bootstrap, topic, task_bytes, work = args.child
        child(bootstrap, topic, args.records, task_bytes, Path(work))
        return
    from confluent_kafka import Producer

    from tests.kafkabroker import KafkaCluster

    size = args.size * MiB
    cluster = KafkaCluster(nodes=1).start()
    try:
        topic = f"big-{uuid.uuid4().hex[:6]}"
        cluster.create_topic(topic, 1, config={"max.message.bytes": str(size + MiB)})
        p = Producer({"bootstrap.servers": cluster.bootstrap, "message.max.bytes": size + MiB,
                      "linger.ms": 5})
        t0 = time.monotonic()
        for i in range(args.records):
            body = json.dumps({"id": i, "body": "x" * (size - 40)}).encode()
            while True:
                try:
                    p.produce(topic, value=body)
                    break
                except BufferError:
                    p.poll(0.1)
        assert p.flush(120) == 0
        print(f"wrote {args.records} records of {args.size} MiB ({args.records * args.size} MiB)"
              f" in {time.monotonic() - t0:.1f} s", flush=True)
        rows = {}
        before = tempfile.mkdtemp(prefix="reclock-before-")
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", before,
                        args.before], check=True, capture_output=True)
        for so in [*ROOT.glob("reclock/*.so"), *ROOT.glob("sources/*.so")]:  # built in place
            (Path(before) / so.relative_to(ROOT)).write_bytes(so.read_bytes())
        variants = (("before", "-", before), ("by bytes (64MiB)", "64MiB", str(ROOT)))
        for label, task_bytes, tree in variants:
            env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "BENCH_TREE": tree,
                   "PYTHONPATH": tree}
            with tempfile.TemporaryDirectory() as work:
                out = subprocess.run(
                    [sys.executable, __file__, "--records", str(args.records),
                     "--child", cluster.bootstrap, topic, task_bytes, work],
                    capture_output=True, text=True, env=env, timeout=1800)
                if out.returncode:
                    raise SystemExit(f"{label}: exit {out.returncode}\n{out.stderr[-3000:]}")
                rows[label] = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"  {label}: done", flush=True)
    finally:
        cluster.close()
        if "before" in locals():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", before],
                           capture_output=True)
    cols = [("worker", "largest worker MiB"), ("workers", "all workers MiB"),
            ("jvm", "JVM MiB"), ("driver", "driver MiB"), ("largest", "largest task"),
            ("jobs", "jobs"), ("tasks", "tasks"), ("seconds", "seconds")]
    print()
    print(f"| variant | {' | '.join(h for _k, h in cols)} |")
    print("|---" * (len(cols) + 1) + "|")
    for label, r in rows.items():
        print(f"| {label} | " + " | ".join(
            f"{r[k]:.0f}" if isinstance(r[k], float) else str(r[k]) for k, _h in cols) + " |")
    a, b = rows["before"], rows["by bytes (64MiB)"]
    print("| ratio (before / by bytes) | " + " | ".join(
        f"{a[k] / b[k]:.2f}" if b[k] else "-" for k, _h in cols) + " |")


if __name__ == "__main__":
    main()
