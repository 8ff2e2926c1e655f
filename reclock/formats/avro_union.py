"""The union of Avro writer schemas: the reader schema of an evolving output.

Records written through a schema registry each name their writer schema.
An output's reader schema is the union of every writer schema it takes
(the subject's versions, in order, and the ids met in records), so that each
record is resolved from its own writer schema into it (Avro's resolution:
promotions, defaults) and no field any writer carried is lost::

    v1 {id: long, score: int}
    v2 {id: long, score: long, email: [null, string] = null}
    union {id: long, score: long, email: [null, string] = null}
      v1 records: score promoted, email = its default (null)

Merging one more writer into the union (:func:`merge`), field by field:

* a field both have: the narrowest type that holds both exactly (int ->
  long, int or float -> double, enum symbols united, nested records merged);
  no such type (string vs int, long vs double) is :class:`Incompatible`;
* a field only the union has: records of the new writer lack it: it takes
  its default, or becomes nullable with default null;
* a field only the new writer has (added by a later version): it must be
  nullable or have a default, which records of earlier writers take; a new
  required field without a default is :class:`Incompatible` (records
  written before it cannot have it: Avro's own backward-compatibility rule).

Schemas are handled as JSON documents with named types expanded inline;
:func:`to_json` writes each named type's definition once, then its name.
Recursive types are not supported (as for the Arrow mapping).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from reclock.core.errors import DefiniteError

#: the types each of these holds exactly (Avro promotions that lose nothing;
#: long -> float or double, which Avro allows, rounds)
_HELD_BY = {"long": ("int",), "double": ("int", "float")}
_PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}


class Incompatible(DefiniteError):
    """No reader schema holds the records of both schemas."""


def _fullname(node: Mapping[str, Any], namespace: str | None) -> str:
    name = str(node["name"])
    if "." in name:
        return name
    ns = node.get("namespace", namespace)
    return f"{ns}.{name}" if ns else name


def expand(schema: Any, named: dict[str, Any] | None = None, namespace: str | None = None
           ) -> Any:
    """``schema`` (parsed JSON) with every reference to a named type replaced
    by its definition; names made full (``namespace.name``)."""
    named = {} if named is None else named
    if isinstance(schema, str):
        if schema in _PRIMITIVES:
            return schema
        full = schema if "." in schema or namespace is None else f"{namespace}.{schema}"
        hit = named.get(full, named.get(schema))
        if hit is None:
            raise Incompatible(f"unknown type name {schema!r}")
        if hit is _VISITING:
            raise Incompatible(f"recursive type {schema!r} is not supported")
        return copy.deepcopy(hit)
    if isinstance(schema, list):
        return [expand(b, named, namespace) for b in schema]
    if not isinstance(schema, Mapping):
        raise Incompatible(f"unexpected schema node {schema!r}")
    t = schema.get("type")
    node = dict(schema)
    if t in ("record", "error", "enum", "fixed"):
        full = _fullname(schema, namespace)
        ns = full.rsplit(".", 1)[0] if "." in full else None
        node["name"] = full
        node.pop("namespace", None)
        if t in ("record", "error"):
            named[full] = _VISITING
            node["fields"] = [{**f, "type": expand(f["type"], named, ns)}
                              for f in schema.get("fields", [])]
        named[full] = node
        return node
    if t == "array":
        node["items"] = expand(schema["items"], named, namespace)
        return node
    if t == "map":
        node["values"] = expand(schema["values"], named, namespace)
        return node
    if isinstance(t, (dict, list)) or (isinstance(t, str) and t not in _PRIMITIVES):
        return expand(t, named, namespace)
    return node if node.keys() - {"type"} else t


_VISITING = object()


def _split(t: Any) -> tuple[bool, Any]:
    """(nullable, the type without null)."""
    if isinstance(t, list):
        rest = [b for b in t if b != "null"]
        if len(rest) > 1:
            raise Incompatible(f"union {json.dumps(t)[:80]} has several non-null branches")
        return len(rest) < len(t), (rest[0] if rest else "null")
    return t == "null", t


def _canon(t: Any) -> str:
    return json.dumps(t, sort_keys=True, separators=(",", ":"))


def _core(a: Any, b: Any, where: str, strict: bool = True) -> Any:
    """The narrowest non-null type holding both ``a`` and ``b`` exactly."""
    if a == "null":
        return b
    if b == "null" or _canon(a) == _canon(b):
        return a
    if isinstance(a, str) and isinstance(b, str):
        for t in ("long", "double"):  # the narrowest type holding both exactly
            if a in (t, *_HELD_BY[t]) and b in (t, *_HELD_BY[t]):
                return t
        return _no(where, a, b)
    if isinstance(a, dict) and isinstance(b, dict) and a.get("type") == b.get("type"):
        t = a["type"]
        if "logicalType" in a or "logicalType" in b:
            return _no(where, a, b)
        if t in ("record", "error"):
            if a["name"] != b["name"]:
                return _no(where, a, b)
            return _record(a, b, where, strict)
        if t == "enum" and a["name"] == b["name"]:
            symbols = list(a["symbols"]) + [s for s in b["symbols"] if s not in a["symbols"]]
            return {**a, "symbols": symbols}
        if t == "array":
            return {**a, "items": merge_type(a["items"], b["items"], f"{where}[]", strict)}
        if t == "map":
            return {**a, "values": merge_type(a["values"], b["values"], f"{where}{{}}",
                                              strict)}
    return _no(where, a, b)


def _no(where: str, a: Any, b: Any) -> Any:
    raise Incompatible(f"field {where!r}: {_show(a)} and {_show(b)} have no common type "
                       "(no type holds every value of both)")


def _show(t: Any) -> str:
    if isinstance(t, dict):
        return str(t.get("logicalType") or t.get("name") or t.get("type"))
    return str(t)


def merge_type(a: Any, b: Any, where: str, strict: bool = True) -> Any:
    """A type holding every value of ``a`` and of ``b`` (nullable if either is)."""
    na, ca = _split(a)
    nb, cb = _split(b)
    core = _core(ca, cb, where, strict)
    if core == "null":
        return "null"
    if na or nb:
        return [core, "null"] if isinstance(a, list) and a and a[0] != "null" \
            else ["null", core]
    return core


def _nullable_field(f: dict[str, Any]) -> dict[str, Any]:
    """``f`` such that a record lacking it reads its default (null if none):
    a union whose first branch is the default's."""
    _, core = _split(f["type"])
    if f.get("default") is not None:
        return {**f, "type": [core, "null"]}
    return {**f, "type": ["null", core], "default": None}


