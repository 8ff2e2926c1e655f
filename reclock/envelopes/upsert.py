"""The ``upsert`` envelope: by key, the latest value wins and a null value
deletes. The output holds retractions and insertions, so it reads as the
current state as of any IntoTime. Tasks decode records into *intents*
(``_diff`` 1 for a value, 0 for a tombstone); the driver settles them against
each key's current row (:mod:`reclock.runtime.upsert_state`), as it does
those of keyed debezium and keyed CDC outputs.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.typing as npt
import pyarrow as pa
from pydantic import Field

from reclock.contracts.envelope import EnvelopeModel, EnvelopePlugin, RowPlan, decoded_rows
from reclock.core.errors import DefiniteError


class UpsertEnvelope(EnvelopeModel):
    """Upsert by key: a later value for a key replaces the earlier one; a null
    value deletes the key."""

    type: Literal["upsert"] = "upsert"
    """``upsert``."""
    key: tuple[str, ...] = Field(min_length=1)
    """The key columns (at least one)."""

    @property
    def allow_null(self) -> bool:
        return True  # a tombstone

    def resolve(self, what: str, columns: list[str], key_columns: list[str] | None
                ) -> tuple[str, ...] | None:
        have = columns if key_columns is None else key_columns
        missing = [k for k in self.key if k not in have]
        if missing:
            raise DefiniteError(
                f"{what}: upsert key columns {missing} must come from "
                f"{'the rows' if key_columns is None else 'key_format'} (it has {have})",
                hint="a tombstone has no value, so the key must be decoded from the "
                "record key: set key_format with a schema naming the key columns")
        return tuple(self.key)

    def rows(self, plan: RowPlan, batch: pa.RecordBatch, into: npt.NDArray[np.int64]
             ) -> tuple[pa.Table, int]:
        return decoded_rows(plan, batch, into, tombstones=True)


PLUGIN = EnvelopePlugin(name="upsert", config=UpsertEnvelope)
