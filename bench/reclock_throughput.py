"""Reclocking throughput: vectorized ``Bindings.reclock_offsets`` vs a plain loop.

Builds a monotone Kafka :class:`~reclock.core.bindings.Bindings` snapshot (``--bindings``
bindings at IntoTimes 1000, 2000, ... over ``--partitions`` partitions, each
binding advancing every partition's next offset by a random non-negative amount,
the last one covering every record), then reclocks ``--records`` records laid
out three ways:

* **kafka order** -- each partition's offsets ascending, delivered in
  fetch-sized chunks (``--chunk`` records of one partition, then a chunk of
  another), reclocked in one call;
* **random order** -- a random permutation of the same records, in one call;
* **one partition per batch** -- one call per partition over its whole offset
  range (one Spark task reading one partition range), times summed.

Vectorized timings are the best of ``--repeat`` runs (``time.perf_counter``).
The plain loop calls ``b.reclock(Partitioned.point(p, o))`` per record on a
random sample of ``--loop-sample`` records, once; its records/s is
extrapolated from that sample. The vectorized results on the sample (plus a
few probes past the last binding, which must stay unbound) are checked against
the scalar rule, and the layouts against each other; any mismatch exits with
status 1.

Run: ``python bench/reclock_throughput.py`` (see ``--help``).
"""

from __future__ import annotations

import os

# Keep numpy (and any BLAS it loads) on one thread: this measures one core.
os.environ["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
os.environ["OPENBLAS_NUM_THREADS"] = os.environ.get("OPENBLAS_NUM_THREADS", "1")
os.environ["MKL_NUM_THREADS"] = os.environ.get("MKL_NUM_THREADS", "1")

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from reclock.core.bindings import UNBOUND, Binding, Bindings
from reclock.core.frontier import kafka_frontier
from reclock.core.time import IntoTime, Partitioned

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]

TARGET_RATE = 20e6  # records/s on one core
TARGET_RATIO = 50.0  # times the plain per-record loop


