"""Pipeline configuration: typed models, errors that name file, line, key path
and what was expected, and secrets that never reach a message."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr, ValidationError

from reclock.config import (
    AvroFormat,
    BytesFormat,
    ConfigError,
    ConnectorConfig,
    ConsoleSinkConfig,
    CsvFormat,
    DebeziumEnvelope,
    FileSinkConfig,
    GeneratorConfig,
    JsonFormat,
    NoneEnvelope,
    OutputConfig,
    PipelineConfig,
    SourceConfig,
    TextFormat,
    UpsertEnvelope,
    _Model,
    load_config,
    parse_config,
    parse_model,
    redact_secrets,
    redacted_dump,
)
from reclock.core.errors import DefiniteError

REPO = Path(__file__).resolve().parents[2]
SECRET = "hunter2-s3cr3t"


def write(tmp_path: Path, text: str, name: str = "pipeline.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def at(path: Path, line: int, needle: str, nth: int = 1) -> str:
    """``file:line:column`` of the ``nth`` occurrence of ``needle`` on ``line``
    of the file (both 1-based): where an error should point."""
    text = path.read_text(encoding="utf-8").splitlines()[line - 1]
    col = -1
    for _ in range(nth):
        col = text.index(needle, col + 1)
    return f"{path}:{line}:{col + 1}"


def errors_of(path: Path, env: dict[str, str] | None = None) -> list[str]:
    """The lines of the ConfigError that loading ``path`` raises."""
    with pytest.raises(ConfigError) as info:
        load_config(path, env=env or {})
    return str(info.value).splitlines()


MINIMAL = """
sources:
  - name: counter
    generator: {kind: counter}
    outputs:
      - name: main
        sink: file
