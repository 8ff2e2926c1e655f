"""Where a keyed output's key state lives, and how a job's intents reach it
in pieces of bounded size.

The key state (the current row per key of an upsert or keyed CDC output,
:class:`~reclock.runtime.upsert_state.UpsertState`) is kept in a
:class:`KeyStore`:

* :class:`MemoryKeys`, a dictionary: models (``verify``, a replay) and
  drivers without a state directory;
* :class:`SqliteKeys`, a SQLite file beside the pipeline's state: a running
  driver's. Memory stays bounded by SQLite's page cache however many keys
  the output holds, and the file is *reused* across runs when its marker
  says it is the state of exactly the output's committed version; otherwise
  it is rebuilt from the output.

Key state is derived: a damaged file is thrown away and rebuilt, never
repaired or retried. A file is checked when it is opened (SQLite's
``quick_check``, and whether a driver that did not close it left its
``-wal`` file behind), and a store that meets damage later, in a page it
reads or a row that does not decode, raises :class:`KeyStateDamaged` (the
driver then rebuilds it from the output).

Changes are written inside the store's open transaction (:meth:`KeyStore.write`)
and become the state only with :meth:`KeyStore.commit`, after the sink
commit that carries their updates succeeded; :meth:`KeyStore.rollback`
forgets them. A crash between the two leaves a store whose marker is behind
the output: it is rebuilt.

Keys are spread over :data:`KEY_BUCKETS` buckets by a hash of their
canonical form (:func:`key_bucket`). Tasks split their intents by bucket and
write large ones to files (:func:`split_intents`); the driver settles a job
a few buckets at a time (:meth:`KeyedIntents.rounds`), so neither the
intents nor the updates of a transaction of millions of rows are ever all in
memory. Buckets are independent (their keys are disjoint), except where an
update moved a row to another key and took columns it did not send from the
old key's row: tasks report such pairs (``links``) and the driver settles
the two buckets together.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import sqlite3
import threading
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from reclock.core.columns import DIFF, SRC_OFFSET, SRC_PART, SRC_SEQ, SRC_UNCHANGED, TRUNCATED
from reclock.core.errors import DefiniteError, sqlite_damaged

#: How many buckets keys are spread over (fixed: a key's bucket is stored).
KEY_BUCKETS = 64

#: A key store's page cache when it shares no budget (:class:`CacheShares`).
DEFAULT_CACHE = 64 * 2**20

#: ``cleared`` argument of :meth:`KeyStore.write`: every bucket.
ALL = frozenset(range(KEY_BUCKETS))


_NAN = ("reclock:NaN",)


def hashable(v: Any) -> Any:
    """A value's canonical, hashable form for counting rows: lists and maps
    (Arrow list/map/struct values) become tuples, and every float NaN one
    marker (and -0.0 0.0), so that an insertion and its retraction cancel
    however the value was decoded."""
    if isinstance(v, float):
        if v != v:
            return _NAN
        if v == 0.0:
            return 0.0
    if isinstance(v, list):
        return ("reclock:list", *(hashable(x) for x in v))
    if isinstance(v, dict):
        return ("reclock:map", *sorted((str(k), hashable(x)) for k, x in v.items()))
    if isinstance(v, tuple):
        return ("reclock:tuple", *(hashable(x) for x in v))
    return v


def canonical(values: Iterable[Any]) -> str:
    """The canonical form of a key (or a row) from its values: the ``repr`` of
    the tuple of their :func:`hashable` forms. The key store keys rows by it."""
    return repr(tuple(hashable(v) for v in values))


def key_bucket(key: str) -> int:
    """The bucket of a key in its canonical form (:func:`canonical`)."""
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) % KEY_BUCKETS


class KeyStateDamaged(DefiniteError):
    """A key store's file is damaged: a page SQLite cannot read (a
    malformed image, not a database), or a stored row that does not decode.
    The file cannot be trusted any more: it is thrown away and rebuilt from
    the output (retrying the same read would fail the same way)."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"key state file {path} is damaged: {reason}",
                         hint="it is rebuilt from the output; if this repeats, the disk "
                              "under state_dir may be failing (check it, or move state_dir)")


