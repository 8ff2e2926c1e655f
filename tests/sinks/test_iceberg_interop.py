"""Spark reads reclock's Iceberg tables: a log table and a state table of
every common column type, written by the Iceberg sink into a SQLite SQL
catalog, are read by a second Spark (the Spark peer of tests/setup.sh, with
``iceberg-spark-runtime``) through Iceberg's JDBC catalog on the same
database, in a JVM of its own (``tests/spark_peer.py``). Spark
gets the right types, the rows pyiceberg reads (the log's every update; the
state table's current row per key, none of the deleted keys), and the
output's upper from the snapshot summary."""

from __future__ import annotations

import datetime as dt
import decimal
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from reclock.contracts.sink import SinkState
from reclock.sinks.iceberg import CatalogConfig, IcebergSink
from tests.peers import spark_reads
from tests.sinks.test_delta_interop import rows_of, spark_type

pytestmark = pytest.mark.integration

USER = pa.schema([("k", pa.string()), ("n", pa.int64()), ("amt", pa.decimal128(10, 2)),
                  ("at", pa.timestamp("us", tz="UTC")), ("day", pa.date32()),
                  ("raw", pa.binary()), ("tags", pa.list_(pa.string())), ("x", pa.float64()),
                  ("ok", pa.bool_())])


def _updates(rows: list[dict[str, Any]], into: int, diff: int, offset: int) -> pa.Table:
    from tests.sinks.rows import updates

    meta = updates(["_"] * len(rows), into, diff=diff, offset=offset).drop_columns(["k", "v"])
    t = pa.Table.from_pylist(rows, schema=USER)
    for f in meta.schema:
        t = t.append_column(f, meta.column(f.name))
    return t


def _row(k: str, n: int) -> dict[str, Any]:
    return {"k": k, "n": n, "amt": decimal.Decimal(f"{n}.25"),
            "at": dt.datetime(2024, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=n),
            "day": dt.date(1900, 1, 1) + dt.timedelta(days=n), "raw": bytes([n % 256, 0]),
            "tags": ["é\"\\", None] if n % 2 else [], "x": [1.5, -0.0, float("nan")][n % 3],
            "ok": n % 2 == 0}


def test_spark_reads_iceberg_log_and_state_tables(tmp_path: Path) -> None:
    cat = CatalogConfig(type="sql", uri=f"sqlite:///{tmp_path}/catalog.db",
                        warehouse=str(tmp_path / "wh")).access(None)
    log = IcebergSink("shop.log", cat, "lake.log")
    state = IcebergSink("shop.state", cat, "lake.state", mode="state", key=("k",))
    first = [_row(f"k{i}", i) for i in range(6)]
    for s in (log, state):
        s.ensure(USER)
        s.commit(s.stager().stage("b1", 0, _updates(first, 10, 1, 0)), SinkState(),
                 SinkState(11, '"p1"'))
        # k1 updated, k2 deleted: a retraction of the old row, an insertion of the new
        change = pa.concat_tables([_updates([first[1], first[2]], 20, -1, 10),
                                   _updates([_row("k1", 101)], 20, 1, 12)])
        s.commit(s.stager().stage("b2", 0, change), SinkState(11, '"p1"'),
                 SinkState(21, '"p2"'))
    # The state table's current snapshot applies the update and the delete
    # by a position-delete file (merge-on-read): Spark must apply it too.
    summary = state._load().current_snapshot().summary
    assert summary["total-delete-files"] == "1" and summary["total-position-deletes"] == "2"
    upper = ("sql:SELECT summary['reclock.upper'] AS u FROM reclock.lake.{}.snapshots "
             "ORDER BY committed_at DESC LIMIT 1")
    got = spark_reads([f"sql:SELECT * FROM reclock.lake.{t}" for t in ("log", "state")]
                      + [upper.format(t) for t in ("log", "state")],
                      (f"reclock=jdbc:sqlite:{tmp_path}/catalog.db,file://{tmp_path}/wh",))
    for name, sink in (("log", log), ("state", state)):
        seen = got[f"sql:SELECT * FROM reclock.lake.{name}"]
        assert got[upper.format(name)]["rows"] == [["21"]]
        mine = sink._load().scan().to_arrow()  # pyiceberg's read
        for f in USER:
            assert seen["types"][f.name] == spark_type(f.type), (name, f.name)
        cols = list(seen["types"])
        if name == "state":  # SELECT * is the user's columns and _into_time
            assert cols == [*USER.names, "_into_time"]
            assert sorted(mine.column("k").to_pylist()) == ["k0", "k1", "k3", "k4", "k5"]
        assert sorted(seen["rows"], key=json.dumps) == rows_of(mine.select(cols))


def test_spark_reads_an_iceberg_state_table_in_a_postgres_catalog_on_s3(
        tmp_path: Path, s3: Any, pg_url: str) -> None:
    """A state table in a PostgreSQL SQL catalog, its warehouse on S3
    (moto's server): Spark reads it through Iceberg's JDBC catalog on the same
    database and Iceberg's own S3FileIO, and gets the current rows (the
    position deletes applied) that pyiceberg reads, and the upper."""
    from reclock.sinks._store import S3Access

    env, bucket = s3.env(), s3.bucket()
    storage = S3Access.resolve(env=env)
    cat = CatalogConfig(type="sql", uri=pg_url.replace("postgresql://", "postgresql+psycopg://"),
                        warehouse=f"s3://{bucket}/wh").access(storage)
    state = IcebergSink("shop.state", cat, "lake.state", storage=storage, mode="state",
                        key=("k",))
    state.ensure(USER)
    first = [_row(f"k{i}", i) for i in range(6)]
    state.commit(state.stager().stage("b1", 0, _updates(first, 10, 1, 0)), SinkState(),
                 SinkState(11, '"p1"'))
    change = pa.concat_tables([_updates([first[1], first[2]], 20, -1, 10),
                               _updates([_row("k1", 101)], 20, 1, 12)])
    state.commit(state.stager().stage("b2", 0, change), SinkState(11, '"p1"'),
                 SinkState(21, '"p2"'))
    user, rest = pg_url[len("postgresql://"):].split("@", 1)
    name, _, password = user.partition(":")
    jdbc = f"jdbc:postgresql://{rest}?user={name}" + (f"&password={password}" if password else "")
    query = "sql:SELECT * FROM reclock.lake.state"
    upper = ("sql:SELECT summary['reclock.upper'] AS u FROM reclock.lake.state.snapshots "
             "ORDER BY committed_at DESC LIMIT 1")
    got = spark_reads([query, upper], (f"reclock={jdbc},s3://{bucket}/wh",), s3=env)
    assert got[upper]["rows"] == [["21"]]
    seen = got[query]
    cols = list(seen["types"])
    assert cols == [*USER.names, "_into_time"]
    mine = state._load().scan().to_arrow()
    assert sorted(mine.column("k").to_pylist()) == ["k0", "k1", "k3", "k4", "k5"]
    assert sorted(seen["rows"], key=json.dumps) == rows_of(mine.select(cols))
