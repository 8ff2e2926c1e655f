"""The schema-change policy (reclock/core/schema_change.py) and the union of
Avro writer schemas (reclock/formats/avro_union.py): pure functions, checked
against hand-written expectations and, for ``widens``, against Arrow's own
casts (a widening never loses a value)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reclock.core.errors import DefiniteError
from reclock.core.schema_change import Change, compare, decide, widens
from reclock.formats import avro_union as au

TODAY = pa.schema([pa.field("id", pa.int64()), pa.field("qty", pa.int32()),
                   pa.field("note", pa.string())])


def test_widens_is_exact() -> None:
    assert widens(pa.int32(), pa.int64()) and widens(pa.float32(), pa.float64())
    assert widens(pa.int32(), pa.float64()) and widens(pa.uint32(), pa.int64())
    assert widens(pa.decimal128(10, 2), pa.decimal128(12, 2))
    assert not widens(pa.int64(), pa.int32()) and not widens(pa.int64(), pa.float64())
    assert not widens(pa.decimal128(10, 2), pa.decimal128(10, 3))
    assert not widens(pa.int32(), pa.string()) and not widens(pa.uint64(), pa.int64())
    assert widens(pa.struct([("a", pa.int32())]),
                  pa.struct([("a", pa.int64()), ("b", pa.string())]))


@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20))
def test_a_widening_keeps_every_value(values: list[int]) -> None:
    arr = pa.array(values, pa.int32())
    for t in (pa.int64(), pa.float64()):
        assert widens(arr.type, t)
        assert arr.cast(t).cast(pa.int32()).to_pylist() == values


def test_evolve_adds_and_widens_keeps_what_upstream_dropped() -> None:
    up = pa.schema([pa.field("id", pa.int64()), pa.field("qty", pa.int64()),
                    pa.field("tag", pa.string())])
    d = decide("o", "o", "evolve", TODAY, up)
    assert d.schema == pa.schema([pa.field("id", pa.int64()), pa.field("qty", pa.int64()),
                                  pa.field("note", pa.string()), pa.field("tag", pa.string())])
    assert {(c.kind, c.column) for c in d.changes} == {
        ("widened", "qty"), ("added", "tag"), ("dropped", "note")}


def test_freeze_keeps_today_and_names_what_it_drops() -> None:
    up = pa.schema([pa.field("id", pa.int64()), pa.field("qty", pa.int64()),
                    pa.field("note", pa.string()), pa.field("tag", pa.string())])
    d = decide("o", "o", "freeze", TODAY, up)
    assert d.schema == TODAY and d.dropped == ("tag",) and d.kept_types == ("qty",)


def test_fail_refuses_any_change_and_every_policy_an_incompatible_one() -> None:
    with pytest.raises(DefiniteError, match="schema_change is fail: column 'tag' added upstream"):
        decide("o", "o", "fail", TODAY, TODAY.append(pa.field("tag", pa.string())))
    with pytest.raises(DefiniteError, match="'b' renamed upstream"):
        decide("o", "o", "fail", TODAY, TODAY, [Change("renamed", "b", "now named 'c'")])
    assert decide("o", "o", "fail", TODAY, TODAY).schema == TODAY
    retyped = pa.schema([pa.field("id", pa.int64()), pa.field("qty", pa.string()),
                         pa.field("note", pa.string())])
    for policy in ("evolve", "freeze", "fail"):
        with pytest.raises(DefiniteError, match="'qty' changed type upstream") as err:
            decide("what", "o", policy, TODAY, retyped)  # type: ignore[arg-type]
        assert "resnapshot" in str(err.value)
    # a narrowing needs nothing: the output's wider column holds the values
    narrowed = pa.schema([pa.field("id", pa.int32()), pa.field("qty", pa.int32()),
                          pa.field("note", pa.string())])
    assert decide("o", "o", "evolve", TODAY, narrowed).schema == TODAY
    assert [c.kind for c in compare(TODAY, narrowed)] == ["narrowed"]


def rec(*fields: dict[str, object]) -> dict[str, object]:
    return {"type": "record", "name": "R", "fields": list(fields)}


def test_avro_union_promotes_defaults_and_refuses() -> None:
    v1 = rec({"name": "id", "type": "long"}, {"name": "n", "type": "int"},
             {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A"]}})
    v2 = rec({"name": "id", "type": "long"}, {"name": "n", "type": "long"},
             {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B"]}},
             {"name": "s", "type": "string", "default": "none"})
    u = au.to_json(au.merge(au.merge(None, au.expand(v1)), au.expand(v2)))
    assert u["fields"] == [
        {"name": "id", "type": "long"}, {"name": "n", "type": "long"},
        {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B"]}},
        {"name": "s", "type": ["string", "null"], "default": "none"}]
    with pytest.raises(au.Incompatible, match="'n': long and double"):
        au.merge(au.expand(u), au.expand(rec({"name": "n", "type": "double"})))
    # a declared reader met by a writer in any order: a required field is merged nullable
    loose = au.merge(au.expand(u), au.expand(rec({"name": "x", "type": "int"})), strict=False)
    assert loose["fields"][-1] == {"name": "x", "type": ["null", "int"], "default": None}
