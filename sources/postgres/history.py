"""Column history of a replicated table, kept durably with the source's state.

A change in the replication stream is described by the relation message in
force when it was written: column *names* and types, no column numbers. The
catalog read at an open describes the table *now*. Between the two, a
column may have been added, dropped, renamed or retyped -- while the
driver ran, or while it was stopped. To map every change's columns onto the
output's columns, each output keeps its table's history, as a fact of the
source's remap shard (``pg:<output>``)::

    {"relid": 16384,                        the table's identity (pg_class oid)
     "columns": [{"name": "b",              the output's column
                  "attnum": 3,              the table's column number (stable
                                            across renames, never reused)
                  "names": ["b", "c"],      every name it had upstream, in order
                  "type": [23, -1, "integer", 0],   its type (oid, typmod, name, elem)
                  "not_null": false,
                  "dropped": false}, ...]}

At every describe the catalog is merged in (:func:`merge`): a column number
under a new name is a *rename* (the output keeps its column's name; changes
written under any of its names land there), a number gone is a *drop* (the
column stays in the output, null from then on), a new number an *addition*
(a new output column named as upstream names it), a different type a
*retype* (the output's policy decides). A table whose oid changed was
dropped and created again: a definite error naming it (its history is not
the output's). The history is written back when the output's policy takes
the changes (``schema_change`` evolve or freeze; under fail the changes are
reported again at every open until the policy takes them).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reclock.core.errors import DefiniteError
from reclock.core.schema_change import Change, widens
from sources.postgres.catalog import PgColumn, PgTable
from sources.postgres.types import PgType

PREFIX = "pg:"


@dataclass(frozen=True)
class Merged:
    """A table as the output sees it: its columns under the output's names
    (each with every upstream name it had), the changes found, the history
    to keep."""

    table: PgTable
    changes: tuple[Change, ...]
    fact: str


def _type_doc(t: PgType) -> list[Any]:
    return [t.oid, t.typmod, t.name, t.elem]


def _type_of(doc: list[Any]) -> PgType:
    return PgType(int(doc[0]), int(doc[1]), str(doc[2]), int(doc[3]))


def merge(who: str, t: PgTable, known: str | None) -> Merged:
    """``t`` (as the catalog describes it now, with column numbers) merged
    with the output's history ``known`` (the fact's text; None: none yet)."""
    now = {c.attnum: c for c in t.columns}
    if known is None:
        first: list[dict[str, Any]] = [
            {"name": c.name, "attnum": c.attnum, "names": [c.name], "type": _type_doc(c.type),
             "not_null": c.not_null, "dropped": False} for c in t.columns]
        return _merged(t, first, (), {"relid": t.oid, "columns": first})
    doc = json.loads(known)
    if int(doc["relid"]) != t.oid:
        raise DefiniteError(
            f"{who}: table {t.qualified} was dropped and created again (its relation oid was "
            f"{doc['relid']}, is {t.oid}): the output holds the rows of the old table",
            hint="drop the output and the source's state and start again (a new snapshot), "
                 "or point the output at a new target")
    changes: list[Change] = []
    cols: list[dict[str, Any]] = [dict(c) for c in doc["columns"]]
    taken = {c["name"] for c in cols}
    for c in cols:
        cur = now.get(int(c["attnum"]))
        if cur is None:
            if not c["dropped"]:
                c["dropped"] = True
                changes.append(Change("dropped", c["name"], f"in {t.qualified}"))
            continue
        if cur.name != c["names"][-1]:
            c["names"] = [*c["names"], cur.name]
            changes.append(Change("renamed", c["name"], f"in {t.qualified}, now named "
                                                        f"{cur.name!r}"))
        old = _type_of(c["type"])
        if (cur.type.oid, cur.type.typmod) != (old.oid, old.typmod) and not widens(
                cur.type.arrow, old.arrow):
            # wider (the output widens) or beyond (the policy names it); a
            # narrowing needs nothing: the output's type holds the new values
            c["type"] = _type_doc(cur.type)
        c["not_null"] = cur.not_null
    known_nums = {int(c["attnum"]) for c in cols}
    for col in t.columns:
        if col.attnum in known_nums:
            continue
        if col.name in taken:
            raise DefiniteError(
                f"{who}: table {t.qualified}: column {col.name!r} was added upstream under the "
                "name an output column keeps for another column (renamed or dropped upstream)",
                hint="rename the new column upstream, or re-read the output in its new shape "
                     "(drop the output and its state, or a new target)")
        cols.append({"name": col.name, "attnum": col.attnum, "names": [col.name],
                     "type": _type_doc(col.type), "not_null": col.not_null, "dropped": False})
        taken.add(col.name)
    return _merged(t, cols, tuple(changes), {"relid": t.oid, "columns": cols})


def _merged(t: PgTable, cols: list[dict[str, Any]], changes: tuple[Change, ...],
            fact: Mapping[str, Any]) -> Merged:
    out_name = {c["names"][-1]: c["name"] for c in cols if not c["dropped"]}
    columns = tuple(
        PgColumn(c["name"], _type_of(c["type"]), bool(c["not_null"]), attnum=int(c["attnum"]),
                 names=tuple(c["names"]), gone=bool(c["dropped"]))
        for c in cols)
    key = tuple(out_name.get(k, k) for k in t.key)
    primary = tuple(out_name.get(k, k) for k in t.primary_key)
    table = dataclasses.replace(t, columns=columns, key=key, primary_key=primary)
    return Merged(table, changes, json.dumps(fact, sort_keys=True))