class KeyStore(ABC):
    """The current row of every key (by canonical key), with one open
    transaction of changes (see the module docstring). Any method may raise
    :class:`KeyStateDamaged`: the store is then to be thrown away
    (:meth:`remove`) and rebuilt."""

    #: what the committed state is the state of (None: nothing known)
    marker: str | None = None
    #: why the store threw away what its file held when it was opened (a
    #: damaged file; None: it did not): to report the rebuild that follows
    discarded: str | None = None

    @property
    def location(self) -> str | None:
        """Where the state is kept (a file), for messages; None: in memory."""
        return None

    @abstractmethod
    def lookup(self, keys: Iterable[str]) -> dict[str, tuple[Any, ...]]:
        """The rows of those of ``keys`` that are live (open changes included)."""

    @abstractmethod
    def live(self, buckets: frozenset[int]) -> Iterator[tuple[str, tuple[Any, ...]]]:
        """Every live key of ``buckets`` with its row (open changes included)."""

    @abstractmethod
    def write(self, changes: dict[str, tuple[Any, ...] | None],
              cleared: frozenset[int] = frozenset()) -> None:
        """Open changes: first every key of the buckets ``cleared`` goes, then
        each key of ``changes`` gets its row (``None``: deleted)."""

    @abstractmethod
    def commit(self, marker: str | None) -> None:
        """The open changes become the state, which is now that of ``marker``."""

    @abstractmethod
    def rollback(self) -> None:
        """Forget the open changes."""

    @abstractmethod
    def __len__(self) -> int:
        """How many keys are live (committed)."""

    def net_rows(self, rows: Iterable[list[tuple[str, tuple[Any, ...], int]]]
                 ) -> Iterator[tuple[tuple[Any, ...], int]]:
        """Rebuilding: each distinct row of an update log given in chunks of
        ``(canonical row, row, diff)`` with its net count where not 0 (the
        first row of equal canonical rows stands for them)."""
        net: dict[str, int] = {}
        first: dict[str, tuple[Any, ...]] = {}
        for chunk in rows:
            for h, row, d in chunk:
                net[h] = net.get(h, 0) + d
                first.setdefault(h, row)
        for h, n in net.items():
            if n != 0:
                yield first[h], n

    def reset(self, marker: str | None = None) -> None:
        """No keys (committed at once)."""
        self.rollback()
        self.write({}, ALL)
        self.commit(marker)

    def discard(self) -> None:
        """Throw everything away, committed or not (a file too: a damaged
        one is never read again): no keys, marker unknown."""
        self.reset(None)

    @abstractmethod
    def close(self) -> None:
        """Release what the store holds open."""

    @abstractmethod
    def damage(self) -> None:
        """Damage what the store keeps, as a failing disk would (rehearsing
        one: ``RECLOCK_FAIL_AT=damage_keys``, :mod:`reclock.faults`)."""

    def remove(self) -> None:
        """Close the store and delete what it keeps: a store made anew for
        the same place starts empty. Never raises."""
        with contextlib.suppress(Exception):
            self.close()