"""


# -- valid files --------------------------------------------------------------


def test_full_valid_example(tmp_path: Path) -> None:
    path = write(tmp_path, """
        state_dir: var/state
        remap_store: postgresql://reclock:pw@db.example/reclock
        timestamp_interval: 2s
        progress_log: false
        spark:
          master: spark://spark:7077
          app_name: ingest
          conf:
            spark.executor.memory: 2g
            spark.sql.shuffle.partitions: 4
            spark.sql.adaptive.enabled: true
          max_records_per_job: 500000
          max_records_per_task: 50000
        sources:
          - name: counter
            timestamp_interval: 250ms
            generator:
              kind: counter
              rate: 2500.5
              max_records: 10000
              start: 100
              seed: 7
              value_format: csv
              bad_every: 10
            outputs:
              - name: main
                format:
                  type: csv
                  columns: [n, payload]
                  types: {n: int64}
                  delimiter: ";"
                key_format: text
                envelope: {type: upsert, key: [n]}
                sink: {type: file, path: out/main}
          - name: shop
            generator: {kind: orders, rate: 10}
            outputs:
              - name: customers
                format:
                  type: json
                  schema: {customer_id: int64, name: string, balance: "decimal(12, 2)"}
                sink: file
              - name: orders
                format: {type: avro, registry_url: "http://registry:8081", subject: o-value}
                envelope: {type: debezium, key: [order_id]}
                sink: {type: console, max_rows: 5}
        """)
    cfg = load_config(path, env={})

    assert cfg.state_dir == tmp_path / "var" / "state"
    assert cfg.remap_store_url == "postgresql://reclock:pw@db.example/reclock"
    assert cfg.timestamp_interval == 2000
    assert cfg.progress_log is False and cfg.progress_log_path is None
    assert cfg.spark.master == "spark://spark:7077"
    assert cfg.spark.app_name == "ingest"
    assert cfg.spark.conf == {
        "spark.executor.memory": "2g",
        "spark.sql.shuffle.partitions": "4",
        "spark.sql.adaptive.enabled": "true",
    }
    assert (cfg.spark.max_records_per_job, cfg.spark.max_records_per_task) == (500000, 50000)

    counter = cfg.source("counter")
    assert counter.timestamp_interval == counter.interval_ms == 250
    assert counter.connector == ("generator", counter.generator)
    assert counter.generator == GeneratorConfig(
        kind="counter", rate=2500.5, max_records=10000, start=100, seed=7,
        value_format="csv", bad_every=10,
    )
    main = counter.output("main")
    assert main.format == CsvFormat(columns=("n", "payload"), types={"n": "int64"},
                                    delimiter=";")
    assert main.key_format == TextFormat()
    assert main.envelope == UpsertEnvelope(key=("n",))
    assert main.sink == FileSinkConfig(path=tmp_path / "out" / "main")

    shop = cfg.source("shop")
    assert shop.interval_ms == 2000  # inherits the pipeline's interval
    assert shop.generator is not None and shop.generator.kind == "orders"
    customers = shop.output("customers")
    assert isinstance(customers.format, JsonFormat)
    assert customers.format.schema_ == {
        "customer_id": "int64", "name": "string", "balance": "decimal(12,2)",
    }
    assert customers.envelope == NoneEnvelope()
    assert customers.sink == FileSinkConfig(
        path=tmp_path / "var" / "state" / "outputs" / "shop" / "customers")
    orders = shop.output("orders")
    assert orders.format == AvroFormat(registry_url="http://registry:8081", subject="o-value")
    assert orders.envelope == DebeziumEnvelope(key=("order_id",))
    assert orders.sink == ConsoleSinkConfig(max_rows=5)


def test_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, MINIMAL), env={})
    assert cfg.state_dir == tmp_path / "state"
    assert cfg.remap_store is None
    assert cfg.remap_store_url == f"sqlite:///{tmp_path / 'state' / 'remap.db'}"
    assert cfg.timestamp_interval == 1000
    assert cfg.progress_log_path == tmp_path / "state" / "progress.jsonl"
    assert cfg.spark.master == "local[*]" and cfg.spark.app_name == "reclock"
    assert cfg.spark.conf == {}
    assert cfg.spark.max_records_per_job == 1_000_000
    assert cfg.spark.max_records_per_task == 200_000
    assert cfg.max_retry_backoff == 30_000
    src = cfg.sources[0]
    assert src.generator == GeneratorConfig(kind="counter")
    assert (src.generator.rate, src.generator.max_records, src.generator.start) == (1000, None, 0)
    assert (src.generator.seed, src.generator.value_format, src.generator.bad_every) == (
        0, "json", 0)
    out = src.outputs[0]
    assert out.format == JsonFormat() and out.format.schema_ is None
    assert out.key_format is None
    assert out.envelope == NoneEnvelope()
    assert out.sink == FileSinkConfig(path=tmp_path / "state" / "outputs" / "counter" / "main")


def test_max_retry_backoff_reaches_the_runners(tmp_path: Path) -> None:
    from reclock.pipeline import Pipeline

    cfg = load_config(write(tmp_path, "max_retry_backoff: 2s\n" + MINIMAL), env={})
    pipe = Pipeline(cfg)
    try:
        assert pipe.settings(cfg.sources[0]).max_retry_backoff_ms == 2000
    finally:
        pipe.close()
    with pytest.raises(ConfigError, match="max_retry_backoff"):
        load_config(write(tmp_path, "max_retry_backoff: 10ms\n" + MINIMAL), env={})


def test_release_memory_reaches_the_runners(tmp_path: Path) -> None:
    from reclock.pipeline import Pipeline

    for text, want in (("", True), ("housekeeping: {release_memory: false}\n", False)):
        cfg = load_config(write(tmp_path, text + MINIMAL), env={})
        pipe = Pipeline(cfg)
        try:
            assert pipe.settings(cfg.sources[0]).housekeeping.release_memory is want
        finally:
            pipe.close()


def test_quickstart_example_loads() -> None:
    cfg = load_config(REPO / "examples" / "quickstart.yaml", env={})
    assert cfg.timestamp_interval == 1000
    counter, shop = cfg.sources
    assert counter.generator == GeneratorConfig(kind="counter", rate=1000, value_format="json",
                                                bad_every=1000)
    assert [o.name for o in counter.outputs] == ["counter"]
    assert isinstance(counter.outputs[0].format, JsonFormat)
    assert shop.generator is not None and shop.generator.kind == "orders"
    assert [o.name for o in shop.outputs] == ["customers", "orders"]
    for src in cfg.sources:
        for out in src.outputs:
            assert out.sink == FileSinkConfig(
                path=REPO / "examples" / "state" / "outputs" / src.name / out.name)


def test_models_are_frozen(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, MINIMAL), env={})
    with pytest.raises(ValidationError):
        cfg.sources[0].name = "other"


def test_a_debezium_envelope_without_a_key_is_refused(tmp_path: Path) -> None:
    """Reported: a keyless ``envelope: debezium`` over events with ``before:
    null`` left a deleted row live, with error rows beside it (Materialize
    requires a key for this envelope). Refused where it is written, saying
    what to add; with a key the same events apply exactly
    (tests/sources/test_kafka_source.py)."""
    path = write(tmp_path, """
        sources:
          - name: cdc
            kafka: {bootstrap_servers: "b:9092", topics: [a, b, c], output_per_topic: true}
            outputs:
              - {name: a, format: json, envelope: debezium, sink: console}
              - name: b
                envelope: {type: debezium}
                sink: console
              - name: c
                envelope: {type: debezium, key: []}
                sink: console
        """)
    lines = errors_of(path)
    assert [line.split(": ", 2)[:2] for line in lines] == [
        [at(path, 5, "debezium"), "sources[0].outputs[0].envelope"],
        [at(path, 7, "{type"), "sources[0].outputs[1].envelope"],
        [at(path, 10, "[]"), "sources[0].outputs[2].envelope.key"],
    ]
    for line in lines:
        assert line.endswith(
            "the debezium envelope needs a key: the key columns of the images, e.g. "
            "envelope: {type: debezium, key: [id]} with the upstream table's primary key. "
            "Without one, an update with 'before: null' or a delete whose before image holds "
            "only the key (REPLICA IDENTITY DEFAULT) cannot retract the old row, which would "
            "stay live beside error rows")


def test_shorthand_forms(tmp_path: Path) -> None:
    path = write(tmp_path, """
        sources:
          - name: s
            kafka: {bootstrap_servers: "b:9092", topics: [a, b, c], output_per_topic: true}
            outputs:
              - {name: a, format: text, key_format: bytes, envelope: none, sink: console}
              - {name: b, format: json, envelope: {type: debezium, key: [id]}, sink: file}
              - name: c
                format: {type: json}
                envelope: {type: none}
                sink: {type: console}
        """)
    a, b, c = load_config(path, env={}).sources[0].outputs
    assert (a.format, a.key_format, a.envelope, a.sink) == (
        TextFormat(), BytesFormat(), NoneEnvelope(), ConsoleSinkConfig(max_rows=20))
    assert (b.format, b.envelope) == (JsonFormat(), DebeziumEnvelope(key=("id",)))
    assert isinstance(b.sink, FileSinkConfig)
    assert (c.format, c.envelope, c.sink) == (JsonFormat(), NoneEnvelope(), ConsoleSinkConfig())


def test_relative_paths_resolve_against_the_yaml_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    path = write(conf_dir, """
        state_dir: ../data/state
        remap_store: remap/bindings.db
        sources:
          - name: s
            kafka: {bootstrap_servers: "b:9092", topics: [a, b], output_per_topic: true}
            outputs:
              - {name: a, sink: file}
              - {name: b, sink: {type: file, path: out/b}}
        """)
    cfg = load_config(Path("..") / "conf" / "pipeline.yaml", env={})
    assert cfg.state_dir == tmp_path / "data" / "state"
    assert cfg.remap_store_url == f"sqlite:///{conf_dir / 'remap' / 'bindings.db'}"
    a, b = cfg.sources[0].outputs
    assert a.sink == FileSinkConfig(path=tmp_path / "data" / "state" / "outputs" / "s" / "a")
    assert b.sink == FileSinkConfig(path=conf_dir / "out" / "b")
    # parse_config without a base directory: the working directory
    cfg2 = parse_config(path.read_text(), env={})
    assert cfg2.state_dir == tmp_path / "data" / "state"  # ../data from elsewhere/
    assert cfg2.source("s").output("b").sink == FileSinkConfig(path=elsewhere / "out" / "b")
    assert parse_config("remap_store: sqlite:///rel.db\n" + MINIMAL, base_dir=conf_dir,
                        env={}).remap_store_url == f"sqlite:///{conf_dir / 'rel.db'}"
    absolute = f"sqlite:///{tmp_path / 'abs.db'}"
    assert parse_config(f"remap_store: {absolute}\n" + MINIMAL, base_dir=conf_dir,
                        env={}).remap_store_url == absolute


@pytest.mark.parametrize(
    ("text", "ms"),
    [("1s", 1000), ("500ms", 500), ("2m", 120_000), ("1h", 3_600_000), ("1.5s", 1500),
     (" 250 ms ", 250), ("750", 750), (42, 42), (3.0, 3)],
)
def test_durations(tmp_path: Path, text: str | int | float, ms: int) -> None:
    value = f'"{text}"' if isinstance(text, str) else str(text)
    cfg = load_config(write(tmp_path, f"timestamp_interval: {value}\n" + MINIMAL), env={})
    assert cfg.timestamp_interval == ms
    assert cfg.sources[0].interval_ms == ms


@pytest.mark.parametrize("bad", ["0", "0s", "-1s", "1.5ms", "fast", "1w", "true", "[1]", "-5"])
def test_bad_durations(tmp_path: Path, bad: str) -> None:
    path = write(tmp_path, f"timestamp_interval: {bad}\n" + MINIMAL)
    assert errors_of(path) == [
        f"{at(path, 1, bad)}: timestamp_interval: expected a positive duration such as '1s', "
        "'500ms', '2m' or an integer number of milliseconds"
        + (" (not a whole number of milliseconds)" if bad == "1.5ms" else "")
    ]


# -- errors -------------------------------------------------------------------


def test_config_error_is_a_definite_error() -> None:
    assert issubclass(ConfigError, DefiniteError)


def test_unknown_key(tmp_path: Path) -> None:
    path = write(tmp_path, """
        sources:
          - name: counter
            kafka: {bootstrap_servers: "b:9092", topics: [main, other], output_per_topic: true}
            outputs:
              - name: main
                sink: file
              - name: other
                sink:
                  type: file
                  pth: /tmp/x
        """)
    [line] = errors_of(path)
    assert line == (
        f"{at(path, 10, 'pth')}: sources[0].outputs[1].sink: unknown key 'pth' "
        "(expected one of: compact, key, mode, name, path, storage, type)"
    )


def test_unknown_top_level_key(tmp_path: Path) -> None:
    path = write(tmp_path, "state_dri: x\n" + MINIMAL)
    assert errors_of(path) == [
        f"{at(path, 1, 'state_dri')}: (top level): unknown key 'state_dri' "
        "(expected one of: housekeeping, http, max_retry_backoff, progress_log, remap_store, "
        "sources, spark, state_dir, timestamp_interval)"
    ]


def test_wrong_type(tmp_path: Path) -> None:
    path = write(tmp_path, """
        sources:
          - name: counter
            generator:
              kind: counter
              rate: fast
              max_records: 1.5
            outputs:
              - name: main
                sink: file
        """)
    assert errors_of(path) == [
        f"{at(path, 5, 'fast')}: sources[0].generator.rate: expected a number",
        f"{at(path, 6, '1.5')}: sources[0].generator.max_records: expected an integer",
    ]


def test_missing_sink(tmp_path: Path) -> None:
    path = write(tmp_path, """
        sources:
          - name: counter
            generator: {kind: counter}
            outputs:
              - name: main
                format: json
        """)
    assert errors_of(path) == [
        f"{at(path, 5, 'name')}: sources[0].outputs[0]: missing required key 'sink' (or "
        "'sinks': a list of sinks)"
    ]


def test_missing_sources_and_empty_file(tmp_path: Path) -> None:
    path = write(tmp_path, "")
    assert errors_of(path) == [f"{path}:1:1: (top level): missing required key 'sources'"]
    path = write(tmp_path, "sources: []\n")
    assert errors_of(path) == [f"{at(path, 1, '[]')}: sources: expected at least 1 item"]
    path = write(tmp_path, "- a\n- b\n")
    assert errors_of(path) == [f"{path}:1:1: (top level): expected a mapping of settings"]


def test_two_outputs_naming_one_sink_target(tmp_path: Path) -> None:
    """Their rows would mix (each reads back the other's): refused with both
    places named, for a Delta path, a Postgres table and a Kafka topic."""
    path = write(tmp_path, """
        sources:
          - name: a
            kafka: {bootstrap_servers: "b:9092", topics: [x, y, z], output_per_topic: true}
            outputs:
              - {name: x, sink: {type: file, path: lake/x}}
              - {name: y, sink: {type: postgres, dsn: "postgresql://h/db", table: t}}
              - {name: z, sink: {type: kafka, bootstrap_servers: "k1,k2", topic: out}}
          - name: b
            kafka: {bootstrap_servers: "b:9092", topics: [x, y, z, w], output_per_topic: true}
            outputs:
              - {name: x, sink: {type: file, path: ./lake/x/}}
              - {name: y, sink: {type: postgres, dsn: "postgresql://h/db", schema: public,
                                 table: t}}
              - {name: z, sink: {type: kafka, bootstrap_servers: "k2,k1", topic: out}}
              - {name: w, sink: {type: postgres, dsn: "postgresql://h/db", table: T}}
        """)
    assert errors_of(path) == [
        f"{at(path, 11, '{type: file')}: sources[1].outputs[0].sink: output b.x writes the "
        "same path as output a.x ('lake/x'): their rows would mix; give each sink its "
        "own path (also at sources[0].outputs[0].sink, line 5)",
        f"{at(path, 12, '{type: postgres')}: sources[1].outputs[1].sink: output b.y writes "
        "the same table as output a.y ('t'): their rows would mix; give each sink its "
        "own table (also at sources[0].outputs[1].sink, line 6)",
        f"{at(path, 14, '{type: kafka')}: sources[1].outputs[2].sink: output b.z writes the "
        "same topic as output a.z ('out'): their rows would mix; give each sink its own "
        "topic (also at sources[0].outputs[2].sink, line 7)",
    ]


def test_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.yaml"
    assert errors_of(path) == [f"{path}: cannot read file: No such file or directory"]


def test_duplicate_source_names(tmp_path: Path) -> None:
    path = write(tmp_path, """
        sources:
          - name: orders
            generator: {kind: orders}
            outputs: [{name: orders, sink: file}, {name: customers, sink: file}]
          - name: counter
            generator: {kind: counter}
            outputs: [{name: main, sink: file}]
          - name: orders
            generator: {kind: counter}
            outputs: [{name: main, sink: file}, {name: main, sink: console}]
        """)
    assert errors_of(path) == [
        f"{at(path, 8, 'orders')}: sources[2].name: duplicate source name 'orders' "
        "(also at sources[0].name, line 2)",
        f"{at(path, 10, 'main', 2)}: sources[2].outputs[1].name: duplicate output name 'main' "
        "(also at sources[2].outputs[0].name, line 10)",
    ]


def test_duplicate_yaml_keys(tmp_path: Path) -> None:
    path = write(tmp_path, """
        timestamp_interval: 1s
        sources:
          - name: counter
            generator: {kind: counter, rate: 5, rate: 6}
            outputs: [{name: main, sink: file}]
        timestamp_interval: 2s
        """)
    assert errors_of(path) == [
        f"{at(path, 4, 'rate', 2)}: sources[0].generator: duplicate key 'rate' "
        "(first at line 4; YAML would keep only the last)",
        f"{at(path, 6, 'timestamp_interval')}: (top level): duplicate key 'timestamp_interval' "
        "(first at line 1; YAML would keep only the last)",
    ]


def test_yaml_syntax_error(tmp_path: Path) -> None:
    path = write(tmp_path, """
        sources:
          - name: counter
            generator: {kind: counter
            outputs: []
        """)
    [line] = errors_of(path)
    assert line.startswith(f"{path}:4:12: invalid YAML: ")
    path = write(tmp_path, "sources:\n\t- name: a\n")
    [line] = errors_of(path)
    assert line.startswith(f"{path}:2:1: invalid YAML: ")
    assert line.endswith("indent with spaces, not tabs")


def test_unsupported_yaml_tag_and_non_string_key(tmp_path: Path) -> None:
    path = write(tmp_path, """
        state_dir: !!python/object/apply:os.getcwd []
        sources:
          - name: counter
            7: seven
            generator: {kind: counter}
            outputs: [{name: main, sink: file}]
        """)
    assert errors_of(path) == [
        f"{at(path, 1, '!!python')}: state_dir: unsupported YAML tag "
        "tag:yaml.org,2002:python/object/apply:os.getcwd",
        f"{at(path, 4, '7')}: sources[0]: key 7 must be a string (quote it)",
    ]


def test_several_errors_in_line_order(tmp_path: Path) -> None:
    path = write(tmp_path, """
        timestamp_interval: soon
        spark:
          max_records_per_task: 0
        sources:
          - name: 9lives
            generator: {kind: counters}
            outputs:
              - name: main
                format: {type: json, schema: {n: integer}}
                envelope: {type: upsert, key: []}
                sink: {type: files}
              - name: side
          - name: ok
            outputs: [{name: main, sink: file, extra: 1}]
        """)
    assert errors_of(path) == [
        f"{at(path, 1, 'soon')}: timestamp_interval: expected a positive duration such as "
        "'1s', '500ms', '2m' or an integer number of milliseconds",
        f"{at(path, 3, '0')}: spark.max_records_per_task: expected a number > 0",
        f"{at(path, 5, '9lives')}: sources[0].name: expected a name: a letter, then letters, "
        "digits, '_' or '-' (63 characters at most)",
        f"{at(path, 6, 'counters')}: sources[0].generator.kind: expected 'counter', 'orders', "
        "'key-value' or 'auction'",
        f"{at(path, 9, 'integer')}: sources[0].outputs[0].format.schema.n: unknown column type "
        "(expected one of: int32, int64, float64, bool, string, binary, timestamp, date, "
        "decimal(p,s), json)",
        f"{at(path, 10, '[]')}: sources[0].outputs[0].envelope.key: expected at least 1 item",
        f"{at(path, 11, 'files')}: sources[0].outputs[0].sink.type: unknown type "
        "(expected one of: console, delta, file, iceberg, kafka, postgres)",
        f"{at(path, 12, 'name')}: sources[0].outputs[1]: missing required key 'sink' (or "
        "'sinks': a list of sinks)",
        f"{at(path, 13, 'name')}: sources[1]: missing connector block "
        "(expected one of: generator, kafka, postgres, mysql, oneshot)",
        f"{at(path, 14, 'extra')}: sources[1].outputs[0]: unknown key 'extra' "
        "(expected one of: envelope, format, key_format, name, rename, schema_change, sink, sinks)",
    ]


def test_connector_blocks(tmp_path: Path) -> None:
    assert SourceConfig.connector_keys() == ("generator", "kafka", "postgres", "mysql",
                                            "oneshot")
    path = write(tmp_path, """
        sources:
          - name: s
            generator: {kind: orders, value_format: csv, bad_every: 3}
            outputs: [{name: orders, sink: file}, {name: customers, sink: file}]
        """)
    assert errors_of(path) == [
        f"{at(path, 3, 'csv')}: sources[0].generator.value_format: only applies to kind 'counter'",
        f"{at(path, 3, '3')}: sources[0].generator.bad_every: only applies to kind 'counter'",
    ]


def test_adding_a_connector_is_one_field(tmp_path: Path) -> None:
    class EchoConfig(ConnectorConfig):
        """A test connector."""

        topic: str

    class ExtendedSource(SourceConfig):
        """SourceConfig plus one connector block."""

        echo: EchoConfig | None = None

    assert ExtendedSource.connector_keys() == ("generator", "kafka", "postgres", "mysql",
                                              "oneshot", "echo")
    both = """
        name: s
        generator: {kind: counter}
        echo: {topic: t}
        outputs: [{name: o, sink: file}]
        """
    with pytest.raises(ConfigError) as info:
        parse_model(ExtendedSource, textwrap.dedent(both), "s.yaml")
    assert str(info.value) == (
        "s.yaml:4:7: echo: only one connector block allowed, found: generator, echo")
    src = parse_model(ExtendedSource, "name: s\necho: {topic: t}\noutputs: [{name: o, sink: file}]")
    assert src.connector == ("echo", EchoConfig(topic="t"))


def test_format_checks(tmp_path: Path) -> None:
    path = write(tmp_path, """
        sources:
          - name: s
            kafka: {bootstrap_servers: "b:9092", topics: [a, b, c, d], output_per_topic: true}
            outputs:
              - name: a
                format: {type: avro}
                sink: file
              - name: b
                format: {type: avro, schema: "{not json"}
                sink: file
              - name: c
                format: {type: csv, columns: [x, y, x], types: {z: "decimal(40,2)"}}
                sink: file
              - name: d
                format: csv
                key_format: 3
                sink: console
        """)
    bad_schema, bad_decimal = at(path, 9, '"{not'), at(path, 12, '"decimal')
    assert errors_of(path) == [
        f"{at(path, 6, '{type: avro}')}: sources[0].outputs[0].format: expected 'schema', "
        "or 'registry_url' with 'subject'",
        f"{bad_schema}: sources[0].outputs[1].format.schema: expected an Avro schema as a JSON "
        "string or a mapping",
        f"{at(path, 12, 'x', 2)}: sources[0].outputs[2].format.columns[2]: duplicate column 'x'",
        f"{at(path, 12, 'z')}: sources[0].outputs[2].format.types.z: column 'z' is not in "
        "'columns'",
        f"{bad_decimal}: sources[0].outputs[2].format.types.z: decimal(p,s) needs "
        "1 <= p <= 38 and 0 <= s <= p",
        f"{at(path, 15, 'csv')}: sources[0].outputs[3].format: missing required key 'columns'",
        f"{at(path, 16, '3')}: sources[0].outputs[3].key_format: expected a format type "
        "(avro, bytes, csv, json, json_schema, protobuf, text) or a mapping with key 'type'",
    ]
    avro = parse_config(MINIMAL.replace(
        "sink: file", "sink: file\n        format: {type: avro, schema: {type: string}}"), env={})
    assert avro.sources[0].outputs[0].format == AvroFormat.model_validate(
        {"schema": '{"type": "string"}'})


# -- environment variables ----------------------------------------------------


def test_env_substitution(tmp_path: Path) -> None:
    path = write(tmp_path, """
        state_dir: ${STATE:-/var/lib/reclock}
        remap_store: postgresql://reclock:${PGPASSWORD}@${PGHOST:-localhost}/reclock
        timestamp_interval: ${INTERVAL}
        spark:
          app_name: cost-$$5-${SUFFIX:-}
        sources:
          - name: counter
            generator: {kind: counter, rate: "${RATE:-10}", max_records: "${MAX}"}
            outputs: [{name: main, sink: "${SINK}"}]
        """)
    # (a password with reserved characters is percent-encoded, in the
    # environment too: test_passwords_with_reserved_characters_are_refused)
    env = {"PGPASSWORD": "p%40ss$1", "INTERVAL": "500ms", "MAX": "100", "SINK": "console"}
    cfg = load_config(path, env=env)
    assert cfg.state_dir == Path("/var/lib/reclock")
    assert cfg.remap_store == "postgresql://reclock:p%40ss$1@localhost/reclock"
    assert cfg.timestamp_interval == 500
    assert cfg.spark.app_name == "cost-$5-"
    assert cfg.sources[0].generator == GeneratorConfig(kind="counter", rate=10, max_records=100)
    assert cfg.sources[0].outputs[0].sink == ConsoleSinkConfig()


def test_env_substitution_defaults_to_os_environ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RECLOCK_TEST_APP", "from-env")
    cfg = load_config(write(tmp_path, "spark: {app_name: '${RECLOCK_TEST_APP}'}\n" + MINIMAL))
    assert cfg.spark.app_name == "from-env"


def test_undefined_env_var(tmp_path: Path) -> None:
    path = write(tmp_path, """
        remap_store: postgresql://u:${PGPASSWORD}@h/db
        spark:
          master: ${MASTER:-local[2]}
          app_name: ${BAD NAME}
        sources:
          - name: counter
            generator: {kind: counter}
            outputs: [{name: main, sink: file}]
        """)
    assert errors_of(path, env={"MASTER": SECRET}) == [
        f"{at(path, 1, 'postgresql')}: remap_store: environment variable PGPASSWORD is not set "
        "(set it, or give a default: ${PGPASSWORD:-default})",
        f"{at(path, 4, '${BAD')}: spark.app_name: malformed variable reference: use ${{NAME}} or "
        "${NAME:-default} (write $$ for a literal $)",
    ]


# -- secrets ------------------------------------------------------------------


def test_secrets_never_reach_error_messages(tmp_path: Path) -> None:
    path = write(tmp_path, f"""
        remap_store: mysql://reclock:{SECRET}@db/reclock
        spark:
          conf: {{spark.password: ["{SECRET}"]}}
        sources:
          - name: counter
            generator: {{kind: counter, rate: "${{RATE}}", seed: "{SECRET}"}}
            outputs: [{{name: main, sink: file, format: "{SECRET}"}}]
        """)
    lines = errors_of(path, env={"RATE": SECRET})
    assert len(lines) == 5
    assert lines[0] == (
        f"{at(path, 1, 'mysql')}: remap_store: unsupported remap store URL scheme 'mysql' "
        "(expected sqlite:///path or postgresql://user@host/db)"
    )
    for line in lines:
        assert SECRET not in line

    # A YAML syntax error on the line holding the password.
    path = write(tmp_path, f"remap_store: postgresql://u:{SECRET}@h/db: [\n" + MINIMAL)
    [line] = errors_of(path)
    assert SECRET not in line


def test_a_malformed_dsn_is_a_located_error_without_its_password(tmp_path: Path) -> None:
    """``postgres//`` (the ``:`` missing) is not a URL, so URL scrubbing did not
    apply: the password reached ``reclock status``'s output."""
    path = write(tmp_path, f"""
        sources:
          - name: pg
            postgres: {{dsn: "postgres//user:{SECRET}@host/db", tables: [t]}}
            outputs:
              - name: t
                sink: {{type: postgres, dsn: "host=h password={SECRET} dbname", table: x}}
        """)
    lines = errors_of(path)
    first, second = at(path, 3, '"postgres//'), at(path, 6, '"host=h')
    assert lines == [
        f"{first}: sources[0].postgres.dsn: invalid PostgreSQL DSN: "
        "the DSN is not a URL (expected postgresql://host:5432/dbname)",
        f"{second}: sources[0].outputs[0].sink.dsn: invalid PostgreSQL DSN: "
        "libpq cannot parse it; use postgresql://user@host:port/dbname (a password after "
        "the user, percent-encoded), or 'host=... dbname=...' with any value holding "
        "spaces or quotes in single quotes (a quote inside as \\')",
    ]


class _WithSecret(_Model):
    """A test-only model with a secret field."""

    user: str
    token: SecretStr
    url: str = "http://example"


def test_secret_fields_are_redacted() -> None:
    with pytest.raises(ConfigError) as info:
        parse_model(_WithSecret, f"user: [x]\ntoken: [\"{SECRET}\"]\nurl: 5\n", "s.yaml")
    assert str(info.value) == (
        "s.yaml:1:7: user: expected a string\n"
        "s.yaml:2:8: token: expected a string\n"
        "s.yaml:3:6: url: expected a string"
    )
    ok = parse_model(_WithSecret, f"user: me\ntoken: {SECRET}\nurl: https://me:{SECRET}@h/\n")
    assert ok.token.get_secret_value() == SECRET
    dumped = redacted_dump(ok)
    assert dumped == {"user": "me", "token": "***", "url": "https://me:***@h/"}
    assert SECRET not in repr(ok) and SECRET not in str(ok)


def test_redacted_dump(tmp_path: Path) -> None:
    path = write(tmp_path, """
        remap_store: postgresql://reclock:pw@db/reclock?sslpassword=pw2
        spark:
          conf:
            spark.hadoop.fs.s3a.secret.key: pw3
            spark.executor.memory: 2g
        sources:
          - name: counter
            generator: {kind: counter}
            outputs:
              - name: main
                format: {type: avro, registry_url: "https://u:pw4@registry/", subject: s}
                sink: file
        """)
    cfg = load_config(path, env={})
    dumped = redacted_dump(cfg)
    assert dumped["remap_store"] == "postgresql://reclock:***@db/reclock?sslpassword=***"
    assert dumped["spark"]["conf"] == {"spark.hadoop.fs.s3a.secret.key": "***",
                                       "spark.executor.memory": "2g"}
    out = dumped["sources"][0]["outputs"][0]
    assert out["format"] == {"type": "avro", "schema": None,
                             "registry_url": "https://u:***@registry/", "subject": "s"}
    assert out["sink"] == {"name": None, "type": "file",
                           "path": str(tmp_path / "state/outputs/counter/main"),
                           "storage": None, "mode": "log", "key": [], "compact": {
                               "every": 600_000, "min_files": 50, "target_size": 128 * 2**20,
                               "retention": 86_400_000, "in_child": True}}
    assert dumped["timestamp_interval"] == 1000 and dumped["state_dir"] == str(tmp_path / "state")
    text = repr(dumped) + repr(cfg) + str(cfg)
    for pw in ("pw@", "pw2", "pw3", "pw4"):
        assert pw not in text
    # the real values are still there for the code that connects
    assert cfg.remap_store_url.startswith("postgresql://reclock:pw@")
    assert cfg.spark.conf["spark.hadoop.fs.s3a.secret.key"] == "pw3"


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        ("postgresql://u:pw@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:p@ss@h:5432/db", "postgresql://u:***@h:5432/db"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("http://h:8081/x", "http://h:8081/x"),
        ("postgresql://h/db?user=u&password=pw", "postgresql://h/db?user=u&password=***"),
        ("see postgresql://a:b@h and https://c:d@e/", "see postgresql://a:***@h and https://c:***@e/"),
    ],
)
def test_redact_secrets(text: str, redacted: str) -> None:
    assert redact_secrets(text) == redacted


def test_top_level_x_keys_hold_anchors(tmp_path: Path) -> None:
    path = write(tmp_path, """
        x-sink: &sink {type: console, max_rows: 3}
        sources:
          - name: s
            kafka: {bootstrap_servers: "b:9092", topics: [a, b], output_per_topic: true}
            outputs: [{name: a, sink: *sink}, {name: b, sink: *sink}]
        """)
    a, b = load_config(path, env={}).sources[0].outputs
    assert a.sink == b.sink == ConsoleSinkConfig(max_rows=3)


def test_programmatic_construction_is_validated_too() -> None:
    out = {"name": "o", "sink": "file"}
    with pytest.raises(ValidationError, match="duplicate source name 'a'"):
        PipelineConfig.model_validate({"sources": [
            {"name": "a", "generator": {"kind": "counter"}, "outputs": [out]},
            {"name": "a", "generator": {"kind": "counter"}, "outputs": [out]},
        ]})
    src = SourceConfig(name="a", generator=GeneratorConfig(kind="counter"),
                       outputs=(OutputConfig(name="o", sink=FileSinkConfig()),))
    cfg = PipelineConfig(sources=(src,))
    assert cfg.state_dir == Path.cwd() / "state"
    assert cfg.sources[0].outputs[0].sink == FileSinkConfig(
        path=Path.cwd() / "state" / "outputs" / "a" / "o")


def test_postgres_connector(tmp_path: Path) -> None:
    ok = write(tmp_path, """
        sources:
          - name: shop
            postgres: {dsn: "postgresql://u:${PW}@db/shop", tables: [orders, inv.items],
                       slot: shop_slot, timeout: 5s}
            outputs:
              - {name: orders, sink: file}
              - {name: items, sink: file}
        """)
    pg = load_config(ok, env={"PW": "pw"}).sources[0].postgres
    assert pg is not None
    assert (pg.table_outputs(), pg.slot, pg.timeout, pg.snapshot, pg.drop_slot) == (
        [("public", "orders", "orders"), ("inv", "items", "items")], "shop_slot", 5000, True,
        False)
    named = write(tmp_path, """
        sources:
          - name: shop
            postgres:
              dsn: "postgresql://db/shop"
              tables: [{table: 'Order "Items".v2', schema: Shop Ünï, output: items}, orders]
            outputs:
              - {name: items, sink: file}
              - {name: orders, sink: file}
        """, name="named.yaml")
    pg = load_config(named).sources[0].postgres
    assert pg is not None and pg.table_outputs() == [
        ("Shop Ünï", 'Order "Items".v2', "items"), ("public", "orders", "orders")]
    bad = write(tmp_path, """
        sources:
          - name: shop
            postgres: {dsn: "postgresql://db/shop", slot: "Bad-Slot", snapshots: false}
            outputs:
              - {name: orders, sink: file}
        """, name="bad.yaml")
    lines = errors_of(bad)
    assert any("postgres.tables" in e and "give tables, or the publication" in e
               for e in lines), lines
    assert any("postgres" in e and "unknown key 'snapshots'" in e for e in lines), lines
    slot = write(tmp_path, """
        sources:
          - name: shop
            postgres: {dsn: "postgresql://db/shop", tables: [t], slot: "Bad-Slot"}
            outputs:
              - {name: t, sink: file}
        """, name="slot.yaml")
    lines = errors_of(slot)
    assert any("postgres.slot" in e for e in lines), lines


def test_nesting_and_alias_expansion_are_bounded(tmp_path: Path, monkeypatch: Any) -> None:
    """A list nested 5,000 deep and an alias bomb of 9^7 values are located
    errors (no RecursionError), and the loader's work stops at its limits:
    it builds at most MAX_YAML_DEPTH levels and MAX_YAML_VALUES values, plus
    the siblings it still visits on its way out, never the 4.8M the bomb
    names. (A bound on work done, not on wall time: CI machines vary.)"""
    from reclock.config import loader

    built = [0]
    build = loader.LineLoader._build

    def counted(self: Any, node: Any, path: Any) -> Any:
        built[0] += 1
        return build(self, node, path)

    monkeypatch.setattr(loader.LineLoader, "_build", counted)
    deep = write(tmp_path, "sources: " + "[" * 5000 + "]" * 5000 + "\n", "deep.yaml")
    bomb_text = "x-a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"x-{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdef", "bcdefg",
                                                                   strict=True)
    ) + "sources: *g\n"
    bomb = write(tmp_path, bomb_text, "bomb.yaml")
    for path, needle, most in (
            (deep, "nested deeper than 64 levels", loader.MAX_YAML_DEPTH + 3),
            # Values up to the limit, then at most 8 siblings more on each of
            # the 8 levels it stops in (measured: 66 and 100,035).
            (bomb, "expands to more than 100,000 values", loader.MAX_YAML_VALUES + 8 * 8)):
        built[0] = 0
        errors = errors_of(path)
        assert any(needle in e for e in errors), errors
        assert 0 < built[0] <= most, (path.name, built[0])

