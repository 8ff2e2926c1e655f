"""What the driver reads from PostgreSQL's catalog: tables, columns, keys,
the publication, the slot, and the checks that come with them.

Everything here runs on an ordinary (non-replication) connection opened with
:func:`connect`. Errors name the object and say what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import psycopg.errors
import pyarrow as pa
from psycopg import sql

from reclock.clients.postgres import connect_defaults, scrub
from reclock.core.errors import DefiniteError, ReclockError, TransientError
from reclock.sources.postgres.types import SESSION_OPTIONS, PgType

Connection = psycopg.Connection[Any]


def connect(dsn: str, params: dict[str, Any], *, replication: bool = False,
            app: str = "reclock", timeout_s: float = 10.0) -> Connection:
    """A connection with reclock's session settings (see :mod:`.types`)."""
    kwargs = connect_defaults(params, app, timeout_s)
    kwargs["autocommit"] = True
    kwargs["options"] = (str(params.get("options") or "") + " " + SESSION_OPTIONS).strip()
    if replication:
        kwargs["replication"] = "database"
    return psycopg.connect(dsn, **kwargs)


def pg_error(exc: BaseException, doing: str, secrets: Sequence[str] = ()) -> ReclockError:
    """A TransientError (connection lost, server restarting, object in use) or
    a DefiniteError for a psycopg error, its text scrubbed of secrets."""
    text = scrub(str(exc).strip(), secrets)
    state = getattr(exc, "sqlstate", None)
    msg = f"{doing}: {text}" + (f" (SQLSTATE {state})" if state else "")
    if isinstance(exc, psycopg.errors.InsufficientPrivilege):
        return DefiniteError(msg, hint="grant the pipeline's user the privilege named above")
    if isinstance(exc, psycopg.errors.ObjectInUse | psycopg.errors.AdminShutdown
                  | psycopg.errors.CannotConnectNow | psycopg.errors.CrashShutdown):
        return TransientError(msg, hint="retried with backoff")
    low = text.lower()
    if state is None and ("authentication failed" in low or "does not exist" in low
                          or "no pg_hba.conf entry" in low):
        return DefiniteError(msg, hint="check the DSN's host, database, user and credentials")
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return TransientError(msg, hint="the database is unreachable or restarting; "
                                        "retried with backoff")
    return DefiniteError(msg)


def quoted(schema: str, name: str) -> str:
    """``"schema"."name"`` the way SQL spells it (for messages and hints)."""
    return ".".join('"' + p.replace('"', '""') + '"' for p in (schema, name))


@dataclass(frozen=True)
class PgColumn:
    """A column: ``name`` as the output names it (see :mod:`reclock.sources.postgres.history`)."""

    name: str
    type: PgType
    not_null: bool
    #: the table's column number (stable across renames, never reused)
    attnum: int = 0
    #: every name it had upstream, the current one last (empty: ``name``)
    names: tuple[str, ...] = ()
    #: dropped upstream: kept in the output, null from then on
    gone: bool = False
    #: it has a default, or had one when it was added (``atthasdef`` or
    #: ``atthasmissing``): added with one, the rows the table held then hold
    #: it although no change carried it
    has_default: bool = False

    @property
    def upstream(self) -> str:
        """Its name upstream now."""
        return self.names[-1] if self.names else self.name


@dataclass(frozen=True)
class PgTable:
    """One replicated table and the output it feeds.

    ``identity`` is ``relreplident``: ``f`` (FULL: old rows are sent whole,
    the output is a diff log), ``d``/``i`` (the key of the primary key or of
    the replica identity index: the output is keyed, updates are upserts and
    deletes tombstones), ``n`` (nothing: inserts only).
    """

    oid: int
    schema: str
    name: str
    output: str
    columns: tuple[PgColumn, ...]
    identity: str
    key: tuple[str, ...] = ()
    primary_key: tuple[str, ...] = ()
    pages: int = 0
    tuples: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def qualified(self) -> str:
        return quoted(self.schema, self.name)

    @property
    def ident(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.name)

    @property
    def envelope(self) -> str:
        """``none`` (diffs from whole old rows) or ``upsert`` (keyed)."""
        return "none" if self.identity == "f" or not self.key else "upsert"

    @property
    def arrow_schema(self) -> pa.Schema:
        return pa.schema([
            pa.field(c.name, c.type.arrow, metadata={"pg_type": c.type.name})
            for c in self.columns
        ])

    def column(self, name: str) -> PgColumn | None:
        for c in self.columns:
            if c.name == name:
                return c
        return None


