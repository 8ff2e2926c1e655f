"""The ``bytes`` and ``text`` formats."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from reclock.formats.base import (
    NULL_REASON,
    DecodeResult,
    _as_binary,
    _Collector,
    _screen,
    _valid_mask,
)

I64 = npt.NDArray[np.int64]

# bytes / text


class BytesDecoder:
    """``{"type": "bytes"}``: the record as column ``data`` (binary). Never fails
    except on a null record (see module doc)."""

    def __init__(self, allow_null: bool = False) -> None:
        self.allow_null = allow_null
        self.schema = pa.schema([pa.field("data", pa.binary())])

    def decode(self, data: pa.Array) -> DecodeResult:
        data = _as_binary(data)
        n = len(data)
        if data.null_count == 0 or self.allow_null:
            col = data.cast(pa.binary())
            table = pa.Table.from_arrays([col], schema=self.schema)
            return DecodeResult(table, np.arange(n, dtype=np.int64), np.zeros(0, np.int64), [])
        valid = _valid_mask(data)
        ok = np.flatnonzero(valid).astype(np.int64)
        err = np.flatnonzero(~valid).astype(np.int64)
        col = data.filter(pa.array(valid)).cast(pa.binary())
        table = pa.Table.from_arrays([col], schema=self.schema)
        return DecodeResult(table, ok, err, [NULL_REASON] * len(err))


class TextDecoder:
    """``{"type": "text"}``: the record as column ``text`` (string); a record
    that is not valid UTF-8 is an error row."""

    def __init__(self, allow_null: bool = False) -> None:
        self.allow_null = allow_null
        self.schema = pa.schema([pa.field("text", pa.string())])

    def decode(self, data: pa.Array) -> DecodeResult:
        data = _as_binary(data)
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
        _, cand = _screen(data, None, None, utf8=True)
        c = _Collector(self.schema, "text")
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


