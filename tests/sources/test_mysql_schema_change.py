"""Schema changes upstream of a MariaDB source, with the driver running and
while it is stopped: columns added and dropped under each ``schema_change``
policy. Each output ends holding what the table holds (every row once, a
dropped column's values as they were before the drop) or stalls with a
definite error naming the change and the way out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest

from reclock.config import load_config
from tests.running import read_updates, running, stalled_with, wait_for
from tests.sources.cdc import output_rows
from tests.sources.mycdc import binlog_pos, connect, passed, source_rows


def _cfg(tmp: Path, url: str, table: str, policy: str = "evolve") -> Any:
    path = tmp / "p.yaml"
    path.write_text(f"""
state_dir: {tmp}/state
timestamp_interval: 200ms
sources:
  - name: db
    mysql: {{url: "{url}", tables: [{table}]}}
    outputs:
      - {{name: {table}, sink: file, schema_change: {policy}}}
""")
    return load_config(path)


def _sql(url: str, *statements: str) -> None:
    with connect(url) as c, c.cursor() as cur:
        for q in statements:
            cur.execute(q)
        c.commit()


def _caught_up(runners: list[Any], url: str) -> None:
    # (a change of shape stalls the source for a moment, transiently, while it
    # re-opens in the new shape, possibly after the changes are durable)
    at = binlog_pos(url)
    wait_for(lambda: (passed(runners[0].status().get("resume"), at)
                      and runners[0].health.status == "running")
             or runners[0].health.definite, 90,
             lambda: f"the changes to be durable (health {runners[0].health})")
    assert runners[0].health.status == "running", runners[0].health


CHANGES = ("update shop set note = 'n2b' where id = 2",  # before the drop
           "alter table shop add column tag varchar(10)",
           "insert into shop values (4, 4, 'n4', 't4')",
           "alter table shop drop column note",
           "update shop set tag = 't1' where id = 1",  # after it: note is null
           "delete from shop where id = 3")


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_add_and_drop_evolve_the_output(tmp_path: Path, spark: Any, mysql_url: str,
                                        stopped: bool) -> None:
    _sql(mysql_url, "create table shop (id int primary key, qty int, note varchar(10))",
         "insert into shop values (1, 1, 'n1'), (2, 2, 'n2'), (3, 3, 'n3')")
    cfg = _cfg(tmp_path, mysql_url, "shop")
    with running(cfg, spark) as runners:
        _caught_up(runners, mysql_url)
        if not stopped:
            _sql(mysql_url, *CHANGES)
            _caught_up(runners, mysql_url)
    if stopped:
        _sql(mysql_url, *CHANGES)
        with running(cfg, spark) as runners:
            _caught_up(runners, mysql_url)
    upstream = source_rows(mysql_url, "select id, qty, tag from shop")
    note = {2: "n2b", 4: "n4"}  # the dropped column, as of each row's last change
    model = sorted(((i, q, note.get(i), t) for i, q, t in upstream), key=repr)
    assert output_rows(read_updates(cfg, "db", "shop"), ["id", "qty", "note", "tag"]) == model


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_freeze_keeps_the_columns_and_counts_what_it_drops(tmp_path: Path, spark: Any,
                                                           mysql_url: str, stopped: bool
                                                           ) -> None:
    _sql(mysql_url, "create table fz (id int primary key, qty int)",
         "insert into fz values (1, 1)")
    cfg = _cfg(tmp_path, mysql_url, "fz", "freeze")
    changes = ("alter table fz add column tag varchar(10)",
               "insert into fz values (2, 2, 't2'), (3, 3, null)")
    with running(cfg, spark) as runners:
        _caught_up(runners, mysql_url)
        if not stopped:
            _sql(mysql_url, *changes)
            _caught_up(runners, mysql_url)
            assert runners[0].outputs[0].dropped.counts == {"tag": 1}
    if stopped:
        _sql(mysql_url, *changes)
        with running(cfg, spark) as runners:
            _caught_up(runners, mysql_url)
            assert runners[0].outputs[0].dropped.counts == {"tag": 1}
    updates = read_updates(cfg, "db", "fz")
    assert "tag" not in updates.schema.names
    assert updates.filter(pc.is_valid(updates.column("_error"))).num_rows == 0
    assert output_rows(updates, ["id", "qty"]) == source_rows(mysql_url,
                                                              "select id, qty from fz")
    events = (tmp_path / "state" / "progress.jsonl").read_text()
    assert '"dropping_values_of":"tag"' in events


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_fail_names_the_change_and_the_way_out(tmp_path: Path, spark: Any, mysql_url: str,
                                               stopped: bool) -> None:
    _sql(mysql_url, "create table fl (id int primary key, a int, b varchar(10))",
         "insert into fl values (1, 1, 'one')")
    cfg = _cfg(tmp_path, mysql_url, "fl", "fail")
    changes = ("alter table fl drop column b", "insert into fl values (2, 2)")
    with running(cfg, spark) as runners:
        _caught_up(runners, mysql_url)
        if not stopped:
            _sql(mysql_url, *changes)
            h = stalled_with(runners, "'b' dropped upstream", "schema_change is fail",
                             "schema_change: evolve")
            assert h.definite
    if stopped:
        _sql(mysql_url, *changes)
        with running(cfg, spark) as runners:
            h = stalled_with(runners, "'b' dropped upstream", "schema_change is fail")
            assert h.definite
    assert output_rows(read_updates(cfg, "db", "fl"), ["id", "a", "b"]) == [(1, 1, "one")]
    cfg = _cfg(tmp_path, mysql_url, "fl", "evolve")  # taking it loses nothing
    with running(cfg, spark) as runners:
        _caught_up(runners, mysql_url)
    assert output_rows(read_updates(cfg, "db", "fl"), ["id", "a", "b"]) == [
        (1, 1, "one"), (2, 2, None)]
