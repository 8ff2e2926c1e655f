"""Decode: every format's good rows, bad rows (exact indices and reasons), nulls,
types, the fast/per-record split, key/value, picklability, and Avro through a
real (local) schema registry over HTTP."""

from __future__ import annotations

import datetime as dt
import io
import json
import pickle
import threading
import uuid
from collections.abc import Iterator
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import fastavro
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reclock.contracts.decode as decode_mod
from reclock.contracts.decode import (
    NULL_REASON,
    TIMESTAMP,
    Decoder,
    DecodeResult,
    FormatError,
    KeyValueDecoder,
    arrow_type,
    decode_key_value,
)
from reclock.core.errors import DefiniteError, SchemaChanged, TransientError
from reclock.formats.avro import SchemaRegistryResolver
from reclock.registry import make_decoder

UTC = dt.UTC

#: every column type; FAST leaves out "json", which makes decoding per-record
TYPED = {
    "i32": "int32", "i64": "int64", "f": "float64", "b": "bool", "s": "string",
    "bin": "binary", "ts": "timestamp", "d": "date", "dec": "decimal(10,2)", "j": "json",
}
FAST = {k: v for k, v in TYPED.items() if v != "json"}


def arr(records: list[bytes | None]) -> pa.Array:
    return pa.array(records, pa.binary())


def run(dec: Decoder, records: list[bytes | None]) -> DecodeResult:
    res = dec.decode(arr(records))
    check_invariants(res, len(records), dec.schema)
    return res


def check_invariants(res: DecodeResult, n: int, schema: pa.Schema) -> None:
    """Every index is in exactly one of ok/errors; both ascending; table matches."""
    assert res.ok.dtype == np.int64 and res.errors.dtype == np.int64
    both = np.concatenate([res.ok, res.errors])
    assert sorted(both.tolist()) == list(range(n))
    assert np.all(np.diff(res.ok) > 0) and np.all(np.diff(res.errors) > 0)
    assert res.table.num_rows == len(res.ok)
    assert res.table.schema == schema
    assert len(res.reasons) == len(res.errors)


def errors(res: DecodeResult) -> dict[int, str]:
    return dict(zip(res.errors.tolist(), res.reasons, strict=True))


