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

:class:`Shapes` is the runner's room for this step: it describes the outputs
at every open, and counts the values an output drops (``freeze``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from reclock.contracts.config import KEYED_ENVELOPE, state_key_problem
from reclock.contracts.rows import check_output_names
from reclock.core.columns import rename_columns
from reclock.core.errors import DefiniteError, SchemaChanged, ShapeSeen
from reclock.core.schema_change import (
    SHAPE_PREFIX,
    Change,
    Decision,
    decide,
    decode_shape,
    encode_shape,
)
from reclock.registry import envelope_for, registry
from reclock.runtime.dataplane import TaskResult
from reclock.runtime.site import OutputRuntime, Site, by_output, share

log = logging.getLogger("reclock.driver")

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


def check_state_key(what: str, out: OutputRuntime) -> None:
    """An output's state table must be keyed by a key that contains the
    output's upstream key (:func:`~reclock.contracts.config.state_key_problem`):
    its envelope's key, else the key its source declares for typed rows (a
    CDC table's primary key or replica identity index, a generator table's
    id). Checked once the output's columns are known: when the pipeline is
    built, or when the source describes its typed outputs. A
    :class:`DefiniteError` naming ``what`` otherwise."""
    if not out.state_key:
        return
    upstream: tuple[str, ...] | None = None
    fix = KEYED_ENVELOPE
    declared = ("the key the source declares for it: a CDC table's primary key or replica "
                "identity index, a generator table's id")
    if out.upsert_key:
        upstream = out.upsert_key
        origin = declared if out.spec.envelope is not None else (
            f"the {out.envelope.type} envelope's key")
    elif out.spec.typed and out.spec.key:
        upstream = tuple(out.rename.get(k, k) for k in out.spec.key)
        origin = declared
    elif out.spec.typed:
        origin = ("the source declares no key for it: a CDC table without a primary key or "
                  "replica identity index, or a file load")
        fix = "give the table a primary key upstream and key the state table by it"
    else:
        origin = "envelope none: every record is an insertion, and none retracts an earlier one"
    problem = state_key_problem(out.state_key, upstream, origin, fix)
    if problem is not None:
        raise DefiniteError(f"{what}: sink key {list(out.state_key)}: {problem}",
                            hint="change the sink's key or mode in the pipeline file")


class Shapes:
    """The schema-change step of one source's outputs (see the module)."""

    def __init__(self, site: Site) -> None:
        self.site = site

    def describe(self) -> None:
        """Each output's columns as upstream is now, met by the output's
        ``schema_change`` policy: typed outputs take the source's
        description (an upstream table may have changed), raw outputs whose
        decoders follow a schema registry rebuild them. What the policy
        decides is kept as a fact before any commit uses it."""
        site = self.site
        groups = by_output(site.outputs)
        outputs = [slots[0] for slots in groups]  # (each output's first sink: see share)
        specs = site.source.current_outputs()
        if [s.name for s in specs] != [o.name for o in outputs]:
            raise DefiniteError(
                f"source {site.name!r}: its outputs changed from {[o.name for o in outputs]}"
                f" to {[s.name for s in specs]}", hint="restart the pipeline")
        facts = Facts(site.store.facts(site.name))
        for slots, spec in zip(groups, specs, strict=True):
            out = slots[0]
            try:
                self._describe(out, spec, facts)
            finally:
                share(slots)
            for other in slots:  # (each sink's key: a state table's)
                if other.user_schema is not None:
                    check_state_key(f"source {site.name!r} {other.label}", other)
        if facts.updates:
            site.store.put_facts(site.name, facts.updates)
        missing = [o.name for o in outputs if o.user_schema is None]
        if missing:
            raise DefiniteError(f"source {site.name!r}: outputs {missing} have no schema")

    def _describe(self, out: OutputRuntime, spec: Any, facts: Facts) -> None:
        """:meth:`describe` of one output (its first sink's slot)."""
        site = self.site
        what = f"source {site.name!r} output {out.name!r}"
        changes: tuple[Change, ...] = ()
        if spec.typed:
            if spec.schema is None:
                return
            out.spec = spec
            if spec.envelope is not None:
                out.envelope = envelope_for(spec.envelope, tuple(spec.key))
            upstream, key_columns = spec.schema, None
            changes = tuple(spec.changes)
        elif self._evolving(out):
            upstream, key_columns = self._redecode(out, what, facts)
        elif out.user_schema is None:
            return
        else:
            assert out.value_decoder is not None
            upstream = pa.schema(
                ([*out.key_decoder.schema] if out.key_decoder is not None else [])
                + [*out.value_decoder.schema] + list(out.spec.extra or []))
            key_columns = ([f.name for f in out.key_decoder.schema]
                           if out.key_decoder is not None else [])
        key = out.envelope.resolve(what, list(upstream.names), key_columns)
        if out.rename:
            upstream, _, key = rename_columns(what, upstream, out.rename, key)
        decision = decide(what, out.name, out.policy, facts.today(out.name), upstream,
                          changes)
        self._log_changes(out, decision)
        out.user_schema, out.upsert_key = decision.schema, key
        if out.rename:
            back = {v: k for k, v in out.rename.items()}
            out.upstream = tuple(back.get(n, n) for n in decision.schema.names)
        check_output_names(what, out.user_schema)
        facts.set_today(out.name, out.user_schema)

    def met(self, exc: Exception) -> None:
        """A task met a shape the last open did not describe (``exc``:
        :class:`~reclock.core.errors.SchemaChanged` or
        :class:`~reclock.core.errors.ShapeSeen`; other errors are not this
        room's): the next open takes it in."""
        outputs = by_output(self.site.outputs)
        if isinstance(exc, SchemaChanged) and 0 <= exc.output < len(outputs):
            # the next open takes the writer schema into the output's union
            for out in outputs[exc.output]:
                out.seen.setdefault(exc.part, []).append(exc.schema_id)
        if isinstance(exc, ShapeSeen):
            # the next open's describe takes the shape the task met in
            self.site.source.shape_seen(exc.output, exc.shape)

    @staticmethod
    def _evolving(out: OutputRuntime) -> bool:
        return any(getattr(d, "evolving", False) for d in (out.key_decoder, out.value_decoder))

    def _redecode(self, out: OutputRuntime, what: str, facts: Facts
                  ) -> tuple[pa.Schema, list[str]]:
        """Rebuild a raw output's decoders that follow a schema registry (the
        union of what they took before, the subject's versions now and the
        ids records named); record their unions; the upstream columns."""
        from reclock.registry import make_decoder

        key_spec, value_spec = out.formats
        decs: dict[str, Any] = {}
        for part, spec in (("key", key_spec), ("value", value_spec)):
            old = out.key_decoder if part == "key" else out.value_decoder
            if spec is None or not getattr(old, "evolving", False):
                decs[part] = old
                continue
            dec = make_decoder(spec, allow_null=part == "value" and out.envelope.allow_null,
                               policy=out.policy, known=facts.avro(out.name, part),
                               seen=out.seen.get(part, ()), part=part)
            for note in getattr(dec, "notes", ()):
                log.warning("%s: %s", what, note)
                self.site.events.log(self.site.name, "schema", output=out.name, note=note)
            facts.set_avro(out.name, part, dec.fact())  # type: ignore[attr-defined]
            decs[part] = dec
        out.key_decoder, out.value_decoder = decs["key"], decs["value"]
        out.seen = {}
        schema, key_columns = raw_user_schema(what, out.key_decoder, out.value_decoder,
                                              list(out.spec.extra or []), out.envelope.type)
        return schema, key_columns

    def _log_changes(self, out: OutputRuntime, decision: Decision) -> None:
        """Name what the policy did with upstream's changes in the progress log."""
        if not decision.changes:
            return
        said = [c.describe() for c in decision.changes]
        log.info("source %s output %s: schema_change %s: %s", self.site.name, out.name,
                 out.policy, "; ".join(said))
        self.site.events.log(self.site.name, "schema", output=out.name, policy=out.policy,
                             changes=said, dropping=list(decision.dropped),
                             keeping_types=list(decision.kept_types))

    def count_dropped(self, out: OutputRuntime, results: list[TaskResult]) -> None:
        """Values of upstream columns the output does not take (freeze),
        committed with this batch: counted, and each column named in the
        progress log the first time (in this run) its values are dropped."""
        counts: dict[str, int] = {}
        for r in results:
            for c, v in r.dropped_values.get(out.slot, {}).items():
                counts[c] = counts.get(c, 0) + v
        if not counts:
            return
        for c in out.dropped.add(counts):
            log.warning("source %s output %s: dropping the values of upstream column %r "
                        "(schema_change: %s; the output does not have it)", self.site.name,
                        out.name, c, out.policy)
            self.site.events.log(self.site.name, "schema", output=out.name,
                                 policy=out.policy, dropping_values_of=c)
