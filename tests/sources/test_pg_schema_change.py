"""Schema changes upstream of a Postgres source, with the driver running and
while it is stopped: each output ends holding what the table holds (every
row once, no value lost) or stalls with a definite error naming the change
and the way out (the output's ``schema_change`` policy)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pyarrow.compute as pc
import pytest

from tests.running import (
    read_updates,
    request_resnapshot,
    running,
    snapshot_durable,
    stalled_with,
    wait_for,
)
from tests.sources.cdc import (
    drop_source_state,
    flushed_lsn,
    output_rows,
    resumed_past,
    source_rows,
)
from tests.sources.test_pg_faults import _cfg


def _caught_up(runners: list[Any], url: str) -> None:
    """The changes so far are durable and the source runs (a change of shape
    stalls it for a moment, transiently, while it re-opens in the new shape,
    possibly after the changes are durable); a definite stall fails."""
    durable = resumed_past(runners, flushed_lsn(url))
    wait_for(lambda: (durable() and runners[0].health.status == "running")
             or runners[0].health.definite, 90, "the changes to be durable")
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
        snapshot_durable(runners)
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
        snapshot_durable(runners)
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("update ren set b = 'uno' where id = 1")
            c.execute("alter table ren rename column b to c")
            c.execute("update ren set c = 'dos' where id = 2")
            c.execute("insert into ren values (3, 3, 'three')")
        _caught_up(runners, cdc_url)
    upstream = source_rows(cdc_url, "select id, a, c from ren")
    assert output_rows(read_updates(cfg, "db", "ren"), ["id", "a", "b"]) == upstream


def _policy_cfg(tmp_path: Path, url: str, table: str, policy: str) -> Any:
    return _cfg(tmp_path, url, table,
                f"      - {{name: {table}, sink: file, schema_change: {policy}}}")


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_add_drop_and_widen_evolve_the_output(tmp_path: Path, spark: Any, cdc_url: str,
                                              stopped: bool) -> None:
    """A keyed table gains a column, loses one and widens one, with the driver
    running or stopped across it: the output holds every row as upstream
    holds it, plus the dropped column's values as they were before the drop
    (rows not changed since keep them, rows changed since hold null)."""
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table shop (id int primary key, qty int, note text)")
        c.execute("insert into shop values (1, 1, 'n1'), (2, 2, 'n2'), (3, 3, 'n3')")
    cfg = _cfg(tmp_path, cdc_url, "shop", "      - {name: shop, sink: file}")

    def change() -> None:
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("update shop set note = 'n2b' where id = 2")  # before the drop
            c.execute("alter table shop add column tag text")
            c.execute("insert into shop values (4, 4, 'n4', 't4')")
            c.execute("alter table shop drop column note")
            c.execute("update shop set tag = 't1' where id = 1")  # after it: note is null
            c.execute("alter table shop alter column qty type bigint")
            c.execute("insert into shop values (5, 2 ^ 40, 't5')")
            c.execute("delete from shop where id = 3")

    with running(cfg, spark) as runners:
        snapshot_durable(runners)
        if not stopped:
            change()
        _caught_up(runners, cdc_url)
    if stopped:
        change()
        with running(cfg, spark) as runners:
            _caught_up(runners, cdc_url)
    upstream = source_rows(cdc_url, "select id, qty, tag from shop")
    note = {2: "n2b", 4: "n4"}  # the dropped column, as of each row's last change
    model = sorted(((i, q, note.get(i), t) for i, q, t in upstream), key=repr)
    updates = read_updates(cfg, "db", "shop")
    assert output_rows(updates, ["id", "qty", "note", "tag"]) == model
    assert str(updates.schema.field("qty").type) == "int64"


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_a_dropped_column_of_a_diff_log_is_named(tmp_path: Path, spark: Any, cdc_url: str,
                                                 stopped: bool) -> None:
    """A diff log (REPLICA IDENTITY FULL) retracts rows whole: once a column
    is dropped a retraction cannot match what the output holds, so the drop
    is a definite error with the way out, never a row left at -1."""
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table dl (id int primary key, v text, w text)")
        c.execute("alter table dl replica identity full")
        c.execute("insert into dl values (1, 'a', 'x')")
    cfg = _cfg(tmp_path, cdc_url, "dl", "      - {name: dl, sink: file}")

    def change() -> None:
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("alter table dl drop column w")
            c.execute("update dl set v = 'b' where id = 1")

    with running(cfg, spark) as runners:
        snapshot_durable(runners)
        if not stopped:
            change()
            h = stalled_with(runners, '"public"."dl"', "['w']", "diff log", "primary key")
            assert h.definite
    if stopped:
        change()
        with running(cfg, spark) as runners:
            h = stalled_with(runners, '"public"."dl"', "['w']", "diff log", "primary key")
            assert h.definite
    # what was accepted stays, every row once
    assert output_rows(read_updates(cfg, "db", "dl"), ["id", "v", "w"]) == [(1, "a", "x")]


def test_the_way_out_of_a_refused_drop_reads_the_table_in_its_shape_now(
        tmp_path: Path, spark: Any, cdc_url: str) -> None:
    """After a diff log's refused drop, the way out its error names (drop the
    output and the source's state) takes a new snapshot; the changes the
    slot still holds from before it are dropped for that output, also those
    written under a shape the new output never had (a column added and
    dropped again while the source was stalled): the source runs, and the
    output holds the table."""
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table wo (id int primary key, v text, w text)")
        c.execute("alter table wo replica identity full")
        c.execute("insert into wo values (1, 'a', 'x'), (2, 'b', 'y')")
    cfg = _cfg(tmp_path, cdc_url, "wo", "      - {name: wo, sink: file}")
    with running(cfg, spark) as runners:
        snapshot_durable(runners)
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("alter table wo drop column w")
            c.execute("update wo set v = 'b2' where id = 2")
        stalled_with(runners, '"public"."wo"', "['w']", "drop the output and the source's state")
        with psycopg.connect(cdc_url, autocommit=True) as c:  # while it is stalled
            c.execute("alter table wo add column t text")
            c.execute("insert into wo values (3, 'c', 't3')")
            c.execute("alter table wo drop column t")
            c.execute("update wo set v = 'a2' where id = 1")
    drop_source_state(cfg, "db")
    with running(cfg, spark) as runners:
        snapshot_durable(runners)
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("insert into wo values (4, 'd')")
        _caught_up(runners, cdc_url)
    updates = read_updates(cfg, "db", "wo")
    assert [c for c in updates.column_names if not c.startswith("_")] == ["id", "v"]
    assert output_rows(updates, ["id", "v"]) == source_rows(cdc_url, "select id, v from wo")


def test_freeze_keeps_the_columns_and_counts_what_it_drops(tmp_path: Path, spark: Any,
                                                           cdc_url: str) -> None:
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table fz (id int primary key, qty int)")
        c.execute("insert into fz values (1, 1)")
    cfg = _policy_cfg(tmp_path, cdc_url, "fz", "freeze")
    with running(cfg, spark) as runners:
        snapshot_durable(runners)
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("alter table fz add column tag text")
            c.execute("insert into fz values (2, 2, 't2'), (3, 3, null)")
        _caught_up(runners, cdc_url)
        assert runners[0].outputs[0].dropped.counts == {"tag": 1}
    with psycopg.connect(cdc_url, autocommit=True) as c:  # stopped: a widening
        c.execute("alter table fz alter column qty type bigint")
        c.execute("insert into fz values (4, 4, 't4'), (5, 2 ^ 40, 't5')")
    with running(cfg, spark) as runners:
        _caught_up(runners, cdc_url)
    updates = read_updates(cfg, "db", "fz")
    assert "tag" not in updates.schema.names
    assert str(updates.schema.field("qty").type) == "int32"  # today's type, kept
    assert output_rows(updates.filter(pc.is_null(updates.column("_error"))), ["id", "qty"]) == [
        (1, 1), (2, 2), (3, 3), (4, 4)]
    # the value qty cannot hold is an error row naming it, never dropped silently
    errors = updates.filter(pc.is_valid(updates.column("_error"))).to_pylist()
    assert len(errors) == 1 and str(2**40) in errors[0]["_error"], errors
    events = (tmp_path / "state" / "progress.jsonl").read_text()
    assert '"dropping_values_of":"tag"' in events


def test_fail_names_each_change_and_the_way_out(tmp_path: Path, spark: Any, cdc_url: str
                                                ) -> None:
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table fl (id int primary key, a int, b text)")
        c.execute("insert into fl values (1, 1, 'one')")
    cfg = _policy_cfg(tmp_path, cdc_url, "fl", "fail")
    with running(cfg, spark) as runners:
        snapshot_durable(runners)
    with psycopg.connect(cdc_url, autocommit=True) as c:  # stopped: a rename
        c.execute("alter table fl rename column b to c")
        c.execute("insert into fl values (2, 2, 'two')")
    with running(cfg, spark) as runners:
        h = stalled_with(runners, "'b' renamed upstream", "now named 'c'",
                         "schema_change is fail", "schema_change: evolve")
        assert h.definite
    with running(cfg, spark) as runners:  # still refused: nothing was taken
        stalled_with(runners, "'b' renamed upstream")
    cfg = _policy_cfg(tmp_path, cdc_url, "fl", "evolve")
    with running(cfg, spark) as runners:
        _caught_up(runners, cdc_url)
    assert output_rows(read_updates(cfg, "db", "fl"), ["id", "a", "b"]) == [
        (1, 1, "one"), (2, 2, "two")]


@pytest.mark.parametrize("identity", ["key", "full"])
def test_widened_then_renamed_while_running_widens_the_output(
        tmp_path: Path, spark: Any, cdc_url: str, identity: str) -> None:
    """A column widened and then renamed before the running driver read a
    change written in between: that change names the column by its old name
    with the wider type, which the catalog (by that name) no longer has. The
    output widens its column and keeps every value, under its name."""
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table wr (id int primary key, n int, b text)")
        if identity == "full":
            c.execute("alter table wr replica identity full")
        c.execute("insert into wr values (1, 1, 'one')")
    cfg = _cfg(tmp_path, cdc_url, "wr", "      - {name: wr, sink: file}")
    with running(cfg, spark) as runners:
        snapshot_durable(runners)
        with psycopg.connect(cdc_url) as c, c.transaction():  # read after it all committed
            c.execute("alter table wr alter column n type bigint")
            c.execute("insert into wr values (2, 2 ^ 40, 'two')")
            c.execute("update wr set n = n + 1 where id = 1")
            c.execute("alter table wr rename column n to m")
            c.execute("insert into wr values (3, -2 ^ 41, 'three')")
        _caught_up(runners, cdc_url)
    updates = read_updates(cfg, "db", "wr")
    assert str(updates.schema.field("n").type) == "int64"
    assert output_rows(updates, ["id", "n", "b"]) == source_rows(cdc_url,
                                                                "select id, m, b from wr")


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_a_column_added_with_a_default_to_a_diff_log_is_named(
        tmp_path: Path, spark: Any, cdc_url: str, stopped: bool) -> None:
    """A column added with a default gives the rows a table holds a value
    that no change carried: the output holds them null (the rule for every
    added column), while a later change's old row carries the default, so a
    diff log's retraction would not match the row it holds. That is a
    definite error naming the table, the column and the way out, and what
    was accepted stays, every row once (never a row left at -1)."""
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table ad (id int primary key, v text)")
        c.execute("alter table ad replica identity full")
        c.execute("insert into ad values (1, 'a'), (2, 'b')")
    cfg = _cfg(tmp_path, cdc_url, "ad", "      - {name: ad, sink: file}")

    def change() -> None:
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("alter table ad add column d text default 'dflt'")
            c.execute("update ad set v = 'b2' where id = 2")

    words = ('"public"."ad"', "['d']", "with a default", "diff log",
             "drop the output and the source's state")
    with running(cfg, spark) as runners:
        snapshot_durable(runners)
        if not stopped:
            change()
            assert stalled_with(runners, *words).definite
    if stopped:
        change()
        with running(cfg, spark) as runners:
            assert stalled_with(runners, *words).definite
    assert output_rows(read_updates(cfg, "db", "ad"), ["id", "v"]) == [(1, "a"), (2, "b")]


def test_a_column_added_with_a_default_is_null_on_earlier_rows_of_a_keyed_output(
        tmp_path: Path, spark: Any, cdc_url: str) -> None:
    """A keyed output retracts by key: a column added with a default is
    taken, null on the rows written before it (docs/schema-changes.md)."""
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table akd (id int primary key, v text)")
        c.execute("insert into akd values (1, 'a'), (2, 'b')")
    cfg = _cfg(tmp_path, cdc_url, "akd", "      - {name: akd, sink: file}")
    with running(cfg, spark) as runners:
        snapshot_durable(runners)
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("alter table akd add column d text default 'dflt'")
            c.execute("update akd set v = 'b2' where id = 2")
            c.execute("insert into akd values (3, 'c', 'own')")
        _caught_up(runners, cdc_url)
    assert output_rows(read_updates(cfg, "db", "akd"), ["id", "v", "d"]) == [
        (1, "a", None), (2, "b2", "dflt"), (3, "c", "own")]


def _unseen_in_between(tmp_path: Path, spark: Any, url: str, table: str, stopped: bool,
                       create: str, statements: list[str]) -> tuple[Any, Any]:
    """``create`` the table (one row), snapshot it, then run ``statements``
    with the driver stopped, or with it running in one transaction (its
    reader reads the changes in between only once all committed: after the
    second change of shape); returns the config and the source's health once
    it caught up and runs, or stalled for good."""
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(create)
    cfg = _cfg(tmp_path, url, table, f"      - {{name: {table}, sink: file}}")

    def change() -> None:
        with psycopg.connect(url) as c, c.transaction():
            for stmt in statements:
                c.execute(stmt)

    def caught_up(runners: list[Any]) -> Any:
        # a change of shape stalls the source for a moment (transient: it
        # re-opens in the new shape), possibly after its changes are durable
        durable = resumed_past(runners, flushed_lsn(url))
        wait_for(lambda: (durable() and runners[0].health.status == "running")
                 or runners[0].health.definite, 90, "durable and running, or a stall")
        return runners[0].health

    with running(cfg, spark) as runners:
        snapshot_durable(runners)
        if not stopped:
            change()
            return cfg, caught_up(runners)
    change()
    with running(cfg, spark) as runners:
        return cfg, caught_up(runners)


def _user_columns(updates: Any) -> list[str]:
    return [c for c in updates.column_names if not c.startswith("_")]


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
@pytest.mark.parametrize("first, then, value, want", [
    ("alter column n type bigint", "drop column n", "2 ^ 40", 2**40),
    ("add column n2 int", "drop column n2", "7", 7),
    ("add column n2 int", "rename column n2 to n3", "7", 7),
], ids=["widened-dropped", "added-dropped", "added-renamed"])
def test_two_shape_changes_unseen_in_between_keep_the_values_written_between(
        tmp_path: Path, spark: Any, cdc_url: str, first: str, then: str, value: str,
        want: int, stopped: bool) -> None:
    """docs/schema-changes.md's rules: a widened column widens the output's, an added one
    is added, a dropped one stays (null from then on), a renamed one keeps
    its output name; the change written between the two lands. The output
    ends the same whether the driver was stopped across both changes or
    read the change in between only after both."""
    col = first.split()[2]
    cfg, health = _unseen_in_between(
        tmp_path, spark, cdc_url, "wd", stopped,
        "create table wd (id int primary key, n int, b text); "
        "insert into wd values (1, 1, 'a')",
        [f"alter table wd {first}", f"insert into wd (id, b, {col}) values (2, 'b', {value})",
         f"alter table wd {then}",
         # a renamed column: a change under its new name lands in its output column too
         *(["update wd set b = 'b2' where id = 2"] if then.startswith("rename") else [])])
    assert health.status == "running", health
    updates = read_updates(cfg, "db", "wd")
    rows = output_rows(updates, ["id", col])
    assert rows == [(1, 1 if col == "n" else None), (2, want)]
    # the added column under the name the change in between carried it, once
    assert _user_columns(updates) == ["id", "n", "b", *([col] if col != "n" else [])]
    if col == "n":
        assert str(updates.schema.field("n").type) == "int64"
    if then.startswith("rename"):
        assert output_rows(updates, ["id", "b"]) == [(1, "a"), (2, "b2")]


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
@pytest.mark.parametrize("identity", ["key", "full"])
def test_two_renames_in_a_row_keep_the_output_name(
        tmp_path: Path, spark: Any, cdc_url: str, identity: str, stopped: bool) -> None:
    """A column renamed twice, a change written under its middle name that
    the source reads only after the second rename: the middle name is one
    the catalog never showed, found by the column's position; every change
    lands in the output's column, retractions match."""
    full = "; alter table rr replica identity full" if identity == "full" else ""
    cfg, health = _unseen_in_between(
        tmp_path, spark, cdc_url, "rr", stopped,
        "create table rr (id int primary key, a int, b text, z int)" + full
        + "; insert into rr values (1, 1, 'one', 1), (2, 2, 'two', 2)",
        ["alter table rr rename column b to c", "update rr set c = 'uno' where id = 1",
         "insert into rr values (3, 3, 'three', 3)", "alter table rr rename column c to d",
         "update rr set d = 'dos' where id = 2", "delete from rr where id = 3"])
    assert health.status == "running", health
    updates = read_updates(cfg, "db", "rr")
    assert _user_columns(updates) == ["id", "a", "b", "z"]
    assert output_rows(updates, ["id", "a", "b", "z"]) == source_rows(
        cdc_url, "select id, a, d, z from rr")


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_a_type_held_for_a_while_widens_the_output(tmp_path: Path, spark: Any, cdc_url: str,
                                                   stopped: bool) -> None:
    """A column widened, a value only the wider type holds written, then
    narrowed back: the catalog shows the old type, the change in between
    the wider one. The output widens (schema_change: evolve) and holds it."""
    cfg, health = _unseen_in_between(
        tmp_path, spark, cdc_url, "tw", stopped,
        "create table tw (id int primary key, n int); insert into tw values (1, 1)",
        ["alter table tw alter column n type bigint", "insert into tw values (2, 2 ^ 40)",
         "insert into tw values (3, -2 ^ 41)", "update tw set n = 2 where id = 2",
         "update tw set n = 3 where id = 3", "alter table tw alter column n type int",
         "insert into tw values (4, 4)"])
    assert health.status == "running", health
    updates = read_updates(cfg, "db", "tw")
    assert str(updates.schema.field("n").type) == "int64"
    assert output_rows(updates, ["id", "n"]) == [(1, 1), (2, 2), (3, 3), (4, 4)]
    held = set(updates.column("n").to_pylist())  # the values written in between landed
    assert {2**40, -2**41} <= held, held


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_columns_whose_numbers_cannot_be_told_are_named(tmp_path: Path, spark: Any,
                                                        cdc_url: str, stopped: bool) -> None:
    """Two columns added and dropped, a change written while the first one
    was there: its column number may be either dropped one. That is a
    definite error naming the table, the column and the way out; what was
    accepted stays."""
    cfg, health = _unseen_in_between(
        tmp_path, spark, cdc_url, "amb", stopped,
        "create table amb (id int primary key, v text); insert into amb values (1, 'a')",
        ["alter table amb add column x int", "insert into amb values (2, 'b', 2)",
         "alter table amb drop column x", "alter table amb add column w int",
         "alter table amb drop column w", "insert into amb values (3, 'c')"])
    assert health.status == "stalled" and health.definite, health
    text = f"{health.error} {health.hint}"
    for words in ('"public"."amb"', "['x']", "cannot be told", "drop the output and the "
                  "source's state"):
        assert words in text, text
    assert output_rows(read_updates(cfg, "db", "amb"), ["id", "v"]) == [(1, "a")]


