"""Arrow's memory pool in the driver: what a compaction-like merge leaves
resident, with the options reclock sets for the driver (``reclock/_allocator.py``:
mimalloc's ``purge_delay`` 0 and lazy arena commit) against the library's
defaults (``RECLOCK_ARROW_ALLOCATOR=default``).

Each variant runs in a fresh interpreter that imports reclock first, as a
driver does, then merges ``--files`` small Parquet files ``--passes`` times
the way ``DeltaSink._merge`` does (an Arrow dataset scanned with threads,
``--readahead`` files ahead, written in row groups of 100,000 rows), and
samples its resident set after each pass and after Arrow's
``release_unused``. The variants alternate, ``--rounds`` times each::

    python bench/arrow_pool_bench.py
    python bench/arrow_pool_bench.py --passes 20 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
import reclock  # first, as in a driver: sets the pool's options before pyarrow loads
import pyarrow as pa, pyarrow.dataset as ds, pyarrow.parquet as pq

files, passes, readahead, out = json.loads(sys.argv[1])

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

after, released = [], []
t0 = time.perf_counter()
for _ in range(passes):
    data = ds.dataset(files, format="parquet")
    writer = pq.ParquetWriter(out, data.schema)
    buf, rows = [], 0
    for b in data.to_batches(use_threads=True, fragment_readahead=readahead):
        buf.append(b)
        rows += b.num_rows
        if rows >= 100_000:
            writer.write_table(pa.Table.from_batches(buf))
            buf, rows = [], 0
    if buf:
        writer.write_table(pa.Table.from_batches(buf))
    writer.close()
    del buf, data, writer
    after.append(rss())
    pa.default_memory_pool().release_unused()
    released.append(rss())
print(json.dumps({"after": after, "released": released, "secs": time.perf_counter() - t0,
                  "backend": pa.default_memory_pool().backend_name}))
"""

VARIANTS = {
    "reclock driver": {},
    "library defaults": {"RECLOCK_ARROW_ALLOCATOR": "default"},
}


def make_files(d: Path, n: int, rows: int) -> list[str]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = []
    rng = np.random.default_rng(0)
    for i in range(n):
        p = d / f"f{i:04d}.parquet"
        base = i * rows
        pq.write_table(pa.table({
            "n": np.arange(base, base + rows),
            "payload": pa.array([f"payload-{j}-{'x' * 24}" for j in range(base, base + rows)]),
            "f": rng.random(rows),
        }), p)
        out.append(str(p))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=400)
    ap.add_argument("--rows", type=int, default=5000, help="rows per file")
    ap.add_argument("--passes", type=int, default=12)
    ap.add_argument("--readahead", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:VAR=V,...",
                    help="another variant: environment variables of its interpreter "
                         "(a MIMALLOC_ one set there wins over reclock's)")
    args = ap.parse_args()
    variants = dict(VARIANTS)
    for spec in args.variant:
        name, _, assigns = spec.partition(":")
        variants[name] = dict(a.split("=", 1) for a in assigns.split(",") if a)
    with tempfile.TemporaryDirectory(prefix="arrow-pool-") as tmp:
        d = Path(tmp)
        files = make_files(d, args.files, args.rows)
        arg = json.dumps([files, args.passes, args.readahead, str(d / "out.parquet")])
        got: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for name, extra in variants.items():
                env = {k: v for k, v in os.environ.items()
                       if not k.startswith("MIMALLOC_") and k != "RECLOCK_ARROW_ALLOCATOR"}
                env.update(extra)
                env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
                r = subprocess.run([sys.executable, "-c", CHILD, arg], env=env, check=True,
                                   capture_output=True, text=True, timeout=900)
                got[name].append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"{args.passes} merges of {args.files} files x {args.rows:,} rows "
          f"({args.readahead} read ahead), {args.rounds} rounds alternating; MiB resident, "
          "the median over rounds")
    print(f"{'variant':<17} {'peak after a pass':>17} {'after the last':>14} "
          f"{'+ release_unused':>16} {'seconds':>8}")
    for name, runs in got.items():
        peak = statistics.median(max(r["after"]) for r in runs)
        last = statistics.median(r["after"][-1] for r in runs)
        rel = statistics.median(r["released"][-1] for r in runs)
        secs = statistics.median(r["secs"] for r in runs)
        print(f"{name:<17} {peak:>17.0f} {last:>14.0f} {rel:>16.0f} {secs:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
