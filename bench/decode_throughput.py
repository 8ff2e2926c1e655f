"""Decode throughput: the vectorised decoders of ``reclock.formats`` vs per-record ``json.loads``.

Generates ``--records`` JSON objects of about 100 bytes (and the same rows as
CSV lines of about 70 bytes), then times on one core:

* **json, schema** -- ``make_decoder({"type": "json", "schema": ...})`` on clean
  input, with ``--bad`` (0.1 % by default) of the records truncated (malformed
  JSON: the reader names the row), and with the same share holding ``1.5`` in an
  ``int64`` field (a conversion error: the reader names no row);
* **json, no schema** -- validation only, the record's text kept;
* **csv** -- typed columns, clean and with ``--bad`` records missing a field;
* **text** -- UTF-8 validation;
* **json.loads baseline** -- ``json.loads`` of every record and nothing else (a
  lower bound on any per-record decoder's cost), on a ``--loop-sample`` of the
  records, extrapolated.

Rates are computed from the CPU time of the process (``time.process_time``;
everything runs on one thread), so that other load on the machine skews them
less; wall time is shown beside. Each decoder timing is the run with the least
CPU time of ``--repeat``. The results are checked (row count, error indices, a
sample of decoded rows against ``json.loads``); a mismatch exits with status 1.
The last line reports the target: json with a schema on clean input at >= 1 M
records/s on one core. Missing the target does not change the exit status.

Run: ``python bench/decode_throughput.py`` (see ``--help``).
"""

from __future__ import annotations

import os

