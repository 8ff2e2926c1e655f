"""Schema change as an explicit, per-output policy.

Every output says what happens when its upstream changes shape (the
output's ``schema_change``)::

    upstream now ---compare---> changes vs the output's columns (today)
                                   |
        incompatible (a type that cannot widen, a new required field
        without a default) -> DefiniteError, under every policy
                                   |
        evolve   today + added columns (nullable), types widened; the sink
                 applies it in the same commit as the first rows needing it
        freeze   today, as it is: values of columns the output lacks are
                 dropped *knowingly* (counted per column, named in the
                 progress log); a value its column's type cannot hold is an
                 error row
        fail     any change (added, dropped, renamed, retyped) is a
                 DefiniteError naming it and the way out

What no policy does: drop a value silently, or narrow a column. A column
dropped upstream stays in the output (null from then on); a column renamed
upstream keeps its output name where the source can tell a rename from a
drop and an add (Postgres: the column's number); a narrowing upstream (long
-> int) needs nothing: the output's wider column holds every value.

The output's columns as the policy left them are kept durably, as a fact of
the source's remap shard (:data:`SHAPE_PREFIX` + output name), so that the
next open compares upstream with them and not with whatever upstream says
then (a driver stopped across a change sees it at its next open).

This module is pure: Arrow types in, decisions out.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import pyarrow as pa

from reclock.core.errors import DefiniteError

Policy = Literal["evolve", "freeze", "fail"]
POLICIES: tuple[Policy, ...] = ("evolve", "freeze", "fail")
DEFAULT_POLICY: Policy = "evolve"

#: remap-store fact key prefix: ``shape:<output>`` -> the output's user columns
SHAPE_PREFIX = "shape:"

#: schema metadata key of a rows table: JSON ``{column: values dropped}``
#: (values of upstream columns that a frozen output does not have)
DROPPED_META = b"reclock.dropped"

_INT_ORDER = [pa.int8(), pa.int16(), pa.int32(), pa.int64()]
_UINT_ORDER = [pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64()]


def widens(old: pa.DataType, new: pa.DataType) -> bool:
    """Whether a column of type ``new`` holds every value of type ``old``
    exactly (a legal widening; ``old == new`` counts): integers to wider
    integers (unsigned to a signed type with more bits), integers of at most
    32 bits and float32 to float64, decimals to decimals with as many
    integer and fraction digits, lists element-wise, structs whose fields
    widen (fields only ``new`` has are nullable additions)."""
    if old == new:
        return True
    if pa.types.is_null(old):
        return True
    if pa.types.is_integer(old) and pa.types.is_integer(new):
        if pa.types.is_signed_integer(old) != pa.types.is_signed_integer(new):
            return bool(pa.types.is_unsigned_integer(old) and new.bit_width > old.bit_width)
        return bool(new.bit_width >= old.bit_width)
    if pa.types.is_float64(new) and (pa.types.is_float32(old) or (
            pa.types.is_integer(old) and old.bit_width <= 32)):
        return True
    if pa.types.is_decimal(old) and pa.types.is_decimal(new):
        return bool(new.scale >= old.scale
                    and new.precision - new.scale >= old.precision - old.scale)
    if pa.types.is_string(old) and pa.types.is_large_string(new):
        return True
    if pa.types.is_binary(old) and pa.types.is_large_binary(new):
        return True
    if (pa.types.is_list(old) or pa.types.is_large_list(old)) and (
            pa.types.is_list(new) or pa.types.is_large_list(new)):
        return widens(old.value_type, new.value_type)
    if pa.types.is_struct(old) and pa.types.is_struct(new):
        have = {new.field(i).name: new.field(i).type for i in range(new.num_fields)}
        return all(old.field(i).name in have and widens(old.field(i).type,
                                                        have[old.field(i).name])
                   for i in range(old.num_fields))
    return False


def wider(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """The narrowest type holding every value of ``a`` and of ``b`` exactly
    (one of them, or for two structs their merge), or None."""
    if widens(a, b):
        return b
    if widens(b, a):
        return a
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        fields: list[pa.Field] = []
        bt = {b.field(i).name: b.field(i) for i in range(b.num_fields)}
        for i in range(a.num_fields):
            fa = a.field(i)
            fb = bt.pop(fa.name, None)
            if fb is None:
                fields.append(fa.with_nullable(True))
                continue
            t = wider(fa.type, fb.type)
            if t is None:
                return None
            fields.append(fa.with_type(t).with_nullable(True))
        fields += [f.with_nullable(True) for f in bt.values()]
        return pa.struct(fields)
    if pa.types.is_integer(a) and pa.types.is_integer(b):
        for t in _INT_ORDER:  # e.g. uint16 and int16: int32
            if widens(a, t) and widens(b, t):
                return t
    return None


@dataclass(frozen=True)
class Change:
    """One difference between an output's columns and upstream's."""

    kind: Literal["added", "dropped", "renamed", "widened", "narrowed", "retyped"]
    column: str
    detail: str = ""

    @property
    def incompatible(self) -> bool:
        return self.kind == "retyped"

    def describe(self) -> str:
        what = {
            "added": "added upstream", "dropped": "dropped upstream",
            "renamed": "renamed upstream", "widened": "widened upstream",
            "narrowed": "narrowed upstream", "retyped": "changed type upstream",
        }[self.kind]
        return f"column {self.column!r} {what}" + (f" ({self.detail})" if self.detail else "")


def compare(today: pa.Schema, upstream: pa.Schema) -> list[Change]:
    """What differs going from the output's columns ``today`` to ``upstream``
    (by name): columns added, dropped, and types widened, narrowed (the
    output's type holds the new one) or changed beyond both."""
    out: list[Change] = []
    for f in upstream:
        i = today.get_field_index(f.name)
        if i < 0:
            out.append(Change("added", f.name, str(f.type)))
            continue
        old = today.field(i).type
        if old == f.type:
            continue
        if widens(old, f.type):
            out.append(Change("widened", f.name, f"{old} -> {f.type}"))
        elif widens(f.type, old):
            out.append(Change("narrowed", f.name, f"{old} -> {f.type}"))
        else:
            out.append(Change("retyped", f.name, f"{old} -> {f.type}"))
    for f in today:
        if upstream.get_field_index(f.name) < 0:
            out.append(Change("dropped", f.name))
    return out


@dataclass(frozen=True)
class Decision:
    """The output's columns once a policy met upstream's shape."""

    schema: pa.Schema
    changes: tuple[Change, ...] = ()
    #: upstream columns whose values the output does not take (freeze)
    dropped: tuple[str, ...] = ()
    #: columns whose output type is narrower than upstream's (freeze): a
    #: value it cannot hold becomes an error row
    kept_types: tuple[str, ...] = ()


def policy_hint(output: str, policy: Policy) -> str:
    """The way out of a change the policy refuses."""
    if policy == "fail":
        return (f"to take it, set schema_change: evolve (or freeze) on output {output!r} and "
                "restart; or re-read the output in its new shape with `reclock resnapshot`")
    return ("re-read the output in its new shape (`reclock resnapshot`, or a new target), "
            "or undo the change upstream")


def decide(what: str, output: str, policy: Policy, today: pa.Schema | None,
           upstream: pa.Schema, source_changes: Sequence[Change] = ()) -> Decision:
    """Apply ``policy`` to ``upstream`` against the output's columns
    ``today`` (None: the output is new, it takes ``upstream``).
    ``source_changes``: changes the source resolved itself (a rename kept
    under the output's name, a drop kept as a column) that a ``fail``
    output must still refuse. Raises :class:`DefiniteError` naming ``what``,
    the changes and the way out."""
    if today is None:
        return Decision(upstream, tuple(source_changes))
    changes = [*source_changes, *compare(today, upstream)]
    bad = [c for c in changes if c.incompatible]
    if bad:
        raise DefiniteError(
            f"{what}: an incompatible schema change: "
            + "; ".join(c.describe() for c in bad)
            + " (no type holds every value of both; no policy stores it)",
            hint=policy_hint(output, policy))
    if policy == "fail" and changes:
        raise DefiniteError(
            f"{what}: the upstream schema changed and the output's schema_change is fail: "
            + "; ".join(c.describe() for c in changes), hint=policy_hint(output, policy))
    if policy == "freeze":
        dropped = tuple(c.column for c in changes if c.kind == "added")
        kept = tuple(c.column for c in changes if c.kind == "widened")
        return Decision(today, tuple(changes), dropped, kept)
    # evolve: today's columns (widened where upstream widened), then the new ones
    by_name = {f.name: f for f in upstream}
    fields = []
    for f in today:
        up = by_name.get(f.name)
        if up is not None and up.type != f.type and widens(f.type, up.type):
            fields.append(f.with_type(up.type))
        else:
            fields.append(f)
    fields += [f.with_nullable(True) for f in upstream if today.get_field_index(f.name) < 0]
    return Decision(pa.schema(fields), tuple(changes))


def encode_shape(schema: pa.Schema) -> str:
    """A user schema as a fact's JSON text (Arrow IPC, base64)."""
    return json.dumps({"arrow": base64.b64encode(schema.serialize().to_pybytes()).decode()})


def decode_shape(text: str) -> pa.Schema:
    doc = json.loads(text)
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(doc["arrow"])))


