"""The Postgres source's decode alone: replication frames -> Arrow batches.

Feeds ``PostgresReader.decode`` a synthetic stream shaped as
``bench/cdc_bench.py``'s table (``id bigint, v float8, at timestamptz``,
REPLICA IDENTITY FULL: inserts) in transactions of 1 and of 100 rows, with
the C decoder and with the Python parser, and prints changes/s of each (the
text-to-Arrow conversion of the batches included; no connection, no Spark).

Run: ``python bench/pgoutput_bench.py [--changes N]``.
"""

from __future__ import annotations

import argparse
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reclock.sources.postgres import pgoutput as po
from reclock.sources.postgres.catalog import PgColumn, PgTable
from reclock.sources.postgres.source import PostgresReader, StreamSpec, _Decoding
from reclock.sources.postgres.types import FLOAT8, INT8, TIMESTAMPTZ, PgType

TABLE = PgTable(16384, "public", "bench", "bench", (
    PgColumn("id", PgType(INT8, -1, "bigint"), True),
    PgColumn("v", PgType(FLOAT8, -1, "double precision"), False),
    PgColumn("at", PgType(TIMESTAMPTZ, -1, "timestamp with time zone"), False)),
    "f", key=("id",), primary_key=("id",))


def frames(changes: int, per_tx: int) -> list[bytes]:
    def w(msg: bytes) -> bytes:
        return b"w" + struct.pack("!QQq", 0, 0, 0) + msg

    def text(s: str) -> bytes:
        return b"t" + struct.pack("!i", len(s)) + s.encode()

    rel = (b"R" + struct.pack("!I", 16384) + b"public\0bench\0f" + struct.pack("!h", 3)
           + b"\1id\0" + struct.pack("!Ii", INT8, -1) + b"\0v\0" + struct.pack("!Ii", FLOAT8, -1)
           + b"\0at\0" + struct.pack("!Ii", TIMESTAMPTZ, -1))
    out = [w(b"B" + struct.pack("!QqI", 100, 0, 1)), w(rel)]
    lsn = 100
    for i in range(changes):
        if i % per_tx == 0:
            lsn += 64
            out.append(w(b"B" + struct.pack("!QqI", lsn, 800_000_000_000_000, i)))
        out.append(w(b"I" + struct.pack("!I", 16384) + b"N" + struct.pack("!h", 3)
                     + text(str(i + 1)) + text(repr(0.123456789 + i / 7))
                     + text(f"2026-11-27 23:{i // 60 % 60:02d}:{i % 60:02d}.{i % 999983:06d}+00")))
        if i % per_tx == per_tx - 1:
            out.append(w(b"C" + struct.pack("!BQQq", 0, lsn, lsn + 8, 0)))
    return out


def run(stream: list[bytes], native: bool) -> float:
    reader = PostgresReader("bench", "postgresql://u@localhost/db", "s", "p", (TABLE,), 5.0,
                            native=native)
    st = _Decoding(reader, {}, StreamSpec(0, 2**63))
    batches = [stream[i:i + 4096] for i in range(0, len(stream), 4096)]
    t0 = time.perf_counter()
    rows = sum(b.num_rows for _, b in reader.decode(st, batches, lambda: None))
    rows += sum(b.num_rows for _, b in st.rest())
    took = time.perf_counter() - t0
    return rows / took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--changes", type=int, default=300_000)
    args = ap.parse_args()
    if po.native() is None:
        print("the C decoder is not built (python setup.py build_ext --inplace)")
        return 1
    for per_tx in (1, 100):
        stream = frames(args.changes, per_tx)
        py = run(stream, native=False)
        c = run(stream, native=True)
        print(f"tx of {per_tx:>3} rows: Python {py:>10,.0f} changes/s   C {c:>10,.0f} "
              f"changes/s   ({c / py:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
