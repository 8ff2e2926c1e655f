"""Postgres CDC source: logical replication with ``pgoutput``; FromTime is the LSN.

Every transaction is stamped at its commit LSN; one output per replicated
table. Driver side (:class:`PostgresSource`)::

    open(...)      check wal_level and the role; describe the tables; create the
                   publication and the slot when absent (a slot missing while
                   outputs hold data is a definite error: changes are lost);
                   for outputs that hold nothing yet, export a snapshot (and
                   count its rows in the background, for snapshot progress:
                   see :mod:`reclock.sources.postgres.snapshot_size`)
    probe()        pg_current_wal_flush_lsn(), and the slot's health
    plan(lo, hi)   one replication task for [lo, hi) (one walsender per slot),
                   plus, in the job that covers the snapshot point, the
                   snapshot's chunk tasks (ctid ranges, in parallel)
    acknowledge(f) pg_replication_slot_advance(slot, f): confirmed_flush_lsn
                   follows the resumption frontier, never passes it

Executor side (:class:`PostgresReader`), deterministic per task:

* **Replication range** ``[lo, hi)``: ``START_REPLICATION SLOT s LOGICAL lo``.
  The server sends whole transactions in commit order, from the first commit
  at or after ``max(lo, confirmed_flush)``; the task reads until a transaction
  commits at ``hi`` or later (stop before it) or a keepalive reports that the
  walsender has decoded past ``hi``. The slot never advances by reading (the
  task confirms nothing), so a retry reads the same transactions.
* **Snapshot chunk**: ``SET TRANSACTION SNAPSHOT`` of the exported snapshot,
  ``COPY (SELECT ... WHERE ctid in a page range) TO STDOUT``.

The snapshot hand-off. The snapshot comes from a *temporary* slot created
with ``EXPORT_SNAPSHOT`` on a connection the driver holds open until the
snapshot is durable everywhere; its consistent point ``s`` splits history:
the snapshot holds exactly the transactions that committed before ``s``, the
main slot (created earlier, so it retains everything from ``s`` on) streams
those that commit at ``s`` or later. Snapshot rows are stamped at ``s - 1``;
the table's streamed changes that commit before ``s`` are dropped. Snapshot
rows carry negative ``_src_part`` values (one per chunk), so that wherever
rows of one IntoTime are ordered by position they come before every
streamed change (``_src_part`` 0, ordered by commit LSN). An output
killed during its snapshot holds nothing, so the next run takes a new
snapshot (new ``s``) for exactly the outputs that hold nothing.

Row shapes. Tables with ``REPLICA IDENTITY FULL`` produce diffs: an update is
the old row retracted and the new one inserted (a TOASTed value the update
did not change is taken from the old row). Tables keyed by a primary key or a
replica identity index produce upsert intents (value or tombstone by key)
that the driver's upsert state turns into diffs; a TOASTed value an update
left unchanged (the server does not send it) is marked (``_unchanged``) and
the upsert state fills it from the key's current row.

Schema changes. Each output keeps its table's column history with the
source's state (:mod:`reclock.sources.postgres.history`): column numbers, every name
a column had, its type, the table's oid. A relation message in the stream is
mapped onto the output's columns by those names, so changes written before
and after a rename (or a stop) land in one column. A message the history
cannot map -- a name no output column had (a column added, or renamed since
the output was described), or a type the output's column cannot hold but a
wider type can -- re-opens the source with :class:`ShapeSeen`, which carries
the message's columns (names, types, in column order) back to the driver;
the describe of the re-open merges the catalog and then the message into
the history (a name between two known columns that only one column number
fits is that column's: an earlier name, the first name of a column added
since, or a column added and dropped unseen). A column missing from a
message that the table no longer has was dropped, and re-opens it too; a
type no policy stores is a definite error. A column the catalog shows first
becomes an output column under the name the first change that carries it
names it (or a snapshot of the output reads it), so a driver stopped across
two changes of a column's shape ends as a running one does. A relation
message is mapped only when a change it describes is taken: changes before
an output's snapshot point are dropped, whatever columns they name. At the
open the output's ``schema_change`` policy meets the changes
(:mod:`reclock.core.schema_change`): a dropped column stays (null from then
on; of a diff log, a definite error: its retractions would not match), a
renamed one keeps the output's name, a widened one widens the output under
evolve. A column added with a default to a FULL table is a definite error
under evolve: the rows the table held then hold the default, which no
change carried, while the output holds them null, so a later change's old
row would not match.

A truncate of a keyed table retracts every row (the driver's key state knows
them); of a diff-log table (FULL, or no identity) it is a definite error (the
output cannot retract rows it was never told about one by one).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import select
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.csv as pacsv
from psycopg import pq, sql

from reclock.clients.postgres import parse_dsn, server_label
from reclock.contracts.source import Facts, OutputSpec, ReadTask, SnapshotSize, SourceBase
from reclock.core.clock import Clock
from reclock.core.columns import (
    SRC_DIFF,
    SRC_OFFSET,
    SRC_PART,
    SRC_SEQ,
    SRC_TS,
    SRC_UNCHANGED,
    TRUNCATED,
)
from reclock.core.errors import DefiniteError, Reopen, ShapeSeen, TransientError
from reclock.core.frontier import Antichain
from reclock.core.schema_change import Change, widens
from reclock.core.time import Lsn
from reclock.sources.postgres import history
from reclock.sources.postgres import pgoutput as po
from reclock.sources.postgres.catalog import (
    Connection,
    PgTable,
    SlotInfo,
    check_server,
    column_numbers,
    columns_listed,
    connect,
    describe_tables,
    lsn_int,
    lsn_text,
    pg_error,
    publication_actions,
    publication_tables,
    quoted,
    resolve_types,
    slot_info,
    slot_invalidation,
)
from reclock.sources.postgres.snapshot_size import SnapshotSizes
from reclock.sources.postgres.types import PgType, convert, widens_to

log = logging.getLogger("reclock.postgres")

#: Rows per output buffered in a task before they become one Arrow batch.
BATCH_ROWS = 50_000
#: CopyData frames handed to the decoder at once (what has arrived, at most this)
FRAMES_PER_BATCH = 4096
#: Assumed WAL bytes per change when bounding a job far behind (a change is
#: rarely smaller), so a job reads at most ~max_job changes.
WAL_BYTES_PER_CHANGE = 64


def _identity_hint(t: PgTable) -> str:
    return (f"ALTER TABLE {t.qualified} REPLICA IDENTITY FULL (then drop and re-create the "
            "output, or let it resume: changes already committed keep their shape)")


@dataclass(frozen=True)
class StreamSpec:
    """Read the transactions committing in ``[start, end)``; for the outputs
    in ``snapshot_at`` drop changes committing before their snapshot point."""

    start: int
    end: int
    snapshot_at: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class ChunkSpec:
    """Rows of output ``output`` in pages ``[first, last)`` (``last`` None: to
    the end) under the exported snapshot ``snapshot`` taken at ``lsn``."""

    output: int
    snapshot: str
    lsn: int
    chunk: int
    first: int
    last: int | None


@dataclass
class _Snapshot:
    """An exported snapshot and the connection that keeps it alive."""

    conn: Connection
    name: str
    lsn: int
    outputs: tuple[int, ...]
    #: the rows of each output's table under it (snapshot progress)
    sizes: SnapshotSizes | None = None

    @property
    def alive(self) -> bool:
        return not self.conn.closed and not self.conn.broken and \
            self.conn.pgconn.status == pq.ConnStatus.OK


def _check_outputs(who: str, tables: Sequence[tuple[str, str, str]]) -> None:
    """Every table feeds an output of its own, with a valid output name."""
    from reclock.contracts.config import NAME_PATTERN

    bad = [quoted(sch, t) for sch, t, out in tables if not re.match(NAME_PATTERN, out)]
    if bad:
        raise DefiniteError(
            f"{who}: tables {', '.join(bad)} cannot name their outputs (letters, digits, _ and "
            "-, starting with a letter)",
            hint="list them under postgres.tables as {table: ..., schema: ..., output: a_name}")
    outs = [out for _, _, out in tables]
    dup = sorted({o for o in outs if outs.count(o) > 1})
    if dup:
        twice = [quoted(sch, t) for sch, t, out in tables if out in dup]
        raise DefiniteError(
            f"{who}: outputs {dup} would be fed by more than one table ({', '.join(twice)})",
            hint="list the tables under postgres.tables, giving each its own output: name")


def default_name(source: str, identity: str | None) -> str:
    """The default slot and publication name: ``reclock_<identity>_<source>``
    (lower case, ``-`` as ``_``, then a digest of the name if that changed it,
    so that no two source names meet; a digest where it would pass
    PostgreSQL's 63 characters). ``identity`` None: the name from before
    pipeline identities."""
    ident = source.replace("-", "_").lower()
    if identity is None:
        name = f"reclock_{ident}"
    else:
        name = f"reclock_{identity}_{ident}"
        if ident != source:  # 'a-b' and 'a_b', 'Shop' and 'shop': never one name
            name += "_" + hashlib.sha256(source.encode()).hexdigest()[:6]
    if len(name) > 63:
        digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
        name = f"{name[:46]}_{digest}"
    return name


class PostgresSource(SourceBase):
    """Driver side (see the module docstring)."""

    kind = Lsn.KIND
    replayable = False  # the slot releases what was acknowledged
    jobs_in_flight: int | None = 1  # a slot serves one walsender at a time: jobs read one by one

    def __init__(
        self,
        name: str,
        dsn: str,
        clock: Clock,
        *,
        publication: str | None = None,
        slot: str | None = None,
        tables: Sequence[tuple[str, str, str]] | None = None,
        snapshot: bool = True,
        snapshot_count: bool = True,
        drop_slot: bool = False,
        timeout_s: float = 30.0,
        output_names: Sequence[str] = (),
        identity: str | None = None,
        facts: Facts | None = None,
        policies: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.clock = clock
        self.dsn = dsn
        self.params, self.secrets = parse_dsn(dsn, f"source {name!r}")
        self.server = server_label(self.params)
        self.publication = publication or default_name(name, identity)
        self.slot = slot or default_name(name, identity)
        # Before pipeline identities, the defaults were reclock_<source>; an
        # existing deployment's slot is adopted under that name (see open()).
        self._legacy = None if (slot or identity is None) else default_name(name, None)
        self._explicit = (slot is not None, publication is not None)
        self.snapshot = snapshot
        self.snapshot_count = snapshot_count
        self.drop_slot_on_drop = drop_slot
        self.timeout_s = timeout_s
        self.who = f"source {name!r} ({self.server})"
        self._configured = list(tables) if tables else None  # (schema, table, output)
        self._output_names = list(output_names)
        if self._configured is not None:
            _check_outputs(self.who, self._configured)
        self.tables: list[PgTable] = []
        #: the tables' column histories (sources/postgres/history.py): kept
        #: with the source's state when a store is at hand, else in memory
        self._facts = facts
        self._histories: dict[str, str] = {}
        self._policies = dict(policies or {})
        #: per output: the changes its history merge found at the last describe
        self._changes: dict[str, tuple[Change, ...]] = {}
        #: per output: columns pending in its history (added upstream, not
        #: output columns yet), as of the last describe
        self._pending: dict[str, tuple[str, ...]] = {}
        #: per output: relation messages its reader met and could not map
        #: (ShapeSeen), until a describe's history merge took them
        self._seen: dict[str, list[history.RawShape]] = {}
        #: per output: the relation messages its history took (a reader that
        #: meets one again cannot map it still: a definite error, not a
        #: re-open for ever)
        self._taken: dict[str, set[history.RawShape]] = {}
        self._conn: Connection | None = None
        self._inval: str | None = None  # see slot_invalidation(), per connection
        self._snap: _Snapshot | None = None
        self._slot_flush: int | None = None
        self._acked: int | None = None

    def __repr__(self) -> str:
        return (f"PostgresSource({self.name!r}, server={self.server!r}, "
                f"publication={self.publication!r}, slot={self.slot!r})")

    # -- connections ---------------------------------------------------------------
    def _connection(self) -> Connection:
        c = self._conn
        if c is not None and not c.closed and not c.broken:
            return c
        self._close_conn()
        try:
            self._conn = connect(self.dsn, self.params, app=f"reclock {self.name}",
                                 timeout_s=self.timeout_s)
        except psycopg.Error as exc:
            raise pg_error(exc, f"{self.who}: cannot connect", self.secrets) from None
        return self._conn

    def _close_conn(self) -> None:
        self._inval = None
        c, self._conn = self._conn, None
        if c is not None:
            with contextlib.suppress(psycopg.Error):
                c.close()

    def _slot_info(self) -> SlotInfo | None:
        try:
            conn = self._connection()
            if self._inval is None:
                self._inval = slot_invalidation(conn)
            return slot_info(conn, self.slot, self._inval)
        except psycopg.Error as exc:
            self._close_conn()
            raise pg_error(exc, f"{self.who}: cannot read slot {self.slot!r}",
                           self.secrets) from None

    def _query(self, doing: str, q: Any, args: Any = None) -> list[tuple[Any, ...]]:
        try:
            cur = self._connection().execute(q, args)
            return cur.fetchall() if cur.description is not None else []
        except psycopg.Error as exc:
            if self._conn is not None and (self._conn.broken or self._conn.closed):
                self._close_conn()
            raise pg_error(exc, f"{self.who}: {doing}", self.secrets) from None

    # -- outputs -------------------------------------------------------------------
    def _table_names(self, conn: Connection) -> list[tuple[str, str, str]]:
        if self._configured is not None:
            return self._configured
        pub = publication_tables(conn, self.publication)
        if pub is None:
            raise DefiniteError(
                f"{self.who}: publication {self.publication!r} does not exist and no tables "
                "are configured", hint="list the tables under postgres.tables, or create the "
                                       "publication")
        named = [(sch, t, t) for sch, t in pub]
        _check_outputs(f"publication {self.publication!r}", named)
        return named

    def describe(self) -> list[PgTable]:
        """Read the tables' current shape from the catalog."""
        try:
            conn = self._connection()
            tables = describe_tables(conn, self._table_names(conn))
        except psycopg.Error as exc:
            self._close_conn()
            raise pg_error(exc, f"{self.who}: cannot read the catalog", self.secrets) from None
        except DefiniteError as exc:
            raise DefiniteError(f"{self.who}: {exc.args[0]}", hint=exc.hint) from None
        if self._output_names:
            have = {t.output for t in tables}
            extra = [n for n in self._output_names if n not in have]
            if extra and self._configured is None:
                raise DefiniteError(
                    f"{self.who}: outputs {extra} are not tables of publication "
                    f"{self.publication!r} (it publishes {sorted(have)})",
                    hint="name each output after a published table")
        # Each table merged with its column history: renames keep the
        # output's names, dropped columns stay (null from then on).
        known = dict(self._facts.read()) if self._facts is not None else dict(self._histories)
        merged, updates = [], {}
        took: dict[str, list[history.RawShape]] = {}
        for t in tables:
            key = history.PREFIX + t.output
            seen = self._seen.get(t.output, []) if known.get(key) is not None else []
            again = [shape for shape in seen if shape in self._taken.get(t.output, ())]
            if again:
                raise DefiniteError(
                    f"{self.who}: table {t.qualified}: changes carry columns "
                    f"{[n for n, _, _ in again[0][1]]} that "
                    "its output's column history took in and still cannot map onto the "
                    "output's columns", hint="re-read the output in the table's shape now "
                    "(drop the output and the source's state: a new snapshot)")
            shapes, attrs, listed = self._shapes(t, seen) if seen else ((), None, False)
            m = history.merge(self.who, t, known.get(key), shapes, attrs, listed)
            dropped = [c.column for c in m.changes if c.kind == "dropped"]
            if dropped and m.table.envelope == "none":
                raise DefiniteError(
                    f"{self.who}: table {t.qualified}: columns {dropped} were dropped upstream, "
                    "and its output is a diff log (REPLICA IDENTITY FULL, or no key): a later "
                    "change's old row lacks their values, so its retraction would not match "
                    "the row the output holds", hint="re-read the output in the table's shape "
                    "now (drop the output and the source's state: a new snapshot), or give the "
                    "table a primary key (a keyed output retracts by key)")
            defaulted = _added_with_default(t, known.get(key))
            if defaulted and t.identity == "f" and self._policies.get(
                    t.output, "evolve") == "evolve":
                raise DefiniteError(
                    f"{self.who}: table {t.qualified}: columns {defaulted} were added upstream "
                    "with a default, and its output is a diff log (REPLICA IDENTITY FULL): the "
                    "rows the table held then hold the default while the output holds them "
                    "null (no change carried it), so a later change's old row would not "
                    "match the row the output holds", hint="re-read the output in the "
                    "table's shape now (drop the output and the source's state: a new "
                    "snapshot), or give the table a primary key and REPLICA IDENTITY DEFAULT "
                    "(a keyed output retracts by key)")
            self._changes[t.output] = m.changes
            self._pending[t.output] = m.pending
            merged.append(m.table)
            if m.fact == known.get(key) or not (
                    m.changes and self._policies.get(t.output) == "fail"):
                if m.fact != known.get(key):
                    updates[key] = m.fact  # (fail: the changes are reported until taken)
                took[t.output] = seen
        if updates:
            if self._facts is not None:
                self._facts.write(updates)
            self._histories.update(updates)
        for output, seen in took.items():  # (once the history holding them is written)
            self._taken.setdefault(output, set()).update(seen)
            self._seen.pop(output, None)
        self.tables = merged
        return merged

    def _shapes(self, t: PgTable, seen: Sequence[history.RawShape]
                ) -> tuple[list[history.Shape], dict[int, str | None], bool]:
        """The relation messages ``seen`` of table ``t`` with their types
        resolved; every column number the table has had; whether the
        publication lists its columns (see :func:`history.merge`)."""
        try:
            conn = self._connection()
            types = resolve_types(conn, [(o, m) for _, cols in seen for _, o, m in cols])
            attrs = column_numbers(conn, t.oid)
            listed = columns_listed(conn, self.publication, t.oid)
        except psycopg.Error as exc:
            self._close_conn()
            raise pg_error(exc, f"{self.who}: cannot read the catalog", self.secrets) from None
        shapes = [history.Shape(relid, tuple((n, types[(o, m)]) for n, o, m in cols))
                  for relid, cols in seen]
        return shapes, attrs, listed

    def shape_seen(self, output: int, shape: object) -> None:
        """A relation message output ``output``'s reader could not map (see
        :meth:`PostgresReader._layout`): the next describe takes it in."""
        if 0 <= output < len(self.tables) and isinstance(shape, tuple):
            seen = self._seen.setdefault(self.tables[output].output, [])
            if shape not in seen:
                seen.append(shape)

    def outputs(self) -> list[OutputSpec]:
        try:
            return self.current_outputs()
        except (TransientError, DefiniteError):
            # The names are known (the database is down, a table is not there
            # yet, the publication cannot name its outputs): the driver's
            # open() describes again and reports it as the source's health.
            if self._configured is not None:
                return [OutputSpec(out, typed=True) for _, _, out in self._configured]
            if self._output_names:
                return [OutputSpec(out, typed=True) for out in self._output_names]
            raise

    def current_outputs(self) -> list[OutputSpec]:
        """The outputs as the catalog describes them now (the driver's open);
        raises what keeps them from being described."""
        self.describe()
        return [OutputSpec(t.output, typed=True, schema=t.arrow_schema, key=t.key,
                           envelope=t.envelope, changes=self._changes.get(t.output, ()))
                for t in self.tables]

    def initial_frontier(self) -> Antichain[Lsn]:
        return Antichain.from_elem(Lsn(0))

    # -- open ------------------------------------------------------------------------
    can_resnapshot = True

    def open(self, resume: Antichain[Lsn], bound: Antichain[Lsn],
             held: Sequence[Antichain[Lsn] | None] = (),
             resnapshot: Sequence[int] = ()) -> None:
        """Checks, publication, slot, and a snapshot for the outputs in
        ``held`` that hold nothing yet (``None`` or the initial frontier) and
        for those in ``resnapshot`` (read again although they hold data: the
        same hand-off, their changes before the new snapshot point dropped)."""
        conn = self._connection()
        try:
            check_server(conn, self.who)
        except psycopg.Error as exc:
            self._close_conn()
            raise pg_error(exc, f"{self.who}: cannot check the server", self.secrets) from None
        # The driver described the tables just before (current_outputs()).
        tables = self.tables or self.describe()
        self._adopt_legacy_names(resume)
        self._ensure_publication(tables)
        actions = publication_actions(conn, self.publication)
        if actions.get("update") or actions.get("delete"):
            for t in tables:
                if not t.key and t.identity != "f":
                    raise DefiniteError(
                        f"{self.who}: table {t.qualified} has no replica identity usable for "
                        f"updates and deletes (REPLICA IDENTITY {_IDENT[t.identity]}, "
                        f"{'no primary key' if t.identity == 'd' else 'no key'})",
                        hint=_identity_hint(t))
        bare = [i for i in range(len(tables))
                if i >= len(held) or held[i] is None or _initial(held[i])]
        holding = len(bare) < len(tables)
        empty = sorted(set(bare) | {i for i in resnapshot if 0 <= i < len(tables)})
        if self.snapshot:
            self._promote([i for i in empty if self._pending.get(tables[i].output)])
        self._ensure_slot(holding, resume)
        self._check_not_advanced_elsewhere(holding, resume)
        if self._snap is not None and (not self._snap.alive
                                       or not set(empty) <= set(self._snap.outputs)):
            self._release_snapshot()
        if self.snapshot and empty and self._snap is None:
            self._take_snapshot(tuple(empty))
        elif self._snap is not None:
            self._snap.outputs = tuple(i for i in self._snap.outputs if i in empty)
            if not self._snap.outputs:
                self._release_snapshot()
        self._acked = None

    def _promote(self, outputs: list[int]) -> None:
        """The outputs a snapshot is to read take the columns pending in
        their histories (added upstream, carried by no change read yet: see
        :mod:`reclock.sources.postgres.history`) under their names now, so that the
        snapshot reads them; the driver re-opens to give the outputs those
        columns before the snapshot is taken."""
        if not outputs:
            return
        known = dict(self._facts.read()) if self._facts is not None else dict(self._histories)
        updates = {}
        for i in outputs:
            t = self.tables[i]
            key = history.PREFIX + t.output
            if key in known:
                updates[key] = history.promote(known[key], self.who, t)
        if self._facts is not None:
            self._facts.write(updates)
        self._histories.update(updates)
        names = {self.tables[i].output: list(self._pending[self.tables[i].output])
                 for i in outputs}
        raise Reopen(f"{self.who}: outputs {list(names)} are read by a new snapshot, which "
                     f"takes the columns added upstream since they were described ({names}); "
                     "describing them again")

    def _adopt_legacy_names(self, resume: Antichain[Lsn]) -> None:
        """A deployment from before pipeline identities holds data read through
        ``reclock_<source>``: keep using that slot (and publication) rather
        than lose the changes since, when this pipeline's own slot does not
        exist yet. Name them explicitly in the config to silence this."""
        if self._legacy is None or _initial(resume) or self._slot_info() is not None:
            return
        own = self.slot
        self.slot = self._legacy
        if self._slot_info() is None:
            self.slot = own
            return
        if not self._explicit[1]:
            self.publication = self._legacy
        log.warning("%s: adopting replication slot %s (named before pipeline identities); "
                    "set postgres.slot: %s (and publication) to make it explicit",
                    self.who, self._legacy, self._legacy)
        self._legacy = None

    def _check_not_advanced_elsewhere(self, holding: bool, resume: Antichain[Lsn]) -> None:
        """reclock advances its slot only to what every output holds, so a slot
        confirmed past the outputs' resumption frontier was advanced by
        something else (another pipeline sharing it): the changes between were
        never read here."""
        lsn = resume.as_option()
        if not holding or lsn is None or _initial(resume) or self._slot_flush is None:
            return  # (an output that holds nothing yet keeps the frontier at the start)
        if self._slot_flush > int(lsn):
            raise DefiniteError(
                f"{self.who}: replication slot {self.slot!r} is confirmed up to LSN "
                f"{_fmt(Antichain.from_elem(Lsn(self._slot_flush)))}, past what this "
                f"pipeline's outputs hold ({_fmt(resume)}): something else advanced it, and "
                "the changes between are lost to this pipeline",
                hint="give each pipeline its own slot (postgres.slot); drop this source's "
                     "outputs and state and start again (a new snapshot)")

    def _ensure_publication(self, tables: list[PgTable]) -> None:
        conn = self._connection()
        have = publication_tables(conn, self.publication)
        if have is None:
            log.info("%s: creating publication %s", self.who, self.publication)
            q = sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
                sql.Identifier(self.publication),
                sql.SQL(", ").join(t.ident for t in tables))
            self._query(f"cannot create publication {self.publication!r} (the user must own "
                        "the tables, or create it beforehand)", q)
            return
        missing = [t.qualified for t in tables if (t.schema, t.name) not in set(have)]
        if missing:
            raise DefiniteError(
                f"{self.who}: publication {self.publication!r} does not publish "
                f"{', '.join(missing)}",
                hint=f"ALTER PUBLICATION {self.publication} ADD TABLE {', '.join(missing)}")

    def _ensure_slot(self, holding: bool, resume: Antichain[Lsn]) -> None:
        info = self._slot_info()
        if info is None:
            if holding:
                raise DefiniteError(
                    f"{self.who}: replication slot {self.slot!r} does not exist although the "
                    f"outputs hold data up to LSN {_fmt(resume)}: it was dropped behind "
                    "reclock's back and the changes since then are lost",
                    hint="drop the source's outputs and state and start it again (a new "
                         "snapshot)")
            self._create_slot()
            return
        self._check_slot(info)

    def _check_slot(self, info: SlotInfo) -> None:
        if info.plugin != "pgoutput":
            raise DefiniteError(f"{self.who}: slot {self.slot!r} uses plugin {info.plugin!r}, "
                                "not pgoutput", hint="name another slot (postgres.slot)")
        db = self.params.get("dbname")
        if db and info.database and info.database != db:
            raise DefiniteError(f"{self.who}: slot {self.slot!r} belongs to database "
                                f"{info.database!r}", hint="name another slot (postgres.slot)")
        if info.wal_status == "lost" or info.invalidation:
            raise DefiniteError(
                f"{self.who}: replication slot {self.slot!r} was invalidated "
                f"({info.invalidation or 'wal_status lost'}): the WAL it needed was removed "
                "and changes are lost",
                hint="raise max_slot_wal_keep_size; drop the source's outputs and state and "
                     "start again (a new snapshot)")
        self._slot_flush = info.confirmed_flush

    def _replication_conn(self) -> Connection:
        try:
            return connect(self.dsn, self.params, replication=True,
                           app=f"reclock {self.name}", timeout_s=self.timeout_s)
        except psycopg.Error as exc:
            raise pg_error(exc, f"{self.who}: cannot open a replication connection",
                           self.secrets) from None

    def _create_slot(self) -> None:
        log.info("%s: creating replication slot %s", self.who, self.slot)
        r = self._replication_conn()
        try:
            cmd = f'CREATE_REPLICATION_SLOT "{_slot_ident(self.slot)}" LOGICAL pgoutput ' \
                  "NOEXPORT_SNAPSHOT"
            res = r.pgconn.exec_(cmd.encode())
            if res.status != pq.ExecStatus.TUPLES_OK:
                raise DefiniteError(
                    f"{self.who}: cannot create replication slot {self.slot!r}: "
                    f"{res.error_message.decode(errors='replace').strip()}",
                    hint="check max_replication_slots and the role's REPLICATION attribute")
            self._slot_flush = lsn_int(_val(res, 1))
        finally:
            r.close()

    def _take_snapshot(self, outputs: tuple[int, ...]) -> None:
        stats = self._table_stats([self.tables[i].oid for i in outputs])  # for estimates
        r = self._replication_conn()
        tmp = f"reclock_snap_{uuid.uuid4().hex[:16]}"
        res = r.pgconn.exec_(f'CREATE_REPLICATION_SLOT "{tmp}" TEMPORARY LOGICAL pgoutput '
                             "EXPORT_SNAPSHOT".encode())
        if res.status != pq.ExecStatus.TUPLES_OK:
            msg = res.error_message.decode(errors="replace").strip()
            r.close()
            raise TransientError(f"{self.who}: cannot export a snapshot: {msg}",
                                 hint="check max_replication_slots; retried with backoff")
        lsn = lsn_int(_val(res, 1))
        name = _val(res, 2)
        assert lsn is not None and name is not None
        sizes = SnapshotSizes({i: self.tables[i] for i in outputs},
                              {i: stats.get(self.tables[i].oid, (0, -1, 0)) for i in outputs})
        self._snap = _Snapshot(r, name, lsn, outputs, sizes)
        log.info("%s: snapshot %s at %s for %s", self.who, name, lsn_text(lsn),
                 [self.tables[i].output for i in outputs])
        if self.snapshot_count:  # in the background: the chunks are read meanwhile
            sizes.start(self.dsn, self.params, self.secrets, name, self.who,
                        f"reclock {self.name} snapshot count", self.timeout_s)

    def _release_snapshot(self) -> None:
        s, self._snap = self._snap, None
        if s is not None:
            if s.sizes is not None:
                s.sizes.cancel()
            with contextlib.suppress(psycopg.Error):
                s.conn.close()

    def snapshot_position(self, output: int) -> tuple[int, int] | None:
        snap = self._snap
        if snap is None or output not in snap.outputs:
            return None
        return 0, snap.lsn - 1  # where its chunk rows are stamped

    def snapshot_sizes(self) -> dict[int, SnapshotSize]:
        """The rows of each output's table under the snapshot being taken:
        the catalog's estimate, then an exact count
        (:mod:`reclock.sources.postgres.snapshot_size`). Any thread."""
        snap = self._snap
        if snap is None or snap.sizes is None:
            return {}
        outputs = snap.outputs
        return {i: s for i, s in snap.sizes.current().items() if i in outputs}

    # -- probe -----------------------------------------------------------------------
    def probe(self) -> Antichain[Lsn]:
        rows = self._query("cannot probe", "SELECT pg_current_wal_flush_lsn()::text")
        flush = lsn_int(rows[0][0])
        info = self._slot_info()
        if info is None:
            raise DefiniteError(
                f"{self.who}: replication slot {self.slot!r} was dropped behind reclock's back; "
                "changes after the last acknowledged LSN are lost",
                hint="drop the source's outputs and state and start it again (a new snapshot)")
        self._check_slot(info)
        assert flush is not None
        return Antichain.from_elem(Lsn(flush))

    # -- plan ------------------------------------------------------------------------
    def plan(self, lower: Antichain[Lsn], upper: Antichain[Lsn], max_task: int, max_job: int
             ) -> tuple[list[ReadTask], Antichain[Lsn]]:
        lo_t, hi_t = lower.as_option(), upper.as_option()
        if lo_t is None or hi_t is None:
            raise DefiniteError(f"{self.who}: a Postgres source never closes its frontier")
        lo, hi = int(lo_t), int(hi_t)
        if hi <= lo:
            return [], lower
        snap = self._snap
        if snap is not None and not snap.alive:
            self._release_snapshot()
            raise Reopen(f"{self.who}: the connection holding the snapshot was lost; taking a "
                         "new one", hint="the outputs that hold nothing re-read their tables")
        tasks: list[ReadTask] = []
        start = max(lo, self._slot_flush or 0)  # the slot holds nothing before it
        end = min(hi, max(start, lo) + max_job * WAL_BYTES_PER_CHANGE)
        if snap is not None and lo < snap.lsn <= hi:
            end = max(end, snap.lsn)
            tasks += self._chunk_tasks(snap, max_task)
        at = () if snap is None else tuple((i, snap.lsn) for i in snap.outputs)
        if start < end:
            tasks.append(ReadTask(self.name, len(tasks), StreamSpec(start, end, at),
                                  max(1, (end - start) // WAL_BYTES_PER_CHANGE)))
        return tasks, Antichain.from_elem(Lsn(end))

    def _table_stats(self, oids: list[int]) -> dict[int, tuple[int, float, int]]:
        """Per table oid: (pages now, ``reltuples``, ``relpages``)."""
        rows = self._query("cannot size the tables",
                           "SELECT oid, pg_relation_size(oid) / current_setting('block_size')"
                           "::int, reltuples, relpages FROM pg_class WHERE oid = ANY(%s)",
                           (oids,))
        return {r[0]: (int(r[1] or 0), float(r[2]), int(r[3] or 0)) for r in rows}

    def _chunk_tasks(self, snap: _Snapshot, max_task: int) -> list[ReadTask]:
        out: list[ReadTask] = []
        sizes = self._table_stats([self.tables[i].oid for i in snap.outputs])
        for i in snap.outputs:
            pages, tuples, relpages = sizes.get(self.tables[i].oid, (0, 0, 0))
            per_page = (tuples / relpages) if relpages and tuples and tuples > 0 else 100.0
            step = max(1, int(max_task / max(per_page, 1.0)))
            first, chunk = 0, 0
            while True:
                last = first + step
                final = last >= pages
                out.append(ReadTask(self.name, len(out), ChunkSpec(
                    i, snap.name, snap.lsn, chunk, first, None if final else last),
                    int(step * per_page), snapshot=i))
                if final:
                    break
                first, chunk = last, chunk + 1
        return out

    def reader(self) -> PostgresReader:
        return PostgresReader(self.name, self.dsn, self.slot, self.publication,
                              tuple(self.tables), self.timeout_s)

    # -- acknowledge -----------------------------------------------------------------
    def acknowledge(self, frontier: Antichain[Lsn]) -> bool:
        """``confirmed_flush_lsn`` to the resumption frontier (never past it);
        the snapshot is released once it is durable everywhere."""
        f = frontier.as_option()
        if f is None:
            return True
        target = int(f)
        snap = self._snap
        if snap is not None and target >= snap.lsn:
            self._release_snapshot()
        if self._acked is not None and target <= self._acked:
            return True
        if self._slot_flush is not None and target <= self._slot_flush:
            self._acked = target
            return True
        try:
            row = self._connection().execute(
                "SELECT end_lsn::text FROM pg_replication_slot_advance(%s, %s::pg_lsn)",
                (self.slot, lsn_text(target))).fetchone()
        except psycopg.errors.ObjectInUse:
            return False  # a task's walsender holds the slot: asked again later
        except psycopg.Error as exc:
            if self._conn is not None and (self._conn.broken or self._conn.closed):
                self._close_conn()
            raise pg_error(exc, f"{self.who}: cannot advance slot {self.slot!r}",
                           self.secrets) from None
        self._acked = target
        if row is not None:
            self._slot_flush = lsn_int(row[0])
        return True

    def drop(self) -> str | None:
        """``reclock drop``: drop the slot when configured to (``drop_slot``).
        Says what was released (None: nothing)."""
        self._release_snapshot()
        if not self.drop_slot_on_drop:
            return None
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                dropped = self._connection().execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                    "WHERE slot_name = %s", (self.slot,)).fetchall()
                if not dropped:
                    return None
                log.info("%s: dropped replication slot %s", self.who, self.slot)
                return f"replication slot {self.slot!r} dropped"
            except psycopg.errors.ObjectInUse:
                if time.monotonic() > deadline:
                    raise TransientError(f"{self.who}: slot {self.slot!r} is still in use",
                                         hint="stop the pipeline, then drop again") from None
                time.sleep(0.2)
            except psycopg.Error as exc:
                self._close_conn()
                raise pg_error(exc, f"{self.who}: cannot drop slot {self.slot!r}",
                               self.secrets) from None

    def close(self) -> None:
        self._release_snapshot()
        self._close_conn()


_IDENT = {"d": "DEFAULT", "f": "FULL", "i": "USING INDEX", "n": "NOTHING"}


def _initial(f: Antichain[Lsn] | None) -> bool:
    if f is None:
        return True
    v = f.as_option()
    return v is not None and int(v) == 0


def _fmt(f: Antichain[Lsn]) -> str:
    v = f.as_option()
    return "(closed)" if v is None else lsn_text(int(v))


def _slot_ident(name: str) -> str:
    return name.replace('"', '""')


def _val(res: pq.abc.PGresult, col: int) -> str | None:
    v = res.get_value(0, col)
    return None if v is None else bytes(v).decode()


# ---------------------------------------------------------------------------
# Executor side
# ---------------------------------------------------------------------------


class _CopyStream:
    """The bytes of a ``COPY ... TO STDOUT`` as a readable file for Arrow."""

    closed = False

    def __init__(self, cp: Any) -> None:
        self._chunks = iter(cp)
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        out: list[bytes] = []
        want = size if size is not None and size >= 0 else None
        got = 0
        while want is None or got < want:
            if not self._pending:
                chunk = next(self._chunks, None)
                if chunk is None:
                    break
                self._pending = memoryview(chunk)
                continue
            take = self._pending if want is None else self._pending[:want - got]
            out.append(bytes(take))
            got += len(take)
            self._pending = self._pending[len(take):]
        return b"".join(out)

    def close(self) -> None:
        self.closed = True


@dataclass
class _Buffer:
    """Rows of one output being collected in a task."""

    table: PgTable
    cols: list[list[Any]] = field(default_factory=list)
    diff: list[int] = field(default_factory=list)
    part: list[int] = field(default_factory=list)
    off: list[int] = field(default_factory=list)
    seq: list[int] = field(default_factory=list)
    ts: list[int | None] = field(default_factory=list)
    #: per row: output columns left unchanged upstream and not sent (or None)
    unchanged: list[list[int] | None] = field(default_factory=list)
    #: the upstream type of each output column in the current layout
    types: list[PgType] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cols = [[] for _ in self.table.columns]
        self.types = [c.type for c in self.table.columns]

    def __len__(self) -> int:
        return len(self.diff)

    def add(self, values: Sequence[Any], diff: int, part: int, off: int, seq: int,
            ts: int | None, unchanged: list[int] | None = None) -> None:
        for col, v in zip(self.cols, values, strict=True):
            col.append(v)
        self.diff.append(diff)
        self.part.append(part)
        self.off.append(off)
        self.seq.append(seq)
        self.ts.append(ts)
        self.unchanged.append(unchanged)

    def take_columns(self, raw: Sequence[pa.Array], diff: int, part: int, off: int,
                     seq: int) -> pa.RecordBatch:
        """A batch of rows given as text columns (a snapshot's CSV block), all
        at one position ``(part, off)`` with sequence numbers from ``seq``."""
        n = len(raw[0]) if raw else 0
        columns = self._converted(raw)
        names = [c.name for c in self.table.columns]
        columns += [pa.array(np.full(n, part, np.int32)), pa.array(np.full(n, off, np.int64)),
                    pa.array(np.arange(seq, seq + n, dtype=np.int32)), pa.nulls(n, pa.int64()),
                    pa.array(np.full(n, diff, np.int64))]
        names += [SRC_PART, SRC_OFFSET, SRC_SEQ, SRC_TS, SRC_DIFF]
        return pa.RecordBatch.from_arrays(columns, names=names)

    def _converted(self, raw: Sequence[pa.Array]) -> list[pa.Array]:
        t = self.table
        arrays: list[pa.Array] = []
        for c, col, typ in zip(t.columns, raw, self.types, strict=True):
            if isinstance(col, pa.ChunkedArray):
                col = col.combine_chunks()
            arr = convert(col, typ, f"table {t.qualified} column {c.name!r}")
            want = c.type.arrow
            if arr.type != want:
                arr = arr.cast(want)
            arrays.append(arr)
        return arrays

    def take_native(self, taken: tuple[Any, ...]) -> pa.RecordBatch:
        """The batch of the C decoder's ``Decoder.take()`` buffers for this
        output (see sources/postgres/_pgoutput_native.c): the same columns
        as :meth:`take` makes of the rows it was given."""
        (n, cols, diff, off, seq, ts, ts_valid, ts_nulls, u_offs, u_vals, u_valid,
         u_nulls) = taken

        def col(t: pa.DataType, nulls: int, valid: bytes, *bufs: bytes) -> pa.Array:
            validity = pa.py_buffer(valid) if nulls else None
            return pa.Array.from_buffers(t, n, [validity, *map(pa.py_buffer, bufs)],
                                         null_count=nulls)

        arrays = self._converted([col(pa.binary(), nulls, valid, offsets, data)
                                  for offsets, data, valid, nulls in cols])
        names = [c.name for c in self.table.columns]
        arrays += [col(pa.int32(), 0, b"", bytes(4 * n)), col(pa.int64(), 0, b"", off),
                   col(pa.int32(), 0, b"", seq), col(pa.int64(), ts_nulls, ts_valid, ts),
                   col(pa.int64(), 0, b"", diff)]
        names += [SRC_PART, SRC_OFFSET, SRC_SEQ, SRC_TS, SRC_DIFF]
        if u_nulls < n:
            values = pa.Array.from_buffers(pa.int32(), len(u_vals) // 4,
                                           [None, pa.py_buffer(u_vals)])
            arrays.append(pa.Array.from_buffers(
                pa.list_(pa.int32()), n, [pa.py_buffer(u_valid), pa.py_buffer(u_offs)],
                null_count=u_nulls, children=[values]))
            names.append(SRC_UNCHANGED)
        return pa.RecordBatch.from_arrays(arrays, names=names)

    def take(self, binary: bool) -> pa.RecordBatch:
        t = self.table
        arrays = self._converted([pa.array(vals, pa.binary() if binary else pa.string())
                                  for vals in self.cols])
        names = [c.name for c in t.columns]
        arrays += [pa.array(self.part, pa.int32()), pa.array(self.off, pa.int64()),
                   pa.array(self.seq, pa.int32()), pa.array(self.ts, pa.int64()),
                   pa.array(self.diff, pa.int64())]
        names += [SRC_PART, SRC_OFFSET, SRC_SEQ, SRC_TS, SRC_DIFF]
        if any(self.unchanged):
            arrays.append(pa.array(self.unchanged, pa.list_(pa.int32())))
            names.append(SRC_UNCHANGED)
        batch = pa.RecordBatch.from_arrays(arrays, names=names)
        self.cols = [[] for _ in t.columns]
        self.diff, self.part, self.off, self.seq, self.ts = [], [], [], [], []
        self.unchanged = []
        return batch


@dataclass
class _Layout:
    """How one relation message's columns map onto an output's columns."""

    output: int
    table: PgTable
    pos: list[int]  # per output column: index in the tuple, -1 = absent (null)
    types: list[PgType]
    key_pos: list[int]  # tuple indexes of the output's key columns


def _commit_ms(commit_ts: int) -> int:
    """A Begin's commit time (us since 2000-01-01) in ms since the Unix epoch."""
    us = commit_ts + po.PG_EPOCH_US
    if us >= 2**63:  # (the C decoder's int64 cannot hold it either)
        raise po.ProtocolError(f"commit time {commit_ts} is out of range")
    return us // 1000


class _NativeRows:
    """Rows the Python path appends (``_Buffer.add``) into the C decoder's
    buffers of one output."""

    __slots__ = ("dec", "ncols", "output")

    def __init__(self, dec: Any, output: int, ncols: int) -> None:
        self.dec, self.output, self.ncols = dec, output, ncols

    def add(self, values: Sequence[Any], diff: int, part: int, off: int, seq: int,
            ts: int | None, unchanged: list[int] | None = None) -> None:
        self.dec.add_row(self.output, self.ncols, values, diff, off, seq, ts, unchanged)


class _Decoding:
    """The state of one replication task's decode: the relation messages
    met, the layouts built from them, the outputs' buffers (in Python, or
    in the C decoder ``dec`` when it decodes)."""

    def __init__(self, reader: PostgresReader, params: dict[str, Any], spec: StreamSpec
                 ) -> None:
        self.reader = reader
        self.params = params
        self.end = spec.end
        self.by_name = {(t.schema, t.name): i for i, t in enumerate(reader.tables)}
        self.snap_at = dict(spec.snapshot_at)
        self.layouts: dict[int, _Layout] = {}
        #: relation messages whose layout is not built yet
        self.rels: dict[int, po.Relation] = {}
        self.bufs: dict[int, _Buffer] = {}
        self.dec: Any = None

    def layout(self, relid: int, commit_lsn: int) -> _Layout | None:
        """How a change of ``relid`` in a transaction committing at
        ``commit_lsn`` maps onto its output; None when the relation is
        no output's table, or the output drops the change (it commits
        before the output's snapshot point). The layout is built from
        the relation message in force only when a change is taken: one
        from before a snapshot point may name columns the output never
        had (added and dropped again before the snapshot was taken)."""
        lay = self.layouts.get(relid)
        if lay is not None:
            return lay
        rel = self.rels.get(relid)
        i = None if rel is None else self.by_name.get((rel.namespace, rel.name))
        if rel is None or i is None or commit_lsn < self.snap_at.get(i, 0):
            return None
        lay = self.layouts[relid] = self.reader._layout(self.params, i, rel)
        del self.rels[relid]
        self.bufs.setdefault(i, _Buffer(self.reader.tables[i])).types = lay.types
        if self.dec is not None:
            self.dec.layout(relid, i, len(lay.pos), lay.pos, lay.key_pos,
                            lay.table.envelope == "none")
        return lay

    def skip(self, relid: int, lay: _Layout | None) -> None:
        """The C decoder skips ``relid``'s changes (advancing the position)
        for as long as :meth:`layout` would return None for them: until a
        relation message for it (no output's table, or no message yet), or
        until its output's snapshot point."""
        rel = self.rels.get(relid)
        i = lay.output if lay is not None else \
            None if rel is None else self.by_name.get((rel.namespace, rel.name))
        self.dec.skip(relid, 2**64 - 1 if i is None else self.snap_at.get(i, 0))

    def relation(self, m: po.Relation, commit_lsn: int) -> Iterator[tuple[int, pa.RecordBatch]]:
        i = self.by_name.get((m.namespace, m.name))
        if i is not None and i in self.bufs and self.pending(i):
            yield i, self.take(i)  # rows of the previous layout
        self.layouts.pop(m.relid, None)
        if self.dec is not None:
            self.dec.forget(m.relid)
        self.rels[m.relid] = m
        self.layout(m.relid, commit_lsn)  # (now, when its changes are taken)

    def truncate(self, m: po.Truncate, commit_lsn: int, seq: int, ts: int | None) -> None:
        hit = [lay for r in m.relids if (lay := self.layout(r, commit_lsn)) is not None
               and commit_lsn >= self.snap_at.get(lay.output, 0)]
        diff_logs = [lay.table for lay in hit if lay.table.envelope != "upsert"]
        if diff_logs:
            names = ", ".join(t.qualified for t in diff_logs)
            raise DefiniteError(
                f"{self.reader.who}: {names} truncated at LSN {lsn_text(commit_lsn)}: "
                "their outputs are diff logs (REPLICA IDENTITY FULL or none) and "
                "cannot retract rows they were never sent one by one",
                hint="drop and re-create these outputs (a new snapshot), give the "
                     "tables a primary key (keyed outputs take truncates), or leave "
                     "truncate out of the publication (publish = 'insert, update, "
                     "delete')")
        for lay in hit:  # keyed: the driver's key state retracts every row
            self.sink(lay.output).add([None] * len(lay.pos), TRUNCATED, 0, commit_lsn,
                                      2 * seq, ts)

    def sink(self, output: int) -> _Buffer | _NativeRows:
        """Where rows of ``output`` are appended."""
        if self.dec is None:
            return self.bufs[output]
        return _NativeRows(self.dec, output, len(self.reader.tables[output].columns))

    def pending(self, output: int) -> int:
        return len(self.bufs[output]) if self.dec is None else int(self.dec.pending(output))

    def take(self, output: int) -> pa.RecordBatch:
        buf = self.bufs[output]
        return buf.take(binary=True) if self.dec is None else \
            buf.take_native(self.dec.take(output))

    def rest(self) -> Iterator[tuple[int, pa.RecordBatch]]:
        """The rows still held, per output."""
        for i in self.bufs:
            if self.pending(i):
                yield i, self.take(i)


@dataclass(frozen=True)
class PostgresReader:
    """Executor side: replication ranges and snapshot chunks."""

    source: str
    dsn: str
    slot: str
    publication: str
    tables: tuple[PgTable, ...]
    timeout_s: float
    native: bool = True  # decode with the C decoder where it is built

    @property
    def who(self) -> str:
        return f"source {self.source!r}"

    def read(self, task: ReadTask) -> Iterator[tuple[int, pa.RecordBatch]]:
        spec = task.spec
        if isinstance(spec, ChunkSpec):
            yield from self._chunk(spec)
        else:
            yield from self._stream(spec)

    # -- snapshot ----------------------------------------------------------------------
    def _chunk(self, spec: ChunkSpec) -> Iterator[tuple[int, pa.RecordBatch]]:
        params, secrets = parse_dsn(self.dsn, self.who)
        t = self.tables[spec.output]
        cond = sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({spec.first},0)"))
        if spec.last is not None:
            cond = sql.SQL("{} AND ctid < {}::tid").format(cond, sql.Literal(f"({spec.last},0)"))
        # CSV, parsed by Arrow's reader in blocks: every value arrives as the
        # same text the text format's rows carry (NULL unquoted and empty, an
        # empty string quoted), with no Python work per row.
        live = [i for i, c in enumerate(t.columns) if not c.gone]  # dropped ones: null
        q = sql.SQL("COPY (SELECT {} FROM {} WHERE {}) TO STDOUT WITH (FORMAT csv)").format(
            sql.SQL(", ").join(sql.Identifier(t.columns[i].upstream) for i in live), t.ident,
            cond)
        names = [f"c{i}" for i in range(len(live))]
        options = (
            pacsv.ReadOptions(column_names=names, use_threads=False, block_size=4 << 20),
            pacsv.ParseOptions(newlines_in_values=True),
            pacsv.ConvertOptions(column_types={n: pa.string() for n in names},
                                 strings_can_be_null=True, quoted_strings_can_be_null=False,
                                 null_values=[""]),
        )
        buf = _Buffer(t)
        seq = 0
        try:
            with connect(self.dsn, params, app=f"reclock {self.source} snapshot",
                         timeout_s=self.timeout_s) as conn:
                conn.autocommit = False
                conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                conn.read_only = True
                try:
                    conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(
                        sql.Literal(spec.snapshot)))
                except psycopg.Error as exc:
                    raise Reopen(f"{self.who}: snapshot {spec.snapshot} is gone ({exc}); taking "
                                 "a new one") from None
                with conn.cursor().copy(q) as cp:
                    stream = pa.PythonFile(_CopyStream(cp), mode="r")
                    try:
                        reader = pacsv.open_csv(stream, *options)
                    except pa.ArrowInvalid as exc:
                        if "Empty CSV file" not in str(exc):
                            raise
                        reader = None  # no rows in these pages
                    for block in reader or ():
                        n = block.num_rows
                        if n:
                            got = dict(zip(live, block.columns, strict=True))
                            cols = [got[i] if i in got else pa.nulls(n, pa.string())
                                    for i in range(len(t.columns))]
                            yield spec.output, buf.take_columns(
                                cols, 1, -1 - spec.chunk, spec.lsn - 1, seq)
                            seq += n
                conn.rollback()
        except psycopg.Error as exc:
            raise pg_error(exc, f"{self.who}: cannot read {t.qualified} (snapshot)",
                           secrets) from None

    # -- replication ---------------------------------------------------------------------
    def _start(self, params: dict[str, Any], secrets: list[str], start: int) -> Connection:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                conn = connect(self.dsn, params, replication=True,
                               app=f"reclock {self.source} stream", timeout_s=self.timeout_s)
            except psycopg.Error as exc:
                raise pg_error(exc, f"{self.who}: cannot open a replication connection",
                               secrets) from None
            pub = self.publication.replace("'", "''")
            cmd = (f'START_REPLICATION SLOT "{_slot_ident(self.slot)}" LOGICAL {lsn_text(start)} '
                   f"(proto_version '1', publication_names '\"{pub}\"')")
            conn.pgconn.send_query(cmd.encode())
            res = conn.pgconn.get_result()
            if res is not None and res.status == pq.ExecStatus.COPY_BOTH:
                return conn
            msg = conn.pgconn.error_message.decode(errors="replace").strip()
            state = None if res is None else res.error_field(pq.DiagnosticField.SQLSTATE)
            conn.close()
            if state == b"55006" and time.monotonic() < deadline:
                time.sleep(0.1)  # the walsender of the previous task is exiting
                continue
            if state == b"42704":
                raise DefiniteError(f"{self.who}: replication slot {self.slot!r} does not exist: "
                                    f"{msg}", hint="it was dropped behind reclock's back; "
                                    "changes are lost: drop the outputs and state and start "
                                    "again")
            if state in (b"55000", b"42P01") or "publication" in msg:
                raise DefiniteError(f"{self.who}: cannot start replication: {msg}")
            raise TransientError(f"{self.who}: cannot start replication: {msg}",
                                 hint="retried with backoff")

    def _batches(self, conn: Connection, end: int) -> Iterator[list[bytes]]:
        """The replication stream's CopyData frames, in batches of what has
        arrived (at most :data:`FRAMES_PER_BATCH`), so that the decoder is
        called per batch, not per frame."""
        pg = conn.pgconn
        last_data = time.monotonic()
        while True:
            frames: list[bytes] = []
            ended = False
            while len(frames) < FRAMES_PER_BATCH:
                n, data = pg.get_copy_data(1)
                if n == 0:
                    break
                if n < 0:
                    ended = True
                    break
                frames.append(bytes(data))
            if frames:
                last_data = time.monotonic()
                yield frames  # (what came before the end may reach `end`)
            if ended:
                msg = pg.error_message.decode(errors="replace").strip()
                raise TransientError(f"{self.who}: the replication stream ended: {msg}",
                                     hint="the server restarted or the connection broke; "
                                          "retried with backoff")
            if frames:
                continue
            ready, _, _ = select.select([pg.socket], [], [], 1.0)
            if not ready and time.monotonic() - last_data > self.timeout_s:
                raise TransientError(
                    f"{self.who}: the replication stream sent nothing for "
                    f"{self.timeout_s:.0f} s before reaching LSN {lsn_text(end)}",
                    hint="the server may be overloaded; retried")
            pg.consume_input()

    @staticmethod
    def _reply(conn: Connection) -> None:
        """Answer a keepalive (confirming nothing), so that the walsender
        sends the next one when it catches up again."""
        now_us = int(time.time() * 1_000_000)
        conn.pgconn.put_copy_data(po.standby_status(0, 0, 0, now_us))
        conn.pgconn.flush()

    def _stream(self, spec: StreamSpec) -> Iterator[tuple[int, pa.RecordBatch]]:
        params, secrets = parse_dsn(self.dsn, self.who)
        st = _Decoding(self, params, spec)
        conn = self._start(params, secrets, spec.start)
        try:
            yield from self.decode(st, self._batches(conn, spec.end), lambda: self._reply(conn))
        finally:
            with contextlib.suppress(psycopg.Error):
                conn.close()
        yield from st.rest()

    def decode(self, st: _Decoding, batches: Iterable[list[bytes]],
               reply: Callable[[], None]) -> Iterator[tuple[int, pa.RecordBatch]]:
        """Decode the frames of ``batches`` (``'w'`` and ``'k'`` CopyData)
        into ``st``'s outputs, yielding full batches, until a transaction
        commits at or after the task's end (stop before it) or a keepalive
        reports that the walsender has decoded past it; ``reply`` answers a
        keepalive. The rows still held after it are ``st.rest()``. The C
        decoder (:func:`pgoutput.native`) does it where it is built and
        ``native`` is set, the Python parser otherwise: both give the same
        rows (tests/sources/test_pgoutput_native.py)."""
        nat = po.native() if self.native else None
        if nat is None:
            yield from self._decode_python(st, batches, reply)
        else:
            yield from self._decode_native(st, batches, reply, nat)

    def _decode_python(self, st: _Decoding, batches: Iterable[list[bytes]],
                       reply: Callable[[], None]) -> Iterator[tuple[int, pa.RecordBatch]]:
        commit_lsn = 0
        ts: int | None = None
        seq = 0
        for frames in batches:
            for data in frames:
                frame = po.parse_frame(data)
                if isinstance(frame, po.Keepalive):
                    reply()
                    if frame.wal_end >= st.end:
                        return
                    continue
                m = frame.message
                if isinstance(m, po.Begin):
                    if m.final_lsn >= st.end:
                        return  # this and every later transaction commit at or after `end`
                    commit_lsn = m.final_lsn
                    ts = _commit_ms(m.commit_ts)
                    seq = 0
                    continue
                if isinstance(m, po.Relation):
                    yield from st.relation(m, commit_lsn)
                    continue
                if isinstance(m, po.Insert | po.Update | po.Delete):
                    lay = st.layout(m.relid, commit_lsn)
                    if lay is None or commit_lsn < st.snap_at.get(lay.output, 0):
                        seq += 1
                        continue
                    buf = st.bufs[lay.output]
                    self._change(lay, m, buf, commit_lsn, seq, ts)
                    seq += 1
                    if len(buf) >= BATCH_ROWS:
                        yield lay.output, buf.take(binary=True)
                    continue
                if isinstance(m, po.Truncate):
                    st.truncate(m, commit_lsn, seq, ts)
                    seq += 1
                    continue

    def _decode_native(self, st: _Decoding, batches: Iterable[list[bytes]],
                       reply: Callable[[], None], nat: Any
                       ) -> Iterator[tuple[int, pa.RecordBatch]]:
        """As :meth:`_decode_python`, with the C decoder taking Begin,
        Commit and the changes of relations with a layout, and handing
        every other frame back here (keepalives, relation and truncate
        messages, the first change of a relation, and changes the Python
        path turns into errors), handled as the Python path does."""
        dec = st.dec = nat.Decoder(st.end, BATCH_ROWS)
        for frames in batches:
            i = 0
            while True:
                i, kind, obj = dec.feed(frames, i)
                if kind == nat.DONE:
                    break
                if kind == nat.END:
                    return  # a transaction commits at or after `end`
                if kind == nat.FULL:
                    yield obj, st.take(obj)
                    continue
                i += 1
                if isinstance(obj, po.Keepalive):
                    reply()
                    if obj.wal_end >= st.end:
                        return
                    continue
                m = obj.message
                lsn = dec.commit_lsn
                if isinstance(m, po.Relation):
                    yield from st.relation(m, lsn)
                elif isinstance(m, po.Insert | po.Update | po.Delete):
                    lay = st.layout(m.relid, lsn)
                    if lay is None or lsn < st.snap_at.get(lay.output, 0):
                        st.skip(m.relid, lay)
                    else:
                        self._change(lay, m, st.sink(lay.output), lsn, dec.seq, dec.ts)
                    dec.seq += 1
                    if lay is not None and dec.pending(lay.output) >= BATCH_ROWS:
                        yield lay.output, st.take(lay.output)
                elif isinstance(m, po.Truncate):
                    st.truncate(m, lsn, dec.seq, dec.ts)
                    dec.seq += 1
                # (type, origin and logical messages: nothing to do)

    def _layout(self, params: dict[str, Any], i: int, rel: po.Relation) -> _Layout:
        """How the columns of relation message ``rel`` map onto output
        ``i``'s columns: by the names each output column had upstream (its
        history), so that changes written before and after a rename land in
        one column. A name no output column had (a column added, or renamed,
        since the output was described), or a type the output's column
        cannot hold but can widen to, is a shape the output's history lacks:
        :class:`ShapeSeen` re-opens the source, whose describe takes the
        message in (:mod:`reclock.sources.postgres.history`)."""
        t = self.tables[i]
        names = [c.name for c in rel.columns]
        hit = history.find(self.who, t, [c.names or (c.name,) for c in t.columns], names)
        pos = [-1] * len(t.columns)
        for j, k in enumerate(hit):
            if k is not None:
                pos[k] = j
        unknown = [n for n, k in zip(names, hit, strict=True) if k is None]
        if unknown:
            raise self._unseen(i, rel, f"changes carry columns {unknown}, which no column of "
                                       "its output was named")
        if any(j < 0 and not c.gone for c, j in zip(t.columns, pos, strict=True)):
            # A column dropped since the output was described: the describe
            # of the re-open records it and the output's policy decides (a
            # diff log cannot take it: its retractions would not match). A
            # change from before a column was added lacks it too, and is
            # fine: that column still exists.
            now = self._catalog_now(params, rel.relid)
            gone = [c.name for c, j in zip(t.columns, pos, strict=True)
                    if j < 0 and not c.gone and c.upstream not in now]
            if gone:
                raise Reopen(f"{self.who}: table {t.qualified}: columns {gone} were dropped "
                             "upstream")
        other = [(rc.type_oid, rc.type_modifier) for c, j in zip(t.columns, pos, strict=True)
                 if j >= 0 and ((rc := rel.columns[j]).type_oid, rc.type_modifier)
                 != (c.type.oid, c.type.typmod)]
        resolved = self._types_now(params, other) if other else {}
        types = []
        for c, j in zip(t.columns, pos, strict=True):
            if j < 0:
                types.append(c.type)
                continue
            rc = rel.columns[j]
            if rc.type_oid == c.type.oid and rc.type_modifier == c.type.typmod:
                types.append(c.type)
                continue
            new = resolved[(rc.type_oid, rc.type_modifier)]  # (a domain: its base type)
            if widens_to(new.arrow, c.type.arrow):
                types.append(new)
                continue
            if widens(c.type.arrow, new.arrow):
                # widened (now, or for a while: the catalog may not show it)
                raise self._unseen(i, rel, f"column {c.name!r} has type {new.name} "
                                           f"({new.arrow}) in changes, wider than the "
                                           f"output's {c.type.arrow}")
            raise DefiniteError(
                f"{self.who}: table {t.qualified} (output {t.output!r}): column {c.name!r} "
                f"changed type upstream to {new.name} ({new.arrow}), which the output's "
                f"{c.type.arrow} cannot hold and cannot widen to: an incompatible schema "
                "change (no policy stores it)",
                hint="re-read the output in the table's shape now (drop the output and the "
                     "source's state: a new snapshot), or undo the change upstream")
        by_name = {c.name: k for k, c in enumerate(t.columns)}
        key_pos = [pos[by_name[k]] for k in t.key if k in by_name and pos[by_name[k]] >= 0]
        if t.envelope == "upsert" and len(key_pos) != len(t.key):
            raise DefiniteError(f"{self.who}: table {t.qualified}: key columns {list(t.key)} "
                                "are missing from the replicated columns",
                                hint=_identity_hint(t))
        return _Layout(i, t, pos, types, key_pos)

    def _unseen(self, i: int, rel: po.Relation, why: str) -> ShapeSeen:
        """The re-open that hands relation message ``rel`` to the describe."""
        t = self.tables[i]
        exc = ShapeSeen(f"{self.who}: table {t.qualified}: {why}; the output's column "
                        "history takes the table's shape then (re-open)",
                        hint="the output's schema_change policy decides")
        exc.output = i
        exc.shape = (rel.relid, tuple((c.name, c.type_oid, c.type_modifier)
                                      for c in rel.columns))
        return exc

    def _types_now(self, params: dict[str, Any], types: Sequence[tuple[int, int]]
                   ) -> dict[tuple[int, int], PgType]:
        """Types (oid, typmod) as the catalog describes them (see
        :func:`resolve_types`)."""
        try:
            with connect(self.dsn, params, app=f"reclock {self.source}",
                         timeout_s=self.timeout_s) as c:
                return resolve_types(c, types)
        except psycopg.Error as exc:
            raise pg_error(exc, f"{self.who}: cannot read the catalog") from None

    def _catalog_now(self, params: dict[str, Any], relid: int
                     ) -> dict[str, tuple[int, int, int]]:
        """The table's columns now: name -> (column number, type oid, typmod)."""
        try:
            with connect(self.dsn, params, app=f"reclock {self.source}",
                         timeout_s=self.timeout_s) as c:
                rows = c.execute("SELECT attname::text, attnum::int, atttypid::int, atttypmod "
                                 "FROM pg_attribute WHERE attrelid = %s AND attnum > 0 AND NOT "
                                 "attisdropped", (relid,)).fetchall()
        except psycopg.Error as exc:
            raise pg_error(exc, f"{self.who}: cannot read the catalog") from None
        return {str(r[0]): (int(r[1]), int(r[2]), int(r[3])) for r in rows}

    def _change(self, lay: _Layout, m: po.Insert | po.Update | po.Delete,
                buf: _Buffer | _NativeRows,
                lsn: int, seq: int, ts: int | None) -> None:
        t = lay.table
        pos = lay.pos

        def row(tup: po.Tuple) -> list[Any]:
            return [None if j < 0 else tup[j] for j in pos]

        def key_only(tup: po.Tuple) -> list[Any]:
            keep = set(lay.key_pos)
            return [tup[j] if j in keep else None for j in pos]

        full = t.envelope == "none"
        if isinstance(m, po.Insert):
            buf.add(row(m.new), 1, 0, lsn, 2 * seq + 1, ts)
            return
        if isinstance(m, po.Delete):
            if full:
                if m.old_is_key:
                    raise self._no_old(t, "delete", lsn)
                buf.add(row(m.old), -1, 0, lsn, 2 * seq, ts)
            else:
                buf.add(key_only(m.old), 0, 0, lsn, 2 * seq, ts)
            return
        new = m.new
        if full:
            if m.old is None or m.old_is_key:
                raise self._no_old(t, "update", lsn)
            old = m.old
            if any(v is po.UNCHANGED_TOAST for v in new):
                new = tuple(o if v is po.UNCHANGED_TOAST else v
                            for v, o in zip(new, old, strict=True))
            bad = [j for j in pos if j >= 0 and (old[j] is po.UNCHANGED_TOAST
                                                 or new[j] is po.UNCHANGED_TOAST)]
            if bad:
                raise self._toast(t, lay, bad[0], lsn)
            buf.add(row(old), -1, 0, lsn, 2 * seq, ts)
            buf.add(row(new), 1, 0, lsn, 2 * seq + 1, ts)
            return
        # A TOASTed value the update did not change is not sent: the driver's
        # key state fills it from the key's current row.
        unchanged = [i for i, j in enumerate(pos) if j >= 0 and new[j] is po.UNCHANGED_TOAST]
        if unchanged:
            in_key = [j for j in lay.key_pos if new[j] is po.UNCHANGED_TOAST]
            if in_key:
                raise self._toast(t, lay, in_key[0], lsn)
            new = tuple(None if v is po.UNCHANGED_TOAST else v for v in new)
        if m.old is not None and [m.old[j] for j in lay.key_pos] != \
                [new[j] for j in lay.key_pos]:
            buf.add(key_only(m.old), 0, 0, lsn, 2 * seq, ts)  # the key moved
        buf.add(row(new), 1, 0, lsn, 2 * seq + 1, ts, unchanged or None)

    def _no_old(self, t: PgTable, what: str, lsn: int) -> DefiniteError:
        return DefiniteError(
            f"{self.who}: table {t.qualified}: an {what} at LSN {lsn_text(lsn)} came without "
            "its old row; the output is a diff log and needs REPLICA IDENTITY FULL "
            "(it was changed upstream)", hint=_identity_hint(t))

    def _toast(self, t: PgTable, lay: _Layout, j: int, lsn: int) -> DefiniteError:
        col = t.columns[lay.pos.index(j)].name
        return DefiniteError(
            f"{self.who}: table {t.qualified} column {col!r}: an update at LSN "
            f"{lsn_text(lsn)} left a TOASTed value unchanged and the server did not send it "
            "(it is missing from the old row too)", hint=_identity_hint(t))


def _added_with_default(t: PgTable, known: str | None) -> list[str]:
    """Columns of ``t`` (the catalog now) that the output's history
    ``known`` does not have and that have a default: added with one, they
    hold it on every row the table held then, which no change carried (an
    output that has no history yet describes the table for the first time)."""
    if known is None:
        return []
    had = {int(c["attnum"]) for c in json.loads(known)["columns"]}
    return [c.name for c in t.columns if c.attnum not in had and c.has_default]
