"""The key index of a lake state table (``mode: state`` of the Delta and
Iceberg sinks): a SQLite file on the driver mapping each live key to the
data file and row position of its current row, with the table version
(Delta) or snapshot id (Iceberg) it describes.

The rule both sinks keep: the index is trusted only for the version it
names. A commit reads it to find the rows it replaces, and writes its
changes in a SQLite transaction (:meth:`KeyIndex.change`) committed only
once the table's own commit exists; after a crash in between, or when
another writer moved the table, the index names another version than the
table's and is rebuilt from the table (the sink's ``rebuild``, passed to
:meth:`KeyIndex.at`). What the table-specific parts keep here:

* ``files``: each data file (``path``, ``rows``); the Delta sink keeps its
  add action (``add_json``) and deletion vector (``dv``) with it, the
  Iceberg sink its deleted positions (``dv``, a Roaring bitmap) and their
  count (``deleted``); a compaction
  may *move* a file's live rows into another (``moved_to``, ``base``,
  ``dropped``: :meth:`Changes.move_files`), followed by :meth:`KeyIndex.lookup`;
* ``retired``: Delta's replaced deletion vector files waiting for their
  retention; ``deletes``: Iceberg's position-delete files and the data
  files they name.

A file of another layout (an index written by an earlier release) is
emptied when opened, so the sink rebuilds it from the table.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pyroaring import BitMap

#: How long a commit waits for another process's transaction on the index.
BUSY_TIMEOUT_S = 30.0
#: The index's page cache (KiB).
CACHE_KIB = 512 * 1024
#: Keys looked up per SQL statement (SQLite's default variable limit is 32766).
LOOKUP_CHUNK = 4000

#: The tables and their columns (the layout an index file must have).
_LAYOUT = {
    "keys": ("k", "f", "r"),
    "files": ("id", "path", "rows", "add_json", "dv", "moved_to", "base", "dropped", "deleted"),
    "meta": ("name", "value"),
    "retired": ("path", "at"),
    "deletes": ("path", "file"),
}
_SCHEMA = """
    CREATE TABLE IF NOT EXISTS keys (k PRIMARY KEY, f INTEGER NOT NULL, r INTEGER NOT NULL)
        WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS files (id INTEGER PRIMARY KEY, path TEXT UNIQUE,
        rows INTEGER NOT NULL, add_json TEXT, dv BLOB, moved_to INTEGER, base INTEGER,
        dropped BLOB, deleted INTEGER NOT NULL DEFAULT 0);
    CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value);
    CREATE TABLE IF NOT EXISTS retired (path TEXT PRIMARY KEY, at INTEGER NOT NULL);
    CREATE TABLE IF NOT EXISTS deletes (path TEXT, file INTEGER);
