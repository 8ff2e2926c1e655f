"""The Postgres CDC source end to end, against a private cluster with
``wal_level=logical``: the snapshot hand-off under concurrent writes,
transactions kept whole, a Postgres replica, acknowledgement, and every
PostgreSQL type the source maps."""

from __future__ import annotations

import datetime as dt
import decimal
import time
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa

from reclock.config import load_config
from reclock.core.time import Lsn
from reclock.verify import verify_pipeline
from tests.running import read_updates, running, wait_for
from tests.sources.cdc import (
    ALL_TYPES,
    ROW,
    Writer,
    create_schema,
    flushed_lsn,
    output_rows,
    resumed_past,
    source_rows,
)

BANK = """
state_dir: {tmp}/state
timestamp_interval: 300ms
spark: {{max_records_per_task: 3000}}
sources:
  - name: bank
    postgres: {{dsn: "{url}", tables: [acct, public.ledger]}}
    outputs:
      - name: acct
        sink: {{type: postgres, dsn: "{url}", table: acct_replica, mode: state, key: [id]}}
      - name: ledger
        sink: file
"""

LEDGER_COLS = ["id", "txn", "acct", "amount", "tags", "at"]


def _norm(v: Any) -> Any:
    if isinstance(v, dt.datetime):
        return round(v.timestamp(), 6)
    if isinstance(v, list):
        return tuple(_norm(x) for x in v)
    return v


