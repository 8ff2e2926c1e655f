"""CSV records of a one-shot load: where they end, with quoted newlines.

A CSV record ends at a newline outside quotes, so a load cannot cut a CSV
file at line starts as it cuts JSON lines. The rules, as the csv decoder
(Arrow's parser, and Python's ``csv``) reads them: a quote at the start of a
field opens a quoted field; inside it two quotes are one quote and a quote
before anything else closes it; a quote anywhere else is a plain character.

:func:`record_ends` applies them to a buffer from a known state: fast (with
numpy) when every quote is where a well-formed file has it, else quote by
quote. :func:`record_starts` runs it over a file once, when a load is
requested, to find the record that starts first at or after each
``split_size`` boundary: the load's byte ranges start there, in the state
"outside quotes, at a field start", so each task reads its records exactly,
whatever the file's quoting (a stray quote makes one long bad record, an
error row, in every reading alike).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

NL, CR = 10, 13
#: Bytes read per step when scanning a file for record starts.
BLOCK = 16 * 2**20

Ends = npt.NDArray[np.int64]


def record_ends(buf: bytes, delimiter: bytes, quote: int = ord('"'), inside: bool = False,
                prev: int = NL) -> tuple[Ends, bool]:
    """Positions in ``buf`` of the newlines that end records, and whether
    ``buf`` ends inside quotes. ``inside``: the state before ``buf``;
    ``prev``: the byte before it (a newline at a record start). ``buf``
    must not end with a quote unless it is the end of the file (the
    meaning of a quote can depend on the byte after it)."""
    arr = np.frombuffer(buf, np.uint8)
    nl = np.flatnonzero(arr == NL)
    q = np.flatnonzero(arr == quote)
    if not len(q):
        return (nl.astype(np.int64) if not inside else nl[:0].astype(np.int64)), inside
    if len(delimiter) == 1 and _regular(arr, q, delimiter[0], quote, inside, prev):
        out = ((np.searchsorted(q, nl) + inside) % 2) == 0
        return nl[out].astype(np.int64), bool((len(q) + inside) % 2)
    return _exact(buf, arr, nl, q, delimiter, quote, inside, prev)


def _regular(arr: npt.NDArray[np.uint8], q: npt.NDArray[np.intp], delim: int, quote: int,
             inside: bool, prev: int) -> bool:
    """Whether every quote toggles the state (then counting them is exact):
    each opening quote starts a field (or follows a closing quote: two
    quotes inside a field), each closing one ends it (or precedes an
    opening one)."""
    seps = np.array([delim, NL, CR], np.uint8)
    k = np.arange(len(q)) + inside
    before = np.where(q > 0, arr[np.maximum(q - 1, 0)], prev)
    after_i = np.minimum(q + 1, len(arr) - 1)
    after = np.where(q + 1 < len(arr), arr[after_i], NL)  # the file's end ends a field
    opening, closing = k % 2 == 0, k % 2 == 1
    prev_q = np.concatenate([[-2], q[:-1]])
    next_q = np.concatenate([q[1:], [-2]])
    ok_open = np.isin(before, seps) | (prev_q == q - 1)
    ok_close = np.isin(after, seps) | (next_q == q + 1)
    return bool(np.all(ok_open[opening]) and np.all(ok_close[closing]))


def _exact(buf: bytes, arr: Any, nl: Any, q: Any, delimiter: bytes, quote: int,
           inside: bool, prev: int) -> tuple[Ends, bool]:
    """Quote by quote (any file)."""
    seps = (NL, CR)
    dl = len(delimiter)
    opens: list[int] = []
    closes: list[int] = []
    if inside:
        opens.append(-1)
    skip = -1
    n = len(buf)
    for p in q.tolist():
        if p == skip:
            continue
        if not inside:
            at_start = (p == 0 and (prev in seps or bytes([prev]) == delimiter[-1:])) or (
                p > 0 and (arr[p - 1] in seps or (p >= dl and buf[p - dl:p] == delimiter)))
            if at_start:
                inside = True
                opens.append(p)
        elif p + 1 < n and buf[p + 1] == quote:
            skip = p + 1  # two quotes: one quote, still inside
        else:
            inside = False
            closes.append(p)
    if inside:
        closes.append(n)
    o, c = np.array(opens, np.int64), np.array(closes, np.int64)
    i = np.searchsorted(o, nl) - 1
    quoted = (i >= 0) & (nl < c[np.maximum(i, 0)] if len(c) else False)
    return nl[~quoted].astype(np.int64), inside


def record_starts(read: Any, size: int, split: int, delimiter: bytes,
                  quote: int = ord('"')) -> list[int]:
    """The offsets where a file's byte ranges start: 0, then per multiple of
    ``split`` the first record that starts at or after it (ranges that would
    start inside a record move to its end; several may meet there).
    ``read(lo, hi)``: the file's bytes ``[lo, hi)``. Reads the file up to
    the last such record."""
    starts = [0]
    bounds = list(range(split, size, split))
    s, inside, prev = 0, False, NL
    while bounds and s < size:
        data = read(s, min(size, s + max(BLOCK, split)))
        while data and data[-1] == quote and s + len(data) < size:
            data += read(s + len(data), s + len(data) + 1)  # what follows a quote
        if not data:
            break
        ends, inside = record_ends(data, delimiter, quote, inside, prev)
        ends = ends + s
        while bounds:
            j = int(np.searchsorted(ends, bounds[0] - 1))
            if j == len(ends):
                break  # in a later block
            start = int(ends[j]) + 1
            if start < size and start > starts[-1]:
                starts.append(start)
            bounds = [b for b in bounds if b > start]
        s += len(data)
        prev = data[-1]
    return starts


def records(buf: bytes, delimiter: bytes, quote: int = ord('"')) -> list[bytes]:
    """The records of ``buf`` (which starts at a record start), without the
    newline that ends each, nor a ``\\r`` before it."""
    ends, _ = record_ends(buf, delimiter, quote)
    out: list[bytes] = []
    lo = 0
    for e in ends.tolist():
        out.append(buf[lo:e])
        lo = e + 1
    if lo < len(buf):
        out.append(buf[lo:])
    return [r[:-1] if r.endswith(b"\r") else r for r in out]
