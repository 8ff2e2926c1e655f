"""MariaDB CDC source: the binary log in ROW format; FromTime is the GTID position.

Every transaction ``domain-server-seq`` is one point ``(domain, seq)`` of a
:class:`~reclock.core.time.Gtid` frontier (:mod:`reclock.sources.mysql.gtid`),
so its rows share one IntoTime. One output per table. Driver side
(:class:`MySqlSource`)::

    open(...)      check the server (MariaDB, log_bin, binlog_format=ROW, full
                   row images and metadata, the user's privileges), describe
                   the tables; for outputs that hold nothing yet, take the
                   snapshot position S (a consistent read's binlog position,
                   as a GTID position); refuse to resume from a position whose
                   binlog was purged
    probe()        @@gtid_binlog_pos
    plan(lo, hi)   one binlog task for [lo, hi) (transactions in binlog order),
                   or, with more than max_job transactions, for the first
                   max_job of them (each domain's backlog cut in proportion),
                   plus, in the job that covers S, the snapshot's chunk tasks
                   (primary key ranges, in parallel)
    acknowledge(f) nothing upstream holds data for reclock (the server purges
                   its binlogs by its own retention)

Executor side (:class:`MySqlReader`), deterministic per task:

* **Binlog range** ``[lo, hi)``: a replica connection (COM_BINLOG_DUMP with
  ``@slave_connect_state`` = ``lo``) reads transactions in binlog order and
  keeps those before ``hi``; it stops once it has read the last one before
  ``hi`` in every domain (or a later one of the domain). ``hi`` was
  ``@@gtid_binlog_pos`` at some point P of the binlog, so every transaction
  before P is before ``hi`` and none after: the task stops at P. A cut job's
  ``hi`` is no binlog position: the task skips transactions past it in one
  domain while it still needs some of another.
* **Snapshot chunk**: MariaDB cannot share one consistent read between
  connections, so each chunk reads its key range under a consistent read of
  its own (``START TRANSACTION WITH CONSISTENT SNAPSHOT``) at binlog position
  G >= S, and then *undoes* the range's changes between S and G, read from
  the binlog (row images are full: every change carries its before image),
  newest first. Every chunk so yields its rows exactly as of S, on any retry.

The hand-off: a snapshot at binlog point Q holds exactly the transactions
before Q, whose GTID position is S. Its rows are stamped at the point of the
last transaction x before Q in the binlog (its GTID event, found with SHOW
BINLOG EVENTS: :func:`last_transaction`), in whichever domain.
Every binding is ``@@gtid_binlog_pos`` read at one point P of the binlog
(transactions before P: before the binding's frontier, in every domain), so
a binding passes x exactly when its P is at or after Q: the rows take the
IntoTime of the first binding past Q, every transaction the snapshot holds
(before x) has that IntoTime or an earlier one, and every transaction after Q
that IntoTime or a later one. For the snapshot's outputs the stream drops
every transaction before S.

Schema changes are seen in the row events' table maps: a column added or
dropped upstream re-opens the source, whose output's ``schema_change``
policy takes it (:mod:`reclock.core.schema_change`). Each output keeps its
table's column history with the source's state (``my:<output>``): a dropped
column stays in the output, read from the changes written before the drop
(after a restart too), null from then on. The binlog names columns but
numbers none: a rename reads as a drop and an add. A column whose new type
the output cannot hold is a definite error naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import random
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pymysql

from reclock.clients.postgres import scrub
from reclock.contracts.source import Facts, OutputSpec, ReadTask, SnapshotSize, SourceBase
from reclock.core.clock import Clock
from reclock.core.columns import SRC_DIFF, SRC_OFFSET, SRC_PART, SRC_SEQ, SRC_TS, TRUNCATED
from reclock.core.errors import DefiniteError, Reopen, TransientError
from reclock.core.frontier import Antichain
from reclock.core.schema_change import Change, widens
from reclock.core.time import Gtid
from reclock.sources.mysql import gtid
from reclock.sources.mysql.types import (
    MyColumn,
    arrow_array,
    describe_column,
    event_fits,
    normalize,
)
from reclock.sources.mysql.url import parse_url

log = logging.getLogger("reclock.mysql")

#: remap-store fact key prefix of an output's column history
HISTORY_PREFIX = "my:"

#: Rows per output buffered in a task before they become one Arrow batch.
BATCH_ROWS = 50_000
#: Snapshot rows share one position; ``_src_seq`` = chunk * CHUNK_SEQ + row.
CHUNK_SEQ = 1 << 21
MAX_CHUNKS = 1000

_PRIV_HINT = ("GRANT SELECT, REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO the user "
              "(REPLICATION CLIENT is BINLOG MONITOR in MariaDB 10.5+)")


@dataclass(frozen=True)
class MyTable:
    """One replicated table as the catalog describes it."""

    database: str
    name: str
    output: str
    columns: tuple[MyColumn, ...]
    key: tuple[str, ...]  # primary key columns ((): none, a diff log)
    rows_estimate: int

    @property
    def qualified(self) -> str:
        return f"`{self.database}`.`{self.name}`"

    @property
    def envelope(self) -> str:
        return "upsert" if self.key else "none"

    @property
    def arrow_schema(self) -> pa.Schema:
        return pa.schema([pa.field(c.name, c.arrow) for c in self.columns])

    def column(self, name: str) -> MyColumn | None:
        return next((c for c in self.columns if c.name == name), None)


def _ident(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


@dataclass(frozen=True)
class Conn:
    """How to reach the server (picklable); ``who`` names it in messages."""

    settings: tuple[tuple[str, Any], ...]
    secrets: tuple[str, ...]
    who: str
    timeout_s: float

    def connect(self, **extra: Any) -> pymysql.Connection[Any]:
        s = dict(self.settings)
        try:
            return pymysql.connect(
                host=s["host"], port=s["port"], user=s["user"], password=s["password"],
                database=s.get("database"), charset="utf8mb4", autocommit=True,
                connect_timeout=max(1, int(self.timeout_s)),
                init_command="SET time_zone = '+00:00'", **extra)
        except pymysql.Error as exc:
            raise self.error(exc, "cannot connect") from None

    def replica_settings(self) -> dict[str, Any]:
        s = dict(self.settings)
        return {"host": s["host"], "port": s["port"], "user": s["user"],
                "passwd": s["password"], "connect_timeout": max(1, int(self.timeout_s)),
                "read_timeout": max(5, int(self.timeout_s))}

    def error(self, exc: BaseException, doing: str) -> DefiniteError | TransientError:
        """A driver error as a definite or transient one, with a hint."""
        code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
        msg = scrub(str(exc.args[1] if len(exc.args) > 1 else exc), list(self.secrets))
        text = f"{self.who}: {doing}: {msg}"
        if code in (1227, 1142, 1044, 1143):
            return DefiniteError(text, hint=_PRIV_HINT)
        if code == 1045:
            return DefiniteError(text, hint="check the user and password in mysql.url")
        if code == 1236:
            return DefiniteError(text, hint=_PURGED_HINT)
        if code in (1146, 1049):
            return DefiniteError(text, hint="create it, or fix mysql.tables")
        return TransientError(text, hint="retried with backoff")


_PURGED_HINT = ("the binary logs holding the changes since the outputs' position were purged "
                "(binlog_expire_logs_seconds / expire_logs_days, PURGE BINARY LOGS) and the "
                "changes are lost: keep binlogs longer, then drop the source's outputs and "
                "state and start again (a new snapshot)")


def _query(conn: pymysql.Connection[Any], q: str, args: Any = None) -> list[tuple[Any, ...]]:
    with conn.cursor() as cur:
        cur.execute(q, args)
        return list(cur.fetchall())


def snapshot_point(conn: pymysql.Connection[Any]) -> tuple[gtid.Pos, str, int]:
    """In a transaction just started WITH CONSISTENT SNAPSHOT: the GTID
    position its reads see, and the binlog file and offset."""
    status = dict(_query(conn, "SHOW STATUS LIKE 'binlog_snapshot_%'"))
    f, p = str(status["Binlog_snapshot_file"]), int(status["Binlog_snapshot_position"])
    rows = _query(conn, "SELECT BINLOG_GTID_POS(%s, %s)", (f, p))
    return gtid.position(rows[0][0] if rows else ""), f, p


_GTID_EVENT = re.compile(r"GTID (\d+)-\d+-(\d+)")
#: Events per SHOW BINLOG EVENTS read when looking for the last transaction.
EVENTS_WINDOW = 4096


def last_transaction(conn: pymysql.Connection[Any], file: str, pos: int
                     ) -> tuple[int, int] | None:
    """``(domain, seq)`` of the last transaction that starts before offset
    ``pos`` of binlog ``file`` (a transaction boundary), looking in earlier
    files when ``file`` has none before it; None when no binlog the server
    still has holds one."""
    logs = [(str(r[0]), int(r[1])) for r in _query(conn, "SHOW BINARY LOGS")]
    names = [n for n, _ in logs]
    if file not in names:
        return None
    for f, size in reversed(logs[:names.index(file) + 1]):
        found = _last_gtid(conn, f, pos if f == file else size)
        if found is not None:
            return found
    return None


def _last_gtid(conn: pymysql.Connection[Any], f: str, end: int) -> tuple[int, int] | None:
    """The last GTID event of binlog ``f`` before offset ``end``. SHOW
    BINLOG EVENTS ... LIMIT i, n skips the first i events on the server (a
    few million a second) and ships n: the index of the first event at or
    after ``end`` is searched (by interpolation on the events' offsets),
    then windows of events before it are read, newest first."""
    def at(i: int, n: int = 1) -> list[tuple[Any, ...]]:
        return _query(conn, f"SHOW BINLOG EVENTS IN '{f}' LIMIT {i}, {n}")

    lo, lo_pos = 0, 4  # event lo starts before `end` (the first starts at 4)
    hi: int | None = None  # event hi does not (None: not found yet)
    hi_pos = end
    step = 0
    while hi is None or hi - lo > EVENTS_WINDOW:
        # where `end` falls at the mean event size so far, a little past it;
        # every other step halves the interval (the search ends either way)
        per = (hi_pos - lo_pos) / (hi - lo) if hi is not None else (
            lo_pos / lo if lo else 100.0)
        guess = max(lo + 1, lo + int((end - lo_pos) / max(per, 1.0)) + EVENTS_WINDOW // 4)
        if hi is not None:
            guess = min(guess if step % 2 == 0 else (lo + hi) // 2, hi - 1)
        step += 1
        row = at(guess)
        if row and int(row[0][1]) < end:
            lo, lo_pos = guess, int(row[0][1])
        else:
            hi, hi_pos = guess, int(row[0][1]) if row else end
    while hi > 0:
        first = max(0, hi - EVENTS_WINDOW)
        for e in reversed(at(first, hi - first)):
            if int(e[1]) < end and str(e[2]) == "Gtid" and (m := _GTID_EVENT.search(str(e[5]))):
                return int(m.group(1)), int(m.group(2))
        hi = first
    return None


# ---------------------------------------------------------------------------
# Task specs
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamSpec:
    """Transactions in ``[start, end)`` (positions as sorted pairs); for the
    outputs in ``since``, only those at or after their position."""

    start: tuple[tuple[int, int], ...]
    end: tuple[tuple[int, int], ...]
    since: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = ()


@dataclass(frozen=True)
class ChunkSpec:
    """Rows of output ``output`` with the (integer) key in ``[lo, hi)`` (None:
    unbounded) as of GTID position ``at``, stamped at the point ``stamp``
    (``(domain, seq)``: see :class:`_Snapshot`)."""

    output: int
    at: tuple[tuple[int, int], ...]
    stamp: tuple[int, int]
    chunk: int
    lo: int | None
    hi: int | None


def _pairs(pos: gtid.Pos) -> tuple[tuple[int, int], ...]:
    return tuple(sorted(pos.items()))


@dataclass
class _Snapshot:
    """A snapshot at GTID position ``pos`` (binlog point Q) of ``outputs``,
    its rows stamped at ``stamp``: the last transaction before Q in the
    binlog (see the module docstring)."""

    pos: gtid.Pos
    stamp: tuple[int, int]
    outputs: tuple[int, ...]


def default_server_id(source: str, identity: str | None) -> int:
    """The first replica server id of the pipeline and source (never a small
    one an operator is likely to have given a server); each binlog
    connection presents it plus an offset below 1,000,000."""
    h = hashlib.sha256(f"{identity}/{source}".encode()).digest()
    return 1_000_000 + int.from_bytes(h[:4], "big") % 3_000_000_000


class MySqlSource(SourceBase):
    """Driver side (see the module docstring)."""

    kind = Gtid.KIND  # one coordinate per replication domain
    replayable = False  # binlogs are purged by the server's retention
    jobs_in_flight: int | None = 1  # each job reads the binlog in order

    def __init__(self, name: str, url: str, clock: Clock, *,
                 tables: Sequence[tuple[str, str, str]], snapshot: bool = True,
                 server_id: int | None = None, identity: str | None = None,
                 timeout_s: float = 30.0,
                 facts: Facts | None = None,
                 policies: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.clock = clock
        try:
            s = parse_url(url)
        except ValueError as exc:
            raise DefiniteError(f"source {name!r}: mysql.url: {exc}") from None
        self.server = f"{s['host']}:{s['port']}"
        self.who = f"source {name!r} ({self.server})"
        secrets = (s["password"],) if s["password"] else ()
        self.conn_info = Conn(tuple(sorted(s.items())), secrets, self.who, timeout_s)
        self._configured = list(tables)
        self.snapshot = snapshot
        self.server_id = server_id or default_server_id(name, identity)
        self.timeout_s = timeout_s
        self.tables: list[MyTable] = []
        #: each output's column history (see describe), kept with the
        #: source's state when a store is at hand, else in memory
        self._facts = facts
        self._histories: dict[str, str] = {}
        self._policies = dict(policies or {})
        self._changes: dict[str, tuple[Change, ...]] = {}
        self._conn: pymysql.Connection[Any] | None = None
        self._snap: _Snapshot | None = None
        #: per output: drop transactions before this position (snapshot
        #: outputs: S; outputs without a snapshot: the position at open)
        self._since: dict[int, gtid.Pos] = {}
        self._from: gtid.Pos = {}

    def __repr__(self) -> str:
        return f"MySqlSource({self.name!r}, server={self.server!r})"

    # -- connections ---------------------------------------------------------------
    def _connection(self) -> pymysql.Connection[Any]:
        c = self._conn
        if c is not None and c.open:
            return c
        self._conn = self.conn_info.connect()
        return self._conn

    def _close_conn(self) -> None:
        c, self._conn = self._conn, None
        if c is not None:
            with contextlib.suppress(Exception):
                c.close()

    def _query(self, doing: str, q: str, args: Any = None) -> list[tuple[Any, ...]]:
        try:
            return _query(self._connection(), q, args)
        except pymysql.Error as exc:
            self._close_conn()
            raise self.conn_info.error(exc, doing) from None

    # -- outputs -------------------------------------------------------------------
    def describe(self) -> list[MyTable]:
        tables = []
        described: list[list[list[Any]]] = []
        for db, name, out in self._configured:
            cols = self._query(
                f"cannot read the columns of `{db}`.`{name}`",
                "SELECT COLUMN_NAME, DATA_TYPE, COLUMN_TYPE, NUMERIC_PRECISION, NUMERIC_SCALE, "
                "COLUMN_KEY FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = %s AND "
                "TABLE_NAME = %s ORDER BY ORDINAL_POSITION", (db, name))
            if not cols:
                raise DefiniteError(
                    f"{self.who}: table `{db}`.`{name}` does not exist or the user cannot see "
                    "it", hint=f"create it, or GRANT SELECT ON `{db}`.`{name}` TO the user")
            key_rows = self._query(
                "cannot read the primary key",
                "SELECT COLUMN_NAME FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = %s "
                "AND TABLE_NAME = %s AND INDEX_NAME = 'PRIMARY' ORDER BY SEQ_IN_INDEX", (db, name))
            est = self._query("cannot size the table",
                              "SELECT TABLE_ROWS FROM information_schema.TABLES WHERE "
                              "TABLE_SCHEMA = %s AND TABLE_NAME = %s", (db, name))
            now: list[list[Any]] = [
                [str(c[0]), str(c[1]), str(c[2]), None if c[3] is None else int(c[3]),
                 None if c[4] is None else int(c[4])] for c in cols]
            tables.append(MyTable(db, name, out, tuple(describe_column(*c) for c in now),
                                  tuple(str(k[0]) for k in key_rows),
                                  int(est[0][0] or 0) if est else 0))
            described.append(now)
        self.tables = self._with_history(tables, described)
        return self.tables

    def _with_history(self, tables: list[MyTable], described: list[list[list[Any]]]
                      ) -> list[MyTable]:
        """Each table merged with its output's column history (a fact
        ``my:<output>``: the columns it ever had, the dropped ones marked):
        a column dropped upstream stays, so that the changes written before
        the drop are read with its values, also after a restart. MariaDB's
        binlog names columns but numbers none: a rename reads as a drop and
        an add."""
        known = dict(self._facts.read()) if self._facts is not None else dict(self._histories)
        out, updates = [], {}
        for t, now in zip(tables, described, strict=True):
            key = HISTORY_PREFIX + t.output
            text = known.get(key)
            hist: list[list[Any]] = [] if text is None else json.loads(text)["columns"]
            by_name = {c[0]: c for c in now}
            changes: list[Change] = []
            merged: list[list[Any]] = []
            for h in hist:
                cur = by_name.pop(h[0], None)
                if cur is None:
                    if not h[5]:
                        changes.append(Change("dropped", h[0], f"in {t.qualified}"))
                    merged.append([*h[:5], True])
                    continue
                old, new = describe_column(*h[:5]), describe_column(*cur)
                # a narrowing needs nothing: the output's type holds the new values
                merged.append([*(h[:5] if widens(new.arrow, old.arrow) else cur), False])
            merged += [[*c, False] for c in now if c[0] in by_name]
            dropped = [c.column for c in changes]
            if dropped and not t.key:
                raise DefiniteError(
                    f"{self.who}: table {t.qualified}: columns {dropped} were dropped upstream, "
                    "and its output is a diff log (no primary key): a later change's before "
                    "image lacks their values, so its retraction would not match the row the "
                    "output holds", hint="re-read the output in the table's shape now (drop the "
                    "output and the source's state: a new snapshot), or give the table a "
                    "primary key (a keyed output retracts by key)")
            cols = tuple(dataclasses.replace(describe_column(*m[:5]), gone=bool(m[5]))
                         for m in merged)
            out.append(dataclasses.replace(t, columns=cols))
            self._changes[t.output] = tuple(changes)
            fact = json.dumps({"columns": merged})
            if fact != text and not (changes and self._policies.get(t.output) == "fail"):
                updates[key] = fact  # (fail: the changes are reported until taken)
        if updates:
            if self._facts is not None:
                self._facts.write(updates)
            self._histories.update(updates)
        return out

    def outputs(self) -> list[OutputSpec]:
        try:
            return self.current_outputs()
        except (TransientError, DefiniteError):
            return [OutputSpec(out, typed=True) for _, _, out in self._configured]

    def current_outputs(self) -> list[OutputSpec]:
        self.describe()
        return [OutputSpec(t.output, typed=True, schema=t.arrow_schema, key=t.key,
                           envelope=t.envelope, changes=self._changes.get(t.output, ()))
                for t in self.tables]

    def initial_frontier(self) -> Antichain[Gtid]:
        return gtid.INITIAL()

    # -- checks ----------------------------------------------------------------------
    def check_server(self) -> None:
        """Definite errors, with the fix, for a server reclock cannot read."""
        rows = self._query("cannot check the server", "SELECT @@version, @@log_bin, "
                           "@@binlog_format, @@binlog_row_image")
        version, log_bin, fmt, image = rows[0]
        if "mariadb" not in str(version).lower():
            raise DefiniteError(
                f"{self.who}: the server is MySQL {version}; the mysql source reads MariaDB's "
                "GTIDs (domain-server-seq) only",
                hint="use a MariaDB server (MySQL's uuid:interval GTID sets are not supported "
                     "yet)")
        if not int(log_bin or 0):
            raise DefiniteError(f"{self.who}: the binary log is off (log_bin = OFF)",
                                hint="start the server with --log-bin --binlog-format=ROW")
        if str(fmt).upper() != "ROW":
            raise DefiniteError(
                f"{self.who}: binlog_format is {fmt}, not ROW: changes are not logged row by "
                "row", hint="SET GLOBAL binlog_format = 'ROW' (and in the server's "
                            "configuration), then restart the source")
        if str(image).upper() != "FULL":
            raise DefiniteError(
                f"{self.who}: binlog_row_image is {image}, not FULL: updates and deletes do not "
                "carry whole rows", hint="SET GLOBAL binlog_row_image = 'FULL'")
        meta = self._query("cannot check the server", "SHOW VARIABLES LIKE 'binlog_row_metadata'")
        if not meta or str(meta[0][1]).upper() != "FULL":
            have = meta[0][1] if meta else "(not supported: MariaDB before 10.5)"
            raise DefiniteError(
                f"{self.who}: binlog_row_metadata is {have}, not FULL: row events do not name "
                "their columns, enum values and charsets", hint="SET GLOBAL binlog_row_metadata "
                "= 'FULL' (MariaDB 10.5 or later)")
        pos = self._query("cannot check the server", "SELECT @@gtid_binlog_pos")[0][0]
        try:
            gtid.position(pos)
        except DefiniteError as exc:
            raise DefiniteError(f"{self.who}: GTIDs are not usable: {exc}",
                                hint="a MariaDB server with its binary log on") from None
        grants = " ".join(str(r[0]) for r in self._query(
            "cannot read the user's grants", "SHOW GRANTS FOR CURRENT_USER()")).upper()
        missing = [p for p, alts in (("REPLICATION SLAVE", ("REPLICATION SLAVE",)),
                                     ("REPLICATION CLIENT", ("REPLICATION CLIENT",
                                                             "BINLOG MONITOR")))
                   if "ALL PRIVILEGES ON *.*" not in grants and not any(a in grants
                                                                         for a in alts)]
        if missing:
            raise DefiniteError(f"{self.who}: the user lacks {' and '.join(missing)}",
                                hint=_PRIV_HINT)

    def _oldest_binlog_gtids(self) -> gtid.Pos:
        """What the oldest binlog file's Gtid_list says was before it (purged)."""
        logs = self._query("cannot list the binary logs", "SHOW BINARY LOGS")
        if not logs:
            return {}
        events = self._query("cannot read the binary log",
                             f"SHOW BINLOG EVENTS IN '{logs[0][0]}' LIMIT 3")
        for e in events:
            if str(e[2]) == "Gtid_list":
                return gtid.position(str(e[5]).strip("[]"))
        return {}

    def _check_not_purged(self, start: gtid.Pos, what: str) -> None:
        gone = self._oldest_binlog_gtids()
        lost = {d: n for d, n in gone.items() if gtid.nxt(start, d) < n}
        if lost:
            raise DefiniteError(
                f"{self.who}: the binary logs before GTID {gtid.text(lost)} were purged, but "
                f"{what} continue from {gtid.text(start)}", hint=_PURGED_HINT)

    # -- open ------------------------------------------------------------------------
    def open(self, resume: Antichain[Gtid], bound: Antichain[Gtid],
             held: Sequence[Antichain[Gtid] | None] = (),
             resnapshot: Sequence[int] = ()) -> None:
        self.check_server()
        tables = self.tables or self.describe()
        bare = [i for i in range(len(tables))
                if i >= len(held) or held[i] is None or held[i] == gtid.INITIAL()]
        holding = {i: gtid.of(h) for i, h in enumerate(held)
                   if i < len(tables) and i not in bare and h is not None}
        if self._snap is not None and not set(bare) <= set(self._snap.outputs):
            self._snap = None
        now = gtid.position(self._query("cannot probe", "SELECT @@gtid_binlog_pos")[0][0])
        if bare and self._snap is None:
            if self.snapshot:
                pos, stamp = self._take_snapshot()
                self._snap = _Snapshot(pos, stamp, tuple(bare))
                log.info("%s: snapshot at GTID %s (stamped at %d-*-%d) for %s", self.who,
                         gtid.text(pos), *stamp, [tables[i].output for i in bare])
            for i in bare:
                self._since[i] = self._snap.pos if self._snap is not None else now
        self._since = {i: p for i, p in self._since.items() if i in bare}
        starts = [*holding.values(), *(self._since[i] for i in bare)]
        self._from = gtid.meet(starts) if starts else now
        if holding:
            self._check_not_purged(gtid.meet(holding.values()), "the outputs hold data and "
                                                                "must")

    def _take_snapshot(self) -> tuple[gtid.Pos, tuple[int, int]]:
        """The position S of a consistent read, and the point its rows are
        stamped at: the last transaction before it in the binlog."""
        try:
            with self.conn_info.connect() as c:
                _query(c, "START TRANSACTION WITH CONSISTENT SNAPSHOT")
                pos, f, p = snapshot_point(c)
                _query(c, "COMMIT")
                last = last_transaction(c, f, p) if pos else None
        except pymysql.Error as exc:
            raise self.conn_info.error(exc, "cannot take a snapshot") from None
        if last is not None and gtid.nxt(pos, last[0]) == last[1] + 1:
            return pos, last
        # With one domain its last transaction is the last one. With several,
        # the binlogs holding every transaction before S were purged (or a
        # domain's sequence numbers are out of binlog order): a guess.
        d = min(pos, default=0)
        if len(pos) > 1:
            log.warning("%s: the last transaction before the snapshot's GTID %s is not in the "
                        "binary logs (%s); its rows are stamped in domain %d, which may give "
                        "them an IntoTime before some transactions they hold", self.who,
                        gtid.text(pos), "none found" if last is None else f"{last} read", d)
        return pos, (d, gtid.nxt(pos, d) - 1)

    def snapshot_position(self, output: int) -> tuple[int, int] | None:
        snap = self._snap
        if snap is None or output not in snap.outputs:
            return None
        return snap.stamp

    def snapshot_sizes(self) -> dict[int, SnapshotSize]:
        snap = self._snap
        if snap is None:
            return {}
        tables = self.tables
        return {i: SnapshotSize(tables[i].rows_estimate, False,
                                f"{tables[i].database}.{tables[i].name}")
                for i in snap.outputs if i < len(tables)}

    # -- probe -----------------------------------------------------------------------
    def probe(self) -> Antichain[Gtid]:
        rows = self._query("cannot probe", "SELECT @@gtid_binlog_pos")
        return gtid.frontier(gtid.position(rows[0][0]))

    # -- plan ------------------------------------------------------------------------
    def plan(self, lower: Antichain[Gtid], upper: Antichain[Gtid],
             max_task: int, max_job: int) -> tuple[list[ReadTask], Antichain[Gtid]]:
        lo, hi = gtid.of(lower), gtid.of(upper)
        if gtid.le(hi, lo) and upper.less_equal(lower):
            return [], lower
        tasks: list[ReadTask] = []
        snap = self._snap
        start = gtid.join(lo, self._from)
        end, count = self._job_end(start, hi, max_job)
        if end != hi:
            upper = gtid.frontier(end)
        if snap is not None:
            p = Gtid.point(*snap.stamp)
            if lower.less_equal_time(p) and not upper.less_equal_time(p):
                tasks += self._chunk_tasks(snap, max_task)
        if count:
            since = tuple((i, _pairs(p)) for i, p in sorted(self._since.items()))
            tasks.append(ReadTask(self.name, len(tasks),
                                  StreamSpec(_pairs(start), _pairs(end), since), count))
        return tasks, upper

    def _job_end(self, start: gtid.Pos, hi: gtid.Pos, max_job: int) -> tuple[gtid.Pos, int]:
        """Where a job from ``start`` ends, and its transactions: ``hi``, or
        about ``max_job`` transactions further, each domain's backlog cut in
        proportion (the binlog interleaves the domains, so the job's end is
        not a binlog position: its task reads on until it has every
        transaction before it, skipping those after). While the snapshot
        being read holds transactions not read yet (an output that holds
        data is behind it), jobs end at or before S, so that no transaction
        after S reaches the snapshot's outputs before the snapshot's rows."""
        snap = self._snap
        target = dict(hi)
        if snap is not None and not gtid.le(snap.pos, start):
            target = {d: min(n, max(gtid.nxt(snap.pos, d), gtid.nxt(start, d)))
                      for d, n in hi.items()}
        backlog = {d: n - gtid.nxt(start, d) for d, n in target.items()
                   if n > gtid.nxt(start, d)}
        count = sum(backlog.values())
        if count <= max_job:
            return (hi if target == hi else gtid.join(start, target)), count
        share = {d: b * max_job // count for d, b in backlog.items()}
        if not any(share.values()):
            biggest = max(backlog, key=lambda d: backlog[d])
            share[biggest] = 1
        end = gtid.join(start, {d: gtid.nxt(start, d) + n for d, n in share.items()})
        return end, sum(share.values())

    def _chunk_tasks(self, snap: _Snapshot, max_task: int) -> list[ReadTask]:
        out: list[ReadTask] = []
        for i in snap.outputs:
            t = self.tables[i]
            bounds: list[int] = []
            key = t.column(t.key[0]) if len(t.key) == 1 else None
            if key is not None and key.kind == "int" and t.rows_estimate > max_task:
                lo, hi = self._query("cannot read the key range",
                                     f"SELECT MIN({_ident(key.name)}), MAX({_ident(key.name)}) "
                                     f"FROM {t.qualified}")[0]
                n = min(MAX_CHUNKS, -(-t.rows_estimate // max(1, max_task)))
                if lo is not None and hi is not None and n > 1 and hi > lo:
                    step = max(1, -(-(int(hi) - int(lo) + 1) // n))
                    bounds = list(range(int(lo) + step, int(hi) + 1, step))
            edges: list[int | None] = [None, *bounds, None]
            per = max(1, t.rows_estimate // (len(edges) - 1))
            for c in range(len(edges) - 1):
                out.append(ReadTask(self.name, len(out),
                                    ChunkSpec(i, _pairs(snap.pos), snap.stamp, c, edges[c],
                                              edges[c + 1]),
                                    per, snapshot=i))
        return out

    def reader(self) -> MySqlReader:
        return MySqlReader(self.name, self.conn_info, tuple(self.tables), self.server_id)

    # -- acknowledge -----------------------------------------------------------------
    def acknowledge(self, frontier: Antichain[Gtid]) -> bool:
        """Nothing upstream to release; the snapshot's filters go once the
        resumption frontier passes its position in every domain."""
        snap = self._snap
        if snap is not None and not frontier.is_empty() and gtid.le(snap.pos, gtid.of(frontier)):
            self._snap = None
            self._since = {}
            self._from = gtid.of(frontier)
        return True

    def close(self) -> None:
        self._close_conn()


# ---------------------------------------------------------------------------
# Executor side
# ---------------------------------------------------------------------------


@dataclass
class _Buffer:
    """Rows of one output being collected in a task."""

    table: MyTable
    rows: list[list[Any]] = field(default_factory=list)
    diff: list[int] = field(default_factory=list)
    part: list[int] = field(default_factory=list)
    off: list[int] = field(default_factory=list)
    seq: list[int] = field(default_factory=list)
    ts: list[int | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.diff)

    def add(self, row: list[Any], diff: int, part: int, off: int, seq: int,
            ts: int | None) -> None:
        self.rows.append(row)
        self.diff.append(diff)
        self.part.append(part)
        self.off.append(off)
        self.seq.append(seq)
        self.ts.append(ts)

    def take(self) -> pa.RecordBatch:
        t = self.table
        arrays = [arrow_array(c, [r[j] for r in self.rows]) for j, c in enumerate(t.columns)]
        names = [c.name for c in t.columns]
        arrays += [pa.array(self.part, pa.int32()), pa.array(self.off, pa.int64()),
                   pa.array(self.seq, pa.int32()), pa.array(self.ts, pa.int64()),
                   pa.array(self.diff, pa.int64())]
        names += [SRC_PART, SRC_OFFSET, SRC_SEQ, SRC_TS, SRC_DIFF]
        batch = pa.RecordBatch.from_arrays(arrays, names=names)
        self.rows, self.diff, self.part, self.off, self.seq, self.ts = [], [], [], [], [], []
        return batch


@dataclass
class _Txn:
    domain: int
    seq: int
    ts: int
    changes: list[tuple[int, str, list[Any] | None, list[Any] | None]] = field(
        default_factory=list)  # (output, "i"/"u"/"d"/"t", before, after)


_TRUNCATE = re.compile(r"^\s*TRUNCATE\s+(?:TABLE\s+)?(?:`?([^`.\s]+)`?\.)?`?([^`\s;]+)`?",
                       re.I)


@dataclass(frozen=True)
class MySqlReader:
    """Executor side: binlog ranges and snapshot chunks."""

    source: str
    conn: Conn
    tables: tuple[MyTable, ...]
    server_id: int

    @property
    def who(self) -> str:
        return self.conn.who

    def read(self, task: ReadTask) -> Iterator[tuple[int, pa.RecordBatch]]:
        spec = task.spec
        if isinstance(spec, ChunkSpec):
            yield from self._chunk(spec)
        else:
            yield from self._stream(spec)

    # -- binlog ------------------------------------------------------------------------
    def _connect_state(self, start: gtid.Pos) -> str:
        """``start`` as a replica's connect state: the last GTID before it per
        domain, with the server id that wrote it (from @@gtid_binlog_state:
        the server whose last GTID in the domain is the first at or after it)."""
        if not start:
            return ""
        with self.conn.connect() as c:
            state = gtid.parse_gtids(_query(c, "SELECT @@gtid_binlog_state")[0][0])
        out = []
        for d, n in sorted(start.items()):
            last = n - 1
            cands = sorted((seq, srv) for dd, srv, seq in state if dd == d and seq >= last)
            if not cands:
                raise DefiniteError(f"{self.who}: GTID {d}-*-{last} is not in the server's "
                                    "binary logs (they were reset or purged)",
                                    hint=_PURGED_HINT)
            out.append(f"{d}-{cands[0][1]}-{last}")
        return ",".join(out)

    def _transactions(self, start: gtid.Pos, end: gtid.Pos,
                      wanted: set[int] | None = None) -> Iterator[_Txn]:
        """The transactions in ``[start, end)`` in binlog order, with their
        changes to the outputs in ``wanted`` (None: all)."""
        # the last transaction to read per domain (``end`` may not be a binlog
        # position: a cut job's, see _job_end; transactions at or after it
        # are skipped until every domain is done)
        remaining = {d: n - 1 for d, n in end.items() if n > gtid.nxt(start, d)}
        if not remaining:
            return
        from pymysqlreplication import BinLogStreamReader
        from pymysqlreplication.event import (
            HeartbeatLogEvent,
            MariadbGtidEvent,
            QueryEvent,
            XidEvent,
        )
        from pymysqlreplication.row_event import DeleteRowsEvent, UpdateRowsEvent, WriteRowsEvent

        by_name = {(t.database, t.name): i for i, t in enumerate(self.tables)
                   if wanted is None or i in wanted}
        checked: dict[tuple[int, int], dict[str, int]] = {}
        # Every binlog connection presents its own server id: the server ends
        # a dump whose replica's id connects again (a task beside it).
        server_id = self.server_id + random.SystemRandom().randrange(1_000_000)
        stream = BinLogStreamReader(
            self.conn.replica_settings(), server_id=server_id, blocking=True,
            is_mariadb=True, auto_position=self._connect_state(start) or None,
            only_events=[MariadbGtidEvent, WriteRowsEvent, UpdateRowsEvent, DeleteRowsEvent,
                         XidEvent, QueryEvent, HeartbeatLogEvent],
            slave_heartbeat=1, enable_logging=False, freeze_schema=True)
        txn: _Txn | None = None
        seen: dict[int, int] = {}
        skip = False
        last_data = time.monotonic()
        try:
            while True:
                try:
                    ev = stream.fetchone()
                except pymysql.Error as exc:
                    raise self.conn.error(exc, "cannot read the binary log") from None
                if ev is None:
                    raise TransientError(f"{self.who}: the binary log stream ended before "
                                         f"GTID {gtid.text(end)}", hint="retried with backoff")
                if isinstance(ev, HeartbeatLogEvent):
                    if time.monotonic() - last_data > self.conn.timeout_s:
                        raise TransientError(
                            f"{self.who}: the binary log sent nothing for "
                            f"{self.conn.timeout_s:.0f} s before reaching GTID "
                            f"{gtid.text(end)}", hint="retried")
                    continue
                last_data = time.monotonic()
                if isinstance(ev, MariadbGtidEvent):
                    d, n = int(ev.domain_id), int(ev.gtid_seq_no)
                    if n <= seen.get(d, 0):
                        # python-mysql-replication re-requested the stream from
                        # its start after a lost connection: not read twice
                        raise TransientError(f"{self.who}: the binary log connection was lost "
                                             "and restarted", hint="retried with backoff")
                    seen[d] = n
                    if n > remaining.get(d, 1 << 63):
                        remaining.pop(d)  # past the end in this domain (a gap in its seqs)
                        if not remaining:
                            return
                    skip = gtid.before(start, d, n) or not gtid.before(end, d, n)
                    txn = _Txn(d, n, int(ev.timestamp) * 1000)
                    continue
                if txn is None:
                    continue
                if isinstance(ev, WriteRowsEvent | UpdateRowsEvent | DeleteRowsEvent):
                    i = by_name.get((ev.schema, ev.table))
                    if i is None or skip:
                        continue
                    names = self._names(i, ev, checked)
                    t = self.tables[i]
                    for r in ev.rows:
                        if isinstance(ev, WriteRowsEvent):
                            txn.changes.append((i, "i", None, _row(t, names, r["values"])))
                        elif isinstance(ev, DeleteRowsEvent):
                            txn.changes.append((i, "d", _row(t, names, r["values"]), None))
                        else:
                            txn.changes.append((i, "u", _row(t, names, r["before_values"]),
                                                _row(t, names, r["after_values"])))
                    continue
                if isinstance(ev, QueryEvent):
                    q = ev.query if isinstance(ev.query, str) else str(ev.query)
                    m = _TRUNCATE.match(q)
                    if m and not skip:
                        db = m.group(1) or str(ev.schema.decode() if isinstance(
                            ev.schema, bytes) else ev.schema)
                        i = by_name.get((db, m.group(2)))
                        if i is not None:
                            txn.changes.append((i, "t", None, None))
                    if not (q.strip().upper() in ("COMMIT", "XA COMMIT") or _is_ddl(q)):
                        continue  # BEGIN and the like
                # XidEvent, COMMIT, or a DDL statement: the transaction ends
                done = txn
                txn = None
                if not skip:
                    yield done
                if done.seq >= remaining.get(done.domain, 1 << 63):
                    remaining.pop(done.domain, None)
                    if not remaining:
                        return
        finally:
            stream.close()

    def _names(self, i: int, ev: Any, checked: dict[tuple[int, int], dict[str, int]]
               ) -> dict[str, int]:
        """Per output column, its index in the row event (absent: dropped
        upstream); a column the output cannot hold is a definite error, one
        added upstream re-opens the source."""
        key = (i, int(ev.table_id))
        if key in checked:
            return checked[key]
        t = self.tables[i]
        cols = list(ev.columns)
        names = {str(c.name): j for j, c in enumerate(cols)}
        for c in t.columns:
            j = names.get(c.name)
            if j is not None and not event_fits(c, cols[j]):
                raise DefiniteError(
                    f"{self.who}: table {t.qualified} column {c.name!r} changed type upstream "
                    f"(binlog type {int(cols[j].type)}) and the output's {c.arrow} cannot hold "
                    "every value of it", hint="drop and re-create the output (a new snapshot) "
                                              "to take the new type")
        extra = [n for n in names if t.column(n) is None]
        missing = [c.name for c in t.columns if not c.gone and c.name not in names]
        if extra or missing:
            with self.conn.connect() as conn:
                now = {str(r[0]) for r in _query(
                    conn, "SELECT COLUMN_NAME FROM information_schema.COLUMNS WHERE "
                    "TABLE_SCHEMA = %s AND TABLE_NAME = %s", (t.database, t.name))}
            dropped = [n for n in missing if n not in now]
            if dropped:  # (a change from before a column was added lacks it too: fine)
                raise Reopen(f"{self.who}: table {t.qualified}: columns {dropped} were "
                             "dropped upstream; the output's schema_change policy decides")
        if extra:
            added = [n for n in extra if n in now]
            if added:
                raise Reopen(f"{self.who}: table {t.qualified}: columns {added} were added "
                             "upstream; the output's schema_change policy takes them")
            raise DefiniteError(
                f"{self.who}: table {t.qualified}: changes carry columns {extra}, which were "
                "added and dropped (or renamed) upstream before this output described the "
                "table: it has no column for their values",
                hint="re-read the output in the table's shape now (drop the output and its "
                     "state: a new snapshot)")
        out = {c.name: names.get(c.name, -1) for c in t.columns}
        checked[key] = out
        return out

    def _stream(self, spec: StreamSpec) -> Iterator[tuple[int, pa.RecordBatch]]:
        start, end = dict(spec.start), dict(spec.end)
        since = {i: dict(p) for i, p in spec.since}
        bufs = {i: _Buffer(t) for i, t in enumerate(self.tables)}
        for txn in self._transactions(start, end):
            seq = 0
            for i, op, before, after in txn.changes:
                p = since.get(i)
                if p is not None and gtid.before(p, txn.domain, txn.seq):
                    continue
                buf = bufs[i]
                t = self.tables[i]
                at = (txn.domain, txn.seq)
                keyed = bool(t.key)
                if op == "t":
                    if not keyed:
                        raise DefiniteError(
                            f"{self.who}: {t.qualified} truncated at GTID {txn.domain}-*-"
                            f"{txn.seq}: its output is a diff log (no primary key) and cannot "
                            "retract rows it was never sent one by one",
                            hint="drop and re-create the output (a new snapshot), or give the "
                                 "table a primary key")
                    buf.add([None] * len(t.columns), TRUNCATED, *at, seq, txn.ts)
                elif op == "i":
                    assert after is not None
                    buf.add(after, 1, *at, seq, txn.ts)
                elif op == "d":
                    assert before is not None
                    buf.add(_key_only(t, before) if keyed else before, 0 if keyed else -1,
                            *at, seq, txn.ts)
                else:
                    assert before is not None and after is not None
                    if keyed:
                        if _key(t, before) != _key(t, after):
                            buf.add(_key_only(t, before), 0, *at, seq, txn.ts)
                            seq += 1
                        buf.add(after, 1, *at, seq, txn.ts)
                    else:
                        buf.add(before, -1, *at, seq, txn.ts)
                        seq += 1
                        buf.add(after, 1, *at, seq, txn.ts)
                seq += 1
                if len(buf) >= BATCH_ROWS:
                    yield i, buf.take()
        for i, buf in bufs.items():
            if len(buf):
                yield i, buf.take()

    # -- snapshot ----------------------------------------------------------------------
    def _chunk(self, spec: ChunkSpec) -> Iterator[tuple[int, pa.RecordBatch]]:
        t = self.tables[spec.output]
        at = dict(spec.at)
        live = [j for j, c in enumerate(t.columns) if not c.gone]  # dropped ones: null
        cols = ", ".join(_ident(t.columns[j].name) for j in live)
        cond, args = [], []
        key = _ident(t.key[0]) if t.key else ""
        if spec.lo is not None:
            cond.append(f"{key} >= %s")
            args.append(spec.lo)
        if spec.hi is not None:
            cond.append(f"{key} < %s")
            args.append(spec.hi)
        q = f"SELECT {cols} FROM {t.qualified}" + (f" WHERE {' AND '.join(cond)}" if cond else "")
        try:
            with self.conn.connect(cursorclass=pymysql.cursors.SSCursor) as c:
                _query(c, "START TRANSACTION WITH CONSISTENT SNAPSHOT")
                read_at, _, _ = snapshot_point(c)
                with c.cursor() as cur:
                    cur.execute(q, args)
                    rows = []
                    for r in cur:
                        row: list[Any] = [None] * len(t.columns)
                        for j, v in zip(live, r, strict=True):
                            row[j] = normalize(t.columns[j], v)
                        rows.append(row)
                _query(c, "COMMIT")
        except pymysql.Error as exc:
            raise self.conn.error(exc, f"cannot read {t.qualified} (snapshot)") from None
        if not gtid.le(at, read_at):
            raise Reopen(f"{self.who}: the binary log went back behind the snapshot "
                         f"({gtid.text(read_at)} < {gtid.text(at)}); taking a new one")
        if read_at != at:
            rows = self._undo(spec, t, rows, at, read_at)
        # in one order on every retry: by key (a diff log's rows by their text)
        if t.key:
            idx = [next(j for j, c in enumerate(t.columns) if c.name == k) for k in t.key]
            rows.sort(key=lambda r: tuple(r[j] for j in idx))
        else:
            rows.sort(key=repr)
        if len(rows) >= CHUNK_SEQ:
            raise DefiniteError(f"{self.who}: snapshot chunk {spec.chunk} of {t.qualified} "
                                f"holds {len(rows)} rows, more than {CHUNK_SEQ}",
                                hint="lower spark.max_records_per_task")
        p_part, p_off = spec.stamp
        buf = _Buffer(t)
        base = spec.chunk * CHUNK_SEQ
        for j, r in enumerate(rows):
            buf.add(r, 1, p_part, p_off, base + j, None)
            if len(buf) >= BATCH_ROWS:
                yield spec.output, buf.take()
        if len(buf):
            yield spec.output, buf.take()

    def _undo(self, spec: ChunkSpec, t: MyTable, rows: list[list[Any]], at: gtid.Pos,
              read_at: gtid.Pos) -> list[list[Any]]:
        """The chunk's rows read at ``read_at`` taken back to ``at``: its
        changes between them undone, newest first."""
        changes = [ch for txn in self._transactions(at, read_at, {spec.output})
                   for ch in txn.changes if ch[0] == spec.output]

        def inside(r: list[Any] | None) -> bool:
            if r is None or not t.key:
                return r is not None
            k = r[[c.name for c in t.columns].index(t.key[0])]
            return (spec.lo is None or k >= spec.lo) and (spec.hi is None or k < spec.hi)

        if t.key:
            state = {_key(t, r): r for r in rows}
            for _, op, before, after in reversed(changes):
                if op == "t":
                    raise Reopen(f"{self.who}: {t.qualified} was truncated while its snapshot "
                                 "was read; taking a new one")
                if after is not None and inside(after):
                    state.pop(_key(t, after), None)
                if before is not None and inside(before):
                    state[_key(t, before)] = before
            return list(state.values())
        counts: dict[tuple[Any, ...], int] = {}
        for r in rows:
            counts[tuple(r)] = counts.get(tuple(r), 0) + 1
        for _, op, before, after in reversed(changes):
            if op == "t":
                raise Reopen(f"{self.who}: {t.qualified} was truncated while its snapshot was "
                             "read; taking a new one")
            if after is not None:
                counts[tuple(after)] = counts.get(tuple(after), 0) - 1
            if before is not None:
                counts[tuple(before)] = counts.get(tuple(before), 0) + 1
        return [list(r) for r, n in counts.items() for _ in range(max(0, n))]


def _is_ddl(q: str) -> bool:
    return bool(re.match(r"^\s*(ALTER|CREATE|DROP|RENAME|TRUNCATE|GRANT|REVOKE|OPTIMIZE|"
                         r"ANALYZE|REPAIR)\b", q, re.I))


def _row(t: MyTable, names: dict[str, int], values: dict[str, Any]) -> list[Any]:
    vals = list(values.values())
    return [None if (j := names[c.name]) < 0 else normalize(c, vals[j]) for c in t.columns]


def _key(t: MyTable, row: list[Any]) -> tuple[Any, ...]:
    idx = [next(j for j, c in enumerate(t.columns) if c.name == k) for k in t.key]
    return tuple(row[j] for j in idx)


def _key_only(t: MyTable, row: list[Any]) -> list[Any]:
    keys = set(t.key)
    return [v if c.name in keys else None for c, v in zip(t.columns, row, strict=True)]