def rows(res: DecodeResult) -> dict[int, dict[str, Any]]:
    return dict(zip(res.ok.tolist(), res.table.to_pylist(), strict=True))


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the fast path read a few records per call, so that runs, splits and
    chunk edges are exercised on small inputs."""
    monkeypatch.setattr(decode_mod, "CHUNK_BYTES", 64)


# --------------------------------------------------------------------------
# types and specs
# --------------------------------------------------------------------------


def test_arrow_types() -> None:
    assert arrow_type("int32") == pa.int32()
    assert arrow_type("int64") == pa.int64()
    assert arrow_type("float64") == pa.float64()
    assert arrow_type("bool") == pa.bool_()
    assert arrow_type("string") == pa.string()
    assert arrow_type("binary") == pa.binary()
    assert arrow_type("timestamp") == pa.timestamp("us", tz="UTC")
    assert arrow_type("date") == pa.date32()
    assert arrow_type("decimal(10,2)") == pa.decimal128(10, 2)
    assert arrow_type("decimal(50, 3)") == pa.decimal256(50, 3)
    assert arrow_type("json") == pa.string()
    with pytest.raises(FormatError, match="unknown column type 'int'"):
        arrow_type("int")
    with pytest.raises(FormatError, match="precision"):
        arrow_type("decimal(5,6)")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({}, "needs a 'type'"),
        ({"type": "xml"}, "unknown format type 'xml'"),
        ({"type": "json", "schema": {"a": "int64"}, "extra": 1}, r"unknown keys \['extra'\]"),
        ({"type": "json", "schema": {"a": "int"}}, "column 'a': unknown column type 'int'"),
        ({"type": "json", "schema": {}}, "non-empty mapping"),
        ({"type": "csv"}, "'columns' is required"),
        ({"type": "csv", "columns": ["a", "a"]}, "duplicate"),
        ({"type": "csv", "columns": ["a"], "types": {"b": "int64"}}, "not in 'columns'"),
        ({"type": "csv", "columns": ["a"], "types": {"a": "json"}}, "json is not supported"),
        ({"type": "csv", "columns": ["a"], "delimiter": ";;"}, "one character"),
        ({"type": "csv", "columns": ["a"], "header": True}, "each record is one CSV line"),
        ({"type": "avro"}, "give 'schema'"),
        ({"type": "avro", "schema": "{not json"}, "invalid schema"),
        ({"type": "avro", "schema": '["int", "string"]'}, "several non-null branches"),
        ({"type": "avro", "schema": {"type": "record", "name": "L", "fields": [
            {"name": "next", "type": ["null", "L"]}]}}, "recursive type"),
    ],
)
def test_bad_specs_fail_at_construction(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(FormatError, match=message) as info:
        make_decoder(spec)
    assert isinstance(info.value, ValueError) and isinstance(info.value, DefiniteError)


def test_decode_rejects_non_binary_input() -> None:
    with pytest.raises(TypeError, match="binary"):
        make_decoder({"type": "text"}).decode(pa.array([1, 2]))


def test_string_and_chunked_inputs_are_accepted() -> None:
    dec = make_decoder({"type": "json", "schema": {"a": "int64"}})
    res = dec.decode(pa.array(['{"a":1}', '{"a":2}'], pa.string()))
    assert res.table.column("a").to_pylist() == [1, 2]
    chunked = pa.chunked_array([arr([b'{"a":1}']), arr([b'{"a":', b'{"a":3}'])])
    res = dec.decode(chunked)
    assert res.ok.tolist() == [0, 2] and res.errors.tolist() == [1]
    large = pa.array([b'{"a":1}', b"x"], pa.large_binary())
    res = dec.decode(large)
    assert res.ok.tolist() == [0] and res.errors.tolist() == [1]


@pytest.mark.parametrize(
    "spec",
    [{"type": "bytes"}, {"type": "text"}, {"type": "json"}, {"type": "json", "schema": FAST},
     {"type": "json", "schema": TYPED}, {"type": "csv", "columns": ["a", "b"]},
     {"type": "avro", "schema": "string"}],
    ids=["bytes", "text", "json", "json-typed", "json-slow", "csv", "avro"],
)
@pytest.mark.parametrize("allow_null", [False, True])
def test_empty_and_all_null_inputs(spec: dict[str, Any], allow_null: bool) -> None:
    dec = make_decoder(spec, allow_null=allow_null)
    for data in (pa.array([], pa.binary()), pa.nulls(3, pa.binary()),
                 pa.array([None, None], pa.large_binary())):
        res = dec.decode(data)
        check_invariants(res, len(data), dec.schema)
        if allow_null:
            assert res.ok.tolist() == list(range(len(data)))
            assert all(v is None for row in res.table.to_pylist() for v in row.values())
        else:
            assert res.reasons == [NULL_REASON] * len(data)


def test_sliced_input_is_respected() -> None:
    dec = make_decoder({"type": "json", "schema": {"a": "int64"}})
    data = arr([b'{"a":0}', b"bad", b'{"a":2}', b'{"a":3}', b"bad"]).slice(1, 3)
    res = dec.decode(data)
    assert res.ok.tolist() == [1, 2] and res.errors.tolist() == [0]
    assert res.table.column("a").to_pylist() == [2, 3]


# --------------------------------------------------------------------------
# bytes and text
# --------------------------------------------------------------------------


def test_bytes_passes_everything_through() -> None:
    dec = make_decoder({"type": "bytes"})
    res = run(dec, [b"\xff\x00", b"", b"abc"])
    assert res.table.column("data").to_pylist() == [b"\xff\x00", b"", b"abc"]
    assert res.errors.tolist() == []


def test_bytes_nulls() -> None:
    res = run(make_decoder({"type": "bytes"}), [b"a", None, b"c"])
    assert errors(res) == {1: NULL_REASON}
    assert res.table.column("data").to_pylist() == [b"a", b"c"]
    res = run(make_decoder({"type": "bytes"}, allow_null=True), [b"a", None])
    assert res.table.column("data").to_pylist() == [b"a", None]


def test_text_good_bad_and_null() -> None:
    dec = make_decoder({"type": "text"})
    res = run(dec, [b"hello", "h\u00e9".encode(), b"ab\xffcd", None, b""])
    assert rows(res) == {0: {"text": "hello"}, 1: {"text": "h\u00e9"}, 4: {"text": ""}}
    assert errors(res) == {
        2: "text: invalid utf-8: 'utf-8' codec can't decode byte 0xff in position 2: "
           "invalid start byte",
        3: NULL_REASON,
    }


def test_text_many_bad_rows_are_found_exactly() -> None:
    records: list[bytes | None] = [b"ok %d" % i for i in range(5000)]
    bad = {7, 1000, 1001, 4999}
    for i in bad:
        records[i] = b"\xc3(" if i % 2 else b"\x80"
    res = run(make_decoder({"type": "text"}), records)
    assert set(res.errors.tolist()) == bad
    assert res.table.column("text").to_pylist() == [
        r.decode() for i, r in enumerate(records) if i not in bad and r is not None
    ]


def test_text_allow_null_gives_null_rows_in_order() -> None:
    res = run(make_decoder({"type": "text"}, allow_null=True), [b"a", None, b"\xff", b"b"])
    assert rows(res) == {0: {"text": "a"}, 1: {"text": None}, 3: {"text": "b"}}


# --------------------------------------------------------------------------
# json, schemaless
# --------------------------------------------------------------------------


def test_json_without_schema_keeps_the_text_and_validates_it() -> None:
    dec = make_decoder({"type": "json"})
    assert dec.schema == pa.schema([pa.field("value", pa.string())])
    recs: list[bytes | None] = [
        b'{"a": 1}', b"[1, 2]", b"5", b'"s"', b' {"b":\n2} ', b'{"a": 1 "b": 2}', b"", None,
        b'{"a":1}{"a":2}', b"\xff",
    ]
    res = run(dec, recs)
    assert rows(res) == {
        0: {"value": '{"a": 1}'}, 1: {"value": "[1, 2]"}, 2: {"value": "5"},
        3: {"value": '"s"'}, 4: {"value": ' {"b":\n2} '},
    }
    assert errors(res) == {
        5: "json: Expecting ',' delimiter: line 1 column 9",
        6: "json: Expecting value: line 1 column 1",
        7: NULL_REASON,
        8: "json: Extra data: line 1 column 8",
        9: "json: invalid utf-8: 'utf-8' codec can't decode byte 0xff in position 0: "
           "invalid start byte",
    }


# --------------------------------------------------------------------------
# json, typed
# --------------------------------------------------------------------------



@pytest.mark.parametrize("spec_schema", [TYPED, FAST], ids=["with-json-field", "fast-path"])
def test_json_types(spec_schema: dict[str, str]) -> None:
    dec = make_decoder({"type": "json", "schema": spec_schema})
    assert dec.schema.field("ts").type == TIMESTAMP
    rec = {
        "i32": -5, "i64": 2**62, "f": 1, "b": True, "s": "h\u00e9\n\"q\"", "bin": "ab",
        "ts": "2024-01-02T03:04:05.123456+01:00", "d": "2024-02-29", "dec": "12.5",
        "j": {"x": [1, 2.5, None], "y": "z"}, "other": {"ignored": True},
    }
    rec2 = {"ts": "2024-01-02 03:04", "dec": 7, "f": 2.5e-3, "j": 3}
    res = run(dec, [json.dumps(rec).encode(), json.dumps(rec2).encode(), b"{}"])
    got = rows(res)
    expected0 = {
        "i32": -5, "i64": 2**62, "f": 1.0, "b": True, "s": "h\u00e9\n\"q\"", "bin": b"ab",
        "ts": dt.datetime(2024, 1, 2, 2, 4, 5, 123456, tzinfo=UTC), "d": dt.date(2024, 2, 29),
        "dec": Decimal("12.50"), "j": '{"x":[1,2.5,null],"y":"z"}',
    }
    expected1: dict[str, Any] = dict.fromkeys(spec_schema)
    expected1.update(
        ts=dt.datetime(2024, 1, 2, 3, 4, tzinfo=UTC), dec=Decimal("7.00"), f=0.0025, j="3"
    )
    for expected in (expected0, expected1):
        if "j" not in spec_schema:
            expected.pop("j", None)
    assert got[0] == expected0
    assert got[1] == expected1
    assert got[2] == dict.fromkeys(spec_schema)


@pytest.mark.parametrize("spec_schema", [TYPED, FAST], ids=["with-json-field", "fast-path"])
@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (b'{"i64": 1 "b": 2}', "json: Expecting ',' delimiter: line 1 column 11"),
        (b"[1]", "json: expected an object, got array"),
        (b'{"i64": "7"}', "json: field 'i64': expected int64, got string '7'"),
        (b'{"i64": 1.5}', "json: field 'i64': expected int64, got number 1.5"),
        (b'{"i64": 1.0}', "json: field 'i64': expected int64, got number 1.0"),
        (b'{"i64": true}', "json: field 'i64': expected int64, got boolean True"),
        (b'{"i64": 9223372036854775808}',
         "json: field 'i64': 9223372036854775808 is out of range for int64"),
        (b'{"i32": 2147483648}', "json: field 'i32': 2147483648 is out of range for int32"),
        (b'{"f": "1.5"}', "json: field 'f': expected float64, got string '1.5'"),
        (b'{"f": 1e400}', "json: field 'f': 1E+400 is out of range for float64"),
        (b'{"b": 1}', "json: field 'b': expected bool, got number 1"),
        (b'{"s": 5}', "json: field 's': expected string, got number 5"),
        (b'{"s": {"a": 1}}', "json: field 's': expected string, got object {'a': 1}"),
        (b'{"ts": "2024-13-01"}', "json: field 'ts': cannot parse '2024-13-01' as timestamp"),
        (b'{"ts": 1700000000}', "json: field 'ts': expected timestamp, got number 1700000000"),
        (b'{"d": "2024-01-01T00:00"}',
         "json: field 'd': cannot parse '2024-01-01T00:00' as date"),
        (b'{"dec": 1.234}',
         "json: field 'dec': cannot convert 1.234 to decimal(10,2): "
         "too many digits after the point"),
        (b'{"dec": 123456789.5}',
         "json: field 'dec': cannot convert 123456789.5 to decimal(10,2): too many digits"),
        (b'{"dec": 99999999.999}', "json: field 'dec': cannot convert 99999999.999 to "
         "decimal(10,2): too many digits"),
        (b'{"dec": "abc"}',
         "json: field 'dec': cannot convert 'abc' to decimal(10,2): not a decimal number"),
        (b'{"s": "\xff"}', "json: invalid utf-8: 'utf-8' codec can't decode byte 0xff in "
         "position 7: invalid start byte"),
        (b'{"s": "a\tb"}', "json: Invalid control character at: line 1 column 9"),
    ],
)
def test_json_bad_records(spec_schema: dict[str, str], record: bytes, reason: str) -> None:
    dec = make_decoder({"type": "json", "schema": spec_schema})
    good = b'{"i64": 1}'
    res = run(dec, [good, record, good])
    assert errors(res) == {1: reason}
    assert res.ok.tolist() == [0, 2]


def test_json_nulls() -> None:
    dec = make_decoder({"type": "json", "schema": {"a": "int64", "b": "string"}})
    res = run(dec, [b'{"a": 1}', None, b'{"a": null, "b": null}'])
    assert errors(res) == {1: NULL_REASON}
    assert rows(res) == {0: {"a": 1, "b": None}, 2: {"a": None, "b": None}}
    dec = make_decoder({"type": "json", "schema": {"a": "int64"}}, allow_null=True)
    res = run(dec, [None, b'{"a": 1}', None, b"bad"])
    assert rows(res) == {0: {"a": None}, 1: {"a": 1}, 2: {"a": None}}
    assert errors(res) == {3: "json: Expecting value: line 1 column 1"}


def test_json_newlines_as_whitespace_inside_records() -> None:
    """A raw record may hold a literal newline (or CR) between tokens: that is
    valid JSON whitespace, and must neither split the record nor shift its
    neighbours; a raw newline inside a string is invalid JSON."""
    dec = make_decoder({"type": "json", "schema": {"a": "int64", "s": "string"}})
    recs: list[bytes | None] = [
        b'{"a": 1}',
        b'{\n"a"\n:\n2,\r\n"s": "x"\n}',
        b'{"a": 3}',
        b'{"a": 4, "s": "line\nbreak"}',
        b'{"a": 5}',
        b'{"a":\n6}',
    ]
    res = run(dec, recs)
    assert rows(res) == {
        0: {"a": 1, "s": None}, 1: {"a": 2, "s": "x"}, 2: {"a": 3, "s": None},
        4: {"a": 5, "s": None}, 5: {"a": 6, "s": None},
    }
    assert errors(res) == {3: "json: Invalid control character at: line 1 column 20"}


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (b'{"a": 1} {"a": 2}', "json: Extra data: line 1 column 10"),
        (b'{"a": 1}{"a": 2}', "json: Extra data: line 1 column 9"),
        (b'{"a": 1}}', "json: Extra data: line 1 column 9"),
        (b"", "json: Expecting value: line 1 column 1"),
        (b"   ", "json: Expecting value: line 1 column 4"),
        (b"\n", "json: Expecting value: line 2 column 1"),
        (b'{"a": 1', "json: Expecting ',' delimiter: line 1 column 8"),
        (b'{"a": 1,', "json: Expecting property name enclosed in double quotes: line 1 column 9"),
        (b'{"a": 1}{"a": ', "json: Extra data: line 1 column 9"),
    ],
)
def test_json_record_boundaries_never_shift(record: bytes, reason: str) -> None:
    """Records that would read as zero or several documents, or that would run
    into the next record, are errors; their neighbours keep their rows."""
    dec = make_decoder({"type": "json", "schema": {"a": "int64"}})
    recs: list[bytes | None] = [b'{"a": 10}', record, b'{"a": 30}}', b'{"a": 40}']
    res = run(dec, recs)
    assert rows(res) == {0: {"a": 10}, 3: {"a": 40}}
    assert errors(res) == {1: reason, 2: "json: Extra data: line 1 column 10"}


def test_json_missing_and_extra_fields() -> None:
    dec = make_decoder({"type": "json", "schema": {"a": "int64", "b": "string"}})
    res = run(dec, [b'{"b": "x", "c": [1, {"d": null}], "e": 1.5}', b'{"a": 2}'])
    assert res.table.to_pylist() == [{"a": None, "b": "x"}, {"a": 2, "b": None}]


def test_json_duplicate_keys_last_wins() -> None:
    # Arrow's reader refuses duplicate keys; the per-record path follows json.loads.
    dec = make_decoder({"type": "json", "schema": {"a": "int64"}})
    res = run(dec, [b'{"a": 1, "a": 2}', b'{"a": 3}'])
    assert res.table.column("a").to_pylist() == [2, 3]


def test_json_nan_and_infinity_constants() -> None:
    dec = make_decoder({"type": "json", "schema": {"f": "float64"}})
    res = run(dec, [b'{"f": NaN}', b'{"f": Infinity}', b'{"f": -Infinity}', b' {"f": NaN}'])
    got = res.table.column("f").to_pylist()
    assert np.isnan(got[0]) and got[1] == float("inf") and got[2] == float("-inf")
    assert np.isnan(got[3])


def test_json_timestamp_forms() -> None:
    dec = make_decoder({"type": "json", "schema": {"ts": "timestamp"}})
    forms = {
        "2024-01-02": dt.datetime(2024, 1, 2, tzinfo=UTC),
        "2024-01-02T03": dt.datetime(2024, 1, 2, 3, tzinfo=UTC),
        "2024-01-02 03:04:05": dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC),
        "2024-01-02T03:04:05Z": dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC),
        "2024-01-02T03:04:05.5-02:30": dt.datetime(2024, 1, 2, 5, 34, 5, 500000, tzinfo=UTC),
        "2024-01-02T03:04:05+0100": dt.datetime(2024, 1, 2, 2, 4, 5, tzinfo=UTC),
    }
    recs: list[bytes | None] = [json.dumps({"ts": s}).encode() for s in forms]
    recs += [b'{"ts": "2024-01-02T03:04:05.1234567Z"}', b'{"ts": "yesterday"}']
    res = run(dec, recs)
    assert res.table.column("ts").to_pylist() == list(forms.values())
    assert errors(res) == {
        6: "json: field 'ts': cannot parse '2024-01-02T03:04:05.1234567Z' as timestamp",
        7: "json: field 'ts': cannot parse 'yesterday' as timestamp",
    }


def test_json_mixed_good_and_bad_keep_order(small_chunks: None) -> None:
    dec = make_decoder({"type": "json", "schema": {"id": "int64", "d": "date"}})
    recs: list[bytes | None] = []
    bad: dict[int, str] = {}
    for i in range(400):
        k = i % 13
        if k == 3:
            recs.append(b'{"id": %d,' % i)
            column = len(b'{"id": %d,' % i) + 1
            bad[i] = ("json: Expecting property name enclosed in double quotes: "
                      f"line 1 column {column}")
        elif k == 7:
            recs.append(b'{"id": %d.5}' % i)
            bad[i] = f"json: field 'id': expected int64, got number {i}.5"
        elif k == 9:
            recs.append(b'{"id": %d, "d": "2024-02-30"}' % i)
            bad[i] = "json: field 'd': cannot parse '2024-02-30' as date"
        elif k == 11:
            recs.append(None)
            bad[i] = NULL_REASON
        else:
            recs.append(b'{"id": %d, "d": "2024-02-%02d"}' % (i, 1 + i % 28))
    res = run(dec, recs)
    assert errors(res) == bad
    assert res.ok.tolist() == [i for i in range(400) if i not in bad]
    assert res.table.column("id").to_pylist() == res.ok.tolist()


def test_json_conversion_errors_in_a_large_batch() -> None:
    """Conversion errors carry no row number; the suspects search must still
    isolate exactly the bad records (and keep the good look-alikes)."""
    dec = make_decoder({"type": "json", "schema": {"id": "int64", "p": "decimal(6,2)",
                                                    "x": "float64"}})
    recs: list[bytes | None] = []
    bad = {}
    for i in range(30_000):
        if i % 997 == 5:
            recs.append(b'{"id": 1.0, "x": 1.0}')
            bad[i] = "json: field 'id': expected int64, got number 1.0"
        elif i % 997 == 6:
            recs.append(b'{"id": 1, "p": 12345.6}')
            bad[i] = "json: field 'p': cannot convert 12345.6 to decimal(6,2): too many digits"
        elif i % 997 == 7:
            recs.append(b'{"id": 12345678901234567890}')
            bad[i] = "json: field 'id': 12345678901234567890 is out of range for int64"
        else:  # look-alikes that are fine: 19 digits, floats elsewhere, 2-digit scale
            recs.append(b'{"id": 1234567890123456789, "p": "1.20", "x": 1.5e3, "i": %d}' % i)
    res = run(dec, recs)
    assert errors(res) == bad
    assert set(res.table.column("id").to_pylist()) == {1234567890123456789}


@pytest.mark.parametrize("share", [0.02, 0.3, 1.0])
def test_json_dense_bad_records(share: float) -> None:
    """Past a few bad records per chunk the rest of the chunk is decoded record
    by record; the outcome is the same."""
    dec = make_decoder({"type": "json", "schema": {"id": "int64", "s": "string"}})
    recs: list[bytes | None] = []
    bad = {}
    step = round(1 / share)
    for i in range(20_000):
        if i % step == 0:
            if i % 3 == 0:
                recs.append(b'{"id": %d.5}' % i)
                bad[i] = f"json: field 'id': expected int64, got number {i}.5"
            else:
                recs.append(b'{"id": %d' % i)
                bad[i] = f"json: Expecting ',' delimiter: line 1 column {len(str(i)) + 8}"
        else:
            recs.append(b'{"id": %d, "s": "v%d"}' % (i, i))
    res = run(dec, recs)
    assert errors(res) == bad
    assert res.table.column("id").to_pylist() == res.ok.tolist()
    assert res.table.column("s").to_pylist() == [f"v{i}" for i in res.ok.tolist()]


def test_json_errors_at_chunk_edges(small_chunks: None) -> None:
    dec = make_decoder({"type": "json", "schema": {"a": "int64"}})
    for bad_at in ([0], [49], [0, 49], list(range(50)), [24, 25]):
        recs: list[bytes | None] = [
            b'{"a" 1}' if i in bad_at else b'{"a": %d}' % i for i in range(50)
        ]
        res = run(dec, recs)
        assert res.errors.tolist() == bad_at
        assert res.table.column("a").to_pylist() == [i for i in range(50) if i not in bad_at]


def test_json_decoder_is_reusable_and_deterministic() -> None:
    dec = make_decoder({"type": "json", "schema": {"a": "int64"}})
    recs: list[bytes | None] = [b'{"a": 1}', b"x", b'{"a": 2.5}', None]
    first, second = run(dec, recs), run(dec, recs)
    assert first.table.equals(second.table)
    assert first.reasons == second.reasons and first.ok.tolist() == second.ok.tolist()


# Hypothesis: random objects, some corrupted, mixed ---------------------------

SCHEMA = {"i": "int64", "f": "float64", "b": "bool", "s": "string"}
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
)
extra_values = st.recursive(
    json_scalars, lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6,
)
objects = st.fixed_dictionaries(
    {},
    optional={
        "i": st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
        "f": st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False),
                       st.integers(-(2**53), 2**53)),
        "b": st.one_of(st.none(), st.booleans()),
        "s": st.one_of(st.none(), st.text()),
        "zz": extra_values,
    },
)


@st.composite
def encoded(draw: st.DrawFn) -> tuple[bytes, dict[str, Any] | None]:
    """A JSON object as bytes (varied layout) and, if it is corrupted, None."""
    obj = draw(objects)
    text = json.dumps(
        obj, indent=draw(st.sampled_from([None, 1, "\t"])),
        ensure_ascii=draw(st.booleans()),
        separators=draw(st.sampled_from([None, (",", ":"), (" , ", " : ")])),
    )
    raw = text.encode()
    how = draw(st.sampled_from(["none"] * 4 + ["truncate", "garbage", "utf8", "type", "pad"]))
    if how == "none":
        return raw, obj
    if how == "pad":  # surrounding whitespace is still valid JSON
        return b" \n" + raw + b"\r\n ", obj
    if how == "truncate":
        return raw[: draw(st.integers(0, len(raw) - 1))], None
    if how == "garbage":
        k = draw(st.integers(0, len(raw)))
        return raw[:k] + draw(st.sampled_from([b"}", b"{", b",", b"x", b"]"])) + raw[k:], None
    if how == "utf8":
        k = draw(st.integers(0, len(raw)))
        return raw[:k] + b"\xff" + raw[k:], None
    return json.dumps({**obj, "i": "not an int"}).encode(), None


@given(st.lists(encoded(), max_size=40), st.booleans())
def test_json_matches_json_loads(items: list[tuple[bytes, dict[str, Any] | None]],
                                 tiny_chunks: bool) -> None:
    old = decode_mod.CHUNK_BYTES
    decode_mod.CHUNK_BYTES = 100 if tiny_chunks else old
    try:
        dec = make_decoder({"type": "json", "schema": SCHEMA})
        res = run(dec, [raw for raw, _ in items])
    finally:
        decode_mod.CHUNK_BYTES = old
    expected_bad = []
    for k, (raw, obj) in enumerate(items):
        if obj is None:
            try:  # a corruption may still be valid JSON of the right shape
                again = json.loads(raw)
                if not isinstance(again, dict) or not isinstance(again.get("i", 0), int | None):
                    raise ValueError
                # escapes that decode to a lone surrogate are not Unicode: no
                # Arrow string can hold them, so they are bad records too
                # (in the schema's fields: the others are not read)
                json.dumps({k: again.get(k) for k in SCHEMA}, ensure_ascii=False).encode()
                obj = again
                items[k] = (raw, obj)
            except (ValueError, UnicodeEncodeError):
                expected_bad.append(k)
    assert res.errors.tolist() == expected_bad
    want = []
    for raw, obj in items:
        if obj is not None:
            assert obj == json.loads(raw)
            row = {k: obj.get(k) for k in SCHEMA}
            if row["f"] is not None:
                row["f"] = float(row["f"])
            want.append(row)
    assert res.table.to_pylist() == want


# --------------------------------------------------------------------------
# csv
# --------------------------------------------------------------------------

CSV = {"type": "csv", "columns": ["id", "name", "ts", "ok", "price", "d", "raw"],
       "types": {"id": "int64", "ts": "timestamp", "ok": "bool", "price": "decimal(6,2)",
                 "d": "date", "raw": "binary"}}


def test_csv_good_rows_and_types() -> None:
    dec = make_decoder(CSV)
    res = run(dec, [
        b'1,alice,2024-01-02T03:04:05Z,true,12.5,2024-01-02,\xff\x00',
        b'2,"bob, jr.",2024-01-02 03:04,0,7,2024-02-29,x',
        b'3,"say ""hi""",,,,,',
        b"4,,2024-01-02T03:04:05+01:00,TRUE,-0.01,,",
    ])
    assert res.table.to_pylist() == [
        {"id": 1, "name": "alice", "ts": dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC),
         "ok": True, "price": Decimal("12.50"), "d": dt.date(2024, 1, 2), "raw": b"\xff\x00"},
        {"id": 2, "name": "bob, jr.", "ts": dt.datetime(2024, 1, 2, 3, 4, tzinfo=UTC),
         "ok": False, "price": Decimal("7.00"), "d": dt.date(2024, 2, 29), "raw": b"x"},
        {"id": 3, "name": 'say "hi"', "ts": None, "ok": None, "price": None, "d": None,
         "raw": b""},
        {"id": 4, "name": "", "ts": dt.datetime(2024, 1, 2, 2, 4, 5, tzinfo=UTC),
         "ok": True, "price": Decimal("-0.01"), "d": None, "raw": b""},
    ]


