"""The ``none`` envelope: append; every record is one insertion (diff +1)."""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from reclock.contracts.envelope import EnvelopeModel, EnvelopePlugin, RowPlan, decoded_rows


class NoneEnvelope(EnvelopeModel):
    """Append only: every record is an insert."""

    type: Literal["none"] = "none"
    """``none``."""

    APPEND_ONLY: ClassVar[bool] = True

    @property
    def allow_null(self) -> bool:
        return False

    def resolve(self, what: str, columns: list[str], key_columns: list[str] | None
                ) -> tuple[str, ...] | None:
        return None

    def rows(self, plan: RowPlan, batch: pa.RecordBatch, into: npt.NDArray[np.int64]
             ) -> tuple[pa.Table, int]:
        return decoded_rows(plan, batch, into, tombstones=False)


PLUGIN = EnvelopePlugin(name="none", config=NoneEnvelope)