class MemoryKeys(KeyStore):
    """A key store in a dictionary (see the module docstring)."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[Any, ...]] = {}
        self._open: dict[str, tuple[Any, ...] | None] = {}
        self._cleared: set[int] = set()

    def lookup(self, keys: Iterable[str]) -> dict[str, tuple[Any, ...]]:
        out = {}
        for k in keys:
            row = self._get(k)
            if row is not None:
                out[k] = row
        return out

    def _get(self, k: str) -> tuple[Any, ...] | None:
        if k in self._open:
            return self._open[k]
        if self._cleared and key_bucket(k) in self._cleared:
            return None
        return self.rows.get(k)

    def live(self, buckets: frozenset[int]) -> Iterator[tuple[str, tuple[Any, ...]]]:
        every = buckets == ALL
        for k, row in self.rows.items():
            if k not in self._open and (every or key_bucket(k) in buckets) and (
                    not self._cleared or key_bucket(k) not in self._cleared):
                yield k, row
        for k, opened in self._open.items():
            if opened is not None and (every or key_bucket(k) in buckets):
                yield k, opened

    def write(self, changes: dict[str, tuple[Any, ...] | None],
              cleared: frozenset[int] = frozenset()) -> None:
        if cleared:
            self._cleared |= cleared
            every = cleared == ALL
            self._open = {k: v for k, v in self._open.items()
                          if not every and key_bucket(k) not in cleared}
        self._open.update(changes)

    def commit(self, marker: str | None) -> None:
        if self._cleared == set(ALL):
            self.rows = {}
        elif self._cleared:
            self.rows = {k: v for k, v in self.rows.items() if key_bucket(k) not in self._cleared}
        for k, row in self._open.items():
            if row is None:
                self.rows.pop(k, None)
            else:
                self.rows[k] = row
        self.rollback()
        self.marker = marker

    def rollback(self) -> None:
        self._open = {}
        self._cleared = set()

    def __len__(self) -> int:
        return len(self.rows)

    def close(self) -> None:
        """A dictionary holds nothing open."""

    def damage(self) -> None:
        """A dictionary keeps nothing a disk could damage."""


_CHUNK = 500  # keys per lookup statement (SQLite allows 32,766 variables)
_PREFIXES = [f"{b:02x}:" for b in range(KEY_BUCKETS)]  # of stored keys, by bucket


class CacheShares:
    """One page-cache budget for the SQLite key stores of a driver, shared
    evenly by the stores open at the time: each gets ``total / n``, at most
    ``most`` and at least ``least`` bytes. SQLite's page cache of a store
    fills as its file grows (an output keyed by a stream of new keys grows
    forever), so without one budget a driver of many keyed outputs would in
    time hold ``n`` full caches. A store takes a changed share up at its next
    transaction (SQLite frees the pages beyond it then)."""

    def __init__(self, total: int, most: int = 64 * 2**20, least: int = 2**20) -> None:
        self.total, self.most, self.least = total, most, least
        self._lock = threading.Lock()
        self._open = 0
        #: bumped whenever the share changes
        self.generation = 0

    def join(self) -> None:
        with self._lock:
            self._open += 1
            self.generation += 1

    def leave(self) -> None:
        with self._lock:
            self._open = max(0, self._open - 1)
            self.generation += 1

    def share(self) -> int:
        """Bytes of page cache each open store may use now."""
        with self._lock:
            n = max(1, self._open)
        return max(self.least, min(self.most, self.total // n))


class ClosedChecksum:
    """The CRC-32 and size of a key file as :meth:`SqliteKeys.close` left
    it, kept beside it (``<file>.sum``) for the next open to compare."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.path = Path(f"{file}.sum")

    def compute(self) -> str:
        """The file's CRC-32 and size, as kept in :attr:`path`."""
        h, n = 0, 0
        buf = bytearray(1 << 20)
        with self.file.open("rb", buffering=0) as f:
            while k := f.readinto(buf):
                h = zlib.crc32(memoryview(buf)[:k], h)
                n += k
        return f"crc32 {h:08x} size {n}\n"

    def take(self) -> bool | str:
        """Whether the file is as it was closed: True when its checksum
        matches, False when there is none to compare with (a crash, a new
        file), else what differs. The checksum is removed: the file changes
        from now on."""
        try:
            kept = self.path.read_text()
        except (OSError, UnicodeDecodeError):
            return False
        self.drop()
        try:
            now = self.compute()
        except FileNotFoundError:
            return False
        if now == kept:
            return True
        return (f"its bytes changed since it was closed (checksum {kept.strip()!r}, now "
                f"{now.strip()!r})")

    def keep(self) -> None:
        """Write the closed file's checksum beside it (atomically)."""
        with contextlib.suppress(OSError):
            tmp = Path(f"{self.path}.tmp")
            tmp.write_text(self.compute())
            os.replace(tmp, self.path)

    def drop(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def read_ahead(path: Path) -> None:
    """Read a file once in order, into the operating system's cache:
    ``quick_check`` reads pages in B-tree order, at random on a cold cache
    (0.8 s for a million keys cold, 0.1-0.2 s after this). Not for a file
    that would not stay in memory (a quarter of it at most)."""
    with contextlib.suppress(OSError, ValueError):
        if path.stat().st_size > os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4:
            return
        buf = bytearray(1 << 20)
        with path.open("rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def damage_pages(conn: sqlite3.Connection, path: Path, nbytes: int) -> None:
    """Overwrite ``nbytes`` of a key file's pages in use with random bytes:
    leaf pages of the keys from the middle of their B-tree (where SQLite
    can list them, ``dbstat``; else the middle of the file, every page
    after the first in a small one)."""
    page = int(conn.execute("PRAGMA page_size").fetchone()[0])
    n = max(1, nbytes // page)
    try:
        leaves = [int(r[0]) for r in conn.execute(
            "SELECT pageno FROM dbstat WHERE name = 'keys' AND pagetype = 'leaf' "
            "ORDER BY pageno")]
    except sqlite3.OperationalError:  # no dbstat in this SQLite
        pages = path.stat().st_size // page
        leaves = list(range(2, pages + 1))
    mid = max(0, len(leaves) // 2 - n // 2)
    with path.open("r+b") as f:
        for no in leaves[mid:mid + n]:
            f.seek((no - 1) * page)
            f.write(os.urandom(page))


class SqliteKeys(KeyStore):
    """A key store in a SQLite file (see the module docstring). Rows are
    pickled, under their key prefixed with its bucket (``"2a:(17,)"``), so
    that one clustered B-tree serves lookups and a bucket's keys are one
    range of it. The transaction stays open from the first :meth:`write` to
    :meth:`commit` or :meth:`rollback`.

    Opening the file checks it; it is replaced by an empty one (marker
    unknown: rebuilt, :attr:`discarded` says why) when it is not a database,
    when its bytes changed since it was closed (:meth:`close` keeps a
    CRC-32 of the closed file beside it, ``<file>.sum``), when it fails
    ``PRAGMA quick_check`` (a page overwritten, the file cut short: the
    check of a file without a checksum, as after a crash), when a driver
    that did not close it left no ``-wal`` file (its last transactions may
    be half in the file), or when it is of another layout. Either check
    reads the whole file: for a million keys (90 MiB) about 0.03 s for the
    checksum and 0.15 s for quick_check with the file in the operating
    system's cache (bench/keystate_check_bench.py). Damage met later raises
    :class:`KeyStateDamaged`."""

    LAYOUT = 2  # PRAGMA user_version of the file

    def __init__(self, path: Path, shares: CacheShares | None = None) -> None:
        self.path = path
        self._sum = ClosedChecksum(path)
        #: the page-cache budget this store shares (given none, one of its
        #: own of :data:`DEFAULT_CACHE`)
        self._shares = shares if shares is not None else CacheShares(DEFAULT_CACHE)
        self._generation = -1
        path.parent.mkdir(parents=True, exist_ok=True)
        self._conn: sqlite3.Connection | None = None
        self.discarded = self._opened()
        self._shares.join()
        self._size_cache()

    @property
    def location(self) -> str:
        return str(self.path)

    @property
    def conn(self) -> sqlite3.Connection:
        assert self._conn is not None, f"key store {self.path} is closed"
        return self._conn

    def _files(self) -> list[Path]:
        return [self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm"), self._sum.path]

    def _opened(self) -> str | None:
        """Open the file, checked (see the class docstring); the reason it
        was replaced by an empty one, or None."""
        # SQLite keeps a -wal file while the database is open and removes it
        # when the last connection closes: a file marked open (by a driver
        # that crashed) without one has lost transactions it had committed,
        # and a checkpoint cut short may have copied part of them.
        wal = Path(f"{self.path}-wal").exists()
        summed: bool | str = False
        if wal:  # opened and not closed since: a checksum beside it is stale
            self._sum.drop()
        else:
            summed = self._sum.take()
        if isinstance(summed, str):
            self._fresh()
            self._mark_open()
            return summed
        why: str | None
        try:
            self._conn = self._open()
            why = None if summed else self._check()
            if why is None and self._get("open") is not None and not wal:
                why = ("a driver that did not close it left no -wal file: the file may hold "
                       "part of its last transactions")
            if why is None:
                self.marker = self._get("marker")
        except sqlite3.DatabaseError as exc:
            if not sqlite_damaged(exc):
                self._close_conn()
                raise
            why = str(exc)
        if why is not None:
            self._fresh()
        self._mark_open()
        return why

    def _check(self) -> str | None:
        """``PRAGMA quick_check``: None when it finds the file sound, else
        what it found (the first few problems)."""
        read_ahead(self.path)
        found = [r[0] for r in self.conn.execute("PRAGMA quick_check(5)")]
        return None if found == ["ok"] else "quick_check: " + "; ".join(found)

    def _fresh(self) -> None:
        """Delete the file (and SQLite's sidecars) and open an empty one."""
        self._close_conn()
        for p in self._files():
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        self._conn = self._open()
        self.marker = None
        self._generation = -1

    def _mark_open(self) -> None:
        """Mark the file open (see :meth:`_opened`), checkpointed: the mark is
        in the file itself, not only in its -wal file. :meth:`close` removes it."""
        with self._guard():
            self.conn.execute("INSERT OR REPLACE INTO meta (k, v) VALUES ('open', ?)",
                              (str(os.getpid()),))
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _get(self, k: str) -> str | None:
        row = self.conn.execute("SELECT v FROM meta WHERE k = ?", (k,)).fetchone()
        return None if row is None else str(row[0])

    def _close_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """SQLite's errors of a damaged file as :class:`KeyStateDamaged`."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            if sqlite_damaged(exc):
                raise KeyStateDamaged(self.path, str(exc)) from exc
            raise
        except UnicodeDecodeError as exc:  # a stored key (see _open's text_factory)
            raise KeyStateDamaged(self.path, f"a stored key does not decode: {exc}") from exc

    def _row(self, blob: bytes) -> tuple[Any, ...]:
        """A stored row, unpickled: bytes that do not unpickle are damage
        (SQLite's checks do not read inside a row)."""
        try:
            row = pickle.loads(blob)
        except Exception as exc:
            raise KeyStateDamaged(self.path, f"a stored row does not decode: "
                                             f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(row, tuple):
            raise KeyStateDamaged(self.path, f"a stored row decodes to a {type(row).__name__}")
        return row

    def _size_cache(self) -> None:
        """Take the current share of the budget up, if it changed."""
        if self._shares.generation != self._generation:
            self._generation = self._shares.generation
            self.conn.execute(f"PRAGMA cache_size=-{self._shares.share() // 1024}")

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        # Keys decode strictly, in Python: a damaged key raises UnicodeDecodeError
        # (the default raises an OperationalError of its own, which says less).
        conn.text_factory = functools.partial(str, encoding="utf-8")
        try:
            # A lost file is rebuilt from the output, and a kill -9 leaves the
            # operating system's buffers intact: no fsync is needed.
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=OFF")
            conn.execute("PRAGMA temp_store=FILE")
            if conn.execute("PRAGMA user_version").fetchone()[0] != self.LAYOUT:
                conn.execute("DROP TABLE IF EXISTS keys")
                conn.execute("DROP TABLE IF EXISTS meta")
                conn.execute(f"PRAGMA user_version={self.LAYOUT}")
            conn.execute("CREATE TABLE IF NOT EXISTS keys "
                         "(key TEXT PRIMARY KEY, row BLOB NOT NULL) WITHOUT ROWID")
            conn.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT)")
            conn.execute("SELECT count(*) FROM meta").fetchone()
        except sqlite3.DatabaseError:
            conn.close()
            raise
        return conn

    @staticmethod
    def _stored(key: str) -> str:
        return f"{key_bucket(key):02x}:{key}"

    @staticmethod
    def _stored_all(keys: Iterable[str]) -> list[str]:
        """:meth:`_stored` of each of ``keys`` (inlined: a call per key costs
        as much as the rest)."""
        crc, pre = zlib.crc32, _PREFIXES
        return [pre[crc(k.encode("utf-8", "surrogatepass")) % KEY_BUCKETS] + k for k in keys]

    def _ranges(self, buckets: frozenset[int]) -> Iterator[tuple[str, str]]:
        for b in sorted(buckets):
            yield f"{b:02x}:", f"{b:02x};"  # ';' follows ':'

    def _begin(self) -> None:
        if not self.conn.in_transaction:
            self._size_cache()
            self.conn.execute("BEGIN")

    def lookup(self, keys: Iterable[str]) -> dict[str, tuple[Any, ...]]:
        # in key order: the statements read neighbouring pages of the B-tree
        ks = sorted(self._stored_all(keys))
        found: list[tuple[str, bytes]] = []
        with self._guard():
            for i in range(0, len(ks), _CHUNK):
                part = ks[i:i + _CHUNK]
                q = f"SELECT key, row FROM keys WHERE key IN ({','.join('?' * len(part))})"
                found.extend(self.conn.execute(q, part))
        try:
            rows = [pickle.loads(blob) for _k, blob in found]
        except Exception:  # which one, and why: as _row says
            rows = [self._row(blob) for _k, blob in found]
        if not all(type(row) is tuple for row in rows):
            for row in rows:
                if not isinstance(row, tuple):
                    raise KeyStateDamaged(
                        self.path, f"a stored row decodes to a {type(row).__name__}")
        return {k[3:]: row for (k, _b), row in zip(found, rows, strict=True)}

    def live(self, buckets: frozenset[int]) -> Iterator[tuple[str, tuple[Any, ...]]]:
        with self._guard():
            for lo, hi in ([("", "~")] if buckets == ALL else self._ranges(buckets)):
                cur = self.conn.execute(
                    "SELECT key, row FROM keys WHERE key >= ? AND key < ? ORDER BY key", (lo, hi))
                while batch := cur.fetchmany(10_000):
                    for k, blob in batch:
                        yield k[3:], self._row(blob)

    def write(self, changes: dict[str, tuple[Any, ...] | None],
              cleared: frozenset[int] = frozenset()) -> None:
        with self._guard():
            self._begin()
            if cleared == ALL:
                self.conn.execute("DELETE FROM keys")
            elif cleared:
                self.conn.executemany("DELETE FROM keys WHERE key >= ? AND key < ?",
                                      self._ranges(cleared))
            # in key order: each statement writes next to the one before
            gone = sorted(self._stored_all(k for k, row in changes.items() if row is None))
            if gone:
                self.conn.executemany("DELETE FROM keys WHERE key = ?", ((k,) for k in gone))
            kept = [(k, row) for k, row in changes.items() if row is not None]
            dumps = pickle.dumps
            self.conn.executemany(
                "INSERT OR REPLACE INTO keys (key, row) VALUES (?, ?)",
                sorted(zip(self._stored_all(k for k, _r in kept),
                           [dumps(row, protocol=5) for _k, row in kept], strict=True)))

    def commit(self, marker: str | None) -> None:
        with self._guard():
            self._begin()
            self.conn.execute("INSERT OR REPLACE INTO meta (k, v) VALUES ('marker', ?)",
                              (marker,))
            self.conn.execute("COMMIT")
        self.marker = marker

    def rollback(self) -> None:
        with self._guard():
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")

    def __len__(self) -> int:
        with self._guard():
            return int(self.conn.execute("SELECT count(*) FROM keys").fetchone()[0])

    def net_rows(self, rows: Iterable[list[tuple[str, tuple[Any, ...], int]]]
                 ) -> Iterator[tuple[tuple[Any, ...], int]]:
        """As :meth:`KeyStore.net_rows`, counted in a table of the file
        (dropped after): an output of any size is rebuilt in bounded memory."""
        with self._guard():
            self._begin()
            self.conn.execute("DROP TABLE IF EXISTS net")
            self.conn.execute("CREATE TABLE net (h TEXT PRIMARY KEY, n INTEGER NOT NULL, "
                              "row BLOB NOT NULL) WITHOUT ROWID")
            for chunk in rows:
                self.conn.executemany(
                    "INSERT INTO net (h, n, row) VALUES (?, ?, ?) "
                    "ON CONFLICT (h) DO UPDATE SET n = n + excluded.n",
                    ((h, d, pickle.dumps(row, protocol=5)) for h, row, d in chunk))
            cur = self.conn.execute("SELECT row, n FROM net WHERE n != 0")
            while batch := cur.fetchmany(10_000):
                for blob, n in batch:
                    yield self._row(blob), int(n)
            self.conn.execute("DROP TABLE net")

    def discard(self) -> None:
        """A new, empty file in place of this one (never read again: it may
        be damaged), marked open."""
        self._fresh()
        self._mark_open()
        self._size_cache()

    def reset(self, marker: str | None = None) -> None:
        self.discard()
        self.commit(marker)

    def close(self) -> None:
        """Roll back, mark the file closed (see :meth:`_opened`) and close it
        (SQLite then folds the -wal file into it and removes it); then keep
        the closed file's checksum beside it, for the next open to compare."""
        self._shut(summed=True)

    def _shut(self, summed: bool) -> None:
        if self._conn is None:
            return
        clean = False
        try:
            with contextlib.suppress(sqlite3.Error, KeyStateDamaged):
                self.rollback()
                self.conn.execute("DELETE FROM meta WHERE k = 'open'")
                clean = True
        finally:
            self._close_conn()
            self._shares.leave()
        if summed and clean and not Path(f"{self.path}-wal").exists():
            self._sum.keep()

    def damage(self, nbytes: int = 32 * 1024) -> None:
        """Overwrite ``nbytes`` of pages in use with random bytes (a fault on
        demand, ``damage_keys``; see :func:`damage_pages`). The -wal file is
        folded in first: a page read from there would not show the damage."""
        self.rollback()
        self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        damage_pages(self.conn, self.path, nbytes)
        self.conn.execute("PRAGMA shrink_memory")

    def remove(self) -> None:
        self._shut(summed=False)
        for p in self._files():
            with contextlib.suppress(OSError):
                p.unlink()


# -- intents, split by bucket in the tasks ----------------------------------------------------


@dataclass
class KeyedIntents:
    """One job's intents for one keyed output, by key bucket: tables carried
    in the task result, or paths of Arrow files a task wrote (large ones).
    ``truncates`` are the rows that remove every key: they belong to every
    bucket. ``links`` pair buckets that must be settled together."""

    parts: dict[int, list[pa.Table | str]] = field(default_factory=dict)
    nbytes: dict[int, int] = field(default_factory=dict)
    links: set[tuple[int, int]] = field(default_factory=set)
    truncates: list[pa.Table] = field(default_factory=list)
    #: the last intent in position order: (part, offset, seq, diff, bucket)
    tail: tuple[int, int, int, int, int] | None = None

    @staticmethod
    def merged(each: Iterable[KeyedIntents]) -> KeyedIntents:
        out = KeyedIntents()
        for k in each:
            for b, ps in k.parts.items():
                out.parts.setdefault(b, []).extend(ps)
                out.nbytes[b] = out.nbytes.get(b, 0) + k.nbytes.get(b, 0)
            out.links |= k.links
            out.truncates.extend(k.truncates)
            out.tail = k.tail if k.tail is not None else out.tail
        return out

    def rounds(self, budget: int) -> list[frozenset[int]]:
        """Groups of buckets to settle together: linked buckets always in one
        group; groups packed up to ``budget`` bytes of intents (a group alone
        may exceed it). With truncations, every bucket is settled (each
        loses its keys), the empty ones too, one group at a time: the keys a
        truncation retracts are not counted in the budget."""
        parent = list(range(KEY_BUCKETS))

        def find(b: int) -> int:
            while parent[b] != b:
                parent[b] = parent[parent[b]]
                b = parent[b]
            return b

        for a, b in self.links:
            parent[find(a)] = find(b)
        todo = range(KEY_BUCKETS) if self.truncates else sorted(self.parts)
        groups: dict[int, set[int]] = {}
        for b in todo:
            groups.setdefault(find(b), set()).add(b)
        for a, b in self.links:  # a linked bucket without intents still goes with its pair
            groups.setdefault(find(a), set()).update((a, b))
        rounds: list[frozenset[int]] = []
        cur: set[int] = set()
        size = 0
        for g in sorted(groups.values(), key=min):
            n = sum(self.nbytes.get(b, 0) for b in g)
            if cur and (size + n > budget or self.truncates):
                rounds.append(frozenset(cur))
                cur, size = set(), 0
            cur |= g
            size += n
        if cur:
            rounds.append(frozenset(cur))
        return rounds

    def read(self, buckets: frozenset[int], schema: pa.Schema) -> pa.Table:
        """The intents of ``buckets`` (truncations included)."""
        tables: list[pa.Table] = []
        for b in sorted(buckets):
            for p in self.parts.get(b, []):
                tables.append(p if isinstance(p, pa.Table) else _read_file(p))
        tables.extend(self.truncates)
        if not tables:
            return schema.empty_table()
        return pa.concat_tables(tables, promote_options="default")

    def files(self) -> list[str]:
        return [p for ps in self.parts.values() for p in ps if isinstance(p, str)]


def _read_file(path: str) -> pa.Table:
    with pa.memory_map(path) as src:
        return pa.ipc.open_file(src).read_all()


def canonical_keys(table: pa.Table, key: Iterable[str]) -> list[str]:
    """Each row's canonical key (:func:`canonical`). Keys of integers,
    strings, booleans and bytes are their own :func:`hashable` forms: their
    tuples' ``repr`` is taken as it is (without a Python call per value)."""
    names = list(key)
    cols = [table.column(k).to_pylist() for k in names]
    if all(_plain_key(table.schema.field(k).type) for k in names):
        return list(map(repr, zip(*cols, strict=True)))
    return [canonical(vals) for vals in zip(*cols, strict=True)]


def _plain_key(typ: pa.DataType) -> bool:
    """Whether every value of ``typ`` is its own :func:`hashable` form."""
    return bool(pa.types.is_integer(typ) or pa.types.is_string(typ)
                or pa.types.is_boolean(typ) or pa.types.is_large_string(typ)
                or pa.types.is_binary(typ) or pa.types.is_large_binary(typ))


class IntentWriter:
    """A task's intents for one keyed output, split by key bucket as they
    come, and written to Arrow files under ``spill`` every ``spill_bytes``
    (named from ``name``: a retried task writes the same files), so a task
    reading a transaction of millions of rows holds a few MiB of them."""

    def __init__(self, key: tuple[str, ...], spill: Path | None, spill_bytes: int,
                 name: str) -> None:
        self.key, self.spill, self.spill_bytes, self.name = key, spill, spill_bytes, name
        self._buf: list[pa.Table] = []
        self._nbytes = 0
        self._pieces = 0
        self.out = KeyedIntents()

    def add(self, table: pa.Table) -> None:
        self._buf.append(table)
        self._nbytes += table.nbytes
        if self.spill is not None and self._nbytes >= self.spill_bytes:
            self._flush()

    def done(self) -> KeyedIntents:
        """Everything added (the rest carried in the result when small)."""
        self._flush()
        return self.out

    def _flush(self) -> None:
        if not self._buf:
            return
        # (some carry SRC_UNCHANGED, others not: missing means nothing unchanged)
        table = pa.concat_tables(self._buf, promote_options="default")
        self._buf, self._nbytes = [], 0
        piece = split_intents(table, self.key, self.spill, self.spill_bytes,
                              f"{self.name}-{self._pieces}", before=self.out.tail)
        self._pieces += 1
        self.out = KeyedIntents.merged([self.out, piece])


def split_intents(table: pa.Table, key: tuple[str, ...], spill: Path | None,
                  spill_bytes: int, name: str,
                  before: tuple[int, int, int, int, int] | None = None) -> KeyedIntents:
    """Intents of one keyed output split by key bucket; written to an Arrow
    file per bucket under ``spill`` (``name``-b<bucket>.arrow) when they
    reach ``spill_bytes``. ``before``: the :attr:`KeyedIntents.tail` of the
    intents that came just before them (a pair of intents may straddle)."""
    out = KeyedIntents()
    if table.num_rows == 0:
        return out
    marks = pc.equal(table.column(DIFF), TRUNCATED).to_numpy(zero_copy_only=False)
    if marks.any():
        out.truncates.append(table.filter(pa.array(marks)))
        table = table.filter(pa.array(~marks))
    out.tail = before
    if table.num_rows == 0:
        return out
    buckets = np.fromiter((key_bucket(k) for k in canonical_keys(table, key)), np.int64,
                          count=table.num_rows)
    out.links, out.tail = _links(table, buckets, before)
    write = spill is not None and table.nbytes >= spill_bytes
    if write:
        assert spill is not None
        spill.mkdir(parents=True, exist_ok=True)
    order = np.argsort(buckets, kind="stable")
    sorted_b = buckets[order]
    cuts = np.flatnonzero(np.diff(sorted_b)) + 1
    for idx in np.split(order, cuts):
        if len(idx) == 0:
            continue
        b = int(buckets[idx[0]])
        part = table.take(pa.array(idx))
        out.nbytes[b] = part.nbytes
        if write:
            assert spill is not None
            path = spill / f"{name}-b{b}.arrow"
            tmp = path.with_suffix(".tmp")
            with pa.OSFile(str(tmp), "wb") as sink, \
                    pa.ipc.new_file(sink, part.schema) as w:
                w.write_table(part)
            os.replace(tmp, path)
            out.parts[b] = [str(path)]
        else:
            out.parts[b] = [part]
    return out


def _links(table: pa.Table, buckets: np.ndarray[Any, Any],
           before: tuple[int, int, int, int, int] | None
           ) -> tuple[set[tuple[int, int]], tuple[int, int, int, int, int]]:
    """Bucket pairs (tombstone's, value's) of updates that moved a row to
    another key and left columns unsent: the value takes them from the row
    the tombstone just removed, at its position and one ``_src_seq`` before
    it (``before`` is the intent before ``table``'s first). Also the last
    intent, for the next piece."""
    order = pc.sort_indices(table, sort_keys=[
        (SRC_PART, "ascending"), (SRC_OFFSET, "ascending"), (SRC_SEQ, "ascending")])
    t = table.take(order)
    b = buckets[order.to_numpy()]
    part = t.column(SRC_PART).to_numpy(zero_copy_only=False).astype(np.int64)
    off = t.column(SRC_OFFSET).to_numpy(zero_copy_only=False).astype(np.int64)
    seq = t.column(SRC_SEQ).to_numpy(zero_copy_only=False).astype(np.int64)
    diff = t.column(DIFF).to_numpy(zero_copy_only=False).astype(np.int64)
    tail = (int(part[-1]), int(off[-1]), int(seq[-1]), int(diff[-1]), int(b[-1]))
    if SRC_UNCHANGED not in t.column_names or t.column(SRC_UNCHANGED).null_count == len(t):
        return set(), tail
    has = pc.fill_null(pc.greater(pc.list_value_length(t.column(SRC_UNCHANGED)), 0),
                       False).to_numpy(zero_copy_only=False)
    if before is not None:  # the piece before: its last intent goes first
        bp, bo, bs, bd, bb = before
        part, off, seq = np.r_[bp, part], np.r_[bo, off], np.r_[bs, seq]
        diff, b, has = np.r_[bd, diff], np.r_[bb, b], np.r_[False, has]
    i = np.flatnonzero(has[1:] & (diff[1:] == 1) & (diff[:-1] == 0) & (part[1:] == part[:-1])
                       & (off[1:] == off[:-1]) & (seq[1:] == seq[:-1] + 1)
                       & (b[1:] != b[:-1])) + 1
    return {(int(b[j - 1]), int(b[j])) for j in i}, tail