def _record(a: dict[str, Any], b: dict[str, Any], where: str, strict: bool = True
            ) -> dict[str, Any]:
    fields: list[dict[str, Any]] = []
    theirs = {f["name"]: f for f in b["fields"]}
    for f in a["fields"]:
        g = theirs.pop(f["name"], None)
        path = f"{where}.{f['name']}" if where else f["name"]
        if g is None:
            fields.append(_nullable_field(f))  # the new writer's records lack it
            continue
        merged = {**f, "type": merge_type(f["type"], g["type"], path, strict)}
        if "default" not in merged and "default" in g:
            merged["default"] = g["default"]
        if "default" in merged and isinstance(merged["type"], list):
            merged = _nullable_field(merged)
        fields.append(merged)
    for g in b["fields"]:
        if g["name"] not in theirs:
            continue
        nullable, _ = _split(g["type"])
        if strict and not nullable and "default" not in g:
            path = f"{where}.{g['name']}" if where else g["name"]
            raise Incompatible(
                f"field {path!r} is added as a required field without a default: the "
                "records written before it cannot have it")
        fields.append(_nullable_field(g))
    return {**a, "fields": fields}


def merge(union: Any | None, writer: Any, strict: bool = True) -> Any:
    """``union`` (expanded, or None for the first schema) with ``writer``
    (expanded) merged in; raises :class:`Incompatible` naming the field.
    ``strict``: ``writer`` is a later version of the schemas in ``union``,
    so a required field it adds without a default is incompatible (the
    records before it cannot have it); otherwise (a writer met beside a
    declared reader schema) such a field is merged as nullable."""
    if union is None:
        return writer
    _, cu = _split(union)
    _, cw = _split(writer)
    if isinstance(cu, dict) and cu.get("type") in ("record", "error") and \
            isinstance(cw, dict) and cw.get("type") in ("record", "error"):
        if cu["name"] != cw["name"]:
            raise Incompatible(f"the record is named {cw['name']!r}, not {cu['name']!r} as "
                               "before (a reader resolves records of one name only)")
        return _record(cu, cw, "", strict)
    return merge_type(union, writer, "value", strict)


def to_json(schema: Any) -> Any:
    """An expanded schema as Avro JSON: each named type defined once."""
    seen: set[str] = set()

    def walk(t: Any) -> Any:
        if isinstance(t, list):
            return [walk(b) for b in t]
        if not isinstance(t, dict):
            return t
        kind = t.get("type")
        if kind in ("record", "error", "enum", "fixed"):
            if t["name"] in seen:
                return t["name"]
            seen.add(t["name"])
        out = dict(t)
        if kind in ("record", "error"):
            out["fields"] = [{**f, "type": walk(f["type"])} for f in t["fields"]]
        elif kind == "array":
            out["items"] = walk(t["items"])
        elif kind == "map":
            out["values"] = walk(t["values"])
        return out

    return walk(schema)


def canonical(schema: Any) -> str:
    """A stable text of an expanded schema (compares unions)."""
    return _canon(schema)
