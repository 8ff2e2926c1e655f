"""Schema changes upstream of a Postgres source, with the driver running and
while it is stopped: each output ends holding what the table holds (every
row once, no value lost) or stalls with a definite error naming the change
and the way out (the output's ``schema_change`` policy)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.running import read_updates, running, wait_for
from tests.sources.cdc import flushed_lsn, output_rows, resumed_past, source_rows
from tests.sources.test_pg_faults import _cfg, _snapshot_durable


def _caught_up(runners: list[Any], url: str) -> None:
    wait_for(resumed_past(runners, flushed_lsn(url)), 90, "the changes to be durable")
    assert runners[0].health.status == "running", runners[0].health


@pytest.mark.parametrize("identity", ["key", "full"])
def test_rename_while_stopped_keeps_every_value(tmp_path: Path, spark: Any, cdc_url: str,
                                                identity: str) -> None:
    """A column renamed while the driver is stopped: changes written before
    the rename (under the old name) and after it (under the new one) land in
    the output's column, retractions match what was inserted."""
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table ren (id int primary key, a int, b text)")
        if identity == "full":
            c.execute("alter table ren replica identity full")
        c.execute("insert into ren values (1, 1, 'one'), (2, 2, 'two'), (4, 4, 'four')")
    cfg = _cfg(tmp_path, cdc_url, "ren", "      - {name: ren, sink: file}")
    with running(cfg, spark) as runners:
        _snapshot_durable(runners)
        _caught_up(runners, cdc_url)
    with psycopg.connect(cdc_url, autocommit=True) as c:  # the driver is stopped
        c.execute("update ren set b = 'uno' where id = 1")
        c.execute("alter table ren rename column b to c")
        c.execute("update ren set c = 'dos' where id = 2")
        c.execute("insert into ren values (3, 3, 'three')")
        c.execute("delete from ren where id = 4")
    with running(cfg, spark) as runners:
        _caught_up(runners, cdc_url)
        with psycopg.connect(cdc_url, autocommit=True) as c:  # and running again
            c.execute("update ren set c = 'eins' where id = 1")
        _caught_up(runners, cdc_url)
    upstream = source_rows(cdc_url, "select id, a, c from ren")
    assert upstream == [(1, 1, "eins"), (2, 2, "dos"), (3, 3, "three")]
    # the output keeps its column's name: b holds what upstream's c holds
    assert output_rows(read_updates(cfg, "db", "ren"), ["id", "a", "b"]) == upstream


@pytest.mark.parametrize("identity", ["key", "full"])
def test_rename_while_running_keeps_every_value(tmp_path: Path, spark: Any, cdc_url: str,
                                                identity: str) -> None:
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table ren (id int primary key, a int, b text)")
        if identity == "full":
            c.execute("alter table ren replica identity full")
        c.execute("insert into ren values (1, 1, 'one'), (2, 2, 'two')")
    cfg = _cfg(tmp_path, cdc_url, "ren", "      - {name: ren, sink: file}")
    with running(cfg, spark) as runners:
        _snapshot_durable(runners)
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("update ren set b = 'uno' where id = 1")
            c.execute("alter table ren rename column b to c")
            c.execute("update ren set c = 'dos' where id = 2")
            c.execute("insert into ren values (3, 3, 'three')")
        _caught_up(runners, cdc_url)
    upstream = source_rows(cdc_url, "select id, a, c from ren")
    assert output_rows(read_updates(cfg, "db", "ren"), ["id", "a", "b"]) == upstream