def test_a_new_snapshot_reads_a_column_no_change_carried_yet(tmp_path: Path, spark: Any,
                                                             cdc_url: str) -> None:
    """A column added while the driver is stopped, that no change carries
    yet, is not an output column (the first change that carries it names
    it); a new snapshot of the output (``reclock resnapshot``) reads the
    table as it is, that column too, under its name now."""
    from reclock.runtime.resnapshot import Requests

    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table ns (id int primary key, v text)")
        c.execute("insert into ns values (1, 'a'), (2, 'b')")
    cfg = _cfg(tmp_path, cdc_url, "ns", "      - {name: ns, sink: file}")
    with running(cfg, spark) as runners:
        snapshot_durable(runners)
    with psycopg.connect(cdc_url, autocommit=True) as c:  # the driver is stopped
        c.execute("alter table ns add column d int default 5")
    with running(cfg, spark) as runners:
        _caught_up(runners, cdc_url)
    assert _user_columns(read_updates(cfg, "db", "ns")) == ["id", "v"]
    request_resnapshot(cfg, "db", "ns")
    requests = Requests(tmp_path / "state", "db")
    with running(cfg, spark) as runners:
        wait_for(lambda: not requests.pending(), 90,
                 lambda: f"the resnapshot {requests.pending()}: {runners[0].health}")
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("insert into ns values (3, 'c')")
        _caught_up(runners, cdc_url)
    updates = read_updates(cfg, "db", "ns")
    assert _user_columns(updates) == ["id", "v", "d"]
    assert output_rows(updates, ["id", "v", "d"]) == [(1, "a", 5), (2, "b", 5), (3, "c", 5)]
