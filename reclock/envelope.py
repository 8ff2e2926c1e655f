"""Envelopes: how decoded records become updates ``(row, time, diff)``.

* ``none`` -- append: every record is one insertion (diff +1).
* ``debezium`` -- a change event carries a ``before`` and an ``after`` image
  (optionally wrapped in ``{"schema": ..., "payload": ...}``): the before
  image is retracted (diff -1) and the after image inserted (diff +1), both at
  the record's IntoTime and with its source position. Creates have no before,
  deletes no after; an event with neither, or that is not a JSON object, is an
  error row.
* ``upsert`` -- by key, the latest value wins and a null value deletes; it
  needs the previous value per key (state) and is not available yet.

Envelopes are pure functions of a batch, applied inside Spark tasks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa


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