def dropped_counts(meta: Mapping[bytes, bytes] | None) -> dict[str, int]:
    """The dropped-value counts a rows table carries in its metadata."""
    if not meta or DROPPED_META not in meta:
        return {}
    return {str(k): int(v) for k, v in json.loads(meta[DROPPED_META]).items()}


def with_dropped(table: pa.Table, counts: Mapping[str, int]) -> pa.Table:
    """``table`` carrying ``counts`` (merged with what it carries) in its metadata."""
    counts = {k: v for k, v in counts.items() if v}
    if not counts:
        return table
    meta = dict(table.schema.metadata or {})
    have = dropped_counts(meta)
    for k, v in counts.items():
        have[k] = have.get(k, 0) + v
    meta[DROPPED_META] = json.dumps(have, sort_keys=True).encode()
    return table.replace_schema_metadata(meta)


@dataclass
class DroppedTally:
    """Values dropped per column of one output (freeze), and which columns
    the progress log has named already."""

    counts: dict[str, int] = field(default_factory=dict)
    named: set[str] = field(default_factory=set)

    def add(self, counts: Mapping[str, int]) -> list[str]:
        """Add ``counts``; the columns dropped for the first time."""
        new = []
        for k, v in counts.items():
            self.counts[k] = self.counts.get(k, 0) + v
            if k not in self.named:
                self.named.add(k)
                new.append(k)
        return new
