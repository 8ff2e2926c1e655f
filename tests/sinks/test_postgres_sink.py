"""The Postgres sink against the real local PostgreSQL (a fresh database per test)."""

from __future__ import annotations

import datetime as dt
import json
import math
import pickle
import random
import threading
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from reclock.contracts.rows import conform, output_schema
from reclock.contracts.sink import SinkError, SinkFenced, SinkState
from reclock.core.clock import ManualClock
from reclock.core.errors import DefiniteError, TransientError
from reclock.runtime.upsert_state import UpsertState
from reclock.sinks.postgres import PostgresSink, PostgresStager, pg_type, storage_type
from tests.sinks.rows import SCHEMA, USER, updates

NAME = "orders.main"
UTC = dt.UTC


def make(pg_url: str, tmp_path: Path, **kw: Any) -> PostgresSink:
    kw.setdefault("table", "orders")
    return PostgresSink(kw.pop("name", NAME), dsn=pg_url, staging_dir=tmp_path / "staging", **kw)


@pytest.fixture
def sink(pg_url: str, tmp_path: Path) -> Any:
    s = make(pg_url, tmp_path)
    s.ensure(USER)
    yield s
    s.close()


def q(pg_url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        cur = conn.execute(query, params or None)
        return cur.fetchall() if cur.description is not None else []


def column_types(pg_url: str, schema: str, table: str) -> dict[str, tuple[str, bool]]:
    rows = q(pg_url,
             "SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull "
             "FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
             "JOIN pg_namespace n ON n.oid = c.relnamespace "
             "WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped "
             "ORDER BY a.attnum", schema, table)
    return {r[0]: (r[1], r[2]) for r in rows}


def keys(table: pa.Table) -> list[str]:
    return sorted(table.column("k").to_pylist())


def count(pg_url: str, table: str = "orders") -> int:
    return int(q(pg_url, f'SELECT count(*) FROM "{table}"')[0][0])


# -- ensure --------------------------------------------------------------------------------------

META_PG = {
    "_into_time": ("bigint", True), "_diff": ("bigint", True), "_src_part": ("integer", True),
    "_src_offset": ("bigint", True), "_src_seq": ("integer", True), "_src_ts": ("bigint", False),
    "_error": ("text", False), "_raw_key": ("bytea", False), "_raw_value": ("bytea", False),
}


def test_ensure_creates_the_log_table_and_the_upper_table(pg_url: str, tmp_path: Path) -> None:
    s = make(pg_url, tmp_path)
    assert s.state() == SinkState()  # no upper table yet
    assert s.read_updates().schema == output_schema(pa.schema([]))
    s.ensure(USER)
    assert column_types(pg_url, "public", "orders") == {
        "k": ("text", False), "v": ("bigint", False), **META_PG}
    assert column_types(pg_url, "public", "reclock_uppers") == {
        "target": ("text", True), "output": ("text", False), "upper": ("bigint", False),
        "progress": ("text", False), "updated_at": ("timestamp with time zone", True),
        "commit_id": ("text", False), "pipeline": ("text", False),
        "pipeline_state": ("text", False), "target_oid": ("bigint", False)}
    assert s.state() == SinkState()
    got = s.read_updates()
    assert got.num_rows == 0 and got.schema == SCHEMA
    s.ensure(USER)  # idempotent
    assert column_types(pg_url, "public", "orders")["k"] == ("text", False)


ALL = pa.schema([
    ("i8", pa.int8()), ("i16", pa.int16()), ("i32", pa.int32()), ("i64", pa.int64()),
    ("u8", pa.uint8()), ("u16", pa.uint16()), ("u32", pa.uint32()), ("u64", pa.uint64()),
    ("f32", pa.float32()), ("f64", pa.float64()), ("b", pa.bool_()),
    ("s", pa.string()), ("ls", pa.large_string()),
    ("bin", pa.binary()), ("fbin", pa.binary(3)),
    ("ts", pa.timestamp("us", "UTC")), ("ts_ns", pa.timestamp("ns", "Europe/Paris")),
    ("ts_naive", pa.timestamp("ms")), ("d", pa.date32()), ("d64", pa.date64()),
    ("t", pa.time64("us")), ("t32", pa.time32("ms")), ("dur", pa.duration("us")),
    ("dec", pa.decimal128(10, 2)), ("dec38", pa.decimal128(38, 10)),
    ("dec50", pa.decimal256(50, 5)),
    ("li", pa.list_(pa.int64())), ("lstr", pa.list_(pa.string())),
    ("lts", pa.list_(pa.timestamp("us", "UTC"))),
    ("st", pa.struct([("a", pa.int64()), ("b", pa.string()), ("c", pa.binary()),
                      ("d", pa.timestamp("ms")), ("e", pa.decimal128(5, 2)),
                      ("f", pa.float64())])),
    ("m", pa.map_(pa.string(), pa.int64())), ("ll", pa.list_(pa.list_(pa.int32()))),
    ("j", pa.json_()), ("dict", pa.dictionary(pa.int32(), pa.string())),
])

ALL_PG = {
    "i8": "smallint", "i16": "smallint", "i32": "integer", "i64": "bigint",
    "u8": "smallint", "u16": "integer", "u32": "bigint", "u64": "numeric(20,0)",
    "f32": "real", "f64": "double precision", "b": "boolean", "s": "text", "ls": "text",
    "bin": "bytea", "fbin": "bytea", "ts": "timestamp with time zone",
    "ts_ns": "timestamp with time zone", "ts_naive": "timestamp without time zone",
    "d": "date", "d64": "date", "t": "time without time zone", "t32": "time without time zone",
    "dur": "interval", "dec": "numeric(10,2)", "dec38": "numeric(38,10)",
    "dec50": "numeric(50,5)", "li": "bigint[]", "lstr": "text[]",
    "lts": "timestamp with time zone[]", "st": "jsonb", "m": "jsonb", "ll": "jsonb", "j": "jsonb",
    "dict": "text",
}


def all_types_rows(into_time: int = 7) -> pa.Table:
    """Three rows: typical values, edge values, all nulls."""
    t0 = dt.datetime(2024, 2, 29, 23, 59, 59, 123456, tzinfo=UTC)
    values: dict[str, list[Any]] = {
        "i8": [-128, 127, None], "i16": [-32768, 32767, None],
        "i32": [-(2**31), 2**31 - 1, None], "i64": [-(2**63), 2**63 - 1, None],
        "u8": [0, 255, None], "u16": [0, 65535, None], "u32": [0, 2**32 - 1, None],
        "u64": [0, 2**64 - 1, None],
        "f32": [1.5, math.inf, None], "f64": [math.nan, -math.inf, None], "b": [True, False, None],
        "s": ["h\u00e9llo \U0001f600 'quotes' \"dq\" \\ tab\t nl\n", "", None],
        "ls": ["large", "", None],
        "bin": [b"\x00\x01\xff", b"", None], "fbin": [b"abc", b"\x00\x00\x00", None],
        "ts": [t0, dt.datetime(1, 1, 1, tzinfo=UTC), None],
        "ts_ns": [1_700_000_000_123_456_000, 0, None],
        "ts_naive": [dt.datetime(2020, 1, 2, 3, 4, 5, 6000), dt.datetime(1970, 1, 1), None],
        "d": [dt.date(2024, 2, 29), dt.date(1, 1, 1), None],
        "d64": [dt.date(1999, 12, 31), dt.date(2000, 1, 1), None],
        "t": [dt.time(23, 59, 59, 999999), dt.time(0, 0), None],
        "t32": [dt.time(12, 0, 0, 5000), dt.time(0, 0), None],
        "dur": [dt.timedelta(days=3, microseconds=7), dt.timedelta(0), None],
        "dec": [Decimal("12345678.90"), Decimal("-0.01"), None],
        "dec38": [Decimal("1234567890123456789012345678.0123456789"), Decimal("0"), None],
        "dec50": [Decimal("123456789012345678901234567890123456789012345.12345"),
                  Decimal("-1.00000"), None],
        "li": [[1, None, 3], [], None], "lstr": [["a", "b c", None], [], None],
        "lts": [[t0, None], [], None],
        "st": [{"a": 1, "b": "x", "c": b"\x00\xfe", "d": dt.datetime(2021, 1, 1, 0, 0, 0, 1000),
                "e": Decimal("1.25"), "f": math.nan},
               {"a": None, "b": None, "c": None, "d": None, "e": None, "f": -math.inf}, None],
        "m": [[("x", 1), ("y", None)], [], None],
        "ll": [[[1, 2], [], None], [], None],
        "j": ['{"b": [1, 2.5, null], "a": {"\u00fc": "v"}}', "[]", None],
        "dict": ["red", "red", None],
    }
    cols = [pa.array(values[f.name], f.type) for f in ALL]
    n = 3
    meta = updates(["x"] * n, into_time).drop_columns(["k", "v"])
    return pa.Table.from_arrays([*cols, *meta.columns], schema=output_schema(ALL))


def norm(v: Any) -> Any:
    """Comparable values: NaN equals NaN, JSON text compared parsed."""
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    if isinstance(v, list):
        return [norm(x) for x in v]
    if isinstance(v, tuple):
        return tuple(norm(x) for x in v)
    if isinstance(v, dict):
        return {k: norm(x) for k, x in v.items()}
    return v


def test_ensure_maps_arrow_types_to_postgres_types(pg_url: str, tmp_path: Path) -> None:
    s = make(pg_url, tmp_path, table="all")
    s.ensure(ALL)
    assert column_types(pg_url, "public", "all") == {
        **{n: (t, False) for n, t in ALL_PG.items()}, **META_PG}
    assert {f.name: pg_type(f.type) for f in ALL} == ALL_PG


def test_round_trip_of_every_type_with_nulls(pg_url: str, tmp_path: Path) -> None:
    s = make(pg_url, tmp_path, table="all")
    s.ensure(ALL)
    rows = all_types_rows()
    s.commit(s.stager().stage("b1", 0, rows), SinkState(), SinkState(8, "p"))
    got = s.read_updates()
    stored = output_schema(pa.schema([f.with_type(storage_type(f.type)) for f in ALL]))
    assert got.schema == stored
    want = conform(NAME, rows, stored)
    for name in stored.names:
        have_col, want_col = got.column(name).to_pylist(), want.column(name).to_pylist()
        if name == "j":  # jsonb normalizes the text: compare the documents
            have_col = [None if v is None else json.loads(v) for v in have_col]
            want_col = [None if v is None else json.loads(v) for v in want_col]
        assert norm(have_col) == norm(want_col), name

    # A sink that was not ensured reads the catalog's types back.
    fresh = make(pg_url, tmp_path, table="all")
    plain = fresh.read_updates()
    assert plain.schema.field("i32").type == pa.int32()
    assert plain.schema.field("u64").type == pa.decimal128(20, 0)
    assert plain.schema.field("ts").type == pa.timestamp("us", "UTC")
    assert plain.schema.field("ts_naive").type == pa.timestamp("us")
    assert plain.schema.field("dec50").type == pa.decimal256(50, 5)
    assert plain.schema.field("li").type == pa.list_(pa.int64())
    assert plain.schema.field("st").type == pa.json_()
    assert plain.column("dec").to_pylist() == want.column("dec").to_pylist()
    assert plain.column("ts").to_pylist() == want.column("ts").to_pylist()
    assert plain.column("bin").to_pylist() == want.column("bin").to_pylist()
    assert json.loads(plain.column("st")[0].as_py())["c"] == "AP4="  # base64 in jsonb

    # Plain SQL readers see ordinary values.
    (row,) = q(pg_url, 'SELECT s, ts, dec, bin, li, st ->> \'b\', d FROM "all" '
                       "WHERE i8 = -128")
    assert row == (rows.column("s")[0].as_py(), rows.column("ts")[0].as_py(),
                   Decimal("12345678.90"), b"\x00\x01\xff", [1, None, 3], "x",
                   dt.date(2024, 2, 29))


def test_nanoseconds_that_do_not_fit_microseconds_are_refused(pg_url: str, tmp_path: Path) -> None:
    s = make(pg_url, tmp_path, table="ts")
    user = pa.schema([("at", pa.timestamp("ns", "UTC"))])
    s.ensure(user)
    base = updates(["x"], 5).drop_columns(["k", "v"])
    rows = pa.Table.from_arrays([pa.array([1_000_000_001], pa.timestamp("ns", "UTC")),
                                 *base.columns], schema=output_schema(user))
    with pytest.raises(SinkError, match="'at'"):
        s.stager().stage("b", 0, rows)


def test_ensure_rejects_an_incompatible_table_naming_table_and_column(
    pg_url: str, tmp_path: Path
) -> None:
    q(pg_url, 'CREATE TABLE "orders" (k integer, v bigint NOT NULL, extra text NOT NULL)')
    with pytest.raises(SinkError) as info:
        make(pg_url, tmp_path).ensure(USER)
    msg = str(info.value)
    assert NAME in msg and '"public"."orders"' in msg
    assert "'k': stored integer, wanted text" in msg
    assert "'v' is NOT NULL" in msg
    assert "'extra' (text) is NOT NULL without a default" in msg
    assert "'_into_time' (bigint) is missing" in msg


def test_ensure_accepts_wider_stored_types_and_writes_through_them(
    pg_url: str, tmp_path: Path
) -> None:
    user = pa.schema([("k", pa.string()), ("n", pa.int32()), ("x", pa.float32())])
    cols = ", ".join(f"{n} {t}{' NOT NULL' if nn else ''}" for n, (t, nn) in META_PG.items())
    q(pg_url, f'CREATE TABLE "orders" (k text, n bigint, x double precision, note text, {cols})')
    s = make(pg_url, tmp_path)
    s.ensure(user)
    base = updates(["a"], 1)
    rows = pa.Table.from_arrays(
        [base.column("k"), pa.array([7], pa.int32()), pa.array([0.5], pa.float32()),
         *base.drop_columns(["k", "v"]).columns], schema=output_schema(user))
    s.commit(s.stager().stage("b", 0, rows), SinkState(), SinkState(2))
    got = s.read_updates()
    assert got.column("n").type == pa.int32() and got.column("n").to_pylist() == [7]
    assert q(pg_url, 'SELECT n, x, note FROM "orders"') == [(7, 0.5, None)]


def test_ensure_adds_new_nullable_columns(sink: PostgresSink, pg_url: str) -> None:
    sink.commit(sink.stager().stage("b1", 0, updates(["a"], 5)), SinkState(), SinkState(10))
    wider = pa.schema([*USER, pa.field("note", pa.string())])
    sink.ensure(wider)
    # the column is added by the commit of the first rows that need it, in its transaction
    assert "note" not in column_types(pg_url, "public", "orders")
    rows = updates(["b"], 12).append_column("note", pa.array(["hi"]))
    sink.commit(sink.stager().stage("b2", 0, rows), SinkState(10), SinkState(20))
    assert column_types(pg_url, "public", "orders")["note"] == ("text", False)
    assert sink.read_updates().column("note").to_pylist() == [None, "hi"]
    sink.ensure(USER)  # a stored superset is compatible
    sink.commit(sink.stager().stage("b3", 0, updates(["c"], 25)), SinkState(20), SinkState(30))
    assert make(pg_url, Path(sink.staging_root)).read_updates().column("note").to_pylist() == [
        None, "hi", None]


def test_ensure_rejects_reclock_column_names_and_bad_settings(pg_url: str, tmp_path: Path) -> None:
    with pytest.raises(DefiniteError, match="_diff"):
        make(pg_url, tmp_path).ensure(pa.schema([("_diff", pa.int64())]))
    with pytest.raises(SinkError, match="key"):
        make(pg_url, tmp_path, mode="state")
    with pytest.raises(SinkError, match="key only applies"):
        make(pg_url, tmp_path, key=("k",))
    with pytest.raises(SinkError, match="63 bytes"):
        make(pg_url, tmp_path, table="é" * 32)
    with pytest.raises(SinkError, match="errors table"):
        make(pg_url, tmp_path, table="t" * 60, mode="state", key=("k",))
    with pytest.raises(SinkError, match="reclock's own"):
        make(pg_url, tmp_path, table="reclock_uppers")
    with pytest.raises(SinkError, match=r"key columns \['nope'\]"):
        make(pg_url, tmp_path, mode="state", key=("nope",)).ensure(USER)
    with pytest.raises(SinkError, match=r"'u'.*no PostgreSQL type"):
        make(pg_url, tmp_path).ensure(pa.schema([("u", pa.null())]))


# -- commit --------------------------------------------------------------------------------------


def test_stage_commit_round_trip(sink: PostgresSink, pg_url: str) -> None:
    staged = sink.stager().stage("b1", 3, updates(["a", "b", "c"], 1000, offset=7))
    (d,) = staged
    assert d["path"] == "b1-00003.arrow" and d["rows"] == 3 and d["errors"] == 0
    assert (sink.staging_root / d["path"]).stat().st_size == d["size"]
    assert count(pg_url) == 0  # staged is not visible

    sink.commit(staged, SinkState(), SinkState(2000, '[{"p":0,"o":10}]'))
    assert sink.state() == SinkState(2000, '[{"p":0,"o":10}]')
    assert not (sink.staging_root / d["path"]).exists()  # staged files removed
    got = sink.read_updates()
    assert got.schema == SCHEMA
    assert got.to_pylist() == updates(["a", "b", "c"], 1000, offset=7).to_pylist()
    assert sink.read_updates(999).num_rows == 0
    assert sink.read_updates(1000).num_rows == 3
    (row,) = q(pg_url, "SELECT target, output, upper, progress, updated_at IS NOT NULL, "
                       "commit_id FROM reclock_uppers")
    assert row[:5] == ("orders", NAME, 2000, '[{"p":0,"o":10}]', True) and len(row[5]) == 32


def test_as_of_reads_across_commits(sink: PostgresSink) -> None:
    sink.commit(sink.stager().stage("b1", 0, updates(["a"], 100)), SinkState(), SinkState(200))
    sink.commit(sink.stager().stage("b2", 0, updates(["a"], 250, diff=-1)), SinkState(200),
                SinkState(300))
    assert sink.read_updates(199).column("_diff").to_pylist() == [1]
    assert sink.read_updates(300).column("_diff").to_pylist() == [1, -1]


def test_several_files_in_one_commit(sink: PostgresSink) -> None:
    stager = sink.stager()
    staged = stager.stage("b", 0, updates(["a", "b"], 1)) + stager.stage(
        "b", 1, updates(["c"], 1, part=1))
    sink.commit(staged, SinkState(), SinkState(2))
    assert keys(sink.read_updates()) == ["a", "b", "c"]


def test_commit_without_files_moves_the_upper(sink: PostgresSink) -> None:
    sink.commit([], SinkState(), SinkState(5000, "[]"))
    assert sink.state() == SinkState(5000, "[]")
    sink.commit([], SinkState(5000, "[]"), SinkState(5000, "[1]"))
    assert sink.state() == SinkState(5000, "[1]")
    assert sink.read_updates().num_rows == 0


def test_closed_upper(sink: PostgresSink, pg_url: str, tmp_path: Path) -> None:
    sink.commit([], SinkState(), SinkState(100, "p"))
    sink.commit([], SinkState(100, "p"), SinkState(None, "[]"))
    assert sink.state() == SinkState(None, "[]")
    assert q(pg_url, "SELECT upper FROM reclock_uppers") == [(None,)]
    assert make(pg_url, tmp_path).state() == SinkState(None, "[]")
    sink.commit([], SinkState(None, "[]"), SinkState(None, "[]"))


def test_two_outputs_share_the_upper_table(pg_url: str, tmp_path: Path) -> None:
    a = make(pg_url, tmp_path, name="s.a", table="a")
    b = make(pg_url, tmp_path, name="s.b", table="b")
    a.ensure(USER)
    b.ensure(USER)
    a.commit(a.stager().stage("x", 0, updates(["a"], 1)), SinkState(), SinkState(10, "pa"))
    b.commit([], SinkState(), SinkState(20, "pb"))
    assert (a.state(), b.state()) == (SinkState(10, "pa"), SinkState(20, "pb"))
    assert count(pg_url, "a") == 1 and count(pg_url, "b") == 0


def test_a_state_whose_table_was_dropped_counts_for_nothing(
        pg_url: str, tmp_path: Path) -> None:
    """The table dropped behind the sink's back, and made again (by the next
    ensure, or by someone): its row in reclock_uppers still says upper 20,
    but the rows it counted are gone. Before, the sink reported upper 20 over
    an empty table; now it reports nothing committed (which the driver
    compares with what it committed), and a commit from nothing starts the
    table's state afresh. A row of the layout before OIDs were kept is
    adopted with the table it finds."""
    sink = make(pg_url, tmp_path)
    sink.ensure(USER)
    sink.commit(sink.stager().stage("b1", 0, updates(["a", "b"], 10)), SinkState(),
                SinkState(20, "p"))
    q(pg_url, "DROP TABLE orders")
    again = make(pg_url, tmp_path)
    assert again.state() == SinkState()  # no table: nothing
    again.ensure(USER)  # made again, empty
    assert again.state() == SinkState() and sink.state() == SinkState()
    with pytest.raises(SinkFenced):  # the stale row is not what a writer can expect
        again.commit([], SinkState(20, "p"), SinkState(30, "q"))
    again.commit(again.stager().stage("b2", 0, updates(["c"], 25)), SinkState(),
                 SinkState(30, "q"))
    assert again.state() == SinkState(30, "q") and keys(again.read_updates()) == ["c"]
    q(pg_url, "UPDATE reclock_uppers SET target_oid = NULL")  # as an earlier layout left it
    assert make(pg_url, tmp_path).state() == SinkState(30, "q")
    again.commit([], SinkState(30, "q"), SinkState(40, "r"))
    assert q(pg_url, "SELECT target_oid = 'orders'::regclass::oid FROM reclock_uppers") == [
        (True,)]
    again.close()
    sink.close()


# -- fencing and retries -------------------------------------------------------------------------


def test_fenced_on_a_brand_new_output(sink: PostgresSink, pg_url: str) -> None:
    with pytest.raises(SinkFenced):
        sink.commit(sink.stager().stage("b", 0, updates(["a"], 1)), SinkState(5), SinkState(6))
    assert count(pg_url) == 0
    assert q(pg_url, "SELECT count(*) FROM reclock_uppers") == [(0,)]


def test_retrying_a_committed_batch_is_fenced_and_rows_stay_once(
    sink: PostgresSink, pg_url: str
) -> None:
    staged = sink.stager().stage("b1", 0, updates(["a", "b"], 10))
    sink.commit(staged, SinkState(), SinkState(20, "p"))
    with pytest.raises(SinkFenced):
        sink.commit(staged, SinkState(), SinkState(20, "p"))
    assert count(pg_url) == 2
    assert sink.state() == SinkState(20, "p")


def test_commit_of_a_vanished_staged_file_fails_and_writes_nothing(
    sink: PostgresSink, pg_url: str
) -> None:
    staged = sink.stager().stage("b", 0, updates(["a"], 1))
    (sink.staging_root / staged[0]["path"]).unlink()
    with pytest.raises(SinkError, match="gone"):
        sink.commit(staged, SinkState(), SinkState(2))
    assert sink.state() == SinkState() and count(pg_url) == 0
    with pytest.raises(ValueError, match="descriptor"):
        sink.commit([{"path": "../../etc/passwd", "size": 1, "rows": 1}], SinkState(),
                    SinkState(2))


def test_racing_committers_never_both_commit(pg_url: str, tmp_path: Path) -> None:
    racers, rounds = 4, 6
    make(pg_url, tmp_path).ensure(USER)
    barrier = threading.Barrier(racers)
    results: list[tuple[int, int, str]] = []
    errors: list[BaseException] = []

    def run(who: int) -> None:
        s = make(pg_url, tmp_path)
        s.ensure(USER)
        try:
            for r in range(rounds):
                expected = s.state()
                staged = s.stager().stage(f"w{who}-r{r}", 0, updates([f"w{who}r{r}"], r))
                barrier.wait()
                try:
                    s.commit(staged, expected, SinkState(r + 1, f"w{who}r{r}"))
                    results.append((r, who, "ok"))
                except SinkFenced:
                    results.append((r, who, "fenced"))
                barrier.wait()
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()
        finally:
            s.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    winners = {r: who for r, who, outcome in results if outcome == "ok"}
    assert len([1 for _, _, o in results if o == "ok"]) == rounds
    assert sorted(winners) == list(range(rounds))
    got = make(pg_url, tmp_path).read_updates()
    assert keys(got) == sorted(f"w{w}r{r}" for r, w in winners.items())


def test_a_committer_stuck_behind_a_lock_times_out_as_transient(
    pg_url: str, tmp_path: Path
) -> None:
    s = make(pg_url, tmp_path, lock_timeout_s=0.2)
    s.ensure(USER)
    s.commit([], SinkState(), SinkState(1))
    with psycopg.connect(pg_url) as holder:  # a hung committer holding the row lock
        holder.execute("SELECT * FROM reclock_uppers FOR UPDATE")
        t0 = time.monotonic()
        with pytest.raises(TransientError, match="55P03"):
            s.commit(s.stager().stage("b", 0, updates(["a"], 1)), SinkState(1), SinkState(2))
        assert time.monotonic() - t0 < 5
        holder.rollback()
    assert s.state() == SinkState(1) and count(pg_url) == 0


# -- the server going away -----------------------------------------------------------------------


class Terminating(PostgresSink):
    """Terminates its own backend from another connection at one step of commit."""

    kill_step = ""
    kill_after = 0
    killed = False

    def _step(self, step: str, count: int = 0) -> None:
        if step == self.kill_step and count >= self.kill_after and not self.killed:
            self.killed = True
            assert self._conn is not None
            pid = self._conn.info.backend_pid
            with psycopg.connect(self._dsn, autocommit=True) as other:
                row = other.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,)).fetchone()
            assert row == (True,)