@dataclass(frozen=True)
class Row:
    """One line of the result table."""

    layout: str
    records: int | None
    seconds: float
    ratio_base: float | None = None  # records/s of the plain loop, for "vs loop"
    note: str = ""

    @property
    def rate(self) -> float | None:
        if self.records is None or self.seconds <= 0:
            return None
        return self.records / self.seconds


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=10_000_000, help="records to reclock")
    ap.add_argument("--partitions", type=int, default=64, help="Kafka partitions")
    ap.add_argument("--bindings", type=int, default=10_000, help="bindings in the snapshot")
    ap.add_argument("--loop-sample", type=int, default=200_000,
                    help="records timed in the plain per-record loop (extrapolated)")
    ap.add_argument("--chunk", type=int, default=1000,
                    help="records per fetch chunk in the kafka-order layout")
    ap.add_argument("--repeat", type=int, default=3, help="vectorized runs; the best is kept")
    ap.add_argument("--seed", type=int, default=0, help="numpy RNG seed")
    args = ap.parse_args(argv)
    for name in ("records", "partitions", "bindings", "loop_sample", "chunk", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# -- data ------------------------------------------------------------------------
def records_per_partition(records: int, partitions: int) -> I64:
    """An even split of ``records`` over the partitions (the remainder to the first)."""
    n = np.full(partitions, records // partitions, dtype=np.int64)
    n[: records % partitions] += 1
    return n


def binding_offsets(rng: np.random.Generator, nb: int, per_part: I64) -> I64:
    """``(nb, partitions)`` next offsets: non-decreasing down each column, random
    non-negative steps (zeros included), the last row equal to ``per_part``."""
    steps = rng.integers(0, 32, size=(nb, per_part.size), dtype=np.int64)
    steps[-1] += 1  # no all-zero column: every partition reaches its record count
    cum = np.cumsum(steps, axis=0)
    out: I64 = cum * per_part // cum[-1]
    return out


def build_bindings(offsets: I64) -> Bindings[Partitioned]:
    parts = offsets.shape[1]
    rows = offsets.tolist()
    bs = [
        Binding(IntoTime(1000 * (i + 1)),
                kafka_frontier(dict(enumerate(row)), partitions=parts))
        for i, row in enumerate(rows)
    ]
    return Bindings(Partitioned.KIND, bs)


def partition_major(per_part: I64) -> tuple[I32, I64]:
    """All records sorted by (partition, offset)."""
    parts = np.repeat(np.arange(per_part.size, dtype=np.int32), per_part)
    starts = np.cumsum(per_part) - per_part
    offs = np.arange(int(per_part.sum()), dtype=np.int64) - np.repeat(starts, per_part)
    return parts, offs


def kafka_order(rng: np.random.Generator, per_part: I64, chunk: int) -> tuple[I32, I64]:
    """Each partition ascending, in chunks of ``chunk`` records; every round of
    fetches takes the next chunk of each partition that has one, partitions in
    a random order per round."""
    nparts = per_part.size
    nchunks = -(-per_part // chunk)  # ceil
    c_part = np.repeat(np.arange(nparts, dtype=np.int64), nchunks)
    c_round = np.arange(int(nchunks.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(nchunks) - nchunks, nchunks)
    c_start = c_round * chunk
    c_len = np.minimum(per_part[c_part] - c_start, chunk)
    order = np.lexsort((rng.random(c_part.size), c_round))
    c_part, c_start, c_len = c_part[order], c_start[order], c_len[order]
    parts = np.repeat(c_part.astype(np.int32), c_len)
    begins = np.cumsum(c_len) - c_len
    offs = np.arange(int(c_len.sum()), dtype=np.int64) - np.repeat(begins - c_start, c_len)
    return parts, offs


# -- timing --------------------------------------------------------------------------
def best_of(repeat: int, fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def scalar_loop(b: Bindings[Partitioned], parts: list[int], offs: list[int]) -> list[int | None]:
    out: list[int | None] = []
    append = out.append
    for p, o in zip(parts, offs, strict=True):
        t = b.reclock(Partitioned.point(p, o))
        append(None if t is None else int(t))
    return out


# -- report --------------------------------------------------------------------------
def fmt_table(rows: list[Row]) -> str:
    header = ("layout", "records", "seconds", "M rec/s", "vs loop", "")
    lines: list[tuple[str, ...]] = [header]
    for r in rows:
        rate = r.rate
        ratio = "" if rate is None or r.ratio_base is None else f"{rate / r.ratio_base:,.0f}x"
        lines.append((
            r.layout,
            "-" if r.records is None else f"{r.records:,}",
            f"{r.seconds:.4f}",
            "-" if rate is None else f"{rate / 1e6:,.3f}",
            ratio,
            r.note,
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    align_right = {1, 2, 3, 4}

    def render(line: tuple[str, ...]) -> str:
        cells = [c.rjust(w) if i in align_right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(line, widths, strict=True))]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths).rstrip()
    return "\n".join([render(lines[0]), rule, *(render(line) for line in lines[1:])])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    per_part = records_per_partition(args.records, args.partitions)
    n = args.records

    # 1. The snapshot, and compiling it.
    t0 = time.perf_counter()
    b = build_bindings(binding_offsets(rng, args.bindings, per_part))
    log(f"built {len(b):,} bindings over {args.partitions} partitions "
        f"in {time.perf_counter() - t0:.1f}s (not timed)")
    t0 = time.perf_counter()
    compiled = b._compiled  # first access compiles; cached afterwards
    compile_s = time.perf_counter() - t0
    log(f"compiled in {compile_s:.3f}s "
        f"({'flat single search' if compiled.flat is not None else 'per-partition search'})")

    # 2. The records, in three layouts.
    t0 = time.perf_counter()
    pm_p, pm_o = partition_major(per_part)
    ko_p, ko_o = kafka_order(rng, per_part, args.chunk)
    perm = rng.permutation(n)
    ro_p, ro_o = pm_p[perm], pm_o[perm]
    edges = np.concatenate(([0], np.cumsum(per_part)))
    slices = [(int(edges[i]), int(edges[i + 1])) for i in range(args.partitions)]
    log(f"generated {n:,} records x 3 layouts in {time.perf_counter() - t0:.1f}s")

    # 3. Timings.
    sample = min(args.loop_sample, n)
    s_p, s_o = ro_p[:sample].tolist(), ro_o[:sample].tolist()  # a uniform random sample
    log(f"plain loop over {sample:,} records ...")
    t0 = time.perf_counter()
    scalar = scalar_loop(b, s_p, s_o)
    loop_s = time.perf_counter() - t0
    loop_rate = sample / loop_s

    def per_partition() -> None:
        for lo, hi in slices:
            b.reclock_offsets(pm_p[lo:hi], pm_o[lo:hi])

    log("vectorized runs ...")
    ko_s = best_of(args.repeat, lambda: b.reclock_offsets(ko_p, ko_o))
    ro_s = best_of(args.repeat, lambda: b.reclock_offsets(ro_p, ro_o))
    pp_s = best_of(args.repeat, per_partition)

    # 4. Correctness.
    ok = True
    extra_p = [*range(args.partitions), args.partitions, args.partitions + 7]
    extra_o = [int(x) for x in per_part] + [0, 12345]  # past the last binding: unbound
    chk_p = np.array(s_p + extra_p, dtype=np.int32)
    chk_o = np.array(s_o + extra_o, dtype=np.int64)
    expected = scalar + [None] * len(extra_p)
    if any(x is not None for x in scalar_loop(b, extra_p, extra_o)):
        log("FAIL: probes past the last binding are bound by the scalar rule")
        ok = False
    vec = b.reclock_offsets(chk_p, chk_o)
    got = [None if v == UNBOUND else v for v in vec.tolist()]
    mismatches = [i for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e]
    if mismatches:
        ok = False
        for i in mismatches[:10]:
            log(f"FAIL: ({int(chk_p[i])}, {int(chk_o[i])}): vectorized {got[i]}, "
                f"scalar {expected[i]}")
        log(f"FAIL: {len(mismatches):,} of {len(expected):,} sample records differ")
    else:
        log(f"ok: vectorized == scalar on {len(expected):,} records "
            f"({len(extra_p)} unbound probes)")
    ref = b.reclock_offsets(pm_p, pm_o)
    if (ref == UNBOUND).any():
        log("FAIL: some records are unbound although the last binding covers all")
        ok = False
    if not np.array_equal(b.reclock_offsets(ro_p, ro_o), ref[perm]):
        log("FAIL: random-order results differ from partition-major results")
        ok = False
    # Kafka order: map each record back to its (partition, offset) position.
    ko_pos = edges[:-1][ko_p] + ko_o
    if not np.array_equal(b.reclock_offsets(ko_p, ko_o), ref[ko_pos]):
        log("FAIL: kafka-order results differ from partition-major results")
        ok = False
    pieces = [b.reclock_offsets(pm_p[lo:hi], pm_o[lo:hi]) for lo, hi in slices]
    if not np.array_equal(np.concatenate(pieces), ref):
        log("FAIL: per-partition results differ from one-call results")
        ok = False

    # 5. Report.
    rows = [
        Row("compile (first _compiled access)", None, compile_s,
            note=f"{len(b):,} bindings x {args.partitions} partitions"),
        Row("plain loop b.reclock(point)", sample, loop_s, loop_rate,
            note=f"sample of {sample:,}; rate extrapolated"),
        Row("kafka order (one call)", n, ko_s, loop_rate,
            note=f"chunks of {args.chunk:,}; best of {args.repeat}"),
        Row("random order (one call)", n, ro_s, loop_rate, note=f"best of {args.repeat}"),
        Row("one partition per batch", n, pp_s, loop_rate,
            note=f"{args.partitions} calls summed; best of {args.repeat}"),
    ]
    print()
    print(f"reclock throughput: {n:,} records, {args.partitions} partitions, "
          f"{len(b):,} bindings, seed {args.seed}, numpy {np.__version__}")
    print(fmt_table(rows))
    ko_rate = n / ko_s
    rate_ok = ko_rate >= TARGET_RATE
    ratio_ok = ko_rate / loop_rate >= TARGET_RATIO
    print()
    print(f"targets (kafka order): >= {TARGET_RATE / 1e6:.0f} M records/s on one core: "
          f"{'PASS' if rate_ok else 'FAIL'} ({ko_rate / 1e6:.2f} M/s); "
          f">= {TARGET_RATIO:.0f}x the plain loop: {'PASS' if ratio_ok else 'FAIL'} "
          f"({ko_rate / loop_rate:,.0f}x); correctness: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
