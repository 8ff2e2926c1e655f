"""``reclock verify`` on large outputs: how long the audit takes, and where.

Two generator sources (replayable: verify reads them again) are run to the
end into Delta outputs by ``reclock run`` (a child process), then audited
in this process:

* ``counter``: an append output of ``--records`` JSON records (``{"n",
  "payload", "even"}``, every 1,000th malformed: an error row);
* ``kv``: an upsert output of ``--keyed-records`` key-value records
  (``--keys`` keys, every 10th a delete).

For each, the best of ``--repeat`` runs of :func:`reclock.verify.verify_pipeline`
on that source alone, and a breakdown of one run: reading the output, the
re-read (records read, rows built, digests), the comparisons. A report that
is not clean exits 1.

Run: ``python bench/verify_bench.py`` (about 2 minutes on 2 cores, most of
it the pipeline run) or ``--records 200000`` for a quick look.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reclock.config import load_config
from reclock.verify import verify_pipeline

PIPELINE = """
state_dir: {dir}/state
timestamp_interval: 1s
spark: {{master: "local[2]", max_records_per_job: 500000}}
sources:
  - name: counter
    generator: {{kind: counter, rate: 400000, max_records: {records}, bad_every: 1000}}
    outputs:
      - name: value
        format: {{type: json, schema: {{n: int64, payload: string, even: bool}}}}
        sink: file
  - name: kv
    generator: {{kind: key-value, keys: {keys}, seed: 7, rate: 100000,
                 max_records: {keyed}, delete_every: 10, value_size: 24}}
    outputs:
      - name: state
        format: {{type: json, schema: {{n: int64, payload: string}}}}
        key_format: {{type: json, schema: {{key: int64}}}}
        envelope: {{type: upsert, key: [key]}}
        sink: file
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ingest(path: Path, timeout: float) -> None:
    """``reclock run`` until every source finished."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "reclock.cli", "run", str(path),
                           "--duration", str(timeout)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        log(proc.stderr[-3000:])
        raise SystemExit(f"reclock run exited {proc.returncode}")
    log(f"ingested in {time.monotonic() - started:.1f} s")


def audit(cfg: Any, source: str, repeat: int) -> tuple[float, Any]:
    """Best of ``repeat`` audits of ``source`` alone; its last report."""
    one = cfg.model_copy(update={"sources": [s for s in cfg.sources if s.name == source]})
    best = float("inf")
    report = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        report = verify_pipeline(one)[0]
        best = min(best, time.perf_counter() - t0)
    return best, report


def breakdown(cfg: Any, source: str) -> list[tuple[str, float]]:
    """Cumulative seconds of verify's phases in one profiled run."""
    one = cfg.model_copy(update={"sources": [s for s in cfg.sources if s.name == source]})
    prof = cProfile.Profile()
    prof.enable()
    verify_pipeline(one)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    want = {"read_updates": "read the output",
            "result": "waiting for the re-read (a thread, beside the time checks)",
            "take": "  rows built and digested", "check_output": "time, upper, once",
            "check_append": "complete, values (append)",
            "check_keyed": "complete, values, history (keyed)", "apply": "  key state model"}
    out: dict[str, float] = {}
    for (file, _line, fn), (_cc, _nc, _tt, ct, _callers) in stats.items():
        if fn in want and ("reclock" in file or "sinks" in file or "concurrent" in file):
            out[want[fn]] = max(out.get(want[fn], 0.0), ct)
    return sorted(out.items(), key=lambda kv: -kv[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--keyed-records", type=int, default=200_000)
    ap.add_argument("--keys", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="reuse a run's directory")
    args = ap.parse_args()
    base = args.dir or Path(tempfile.mkdtemp(prefix="verify-bench-"))
    path = base / "pipeline.yaml"
    if not path.exists():
        path.write_text(PIPELINE.format(dir=base, records=args.records, keys=args.keys,
                                        keyed=args.keyed_records))
        ingest(path, 600)
    cfg = load_config(path)
    print(f"# verify bench, {platform.node()} ({os.cpu_count()} CPUs), python "
          f"{platform.python_version()}; {base}")
    bad = False
    for source in ("counter", "kv"):
        best, rep = audit(cfg, source, args.repeat)
        o = rep.outputs[0]
        print(f"{source}: {o.rows:,} rows ({o.errors:,} errors), {rep.complete_checked:,} "
              f"records re-read: verify {best:.2f} s (best of {args.repeat}); ok={rep.ok}")
        print(f"  checked: {o.checks}")
        if o.unchecked:
            print(f"  not checked: {o.unchecked}")
        for what, secs in breakdown(cfg, source):
            print(f"  {what}: {secs:.2f} s (profiled)")
        bad |= not rep.ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