def test_csv_bad_rows_name_the_column() -> None:
    dec = make_decoder(CSV)
    good = b"1,a,,,,,"
    recs: list[bytes | None] = [
        good,
        b"1,a",                      # too few fields
        b"1,a,,,,,,",                # too many
        b"x1,a,,,,,",                # int
        b"1,a,2024-13-01,,,,",       # timestamp
        b"1,a,,yes,,,",              # bool
        b"1,a,,,1.234,,",            # decimal scale
        b"1,a,,,12345,,",            # decimal precision
        b"1,a,,,,2024-02-30,",       # date
        b"1,\xff,,,,,",              # utf-8 in a string column
        b"",                         # an empty record holds one field
        None,
        good,
    ]
    res = run(dec, recs)
    assert errors(res) == {
        1: "csv: expected 7 columns, got 2",
        2: "csv: expected 7 columns, got 8",
        3: "csv: column 'id': cannot convert 'x1' to int64",
        4: "csv: column 'ts': cannot convert '2024-13-01' to timestamp",
        5: "csv: column 'ok': cannot convert 'yes' to bool",
        6: "csv: column 'price': cannot convert '1.234' to decimal(6,2)",
        7: "csv: column 'price': cannot convert '12345' to decimal(6,2)",
        8: "csv: column 'd': cannot convert '2024-02-30' to date",
        9: "csv: column 'name': invalid utf-8",
        10: "csv: expected 7 columns, got 1",
        11: NULL_REASON,
    }
    assert res.ok.tolist() == [0, 12]


