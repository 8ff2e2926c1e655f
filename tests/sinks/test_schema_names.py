"""Field names a sink cannot hold as columns are a definite error that names
them, never a retry loop: names that differ only in case, and names that
clash with reclock's own columns in any case."""

from __future__ import annotations

import pyarrow as pa
import pytest

from reclock.errors import DefiniteError
from sinks.base import META_NAMES, output_schema


@pytest.mark.parametrize("names, named", [
    (["a", "A"], "'a' and 'A'"),
    (["id", "Id", "ID"], "'id' and 'Id', 'id' and 'ID'"),
    (["x", "x"], "'x' and 'x'"),
])
def test_names_that_differ_only_in_case(names: list[str], named: str) -> None:
    schema = pa.schema([(n, pa.int64()) for n in names])
    with pytest.raises(DefiniteError, match="differ only in case") as err:
        output_schema(schema)
    assert named in str(err.value) and err.value.hint


@pytest.mark.parametrize("name", ["_into_time", "_Into_Time", "_DIFF", "_error"])
def test_names_that_clash_with_reclocks_columns_in_any_case(name: str) -> None:
    with pytest.raises(DefiniteError, match="clash with reclock's own columns") as err:
        output_schema(pa.schema([("v", pa.string()), (name, pa.int64())]))
    assert name in str(err.value)


def test_distinct_names_pass() -> None:
    out = output_schema(pa.schema([("a", pa.int64()), ("b_", pa.string())]))
    assert out.names[:2] == ["a", "b_"] and out.names[2:] == list(META_NAMES)
