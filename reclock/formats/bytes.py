"""The ``bytes`` format: each record kept as it is."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from reclock.contracts.config import ConfigModel
from reclock.contracts.decode import (
    NULL_REASON,
    DecodeResult,
    DecoderOptions,
    FormatPlugin,
    as_binary,
    valid_mask,
)


class BytesDecoder:
    """``{"type": "bytes"}``: the record as column ``data`` (binary). Never fails
    except on a null record (see module doc)."""

    def __init__(self, allow_null: bool = False) -> None:
        self.allow_null = allow_null
        self.schema = pa.schema([pa.field("data", pa.binary())])

    def decode(self, data: pa.Array) -> DecodeResult:
        data = as_binary(data)
        n = len(data)
        if data.null_count == 0 or self.allow_null:
            col = data.cast(pa.binary())
            table = pa.Table.from_arrays([col], schema=self.schema)
            return DecodeResult(table, np.arange(n, dtype=np.int64), np.zeros(0, np.int64), [])
        valid = valid_mask(data)
        ok = np.flatnonzero(valid).astype(np.int64)
        err = np.flatnonzero(~valid).astype(np.int64)
        col = data.filter(pa.array(valid)).cast(pa.binary())
        table = pa.Table.from_arrays([col], schema=self.schema)
        return DecodeResult(table, ok, err, [NULL_REASON] * len(err))


class BytesFormat(ConfigModel):
    """Each record is kept as raw bytes (a ``data`` column)."""

    type: Literal["bytes"] = "bytes"
    """``bytes``."""


def _decoder(spec: Mapping[str, Any], options: DecoderOptions) -> BytesDecoder:
    return BytesDecoder(allow_null=options.allow_null)


PLUGIN = FormatPlugin(name="bytes", config=BytesFormat, decoder=_decoder)