"""


class KeyIndex:
    """The key index in the SQLite file ``path`` (see the module
    docstring). One writer at a time (the sink's commit lock); a second
    committer waits for the first one's transaction."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                                  timeout=BUSY_TIMEOUT_S)
        self.db.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a WAL transaction is atomic, and its durability against a
        # power loss does not matter: an index that lost its last change
        # names an older version, and is rebuilt.
        self.db.execute("PRAGMA synchronous=NORMAL")
        # a commit probes and writes keys spread over the whole table: keep
        # the B-tree's inner pages and many leaves cached (the default is 2 MiB)
        self.db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
        self.db.execute("BEGIN IMMEDIATE")
        try:
            have = {t: [r[1] for r in self.db.execute(f"PRAGMA table_info({t})")]
                    for t in _LAYOUT}
            if any(cols and not set(_LAYOUT[t]) - {"deleted"} <= set(cols)
                   for t, cols in have.items()):
                # another layout: start empty (the sink rebuilds the index)
                for t in _LAYOUT:
                    self.db.execute(f"DROP TABLE IF EXISTS {t}")
            elif have["files"] and "deleted" not in have["files"]:  # a Delta index of before
                self.db.execute("ALTER TABLE files ADD COLUMN deleted INTEGER NOT NULL "
                                "DEFAULT 0")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    self.db.execute(statement)
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    @property
    def version(self) -> int | None:
        """The table version (Delta) or snapshot id (Iceberg, -1: no
        snapshot) the index describes; None: none yet."""
        row = self.db.execute("SELECT value FROM meta WHERE name = 'version'").fetchone()
        return None if row is None else int(row[0])

    def mark(self, version: int) -> None:
        """Say the index describes ``version`` (a version that changed no file)."""
        self.db.execute("INSERT OR REPLACE INTO meta VALUES ('version', ?)", (version,))

    def forget(self) -> None:
        """Say the index describes no version (it is rebuilt before use)."""
        self.db.execute("DELETE FROM meta WHERE name = 'version'")

    def at(self, version: int, rebuild: Callable[[KeyIndex], object]) -> KeyIndex:
        """The index, describing ``version``: ``rebuild(self)`` makes it
        describe the table anew when it names another."""
        if self.version != version:
            rebuild(self)
        return self

    def close(self) -> None:
        self.db.close()

    def lookup(self, keys: Sequence[Any]) -> dict[Any, tuple[int, int]]:
        """(file id, position) of each of ``keys`` that has a row, in the
        live file that holds it now (see :meth:`Changes.move_files`)."""
        out: dict[Any, tuple[int, int]] = {}
        for i in range(0, len(keys), LOOKUP_CHUNK):
            chunk = list(keys[i:i + LOOKUP_CHUNK])
            marks = ",".join("?" * len(chunk))
            for k, f, r in self.db.execute(f"SELECT k, f, r FROM keys WHERE k IN ({marks})",
                                           chunk):
                out[k] = (f, r)
        moves: dict[int, tuple[int, int, BitMap] | None] = {}
        while True:
            ask = sorted({f for f, _ in out.values()} - set(moves))
            if not ask:
                break
            for f in ask:
                moves[f] = None
            for i in range(0, len(ask), LOOKUP_CHUNK):
                chunk = ask[i:i + LOOKUP_CHUNK]
                for f, to, base, dropped in self.db.execute(
                        "SELECT id, moved_to, base, dropped FROM files WHERE moved_to IS NOT "
                        f"NULL AND id IN ({','.join('?' * len(chunk))})", chunk):
                    moves[f] = (to, base, BitMap.deserialize(dropped) if dropped else BitMap())
            moved = {k: at for k, at in out.items() if moves.get(at[0]) is not None}
            if not moved:
                break
            for k, (f, r) in moved.items():
                to, base, dropped = moves[f]  # type: ignore[misc]
                # the live rows of the moved file, in order, from ``base`` on
                out[k] = (to, base + r - dropped.rank(r))
        return out

    def paths(self, ids: Sequence[int]) -> dict[int, str]:
        """The path of each data file of ``ids``."""
        out: dict[int, str] = {}
        wanted = sorted(set(ids))
        for i in range(0, len(wanted), LOOKUP_CHUNK):
            chunk = wanted[i:i + LOOKUP_CHUNK]
            out.update(self.db.execute(
                f"SELECT id, path FROM files WHERE id IN ({','.join('?' * len(chunk))})",
                chunk))
        return out

    @contextmanager
    def change(self, version: int, base: int | None = None) -> Iterator[Changes]:
        """A transaction that makes the index describe ``version``, committed
        when the block ends normally and the block's ``Changes.done`` is set
        (the table's commit exists), rolled back otherwise. With ``base``:
        ``Changes.stale`` is set unless the index still describes ``base``
        (then the block must change nothing)."""
        self.db.execute("BEGIN IMMEDIATE")
        ch = Changes(self.db)
        ch.stale = base is not None and self.version != base
        try:
            yield ch
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        if not ch.done:
            self.db.execute("ROLLBACK")
            return
        self.db.execute("INSERT OR REPLACE INTO meta VALUES ('version', ?)", (version,))
        self.db.execute("COMMIT")


class Changes:
    """The writes of one :meth:`KeyIndex.change` transaction (``db``: its
    connection, for the table-specific statements)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.done = False
        self.stale = False

    def add_file(self, path: str, rows: int, *, add_json: str | None = None,
                 deleted: int = 0) -> int:
        """A data file of ``rows`` rows (``deleted`` of them deleted); its id."""
        cur = self.db.execute("INSERT INTO files (path, rows, add_json, dv, deleted) "
                              "VALUES (?, ?, ?, NULL, ?)", (path, rows, add_json, deleted))
        assert cur.lastrowid is not None
        return cur.lastrowid

    def put_keys(self, keys: Sequence[Any], file_id: int, positions: Sequence[int]) -> None:
        """Each key's row is now at ``positions`` of ``file_id`` (written in
        key order: neighbouring keys share B-tree pages)."""
        rows = sorted(zip(keys, [file_id] * len(keys), positions, strict=True),
                      key=_sort_key)
        self.db.executemany("INSERT OR REPLACE INTO keys VALUES (?, ?, ?)", rows)

    def delete_keys(self, keys: Sequence[Any]) -> None:
        self.db.executemany("DELETE FROM keys WHERE k = ?",
                            [(k,) for k in sorted(keys, key=lambda k: _sort_key((k,)))])

    def move_files(self, moves: Sequence[tuple[int, int, int, BitMap]]) -> None:
        """Compaction: the live rows of each file ``(old, new, base, dropped)``
        are now rows ``base, base + 1, ...`` of file ``new`` in their order
        (``dropped``: the old file's deleted positions; ``new`` 0: no live
        row was left). The keys keep naming the old file; :meth:`KeyIndex.lookup`
        follows the move, so a compaction writes a row per file, not per key."""
        self.db.executemany(
            "UPDATE files SET moved_to = ?, base = ?, dropped = ?, dv = NULL WHERE id = ?",
            [(new, base, dropped.serialize(), old) for old, new, base, dropped in moves])

    def clear(self) -> None:
        """Forget the keys, data files and delete files (before a rebuild;
        not the retired vectors: their files still wait for their retention)."""
        self.db.execute("DELETE FROM keys")
        self.db.execute("DELETE FROM files")
        self.db.execute("DELETE FROM deletes")


def _sort_key(row: tuple[Any, ...]) -> tuple[int, Any]:
    """SQLite's order of keys: integers before texts."""
    k = row[0]
    return (0, k) if isinstance(k, int) else (1, k)