def test_csv_quoted_newline_and_multiline_records() -> None:
    dec = make_decoder({"type": "csv", "columns": ["a", "b"], "types": {"a": "int64"}})
    res = run(dec, [b'1,"two\nlines"', b"2,x\n3,y", b'4,"cr\r\nlf"', b"5,z"])
    assert rows(res) == {0: {"a": 1, "b": "two\nlines"}, 2: {"a": 4, "b": "cr\r\nlf"},
                         3: {"a": 5, "b": "z"}}
    assert errors(res) == {1: "csv: the record holds 2 lines; a record is one CSV line"}


@pytest.mark.parametrize("where", ["first", "middle", "last", "alone"])
def test_csv_unclosed_quote_is_an_error_wherever_it_is(where: str) -> None:
    dec = make_decoder({"type": "csv", "columns": ["a", "b"]})
    recs: list[bytes | None] = [b"1,x", b"2,y", b"3,z"]
    at = {"first": 0, "middle": 1, "last": 2, "alone": 0}[where]
    if where == "alone":
        recs = recs[:1]
    recs[at] = b'9,"open'
    res = run(dec, recs)
    assert errors(res) == {at: "csv: a quoted field is not closed"}
    assert all(r["b"] in "xyz" for r in res.table.to_pylist())
    # a quote inside an unquoted field is a plain character
    res = run(dec, [b'1,a"b', b"2,c"])
    assert res.table.to_pylist() == [{"a": "1", "b": 'a"b'}, {"a": "2", "b": "c"}]