def _rows(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return sorted((tuple(_norm(v) for v in r) for r in rows), key=repr)


def _slot(url: str) -> tuple[int, int, int]:
    """(confirmed_flush_lsn, restart_lsn, current WAL insert LSN) of the source's slot."""
    with psycopg.connect(url) as c:
        row = c.execute("select confirmed_flush_lsn::text, restart_lsn::text, "
                        "pg_current_wal_insert_lsn()::text from pg_replication_slots "
                        "where database = current_database() and slot_name like 'reclock%bank'"
                        ).fetchone()
    assert row is not None, "the slot is gone"
    return int(Lsn.parse(row[0])), int(Lsn.parse(row[1])), int(Lsn.parse(row[2]))


def test_snapshot_under_concurrent_writes_keeps_transactions_whole(
        tmp_path: Path, spark: Any, cdc_url: str) -> None:
    create_schema(cdc_url, accounts=2000, ledger=20_000)
    path = tmp_path / "p.yaml"
    path.write_text(BANK.format(tmp=tmp_path, url=cdc_url))
    cfg = load_config(path)
    writer = Writer(cdc_url, seed=5)
    with running(cfg, spark) as runners:
        # the snapshot is taken while the writer runs; it keeps running after
        wait_for(lambda: bool(runners[0].status().get("resume")) and
                 runners[0].status()["resume"] != ["0/0"], 90, "the snapshot to be durable")
        time.sleep(3)
        txns = writer.stop()
        target = flushed_lsn(cdc_url)
        wait_for(resumed_past(runners, target), 90, "the outputs to catch up")
        assert runners[0].health.status == "running", runners[0].health
        confirmed, _, _ = _slot(cdc_url)
        resume = int(Lsn.parse(runners[0].status()["resume"][0]))
        assert confirmed <= resume  # never past what the outputs hold
        # Idle (only unpublished writes move the WAL): the slot keeps following.
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("create table other (x int)")
            for i in range(30):
                c.execute("insert into other values (%s)", (i,))
                time.sleep(0.1)
        idle_target = flushed_lsn(cdc_url)
        wait_for(lambda: _slot(cdc_url)[0] >= idle_target, 30, "the slot to follow on idle")
        confirmed, restart, now = _slot(cdc_url)
        assert now - restart < 4 * 1024 * 1024, (now, restart)  # retained WAL stays small
    assert txns > 100
    # the replica (state mode, keyed upserts) equals the source table
    assert _rows(source_rows(cdc_url, "select id, owner, bal, note from acct")) == \
        _rows(source_rows(cdc_url, "select id, owner, bal, note from acct_replica"))
    # the diff log (FULL identity) consolidates to the source table
    updates = read_updates(cfg, "bank", "ledger")
    assert _rows(output_rows(updates, LEDGER_COLS)) == \
        _rows(source_rows(cdc_url, f"select {', '.join(LEDGER_COLS)} from ledger"))
    # every transaction's rows first appear at one IntoTime
    ins = updates.filter(pa.compute.greater(updates.column("_diff"), 0))
    first: dict[int, tuple[int, int]] = {}
    for rid, txn, t in zip(ins.column("id").to_pylist(), ins.column("txn").to_pylist(),
                           ins.column("_into_time").to_pylist(), strict=True):
        if rid not in first or t < first[rid][1]:
            first[rid] = (txn, t)
    times: dict[int, set[int]] = {}
    for txn, t in first.values():
        times.setdefault(txn, set()).add(t)
    split = {k: v for k, v in times.items() if k > 0 and len(v) > 1}
    assert not split, f"transactions split across IntoTimes: {list(split.items())[:5]}"
    assert len([k for k in times if k > 0]) > 100
    # snapshot rows are stamped at the snapshot, before every streamed change
    snap = ins.filter(pa.compute.less(ins.column("_src_part"), 0))
    assert snap.num_rows >= 20_000  # the seeded rows and what the writer did before it
    assert len(set(snap.column("_src_offset").to_pylist())) == 1
    # the audit: every row at its bindings' IntoTime, no position twice
    [report] = verify_pipeline(cfg)
    assert report.ok, [(o.output, o.breaches, o.samples) for o in report.outputs]
    assert any("current-state table" in n for n in report.notes)  # the replica


TRICKY = ("insert into kinds (id, t, vc, ch, ta, j) values (%s, E'two\\nlines,\\r\"q\" \\\\N', "
          "'', 'a', array[E'x\\ny', '', null, ','], '\"\\\\n\"')")


def test_every_type_reads_the_same_from_the_snapshot_and_the_stream(
        tmp_path: Path, spark: Any, cdc_url: str) -> None:
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute(ALL_TYPES)
        c.execute("insert into kinds values " + ROW % 1)  # snapshot
        c.execute("insert into kinds (id) values (2)")  # all nulls
        c.execute("insert into kinds (id, ts, d, f4) values (3, 'infinity', '-infinity', "
                  "'-Infinity')")
        c.execute(TRICKY % 4)  # the snapshot reads CSV: line breaks, quotes, \N, empty
    path = tmp_path / "p.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
sources:
  - name: bank
    postgres: {{dsn: "{cdc_url}", tables: [kinds], slot: reclock_bank}}
    outputs:
      - {{name: kinds, sink: file}}
""")
    cfg = load_config(path)
    with running(cfg, spark) as runners:
        wait_for(lambda: runners[0].status().get("resume") not in (None, ["0/0"]), 90,
                 "the snapshot")
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("insert into kinds values " + ROW % 11)  # streamed
            c.execute("insert into kinds (id) values (12)")
            c.execute("insert into kinds (id, ts, d, f4) values (13, 'infinity', '-infinity', "
                      "'-Infinity')")
            c.execute(TRICKY % 14)
        target = flushed_lsn(cdc_url)
        wait_for(resumed_past(runners, target), 60, "the stream")
    updates = read_updates(cfg, "bank", "kinds")
    schema = updates.schema
    expect = {
        "b": pa.bool_(), "i2": pa.int16(), "i4": pa.int32(), "i8": pa.int64(),
        "f4": pa.float32(), "f8": pa.float64(), "n": pa.decimal128(12, 3), "nu": pa.string(),
        "t": pa.string(), "j": pa.string(), "jb": pa.string(), "ts": pa.timestamp("us"),
        "tz": pa.timestamp("us", tz="UTC"), "d": pa.date32(), "tm": pa.int64(),  # Delta: µs
        "ba": pa.binary(), "u": pa.string(), "ia": pa.list_(pa.int32()),
        "ta": pa.list_(pa.string()), "iv": pa.string(), "ip": pa.string(),
    }
    for name, typ in expect.items():
        assert schema.field(name).type == typ, (name, schema.field(name).type)
    assert sorted(updates.column("id").to_pylist()) == [1, 2, 3, 4, 11, 12, 13, 14]
    # infinities: the extremes of the Arrow types (no Python datetime holds them)
    inf = updates.filter(pa.compute.is_in(updates.column("id"), pa.array([3, 13])))
    assert inf.column("ts").cast(pa.int64()).to_pylist() == [2**63 - 1] * 2
    assert inf.column("d").cast(pa.int32()).to_pylist() == [-(2**31) + 1] * 2
    assert inf.column("f4").to_pylist() == [float("-inf")] * 2
    finite = updates.filter(pa.compute.invert(pa.compute.is_in(updates.column("id"),
                                                               pa.array([3, 13]))))
    rows = {r["id"]: r for r in finite.to_pylist()}
    for snap, streamed in ((1, 11), (2, 12), (4, 14)):
        a = {k: v for k, v in rows[snap].items() if not k.startswith("_") and k != "id"}
        b = {k: v for k, v in rows[streamed].items() if not k.startswith("_") and k != "id"}
        assert repr(a) == repr(b), (a, b)  # repr: NaN equals NaN
    r4 = rows[4]
    assert (r4["t"], r4["vc"], r4["ch"]) == ('two\nlines,\r"q" \\N', "", "a  ")
    assert r4["ta"] == ["x\ny", "", None, ","] and r4["j"] == '"\\\\n"'
    r = rows[1]
    assert r["b"] is True and r["i2"] == 32767 and r["i4"] == -(2**31) and r["i8"] == 2**63 - 1
    assert r["f4"] == 1.5 and r["f8"] != r["f8"]
    assert r["n"] == decimal.Decimal("123456789.125")
    assert r["nu"] == "0." + "0" * 39 + "1"  # unconstrained numeric: exact, as text
    assert r["t"] == "a \"quoted\" \\ and 'x'" and r["vc"] == "vc" and r["ch"] == "ab "
    assert r["j"] == '{"a": [1, 2]}' and r["jb"] == '{"b": null}'
    assert r["ts"] == dt.datetime(2024, 2, 29, 12, 34, 56, 789012)
    assert r["tz"] == dt.datetime(2023, 12, 31, 18, 30, tzinfo=dt.UTC)
    assert r["d"] == dt.date(2024, 3, 1) and r["tm"] == 86_399_999_999
    assert r["ba"] == b"\x00\xff\x10" and r["u"] == "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
    assert r["ia"] == [1, None, 3] and r["ta"] == ["x,y", "", None, 'q"']
    assert r["iv"] == "P1DT2H" and r["ip"] == "10.0.0.1/8"
    assert all(v is None for k, v in rows[2].items() if not k.startswith("_") and k != "id")
