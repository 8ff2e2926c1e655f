"""Settling a keyed output's intents in the driver: intents per second of
:meth:`UpsertState.settle` settling slices in whole columns (``columns``,
what drivers do) and intent by intent (``rows``, the reference, as drivers
did before), side by side in one run, against a SQLite key store
(:class:`SqliteKeys`) in a temporary directory.

Scenarios, each on ``--rows`` intents of a table ``(id bigint, v text)``
split by key bucket as tasks split them (``split_intents``, not timed),
settled in rounds of ``max_bytes_per_settle`` (32 MiB) and committed:

* ``insert``: every key new (a bulk load: the keyed transaction bench);
* ``update``: every key held already, each given a new value;
* ``mixed``: keys drawn from twice ``--rows`` held half, a fifth of
  intents tombstones, keys repeated within the transaction.

Run: ``python bench/settle_bench.py`` (1 million intents; ``--rows`` to
change). Other work on the machine changes the figures: the ratio of the
two ways, measured in the same run, and the intents per CPU second (the
process's own) are the figures to compare; the load average is printed
with them. ``--rows-only`` measures the intent-by-intent way alone, and
runs against code that has no other (``PYTHONPATH`` at an older checkout:
its ``settle`` takes no ``vectorised``). Both ways must give as many
updates and leave as many keys (in ``insert`` and ``update``: the keys
written); the script exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reclock.contracts.rows import output_schema
from reclock.runtime.keystate import KeyedIntents, SqliteKeys, split_intents
from reclock.runtime.upsert_state import UpsertState

USER = pa.schema([("id", pa.int64()), ("v", pa.string())])
SCHEMA = output_schema(USER)
BUDGET = 32 * 2**20


def intents(ids: np.ndarray, diffs: np.ndarray, t: int) -> KeyedIntents:
    n = len(ids)
    table = pa.table({
        "id": pa.array(ids, pa.int64()),
        "v": pa.array([f"value-{i}-{t}" for i in ids.tolist()]),
        "_into_time": pa.array(np.full(n, t), pa.int64()),
        "_diff": pa.array(diffs, pa.int64()),
        "_src_part": pa.array(np.zeros(n, np.int32), pa.int32()),
        "_src_offset": pa.array(np.arange(n), pa.int64()),
        "_src_seq": pa.array(np.zeros(n, np.int32), pa.int32()),
        "_src_ts": pa.nulls(n, pa.int64()), "_error": pa.nulls(n, pa.string()),
        "_raw_key": pa.nulls(n, pa.binary()), "_raw_value": pa.nulls(n, pa.binary()),
    }, schema=SCHEMA)
    return split_intents(table, ("id",), None, 1 << 62, "bench")


def settle(st: UpsertState, ki: KeyedIntents, vectorised: bool | None, marker: str
           ) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of this process, updates) of settling ``ki``."""
    t0, c0 = time.perf_counter(), time.process_time()
    kw = {} if vectorised is None else {"vectorised": vectorised}
    rows = sum(u.num_rows for u in st.settle(ki, SCHEMA, BUDGET, **kw))
    st.commit(marker)
    return time.perf_counter() - t0, time.process_time() - c0, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--scenarios", default="insert,update,mixed")
    ap.add_argument("--rows-only", action="store_true")
    args = ap.parse_args()
    n = args.rows
    rng = np.random.default_rng(7)
    failed = False
    print(f"settling {n:,} intents; load average before: {os.getloadavg()}")
    print(f"{'scenario':8} {'way':8} {'s':>7} {'intents/s':>11} {'CPU s':>7} "
          f"{'intents/CPU s':>13} {'updates':>10}")
    for scenario in args.scenarios.split(","):
        held = {"insert": np.empty(0, np.int64), "update": np.arange(n),
                "mixed": np.arange(0, 2 * n, 2)}[scenario]
        if scenario == "mixed":
            ids = rng.integers(0, 2 * n, n)
            diffs = (rng.random(n) >= 0.2).astype(np.int64)
        else:
            ids, diffs = np.arange(n), np.ones(n, np.int64)
        speed = {}
        got: dict[str, tuple[int, int]] = {}  # (updates, keys held after)
        for way in ("rows",) if args.rows_only else ("rows", "columns"):
            with tempfile.TemporaryDirectory(prefix="reclock-settle-") as d:
                st = UpsertState(["id", "v"], ("id",), SqliteKeys(Path(d) / "k.sqlite"))
                if len(held):
                    settle(st, intents(held, np.ones(len(held), np.int64), 1), None, "0")
                ki = intents(ids, diffs, 2)
                dt, cpu, rows = settle(st, ki, None if args.rows_only else way == "columns",
                                       "1")
                got[way] = (rows, len(st.store))
                st.store.close()
            speed[way] = n / dt
            print(f"{scenario:8} {way:8} {dt:7.2f} {n / dt:11,.0f} {cpu:7.2f} {n / cpu:13,.0f} "
                  f"{rows:10,}", flush=True)
        keys = len(set(held.tolist()) | set(ids[diffs == 1].tolist())
                   - set(ids[diffs == 0].tolist())) if scenario != "mixed" else None
        if len(set(got.values())) != 1 or (keys is not None and got["rows"][1] != keys):
            print(f"MISMATCH: {scenario}: (updates, keys held) {got}, expected keys {keys}")
            failed = True
        if not args.rows_only:
            print(f"{scenario:8} columns/rows (wall): {speed['columns'] / speed['rows']:.1f}x")
    print(f"load average after: {os.getloadavg()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
