"""The remap store on SQLAlchemy 2: SQLite (a file: the embedded default) and
PostgreSQL (psycopg 3), chosen by URL.

Four tables::

    remap_shards       shard (PK) | kind | since | upper (NULL: closed) | updated_at
    remap_bindings     shard, into_time (PK) | frontier: canonical JSON, whole or
                       as the change since the row before (remap_store/delta.py)
    remap_pipeline     key (PK) | value        the pipeline's identity, minted once
    remap_coordinates  shard, name (PK) | coordinate (unique per shard)
                       a multi-topic Kafka source's (topic, partition) -> partition id
    remap_facts        shard, key (PK) | value: JSON text
                       what the shard's bindings depend on: upstream identities
                       (topic ids, table identities), each output's committed state

A store of an earlier version gains the tables it lacks when it is opened
(``create_all`` creates missing tables and leaves existing ones as they are),
and its bindings, all stored whole then, are rewritten as changes once
(``remap_pipeline`` key ``bindings_format``): every frontier reads the same
before and after. A reclock from before that cannot read such a store.

``compare_and_append`` is one transaction whose first statement is the
conditional ``UPDATE remap_shards SET upper = :new WHERE shard = :s AND upper
IS NOT DISTINCT FROM :expected``. That row update is the fence: in PostgreSQL
a concurrent writer blocks on the row lock and then finds its predicate false;
in SQLite the transaction starts with ``BEGIN IMMEDIATE`` and writers
serialize on the database lock. Zero rows updated means someone else moved
the upper: roll back and raise :class:`~reclock.core.errors.UpperMismatch`.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError, ProgrammingError

from reclock.contracts.remap_store import RemapStorePlugin
from reclock.core.bindings import Binding, Bindings, check_appendable
from reclock.core.errors import (
    AlreadyRunning,
    BindingError,
    LockLost,
    LockTaken,
    ShardNotFound,
    SinceViolation,
    TransientError,
    UpperMismatch,
)
from reclock.core.frontier import Antichain
from reclock.core.mint import ReadFrom
from reclock.core.secrets import scrub
from reclock.core.time import TIME_KINDS, IntoTime, encoded_canonical, time_type
from reclock.core.urls import check_url, mask_url, url_secrets
from reclock.remap_store import delta

R = TypeVar("R")

#: How ``remap_bindings.frontier`` holds frontiers: whole or as changes.
BINDINGS_FORMAT = "delta-1"

metadata = sa.MetaData()

shards_table = sa.Table(
    "remap_shards",
    metadata,
    sa.Column("shard", sa.String(255), primary_key=True),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("since", sa.BigInteger, nullable=False),
    sa.Column("upper", sa.BigInteger, nullable=True),
    sa.Column("updated_at", sa.BigInteger, nullable=False),
)

pipeline_table = sa.Table(
    "remap_pipeline",
    metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.String(255), nullable=False),
)

bindings_table = sa.Table(
    "remap_bindings",
    metadata,
    sa.Column("shard", sa.String(255), primary_key=True),
    sa.Column("into_time", sa.BigInteger, primary_key=True),
    sa.Column("frontier", sa.Text, nullable=False),
)


def normalize_url(url: str) -> str:
    """``postgres://`` and ``postgresql://`` use psycopg 3; a bare path is SQLite."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url[len("postgresql://") :]
    if "://" not in url:
        return f"sqlite:///{Path(url).expanduser().resolve()}"
    return url


def redact_url(url: str) -> str:
    """The URL with any password replaced, for logs and errors
    (:func:`reclock.core.urls.mask_url`)."""
    return mask_url(url)


coordinates_table = sa.Table(
    "remap_coordinates",
    metadata,
    sa.Column("shard", sa.String(255), primary_key=True),
    sa.Column("name", sa.String(1024), primary_key=True),
    sa.Column("coordinate", sa.Integer, nullable=False),
    sa.UniqueConstraint("shard", "coordinate", name="remap_coordinates_unique"),
)


