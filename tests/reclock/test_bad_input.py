"""Bad input of every kind: malformed configurations, malformed records in
every format, hostile identifiers in the Postgres and file sinks, oversized
records. Each gives a clear error (configurations: file, line, column and
key; records: a row of the output's error collection with the reason and the
raw bytes), and nothing already accepted is lost."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from confluent_kafka import Producer

from reclock.config import ConfigError, load_config, parse_config
from reclock.pipeline import Pipeline
from reclock.registry import make_decoder
from tests.running import running, wait_for
from tests.tally import count

# -- configurations ---------------------------------------------------------------------------

OK_SOURCE = "  - name: s\n    generator: {kind: counter}\n    outputs: [{name: o, sink: file}]\n"

BAD_CONFIGS: list[tuple[str, str]] = [
    ("sources: [", "YAML"),
    ("sources:\n  - name: s\n\tgenerator: {}\n", "YAML"),
    ("", "sources"),
    ("sources: []\n", "sources"),
    ("sources:\n" + OK_SOURCE + OK_SOURCE, "duplicate"),
    ("sourcez:\n" + OK_SOURCE, "unknown key"),
    ("timestamp_interval: soon\nsources:\n" + OK_SOURCE, "timestamp_interval"),
    ("timestamp_interval: -5\nsources:\n" + OK_SOURCE, "timestamp_interval"),
    ("sources:\n  - name: 9lives\n    generator: {kind: counter}\n"
     "    outputs: [{name: o, sink: file}]\n", "a letter"),
    ("sources:\n  - name: s\n    outputs: [{name: o, sink: file}]\n", "missing connector"),
    ("sources:\n  - name: s\n    generator: {kind: counter}\n    kafka: {bootstrap_servers: x,"
     " topic: t}\n    outputs: [{name: o, sink: file}]\n", "only one connector"),
    ("sources:\n  - name: s\n    generator: {kind: teapot}\n"
     "    outputs: [{name: o, sink: file}]\n", "kind"),
    ("sources:\n  - name: s\n    generator: {kind: counter, rate: 0}\n"
     "    outputs: [{name: o, sink: file}]\n", "rate"),
    ("sources:\n  - name: s\n    kafka: {bootstrap_servers: x, topic: \"b'a\\\"d t o p i c\"}\n"
     "    outputs: [{name: o, sink: file}]\n", "Kafka topic name"),
    ("sources:\n  - name: s\n    kafka: {bootstrap_servers: x, topic: t, start: offsets}\n"
     "    outputs: [{name: o, sink: file}]\n", "start_offsets"),
    ("sources:\n  - name: s\n    generator: {kind: counter}\n"
     "    outputs: [{name: o}]\n", "sink"),
    ("sources:\n  - name: s\n    generator: {kind: counter}\n"
     "    outputs: [{name: o, sink: {type: ftp}}]\n", "type"),
    ("sources:\n  - name: s\n    generator: {kind: counter}\n"
     "    outputs: [{name: o, format: {type: csv}, sink: file}]\n", "columns"),
    ("sources:\n  - name: s\n    generator: {kind: counter}\n"
     "    outputs: [{name: o, format: {type: json, schema: {a: int65}}, sink: file}]\n",
     "unknown column type"),
    ("sources:\n  - name: s\n    generator: {kind: counter}\n    outputs: [{name: o, sink: "
     "{type: postgres, dsn: 'postgresql://db/x', table: t, mode: state}}]\n", "key"),
    ("sources:\n  - name: s\n    postgres: {dsn: 'postgresql://db/x'}\n"
     "    outputs: [{name: o, sink: file}]\n", "give tables"),
    ("sources:\n  - name: s\n    postgres: {dsn: 'postgresql://db/x', tables: [t], "
     "slot: 'Drop Table'}\n    outputs: [{name: t, sink: file}]\n", "replication slot name"),
    ("sources:\n  - name: s\n    postgres: {dsn: 'postgresql://db/x', tables: [shop.'Order "
     "Items']}\n    outputs: [{name: o, sink: file}]\n", "cannot name its output"),
    ("sources:\n  - name: s\n    postgres: {dsn: 'postgresql://db/x', tables: [a.orders, "
     "b.orders]}\n    outputs: [{name: orders, sink: file}]\n", "fed by two tables"),
    ("sources:\n  - name: s\n    postgres: {dsn: 'postgresql://db/x', tables: [{table: t, "
     "output: 'no good'}]}\n    outputs: [{name: o, sink: file}]\n", "tables[0].output"),
    ("remap_store: mysql://db\nsources:\n" + OK_SOURCE, "remap_store"),
    ("sources:\n  - name: s\n    generator: {kind: counter}\n    outputs: [{name: o, "
     "sink: {type: postgres, dsn: 'postgresql://u:${NOPE}@db/x', table: t}}]\n", "NOPE"),
]


@pytest.mark.parametrize(("text", "words"), BAD_CONFIGS)
def test_malformed_configurations_are_located(text: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "bad.yaml", env={})
    msg = str(info.value)
    assert words.lower() in msg.lower(), msg
    assert msg.startswith("bad.yaml"), msg  # every problem names the file (and line)
    count("bad input: configurations", inputs_tried=1)


# -- records ----------------------------------------------------------------------------------

AVRO_SCHEMA = {"type": "record", "name": "r", "fields": [
    {"name": "id", "type": "long"}, {"name": "name", "type": "string"}]}

FORMATS: dict[str, tuple[dict[str, Any], list[bytes], list[bytes | None]]] = {
    # format spec, good records, malformed records
    "json": ({"type": "json", "schema": {"id": "int64", "name": "string"}},
             [b'{"id": 1, "name": "a"}', b'{"id": 2}'],
             [b"{", b"[1, 2]", b'{"id": "one"}', b"\xff\xfe", b"", b'{"id": 1e400}',
              b'{"id": 1}{"id": 2}', b"null", None]),
    "text": ({"type": "text"}, [b"hello", "ünïcødé".encode()],
             [b"\xff\xfe", b"\xc3\x28", None]),
    "bytes": ({"type": "bytes"}, [b"\x00\xff", b""], [None]),
    "csv": ({"type": "csv", "columns": ["id", "name"], "types": {"id": "int64"}},
            [b"1,a", b'2,"b, c"'],
            [b"x,a", b"1", b"1,a,extra", b'1,"open', b"\xff,a", None]),
    "avro": ({"type": "avro", "schema": AVRO_SCHEMA}, [],
             [b"", b"\x02", b"\x02\x10abc", b"\xff" * 12, None]),
}


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_malformed_records_become_error_rows(kind: str) -> None:
    spec, good, bad = FORMATS[kind]
    if kind == "avro":
        import io

        import fastavro

        for rec in ({"id": 1, "name": "a"}, {"id": 2, "name": "ü"}):
            buf = io.BytesIO()
            fastavro.schemaless_writer(buf, fastavro.parse_schema(AVRO_SCHEMA), rec)
            good.append(buf.getvalue())
    dec = make_decoder(spec)
    values = pa.array([*good, *bad], pa.binary())
    res = dec.decode(values)
    assert sorted(res.ok.tolist()) == list(range(len(good))), (kind, res.reasons)
    assert sorted(res.errors.tolist()) == list(range(len(good), len(good) + len(bad)))
    assert all(r and len(r) > 5 for r in res.reasons), res.reasons  # a reason for each
    count("bad input: records", formats=1, inputs_tried=len(good) + len(bad))


# -- hostile identifiers and oversized records, through a pipeline ----------------------------

HOSTILE_SCHEMA = 'spa ce "schema"'
HOSTILE_TABLE = 'we"ird tåble; DROP TABLE x; --'


def test_hostile_identifiers_and_oversized_records(tmp_path: Path, spark: Any, pg_url: str,
                                                   kafka: Any) -> None:
    topic = "bad-input.oversized_1"
    kafka.create_topic(topic, 2)
    big_ok = json.dumps({"id": 1, "name": "x" * 900_000}).encode()
    big_bad = b'{"id": "not a number", "name": "' + b"y" * 900_000 + b'"}'
    p = Producer({"bootstrap.servers": kafka.bootstrap, "message.max.bytes": 2_000_000})
    for i, v in enumerate([big_ok, big_bad, b'{"id": 3, "name": "small"}']):
        p.produce(topic, key=str(i).encode(), value=v, partition=0)
    assert p.flush(30) == 0
    out_dir = tmp_path / "ü n\"i'c ode dir"
    path = tmp_path / "p.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
sources:
  - name: shop
    generator: {{kind: orders, rate: 5000, max_records: 2000}}
    outputs:
      - name: customers
        sink: {{type: postgres, dsn: "{pg_url}", schema: {json.dumps(HOSTILE_SCHEMA)},
               table: {json.dumps(HOSTILE_TABLE)}, mode: state, key: [customer_id]}}
      - name: orders
        sink: {{type: file, path: {json.dumps(str(out_dir))}}}
  - name: big
    kafka: {{bootstrap_servers: "{kafka.bootstrap}", topic: {topic},
            properties: {{fetch.message.max.bytes: 4000000}}}}
    outputs:
      - name: big
        format: {{type: json, schema: {{id: int64, name: string}}}}
        sink: {{type: postgres, dsn: "{pg_url}", table: {json.dumps(HOSTILE_TABLE + " big")}}}
""")
    cfg = load_config(path)
    with running(cfg, spark) as runners:
        wait_for(lambda: runners[0].health.status == "finished" and runners[1].records >= 3,
                 120, "the pipeline")
        wait_for(lambda: all(o.state.upper and o.rows + o.errors >= 3
                             for o in runners[1].outputs), 60, "the big records")
    with psycopg.connect(pg_url) as c:
        n = c.execute(psycopg.sql.SQL("select count(*) from {}").format(
            psycopg.sql.Identifier(HOSTILE_SCHEMA, HOSTILE_TABLE))).fetchone()
        assert n == (400,)
        rows = c.execute(psycopg.sql.SQL(
            "select id, length(name), _error, length(_raw_value) from {} order by _src_offset"
        ).format(psycopg.sql.Identifier("public", HOSTILE_TABLE + " big"))).fetchall()
    assert rows[0] == (1, 900_000, None, None)
    assert rows[1][0] is None and "id" in rows[1][2] and rows[1][3] == len(big_bad)
    assert rows[2] == (3, 5, None, None)
    pipe = Pipeline(cfg)
    src = pipe.source_config("shop")
    assert pipe.sink(src, src.output("orders")).read_updates().num_rows == 1600
    assert out_dir.exists()
    count("bad input: identifiers and oversized records", inputs_tried=5,
          records_checked=2000 + 3)
