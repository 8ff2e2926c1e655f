"""Row digests: a 64-bit hash of each row's values, computed a column at a
time with numpy over the Arrow buffers (``reclock verify`` compares what an
output holds with what its source's records must produce, a million rows in
well under a second).

Equal values give equal digests under the equality :mod:`reclock.contracts.consolidate`
uses (SQL ``GROUP BY``): nulls equal each other, ``-0.0`` equals ``0.0``, NaN
equals NaN; a column's digest depends on its values, not on how Arrow holds
them (``string`` or ``large_string``, chunks, offsets). Both sides of a
comparison must be cast to one schema first (:func:`conform`): an ``int32``
and an ``int64`` column of equal values hash alike, a timestamp in
milliseconds and one in microseconds do not.

Digests are made to be *summed*: the digest of a multiset of updates is the
sum of ``diff * digest`` over them (wrapping modulo 2**64), so a row and its
retraction cancel, and what an update log nets to at a position or a time
compares as one number (:func:`signed_sums`). Two different rows share a
digest with probability about 2**-64: a digest detects a changed value, it
is no cryptographic proof against a forger.

How each column is hashed:

* fixed-width numbers and times: their integer value (floats: their bits,
  ``-0.0`` and NaN made canonical), mixed by the splitmix64 finalizer;
* strings and bytes: the sum over their bytes of ``mix(index, byte)``, and
  their length (vectorized with one cumulative sum per slice of at most
  :data:`SLICE_BYTES` bytes);
* decimals: their text (exact, one scale per column);
* anything else (lists, structs, maps): a canonical JSON text per value, in
  Python (slow, and rare in outputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from reclock.core.columns import DIFF, ERROR, RAW_KEY, RAW_VALUE

U64 = npt.NDArray[np.uint64]

#: bytes of strings hashed in one vectorized step (memory: about 40 bytes each)
SLICE_BYTES = 4 * 2**20

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_NULL = np.uint64(0x6A09E667F3BCC908)  # the digest of a null value, any type
_ERROR_TAG = np.uint64(0xBB67AE8584CAA73B)  # error rows hash apart from data rows


def mix(x: U64) -> U64:
    """The splitmix64 finalizer, elementwise (a new array)."""
    x = x ^ (x >> np.uint64(30))
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def _numbers(arr: pa.Array) -> U64:
    """Fixed-width values as uint64 (nulls arbitrary)."""
    t = arr.type
    if pa.types.is_boolean(t):
        b = arr.cast(pa.int8()).fill_null(0).to_numpy().astype(np.int64)
        return b.view(np.uint64)  # type: ignore[no-any-return]
    if pa.types.is_floating(t):
        f = arr.cast(pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False).copy()
        f[f == 0.0] = 0.0  # -0.0
        f[np.isnan(f)] = np.nan  # one NaN
        return f.view(np.uint64)  # type: ignore[no-any-return]
    if not pa.types.is_integer(t):  # dates, times, timestamps, durations
        arr = arr.view(pa.int32() if t.bit_width == 32 else pa.int64())
    vals = arr.fill_null(0).to_numpy(zero_copy_only=False)
    if vals.dtype == np.uint64:
        return vals  # type: ignore[no-any-return]
    return vals.astype(np.int64).view(np.uint64)  # type: ignore[no-any-return]


def _bytes(arr: pa.Array) -> U64:
    """Strings or bytes (nulls arbitrary): see the module."""
    arr = arr.cast(pa.large_binary())
    n = len(arr)
    bufs = arr.buffers()
    offs = np.frombuffer(bufs[1], np.int64, count=n + 1, offset=arr.offset * 8)
    data = (np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None
            else np.zeros(0, np.uint8))
    out = np.empty(n, np.uint64)
    i = 0
    while i < n:
        j = int(np.searchsorted(offs, offs[i] + SLICE_BYTES, side="right")) - 1
        j = min(max(j, i + 1), n)
        lo, hi = int(offs[i]), int(offs[j])
        starts = offs[i:j] - lo
        lens = np.diff(offs[i:j + 1])
        if hi > lo:
            local = np.arange(hi - lo, dtype=np.int64) - np.repeat(starts, lens)
            v = mix(local.view(np.uint64) * np.uint64(256) + data[lo:hi].astype(np.uint64)
                    + _GOLD)
            cs = np.zeros(hi - lo + 1, np.uint64)
            np.cumsum(v, out=cs[1:])
            seg = cs[offs[i + 1:j + 1] - lo] - cs[starts]
        else:
            seg = np.zeros(j - i, np.uint64)
        out[i:j] = mix(seg ^ mix(lens.view(np.uint64) + _M2))
        i = j
    return out


def _json_texts(arr: pa.Array) -> pa.Array:
    from reclock.contracts.consolidate import row_keys

    return pa.array(row_keys(pa.table({"v": arr}), ["v"]), pa.large_string())


def column_digests(col: pa.Array | pa.ChunkedArray) -> U64:
    """One digest per value of ``col`` (see the module)."""
    if isinstance(col, pa.ChunkedArray):
        if col.num_chunks == 1:
            return column_digests(col.chunk(0))
        if col.num_chunks == 0:
            return np.zeros(0, np.uint64)
        return np.concatenate([column_digests(c) for c in col.chunks])
    t = col.type
    if pa.types.is_dictionary(t):
        col = col.dictionary_decode()
        t = col.type
    if pa.types.is_null(t):
        return np.full(len(col), _NULL, np.uint64)
    if pa.types.is_decimal(t):
        h = _bytes(col.cast(pa.large_string()))
    elif (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
          or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)
          or pa.types.is_string_view(t) or pa.types.is_binary_view(t)):
        h = _bytes(col)
    elif (pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t)
          or pa.types.is_temporal(t)):
        h = mix(_numbers(col) ^ _GOLD)
    else:
        h = _bytes(_json_texts(col))
    if col.null_count:
        h[~col.is_valid().to_numpy(zero_copy_only=False)] = _NULL
    return h


def row_digests(table: pa.Table, columns: Sequence[str]) -> U64:
    """One digest per row of ``table``'s ``columns`` (in that order)."""
    h = np.zeros(table.num_rows, np.uint64)
    for i, c in enumerate(columns):
        h = mix(h * _GOLD + column_digests(table.column(c)) + np.uint64(i + 1))
    return h