def test_csv_single_column_and_delimiter() -> None:
    dec = make_decoder({"type": "csv", "columns": ["v"]})
    res = run(dec, [b"a", b"", b"c"])
    assert res.table.column("v").to_pylist() == ["a", "", "c"]
    dec = make_decoder({"type": "csv", "columns": ["a", "b"], "delimiter": "|", "quote": "'",
                        "types": ["int32", "float64"]})
    res = run(dec, [b"1|2.5", b"'3'|'1e3'", b"1,2|3"])
    assert rows(res) == {0: {"a": 1, "b": 2.5}, 1: {"a": 3, "b": 1000.0}}
    assert errors(res) == {2: "csv: column 'a': cannot convert '1,2' to int32"}


def test_csv_many_records_with_bad_ones(small_chunks: None) -> None:
    dec = make_decoder({"type": "csv", "columns": ["id", "v"], "types": {"id": "int64"}})
    recs: list[bytes | None] = []
    bad: dict[int, str] = {}
    for i in range(300):
        if i % 17 == 4:
            recs.append(b"%d" % i)
            bad[i] = "csv: expected 2 columns, got 1"
        elif i % 17 == 9:
            recs.append(b"n%d,v" % i)
            bad[i] = f"csv: column 'id': cannot convert 'n{i}' to int64"
        elif i % 17 == 12:
            recs.append(b'%d,"open' % i)  # an unclosed quote must not swallow the next line
            bad[i] = "csv: a quoted field is not closed"
        else:
            recs.append(b"%d,v%d" % (i, i))
    res = run(dec, recs)
    assert errors(res) == bad
    assert res.table.column("id").to_pylist() == res.ok.tolist()


# --------------------------------------------------------------------------
# avro
# --------------------------------------------------------------------------

