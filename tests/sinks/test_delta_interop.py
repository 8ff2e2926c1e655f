"""Delta interoperability: Spark (with delta-spark) reads reclock's outputs as
deltalake does.

reclock writes its Delta tables with deltalake (delta-rs). The claim "any
Delta reader can read them" is checked with the reader most users run: Spark,
in a JVM of its own (``tests/spark_peer.py`` under the Spark that
``tests/setup.sh`` installs beside reclock's, because delta-spark is released
for Spark 4.1, not for the PySpark reclock runs on). Both readers must return
the same column types and the same rows, every type the sinks store included
(decimals, timestamps with and without a zone, dates, binary, arrays, JSON
documents, infinities, NaN, error rows), and Spark's Delta log must see the
application transaction that carries each output's upper.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
from confluent_kafka import Producer
from deltalake import DeltaTable

from reclock.config import load_config
from tests.peers import spark_reads
from tests.running import durable, running, wait_for
from tests.sources.cdc import ALL_TYPES, ROW, flushed_lsn, resumed_past

#: Kafka records: every JSON column type, and records that cannot be decoded.
GOOD = [
    {"n": 1, "amt": "12.34", "at": "2024-01-01T00:00:00Z", "day": "2024-03-01",
     "raw": "AP8Q", "doc": {"a": [1, {"b": None}], "s": "é\"\\"}, "ok": True, "x": 1.5},
    {"n": 2, "amt": "-0.01", "at": "1969-12-31T23:59:59.999999+00:00", "day": "1900-01-01",
     "raw": "", "doc": [], "ok": False, "x": -0.0},
    {"n": 3},
]
BAD = [b"not json", b'{"n": "three"}', b'{"n": 4, "amt": "12.345"}']
SCHEMA = ("{n: int64, amt: \"decimal(10,2)\", at: timestamp, day: date, raw: binary, doc: json, "
          "ok: bool, x: float64}")


def spark_type(t: pa.DataType) -> str:
    """The Spark type a column of Arrow type ``t`` must read as."""
    simple = {pa.bool_(): "boolean", pa.int8(): "tinyint", pa.int16(): "smallint",
              pa.int32(): "int", pa.int64(): "bigint", pa.float32(): "float",
              pa.float64(): "double", pa.date32(): "date"}
    if t in simple:
        return simple[t]
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return "binary"
    if pa.types.is_decimal(t):
        return f"decimal({t.precision},{t.scale})"
    if pa.types.is_timestamp(t):
        return "timestamp" if t.tz else "timestamp_ntz"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t):
        return f"array<{spark_type(t.value_type)}>"
    raise AssertionError(f"no Spark type expected for {t}")


def plain(col: pa.ChunkedArray) -> list[Any]:
    """Values as the Spark reader prints them (see its docstring)."""
    t = col.type
    if pa.types.is_timestamp(t):
        return col.cast(pa.int64()).to_pylist()  # type: ignore[no-any-return]
    if pa.types.is_date32(t):
        return col.cast(pa.int32()).to_pylist()  # type: ignore[no-any-return]
    values = col.to_pylist()
    if pa.types.is_decimal(t):
        return [None if v is None else str(v) for v in values]
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return [None if v is None else v.hex().upper() for v in values]
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return [None if v is None else json.dumps(v, separators=(",", ":"), ensure_ascii=False)
                for v in values]
    return [repr(v) if isinstance(v, float) else v for v in values]


def rows_of(table: pa.Table) -> list[list[Any]]:
    columns = [plain(table.column(i)) for i in range(table.num_columns)]
    return sorted((list(r) for r in zip(*columns, strict=True)), key=json.dumps)


def test_spark_and_deltalake_read_reclocks_outputs_alike(
        tmp_path: Path, spark: Any, cdc_url: str, kafka: Any) -> None:
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute(ALL_TYPES)
        c.execute("insert into kinds values " + ROW % 1)
        c.execute("insert into kinds (id) values (2)")  # all nulls
        c.execute("insert into kinds (id, ts, d, f4) values (3, 'infinity', '-infinity', "
                  "'-Infinity')")
    topic = f"interop-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 2)
    producer = Producer({"bootstrap.servers": kafka.bootstrap})
    for i, value in enumerate([json.dumps(v).encode() for v in GOOD] + BAD):
        producer.produce(topic, value, partition=i % 2)
    assert producer.flush(30) == 0
    path = tmp_path / "p.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
sources:
  - name: bank
    postgres: {{dsn: "{cdc_url}", tables: [kinds], slot: reclock_interop}}
    outputs:
      - {{name: kinds, sink: file}}
  - name: events
    kafka: {{bootstrap_servers: "{kafka.bootstrap}", topic: {topic}, timeout: 5s}}
    outputs:
      - name: events
        format: {{type: json, schema: {SCHEMA}}}
        sink: file
""")
    cfg = load_config(path)
    records = len(GOOD) + len(BAD)
    with running(cfg, spark) as runners:
        by_name = {r.name: r for r in runners}
        assert set(by_name) == {"bank", "events"}
        target = flushed_lsn(cdc_url)
        wait_for(resumed_past([by_name["bank"]], target), 90, "the snapshot")
        wait_for(lambda: sum(durable(by_name["events"]).values()) >= records, 90,
                 "the Kafka records")
    paths = [tmp_path / "state" / "outputs" / "bank" / "kinds",
             tmp_path / "state" / "outputs" / "events" / "events"]
    seen = spark_reads([str(p) for p in paths])
    assert [len(seen[str(p)]["rows"]) for p in paths] == [3, records]
    for p in paths:
        dt = DeltaTable(str(p))
        table = dt.to_pyarrow_table()
        got = seen[str(p)]
        assert got["types"] == {f.name: spark_type(f.type) for f in table.schema}, p.name
        assert sorted(got["rows"], key=json.dumps) == rows_of(table), p.name
        app = next(iter(got["txns"]))
        assert app.startswith("reclock:")
        assert got["txns"] == {app: dt.transaction_version(app)}, p.name
        assert got["version"] == dt.version()
    events_table = DeltaTable(str(paths[1])).to_pyarrow_table()
    errors = events_table.filter(pa.compute.invert(pa.compute.is_null(
        events_table.column("_error"))))
    assert errors.num_rows == len(BAD)  # error rows read alike too (compared above)
