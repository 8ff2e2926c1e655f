"""Row digests (reclock/digest.py): equal values hash alike whatever their
Arrow layout, the equality is consolidation's, and different values differ;
checked against a plain-Python model of the values (Hypothesis)."""

from __future__ import annotations

import datetime as dt
import decimal
import math
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reclock import digest
from reclock.digest import column_digests, conform, row_digests, signed, update_digests

pytestmark = pytest.mark.unit


def _key(v: Any) -> Any:
    """The value as consolidation compares it."""
    if isinstance(v, float):
        return "nan" if math.isnan(v) else 0.0 if v == 0 else v
    return v


values = st.one_of(
    st.lists(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)), max_size=30)
    .map(lambda v: pa.array(v, pa.int64())),
    st.lists(st.one_of(st.none(), st.floats(allow_nan=True, width=64)), max_size=30)
    .map(lambda v: pa.array(v, pa.float64())),
    st.lists(st.one_of(st.none(), st.text(max_size=12)), max_size=30)
    .map(lambda v: pa.array(v, pa.string())),
    st.lists(st.one_of(st.none(), st.binary(max_size=12)), max_size=30)
    .map(lambda v: pa.array(v, pa.binary())),
    st.lists(st.one_of(st.none(), st.booleans()), max_size=30)
    .map(lambda v: pa.array(v, pa.bool_())),
)


@settings(max_examples=200, deadline=None)
@given(values)
def test_equal_values_have_equal_digests_and_different_ones_differ(arr: pa.Array) -> None:
    h = column_digests(arr)
    vals = [_key(v) for v in arr.to_pylist()]
    for i in range(len(vals)):
        for j in range(len(vals)):
            assert (h[i] == h[j]) == (vals[i] == vals[j]), (vals[i], vals[j])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.none(), st.text(max_size=40)), min_size=1, max_size=40),
       st.integers(0, 39), st.integers(1, 64))
def test_a_digest_does_not_depend_on_layout(texts: list[str | None], cut: int,
                                            slice_bytes: int) -> None:
    """Chunks, offsets into a buffer, string kinds and the slicing of the
    bytes hashed at once do not change a value's digest."""
    whole = column_digests(pa.array(texts, pa.string()))
    cut = min(cut, len(texts))
    chunked = pa.chunked_array([pa.array(["x", *texts[:cut]], pa.large_string()).slice(1),
                                pa.array(texts[cut:], pa.large_string())])
    assert (column_digests(chunked) == whole).all()
    assert (column_digests(pa.array(texts, pa.string_view())) == whole).all()
    old = digest.SLICE_BYTES
    digest.SLICE_BYTES = slice_bytes
    try:
        assert (column_digests(pa.array(texts, pa.string())) == whole).all()
    finally:
        digest.SLICE_BYTES = old


def test_each_type_hashes_by_value() -> None:
    cases: list[tuple[pa.DataType, list[Any]]] = [
        (pa.int32(), [1, 1, 2, None]),
        (pa.uint64(), [2**64 - 1, 2**64 - 1, 0, None]),
        (pa.float32(), [0.0, -0.0, float("nan"), None]),
        (pa.date32(), [dt.date(2020, 1, 1), dt.date(2020, 1, 1), dt.date(2020, 1, 2), None]),
        (pa.timestamp("us", "UTC"), [dt.datetime(2020, 1, 1, tzinfo=dt.UTC)] * 2
         + [dt.datetime(2021, 1, 1, tzinfo=dt.UTC), None]),
        (pa.decimal128(6, 2), [decimal.Decimal("1.50"), decimal.Decimal("1.5"),
                               decimal.Decimal("2"), None]),
        (pa.binary(2), [b"ab", b"ab", b"ba", None]),
        (pa.list_(pa.int64()), [[1, 2], [1, 2], [2, 1], None]),
        (pa.struct([("a", pa.string())]), [{"a": "x"}, {"a": "x"}, {"a": "y"}, None]),
    ]
    for t, vals in cases:
        h = column_digests(pa.array(vals, t))
        assert h[0] == h[1] and h[0] != h[2] and len(set(h.tolist())) == 3, t
    # a null is a null, whatever its type; and not the digest of a value
    nulls = {int(column_digests(pa.array([None], t))[0]) for t, _ in cases}
    assert len(nulls) == 1
    # a dictionary-encoded column hashes as its values
    plain = pa.array(["a", "b", "a", None])
    assert (column_digests(plain.dictionary_encode()) == column_digests(plain)).all()
    # a column cast to the output's type (conform) hashes as that type's values
    t = pa.table({"n": pa.array([1, None], pa.int32())})
    schema = pa.schema([("n", pa.int64()), ("s", pa.string())])
    fitted = conform(t, schema)
    assert fitted.schema.types == schema.types and fitted.column("s").null_count == 2


def test_rows_and_updates() -> None:
    """A row's digest depends on its columns' order and values; an error row
    is hashed by its raw key and value, apart from data rows; signed digests
    of an insertion and its retraction cancel."""
    t = pa.table({"a": [1, 2, 1, None], "b": ["x", "x", "x", None],
                  "_diff": pa.array([1, 1, -1, 1], pa.int64()),
                  "_error": [None, None, None, "bad json"],
                  "_raw_key": pa.array([None, None, None, b"k"], pa.binary()),
                  "_raw_value": pa.array([None, None, None, b"{"], pa.binary())})
    rows = row_digests(t, ["a", "b"])
    assert rows[0] == rows[2] and rows[0] != rows[1]
    assert (row_digests(t, ["b", "a"])[:3] != rows[:3]).all()  # (row 3: two nulls)
    upd = update_digests(t, ["a", "b"])
    assert (upd[:3] == rows[:3]).all() and upd[3] != rows[3]
    assert upd[3] == update_digests(t.slice(3).set_column(
        t.schema.get_field_index("_error"), "_error", pa.array(["other words"])), ["a", "b"])[0]
    s = signed(t, upd)
    assert s[[0, 2]].sum() == 0  # (array sums wrap silently)