_COLUMNS = """
SELECT c.oid, n.nspname, c.relname, c.relreplident, c.relkind, c.relpages, c.reltuples,
       has_table_privilege(c.oid, 'SELECT'),
       a.attname, bt.oid, CASE WHEN t.typbasetype <> 0 THEN t.typtypmod ELSE a.atttypmod END,
       format_type(a.atttypid, a.atttypmod),
       CASE WHEN bt.typcategory = 'A' THEN bt.typelem ELSE 0 END, a.attnotnull, a.attnum,
       a.atthasdef OR a.atthasmissing
FROM unnest(%s::text[], %s::text[]) AS want(nsp, rel)
JOIN pg_namespace n ON n.nspname = want.nsp
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = want.rel
LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
     AND a.attgenerated = ''
LEFT JOIN pg_type t ON t.oid = a.atttypid
LEFT JOIN pg_type bt ON bt.oid = CASE WHEN t.typbasetype <> 0 THEN t.typbasetype ELSE t.oid END
ORDER BY c.oid, a.attnum
"""

_KEYS = """
SELECT i.indrelid, i.indisprimary, i.indisreplident,
       array_agg(a.attname::text ORDER BY k.ord)
FROM pg_index i
CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE i.indrelid = ANY(%s) AND (i.indisprimary OR i.indisreplident)
GROUP BY i.indexrelid, i.indrelid, i.indisprimary, i.indisreplident
"""


def describe_tables(conn: Connection, tables: Sequence[tuple[str, str, str]]
                    ) -> list[PgTable]:
    """The tables ``(schema, table, output)``, in that order; a missing table,
    a view, or one the user may not read is a DefiniteError naming it."""
    rows = conn.execute(_COLUMNS, ([t[0] for t in tables], [t[1] for t in tables])).fetchall()
    by_name: dict[tuple[str, str], dict[str, Any]] = {}
    for (oid, nsp, rel, ident, kind, pages, tuples, can_read, att, typ, typmod, tname, elem,
         notnull, attnum, hasdef) in rows:
        t = by_name.setdefault((nsp, rel), {
            "oid": oid, "ident": ident, "kind": kind, "pages": pages, "tuples": tuples,
            "read": can_read, "cols": []})
        if att is not None:
            t["cols"].append(PgColumn(att, PgType(int(typ), int(typmod), tname, int(elem or 0)),
                                      bool(notnull), attnum=int(attnum),
                                      has_default=bool(hasdef)))
    missing = [quoted(s, n) for s, n, _ in tables if (s, n) not in by_name]
    if missing:
        raise DefiniteError(f"tables {', '.join(missing)} do not exist",
                            hint="create them, or fix the source's tables list")
    not_tables = [quoted(s, n) for s, n, _ in tables if by_name[(s, n)]["kind"] not in "rp"]
    if not_tables:
        raise DefiniteError(f"{', '.join(not_tables)} are not tables (views and other relations "
                            "cannot be replicated)")
    unreadable = [quoted(s, n) for s, n, _ in tables if not by_name[(s, n)]["read"]]
    if unreadable:
        raise DefiniteError(f"the pipeline's user may not read {', '.join(unreadable)}",
                            hint="GRANT SELECT ON ... TO the pipeline's user (the snapshot "
                                 "reads the tables)")
    keys: dict[int, dict[str, tuple[str, ...]]] = {}
    oids = [by_name[(s, n)]["oid"] for s, n, _ in tables]
    for relid, primary, replident, cols in conn.execute(_KEYS, (oids,)).fetchall():
        k = keys.setdefault(relid, {})
        if primary:
            k["primary"] = tuple(cols)
        if replident:
            k["index"] = tuple(cols)
    out = []
    for s, n, output in tables:
        t = by_name[(s, n)]
        k = keys.get(t["oid"], {})
        ident = t["ident"]
        key = k.get("index", ()) if ident == "i" else k.get("primary", ())
        out.append(PgTable(
            oid=t["oid"], schema=s, name=n, output=output, columns=tuple(t["cols"]),
            identity=ident, key=key if ident in "dif" else (), primary_key=k.get("primary", ()),
            pages=max(0, int(t["pages"] or 0)), tuples=float(t["tuples"] or 0.0),
        ))
    return out


_TYPES = """
SELECT want.o, want.m, bt.oid, CASE WHEN t.typbasetype <> 0 THEN t.typtypmod ELSE want.m END,
       format_type(t.oid, want.m), CASE WHEN bt.typcategory = 'A' THEN bt.typelem ELSE 0 END
FROM unnest(%s::oid[], %s::int[]) AS want(o, m)
JOIN pg_type t ON t.oid = want.o
JOIN pg_type bt ON bt.oid = CASE WHEN t.typbasetype <> 0 THEN t.typbasetype ELSE t.oid END
"""

#: Array type OIDs of the built-in element types (a type gone from the catalog).
_ARRAY_ELEMS = {1000: 16, 1001: 17, 1005: 21, 1007: 23, 1016: 20, 1009: 25, 1015: 1043,
                1014: 1042, 1021: 700, 1022: 701, 1231: 1700, 1182: 1082, 1115: 1114,
                1185: 1184, 2951: 2950, 199: 114, 3807: 3802, 1183: 1083}


