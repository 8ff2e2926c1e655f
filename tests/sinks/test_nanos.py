"""Nanosecond timestamps, times and durations where rows become Python
values (a refused row's JSON, the console sink, ``reclock read``): pyarrow
makes such values Python objects only through pandas, which reclock does
not require, so these paths give them as text and never need pandas."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pyarrow as pa

from reclock.contracts.encoding import py_rows

NS = 1_700_000_000_123_456_789


def test_py_rows_gives_nanoseconds_as_text_nested_too() -> None:
    t = pa.table({
        "ts": pa.array([NS, None], pa.timestamp("ns", tz="UTC")),
        "l": pa.array([[1001], None], pa.list_(pa.duration("ns"))),
        "s": pa.array([{"x": 5}, None], pa.struct([("x", pa.time64("ns"))])),
        "m": pa.array([[("k", 7)], None], pa.map_(pa.string(), pa.timestamp("ns"))),
        "d": pa.array([NS, NS]).cast(pa.timestamp("ns")).dictionary_encode(),
        "us": pa.array([1, 2], pa.timestamp("us")),
        "i": [1, 2],
    })
    rows = py_rows(t)
    assert rows[0]["ts"] == "2023-11-14 22:13:20.123456789Z"
    assert rows[0]["l"] == ["1001"]
    assert rows[0]["s"] == {"x": "00:00:00.000000005"}
    assert rows[0]["m"] == [("k", "1970-01-01 00:00:00.000000007")]
    assert rows[1]["d"] == "2023-11-14 22:13:20.123456789"
    # other columns as to_pylist gives them
    assert [r["us"] for r in rows] == t.column("us").to_pylist()
    assert rows[1] == {"ts": None, "l": None, "s": None, "m": None,
                       "d": "2023-11-14 22:13:20.123456789", "us": rows[1]["us"], "i": 2}


def test_refused_and_printed_rows_need_no_pandas() -> None:
    """Run where ``import pandas`` fails, as on a machine without it."""
    code = textwrap.dedent(f"""
        import sys

        class NoPandas:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "pandas":
                    raise ImportError("no pandas here")
                return None

        sys.meta_path.insert(0, NoPandas())
        import io, json
        import pyarrow as pa
        from reclock.contracts.rows import refuse_rows
        from reclock.sinks.console import ConsoleStager
        from tests.sinks.rows import updates

        base = updates(["a", "b"], 1).drop_columns(["k", "v"])
        ts = pa.array([{NS}, {NS} - {NS} % 1000], pa.timestamp("ns"))
        table = pa.table([ts, *base.columns], names=["ts", *base.column_names])
        out = refuse_rows(table, [True, False], "nanoseconds")
        raw = out.column("_raw_value").to_pylist()
        assert json.loads(raw[0]) == {{"ts": "2023-11-14 22:13:20.123456789"}}, raw
        assert out.column("_error").to_pylist() == ["nanoseconds", None]
        staged = ConsoleStager().stage("b", 0, table)
        assert staged[0]["rows"][0]["ts"] == "2023-11-14 22:13:20.123456789", staged
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
