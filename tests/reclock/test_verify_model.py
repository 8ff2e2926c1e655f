"""``verify``'s own model of the upsert envelope (``upsert_model``, one
vectorized sort) makes the same update log as the envelope itself
(``UpsertState.apply``, a Python step per intent), row for row, for any
intents: values, equal values again, tombstones (of absent keys too), error
rows, several keys at one IntoTime and one position."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reclock.contracts.rows import output_schema
from reclock.runtime.keystate import hashable
from reclock.runtime.upsert_state import UpsertState
from reclock.verify import upsert_model

pytestmark = pytest.mark.unit

USER = pa.schema([("id", pa.int64()), ("body", pa.string()), ("x", pa.float64())])
SCHEMA = output_schema(USER)

intent = st.tuples(
    st.integers(0, 4),  # key
    st.one_of(st.none(), st.sampled_from(["a", "b"])),  # body (None: a null body)
    st.sampled_from([0.0, -0.0, 1.5, float("nan")]),
    st.sampled_from(["value", "value", "tombstone", "error"]),
    st.integers(1, 3),  # IntoTime
    st.integers(0, 1),  # partition
)


def _intents(spec: list[tuple[Any, ...]]) -> pa.Table:
    cols: dict[str, list[Any]] = {f.name: [] for f in SCHEMA}
    for i, (k, body, x, what, into, part) in enumerate(spec):
        row = {"id": k, "body": body, "x": x, "_into_time": into * 1000,
               "_diff": 0 if what == "tombstone" else 1, "_src_part": part,
               "_src_offset": i, "_src_seq": 0, "_src_ts": None,
               "_error": "bad" if what == "error" else None,
               "_raw_key": b"k" if what == "error" else None,
               "_raw_value": b"{" if what == "error" else None}
        if what == "error":
            row.update(id=None, body=None, x=None)
        for f in SCHEMA:
            cols[f.name].append(row[f.name])
    return pa.Table.from_pydict(cols, schema=SCHEMA)


def _log(t: pa.Table) -> Counter[tuple[Any, ...]]:
    return Counter(tuple(hashable(r[f.name]) for f in SCHEMA) for r in t.to_pylist())


@settings(max_examples=300, deadline=None)
@given(st.lists(intent, max_size=40))
def test_the_vectorized_model_is_the_envelope(spec: list[tuple[Any, ...]]) -> None:
    intents = _intents(spec)
    want, _ = UpsertState(list(USER.names), ("id",)).apply(intents, SCHEMA)
    got = upsert_model(intents, SCHEMA, list(USER.names), ("id",))
    assert _log(got) == _log(want)


def test_a_truncate_goes_through_the_envelope_itself() -> None:
    intents = _intents([(1, "a", 0.0, "value", 1, 0), (2, "b", 0.0, "value", 1, 0)])
    intents = pa.concat_tables([intents, _intents([(None, None, None, "value", 2, 0)])
                                .set_column(SCHEMA.get_field_index("_diff"),
                                            SCHEMA.field("_diff"), pa.array([-2], pa.int64()))])
    got = upsert_model(intents, SCHEMA, list(USER.names), ("id",))
    assert sorted(got.column("_diff").to_pylist()) == [-1, -1, 1, 1]
