"""Start-up: from launching ``reclock run`` to the first durable data, with
and without the driver's class-data-sharing archive (reclock.runtime.cds).

One command::

    python bench/startup_bench.py [--runs 3]

Each run launches ``python -m reclock.cli run`` on a copy of
``examples/quickstart.yaml`` with a fresh state directory and times, from
the launch: the first ``open`` event in the progress log (config parsed,
Spark started, the source opened) and the first ``sink_upper`` event with
rows (the first durable commit of data, not an empty one). The variants alternate run by run, so
that a noisy neighbour hits each: ``before`` (no class-data-sharing
archive, Spark started once the file is checked: ``RECLOCK_CDS=off
RECLOCK_EARLY_SPARK=off``), ``archive`` (the archive, made first if
missing, as the first driver on a machine makes it in the background), and
``archive+early`` (Spark's JVM also starts while the file is checked and
the plug-ins imported), and ``all (default)``, which also starts Spark's
Python workers in a background job while the sources open
(``reclock.runtime.spark.warm_workers``). The target (issue
43): first durable data within 3 s of launch on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET_S = 3.0


def _first(log: Path, kind: str, after: float, proc: subprocess.Popen[bytes],
           timeout: float = 120) -> float:
    """Seconds from ``after`` until ``log`` holds an event of ``kind``."""
    deadline = after + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the driver exited with {proc.returncode}: "
                             f"{(proc.stderr.read() if proc.stderr else b'').decode()[-2000:]}")
        try:
            for line in log.read_text().splitlines():
                event = json.loads(line)
                if event.get("kind") == kind and (kind != "sink_upper" or event.get("rows")):
                    return time.monotonic() - after
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise SystemExit(f"no {kind} event within {timeout} s")


#: the variants: name -> the environment they set
VARIANTS: dict[str, dict[str, str]] = {
    "before": {"RECLOCK_CDS": "off", "RECLOCK_EARLY_SPARK": "off",
               "RECLOCK_WARM_WORKERS": "off"},
    "archive": {"RECLOCK_EARLY_SPARK": "off", "RECLOCK_WARM_WORKERS": "off"},
    "archive+early": {"RECLOCK_WARM_WORKERS": "off"},
    "all (default)": {},
}


def one(work: Path, variant: str) -> tuple[float, float]:
    """(seconds to the first open, seconds to the first durable commit)."""
    state = Path(tempfile.mkdtemp(dir=work, prefix="state-"))
    cfg = work / f"quickstart-{state.name}.yaml"
    text = (ROOT / "examples" / "quickstart.yaml").read_text()
    cfg.write_text(text + f"\nstate_dir: {state}\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPARK_SUBMIT_OPTS", "SPARK_CONF_DIR", "RECLOCK_CDS",
                        "RECLOCK_EARLY_SPARK", "RECLOCK_WARM_WORKERS")}
    env.update({"PYSPARK_PYTHON": sys.executable, "PYTHONUNBUFFERED": "1",
                **VARIANTS[variant]})
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "reclock.cli", "run", str(cfg)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=work)
    try:
        log = state / "progress.jsonl"
        opened = _first(log, "open", started, proc)
        durable = _first(log, "sink_upper", started, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()
    return opened, durable


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of each variant (alternating)")
    args = ap.parse_args()
    from reclock.runtime import cds

    path = cds.archive_path()
    if path is None:
        raise SystemExit("no java found")
    if not path.exists():
        print(f"making the archive first: {path}", flush=True)
        cds.make(path)
    with tempfile.TemporaryDirectory(prefix="reclock-startup-") as tmp:
        work = Path(tmp)
        one(work, "all (default)")  # (warms the page cache for every variant)
        got: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
        for _ in range(args.runs):
            for variant in VARIANTS:
                got[variant].append(one(work, variant))
    load = os.getloadavg()[0]
    print(f"\nquickstart, launch to first durable data, median of {args.runs} "
          f"(load average {load:.1f} on {os.cpu_count()} cores)")
    print(f"{'variant':<14} {'open s':>8} {'durable s':>10} {'ratio':>6}  "
          f"{'runs (durable s)':<24} target")
    base = statistics.median(d for _, d in got["before"])
    for variant, runs in got.items():
        opened = statistics.median(o for o, _ in runs)
        durable = statistics.median(d for _, d in runs)
        each = " ".join(f"{d:.2f}" for _, d in runs)
        verdict = "PASS" if durable <= TARGET_S else "FAIL"
        print(f"{variant:<14} {opened:>8.2f} {durable:>10.2f} {durable / base:>6.2f}  "
              f"{each:<24} {verdict} (<= {TARGET_S:.0f} s)")
    for variant, env in VARIANTS.items():
        print(f"{variant}: {' '.join(f'{k}={v}' for k, v in env.items()) or 'nothing set'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