def update_digests(table: pa.Table, columns: Sequence[str]) -> U64:
    """The digest of each row of an output's update log: a data row by its
    user ``columns``, an error row by its raw key and value (its reason is
    prose, worded differently by other versions), apart from data rows."""
    h = row_digests(table, columns)
    if ERROR in table.column_names and table.column(ERROR).null_count < table.num_rows:
        err = table.column(ERROR).is_valid().to_numpy(zero_copy_only=False)
        raw = row_digests(table, [RAW_KEY, RAW_VALUE]) ^ _ERROR_TAG
        h[err] = raw[err]
    return h


def signed(table: pa.Table, digests: U64) -> U64:
    """``diff * digest`` per row (wrapping): summed, a multiset's digest."""
    d = table.column(DIFF).to_numpy().astype(np.int64).view(np.uint64)
    return digests * d  # type: ignore[no-any-return]


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table``'s columns named in ``schema``, cast to its types (a column
    it lacks: nulls; a value the type cannot hold exactly: cast unsafely, as
    the output could not have held it either)."""
    cols: list[Any] = []
    for f in schema:
        if f.name not in table.column_names:
            cols.append(pa.nulls(table.num_rows, f.type))
            continue
        col = table.column(f.name)
        if col.type != f.type:
            try:
                col = col.cast(f.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                col = pc.cast(col, f.type, safe=False)
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=pa.schema([f.with_nullable(True) for f in schema]))
