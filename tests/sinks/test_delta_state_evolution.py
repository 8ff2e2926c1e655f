"""Schema changes upstream of a Delta state table (``mode: state``): a
Postgres CDC table gains, loses and widens columns while the driver runs,
and the state table follows the output's ``schema_change`` policy as a log
table does (docs/schema-changes.md). The model is the Postgres table itself
(plus, for a dropped column, each row's value as of its last change);
delta-rs, DuckDB and the peer Spark read the evolved table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from tests.peers import spark_reads
from tests.running import read_updates, running, snapshot_durable, stalled_with
from tests.sinks.test_delta_state import by_duckdb_query
from tests.sources.cdc import execute, output_rows, source_rows
from tests.sources.test_pg_faults import _cfg
from tests.sources.test_pg_schema_change import _caught_up


def _state_cfg(tmp: Path, url: str, table: str, policy: str, *setup: str) -> Any:
    """Runs ``setup`` upstream (the table made), then the config (its state
    under ``tmp``) of a Delta state table of ``table`` with ``policy``."""
    execute(url, *setup)
    tmp.mkdir(exist_ok=True)
    return _cfg(tmp, url, table, f"      - {{name: {table}, schema_change: {policy}, "
                                 "sink: {type: delta, mode: state, key: [id]}}")


def test_a_state_table_evolves_with_its_table_and_reads_alike_everywhere(
        tmp_path: Path, spark: Any, cdc_url: str) -> None:
    """Added (nullable), dropped and widened columns, with the driver running."""
    cfg = _state_cfg(tmp_path, cdc_url, "shop", "evolve",
                     "create table shop (id int primary key, qty int, note text)",
                     "insert into shop select i, i, 'n' || i from generate_series(1, 6) i")
    with running(cfg, spark) as runners:
        snapshot_durable(runners)
        execute(cdc_url,
                "update shop set note = 'n2b' where id = 2",  # before the drop
                "delete from shop where id = 6")
        _caught_up(runners, cdc_url)
        execute(cdc_url,
                "alter table shop add column tag text",
                "insert into shop values (7, 7, 'n7', 't7')")
        _caught_up(runners, cdc_url)
        execute(cdc_url,
                "alter table shop drop column note",
                "update shop set tag = 't1' where id = 1",  # after it: note is null
                "alter table shop alter column qty type bigint",
                "insert into shop values (8, 2 ^ 40, 't8')",
                "update shop set qty = qty + 1 where id = 4",
                "delete from shop where id = 3")
        _caught_up(runners, cdc_url)
    upstream = source_rows(cdc_url, "select id, qty, tag from shop")
    # the dropped column as of each row's last change before the drop
    note = {2: "n2b", 5: "n5", 7: "n7"}
    model = sorted(((i, q, note.get(i), t) for i, q, t in upstream), key=repr)
    updates = read_updates(cfg, "db", "shop")  # delta-rs's DataFusion reader
    assert set(updates.column("_diff").to_pylist()) == {1}
    assert output_rows(updates.filter(pc.is_null(updates.column("_error"))),
                       ["id", "qty", "note", "tag"]) == model
    assert str(updates.schema.field("qty").type) == "int64"
    out = tmp_path / "state" / "outputs" / "db" / "shop"
    duck = by_duckdb_query(out, f"SELECT id, qty, note, tag FROM delta_scan('{out}')")
    assert sorted(duck, key=repr) == model
    spark_rows = spark_reads([str(out)])[str(out)]
    assert spark_rows["types"] == {"id": "int", "qty": "bigint", "note": "string",
                                   "tag": "string", "_into_time": "bigint"}
    at = [list(spark_rows["types"]).index(c) for c in ["id", "qty", "note", "tag"]]
    assert sorted((tuple(r[i] for i in at) for r in spark_rows["rows"]), key=repr) == model


def test_freeze_and_fail_hold_for_a_state_table(tmp_path: Path, spark: Any,
                                                cdc_url: str) -> None:
    """``freeze``: the table keeps its columns and type, a value the type
    cannot hold is an error row; ``fail``: a definite error, nothing written."""
    cfg = _state_cfg(tmp_path / "f", cdc_url, "fz", "freeze",
                     "create table fz (id int primary key, qty int)",
                     "insert into fz values (1, 1)")
    with running(cfg, spark) as runners:
        snapshot_durable(runners)
        execute(cdc_url,
                "alter table fz add column tag text",
                "insert into fz values (2, 2, 't2')",
                "alter table fz alter column qty type bigint",
                "insert into fz values (3, 3, 't3'), (4, 2 ^ 40, 't4')",
                "update fz set qty = 5 where id = 1")
        _caught_up(runners, cdc_url)
    updates = read_updates(cfg, "db", "fz")
    assert "tag" not in updates.schema.names
    assert str(updates.schema.field("qty").type) == "int32"
    ok = updates.filter(pc.is_null(updates.column("_error")))
    assert output_rows(ok, ["id", "qty"]) == [(1, 5), (2, 2), (3, 3)]
    errors = updates.filter(pc.is_valid(updates.column("_error"))).to_pylist()
    assert len(errors) == 1 and str(2**40) in errors[0]["_error"], errors

    cfg = _state_cfg(tmp_path / "l", cdc_url, "fl", "fail",
                     "create table fl (id int primary key, a int)",
                     "insert into fl values (1, 1)")
    with running(cfg, spark) as runners:
        snapshot_durable(runners)
        execute(cdc_url,
                "alter table fl add column b text",
                "insert into fl values (2, 2, 'two')")
        h = stalled_with(runners, "'b'", "schema_change is fail", "schema_change: evolve")
        assert h.definite
    updates = read_updates(cfg, "db", "fl")
    assert "b" not in updates.schema.names
    assert output_rows(updates, ["id", "a"]) == [(1, 1)]