AVRO_SCHEMA: dict[str, Any] = {
    "type": "record", "name": "Order", "namespace": "shop",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "qty", "type": "int"},
        {"name": "price", "type": {"type": "bytes", "logicalType": "decimal",
                                   "precision": 9, "scale": 2}},
        {"name": "ratio", "type": "float"},
        {"name": "score", "type": "double"},
        {"name": "paid", "type": "boolean"},
        {"name": "note", "type": ["null", "string"], "default": None},
        {"name": "blob", "type": "bytes"},
        {"name": "tag", "type": {"type": "fixed", "name": "Tag", "size": 2}},
        {"name": "state", "type": {"type": "enum", "name": "State",
                                   "symbols": ["NEW", "DONE"]}},
        {"name": "at_ms", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "at_us", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "day", "type": {"type": "int", "logicalType": "date"}},
        {"name": "uid", "type": {"type": "string", "logicalType": "uuid"}},
        {"name": "address", "type": {"type": "record", "name": "Address", "fields": [
            {"name": "city", "type": "string"},
            {"name": "zip", "type": ["null", "int"]},
        ]}},
        {"name": "previous", "type": ["null", "Address"], "default": None},
        {"name": "lines", "type": {"type": "array", "items": "long"}},
        {"name": "attrs", "type": {"type": "map", "values": "string"}},
        {"name": "ids", "type": {"type": "array", "items": {"type": "string",
                                                             "logicalType": "uuid"}}},
    ],
}
UID = uuid.UUID("12345678-1234-5678-1234-567812345678")
ORDER: dict[str, Any] = {
    "id": 7, "qty": 3, "price": Decimal("19.99"), "ratio": 0.5, "score": 2.25, "paid": True,
    "note": None, "blob": b"\x00\x01", "tag": b"ab", "state": "DONE",
    "at_ms": dt.datetime(2024, 1, 2, 3, 4, 5, 123000, tzinfo=UTC),
    "at_us": dt.datetime(2024, 1, 2, 3, 4, 5, 123456, tzinfo=UTC),
    "day": dt.date(2024, 1, 2), "uid": UID,
    "address": {"city": "Oslo", "zip": None}, "previous": {"city": "Rome", "zip": 123},
    "lines": [1, 2], "attrs": {"k": "v"}, "ids": [UID],
}


def avro_bytes(schema: Any, record: Any) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), record)
    return out.getvalue()


def wire(schema_id: int, payload: bytes) -> bytes:
    return b"\x00" + schema_id.to_bytes(4, "big") + payload


def test_avro_types_round_trip() -> None:
    dec = make_decoder({"type": "avro", "schema": json.dumps(AVRO_SCHEMA)})
    s = dec.schema
    assert s.field("id").type == pa.int64() and s.field("qty").type == pa.int32()
    assert s.field("price").type == pa.decimal128(9, 2)
    assert s.field("ratio").type == pa.float32()
    assert s.field("tag").type == pa.binary(2)
    assert s.field("state").type == pa.string()
    assert s.field("at_ms").type == pa.timestamp("ms", tz="UTC")
    assert s.field("at_us").type == pa.timestamp("us", tz="UTC")
    assert s.field("day").type == pa.date32()
    assert s.field("address").type == pa.struct([("city", pa.string()), ("zip", pa.int32())])
    assert s.field("lines").type == pa.list_(pa.int64())
    assert s.field("attrs").type == pa.map_(pa.string(), pa.string())
    other = {**ORDER, "id": 8, "note": "rush", "previous": None, "lines": [], "attrs": {}}
    res = run(dec, [avro_bytes(AVRO_SCHEMA, ORDER), avro_bytes(AVRO_SCHEMA, other)])
    got = res.table.to_pylist()
    assert got[0] == {**ORDER, "uid": str(UID), "ids": [str(UID)], "attrs": [("k", "v")]}
    assert got[1]["id"] == 8 and got[1]["note"] == "rush" and got[1]["previous"] is None


def test_avro_bad_bytes_are_error_rows() -> None:
    dec = make_decoder({"type": "avro", "schema": AVRO_SCHEMA})
    good = avro_bytes(AVRO_SCHEMA, ORDER)
    res = run(dec, [good, good[:10], good + b"\x00\x00", b"", None, good])
    assert res.ok.tolist() == [0, 5]
    errs = errors(res)
    assert set(errs) == {1, 2, 3, 4}
    assert errs[1].startswith("avro: ")
    assert errs[2] == "avro: ValueError: 2 trailing bytes after the datum"
    assert errs[3].startswith("avro: ")
    assert errs[4] == NULL_REASON


def test_avro_non_record_schema_and_enum_index_error() -> None:
    dec = make_decoder({"type": "avro", "schema": "string"})
    assert dec.schema == pa.schema([pa.field("value", pa.string())])
    res = run(dec, [avro_bytes("string", "hi"), b"\x08ab"])
    assert rows(res) == {0: {"value": "hi"}}
    assert errors(res)[1].startswith("avro: ")
    enum = {"type": "enum", "name": "E", "symbols": ["A"]}
    res = run(make_decoder({"type": "avro", "schema": enum}), [b"\x00", b"\x04"])
    assert rows(res) == {0: {"value": "A"}} and list(errors(res)) == [1]


class Registry:
    """A tiny Confluent-compatible schema registry on 127.0.0.1 (a real HTTP peer)."""

    def __init__(self) -> None:
        self.schemas: dict[int, str] = {}
        self.subjects: dict[str, int] = {}
        self.requests: list[str] = []
        self.fail_with: int | None = None
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                registry.requests.append(self.path)
                if registry.fail_with:
                    self.send_error(registry.fail_with)
                    return
                parts = self.path.strip("/").split("/")
                body: dict[str, Any] | None = None
                if parts[:2] == ["schemas", "ids"] and int(parts[2]) in registry.schemas:
                    body = {"schema": registry.schemas[int(parts[2])]}
                elif parts[0] == "subjects" and parts[1] in registry.subjects:
                    sid = registry.subjects[parts[1]]
                    body = {"subject": parts[1], "id": sid, "version": 1,
                            "schema": registry.schemas[sid]}
                if body is None:
                    self.send_response(404)
                    payload = b'{"error_code": 40403, "message": "Schema not found"}'
                else:
                    self.send_response(200)
                    payload = json.dumps(body).encode()
                self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def registry() -> Iterator[Registry]:
    reg = Registry()
    try:
        yield reg
    finally:
        reg.close()


WRITER_V1 = {"type": "record", "name": "User", "fields": [
    {"name": "id", "type": "long"}, {"name": "name", "type": "string"},
    {"name": "legacy", "type": "int"},
]}
READER_V2 = {"type": "record", "name": "User", "fields": [
    {"name": "id", "type": "long"}, {"name": "name", "type": "string"},
    {"name": "email", "type": ["null", "string"], "default": None},
]}


def test_avro_wire_format_with_registry(registry: Registry) -> None:
    registry.schemas = {1: json.dumps(WRITER_V1), 2: json.dumps(READER_V2)}
    spec = {"type": "avro", "schema": READER_V2, "registry_url": registry.url}
    v1 = wire(1, avro_bytes(WRITER_V1, {"id": 1, "name": "ann", "legacy": 9}))
    # v1 carries a field the declared columns lack: never dropped silently
    with pytest.raises(SchemaChanged) as changed:  # evolve (the default): re-open for it
        make_decoder(spec).decode(arr([v1]))
    assert changed.value.schema_id == 1 and changed.value.part == "value"
    with pytest.raises(DefiniteError, match=r"schema id 1 change the output's shape .*"
                                            r"schema_change is fail"):
        make_decoder(spec, policy="fail").decode(arr([v1]))
    # evolving: the union of the declared schema and v1 (legacy nullable)
    evolved = make_decoder(spec, seen=[1])
    assert evolved.schema.names == ["id", "name", "email", "legacy"]
    assert run(evolved, [v1]).table.to_pylist() == [
        {"id": 1, "name": "ann", "email": None, "legacy": 9}]
    # freeze: the declared columns; legacy's values dropped and counted
    registry.requests.clear()
    dec = make_decoder(spec, policy="freeze")
    assert dec.schema.names == ["id", "name", "email"]
    v2 = wire(2, avro_bytes(READER_V2, {"id": 2, "name": "bo", "email": "b@x"}))
    unknown = wire(99, avro_bytes(READER_V2, {"id": 3, "name": "c", "email": None}))
    res = run(dec, [v1, v2, unknown, b"\x01abcd", avro_bytes(READER_V2, {"id": 4, "name": "d",
                                                                          "email": None}), v1])
    assert rows(res) == {
        0: {"id": 1, "name": "ann", "email": None},
        1: {"id": 2, "name": "bo", "email": "b@x"},
        5: {"id": 1, "name": "ann", "email": None},
    }
    assert res.dropped == {"legacy": 2}
    errs = errors(res)
    assert errs[2] == f"avro: {registry.url}/schemas/ids/99: not found"
    assert errs[3] == ("avro: ValueError: not in the Confluent wire format (starts with 0x01, "
                       "expected 0x00 and a 4-byte schema id)")
    assert errs[4].startswith("avro: ValueError: not in the Confluent wire format")
    # writer schemas are fetched once per id
    assert registry.requests.count("/schemas/ids/1") == 1
    # and travel with a pickled decoder
    clone = pickle.loads(pickle.dumps(dec))
    before = len(registry.requests)
    assert rows(run(clone, [v1, v2])) == {0: rows(res)[0], 1: rows(res)[1]}
    assert len(registry.requests) == before


