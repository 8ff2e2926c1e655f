"""What the state-table benchmarks share (``bench/state_table_bench.py`` for
Delta, ``bench/iceberg_state_bench.py`` for Iceberg): the random changes
over the live keys and their model, the rows reclock's sink and Spark's
``MERGE`` are given for them, and the sink-level tick loop that stamps each
change with its due time and measures its freshness.

The loop, every ``--interval`` for ``--ticks`` ticks: sleep until the
tick's due time (the schedule never waits for a late tick: a tick that
overruns delays the next ones, so an overrun shows in their freshness),
draw ``--rate`` changes on random keys (80 % updates, 10 % deletes, 10 %
inserts of new keys; each key at most once per tick) with IntoTime = the
due time, write the first ``--spark-batches`` ticks' changes as one Parquet
file each for the Spark peer, stage them through the sink's stager (in this
process: staging stands for the executors' work), commit, then run the
sink's maintenance as the driver does between ticks. Freshness of a tick's
changes = the time its commit was durable - the due time.

The retractions of updates and deletes carry placeholder values: a state
table removes the key's row whatever its other columns hold.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from reclock.contracts.rows import output_schema
from reclock.contracts.sink import SinkState

#: the user's columns of the benchmarks' state tables (key ``k``)
USER = pa.schema([("k", pa.int64()), ("v", pa.string()), ("n", pa.float64())])
SCHEMA = output_schema(USER)


def peer_dir() -> Path:
    """The peer Spark's virtualenv (``tests/setup.sh`` makes it)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("RECLOCK_CACHE") or Path(base) / "reclock") / "spark-peer"


