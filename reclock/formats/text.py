"""The ``text`` format: each record one UTF-8 string."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from reclock.contracts.config import ConfigModel
from reclock.contracts.decode import (
    Collector,
    DecodeResult,
    DecoderOptions,
    FormatPlugin,
    as_binary,
    screen,
)

I64 = npt.NDArray[np.int64]

class TextDecoder:
    """``{"type": "text"}``: the record as column ``text`` (string); a record
    that is not valid UTF-8 is an error row."""

    def __init__(self, allow_null: bool = False) -> None:
        self.allow_null = allow_null
        self.schema = pa.schema([pa.field("text", pa.string())])

    def decode(self, data: pa.Array) -> DecodeResult:
        data = as_binary(data)
        n = len(data)
        if data.null_count == 0 or self.allow_null:
            try:  # a null record stays a null row: exactly what the cast gives
                col = data.cast(pa.string())
                table = pa.Table.from_arrays([col], schema=self.schema)
                return DecodeResult(
                    table, np.arange(n, dtype=np.int64), np.zeros(0, np.int64), []
                )
            except (pa.ArrowException, ValueError):
                pass
        _, cand = screen(data, None, None, utf8=True)
        c = Collector(self.schema, "text")
        rest = np.flatnonzero(~cand)
        for i, raw in zip(rest.tolist(), data.take(pa.array(rest)).to_pylist(), strict=True):
            if raw is None:
                c.null(i, self.allow_null)
                continue
            try:
                raw.decode("utf-8")
                c.error(i, "text: invalid utf-8")  # pragma: no cover - the screen said so
            except UnicodeDecodeError as exc:
                c.error(i, f"text: invalid utf-8: {exc}")
        good = np.flatnonzero(cand).astype(np.int64)
        col = data.filter(pa.array(cand)).cast(pa.string())
        c.table(pa.Table.from_arrays([col], schema=self.schema), good)
        return c.result()


class TextFormat(ConfigModel):
    """Each record is one UTF-8 string (a ``text`` column)."""

    type: Literal["text"] = "text"
    """``text``."""


def _decoder(spec: Mapping[str, Any], options: DecoderOptions) -> TextDecoder:
    return TextDecoder(allow_null=options.allow_null)


PLUGIN = FormatPlugin(name="text", config=TextFormat, decoder=_decoder)