def test_avro_reader_schema_is_the_union_of_the_subjects_versions() -> None:
    from tests.registry import register, registry_server

    with registry_server() as reg:
        with pytest.raises(DefiniteError, match="no subject 'users-value'"):
            make_decoder({"type": "avro", "registry_url": reg.url, "subject": "users-value"})
        one = register(reg.url, "users-value", WRITER_V1)
        dec = make_decoder({"type": "avro", "registry_url": reg.url, "subject": "users-value"})
        assert dec.schema.names == ["id", "name", "legacy"]
        two = register(reg.url, "users-value", READER_V2)  # drops legacy, adds email
        dec = make_decoder({"type": "avro", "registry_url": reg.url, "subject": "users-value"})
        assert dec.schema.names == ["id", "name", "legacy", "email"]
        res = run(dec, [wire(one, avro_bytes(WRITER_V1, {"id": 1, "name": "a", "legacy": 3})),
                        wire(two, avro_bytes(READER_V2, {"id": 2, "name": "b", "email": "e"}))])
        assert res.table.to_pylist() == [
            {"id": 1, "name": "a", "legacy": 3, "email": None},
            {"id": 2, "name": "b", "legacy": None, "email": "e"}]
        assert dec.fact()["versions"] == {"1": one, "2": two}  # type: ignore[attr-defined]
        # a later version adding a required field without a default: incompatible
        register(reg.url, "users-value", {**READER_V2, "fields": [
            *READER_V2["fields"], {"name": "age", "type": "int"}]})
        with pytest.raises(DefiniteError, match=r"'users-value': version 3 .* field 'age' is "
                                                r"added as a required field without a default"):
            make_decoder({"type": "avro", "registry_url": reg.url, "subject": "users-value"})


def test_avro_registry_faults_are_transient(registry: Registry) -> None:
    registry.schemas = {1: json.dumps(WRITER_V1)}
    dec = make_decoder({"type": "avro", "schema": WRITER_V1, "registry_url": registry.url})
    record = wire(1, avro_bytes(WRITER_V1, {"id": 1, "name": "a", "legacy": 0}))
    registry.fail_with = 503
    with pytest.raises(TransientError, match="HTTP 503"):
        dec.decode(arr([record]))
    registry.fail_with = None
    assert run(dec, [record]).ok.tolist() == [0]
    gone = Registry()
    gone.close()  # nothing listens on its port any more
    dead = make_decoder({"type": "avro", "schema": WRITER_V1, "registry_url": gone.url})
    with pytest.raises(TransientError, match=r"GET /schemas/ids/1 failed"):
        dead.decode(arr([record]))


def test_registry_url_secrets_are_not_shown(registry: Registry) -> None:
    url = registry.url.replace("http://", "http://user:s3cret@")
    resolver = SchemaRegistryResolver(url)
    assert "s3cret" not in repr(resolver) and resolver.url == registry.url
    with pytest.raises(DefiniteError) as info:
        resolver.writer_schema(404)
    assert "s3cret" not in str(info.value)
    with pytest.raises(FormatError) as bad:
        SchemaRegistryResolver("ftp://user:s3cret@host")
    assert "s3cret" not in str(bad.value)


# --------------------------------------------------------------------------
# key / value
# --------------------------------------------------------------------------


def test_key_value_columns_and_reasons() -> None:
    key = make_decoder({"type": "json", "schema": {"k": "int64"}})
    value = make_decoder({"type": "csv", "columns": ["a", "b"], "types": {"a": "int64"}})
    keys = arr([b'{"k": 1}', b'{"k": 2}', b"bad", b"bad", None, b'{"k": 6}'])
    values = arr([b"1,x", b"oops", b"3,z", b"x", b"5,w", None])
    res = decode_key_value(key, value, keys, values)
    check_invariants(res, 6, KeyValueDecoder(key, value).schema)
    assert res.table.schema.names == ["k", "a", "b"]
    assert rows(res) == {0: {"k": 1, "a": 1, "b": "x"}}
    assert errors(res) == {
        1: "value: csv: expected 2 columns, got 1",
        2: "key: json: Expecting value: line 1 column 1",
        3: "key: json: Expecting value: line 1 column 1; value: csv: expected 2 columns, got 1",
        4: "key is null",
        5: "value is null",
    }


def test_key_value_without_key_and_with_upsert_nulls() -> None:
    value = make_decoder({"type": "json", "schema": {"a": "int64"}}, allow_null=True)
    res = decode_key_value(None, value, arr([b"x", b"y"]), arr([b'{"a": 1}', None]))
    assert res.table.to_pylist() == [{"a": 1}, {"a": None}]
    key = make_decoder({"type": "text"})
    res = decode_key_value(key, value, arr([b"k1", b"k2"]), arr([b'{"a": 1}', None]))
    assert res.table.to_pylist() == [{"text": "k1", "a": 1}, {"text": "k2", "a": None}]
    value = make_decoder({"type": "json", "schema": {"a": "int64"}})
    res = decode_key_value(None, value, arr([None]), arr([b"{"]))
    assert res.reasons == ["value: json: Expecting property name enclosed in double quotes: "
                           "line 1 column 2"]


def test_key_value_clash_is_a_value_error() -> None:
    key = make_decoder({"type": "json", "schema": {"id": "int64"}})
    value = make_decoder({"type": "json", "schema": {"id": "int64", "x": "string"}})
    with pytest.raises(ValueError, match=r"both produce columns \['id'\]"):
        KeyValueDecoder(key, value)
    with pytest.raises(ValueError, match=r"both produce"):
        decode_key_value(key, value, arr([b"{}"]), arr([b"{}"]))
    with pytest.raises(ValueError, match="2 records"):
        decode_key_value(make_decoder({"type": "text"}), value, arr([b"a", b"b"]), arr([b"{}"]))


