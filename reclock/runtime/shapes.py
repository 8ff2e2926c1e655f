"""The driver's schema-change step: each output's columns at every open.

At every open the driver describes each output as upstream is now (a CDC
table's catalog and column history, an Avro subject's versions, the
declared format), then lets the output's ``schema_change`` policy
(:mod:`reclock.core.schema_change`) meet it with the columns the output has
(``today``, a fact of the source's remap shard)::

    describe upstream  ->  decide(policy, today, upstream)  ->  record today'
         |                        |                                 |
    raw outputs: decoders   DefiniteError (incompatible,       sink.ensure(today'):
    rebuilt with the        or refused by the policy)          the sink applies it
    registry's schemas                                         with its next commit

The facts this module keeps (remap shard of the source):

* ``shape:<output>`` -- the output's user columns as last decided;
* ``avro:<output>:<part>`` -- an Avro decoder's union: the subject's
  versions (version -> schema id) and every writer schema it took, so that a
  subject deleted and registered again is seen, and the union never shrinks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from reclock.core.errors import DefiniteError
from reclock.core.schema_change import SHAPE_PREFIX, decode_shape, encode_shape
from reclock.registry import registry

AVRO_PREFIX = "avro:"


def raw_user_schema(what: str, key_dec: Any | None, value_dec: Any, extra: Sequence[pa.Field],
                    envelope_type: str) -> tuple[pa.Schema, list[str]]:
    """The user columns of an output whose records are decoded: the key's
    columns, the value's, then the columns the source adds (``extra``); and
    the key's column names. ``envelope_type`` names the output's envelope,
    which may take no such columns
    (:attr:`~reclock.contracts.envelope.EnvelopeModel.TAKES_EXTRA`)."""
    fields = list(key_dec.schema) if key_dec else []
    key_columns = [f.name for f in fields]
    envelope = registry().envelopes.get(envelope_type)
    if extra and envelope is not None and not envelope.config.TAKES_EXTRA:
        raise DefiniteError(
            f"{what}: the {envelope_type} envelope takes no {[f.name for f in extra]} "
            "column", hint="read the topic without include_headers, or with another "
            "envelope")
    taken = {f.name for f in fields} | set(value_dec.schema.names)
    clash = [f.name for f in extra if f.name in taken]
    if clash:
        raise DefiniteError(
            f"{what}: the decoded columns already have {clash}, which the source "
            "adds", hint="rename the decoded column in the format's schema")
    return pa.schema(fields + list(value_dec.schema) + list(extra)), key_columns


class Facts:
    """The shape facts of one source's outputs, read once per open."""

    def __init__(self, facts: Mapping[str, str]) -> None:
        self.facts = dict(facts)
        self.updates: dict[str, str | None] = {}

    def today(self, output: str) -> pa.Schema | None:
        text = self.facts.get(SHAPE_PREFIX + output)
        return None if text is None else decode_shape(text)

    def set_today(self, output: str, schema: pa.Schema) -> None:
        text = encode_shape(schema)
        if self.facts.get(SHAPE_PREFIX + output) != text:
            self.facts[SHAPE_PREFIX + output] = self.updates[SHAPE_PREFIX + output] = text

    def avro(self, output: str, part: str) -> dict[str, Any] | None:
        text = self.facts.get(f"{AVRO_PREFIX}{output}:{part}")
        return None if text is None else dict(json.loads(text))

    def set_avro(self, output: str, part: str, fact: Mapping[str, Any]) -> None:
        key = f"{AVRO_PREFIX}{output}:{part}"
        text = json.dumps(fact, sort_keys=True)
        if self.facts.get(key) != text:
            self.facts[key] = self.updates[key] = text
