"""The column history's merge of relation messages the reader could not map
(sources/postgres/history.py), without a server: which column number a name
no column had belongs to, from its position among the table's column
numbers, or a definite error when that cannot be told."""

from __future__ import annotations

import json

import pytest

from reclock.core.errors import DefiniteError
from reclock.sources.postgres import history
from reclock.sources.postgres.catalog import PgColumn, PgTable
from reclock.sources.postgres.types import PgType

INT4 = PgType(23, -1, "integer")
INT8 = PgType(20, -1, "bigint")
TEXT = PgType(25, -1, "text")


def _table(*cols: tuple[int, str, PgType]) -> PgTable:
    return PgTable(oid=7, schema="public", name="t", output="t",
                   columns=tuple(PgColumn(n, ty, False, attnum=a) for a, n, ty in cols),
                   identity="d", key=("id",), primary_key=("id",))


BASE = ((1, "id", INT4), (2, "n", INT4), (3, "b", TEXT))


def _known() -> str:
    return history.merge("src", _table(*BASE), None).fact


def _shape(*cols: tuple[str, PgType]) -> history.Shape:
    return history.Shape(7, tuple(cols))


def _columns(m: history.Merged) -> list[tuple[str, tuple[str, ...], bool, str]]:
    return [(c.name, c.names, c.gone, c.type.name) for c in m.table.columns]


def test_a_column_the_catalog_shows_first_is_pending_until_a_change_names_it() -> None:
    now = _table(*BASE, (4, "n3", INT4))  # added as n2, renamed to n3
    m = history.merge("src", now, _known())
    assert [c.name for c in m.table.columns] == ["id", "n", "b"] and m.pending == ("n3",)
    m2 = history.merge("src", now, m.fact, [_shape(("id", INT4), ("n", INT4), ("b", TEXT),
                                                   ("n2", INT4))], {1: "id", 2: "n", 3: "b",
                                                                    4: "n3"})
    assert _columns(m2)[-1] == ("n2", ("n2", "n3"), False, "integer") and m2.pending == ()
    assert m2.changes == ()  # an addition: the policy meets it as a new output column
    # a snapshot takes a pending column under its name now
    doc = json.loads(history.promote(m.fact, "src", now))
    assert [(c["name"], c.get("pending")) for c in doc["columns"]][-1] == ("n3", None)


def test_a_name_between_known_columns_is_an_earlier_name_or_a_column_added_unseen() -> None:
    # b renamed to c (a change written), then to d; a column x added, written, dropped
    now = _table((1, "id", INT4), (2, "n", INT4), (3, "d", TEXT))
    m = history.merge("src", now, _known())
    attrs = {1: "id", 2: "n", 3: "d", 4: None}
    m2 = history.merge("src", now, m.fact, [
        _shape(("id", INT4), ("n", INT4), ("c", TEXT), ("x", INT8))], attrs)
    assert _columns(m2) == [("id", ("id",), False, "integer"), ("n", ("n",), False, "integer"),
                            ("b", ("b", "c", "d"), False, "text"),
                            ("x", ("x",), True, "bigint")]
    assert [(c.kind, c.column) for c in m2.changes] == [("renamed", "b"), ("dropped", "x")]
    assert "named 'c' for a while" in m2.changes[0].detail
    # taken once, the same message changes nothing more
    m3 = history.merge("src", now, m2.fact, [
        _shape(("id", INT4), ("n", INT4), ("c", TEXT), ("x", INT8))], attrs)
    assert m3.fact == m2.fact and m3.changes == ()


def test_a_wider_type_held_for_a_while_widens_and_an_incompatible_one_is_named() -> None:
    now = _table(*BASE[:2])  # b dropped
    known = _known()
    attrs = {1: "id", 2: "n", 3: None}
    m = history.merge("src", now, known, [_shape(("id", INT4), ("n", INT8), ("b", TEXT))],
                      attrs)
    assert [c.type.name for c in m.table.columns] == ["integer", "bigint", "text"]
    with pytest.raises(DefiniteError, match=r"column 'n' changed type upstream to text"):
        history.merge("src", now, known, [_shape(("id", INT4), ("n", TEXT))], attrs)


def test_a_live_column_numbered_below_one_the_message_lists_was_listed_too() -> None:
    # x added (4) and renamed to y, z added (5): a message [id, n, b, x] is 4, not 5,
    # since 4 is live now and numbered below 5, so a message listing 5 lists 4
    now = _table(*BASE, (4, "y", INT4), (5, "z", INT4))
    m = history.merge("src", now, _known())
    m2 = history.merge("src", now, m.fact, [
        _shape(("id", INT4), ("n", INT4), ("b", TEXT), ("x", INT4))],
        {1: "id", 2: "n", 3: "b", 4: "y", 5: "z"})
    assert [(c.name, c.names) for c in m2.table.columns][-1] == ("x", ("x", "y"))
    assert m2.pending == ("z",)


@pytest.mark.parametrize("attrs, listed, why", [
    ({1: "id", 2: "n", 3: "b", 4: None, 5: None}, False, "cannot be told"),
    ({1: "id", 2: "n", 3: "b"}, False, "no column of the table fits"),
    ({1: "id", 2: "n", 3: "b", 4: None}, True, "publication lists"),
], ids=["two-dropped", "none", "column-list"])
def test_a_placement_that_is_not_one_is_a_definite_error(
        attrs: dict[int, str | None], listed: bool, why: str) -> None:
    with pytest.raises(DefiniteError) as err:
        history.merge("src", _table(*BASE), _known(), [
            _shape(("id", INT4), ("n", INT4), ("b", TEXT), ("x", INT4))], attrs, listed)
    text = str(err.value)
    assert '"public"."t"' in text and "['x']" in text and why in text
    assert "drop the output and the source's state" in text


def test_a_changed_table_oid_in_a_message_is_named() -> None:
    with pytest.raises(DefiniteError, match="dropped and created again"):
        history.merge("src", _table(*BASE), _known(), [history.Shape(8, (("id", INT4),))],
                      {1: "id", 2: "n", 3: "b"})
