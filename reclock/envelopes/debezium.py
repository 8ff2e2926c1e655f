"""The ``debezium`` envelope: a change event carries a ``before`` and an
``after`` image (optionally wrapped in ``{"schema": ..., "payload": ...}``).
The envelope is keyed, ``{type: debezium, key: [cols]}`` (the key columns of
the images): after images are values, deletes are tombstones of the before
image's key, and the key state retracts what the output holds, as for
``upsert``; each change lands at the record's IntoTime with its source
position. Creates have no before, deletes no after; an event with neither,
or that is not a JSON object, is an error row.

The key is required (as Materialize requires one for this envelope): under
``REPLICA IDENTITY DEFAULT`` Debezium sends updates with ``before: null`` and
deletes whose before image holds only the key, so without a key there is
nothing to retract: the old row would stay live beside error rows. A
configuration without one is refused where it is written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt
import pyarrow as pa
from pydantic_core import InitErrorDetails

from reclock.contracts.config import problem
from reclock.contracts.envelope import (
    EnvelopeModel,
    EnvelopePlugin,
    RowPlan,
    meta_columns,
    null_columns,
)
from reclock.core.errors import DefiniteError

#: Why a debezium envelope needs a key, and what to write.
MISSING_KEY = (
    "the debezium envelope needs a key: the key columns of the images, e.g. "
    "envelope: {type: debezium, key: [id]} with the upstream table's primary key. "
    "Without one, an update with 'before: null' or a delete whose before image holds "
    "only the key (REPLICA IDENTITY DEFAULT) cannot retract the old row, which would "
    "stay live beside error rows"
)


class DebeziumEnvelope(EnvelopeModel):
    """Debezium change events: ``before`` / ``after`` images."""

    type: Literal["debezium"] = "debezium"
    """``debezium``."""

    TAKES_EXTRA: ClassVar[bool] = False
    key: tuple[str, ...] = ()
    """Key columns of the images (required, at least one: the upstream
    table's primary key). The output keeps one row per key and retracts what
    it holds, so events whose before image is missing or holds only the key
    (``REPLICA IDENTITY DEFAULT`` upstream) are applied exactly."""

    @property
    def allow_null(self) -> bool:
        return False

    @classmethod
    def check_raw(cls, data: Mapping[str, Any]) -> list[InitErrorDetails]:
        key = data.get("key")
        if key is None or (isinstance(key, list | tuple) and not key):
            return [problem(("key",) if "key" in data else (), MISSING_KEY)]
        return []

    def resolve(self, what: str, columns: list[str], key_columns: list[str] | None
                ) -> tuple[str, ...] | None:
        if key_columns is None:
            raise DefiniteError(f"{what}: debezium needs raw records (a Kafka topic), not "
                                "typed rows")
        if not self.key:  # (a model built in code without validation)
            raise DefiniteError(f"{what}: {MISSING_KEY}")
        missing = [k for k in self.key if k not in columns]
        if missing:
            raise DefiniteError(
                f"{what}: debezium key columns {missing} are not columns of the images "
                f"({columns})", hint="name key columns that the format's schema has")
        return tuple(self.key)

    def rows(self, plan: RowPlan, batch: pa.RecordBatch, into: npt.NDArray[np.int64]
             ) -> tuple[pa.Table, int]:
        return _debezium_rows(plan, batch, into)


@dataclass(frozen=True)
class DebeziumSplit:
    """A batch of change events split into images.

    ``before``/``after`` are JSON object bytes (null where the image is
    absent); ``errors`` are indices of events that are not valid, with reasons.
    """

    before: pa.Array
    after: pa.Array
    errors: npt.NDArray[np.int64]
    reasons: list[str]


def split_debezium(values: pa.Array) -> DebeziumSplit:
    before: list[bytes | None] = []
    after: list[bytes | None] = []
    errors: list[int] = []
    reasons: list[str] = []
    for i, raw in enumerate(values.to_pylist()):
        b = a = None
        try:
            if raw is None:
                raise ValueError("value is null")
            event: Any = json.loads(raw)
            if isinstance(event, dict) and isinstance(event.get("payload"), dict):
                event = event["payload"]
            if not isinstance(event, dict):
                raise ValueError("not a JSON object")
            bi, ai = event.get("before"), event.get("after")
            if bi is None and ai is None:
                raise ValueError("neither 'before' nor 'after' is present")
            for name, img in (("before", bi), ("after", ai)):
                if img is not None and not isinstance(img, dict):
                    raise ValueError(f"'{name}' is not a JSON object")
            b = None if bi is None else json.dumps(bi).encode()
            a = None if ai is None else json.dumps(ai).encode()
        except (ValueError, UnicodeDecodeError) as exc:
            errors.append(i)
            reasons.append(f"debezium: {exc}")
        before.append(b)
        after.append(a)
    return DebeziumSplit(pa.array(before, pa.binary()), pa.array(after, pa.binary()),
                         np.array(errors, dtype=np.int64), reasons)



def _debezium_rows(plan: RowPlan, batch: pa.RecordBatch, into: npt.NDArray[np.int64]
                   ) -> tuple[pa.Table, int]:
    """The events as intents of the keyed output: after images are values,
    deletes tombstones of the before image's key. An event fails as a whole:
    if it is malformed or either image does not decode, it becomes one error
    row and neither image is written."""
    assert plan.keyed, "a debezium output is keyed (DebeziumEnvelope.resolve)"
    schema, user = plan.schema, plan.user_schema
    value = batch.column("value")
    split = split_debezium(value)
    bad: dict[int, str] = dict(zip(split.errors.tolist(), split.reasons, strict=True))
    decoded: list[tuple[int, npt.NDArray[np.int64], Any]] = []
    for images, diff in ((split.before, -1), (split.after, 1)):
        present = np.flatnonzero(~np.asarray(images.is_null().to_numpy(zero_copy_only=False)))
        if not len(present):
            continue
        res = plan.value_decoder.decode(images.take(pa.array(present)))  # type: ignore[union-attr]
        for j, why in zip(np.asarray(res.errors, dtype=np.int64).tolist(), res.reasons,
                          strict=True):
            bad.setdefault(int(present[j]), f"{'before' if diff < 0 else 'after'}: {why}")
        decoded.append((diff, present[np.asarray(res.ok, dtype=np.int64)], res.table))
    decoded = _debezium_intents(plan, decoded, split.after)
    parts: list[pa.Table] = []
    for diff, ok, table in decoded:
        keep = ~np.isin(ok, np.fromiter(bad, dtype=np.int64, count=len(bad)))
        rows_ok = ok[keep]
        if not len(rows_ok):
            continue
        k = len(rows_ok)
        meta = meta_columns(batch, into, rows_ok)
        meta[1] = pa.array(np.full(k, diff, dtype=np.int64))
        cols = [table.column(up).filter(pa.array(keep)).cast(f.type) for up, f in plan.picks()]
        parts.append(pa.Table.from_arrays(
            [*cols, *meta, pa.nulls(k, pa.string()), pa.nulls(k, pa.binary()),
             pa.nulls(k, pa.binary())], schema=schema))
    if bad:
        idx = np.array(sorted(bad), dtype=np.int64)
        k = len(idx)
        take = pa.array(idx)
        parts.append(pa.Table.from_arrays(
            [*null_columns(user, k), *meta_columns(batch, into, idx),
             pa.array([bad[i] for i in idx.tolist()], pa.string()),
             batch.column("key").take(take).cast(pa.binary()),
             value.take(take).cast(pa.binary())], schema=schema))
    if not parts:
        return schema.empty_table(), 0
    return pa.concat_tables(parts), len(bad)


def _debezium_intents(
    plan: RowPlan, decoded: list[tuple[int, npt.NDArray[np.int64], Any]], after: pa.Array
) -> list[tuple[int, npt.NDArray[np.int64], Any]]:
    """Keyed debezium: (diff, event indices, images) as upsert intents. A
    delete (no after image) is a tombstone (diff 0) of its before image's key;
    an update that moves the key tombstones the old key first. Tombstones come
    before values, and the driver's stable sort keeps that order within an
    event's position."""
    befores = next(((ok, t) for d, ok, t in decoded if d < 0), None)
    afters = next(((ok, t) for d, ok, t in decoded if d > 0), None)
    out: list[tuple[int, npt.NDArray[np.int64], Any]] = []
    if befores is not None:
        ok, table = befores
        has_after = ~np.asarray(after.is_null().to_numpy(zero_copy_only=False))[ok]
        gone = ~has_after
        if afters is not None and has_after.any():
            # an update whose key differs from its before image's: the old key goes
            a_ok, a_table = afters
            pos = {int(e): r for r, e in enumerate(a_ok.tolist())}
            b_keys = [tuple(table.column(k)[r].as_py() for k in plan.upstream_key)
                      for r in range(len(ok))]
            for r, e in enumerate(ok.tolist()):
                if has_after[r] and int(e) in pos:
                    a_key = tuple(a_table.column(k)[pos[int(e)]].as_py()
                                  for k in plan.upstream_key)
                    gone[r] = a_key != b_keys[r]
        if gone.any():
            out.append((0, ok[gone], table.filter(pa.array(gone))))
    if afters is not None:
        out.append((1, *afters))
    return out


PLUGIN = EnvelopePlugin(name="debezium", config=DebeziumEnvelope)
