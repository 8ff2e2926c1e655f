"""Envelopes: how decoded records become updates (see
:mod:`reclock.envelopes.base` for the contract): ``none`` (append),
``upsert`` (by key, the latest value wins) and ``debezium`` (change events),
each in its own module with its configuration model."""

from __future__ import annotations

from typing import Any

from reclock.envelopes.base import Envelope
from reclock.envelopes.debezium import DebeziumEnvelope
from reclock.envelopes.none import NoneEnvelope
from reclock.envelopes.upsert import UpsertEnvelope, UpsertState

#: Every envelope, by its ``type``.
ENVELOPES: dict[str, type[Any]] = {
    "none": NoneEnvelope, "upsert": UpsertEnvelope, "debezium": DebeziumEnvelope,
}


def envelope_for(name: str, key: tuple[str, ...] = ()) -> Envelope:
    """The envelope a source chose for its typed rows (``OutputSpec.envelope``)."""
    cls = ENVELOPES.get(name)
    if cls is None:
        raise ValueError(f"unknown envelope {name!r}; one of {sorted(ENVELOPES)}")
    keyed = key and "key" in cls.model_fields
    return cls(key=tuple(key)) if keyed else cls()  # type: ignore[no-any-return]


__all__ = ["ENVELOPES", "DebeziumEnvelope", "Envelope", "NoneEnvelope", "UpsertEnvelope",
           "UpsertState", "envelope_for"]
