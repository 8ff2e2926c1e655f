"""Formats: raw record bytes -> typed rows, bad records kept as data.

One module per format (``text``: bytes and text, ``json``, ``csv``, ``avro``
with its schema registry client), all on the screening machinery and the
decoder contract of :mod:`reclock.formats.base`. This module builds the
decoder a format spec names (:func:`make_decoder`) and decodes keys and values
together (:class:`KeyValueDecoder`).

Adding a format: write ``reclock/formats/<name>.py`` with a class that meets
:class:`~reclock.formats.base.Decoder` (``schema``, and ``decode(data)`` ->
:class:`~reclock.formats.base.DecodeResult`, every record either a row or an
error with its reason), add its spec keys to ``_SPEC_KEYS`` and a branch to
:func:`make_decoder`, and its config model to ``reclock/config.py``'s formats.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from reclock.core.errors import SchemaChanged
from reclock.formats.avro import AvroDecoder, SchemaRegistryResolver
from reclock.formats.base import (
    NULL_REASON,
    TIMESTAMP,
    TYPE_NAMES,
    Decoder,
    DecodeResult,
    FormatError,
    arrow_type,
)
from reclock.formats.csv import CsvDecoder
from reclock.formats.json import JsonDecoder
from reclock.formats.text import BytesDecoder, TextDecoder

__all__ = [
    "NULL_REASON",
    "SchemaChanged",
    "TIMESTAMP",
    "TYPE_NAMES",
    "AvroDecoder",
    "BytesDecoder",
    "CsvDecoder",
    "DecodeResult",
    "Decoder",
    "FormatError",
    "JsonDecoder",
    "KeyValueDecoder",
    "SchemaRegistryResolver",
    "TextDecoder",
    "arrow_type",
    "decode_key_value",
    "make_decoder",
]

I64 = npt.NDArray[np.int64]


_SPEC_KEYS = {
    "bytes": {"type"},
    "text": {"type"},
    "json": {"type", "schema"},
    "csv": {"type", "columns", "types", "delimiter", "quote", "header"},
    "avro": {"type", "schema", "registry_url", "subject", "timeout"},
}


def make_decoder(spec: Mapping[str, Any], *, allow_null: bool = False,
                 policy: str = "evolve", known: Mapping[str, Any] | None = None,
                 seen: Sequence[int] = (), part: str = "value") -> Decoder:
    """Build the decoder a format spec describes (driver side; checks the spec).

    ``allow_null`` is set by the envelope, not the user: the upsert envelope
    passes ``True`` for the value decoder so that a tombstone becomes a row of
    nulls (a delete) instead of an error. ``policy`` is the output's
    ``schema_change``; ``known`` and ``seen`` feed an Avro decoder's union of
    writer schemas (see :class:`~reclock.formats.avro.AvroDecoder`).
    """
    if not isinstance(spec, Mapping) or "type" not in spec:
        raise FormatError(f"format spec needs a 'type' ({', '.join(_SPEC_KEYS)}), got {spec!r}")
    kind = spec["type"]
    if kind not in _SPEC_KEYS:
        raise FormatError(f"unknown format type {kind!r}; expected one of {', '.join(_SPEC_KEYS)}")
    extra = sorted(set(spec) - _SPEC_KEYS[kind])
    if extra:
        raise FormatError(
            f"{kind} format: unknown keys {extra}; allowed: {sorted(_SPEC_KEYS[kind])}"
        )
    if kind == "bytes":
        return BytesDecoder(allow_null=allow_null)
    if kind == "text":
        return TextDecoder(allow_null=allow_null)
    if kind == "json":
        return JsonDecoder(spec.get("schema"), allow_null=allow_null)
    if kind == "csv":
        if "columns" not in spec:
            raise FormatError("csv format: 'columns' is required")
        return CsvDecoder(
            spec["columns"], spec.get("types"), delimiter=spec.get("delimiter", ","),
            quote=spec.get("quote", '"'), header=bool(spec.get("header", False)),
            allow_null=allow_null,
        )
    return AvroDecoder(
        spec.get("schema"), registry_url=spec.get("registry_url"), subject=spec.get("subject"),
        allow_null=allow_null, timeout=float(spec.get("timeout", 10.0)),
        policy=policy, known=known, seen=seen, part=part,
    )


def _mask(idx: I64, n: int) -> npt.NDArray[np.bool_]:
    m = np.zeros(n, dtype=bool)
    m[idx] = True
    return m


def _part_reason(part: str, reason: str) -> str:
    return f"{part} is null" if reason == NULL_REASON else f"{part}: {reason}"


class KeyValueDecoder:
    """Decodes Kafka key and value together: key columns (as declared) then
    value columns (as declared). Names must not clash (``FormatError``, a
    ``ValueError``, when built). A record fails if either part fails; the
    reason says which (``"key: ..."``, ``"value: ..."``, both joined by
    ``"; "``). Without a key decoder the key is ignored."""

    def __init__(self, key: Decoder | None, value: Decoder) -> None:
        if key is not None:
            clash = sorted(set(key.schema.names) & set(value.schema.names))
            if clash:
                raise FormatError(
                    f"key and value formats both produce columns {clash}; rename them "
                    "(e.g. declare the key's columns under other names)"
                )
        self.key = key
        self.value = value
        fields = ([*key.schema] if key is not None else []) + [*value.schema]
        self.schema = pa.schema(fields)

    def decode(self, key: pa.Array, value: pa.Array) -> DecodeResult:
        vr = self.value.decode(value)
        if self.key is None:
            reasons = [_part_reason("value", r) for r in vr.reasons]
            return DecodeResult(vr.table, vr.ok, vr.errors, reasons, vr.dropped)
        n = len(value)
        if len(key) != n:
            raise ValueError(f"key has {len(key)} records, value has {n}")
        kr = self.key.decode(key)
        k_ok, v_ok = _mask(kr.ok, n), _mask(vr.ok, n)
        both = k_ok & v_ok
        kt = kr.table.filter(pa.array(both[kr.ok])) if not both[kr.ok].all() else kr.table
        vt = vr.table.filter(pa.array(both[vr.ok])) if not both[vr.ok].all() else vr.table
        cols = [*kt.columns, *vt.columns]
        table = pa.Table.from_arrays(cols, schema=self.schema)
        why: dict[int, list[str]] = {}
        for i, r in zip(kr.errors.tolist(), kr.reasons, strict=True):
            why.setdefault(i, []).append(_part_reason("key", r))
        for i, r in zip(vr.errors.tolist(), vr.reasons, strict=True):
            why.setdefault(i, []).append(_part_reason("value", r))
        errors = np.array(sorted(why), dtype=np.int64)
        reasons = ["; ".join(why[int(i)]) for i in errors]
        dropped = dict(vr.dropped)
        for k, v in kr.dropped.items():
            dropped[k] = dropped.get(k, 0) + v
        return DecodeResult(table, np.flatnonzero(both).astype(np.int64), errors, reasons,
                            dropped)


def decode_key_value(
    key_dec: Decoder | None, value_dec: Decoder, key: pa.Array, value: pa.Array
) -> DecodeResult:
    """Decode ``key``/``value`` arrays together (see :class:`KeyValueDecoder`)."""
    return KeyValueDecoder(key_dec, value_dec).decode(key, value)