class Changes:
    """Random changes over the live keys (a bitmap of them), and the tick
    of each key's last change (the model a table is checked against:
    key ``k`` last changed at tick ``t`` holds ``v{t}-{k}``, ``v0-{k}``
    if only loaded)."""

    def __init__(self, keys: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.live = np.ones(keys * 2, dtype=bool)
        self.live[keys:] = False
        self.next = keys
        self.last = np.zeros(keys * 2, dtype=np.int32)  # the tick of each key's row (0: load)

    def batch(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(updated keys, deleted keys, inserted keys)."""
        inserts = np.arange(self.next, self.next + n // 10, dtype=np.int64)
        self.next += len(inserts)
        want = n - len(inserts)
        pick = np.unique(self.rng.integers(0, self.next - len(inserts), int(want * 1.3)))
        pick = pick[self.live[pick]]
        self.rng.shuffle(pick)
        pick = pick[:want]
        cut = len(pick) * 8 // 9
        updates, deletes = pick[:cut], pick[cut:]
        self.live[deletes] = False
        self.live[inserts] = True
        return updates, deletes, inserts

    def settle(self, tick: int, updates: np.ndarray, inserts: np.ndarray) -> None:
        self.last[updates] = tick
        self.last[inserts] = tick

    def value(self, k: int) -> str:
        """The value key ``k`` holds in the model."""
        t = int(self.last[k])
        return f"v0-{k}" if t == 0 else f"v{t}-{k}"


def load_rows(lo: int, hi: int) -> pa.Table:
    """The loaded rows of keys ``lo`` to ``hi`` (user columns)."""
    k = np.arange(lo, hi, dtype=np.int64)
    return pa.table({"k": k, "v": pa.array([f"v0-{x}" for x in k.tolist()]), "n": k / 3.0},
                    schema=USER)


def reclock_rows(tick: int, into: int, upd: np.ndarray, dele: np.ndarray,
                 ins: np.ndarray) -> pa.Table:
    """A tick's updates as the sink is given them: a retraction per updated
    or deleted key, an insertion per updated or inserted key."""
    minus = np.concatenate([upd, dele])
    plus = np.concatenate([upd, ins])
    k = np.concatenate([minus, plus])
    m = len(k)
    v = ["old"] * len(minus) + [f"v{tick}-{x}" for x in plus.tolist()]
    return pa.table({
        "k": k, "v": v, "n": k / 7.0, "_into_time": np.full(m, into, dtype=np.int64),
        "_diff": np.concatenate([np.full(len(minus), -1), np.ones(len(plus))]).astype(np.int64),
        "_src_part": pa.array(np.zeros(m, dtype=np.int32)),
        "_src_offset": np.arange(m, dtype=np.int64),
        "_src_seq": pa.array(np.zeros(m, dtype=np.int32)),
        "_src_ts": pa.nulls(m, pa.int64()), "_error": pa.nulls(m, pa.string()),
        "_raw_key": pa.nulls(m, pa.binary()), "_raw_value": pa.nulls(m, pa.binary())},
        schema=SCHEMA)


def spark_rows(tick: int, upd: np.ndarray, dele: np.ndarray, ins: np.ndarray) -> pa.Table:
    """A tick's changes as Spark's ``MERGE`` is given them: one row per key,
    ``op`` ``u``/``d``/``i``."""
    k = np.concatenate([upd, dele, ins])
    ops = ["u"] * len(upd) + ["d"] * len(dele) + ["i"] * len(ins)
    return pa.table({"k": k, "v": [f"v{tick}-{x}" for x in k.tolist()], "n": k / 7.0,
                     "op": ops})


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else float("nan")


def add_load_args(ap: argparse.ArgumentParser, *, ticks: int = 120) -> None:
    """The load's options, the same in both benchmarks."""
    ap.add_argument("--keys", type=int, default=10_000_000)
    ap.add_argument("--rate", type=int, default=10_000, help="changes per interval")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--ticks", type=int, default=ticks)
    ap.add_argument("--spark-batches", type=int, default=6)
    ap.add_argument("--no-spark", action="store_true")
    ap.add_argument("--dir", default=None, help="where the tables go (a temp dir by default)")


@dataclass
class Ticks:
    """What :func:`run_ticks` measured, one entry per tick (times in s)."""

    fresh: list[float] = field(default_factory=list)  # durable - due
    busy: list[float] = field(default_factory=list)  # stage + commit + maintenance
    stage: list[float] = field(default_factory=list)
    commit: list[float] = field(default_factory=list)
    after: list[float] = field(default_factory=list)  # the commit's work once durable
    written: list[int] = field(default_factory=list)  # bytes the commit wrote
    changed: list[int] = field(default_factory=list)
    passes: list[int] = field(default_factory=list)  # files each compaction pass merged
    spark_live: int = 0  # live keys after the Spark batches' changes
    spark_wall: float = 0.0  # the first due time to the last Spark batch's tick durable
    state: SinkState = field(default_factory=SinkState)


def run_ticks(sink: Any, state: SinkState, gen: Changes, args: argparse.Namespace,
              changes_dir: Path, *, written: Callable[[], int],
              durable: Callable[[], float] | None = None,
              compacted: str = "files_removed") -> Ticks:
    """The tick loop of the module docstring on ``sink`` (a persist sink in
    ``mode: state`` keyed on ``k``, holding the state ``state``).
    ``written()``: the bytes the commit just made wrote. ``durable()``: the
    wall time (``time.time()``) the commit just made was durable, if the
    sink's commit returns some work later (default: when it returned).
    ``compacted``: the key of the maintenance report that counts the files
    a compaction pass merged."""
    out = Ticks()
    interval = args.interval
    start = time.time() + 0.5
    for tick in range(args.ticks):
        due = start + tick * interval
        if time.time() < due:
            time.sleep(due - time.time())
        into = int(due * 1000)
        upd, dele, ins = gen.batch(args.rate)
        gen.settle(tick, upd, ins)
        if tick == args.spark_batches - 1:
            out.spark_live = int(gen.live.sum())
        if tick < args.spark_batches:
            pq.write_table(spark_rows(tick, upd, dele, ins),
                           changes_dir / f"batch-{tick:05d}.parquet")
        b0 = time.monotonic()
        staged = sink.stager().stage(f"t{tick}", 0, reclock_rows(tick, into, upd, dele, ins))
        b1 = time.monotonic()
        new = SinkState(into + 1, f'"{tick}"')
        sink.commit(staged, state, new)
        returned = time.time()
        done_at = returned if durable is None else durable()
        state = new
        b2 = time.monotonic()
        out.written.append(written())  # this commit's, before maintenance adds to the table
        b3 = time.monotonic()
        done = sink.maintain(int(time.time() * 1000))
        if done.get(compacted):
            out.passes.append(done[compacted])
        out.fresh.append(done_at - due)
        out.busy.append(time.monotonic() - b0 - (b3 - b2))  # (not the counting of bytes)
        out.stage.append(b1 - b0)
        out.commit.append(b2 - b1)
        out.after.append(returned - done_at)
        if tick == args.spark_batches - 1:
            out.spark_wall = done_at - start
        out.changed.append(len(upd) + len(dele) + len(ins))
        if tick % 10 == 0:
            print(f"  tick {tick}: stage {b1 - b0:.3f} s, commit {b2 - b1:.3f} s, "
                  f"freshness {out.fresh[-1]:.2f} s", file=sys.stderr, flush=True)
    out.state = state
    return out