def terminating(pg_url: str, tmp_path: Path, step: str, after: int = 0, **kw: Any) -> Terminating:
    s = Terminating(NAME, dsn=pg_url, table=kw.pop("table", "orders"),
                    staging_dir=tmp_path / "staging", **kw)
    s.kill_step, s.kill_after = step, after
    return s


def test_backend_terminated_mid_copy_leaves_nothing_and_the_retry_lands_once(
    pg_url: str, tmp_path: Path
) -> None:
    n = 120_000
    s = terminating(pg_url, tmp_path, "copied", after=40_000)
    s.ensure(USER)
    s.commit([], SinkState(), SinkState(1, "p1"))
    keys_ = [f"k{i}" for i in range(n)]
    staged = s.stager().stage("big", 0, updates(keys_[: n // 2], 5)) + s.stager().stage(
        "big", 1, updates(keys_[n // 2:], 5, offset=n // 2))
    with pytest.raises(TransientError) as info:
        s.commit(staged, SinkState(1, "p1"), SinkState(10, "p10"))
    assert s.killed
    assert NAME in str(info.value) and "127.0.0.1" in str(info.value)
    assert s.state() == SinkState(1, "p1")  # reconnects by itself
    assert count(pg_url) == 0
    assert all((s.staging_root / d["path"]).exists() for d in staged)

    s.commit(staged, SinkState(1, "p1"), SinkState(10, "p10"))  # the driver's retry
    assert s.state() == SinkState(10, "p10")
    assert count(pg_url) == n
    assert q(pg_url, 'SELECT count(DISTINCT k) FROM "orders"') == [(n,)]
    with pytest.raises(SinkFenced):
        s.commit(staged, SinkState(1, "p1"), SinkState(10, "p10"))
    assert count(pg_url) == n


def test_backend_terminated_before_commit_in_state_mode(pg_url: str, tmp_path: Path) -> None:
    s = terminating(pg_url, tmp_path, "upper_set", mode="state", key=("k",))
    s.ensure(USER)
    staged = s.stager().stage("b", 0, updates([f"k{i}" for i in range(5000)], 5))
    with pytest.raises(TransientError):
        s.commit(staged, SinkState(), SinkState(10))
    assert s.state() == SinkState() and count(pg_url) == 0
    s.commit(staged, SinkState(), SinkState(10))
    assert s.state() == SinkState(10) and count(pg_url) == 5000


def test_a_commit_whose_reply_is_lost_is_found_committed(
    sink: PostgresSink, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def commit_then_lose_the_reply(conn: psycopg.Connection[Any]) -> None:
        conn.execute("COMMIT")
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(sink, "_send_commit", commit_then_lose_the_reply)
    staged = sink.stager().stage("b", 0, updates(["a"], 1))
    sink.commit(staged, SinkState(), SinkState(2, "p"))  # returns normally
    assert sink.state() == SinkState(2, "p") and count(pg_url) == 1
    assert not (sink.staging_root / staged[0]["path"]).exists()


def test_a_commit_that_failed_is_not_taken_for_committed(
    sink: PostgresSink, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(conn: psycopg.Connection[Any]) -> None:
        conn.close()  # the transaction dies with the connection
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(sink, "_send_commit", fail)
    staged = sink.stager().stage("b", 0, updates(["a"], 1))
    with pytest.raises(TransientError, match="commit to"):
        sink.commit(staged, SinkState(), SinkState(2, "p"))
    assert sink.state() == SinkState() and count(pg_url) == 0


# -- connections and secrets ---------------------------------------------------------------------


@pytest.mark.parametrize("dsn", [
    "postgresql://postgres:s3cr3t-pw@127.0.0.1:1/nothing",
    "host=127.0.0.1 port=1 user=postgres password=s3cr3t-pw dbname=nothing",
])
def test_an_unreachable_server_is_transient_and_the_password_never_shows(
    dsn: str, tmp_path: Path
) -> None:
    s = PostgresSink(NAME, dsn=dsn, table="t", staging_dir=tmp_path)
    assert "s3cr3t" not in repr(s) and "127.0.0.1:1/nothing" in repr(s)
    for call in (s.state, lambda: s.ensure(USER), s.read_updates,
                 lambda: s.commit([], SinkState(), SinkState(1))):
        with pytest.raises(TransientError) as info:
            call()
        assert "s3cr3t" not in str(info.value)
        assert "postgres@127.0.0.1:1/nothing" in str(info.value)


def test_a_missing_database_is_definite(pg_url: str, tmp_path: Path) -> None:
    dsn = pg_url.rsplit("/", 1)[0].replace("postgres@", "postgres:pw-x9@") + "/no_such_db"
    with pytest.raises(SinkError) as info:
        PostgresSink(NAME, dsn=dsn, table="t", staging_dir=tmp_path).state()
    assert "no_such_db" in str(info.value) and "pw-x9" not in str(info.value)
    with pytest.raises(SinkError, match="invalid PostgreSQL DSN") as bad:
        PostgresSink(NAME, dsn="host=x password", table="t", staging_dir=tmp_path)
    assert bad.value.__cause__ is None


def test_the_connection_is_reused_and_reopened(sink: PostgresSink, pg_url: str) -> None:
    sink.state()
    conn = sink._conn
    sink.state()
    assert sink._conn is conn and conn is not None
    q(pg_url, "SELECT pg_terminate_backend(%s, 5000)", conn.info.backend_pid)
    with pytest.raises(TransientError):
        sink.state()
    assert sink.state() == SinkState()  # a new connection
    assert sink._conn is not conn


# -- state mode ----------------------------------------------------------------------------------


def intents(rows: list[tuple[str, int | None, int, int]]) -> pa.Table:
    """Upsert intents: (key, value or None for a tombstone, into_time, offset)."""
    n = len(rows)
    return pa.table({
        "k": [r[0] for r in rows], "v": [r[1] for r in rows],
        "_into_time": [r[2] for r in rows], "_diff": [0 if r[1] is None else 1 for r in rows],
        "_src_part": pa.array([0] * n, pa.int32()), "_src_offset": [r[3] for r in rows],
        "_src_seq": pa.array([0] * n, pa.int32()), "_src_ts": pa.array([None] * n, pa.int64()),
        "_error": pa.array([None] * n, pa.string()), "_raw_key": pa.array([None] * n, pa.binary()),
        "_raw_value": pa.array([None] * n, pa.binary()),
    }, schema=SCHEMA)


def shuffled(table: pa.Table, seed: int) -> pa.Table:
    order = list(range(table.num_rows))
    random.Random(seed).shuffle(order)
    return table.take(pa.array(order))


def state_rows(pg_url: str, table: str = "orders") -> dict[str, tuple[Any, ...]]:
    return {r[0]: tuple(r[1:]) for r in q(pg_url, f'SELECT k, v, _into_time FROM "{table}"')}


def test_ensure_creates_a_state_table_with_a_primary_key_and_an_errors_table(
    pg_url: str, tmp_path: Path
) -> None:
    s = make(pg_url, tmp_path, mode="state", key=("k",))
    s.ensure(USER)
    assert column_types(pg_url, "public", "orders") == {
        "k": ("text", True), "v": ("bigint", False), "_into_time": ("bigint", True)}
    assert column_types(pg_url, "public", "orders_errors") == META_PG
    assert q(pg_url, "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = "
                     "i.indrelid AND a.attnum = ANY(i.indkey) WHERE i.indisprimary AND "
                     "i.indrelid = 'orders'::regclass") == [("k",)]
    other = make(pg_url, tmp_path, mode="state", key=("v",))
    with pytest.raises(SinkError, match=r"primary key is \['k'\], wanted \['v'\]"):
        other.ensure(USER)


def test_state_mode_applies_a_batch_in_time_order(pg_url: str, tmp_path: Path) -> None:
    s = make(pg_url, tmp_path, mode="state", key=("k",))
    s.ensure(USER)
    up = UpsertState(["k", "v"], ("k",))
    first, pending = up.apply(intents([("a", 1, 10, 0), ("b", 2, 10, 1), ("c", 3, 10, 2)]),
                              SCHEMA)
    up.accept(pending)
    s.commit(s.stager().stage("b1", 0, first), SinkState(), SinkState(11))
    assert state_rows(pg_url) == {"a": (1, 10), "b": (2, 10), "c": (3, 10)}

    # One batch: updates, a delete, a delete then re-insert, an insert then
    # delete, several updates of one key; rows staged in random order.
    second, pending = up.apply(intents([
        ("a", 11, 20, 3), ("a", 12, 21, 4), ("a", 13, 21, 5),  # last wins: 13 at 21
        ("b", None, 20, 6),                                     # deleted
        ("c", None, 20, 7), ("c", 33, 22, 8),                   # deleted, then back
        ("d", 4, 20, 9), ("d", None, 23, 10),                   # inserted, then deleted
        ("e", 5, 24, 11),                                        # new
    ]), SCHEMA)
    up.accept(pending)
    assert sorted(second.column("_diff").to_pylist()) == [-1] * 6 + [1] * 6
    s.commit(s.stager().stage("b2", 0, shuffled(second, 1)), SinkState(11), SinkState(25))
    assert state_rows(pg_url) == {"a": (13, 21), "c": (33, 22), "e": (5, 24)}
    assert {(k,): (k, v) for k, (v, _) in state_rows(pg_url).items()} == up.rows

    # The driver rebuilds its key state from read_updates on open.
    got = s.read_updates()
    assert got.schema == SCHEMA
    assert UpsertState.rebuild(got, ["k", "v"], ("k",)).rows == up.rows
    assert got.column("_diff").to_pylist() == [1, 1, 1]
    assert got.column("_into_time").to_pylist() == [21, 22, 24]


def test_state_mode_retraction_and_insertion_at_one_position(pg_url: str, tmp_path: Path) -> None:
    """An update is a -1 and a +1 with the same position: the +1 must win
    whatever order the rows are staged in."""
    s = make(pg_url, tmp_path, mode="state", key=("k",))
    s.ensure(USER)
    s.commit(s.stager().stage("b1", 0, updates(["a"], 1, offset=0)), SinkState(), SinkState(2))
    old = updates(["a"], 5, diff=-1, offset=0)
    new = updates(["a"], 5, diff=1, offset=0).set_column(1, "v", pa.array([99]))
    for i, rows in enumerate((pa.concat_tables([new, old]), pa.concat_tables([old, new]))):
        s.commit(s.stager().stage(f"u{i}", 0, rows), SinkState(2 + i * 10),
                 SinkState(12 + i * 10))
        assert state_rows(pg_url) == {"a": (99, 5)}


def test_state_mode_error_rows_go_to_the_errors_table(pg_url: str, tmp_path: Path) -> None:
    s = make(pg_url, tmp_path, mode="state", key=("k",))
    s.ensure(USER)
    bad = updates(["x", "y"], 7, offset=5, error="bad json").set_column(
        0, "k", pa.array([None, None], pa.string()))
    rows = pa.concat_tables([updates(["a"], 7), bad])
    staged = s.stager().stage("b", 0, rows)
    assert staged[0]["errors"] == 2
    s.commit(staged, SinkState(), SinkState(8))
    assert state_rows(pg_url) == {"a": (0, 7)}
    assert q(pg_url, 'SELECT _error, _src_offset, _raw_value FROM "orders_errors" '
                     "ORDER BY _src_offset") == [("bad json", 5, b"raw"), ("bad json", 6, b"raw")]
    got = s.read_updates()
    assert got.column("_error").to_pylist() == [None, "bad json", "bad json"]
    assert s.read_updates(6).column("_error").to_pylist() == [None]  # as_of filters errors


def rows_at(rows: list[tuple[str, int, int, int, int, int]]) -> pa.Table:
    """Updates of :data:`SCHEMA`: (k, v, into_time, diff, partition, offset)."""
    return pa.concat_tables([
        updates([k], t, diff=d, part=p, offset=o).set_column(1, "v", pa.array([v]))
        for k, v, t, d, p, o in rows])


def test_state_mode_applies_the_sum_of_an_intotime_not_its_last_update(
    pg_url: str, tmp_path: Path
) -> None:
    """Issue: a state table keyed by a column that moves between upstream
    keys (an email passing from one id to another within one IntoTime, the
    two ids in different Kafka partitions) lost the moved value: the last
    update of the key in partition-and-offset order won, and that was the
    retraction. The updates of an IntoTime are a multiset: their sum per key
    is what the table holds. (A sink built by hand: the configuration now
    refuses such a key, see tests/sinks/test_postgres_pipeline.py.)"""
    s = make(pg_url, tmp_path, mode="state", key=("k",))  # k: an email, v: the id holding it
    s.ensure(USER)
    s.commit(s.stager().stage("b1", 0, rows_at([("x@", 1, 10, 1, 1, 0), ("y@", 2, 10, 1, 0, 0)])),
             SinkState(), SinkState(11))
    # id 1 (partition 1) releases x@ for z@; id 2 (partition 0) takes x@, releasing y@
    moved = rows_at([
        ("x@", 1, 20, -1, 1, 1), ("z@", 1, 20, 1, 1, 1),
        ("y@", 2, 20, -1, 0, 1), ("x@", 2, 20, 1, 0, 1),
    ])
    s.commit(s.stager().stage("b2", 0, moved), SinkState(11), SinkState(21))
    assert state_rows(pg_url) == {"x@": (2, 20), "z@": (1, 20)}

    # A swap of two keys in one transaction (a deferrable primary key, whose
    # rows hold each other's key for a moment): +(b, 1) comes before -(b, 2).
    swap = rows_at([
        ("x@", 2, 30, -1, 0, 5), ("z@", 2, 30, 1, 0, 5),
        ("z@", 1, 30, -1, 0, 6), ("x@", 1, 30, 1, 0, 6),
    ])
    s.commit(s.stager().stage("b3", 0, shuffled(swap, 3)), SinkState(21), SinkState(31))
    assert state_rows(pg_url) == {"x@": (1, 30), "z@": (2, 30)}


def test_state_mode_applies_the_intotimes_of_a_commit_in_time_order(
    pg_url: str, tmp_path: Path
) -> None:
    """One commit may hold several IntoTimes: each is consolidated on its
    own and applied on what the one before it left, whatever the staging
    order; a key takes its last IntoTime's row, and ``_into_time`` says when
    it last changed (an update that cancels out changes nothing)."""
    s = make(pg_url, tmp_path, mode="state", key=("k",))
    s.ensure(USER)
    s.commit(s.stager().stage("b1", 0, rows_at([("a", 1, 10, 1, 0, 0), ("b", 2, 10, 1, 0, 1),
                                                ("c", 3, 10, 1, 0, 2)])),
             SinkState(), SinkState(11))
    batch = rows_at([
        ("a", 1, 20, -1, 1, 9), ("a", 5, 20, 1, 1, 9),   # a: 1 -> 5 -> gone -> 7
        ("a", 5, 21, -1, 0, 3),
        ("a", 7, 22, 1, 0, 1),
        ("b", 2, 20, -1, 0, 5), ("b", 2, 20, 1, 0, 6),   # b: the same row again: unchanged
        ("c", 3, 21, -1, 0, 7),                          # c: gone at 21
        ("d", 4, 20, 1, 1, 1), ("d", 4, 21, -1, 1, 0),   # d: in at 20, out at 21
        ("e", 6, 21, 1, 0, 0), ("e", 6, 21, -1, 1, 0),   # e: in and out within 21
        ("e", 8, 21, 1, 0, 9),                           #    and in again
    ])
    s.commit(s.stager().stage("b2", 0, shuffled(batch, 7)), SinkState(11), SinkState(23))
    assert state_rows(pg_url) == {"a": (7, 22), "b": (2, 10), "e": (8, 21)}


def test_state_mode_a_retraction_removes_the_keys_row_whatever_it_holds(
    pg_url: str, tmp_path: Path
) -> None:
    """A retraction removes the key's row; its other columns are not compared
    with the stored ones (a diff log's before image lacks a column dropped
    upstream since the row was written)."""
    s = make(pg_url, tmp_path, mode="state", key=("k",))
    s.ensure(USER)
    s.commit(s.stager().stage("b1", 0, rows_at([("a", 1, 10, 1, 0, 0)])), SinkState(),
             SinkState(11))
    s.commit(s.stager().stage("b2", 0, rows_at([("a", 99, 20, -1, 0, 1),
                                                ("a", 2, 20, 1, 0, 1)])),
             SinkState(11), SinkState(21))
    assert state_rows(pg_url) == {"a": (2, 20)}


@pytest.mark.parametrize(("rows", "words"), [
    # an insertion for a key that has a row, nothing retracting it
    ([("a", 2, 20, 1, 0, 1)], ["key (k='a')", "IntoTime 20", "2 live rows", "it had a row",
                               "+1 at partition 0 offset 1 seq 0"]),
    # two rows for one key within one IntoTime
    ([("n", 1, 20, 1, 0, 1), ("n", 2, 20, 1, 1, 1)], ["key (k='n')", "2 live rows",
                                                      "insert 2 distinct rows"]),
    # one row twice
    ([("n", 1, 20, 1, 0, 1), ("n", 1, 20, 1, 1, 1)], ["key (k='n')", "2 live rows",
                                                      "one of them 2 times"]),
    # a retraction of a key the table does not have
    ([("gone", 1, 20, -1, 0, 1)], ["key (k='gone')", "negative count", "it had no row"]),
    # a later IntoTime of the commit inserts again what an earlier one left
    ([("n", 1, 20, 1, 0, 1), ("n", 2, 21, 1, 0, 2)], ["key (k='n')", "IntoTime 21",
                                                      "2 live rows"]),
])
def test_state_mode_refuses_updates_that_leave_a_key_with_two_rows_or_less_than_none(
    pg_url: str, tmp_path: Path, rows: list[tuple[str, int, int, int, int, int]],
    words: list[str],
) -> None:
    """A table cannot hold two rows for a key, or less than none: updates that
    say so are a definite error naming the key, the IntoTime and the
    positions, and nothing of the commit is written (no row dropped or
    overwritten in silence). The output stays at its state until the cause
    is fixed; the same commit without those updates goes through."""
    s = make(pg_url, tmp_path, mode="state", key=("k",))
    s.ensure(USER)
    s.commit(s.stager().stage("b1", 0, rows_at([("a", 1, 10, 1, 0, 0)])), SinkState(),
             SinkState(11))
    good = rows_at([("b", 3, 20, 1, 0, 9)])
    bad = pa.concat_tables([good, rows_at(rows),
                            updates(["e"], 20, offset=7, error="bad json")])
    with pytest.raises(SinkError) as info:
        s.commit(s.stager().stage("b2", 0, bad), SinkState(11), SinkState(22))
    msg = str(info.value)
    assert all(w in msg for w in words), msg
    assert NAME in msg and "nothing was written" in msg
    assert info.value.hint and "mode: log" in info.value.hint
    assert s.state() == SinkState(11)
    assert state_rows(pg_url) == {"a": (1, 10)}
    assert count(pg_url, "orders_errors") == 0
    s.commit(s.stager().stage("b3", 0, good), SinkState(11), SinkState(22))
    assert state_rows(pg_url) == {"a": (1, 10), "b": (3, 20)}


def test_state_mode_names_how_many_keys_break_the_rule(pg_url: str, tmp_path: Path) -> None:
    s = make(pg_url, tmp_path, mode="state", key=("k",))
    s.ensure(USER)
    bad = rows_at([(f"k{i}", 1, 20 + i % 2, -1, 0, i) for i in range(9)])
    with pytest.raises(SinkError, match=r"key \(k='k0'\).* \(8 more keys or IntoTimes do too\)"):
        s.commit(s.stager().stage("b", 0, bad), SinkState(), SinkState(30))


def test_state_mode_consolidates_json_columns_of_an_existing_table(
    pg_url: str, tmp_path: Path
) -> None:
    """A table made by hand with ``json`` (no equality operator) where reclock
    would make ``jsonb``: its values are consolidated as jsonb."""
    user = pa.schema([("k", pa.string()), ("doc", pa.struct([("a", pa.int64())]))])
    q(pg_url, 'CREATE TABLE "docs" (k text PRIMARY KEY, doc json, _into_time bigint NOT NULL)')
    s = make(pg_url, tmp_path, table="docs", mode="state", key=("k",))
    s.ensure(user)

    def docs(rows: list[tuple[str, int, int, int]]) -> pa.Table:
        """(k, doc.a, into_time, diff) at consecutive offsets."""
        base = rows_at([(k, 0, t, d, 0, i) for i, (k, _, t, d) in enumerate(rows)])
        return base.set_column(1, user.field("doc"), pa.array(
            [{"a": a} for _, a, _, _ in rows], user.field("doc").type))

    s.commit(s.stager().stage("b1", 0, docs([("x", 1, 10, 1), ("y", 1, 10, 1),
                                             ("y", 1, 10, -1)])), SinkState(), SinkState(11))
    assert q(pg_url, "SELECT k, doc::jsonb FROM docs") == [("x", {"a": 1})]
    s.commit(s.stager().stage("b2", 0, docs([("x", 1, 20, -1), ("x", 2, 20, 1)])),
             SinkState(11), SinkState(21))
    assert q(pg_url, "SELECT k, doc::jsonb, _into_time FROM docs") == [("x", {"a": 2}, 20)]


def test_a_tombstone_passes_the_screen_of_a_key_containing_the_envelopes(
    pg_url: str, tmp_path: Path
) -> None:
    """Issue: a state table keyed by ``[k, v]`` (containing the upsert key
    ``k``) refused every tombstone as an error row, since its ``v`` is null:
    the key state never saw the delete, and the table kept the row. A
    tombstone holds the envelope's key alone; only a wholly null key is
    refused, and a value with a null key column still is."""
    s = make(pg_url, tmp_path, mode="state", key=("k", "v"))
    s.ensure(USER)
    screened = s.stager().screen(intents([("a", None, 10, 0), ("b", 1, 10, 1)]).set_column(
        1, "v", pa.array([None, None], pa.int64())))
    assert screened.column("_error").to_pylist() == [
        None, "key column 'v' is null: a state table keeps one row per key, and a null key "
              "names none"]
    nokey = s.stager().screen(intents([("x", None, 10, 0)]).set_column(
        0, "k", pa.array([None], pa.string())))
    assert nokey.column("_error").to_pylist() == [
        "key column 'k' is null: a state table keeps one row per key, and a null key names none"]


def test_state_mode_staging_checks(pg_url: str, tmp_path: Path) -> None:
    s = make(pg_url, tmp_path, mode="state", key=("k",))
    s.ensure(USER)
    with pytest.raises(SinkError, match="_diff other than -1 or 1"):
        s.stager().stage("b", 0, updates(["a"], 1, diff=2))
    nokey = updates(["a"], 1).set_column(0, "k", pa.array([None], pa.string()))
    # a null key is a row the table cannot hold: an error row, not a refused batch
    assert [d["errors"] for d in s.stager().stage("b", 0, nokey)] == [1]


# -- identifiers ---------------------------------------------------------------------------------

HOSTILE = pa.schema([("my col", pa.string()), ('qu"ote', pa.int64()), ("Ünï cödé", pa.bool_()),
                     ("select", pa.float64()), ("x'); DROP TABLE t; --", pa.string())])


@pytest.mark.parametrize("mode", ["log", "state"])
def test_hostile_identifiers(pg_url: str, tmp_path: Path, mode: str) -> None:
    schema, table = 'Sch"éma x', 'we"ird tab lé'
    s = PostgresSink('out "q" ü', dsn=pg_url, schema=schema, table=table, mode=mode,  # type: ignore[arg-type]
                     key=('qu"ote',) if mode == "state" else (), staging_dir=tmp_path)
    s.ensure(HOSTILE)
    s.ensure(HOSTILE)
    cols = column_types(pg_url, schema, table)
    assert list(cols)[:5] == HOSTILE.names
    base = updates(["a", "b"], 3).drop_columns(["k", "v"])
    user = [pa.array(["x", "y"]), pa.array([1, 2]), pa.array([True, None]),
            pa.array([0.5, None]), pa.array(["'; --", '"'])]
    rows = pa.Table.from_arrays([*user, *base.columns], schema=output_schema(HOSTILE))
    s.commit(s.stager().stage("b", 0, rows), SinkState(), SinkState(4, "p"))
    assert s.state() == SinkState(4, "p")
    got = s.read_updates()
    for name in HOSTILE.names:
        assert got.column(name).to_pylist() == rows.column(name).to_pylist()
    fresh = PostgresSink('out "q" ü', dsn=pg_url, schema=schema, table=table, mode=mode,  # type: ignore[arg-type]
                         key=('qu"ote',) if mode == "state" else (), staging_dir=tmp_path)
    assert fresh.read_updates().column("Ünï cödé").to_pylist() == [True, None]
    if mode == "state":
        assert column_types(pg_url, schema, table + "_errors") == META_PG
    assert staging_name_is_safe(s)


def staging_name_is_safe(s: PostgresSink) -> bool:
    name = s.staging_root.name
    return '"' not in name and " " not in name and name.startswith("out")


# -- staging -------------------------------------------------------------------------------------


def test_staging_checks_the_rows(sink: PostgresSink) -> None:
    stager = sink.stager()
    with pytest.raises(SinkError, match="surprise"):
        stager.stage("b", 0, updates(["a"], 1).append_column("surprise", pa.array([1])))
    with pytest.raises(ValueError, match="batch id"):
        stager.stage("../escape", 0, updates(["a"], 1))
    assert stager.stage("b", 0, updates([], 1)) == []
    assert not sink.staging_root.exists() or not list(sink.staging_root.iterdir())
    # a NUL is a row text cannot hold: an error row, not a refused batch
    assert [d["errors"] for d in stager.stage("b", 0, updates(["a\x00b"], 1))] == [1]


def test_restaging_replaces_the_file(sink: PostgresSink) -> None:
    stager = sink.stager()
    first = stager.stage("b1", 0, updates(["a", "b"], 1))
    second = stager.stage("b1", 0, updates(["c"], 1))
    assert first[0]["path"] == second[0]["path"]
    assert sorted(p.name for p in sink.staging_root.iterdir()) == ["b1-00000.arrow"]
    sink.commit(second, SinkState(), SinkState(2))
    assert keys(sink.read_updates()) == ["c"]


def test_stager_pickles_and_needs_ensure(sink: PostgresSink, pg_url: str, tmp_path: Path) -> None:
    stager = pickle.loads(pickle.dumps(sink.stager()))
    assert isinstance(stager, PostgresStager)
    sink.commit(stager.stage("p", 0, updates(["a"], 1)), SinkState(), SinkState(2))
    assert keys(sink.read_updates()) == ["a"]
    with pytest.raises(SinkError, match="ensure"):
        make(pg_url, tmp_path).stager()


def test_commit_before_ensure_is_a_sink_error(pg_url: str, tmp_path: Path) -> None:
    with pytest.raises(SinkError, match="ensure"):
        make(pg_url, tmp_path).commit([], SinkState(), SinkState(1))


def test_vacuum_orphans(sink: PostgresSink) -> None:
    staged = sink.stager().stage("crashed", 0, updates(["a"], 1))
    assert sink.vacuum_orphans(grace_seconds=3600) == []
    sink._clock = ManualClock(int((time.time() + 7200) * 1000))
    assert sink.vacuum_orphans(grace_seconds=3600) == [staged[0]["path"]]


# -- throughput ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["log", "state"])
def test_copy_throughput(pg_url: str, tmp_path: Path, mode: str,
                         capsys: pytest.CaptureFixture[str]) -> None:
    """Rows per second for 200k rows (printed, not asserted)."""
    n = 200_000
    s = make(pg_url, tmp_path, mode=mode, key=("k",) if mode == "state" else ())
    s.ensure(USER)
    rows = updates([f"key-{i}" for i in range(n)], 5)
    t0 = time.perf_counter()
    staged = s.stager().stage("bench", 0, rows)
    t1 = time.perf_counter()
    s.commit(staged, SinkState(), SinkState(6))
    t2 = time.perf_counter()
    assert count(pg_url) == n
    with capsys.disabled():
        print(f"\n[postgres sink, {mode}] {n} rows: stage {t1 - t0:.2f} s "
              f"({n / (t1 - t0):,.0f} rows/s), commit {t2 - t1:.2f} s "
              f"({n / (t2 - t1):,.0f} rows/s)")


def test_the_state_belongs_to_the_table_not_the_output_name(pg_url: str, tmp_path: Path
                                                            ) -> None:
    """Two pipelines whose outputs share a name, writing two tables of one
    schema, never see each other's state; two writers of one table fence."""
    dev, prod = make(pg_url, tmp_path, table="orders_dev"), make(pg_url, tmp_path / "p",
                                                                 table="orders_prod")
    for s in (dev, prod):
        s.ensure(USER)
    dev.commit(dev.stager().stage("d1", 0, updates(["a", "b"], 10)), SinkState(), SinkState(20))
    assert prod.state() == SinkState()  # prod owes everything still
    prod.commit(prod.stager().stage("p1", 0, updates(["x"], 10)), SinkState(), SinkState(30))
    assert (dev.state(), prod.state()) == (SinkState(20), SinkState(30))
    assert q(pg_url, "SELECT count(*) FROM orders_dev") == [(2,)]
    assert q(pg_url, "SELECT count(*) FROM orders_prod") == [(1,)]
    # another output name writing orders_dev meets orders_dev's state
    other = make(pg_url, tmp_path / "o", name="orders.copy", table="orders_dev")
    other.ensure(USER)
    assert other.state() == SinkState(20)
    with pytest.raises(SinkFenced):
        other.commit([], SinkState(), SinkState(40))
    for s in (dev, prod, other):
        s.close()


def test_an_upper_table_of_the_earlier_layout_is_named(pg_url: str, tmp_path: Path) -> None:
    q(pg_url, "CREATE TABLE reclock_uppers (output text PRIMARY KEY, upper bigint, "
              "progress text, updated_at timestamptz NOT NULL DEFAULT now(), commit_id text)")
    with pytest.raises(SinkError, match="earlier layout") as err:
        make(pg_url, tmp_path).ensure(USER)
    assert err.value.hint and "rename or drop" in err.value.hint


@pytest.mark.parametrize("mode", ["log", "state"])
def test_rows_postgres_cannot_store_become_error_rows(pg_url: str, tmp_path: Path,
                                                      mode: str) -> None:
    """Bad input is data: a NUL character (which text cannot hold) and, in a
    state table, a null key make error rows with the reason, the position and
    what the row held; the rest of the batch lands (before: the whole batch
    was refused, for ever)."""
    s = make(pg_url, tmp_path, mode=mode, key=("k",) if mode == "state" else ())
    s.ensure(USER)
    rows = updates(["a", "b\x00c", "d"], 5)
    if mode == "state":
        rows = pa.concat_tables([rows, updates([None], 5, offset=3)])  # type: ignore[list-item]
    staged = s.stager().stage("b1", 0, rows)
    assert sum(d["errors"] for d in staged) == (2 if mode == "state" else 1)
    s.commit(staged, SinkState(), SinkState(6))
    got = s.read_updates()
    good = got.filter(pc.is_null(got.column("_error")))
    assert sorted(good.column("k").to_pylist()) == ["a", "d"]
    errs = {r["_src_offset"]: r for r in got.filter(
        pc.invert(pc.is_null(got.column("_error")))).to_pylist()}
    assert "NUL character" in errs[1]["_error"] and b'"k": "b\\u0000c"' in errs[1]["_raw_value"]
    if mode == "state":
        assert "key column 'k' is null" in errs[3]["_error"]
        assert state_rows(pg_url) == {"a": (0, 5), "d": (2, 5)}


def test_an_upper_table_of_the_layout_before_owners_gains_them_and_is_adopted(
        pg_url: str, tmp_path: Path) -> None:
    """``reclock_uppers`` written before the owner columns existed: a reader
    still reads its state; ``ensure`` adds the columns; the first pipeline
    that commits adopts the output, and another is refused from then on."""
    from reclock.contracts.sink import OutputOwned, Owner

    q(pg_url, "CREATE TABLE reclock_uppers (target text PRIMARY KEY, output text, "
              "upper bigint, progress text, updated_at timestamptz NOT NULL DEFAULT now(), "
              "commit_id text)")
    q(pg_url, "INSERT INTO reclock_uppers (target, output, upper, progress) "
              "VALUES ('orders', %s, 100, 'p100')", NAME)
    assert make(pg_url, tmp_path).state() == SinkState(100, "p100")  # before ensure()
    mine = make(pg_url, tmp_path, owner=Owner("pipe-a", "/a"))
    mine.ensure(USER)
    assert "pipeline" in column_types(pg_url, "public", "reclock_uppers")
    assert mine.state() == SinkState(100, "p100")
    mine.commit(mine.stager().stage("b1", 0, updates(["a"], 150)), SinkState(100, "p100"),
                SinkState(200, "p200"))
    assert q(pg_url, "SELECT pipeline, pipeline_state FROM reclock_uppers") == [("pipe-a", "/a")]
    other = make(pg_url, tmp_path, owner=Owner("pipe-b", "/b"))
    other.ensure(USER)
    with pytest.raises(OutputOwned, match="'pipe-a' \\(state in /a\\)"):
        other.state()
    assert count(pg_url) == 1