@pytest.mark.parametrize("value", ["1.0e+29", "99999999999999999999", "721h"])
def test_durations_have_a_sane_range(tmp_path: Path, value: str) -> None:
    path = write(tmp_path, f"timestamp_interval: {value}\n" + MINIMAL)
    assert any("at most 30 days" in e for e in errors_of(path))


# -- state tables: the key must contain the output's upstream key ------------------------

STATE_KEYS = """
    sources:
      - name: users
        kafka: {bootstrap_servers: "k:9092", topic: users}
        outputs:
          - name: users
            format: {type: json, schema: {email: string, Name: string}}
            key_format: {type: json, schema: {ID: int64}}
            envelope: {type: upsert, key: [ID]}
            rename: {ID: id, Name: name}
            sink: {type: postgres, dsn: "postgresql://h/db", table: t, mode: state, %s}
      - name: cdc
        kafka: {bootstrap_servers: "k:9092", topic: cdc}
        outputs:
          - name: cdc
            format: {type: json, schema: {id: int64, email: string}}
            envelope: %s
            sink: {type: postgres, dsn: "postgresql://h/db", table: c, mode: state, %s}
      - name: shop
        generator: {kind: orders}
        outputs:
          - name: customers
            sink: {type: postgres, dsn: "postgresql://h/db", table: s, mode: state, %s}
          - name: orders
            sink: {type: postgres, dsn: "postgresql://h/db", table: o, mode: log}
    """