# One core: Arrow's and numpy's thread pools stay at one thread.
os.environ["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
os.environ["OPENBLAS_NUM_THREADS"] = os.environ.get("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa

from reclock.contracts.decode import DecodeResult
from reclock.registry import make_decoder

TARGET_RATE = 1e6  # json with a schema, clean input, records/s on one core

SCHEMA = {"id": "int64", "name": "string", "score": "float64", "ok": "bool", "tags": "string"}
CSV_SPEC = {"type": "csv", "columns": ["id", "name", "score", "ok", "tags"],
            "types": {"id": "int64", "score": "float64", "ok": "bool"}}


@dataclass(frozen=True)
class Row:
    """One line of the result table."""

    case: str
    records: int
    cpu: float  # seconds of CPU time used by this process
    wall: float
    errors: int | None
    base: float  # records/s (CPU time) of the json.loads loop
    note: str = ""

    @property
    def rate(self) -> float:
        return self.records / self.cpu


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000, help="records per case")
    ap.add_argument("--bad", type=float, default=0.001, help="share of bad records")
    ap.add_argument("--loop-sample", type=int, default=200_000,
                    help="records timed in the json.loads loop (extrapolated)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case; the best is kept")
    ap.add_argument("--seed", type=int, default=0, help="random seed")
    args = ap.parse_args(argv)
    if args.records < 1 or args.loop_sample < 1 or args.repeat < 1:
        ap.error("--records, --loop-sample and --repeat must be >= 1")
    if not 0 <= args.bad < 1:
        ap.error("--bad must be in [0, 1)")
    return args


def make_rows(n: int, rng: random.Random) -> list[dict[str, object]]:
    return [
        {"id": i, "name": f"user-{rng.randrange(10**8):08d}", "score": rng.random() * 100,
         "ok": rng.random() < 0.5, "tags": rng.choice(["a,b", "c", "", "d e f"]),
         "extra": {"v": rng.randrange(1000)}}
        for i in range(n)
    ]


def best_of(repeat: int, fn: Callable[[], DecodeResult]
            ) -> tuple[float, float, DecodeResult]:
    """(CPU seconds, wall seconds, result) of the run with the least CPU time."""
    best, wall, out = float("inf"), float("inf"), None
    for _ in range(repeat):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        cpu = time.process_time() - c0
        if cpu < best:
            best, wall = cpu, time.perf_counter() - t0
    assert out is not None
    return best, wall, out


def fmt_table(rows: list[Row]) -> str:
    header = ("case", "records", "bad", "cpu s", "wall s", "M rec/s", "vs json.loads", "note")
    lines: list[tuple[str, ...]] = [header]
    for r in rows:
        lines.append((
            r.case, f"{r.records:,}", "-" if r.errors is None else f"{r.errors:,}",
            f"{r.cpu:.3f}", f"{r.wall:.3f}", f"{r.rate / 1e6:.2f}", f"{r.rate / r.base:.1f}x",
            r.note,
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    right = {1, 2, 3, 4, 5, 6}

    def render(line: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(line, widths, strict=True))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([render(lines[0]), rule, *(render(line) for line in lines[1:])])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    rng = random.Random(args.seed)
    n = args.records

    t0 = time.perf_counter()
    objs = make_rows(n, rng)
    clean = [json.dumps(o).encode() for o in objs]
    nbad = round(n * args.bad)
    bad_at = sorted(rng.sample(range(n), nbad))
    truncated, drifted = list(clean), list(clean)
    for i in bad_at:
        truncated[i] = clean[i][: len(clean[i]) // 2]
        drifted[i] = clean[i].replace(b'"id": ', b'"id": 1.5, "was": ', 1)
    csv_clean = [
        f'{o["id"]},{o["name"]},{o["score"]!r},{"true" if o["ok"] else "false"},"{o["tags"]}"'
        .encode()
        for o in objs
    ]
    csv_bad = list(csv_clean)
    for i in bad_at:
        csv_bad[i] = csv_clean[i].split(b",", 1)[1]  # the id field missing
    arrays = {name: pa.array(v, pa.binary()) for name, v in [
        ("clean", clean), ("truncated", truncated), ("drifted", drifted),
        ("csv_clean", csv_clean), ("csv_bad", csv_bad)]}
    avg = sum(map(len, clean)) / n
    avg_csv = sum(map(len, csv_clean)) / n
    log(f"generated {n:,} records (json {avg:.0f} B, csv {avg_csv:.0f} B avg) in "
        f"{time.perf_counter() - t0:.1f}s (not timed)")

    sample = min(args.loop_sample, n)
    c0, t0 = time.process_time(), time.perf_counter()
    loads = json.loads
    for r in clean[:sample]:
        loads(r)
    loop_cpu, loop_wall = time.process_time() - c0, time.perf_counter() - t0
    base = sample / loop_cpu

    typed = make_decoder({"type": "json", "schema": SCHEMA})
    plain = make_decoder({"type": "json"})
    csv = make_decoder(CSV_SPEC)
    text = make_decoder({"type": "text"})
    cases: list[tuple[str, Callable[[], DecodeResult], set[int], str]] = [
        ("json, schema, clean", lambda: typed.decode(arrays["clean"]), set(), ""),
        ("json, schema, malformed", lambda: typed.decode(arrays["truncated"]), set(bad_at),
         "truncated records"),
        ("json, schema, type errors", lambda: typed.decode(arrays["drifted"]), set(bad_at),
         "1.5 in an int64 field"),
        ("json, no schema, clean", lambda: plain.decode(arrays["clean"]), set(), "validated"),
        ("csv, clean", lambda: csv.decode(arrays["csv_clean"]), set(), ""),
        ("csv, malformed", lambda: csv.decode(arrays["csv_bad"]), set(bad_at),
         "a field missing"),
        ("text, clean", lambda: text.decode(arrays["clean"]), set(), "utf-8 checked"),
    ]
    rows = [Row("json.loads per record", sample, loop_cpu, loop_wall, None, base,
                f"parse only; sample of {sample:,}, extrapolated")]
    ok = True
    results: dict[str, DecodeResult] = {}
    for name, fn, expect_bad, note in cases:
        log(f"{name} ...")
        cpu, wall, res = best_of(args.repeat, fn)
        results[name] = res
        got_bad = set(res.errors.tolist())
        if got_bad != expect_bad or res.table.num_rows + len(got_bad) != n:
            log(f"FAIL: {name}: {len(got_bad):,} errors, expected {len(expect_bad):,}")
            ok = False
        rows.append(Row(name, n, cpu, wall, len(got_bad), base,
                        (note + "; " if note else "") + f"best of {args.repeat}"))

    # decoded values agree with json.loads on a sample
    check = rng.sample(range(n), min(n, 2000))
    decoded = results["json, schema, clean"].table
    for i in check:
        want = {k: objs[i][k] for k in SCHEMA}
        if decoded.slice(i, 1).to_pylist()[0] != want:
            log(f"FAIL: record {i}: {decoded.slice(i, 1).to_pylist()[0]} != {want}")
            ok = False
            break
    dec_csv = results["csv, clean"].table
    for i in check[:200]:
        got = dec_csv.slice(i, 1).to_pylist()[0]
        if got != {k: objs[i][k] for k in CSV_SPEC["columns"]}:
            log(f"FAIL: csv record {i}: {got}")
            ok = False
            break

    print()
    print(f"decode throughput: {n:,} records, bad share {args.bad:g}, seed {args.seed}, "
          f"pyarrow {pa.__version__}, one thread; rates from CPU time")
    print(fmt_table(rows))
    rate = rows[1].rate
    print()
    print(f"target: json with a schema, clean, >= {TARGET_RATE / 1e6:.0f} M records/s on one "
          f"core: {'PASS' if rate >= TARGET_RATE else 'FAIL'} ({rate / 1e6:.2f} M/s); "
          f"correctness: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