# --------------------------------------------------------------------------
# picklability (decoders travel to Spark executors)
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        {"type": "bytes"},
        {"type": "text"},
        {"type": "json"},
        {"type": "json", "schema": TYPED},
        {"type": "json", "schema": FAST},
        CSV,
        {"type": "avro", "schema": AVRO_SCHEMA},
    ],
    ids=["bytes", "text", "json", "json-typed", "json-fast", "csv", "avro"],
)
def test_decoders_pickle(spec: dict[str, Any]) -> None:
    dec = make_decoder(spec, allow_null=True)
    clone = pickle.loads(pickle.dumps(dec))
    assert clone.schema == dec.schema
    sample: list[bytes | None] = [None, b'{"i64": 1}', b"1,a,,,,,", b"\xff", b""]
    if spec["type"] == "avro":
        sample.append(avro_bytes(AVRO_SCHEMA, ORDER))
    a, b = dec.decode(arr(sample)), clone.decode(arr(sample))
    assert a.table.equals(b.table) and a.reasons == b.reasons
    assert a.ok.tolist() == b.ok.tolist()
    kv = KeyValueDecoder(make_decoder({"type": "text"}), make_decoder({"type": "bytes"}))
    assert pickle.loads(pickle.dumps(kv)).schema == kv.schema


@pytest.mark.parametrize("spec", [{"type": "json"}, {"type": "json", "schema": {"s": "string"}}])
def test_regression_lone_surrogate_escape_is_an_error_row(spec: dict[str, Any]) -> None:
    """Found by Hypothesis: ``"\\ud800}"`` parses with json.loads but is not Unicode;
    fast path and slow path (a record with a line break) must both reject it."""
    dec = make_decoder(spec)
    bad_slow = b'{\n "s" : "\\ud800}\\udc00"\n}'
    bad_fast = b'{"s": "\\ud800x"}'
    good = b'{"s": "\\ud83d\\ude00"}'
    res = dec.decode(pa.array([good, bad_slow, bad_fast], pa.binary()))
    assert res.ok.tolist() == [0] and res.errors.tolist() == [1, 2]


# -- the C parser of flat objects (reclock/_json_native.c) ---------------------------------

_NATIVE_SCHEMA = {"i": "int64", "j": "int32", "f": "float64", "b": "bool", "s": "string",
                  "t": "timestamp"}

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(min_value=-1e6, max_value=1e6, allow_nan=False).map(lambda x: round(x, 3)),
    st.text(max_size=12),
    st.sampled_from(["2024-01-02T03:04:05Z", "2024-13-01", "x\u00e9\U0001f600", "a\"b\\c\n"]),
)
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=6)
_keys = st.one_of(st.sampled_from(list(_NATIVE_SCHEMA)), st.text(max_size=5))


@st.composite
def _records(draw: Any) -> bytes:
    obj = draw(st.dictionaries(_keys, _values, max_size=8))
    text = json.dumps(obj, ensure_ascii=draw(st.booleans()),
                      separators=draw(st.sampled_from([(",", ":"), (", ", ": ")])))
    raw = text.encode()
    # hand-made shapes the serializer never writes
    return draw(st.sampled_from([raw, raw, raw, raw.replace(b":", b" :\t"),
                                 raw.replace(b"1", b"01"), raw.replace(b"e", b"E+"),
                                 raw[:-1] + b" }", b'{"i": 1, "i": 2}', b'{"s": "\\u0000"}',
                                 b'{"s": "\\ud800"}', b'{"\\u0069": 5}', b'{"f": 1e400}',
                                 b'{"i": 12345678901234567890}', b'{"f": 0.1e-30}']))


_well_typed = st.builds(
    lambda obj, ascii_: json.dumps(obj, ensure_ascii=ascii_).encode(),
    st.fixed_dictionaries({}, optional={
        "i": st.one_of(st.none(), st.integers(-(10**16), 10**16)),
        "j": st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1)),
        "f": st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False),
                       st.integers(-(10**9), 10**9)),
        "b": st.one_of(st.none(), st.booleans()),
        "s": st.one_of(st.none(), st.text()),
        "t": st.one_of(st.none(), st.sampled_from(["2024-01-02T03:04:05Z", "2024-01-02",
                                                   "bad"])),
        "extra": _values}),
    st.booleans())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_records(), _well_typed), min_size=1, max_size=40))
def test_the_c_parser_decodes_as_pyarrow_does(records: list[bytes]) -> None:
    """Every run the C parser accepts decodes exactly as with pyarrow's reader
    (values, nulls, float bits, errors and their reasons); the runs it refuses
    go to pyarrow."""
    native = make_decoder({"type": "json", "schema": _NATIVE_SCHEMA})
    arrow = make_decoder({"type": "json", "schema": _NATIVE_SCHEMA})
    assert native._native is not None, "reclock._json_native was not built"
    arrow._native = None
    data = pa.array(records, pa.binary())
    got, want = native.decode(data), arrow.decode(data)
    assert got.table.equals(want.table), (records, got.table, want.table)
    assert got.ok.tolist() == want.ok.tolist()
    assert got.errors.tolist() == want.errors.tolist()
    assert got.reasons == want.reasons


def test_the_c_parser_fills_typed_columns_and_gives_up_when_unsure() -> None:
    from reclock import _json_native

    fields = ((b"i", 0), (b"j", 1), (b"f", 2), (b"b", 3), (b"s", 4))
    recs = [b'{"i": -7, "j": 3, "f": 2.5e3, "b": true, "s": "a\\u00e9\\ud83d\\ude00", "x": [1]}',
            b'{"s": null, "other": {"deep": [true, null]}}', b'{}']
    off = np.cumsum([0] + [len(r) for r in recs]).astype(np.int64)
    cols = _json_native.parse(off, b"".join(recs), fields)
    assert cols is not None
    ints, _, valid, nulls = cols[0]
    assert np.frombuffer(ints, np.int64)[0] == -7 and nulls == 2 and valid[0] & 1
    assert np.frombuffer(cols[2][0], np.float64)[0] == 2500.0
    s_offsets, s_data, _, s_nulls = cols[4]
    assert s_data.decode() == "a\u00e9\U0001f600" and s_nulls == 2
    assert np.frombuffer(s_offsets, np.int32).tolist() == [0, len(s_data), len(s_data),
                                                           len(s_data)]
    for unsure in [b'{"i": 1.0}', b'{"i": "1"}', b'{"j": 2147483648}', b'{"s": 1}',
                   b'{"b": 0}', b'{"i": 1, "i": 1}', b'{"s": "\\u0000"}', b'{"i": 01}',
                   b'{"x": [1,]}', b'{"i": 1} x', b'{"s": "a\tb"}']:
        assert _json_native.parse(np.array([0, len(unsure)], np.int64), unsure, fields) is None, \
            unsure


def test_schemaless_json_nested_too_deep_is_an_error_row() -> None:
    """Objects nested as deep as arrays are refused alike (a reader's
    json.loads could not parse them back); braces inside strings do not count."""
    dec = make_decoder({"type": "json"})
    docs = [b'{"a": 1}', b'{"a":' * 600 + b"1" + b"}" * 600, b"[" * 600 + b"]" * 600,
            b'{"s": "' + b"{" * 600 + b'"}', b'{"a":' * 100 + b"1" + b"}" * 100]
    res = dec.decode(pa.array(docs, pa.binary()))
    assert sorted(res.ok.tolist()) == [0, 3, 4]
    assert list(zip(res.errors.tolist(), res.reasons, strict=True)) == [
        (1, "json: nested deeper than 512 levels"), (2, "json: nested deeper than 512 levels")]