@pytest.mark.parametrize(("users", "cdc", "cdc_key"), [
    (("id",), "{type: debezium, key: [id]}", ("id",)),  # the upstream key itself
    (("email", "id"), "{type: upsert, key: [id]}", ("id", "email")),  # a key containing it
    (("name", "id"), "{type: debezium, key: [id]}", ("email", "id")),  # a renamed column
])
def test_a_state_table_keyed_by_what_contains_the_upstream_key_loads(
    tmp_path: Path, users: tuple[str, ...], cdc: str, cdc_key: tuple[str, ...]
) -> None:
    """Envelope keys name upstream fields, the sink's key output columns
    (after rename): ``ID`` read as ``id`` is the upstream key ``[id]``.
    Typed outputs (a generator's, a CDC table's) are not decided here: their
    key is the source's, known when it describes them (see
    tests/sinks/test_postgres_pipeline.py)."""
    path = write(tmp_path, STATE_KEYS % (f"key: [{', '.join(users)}]", cdc,
                                         f"key: [{', '.join(cdc_key)}]", "key: [name]"))
    cfg = load_config(path)
    assert [o.sink.state_key for s in cfg.sources for o in s.outputs] == [
        users, cdc_key, ("name",), None]


def test_a_state_table_not_keyed_by_the_upstream_key_is_refused_with_the_reason(
    tmp_path: Path
) -> None:
    """Issue: a state table keyed by ``email``, fed by an upsert output keyed
    by ``id`` over a topic of 2 partitions, lost every email that moved from
    one id to another within one IntoTime: the table ended with 10 of 20
    rows. One row per id at every IntoTime does not make one row per email:
    an IntoTime need not hold the two ids' updates together. Such keys are
    refused when the file is loaded, at the sink's key, saying why and what
    to do; so are outputs that keep no key at all."""
    path = write(tmp_path, STATE_KEYS % ("key: [email]", "debezium", "key: [id]",
                                         "key: [customer_id]"))
    lines = errors_of(path)
    assert lines[0] == (
        f"{at(path, 10, '[email]')}: sources[0].outputs[0].sink.key: a state table's key must "
        "contain the output's "
        "upstream key ['id'] (the upsert envelope's key), and ['email'] does not: rows of one "
        "['email'] can belong to several upstream keys, whose updates an IntoTime need not "
        "hold together (they can sit in different partitions, or in different jobs of one "
        "binding), so a ['email'] value that moves from one ['id'] to another could leave "
        "the table with two rows for it or none; key the table by ['id', 'email'], or keep "
        "the update log (mode: log)")
    # a keyless debezium envelope is refused as such, not again at the table's key
    assert "sources[1].outputs[0].envelope: the debezium envelope needs a key" in lines[1]
    assert len(lines) == 2, lines  # the generator's customers are the source's to decide

    none = write(tmp_path, STATE_KEYS % ("key: [id]", "none", "key: [id]", "key: [x]"),
                 name="none.yaml")
    (line,) = errors_of(none)
    assert "sources[1].outputs[0].sink.key" in line
    assert "(envelope none: every record is an insertion, and none retracts an earlier one)" \
        in line
    renamed = write(tmp_path, STATE_KEYS % ("key: [ID]", "{type: upsert, key: [id]}",
                                            "key: [email]", "key: [x]"), name="renamed.yaml")
    lines = errors_of(renamed)
    assert "sources[0].outputs[0].sink.key" in lines[0] and "upstream key ['id']" in lines[0] \
        and "and ['ID'] does not" in lines[0]
    assert "sources[1].outputs[0].sink.key" in lines[1] and "and ['email'] does not" in lines[1]