facts_table = sa.Table(
    "remap_facts",
    metadata,
    sa.Column("shard", sa.String(255), primary_key=True),
    sa.Column("key", sa.String(1024), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)


def _upper_col(upper: Antichain[IntoTime]) -> int | None:
    u = upper.as_option()
    return None if u is None else int(u)


def _upper_ac(value: int | None) -> Antichain[IntoTime]:
    return Antichain.empty() if value is None else Antichain.from_elem(IntoTime(value))


#: No binding time reaches this: "below" for a closed shard.
_NO_UPPER = 2**63 - 1

# The statements of a tick, built once: building one costs SQLAlchemy more
# than running it on SQLite (100 sources minting every second).
_SHARD = sa.select(shards_table.c.kind, shards_table.c.since, shards_table.c.upper).where(
    shards_table.c.shard == sa.bindparam("s"))
_ROWS = (
    sa.select(bindings_table.c.into_time, bindings_table.c.frontier)
    .where(bindings_table.c.shard == sa.bindparam("s"),
           bindings_table.c.into_time >= sa.bindparam("lo"),
           bindings_table.c.into_time < sa.bindparam("below"))
    .order_by(bindings_table.c.into_time)
)
_FENCE = (
    sa.update(shards_table)
    .where(shards_table.c.shard == sa.bindparam("s"),
           shards_table.c.upper == sa.bindparam("expected"))
    .values(upper=sa.bindparam("new"), updated_at=sa.bindparam("now"))
    .returning(shards_table.c.kind, shards_table.c.since)
)


@dataclass(frozen=True)
class _Tail:
    """A shard's rows below ``upper`` as this store last read or wrote them:
    the last binding, the frontier keyed and the rows since the last whole
    one. Rows below an upper are final (compaction keeps every frontier from
    ``since`` on, and ``since`` stays below the upper), so the next read or
    append from exactly ``upper`` starts here instead of at the last whole
    row; any other start goes back to the rows."""

    kind: str
    upper: int
    last: Binding[Any] | None
    state: delta.State | None
    since_whole: int


def _upper_cols(shard: str, expected_upper: Antichain[IntoTime],
                new_upper: Antichain[IntoTime]) -> tuple[int, int | None]:
    """The two uppers' column values, checked before any transaction: the
    append needs a closed-ended expected upper and an upper that advances."""
    expected = _upper_col(expected_upper)
    new = _upper_col(new_upper)
    if expected is None:
        raise BindingError(f"remap shard {shard!r}: cannot append after the empty upper")
    if new is not None and new <= expected:
        raise BindingError(
            f"remap shard {shard!r}: the upper must advance, got {expected} -> {new}"
        )
    return expected, new


@dataclass(frozen=True)
class _Read:
    """:meth:`SqlRemapStore.read_from`'s rows, read in a transaction: the
    shard's kind, since and upper (None: closed), the cached tail it started
    from (None: from the last whole row) and its chain, and the rows."""

    kind: str
    since: int
    upper: int | None
    tail: _Tail | None
    chain: delta.Chain
    rows: list[tuple[int, str]]


def _follow(kind: str, chain: delta.Chain, rows: list[tuple[int, str]], lower: int,
            last: Binding[Any] | None) -> tuple[list[Binding[Any]], Binding[Any] | None]:
    """``rows`` (time order) applied to ``chain``: the bindings at ``lower`` or
    later, and the last binding (``last`` when there is no row). Only those
    are decoded."""
    new: list[Binding[Any]] = []
    for n, (t, text) in enumerate(rows):
        chain.apply(text)
        if t >= lower or n == len(rows) - 1:
            last = Binding(IntoTime(t), Antichain.decode(kind, chain.elements()))
            if t >= lower:
                new.append(last)
    return new, last


#: SQLite connections a store keeps open (more are opened while needed).
SQLITE_POOL = 128


class SqlRemapStore:
    """:class:`~reclock.contracts.remap_store.RemapStore` on SQLite or PostgreSQL."""

    def __init__(self, url: str, *, poll_interval: float = 0.05, echo: bool = False) -> None:
        self.url = normalize_url(url)
        self._poll = poll_interval
        #: SQLite: this process's writers, one at a time (see :meth:`_tx`)
        self._writer: threading.Lock | None = None
        #: shard -> where its rows ended, as last read or written here, and
        #: before that (an appender reads back from where its append began)
        self._tails: dict[str, tuple[_Tail, ...]] = {}
        parsed = sa.engine.make_url(self.url)
        self.dialect = parsed.get_backend_name()
        if self.dialect == "sqlite":
            db = parsed.database
            if db and db != ":memory:":
                Path(db).parent.mkdir(parents=True, exist_ok=True)
            # Every source's thread may wait for SQLite's one writer at the
            # same time, each with a connection: no cap on them (a file handle
            # each), or a hundred sources would queue for the pool too. Up to
            # SQLITE_POOL of them stay open: sources that tick together open
            # that many at once every interval, and opening one (the file,
            # its pragmas, the schema) under a hundred threads took longer
            # than the reads it served (a read p90 106 -> 52 ms, 100 sources).
            self.engine: Engine = sa.create_engine(
                self.url, echo=echo, pool_size=SQLITE_POOL, max_overflow=-1,
                connect_args={"timeout": 30, "check_same_thread": False}
            )
            _sqlite_immediate_transactions(self.engine)
            self._writer = threading.Lock()
        elif self.dialect == "postgresql":
            self.engine = sa.create_engine(
                self.url,
                echo=echo,
                pool_pre_ping=True,
                # (one connection per source that mints or reads at a time:
                # bounded, for the server's max_connections)
                pool_size=8, max_overflow=24,
                connect_args={"connect_timeout": 10, "application_name": "reclock-remap"},
            )
        else:
            raise BindingError(
                f"unsupported remap store URL {redact_url(self.url)!r}: "
                "use sqlite:///PATH or postgresql://USER@HOST/DB"
            )
        self._retry(self._create_tables)
        self._retry(self._migrate)

    def _create_tables(self) -> None:
        # Two processes opening a new PostgreSQL store at once both find a
        # table missing and both create it: the loser's CREATE fails on the
        # catalog's unique index; the tables exist then, so look again.
        for attempt in range(3):
            try:
                metadata.create_all(self.engine)
                return
            except (IntegrityError, ProgrammingError):
                if attempt == 2:
                    raise
                time.sleep(0.1)

    def _migrate(self) -> None:
        """Bindings stored whole (every store before ``delta-1``) rewritten as
        changes, shard by shard, each in one transaction that holds the
        shard's row (appends and compactions wait)."""
        sel = sa.select(pipeline_table.c.value).where(pipeline_table.c.key == "bindings_format")
        with self._tx(readonly=True) as conn:
            if conn.execute(sel).scalar() == BINDINGS_FORMAT:
                return
        for shard in self.shards():
            with self._tx() as conn:
                conn.execute(sa.update(shards_table).where(shards_table.c.shard == shard)
                             .values(updated_at=shards_table.c.updated_at))  # the row lock
                rows = self._rows(conn, shard, 0)
                w = delta.Writer(None, 0)
                for (t, old), (_t, enc) in zip(rows, delta.decode(rows), strict=True):
                    new = w.text(enc)
                    if new != old:
                        conn.execute(sa.update(bindings_table).where(
                            bindings_table.c.shard == shard, bindings_table.c.into_time == t
                        ).values(frontier=new))
        with self._tx() as conn:
            conn.execute(self._insert_ignore(pipeline_table),
                         {"key": "bindings_format", "value": BINDINGS_FORMAT})

    def __repr__(self) -> str:
        return f"SqlRemapStore({redact_url(self.url)!r})"

    def _said(self, exc: DBAPIError) -> str:
        """What the database said, scrubbed of the URL's password."""
        return scrub(str(exc.orig), url_secrets(self.url))

    # -- plumbing -------------------------------------------------------------
    def _retry(self, fn: Callable[[], R]) -> R:
        try:
            return fn()
        except OperationalError as exc:
            raise TransientError(
                f"remap store {redact_url(self.url)} unavailable: {self._said(exc)}",
                hint="check that the database is up; reclock retries with backoff",
            ) from exc

    @contextmanager
    def _tx(self, readonly: bool = False) -> Iterator[Connection]:
        """A transaction. Read-only ones see one consistent snapshot: REPEATABLE
        READ in PostgreSQL, a deferred transaction in SQLite (WAL snapshot).

        SQLite has one writer at a time, and a writer that finds the file
        locked polls for it with growing sleeps (the busy handler), so among
        a hundred sources' threads some lose for seconds while newcomers win.
        This process's writers queue on a lock instead, and meet the busy
        handler only against another process (a zombie driver, a CLI)."""
        queue = self._writer if self._writer is not None and not readonly else (
            contextlib.nullcontext())
        with queue, self._transaction(readonly) as conn:
            yield conn

    @contextmanager
    def _transaction(self, readonly: bool) -> Iterator[Connection]:
        try:
            with self.engine.connect() as conn:
                if readonly:
                    conn = (
                        conn.execution_options(
                            isolation_level="REPEATABLE READ", reclock_readonly=True
                        )
                        if self.dialect == "postgresql"
                        else conn.execution_options(reclock_readonly=True)
                    )
                with conn.begin():
                    yield conn
        except OperationalError as exc:
            raise TransientError(
                f"remap store {redact_url(self.url)} unavailable: {self._said(exc)}",
                hint="check that the database is up; reclock retries with backoff",
            ) from exc
        except DBAPIError as exc:
            if getattr(exc, "connection_invalidated", False):
                raise TransientError(
                    f"remap store {redact_url(self.url)} connection lost: {self._said(exc)}"
                ) from exc
            raise

    def _shard_row(self, conn: Connection, shard: str) -> sa.Row[Any]:
        row = conn.execute(sa.select(shards_table).where(shards_table.c.shard == shard)).first()
        if row is None:
            raise ShardNotFound(
                f"remap store {redact_url(self.url)} has no shard {shard!r}",
                hint="the source has not minted any binding yet, or was dropped",
            )
        return row

    def _insert_ignore(self, table: sa.Table) -> Any:
        """INSERT that leaves an existing row with the same key as it is."""
        if self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as pg_insert

            return pg_insert(table).on_conflict_do_nothing()
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert(table).on_conflict_do_nothing()

    # -- the contract -----------------------------------------------------------
    def identity(self) -> str:
        sel = sa.select(pipeline_table.c.value).where(pipeline_table.c.key == "identity")
        with self._tx(readonly=True) as conn:
            found = conn.execute(sel).scalar()
        if found is None:
            with self._tx() as conn:  # two drivers racing: the first insert wins
                conn.execute(self._insert_ignore(pipeline_table),
                             {"key": "identity", "value": uuid.uuid4().hex[:12]})
                found = conn.execute(sel).scalar()
        return str(found)

    def create_shard(self, shard: str, kind: str) -> None:
        time_type(kind)
        with self._tx(readonly=True) as conn:
            existing = conn.execute(
                sa.select(shards_table.c.kind).where(shards_table.c.shard == shard)
            ).first()
        if existing is not None:  # the common case on restart: no write transaction
            if existing.kind != kind:
                raise BindingError(
                    f"remap shard {shard!r} holds {existing.kind} times, not {kind}",
                    hint="a source's kind cannot change; use a new source name",
                )
            return
        with self._tx() as conn:
            row = conn.execute(
                sa.select(shards_table.c.kind).where(shards_table.c.shard == shard)
            ).first()
            if row is None:
                conn.execute(
                    self._insert_ignore(shards_table),
                    {
                        "shard": shard,
                        "kind": kind,
                        "since": 0,
                        "upper": 0,
                        "updated_at": int(time.time() * 1000),
                    },
                )
                row = conn.execute(
                    sa.select(shards_table.c.kind).where(shards_table.c.shard == shard)
                ).first()
            assert row is not None
            if row.kind != kind:
                raise BindingError(
                    f"remap shard {shard!r} holds {row.kind} times, not {kind}",
                    hint="a source's kind cannot change; use a new source name",
                )

    def open_shards(self, kinds: Mapping[str, str]) -> dict[str, Bindings[Any]]:
        """:meth:`create_shard` and then :meth:`read` for many shards (a driver
        starting many sources): one read transaction, plus one write
        transaction that creates every missing shard. A shard of an unknown
        kind, or that exists with another kind, is left out of the result
        (its own :meth:`create_shard` says why)."""
        valid = {shard: kind for shard, kind in kinds.items() if kind in TIME_KINDS}
        with self._tx(readonly=True) as conn:
            have = {str(s) for s in conn.execute(sa.select(shards_table.c.shard)).scalars()}
        missing = [s for s in valid if s not in have]
        if missing:
            now = int(time.time() * 1000)
            with self._tx() as conn:  # a racing creator's rows stay as they are
                conn.execute(self._insert_ignore(shards_table), [
                    {"shard": s, "kind": valid[s], "since": 0, "upper": 0, "updated_at": now}
                    for s in missing])
        out: dict[str, Bindings[Any]] = {}
        with self._tx(readonly=True) as conn:
            rows = {str(r.shard): r for r in conn.execute(sa.select(shards_table))}
            for shard, kind in valid.items():
                row = rows.get(shard)
                if row is not None and row.kind == kind:
                    out[shard] = self._snapshot(conn, row)
        return out

    def shards(self) -> list[str]:
        with self._tx(readonly=True) as conn:
            return list(conn.execute(sa.select(shards_table.c.shard).order_by("shard")).scalars())

    def kind(self, shard: str) -> str:
        with self._tx(readonly=True) as conn:
            return str(self._shard_row(conn, shard).kind)

    def upper(self, shard: str) -> Antichain[IntoTime]:
        with self._tx(readonly=True) as conn:
            return _upper_ac(self._shard_row(conn, shard).upper)

    def since(self, shard: str) -> IntoTime:
        with self._tx(readonly=True) as conn:
            return IntoTime(self._shard_row(conn, shard).since)

    def _rows(self, conn: Connection, shard: str, start: int, upto: int | None = None,
              below: int | None = None) -> list[tuple[int, str]]:
        """``(time, stored text)`` of the rows with ``start <= time``, ``time <=
        upto`` and ``time < below``, in time order (``start`` a whole row's)."""
        q = (
            sa.select(bindings_table.c.into_time, bindings_table.c.frontier)
            .where(bindings_table.c.shard == shard, bindings_table.c.into_time >= start)
            .order_by(bindings_table.c.into_time)
        )
        if upto is not None:
            q = q.where(bindings_table.c.into_time <= upto)
        if below is not None:
            q = q.where(bindings_table.c.into_time < below)
        return [(int(t), str(f)) for t, f in conn.execute(q)]

    def _whole_at_or_before(self, conn: Connection, shard: str, t: int | None) -> int:
        """The time of the last whole row at or before ``t`` (any: None), 0 if none."""
        q = (sa.select(bindings_table.c.into_time)
             .where(bindings_table.c.shard == shard, bindings_table.c.frontier.like("[%"))
             .order_by(bindings_table.c.into_time.desc()).limit(1))
        if t is not None:
            q = q.where(bindings_table.c.into_time <= t)
        found = conn.execute(q).scalar()
        return 0 if found is None else int(found)

    def read(self, shard: str, as_of: int | None = None) -> Bindings[Any]:
        with self._tx(readonly=True) as conn:
            row = self._shard_row(conn, shard)
            upper = _upper_ac(row.upper)
            if as_of is not None:
                if as_of < row.since:
                    raise SinceViolation(
                        f"remap shard {shard!r}: as_of {as_of} is below since {row.since}",
                        hint="history before since was compacted",
                    )
                if row.upper is None or as_of + 1 < row.upper:
                    upper = _upper_ac(as_of + 1)
            return self._snapshot(conn, row, as_of, upper)

    def _snapshot(self, conn: Connection, row: sa.Row[Any], as_of: int | None = None,
                  upper: Antichain[IntoTime] | None = None) -> Bindings[Any]:
        """The shard of ``row`` as :meth:`read` gives it (``upper``: the
        shard's unless given)."""
        # an upper of 0 (a new shard) holds no binding: binding times < upper
        times, log = delta.build(row.kind, [] if row.upper == 0 else
                                 self._rows(conn, row.shard, 0, as_of, row.upper))
        return Bindings.from_log(row.kind, times, log, since=row.since,
                                 upper=_upper_ac(row.upper) if upper is None else upper)

    def read_encoded(self, shard: str) -> tuple[str, int, int | None, list[tuple[int, Any]]]:
        """The shard as :meth:`read` gives it with each frontier left in
        :meth:`Antichain.encode`'s form (canonical order), not decoded:
        ``(kind, since, upper (None: closed), [(time, frontier), ...])``, to
        be shown (``reclock bindings``: at 2,048 partitions, decoding and
        validating the frontiers was most of it)."""
        with self._tx(readonly=True) as conn:
            row = self._shard_row(conn, shard)
            rows = [] if row.upper == 0 else self._rows(conn, shard, 0, below=row.upper)
        canonical = encoded_canonical(row.kind)
        return (str(row.kind), int(row.since), None if row.upper is None else int(row.upper),
                [(t, canonical(enc)) for t, enc in delta.decode(rows)])

    def read_from(
        self, shard: str, lower: int
    ) -> tuple[list[Binding[Any]], Antichain[IntoTime], IntoTime]:
        with self._tx(readonly=True) as conn:
            got = self._read_from_in(conn, shard, lower)
        return self._read_from_done(shard, lower, got)

    def _read_from_in(self, conn: Connection, shard: str, lower: int) -> _Read:
        """:meth:`read_from`'s statements, in ``conn``'s transaction."""
        row = conn.execute(_SHARD, {"s": shard}).first()
        if row is None:
            self._shard_row(conn, shard)  # raises
        assert row is not None
        below = _NO_UPPER if row.upper is None else int(row.upper)
        tail = self._tail_at(shard, lower, str(row.kind))
        if tail is not None:
            chain = delta.Chain(tail.state, tail.since_whole)
            start = lower
        else:
            tail, chain = None, delta.Chain()
            start = self._whole_at_or_before(conn, shard, lower) if lower > 0 else 0
        rows = [(int(t), str(f)) for t, f in
                conn.execute(_ROWS, {"s": shard, "lo": start, "below": below})]
        return _Read(str(row.kind), int(row.since),
                     None if row.upper is None else int(row.upper), tail, chain, rows)

    def _read_from_done(
        self, shard: str, lower: int, got: _Read
    ) -> tuple[list[Binding[Any]], Antichain[IntoTime], IntoTime]:
        """:meth:`read_from`'s result from its statements' rows, after the
        transaction; the shard's tail kept for the next read or append."""
        tail = got.tail
        new, last = _follow(got.kind, got.chain, got.rows, lower,
                            None if tail is None else tail.last)
        if got.upper is None:
            self._tails.pop(shard, None)
        elif got.rows or tail is not None:
            self._keep(shard, _Tail(got.kind, got.upper, last, got.chain.state(),
                                    got.chain.since_whole))
        return new, _upper_ac(got.upper), IntoTime(got.since)

    def compare_and_append(
        self,
        shard: str,
        bindings: Sequence[Binding[Any]],
        expected_upper: Antichain[IntoTime],
        new_upper: Antichain[IntoTime],
    ) -> None:
        cols = _upper_cols(shard, expected_upper, new_upper)
        with self._tx() as conn:
            done = self._append_in(conn, shard, bindings, expected_upper, new_upper, cols)
        self._append_done(shard, bindings, cols[1], done)

    def append_and_read_from(
        self,
        shard: str,
        bindings: Sequence[Binding[Any]],
        expected_upper: Antichain[IntoTime],
        new_upper: Antichain[IntoTime],
    ) -> tuple[bool, ReadFrom]:
        """One transaction when the append succeeds: the fence holds the
        shard (SQLite's write lock, PostgreSQL's row lock on the shard, which
        a compaction also takes), so the read sees exactly the shard as this
        append left it. A lost race reads in a transaction of its own (in
        PostgreSQL's read committed a read beside no lock could see a
        compaction halfway)."""
        cols = lower, new = _upper_cols(shard, expected_upper, new_upper)
        try:
            with self._tx() as conn:
                done = self._append_in(conn, shard, bindings, expected_upper, new_upper, cols)
                got = self._read_from_in(conn, shard, lower)
        except UpperMismatch:
            return False, self.read_from(shard, lower)
        self._append_done(shard, bindings, new, done)
        return True, self._read_from_done(shard, lower, got)

    def _append_in(self, conn: Connection, shard: str, bindings: Sequence[Binding[Any]],
                   expected_upper: Antichain[IntoTime], new_upper: Antichain[IntoTime],
                   cols: tuple[int, int | None]) -> tuple[str, _Tail, Any]:
        """:meth:`compare_and_append`'s statements, in ``conn``'s transaction
        (``cols``: the uppers' column values): ``(kind, the tail appended
        after, the writer)``."""
        expected, new = cols
        row = conn.execute(_FENCE, {"s": shard, "expected": expected, "new": new,
                                    "now": int(time.time() * 1000)}).first()
        if row is None:
            self._tails.pop(shard, None)
            raise UpperMismatch(shard, expected_upper,
                                _upper_ac(self._shard_row(conn, shard).upper))
        tail = (self._tail_at(shard, expected, str(row.kind))
                or self._tail_of(conn, shard, str(row.kind), expected))
        last = [] if tail.last is None else [tail.last]
        since = min([row.since, *(int(b.time) for b in last)])
        # Validates kinds, time range, order and monotonicity; raising
        # here rolls the upper move back too.
        check_appendable(
            Bindings(row.kind, last, since=since, upper=expected_upper), bindings, new_upper)
        w = delta.Writer(tail.state, tail.since_whole)
        if bindings:
            conn.execute(
                sa.insert(bindings_table),
                [
                    {
                        "shard": shard,
                        "into_time": int(b.time),
                        "frontier": w.text(b.frontier.encode()),
                    }
                    for b in bindings
                ],
            )
        return str(row.kind), tail, w

    def _append_done(self, shard: str, bindings: Sequence[Binding[Any]], new: int | None,
                     done: tuple[str, _Tail, Any]) -> None:
        """After the append's transaction committed: the next append and the
        read back start at its tail."""
        kind, tail, w = done
        if new is None:
            self._tails.pop(shard, None)
        else:
            self._keep(shard, _Tail(kind, new, bindings[-1] if bindings else tail.last,
                                    w.state, w.since_whole), tail)

    def _tail_at(self, shard: str, upper: int, kind: str) -> _Tail | None:
        for tail in self._tails.get(shard, ()):
            if tail.upper == upper and tail.kind == kind:
                return tail
        return None

    def _keep(self, shard: str, tail: _Tail, before: _Tail | None = None) -> None:
        """``tail`` the shard's latest; ``before`` (else the latest so far) kept too."""
        if before is None:
            before = next(iter(self._tails.get(shard, ())), None)
        self._tails[shard] = (tail,) if before is None or before.upper >= tail.upper else (
            tail, before)

    def _tail_of(self, conn: Connection, shard: str, kind: str, upper: int) -> _Tail:
        """The shard's rows below ``upper`` summed up, from its last whole row."""
        rows = self._rows(conn, shard, self._whole_at_or_before(conn, shard, None), below=upper)
        chain = delta.Chain()
        _none, last = _follow(kind, chain, rows, upper, None)
        return _Tail(kind, upper, last, chain.state(), chain.since_whole)

    def listen(
        self, shard: str, upper: Antichain[IntoTime], timeout: float
    ) -> tuple[list[Binding[Any]], Antichain[IntoTime]]:
        deadline = time.monotonic() + timeout
        lower = _upper_col(upper)
        delay = self._poll
        while True:
            if lower is None:
                return [], upper
            new, current, _since = self.read_from(shard, lower)
            if current != upper:
                return new, current
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return [], upper
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 1.0)

    def compact(self, shard: str, new_since: int) -> int:
        self._tails.pop(shard, None)
        with self._tx() as conn:
            row = self._shard_row(conn, shard)
            if new_since <= row.since:
                return 0
            if row.upper is not None and new_since >= row.upper:
                raise SinceViolation(
                    f"remap shard {shard!r}: since {new_since} must stay below the upper "
                    f"{row.upper}"
                )
            res = conn.execute(
                sa.update(shards_table)
                .where(shards_table.c.shard == shard, shards_table.c.since == row.since)
                .values(since=new_since)
            )
            if res.rowcount != 1:
                return 0  # a concurrent compaction got there first
            # The consolidated head is the frontier of the last row at or
            # before new_since, whole: the rows from the last whole one on
            # give it (at most delta.CHECKPOINT of them, not the history).
            at = bindings_table.c.into_time <= new_since
            head = self._rows(conn, shard, self._whole_at_or_before(conn, shard, new_since),
                              upto=new_since)
            gone = conn.execute(
                sa.delete(bindings_table).where(bindings_table.c.shard == shard, at)).rowcount
            if not head:
                return gone
            chain = delta.Chain()
            for _t, text in head:
                chain.apply(text)
            whole = encoded_canonical(row.kind)(chain.elements())
            conn.execute(sa.insert(bindings_table), [{
                "shard": shard, "into_time": new_since,
                "frontier": json.dumps(whole, separators=(",", ":"))}])
            return gone - 1

    def coordinates(self, shard: str, names: Sequence[str] = ()) -> dict[str, int]:
        """Dense ids for the coordinates of a partitioned FromTime
        (:meth:`RemapStore.coordinates`)."""
        sel = sa.select(coordinates_table.c.name, coordinates_table.c.coordinate).where(
            coordinates_table.c.shard == shard)
        with self._tx(readonly=True) as conn:
            known = {str(n): int(c) for n, c in conn.execute(sel)}
        if all(n in known for n in names):
            return known
        with self._tx() as conn:  # serialized: SQLite's BEGIN IMMEDIATE, Postgres' lock below
            if self.dialect == "postgresql":
                # one assigner at a time per shard (a zombie driver included)
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext(:k))"),
                             {"k": "reclock-coordinates:" + shard})
            known = {str(n): int(c) for n, c in conn.execute(sel)}
            nxt = max(known.values(), default=-1) + 1
            new = []
            for n in dict.fromkeys(names):
                if n not in known:
                    known[n] = nxt
                    new.append({"shard": shard, "name": n, "coordinate": nxt})
                    nxt += 1
            if new:
                conn.execute(sa.insert(coordinates_table), new)
        return known

    def facts(self, shard: str) -> dict[str, str]:
        sel = sa.select(facts_table.c.key, facts_table.c.value).where(
            facts_table.c.shard == shard)
        with self._tx(readonly=True) as conn:
            return {str(k): str(v) for k, v in conn.execute(sel)}

    def put_facts(self, shard: str, facts: Mapping[str, str | None]) -> None:
        if not facts:
            return
        gone = [k for k, v in facts.items() if v is None]
        rows = [{"shard": shard, "key": k, "value": v} for k, v in facts.items() if v is not None]
        if self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as upsert
        else:
            from sqlalchemy.dialects.sqlite import insert as upsert  # type: ignore[assignment]
        with self._tx() as conn:
            if gone:
                conn.execute(sa.delete(facts_table).where(
                    facts_table.c.shard == shard, facts_table.c.key.in_(gone)))
            if rows:
                ins = upsert(facts_table)
                conn.execute(ins.on_conflict_do_update(
                    index_elements=["shard", "key"], set_={"value": ins.excluded.value}), rows)

    def drop_shard(self, shard: str) -> None:
        self._tails.pop(shard, None)
        with self._tx() as conn:
            conn.execute(sa.delete(bindings_table).where(bindings_table.c.shard == shard))
            conn.execute(sa.delete(coordinates_table).where(coordinates_table.c.shard == shard))
            conn.execute(sa.delete(facts_table).where(facts_table.c.shard == shard))
            conn.execute(sa.delete(shards_table).where(shards_table.c.shard == shard))

    def lock_driver(self, holder: dict[str, Any]) -> PgDriverLock | None:
        """PostgreSQL: a session advisory lock keyed on the pipeline's
        identity, on a connection of its own held until the release
        (:class:`PgDriverLock`); the holder's record goes to
        ``remap_pipeline`` (key ``driver``) for the refusal message. The
        server drops the lock with the session, so a killed driver's lock
        goes when its connection does, and so does a running driver's when
        the server restarts: :meth:`PgDriverLock.check` notices and takes it
        again. SQLite: ``None`` (the file lives with the state, whose lock
        covers it)."""
        if self.dialect != "postgresql":
            return None
        lock = PgDriverLock(self, f"reclock-driver:{self.identity()}", holder)
        lock.take(retry=True)
        return lock

    def driver_record(self) -> dict[str, Any] | None:
        """What the driver that last took the pipeline's lock recorded
        about itself (pid, host, since), if it can be read."""
        sel = sa.select(pipeline_table.c.value).where(pipeline_table.c.key == "driver")
        with self._tx(readonly=True) as tx:
            raw = tx.execute(sel).scalar()
        try:
            rec = json.loads(raw) if raw else None
        except ValueError:
            rec = None
        return rec if isinstance(rec, dict) else None

    def close(self) -> None:
        self.engine.dispose()


