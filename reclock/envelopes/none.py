"""The ``none`` envelope: append; every record is one insertion (diff +1)."""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from reclock.config.base import _Model
from reclock.envelopes.base import RowPlan, decoded_rows


class NoneEnvelope(_Model):
    """Append only: every record is an insert."""

    type: Literal["none"] = "none"
    """``none``."""

    @property
    def allow_null(self) -> bool:
        return False

    def resolve(self, what: str, columns: list[str], key_columns: list[str] | None
                ) -> tuple[str, ...] | None:
        return None

    def rows(self, plan: RowPlan, batch: pa.RecordBatch, into: npt.NDArray[np.int64]
             ) -> tuple[pa.Table, int]:
        return decoded_rows(plan, batch, into, tombstones=False)