def resolve_types(conn: Connection, types: Sequence[tuple[int, int]]
                  ) -> dict[tuple[int, int], PgType]:
    """Types a relation message names (type oid, typmod), as the catalog
    describes a column of that type (a domain as its base type); one the
    catalog no longer has, by its oid alone."""
    want = sorted(set(types))
    rows = conn.execute(_TYPES, ([o for o, _ in want], [m for _, m in want])).fetchall() \
        if want else []
    out = {(int(o), int(m)): PgType(int(b), int(bm), str(name), int(elem or 0))
           for o, m, b, bm, name, elem in rows}
    for o, m in want:
        out.setdefault((o, m), PgType(o, m, f"oid {o}", _ARRAY_ELEMS.get(o, 0)))
    return out


def column_numbers(conn: Connection, relid: int) -> dict[int, str | None]:
    """Every column number the table has had (generated columns aside): its
    name now, None when it was dropped (the number is never used again)."""
    rows = conn.execute(
        "SELECT attnum::int, CASE WHEN attisdropped THEN NULL ELSE attname::text END "
        "FROM pg_attribute WHERE attrelid = %s AND attnum > 0 "
        "AND (attisdropped OR attgenerated = '')", (relid,)).fetchall()
    return {int(a): (None if n is None else str(n)) for a, n in rows}


def columns_listed(conn: Connection, publication: str, relid: int) -> bool:
    """Whether ``publication`` lists which of the table's columns it
    publishes (PostgreSQL 15's column lists)."""
    has = conn.execute("SELECT 1 FROM pg_attribute WHERE attrelid = "
                       "'pg_catalog.pg_publication_rel'::regclass AND attname = 'prattrs'"
                       ).fetchone()
    if has is None:
        return False
    return conn.execute(
        "SELECT 1 FROM pg_publication_rel r JOIN pg_publication p ON p.oid = r.prpubid "
        "WHERE p.pubname = %s AND r.prrelid = %s AND r.prattrs IS NOT NULL",
        (publication, relid)).fetchone() is not None


def publication_tables(conn: Connection, publication: str) -> list[tuple[str, str]] | None:
    """The tables a publication publishes, ``None`` when it does not exist."""
    if conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s",
                    (publication,)).fetchone() is None:
        return None
    rows = conn.execute("SELECT schemaname::text, tablename::text FROM pg_publication_tables "
                        "WHERE pubname = %s ORDER BY 1, 2", (publication,)).fetchall()
    return [(str(s), str(t)) for s, t in rows]


def publication_actions(conn: Connection, publication: str) -> dict[str, bool]:
    row = conn.execute("SELECT pubinsert, pubupdate, pubdelete, pubtruncate FROM pg_publication "
                       "WHERE pubname = %s", (publication,)).fetchone()
    if row is None:
        return {}
    return dict(zip(("insert", "update", "delete", "truncate"), map(bool, row), strict=True))


@dataclass(frozen=True)
class SlotInfo:
    plugin: str | None
    database: str | None
    temporary: bool
    active_pid: int | None
    confirmed_flush: int | None
    restart_lsn: int | None
    wal_status: str | None
    invalidation: str | None


def lsn_int(text: str | None) -> int | None:
    if text is None:
        return None
    hi, _, lo = text.partition("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def lsn_text(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


def slot_invalidation(conn: Connection) -> str:
    """The SQL expression for why a slot was invalidated, as this server's
    ``pg_replication_slots`` tells it (the column differs across versions)."""
    have = {r[0] for r in conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = 'pg_catalog.pg_replication_slots'"
        "::regclass AND attnum > 0").fetchall()}
    return ("invalidation_reason" if "invalidation_reason" in have
            else "CASE WHEN conflicting THEN 'conflicting' END" if "conflicting" in have
            else "NULL")


def slot_info(conn: Connection, slot: str, inval: str) -> SlotInfo | None:
    """The slot's row; ``inval`` from :func:`slot_invalidation`."""
    row = conn.execute(
        f"SELECT plugin, database, temporary, active_pid, confirmed_flush_lsn::text, "
        f"restart_lsn::text, wal_status, {inval} FROM pg_replication_slots "
        f"WHERE slot_name = %s", (slot,)).fetchone()
    if row is None:
        return None
    return SlotInfo(row[0], row[1], bool(row[2]), row[3], lsn_int(row[4]), lsn_int(row[5]),
                    row[6], row[7])


def check_server(conn: Connection, who: str) -> None:
    """``wal_level`` is ``logical`` and the user may replicate."""
    (level,) = conn.execute("SHOW wal_level").fetchone() or ("?",)
    if level != "logical":
        raise DefiniteError(
            f"{who}: the server's wal_level is {level!r}, logical replication needs 'logical'",
            hint="set wal_level = logical in postgresql.conf (ALTER SYSTEM SET wal_level = "
                 "logical) and restart the server")
    row = conn.execute("SELECT rolsuper OR rolreplication, current_user FROM pg_roles "
                       "WHERE rolname = current_user").fetchone()
    if row is None or not row[0]:
        user = row[1] if row else "the pipeline's user"
        raise DefiniteError(
            f"{who}: role {user!r} may not use replication",
            hint=f"ALTER ROLE {user} REPLICATION (or connect as a role that has it)")