class PgDriverLock:
    """A PostgreSQL remap store's driver lock (:meth:`SqlRemapStore.lock_driver`):
    ``pg_try_advisory_lock`` on a session of its own, held for the driver's
    life. The lock lives exactly as long as that session, so :meth:`check`
    asks the session (``SELECT 1``); a session that is gone (the server
    restarted, a network cut ended it) took the lock with it, and
    :meth:`check` takes it again on a new session, unless another driver
    holds it by then: that one keeps it (:class:`LockTaken`, naming it from
    the record it wrote)."""

    def __init__(self, store: SqlRemapStore, key: str, holder: dict[str, Any]) -> None:
        self.store = store
        self.key = key
        self.holder = holder
        self.where = f"advisory lock in the remap store {redact_url(store.url)}"
        self._conn: Connection | None = None
        self._lost: str | None = None  # why it was lost, while it is not held
        self._mu = threading.Lock()

    def take(self, retry: bool = False) -> None:
        """Take the lock on a new session and record the holder; raises
        :class:`AlreadyRunning` when another session holds it."""
        engine = self.store.engine
        conn = (self.store._retry(engine.connect) if retry else engine.connect()
                ).execution_options(isolation_level="AUTOCOMMIT")
        try:
            taken = conn.execute(sa.text("SELECT pg_try_advisory_lock(hashtextextended(:k, 0))"),
                                 {"k": self.key}).scalar()
        except BaseException:
            conn.close()
            raise
        if not taken:
            conn.close()
            raise AlreadyRunning(self.store.driver_record(), self.where)
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        value = json.dumps(self.holder, sort_keys=True)
        try:
            with self.store._tx() as tx:
                ins = pg_insert(pipeline_table).values(key="driver", value=value)
                tx.execute(ins.on_conflict_do_update(index_elements=["key"],
                                                     set_={"value": value}))
        except BaseException:
            self._close(conn)
            raise
        self._conn = conn

    def check(self) -> str | None:
        """See :meth:`reclock.contracts.remap_store.StoreLock.check`."""
        with self._mu:
            conn = self._conn
            if conn is not None:
                try:
                    conn.execute(sa.text("SELECT 1")).scalar()
                    return None  # the session lives, and the lock with it
                except Exception as exc:
                    self._conn = None
                    self._close(conn)
                    self._lost = f"its session ended ({_first_line(exc)})"
            why = self._lost or "it was released"
            try:
                self.take()
            except AlreadyRunning as exc:
                if exc.holder == self.holder:
                    # Our own record: the server still keeps the old session
                    # (it has not noticed the connection is gone yet).
                    raise LockLost(self.where, f"{why}; the server still holds it for the "
                                   "old session") from None
                raise LockTaken(exc.holder, self.where, why) from None
            except Exception as exc:
                raise LockLost(self.where, f"{why}; it cannot be taken again yet "
                               f"({_first_line(exc)})") from exc
            self._lost = None
            return why

    def release(self) -> None:
        with self._mu:
            conn, self._conn = self._conn, None
            if conn is not None:
                # Unlock first: closing the session drops the lock too, but
                # the server notices the closed connection a moment later, and
                # a driver started right after this one ends would be refused.
                with contextlib.suppress(Exception):
                    conn.execute(sa.text("SELECT pg_advisory_unlock(hashtextextended(:k, 0))"),
                                 {"k": self.key})
                self._close(conn)

    @staticmethod
    def _close(conn: Connection) -> None:
        # Close the session itself (not back to the pool, where it would
        # keep the lock): the server drops the lock with it.
        with contextlib.suppress(Exception):
            conn.invalidate()
        with contextlib.suppress(Exception):
            conn.close()


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _wal(cur: Any) -> None:
    """The database file in WAL mode (a property of the file: set once). Two
    connections converting a new file at once: the loser's PRAGMA fails with
    "database is locked" at once, whatever the busy timeout, so look again."""
    import sqlite3

    for attempt in range(50):
        try:
            if str(cur.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
                return
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == 49:
                raise
            time.sleep(0.02 * (attempt + 1))


def _sqlite_immediate_transactions(engine: Engine) -> None:
    """Let SQLAlchemy, not pysqlite, begin transactions, and begin them with
    ``BEGIN IMMEDIATE`` so that writers take the write lock up front instead
    of failing to upgrade a read lock mid-transaction; WAL lets readers go on."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA busy_timeout=30000")
        _wal(cur)
        cur.execute("PRAGMA synchronous=FULL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        readonly = conn.get_execution_options().get("reclock_readonly", False)
        conn.exec_driver_sql("BEGIN" if readonly else "BEGIN IMMEDIATE")


def _checked(url: str) -> str:
    """A PostgreSQL URL reads alike everywhere (:func:`~reclock.core.urls.check_url`);
    a SQLite URL names a file, any path."""
    head = url.split("://", 1)[0]
    if head.split("+", 1)[0].lower() != "sqlite":
        check_url(url, (head.lower(),), what="the remap store URL", host_required=False,
                  path_slashes=False, example="host:5432/dbname")
    return url


def _resolved(url: str, base: Path) -> str:
    """A relative ``sqlite:///`` path resolved against ``base``."""
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        rest = url[len("sqlite:///"):]
        if rest and rest != ":memory:":
            return f"sqlite:///{os.path.abspath(base / Path(rest).expanduser())}"
    return url


PLUGIN = RemapStorePlugin(
    name="sql", schemes=("sqlite", "postgresql", "postgres"), open=SqlRemapStore,
    check=_checked, resolve=_resolved,
    examples=("sqlite:///path", "postgresql://user@host/db"))
