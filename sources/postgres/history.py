"""Column history of a replicated table, kept durably with the source's state.

A change in the replication stream is described by the relation message in
force when it was written: column *names* and types, in the table's column
order then, no column numbers. The catalog read at an open describes the
table *now*. Between the two, a column may have been added, dropped, renamed
or retyped -- while the driver ran, or while it was stopped. To map every
change's columns onto the output's columns, each output keeps its table's
history, as a fact of the source's remap shard (``pg:<output>``)::

    {"relid": 16384,                        the table's identity (pg_class oid)
     "columns": [{"name": "b",              the output's column
                  "attnum": 3,              the table's column number (stable
                                            across renames, never reused)
                  "names": ["b", "c"],      every name it had upstream (its
                                            current one last)
                  "type": [23, -1, "integer", 0],   its type (oid, typmod, name, elem)
                  "not_null": false,
                  "dropped": false,
                  "pending": true}, ...]}   (only while true: see below)

At every describe the catalog is merged in (:func:`merge`): a column number
under a new name is a *rename* (the output keeps its column's name; changes
written under any of its names land there), a number gone is a *drop* (the
column stays in the output, null from then on), a different type a *retype*
(the output's policy decides). A table whose oid changed was dropped and
created again: a definite error naming it (its history is not the output's).

A new column number is a column *added* -- but under which name? Changes
written before the describe may carry it under a name it no longer has (added
as ``n2``, renamed to ``n3`` before the driver read the change in between).
So a column the catalog shows first is *pending*: kept in the history, not
an output column yet. It becomes one under the name the first change that
carries it names it (a relation message the reader meets, below), so that a
driver stopped across both changes names it as a running one that read the
change in between does; a snapshot of the output reads it under its name then
(:func:`promote`). A column added as a key column is an output column at once.

Relation messages the reader cannot map (:class:`Shape`: a name no output
column had, or a type the output's column cannot hold) are taken in at the
next describe, after the catalog. Each name is found by the names the history
knows (as the reader finds it), then by its position: the message lists the
table's live columns in column-number order, so a name between two known
columns is one of the column numbers between theirs. Those are the table's
columns now and those dropped since (``pg_attribute`` keeps a dropped
column's number), less the ones the message names otherwise; and a column
that is live now and numbered below one the message lists was live then too,
so the message lists it. When exactly one choice of numbers fits, each name
is that column's: an earlier name of a known column (a rename seen late,
which a ``fail`` output refuses), the first name of a pending one (now an
output column), or -- a number the history never had -- a column added and
dropped again before any describe saw it (an output column, dropped at once:
null from then on; the changes written between hold its values). A type the
history's cannot hold is a widening it takes (the output widens under
``evolve``; a column dropped since too), or an incompatible one (a definite
error). When no choice, or more than one, fits (columns dropped, added and
renamed so that the numbers cannot tell), or the publication lists the
table's columns (the message then lacks some), it is a definite error naming
the table, the columns and the way out (a new snapshot).

The history is written back when the output's policy takes the changes
(``schema_change`` evolve or freeze; under fail the changes are reported
again at every open until the policy takes them).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reclock.core.errors import DefiniteError
from reclock.core.schema_change import Change, widens
from reclock.sources.postgres.catalog import PgColumn, PgTable
from reclock.sources.postgres.types import PgType, widens_to

PREFIX = "pg:"

#: Beyond this many ways to place a relation message's unknown names among
#: the column numbers, the placement is called ambiguous without trying them.
MAX_PLACEMENTS = 10_000

_REREAD = ("re-read the output in the table's shape now (drop the output and the source's "
           "state: a new snapshot)")


@dataclass(frozen=True)
class Merged:
    """A table as the output sees it: its columns under the output's names
    (each with every upstream name it had), the changes found, the history
    to keep, and the columns pending (added upstream, not output columns
    yet: their upstream names now)."""

    table: PgTable
    changes: tuple[Change, ...]
    fact: str
    pending: tuple[str, ...] = ()


#: A relation message as a reader hands it back (:class:`~reclock.core.errors.ShapeSeen`):
#: the table's oid, and per column its name, type oid and typmod, in column order.
RawShape = tuple[int, tuple[tuple[str, int, int], ...]]


@dataclass(frozen=True)
class Shape:
    """A relation message the reader could not map: the table's oid then,
    and its live columns then (name, type resolved through the catalog: a
    domain as its base type), in column-number order."""

    relid: int
    columns: tuple[tuple[str, PgType], ...]


def _type_doc(t: PgType) -> list[Any]:
    return [t.oid, t.typmod, t.name, t.elem]


def _type_of(doc: list[Any]) -> PgType:
    return PgType(int(doc[0]), int(doc[1]), str(doc[2]), int(doc[3]))


def find(who: str, t: PgTable, columns: Sequence[Sequence[str]], names: Sequence[str]
         ) -> list[int | None]:
    """For each name of a relation message (``names``), the index of the
    column of ``columns`` (each column's upstream names, its current one
    last) it names, or None when none had that name. A name two columns had
    in turn (b renamed to c, a new b added) is the one whose current name the
    message does not also carry; two names of one message are never one
    column (the one it is named now wins, the other is None). Raises a
    DefiniteError naming the table when it cannot be told."""
    aliases: dict[str, list[int]] = {}
    for k, ns in enumerate(columns):
        for n in dict.fromkeys(ns):
            aliases.setdefault(n, []).append(k)
    out: list[int | None] = []
    for n in names:
        cands = aliases.get(n, [])
        if len(cands) > 1:
            cands = [k for k in cands
                     if not any(m != n and m == columns[k][-1] for m in names)]
            if len(cands) != 1:
                raise DefiniteError(
                    f"{who}: table {t.qualified}: a change names column {n!r}, which two "
                    "columns of the table were named in turn, and which one it was cannot be "
                    "told", hint=_REREAD)
        out.append(cands[0] if cands else None)
    for k in {k for k in out if k is not None and out.count(k) > 1}:
        hits = [j for j, x in enumerate(out) if x == k]
        now = [j for j in hits if names[j] == columns[k][-1]]
        for j in hits:
            if j not in now[:1]:
                out[j] = None
    return out


def merge(who: str, t: PgTable, known: str | None, shapes: Sequence[Shape] = (),
          attrs: Mapping[int, str | None] | None = None, listed: bool = False) -> Merged:
    """``t`` (as the catalog describes it now, with column numbers) merged
    with the output's history ``known`` (the fact's text; None: none yet),
    then with the relation messages ``shapes`` the reader met and could not
    map (see the module docstring). ``attrs``: every column number of the
    table now (generated columns aside), with its name, None when dropped;
    ``listed``: the publication lists the table's columns (a message lacks
    the others, so positions tell nothing)."""
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
    taken = {c["name"] for c in cols if not c.get("pending")}
    for c in cols:
        pending = bool(c.get("pending"))
        cur = now.get(int(c["attnum"]))
        if cur is None:
            if not c["dropped"]:
                c["dropped"] = True
                if not pending:  # (a pending one was never the output's)
                    changes.append(Change("dropped", c["name"], f"in {t.qualified}"))
            continue
        if cur.name != c["names"][-1]:
            c["names"] = [*c["names"], cur.name]
            if not pending:
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
        new: dict[str, Any] = {"name": col.name, "attnum": col.attnum, "names": [col.name],
                               "type": _type_doc(col.type), "not_null": col.not_null,
                               "dropped": False}
        if col.name in t.key:
            taken.add(col.name)  # every change carries a key column: its name now is its first
        else:
            new["pending"] = True
        cols.append(new)
    for shape in shapes:
        changes += _take(who, t, cols, taken, shape, attrs or {}, listed)
    return _merged(t, cols, tuple(changes), {"relid": t.oid, "columns": cols})


def _take(who: str, t: PgTable, cols: list[dict[str, Any]], taken: set[str], shape: Shape,
          attrs: Mapping[int, str | None], listed: bool) -> list[Change]:
    """Relation message ``shape`` taken into the history ``cols`` (in place):
    each of its columns found (by name, else by position), earlier names
    and types recorded, pending columns made output columns, columns added
    and dropped unseen added. Afterwards the reader maps every column of the
    message onto an output column whose type holds its values."""
    if shape.relid != t.oid:
        raise DefiniteError(
            f"{who}: table {t.qualified}: changes were written to a table of that name whose "
            f"relation oid was {shape.relid} (it is {t.oid}): it was dropped and created "
            "again, and the output's history is not the old table's", hint=_REREAD)
    names = [n for n, _ in shape.columns]
    hit = find(who, t, [c["names"] for c in cols], names)
    nums: list[int | None] = [None if k is None else int(cols[k]["attnum"]) for k in hit]
    anchors = [a for a in nums if a is not None]
    if any(b <= a for a, b in itertools.pairwise(anchors)):
        raise DefiniteError(
            f"{who}: table {t.qualified}: changes carry columns {names} in an order its "
            "column history cannot follow (names reused for other columns)", hint=_REREAD)
    j = 0
    while j < len(names):
        if nums[j] is not None:
            j += 1
            continue
        end = j
        while end < len(names) and nums[end] is None:
            end += 1
        nums[j:end] = _place(who, t, names, j, end, nums, set(anchors), attrs, listed)
        j = end
    by_num = {int(c["attnum"]): c for c in cols}
    changes: list[Change] = []
    for (name, typ), a in zip(shape.columns, nums, strict=True):
        assert a is not None
        c = by_num.get(a)
        if c is None:
            if attrs.get(a) is not None:
                raise AssertionError(f"live column {a} of {t.qualified} not in its history")
            _free(who, t, name, taken)
            c = by_num[a] = {"name": name, "attnum": a, "names": [name],
                             "type": _type_doc(typ), "not_null": False, "dropped": True}
            cols.append(c)
            taken.add(name)
            changes.append(Change("dropped", name, f"in {t.qualified}: added and dropped "
                                                   "again before the output described it"))
        elif c.get("pending"):
            _free(who, t, name, taken)
            del c["pending"]
            c["name"] = name  # the name the first change that carries it names it
            if name not in c["names"]:
                c["names"] = [name, *c["names"]]
            taken.add(name)
            if c["dropped"]:
                changes.append(Change("dropped", name, f"in {t.qualified}: added and dropped "
                                                       "again before the output described it"))
        elif name not in c["names"]:
            at = len(c["names"]) if c["dropped"] else len(c["names"]) - 1  # (current one last)
            c["names"] = [*c["names"][:at], name, *c["names"][at:]]
            changes.append(Change("renamed", c["name"], f"in {t.qualified}, named {name!r} "
                                                        "for a while"))
        old = _type_of(c["type"])
        if widens_to(typ.arrow, old.arrow):
            continue
        if not widens(old.arrow, typ.arrow):
            raise DefiniteError(
                f"{who}: table {t.qualified} (output {t.output!r}): column {c['name']!r} "
                f"changed type upstream to {typ.name} ({typ.arrow}) for a while, which the "
                f"output's {old.arrow} cannot hold and cannot widen to: an incompatible "
                "schema change (no policy stores it)", hint=_REREAD)
        c["type"] = _type_doc(typ)  # a widening: the output's policy takes it
    return changes


def _free(who: str, t: PgTable, name: str, taken: set[str]) -> None:
    if name in taken:
        raise DefiniteError(
            f"{who}: table {t.qualified}: changes carry a column {name!r} that was added "
            "upstream under the name an output column keeps for another column (renamed "
            "or dropped upstream)", hint=_REREAD)


def _place(who: str, t: PgTable, names: Sequence[str], j: int, end: int,
           nums: Sequence[int | None], anchored: set[int], attrs: Mapping[int, str | None],
           listed: bool) -> list[int]:
    """The column numbers of ``names[j:end]`` (no column of the history had
    those names), between the numbers of their neighbours: the one choice
    that fits (see the module docstring), or a DefiniteError."""
    lo = nums[j - 1] if j > 0 else 0
    hi = nums[end] if end < len(nums) else None
    assert lo is not None
    run = list(names[j:end])
    cand = sorted(a for a in attrs if a > lo and (hi is None or a < hi) and a not in anchored)
    live = [a for a in cand if attrs[a] is not None]
    fits: list[tuple[int, ...]] = []
    if not listed and math.comb(len(cand), len(run)) <= MAX_PLACEMENTS:
        for combo in itertools.combinations(cand, len(run)):
            top = combo[-1] if hi is None else hi
            if all(a in combo for a in live if a < top):
                fits.append(combo)
                if len(fits) > 1:
                    break
    if len(fits) == 1:
        return list(fits[0])
    now = [attrs[a] or f"(dropped, number {a})" for a in cand]
    why = ("the publication lists the table's columns, so the changes' columns cannot be "
           "placed by position" if listed else
           f"their column numbers cannot be told (they may be any of {now})" if fits else
           f"no column of the table fits them (its columns there: {now})")
    raise DefiniteError(
        f"{who}: table {t.qualified}: changes carry columns {run}, which no column of the "
        f"output's history was named, and which were dropped or renamed upstream before this "
        f"output described the table: {why}", hint=_REREAD)


def promote(fact: str, who: str, t: PgTable) -> str:
    """History ``fact`` with every pending column an output column under
    its name now (a snapshot of the output reads them)."""
    doc = json.loads(fact)
    taken = {c["name"] for c in doc["columns"] if not c.get("pending")}
    for c in doc["columns"]:
        if c.get("pending") and not c["dropped"]:  # (a dropped one: no snapshot reads it)
            del c["pending"]
            c["name"] = c["names"][-1]
            _free(who, t, c["name"], taken)
            taken.add(c["name"])
    return json.dumps(doc, sort_keys=True)


def _merged(t: PgTable, cols: list[dict[str, Any]], changes: tuple[Change, ...],
            fact: Mapping[str, Any]) -> Merged:
    out = [c for c in cols if not c.get("pending")]
    out_name = {c["names"][-1]: c["name"] for c in out if not c["dropped"]}
    columns = tuple(
        PgColumn(c["name"], _type_of(c["type"]), bool(c["not_null"]), attnum=int(c["attnum"]),
                 names=tuple(c["names"]), gone=bool(c["dropped"]))
        for c in out)
    key = tuple(out_name.get(k, k) for k in t.key)
    primary = tuple(out_name.get(k, k) for k in t.primary_key)
    table = dataclasses.replace(t, columns=columns, key=key, primary_key=primary)
    pending = tuple(c["names"][-1] for c in cols if c.get("pending") and not c["dropped"])
    return Merged(table, changes, json.dumps(fact, sort_keys=True), pending)