def test_schema_change_is_a_policy_named_with_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, """
        sources:
          - name: g
            generator: {kind: counter}
            outputs:
              - {name: main, sink: file, schema_change: sometimes}
        """)
    assert errors_of(path) == [
        f"{at(path, 5, 'sometimes')}: sources[0].outputs[0].schema_change: expected 'evolve', "
        "'freeze' or 'fail'"]
    ok = write(tmp_path, """
        sources:
          - name: g
            kafka: {bootstrap_servers: "b:9092", topics: [main, other], output_per_topic: true}
            outputs:
              - {name: main, sink: file, schema_change: freeze}
              - {name: other, sink: file}
        """)
    cfg = load_config(ok)
    assert [o.schema_change for o in cfg.sources[0].outputs] == ["freeze", "evolve"]


@pytest.mark.unit
def test_each_runtime_setting_is_declared_once(tmp_path: Path) -> None:
    """The ``spark`` and ``housekeeping`` blocks reach a runner as the models
    themselves: no other model or dataclass of the runtime declares one of
    their settings again (with a default of its own), and the two byte
    limits of a task, reading and staging, are two settings."""
    import dataclasses
    import importlib
    import pkgutil

    import pydantic

    import reclock.runtime
    from reclock.pipeline import Pipeline
    from reclock.runtime.settings import HousekeepingConfig, Settings, SparkConfig

    names = set(SparkConfig.model_fields) | set(HousekeepingConfig.model_fields) | {
        "max_retry_backoff", "timestamp_interval"}
    mods = [importlib.import_module(f"reclock.runtime.{m.name}")
            for m in pkgutil.iter_modules(reclock.runtime.__path__)]
    mods.append(importlib.import_module("reclock.pipeline"))
    again = []
    for mod in mods:
        for cls in vars(mod).values():
            if (not isinstance(cls, type) or cls.__module__ != mod.__name__
                    or cls in (SparkConfig, HousekeepingConfig)):
                continue
            if dataclasses.is_dataclass(cls):
                fields = {f.name for f in dataclasses.fields(cls)}
            elif issubclass(cls, pydantic.BaseModel):
                fields = set(cls.model_fields)
            else:
                continue
            again += [f"{cls.__module__}.{cls.__name__}.{f}" for f in fields & names]
    assert again == []

    path = tmp_path / "p.yaml"
    path.write_text("sources:\n  - name: c\n    generator: {kind: counter}\n"
                    "    outputs: [{name: value, sink: file}]\n"
                    "spark: {max_bytes_per_stage: 2MiB, job_timeout: 90s}\n"
                    "housekeeping: {vacuum_every: 2m}\n")
    cfg = load_config(path)
    s = Pipeline(cfg).settings(cfg.sources[0])
    assert isinstance(s, Settings) and s.spark is cfg.spark and s.housekeeping is cfg.housekeeping
    assert (s.spark.max_bytes_per_stage, s.spark.max_bytes_per_task) == (2 * 2**20, 64 * 2**20)
    assert (s.spark.job_timeout, s.housekeeping.vacuum_every) == (90_000, 120_000)
