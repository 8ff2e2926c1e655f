"""PostgreSQL text values to Arrow: arrays, numerics, type widening, and
errors that name the column and the value."""

from __future__ import annotations

import decimal
import random

import pyarrow as pa
import pytest

from reclock.core.errors import DefiniteError
from reclock.sources.postgres.types import (
    BYTEA,
    DATE,
    INT4,
    NUMERIC,
    TEXT,
    TIME,
    TIMESTAMPTZ,
    PgType,
    _bytea_column,
    _per_value,
    _py_bytea,
    _py_time,
    _time_column,
    convert,
    numeric_precision,
    parse_array,
    widens_to,
)


def test_array_literals() -> None:
    assert parse_array("{}") == []
    assert parse_array("{1,NULL,3}") == ["1", None, "3"]
    assert parse_array('{"a,b","","NULL",NULL,"q\\"\\\\"}') == ["a,b", "", "NULL", None, 'q"\\']
    assert parse_array("[0:1]={x,y}") == ["x", "y"]
    with pytest.raises(ValueError, match="multi-dimensional"):
        parse_array("{{1,2},{3,4}}")
    with pytest.raises(ValueError):
        parse_array('{"open')


def test_numeric_typmods() -> None:
    assert numeric_precision(-1) == (None, 0)
    assert numeric_precision(((12 << 16) | 3) + 4) == (12, 3)
    assert PgType(NUMERIC, ((12 << 16) | 3) + 4, "numeric(12,3)").arrow == pa.decimal128(12, 3)
    assert PgType(NUMERIC, -1, "numeric").arrow == pa.string()  # exact, unconstrained
    arr = convert(["1.5", None, "-0.001"], PgType(NUMERIC, ((12 << 16) | 3) + 4, "n"), "c")
    assert arr.to_pylist() == [decimal.Decimal("1.500"), None, decimal.Decimal("-0.001")]


def test_bad_values_name_the_column_and_value() -> None:
    with pytest.raises(DefiniteError, match=r"table t column 'n'.*'NaN'"):
        convert(["1", "NaN"], PgType(NUMERIC, ((5 << 16) | 0) + 4, "numeric(5,0)"),
                "table t column 'n'")
    with pytest.raises(DefiniteError, match=r"column 'd'.*BC"):
        convert(["0044-03-15 BC"], PgType(DATE, -1, "date"), "column 'd'")


def test_timestamptz_offsets_and_lists() -> None:
    ts = convert(["2024-01-01 00:00:00+05:30", "2024-01-01 12:00:00.5+00"],
                 PgType(TIMESTAMPTZ, -1, "timestamptz"), "c")
    assert ts.cast(pa.int64()).to_pylist() == [1704047400000000, 1704110400500000]
    lists = convert(["{1,2}", None, "{}"], PgType(1007, -1, "integer[]", INT4), "c")
    assert lists.type == pa.list_(pa.int32()) and lists.to_pylist() == [[1, 2], None, []]
    texts = convert(['{"a b",c}'], PgType(1009, -1, "text[]", TEXT), "c")
    assert texts.to_pylist() == [["a b", "c"]]


def test_widening_rules() -> None:
    assert widens_to(pa.int16(), pa.int64()) and not widens_to(pa.int64(), pa.int32())
    assert widens_to(pa.float32(), pa.float64()) and not widens_to(pa.float64(), pa.float32())
    assert widens_to(pa.decimal128(5, 2), pa.decimal128(10, 2))
    assert not widens_to(pa.decimal128(10, 4), pa.decimal128(10, 2))
    assert widens_to(pa.int32(), pa.string()) and not widens_to(pa.string(), pa.int32())


def test_bytea_and_times_convert_as_whole_columns_as_value_by_value() -> None:
    """The whole-column conversions of bytea (hex) and times give what the
    per-value pass gives, nulls, empty values and sliced columns included;
    a column they refuse goes value by value, and a bad value is named."""
    rng = random.Random(7)
    blobs = [None if rng.random() < 0.2 else bytes(rng.randrange(256)
                                                    for _ in range(rng.randrange(6)))
             for _ in range(300)]
    texts = pa.array([None if b is None else "\\x" + b.hex() for b in blobs], pa.string())
    for arr in (texts, texts.slice(17, 150)):
        assert _bytea_column(arr) is not None  # (short values: the column pass)
        got = convert(arr, PgType(BYTEA, -1, "bytea"), "c")
        assert got.equals(_per_value(arr.to_pylist(), _py_bytea, pa.binary(), "c"))
    assert convert(texts, PgType(BYTEA, -1, "bytea"), "c").to_pylist() == blobs
    with pytest.raises(DefiniteError, match=r"column 'b'.*'\\\\x0g'"):
        convert(["\\x01", "\\x0g"], PgType(BYTEA, -1, "bytea"), "column 'b'")
    times = [None if rng.random() < 0.2 else
             f"{rng.randrange(24):02d}:{rng.randrange(60):02d}:{rng.randrange(60):02d}"
             + (f".{rng.randrange(10**6):06d}" if rng.random() < 0.5 else "")
             for _ in range(300)]
    arr = pa.array(times, pa.string())
    assert _time_column(arr) is not None
    got = convert(arr, PgType(TIME, -1, "time"), "c")
    assert got.equals(_per_value(times, _py_time, pa.time64("us"), "c"))
    late = convert(["24:00:00", "00:00:01", None], PgType(TIME, -1, "time"), "c")
    assert late.cast(pa.int64()).to_pylist() == [86_400_000_000, 1_000_000, None]
