"""Merge-on-read for Iceberg state tables (``mode: state`` of
:mod:`reclock.sinks.iceberg`): position-delete files, the snapshot that adds
them with a data file in one commit, and the key index that says which row
of which data file holds each live key.

Position-delete files (Iceberg spec, "Position Delete Files"): Parquet with
the columns ``file_path`` (string, field id 2147483546) and ``pos`` (long,
field id 2147483545), sorted by ``file_path`` then ``pos``; each row deletes
one row of a data file whose data sequence number is at most the delete
file's. pyiceberg 0.12 reads them (``_read_all_delete_files``: a scan drops
the rows they name) but writes none; Spark's Iceberg runtime reads them as
its own merge-on-read ``MERGE`` writes them.

The snapshot (:class:`RowDelta`): a pyiceberg snapshot producer that writes
one data manifest (``ManifestContent.DATA``) of the added data files, one
delete manifest (``ManifestContent.DELETES``) of the added delete files, and
keeps every manifest of the parent snapshot, rewritten without the files it
removes (compaction): operation ``overwrite`` for a commit (what Spark's
merge-on-read ``MERGE`` writes), also for a compaction (pyiceberg 0.12's
summaries know no ``replace``). The base
class writes the manifest list and the ``AddSnapshotUpdate`` and
``SetSnapshotRefUpdate``; the sink sends them fenced by
``assert-ref-snapshot-id``.

The key index (:class:`KeyIndex`): a SQLite file mapping each live key to
the data file and row position of its current row, each data file to its
row count and deleted rows, each delete file to the data files it names,
with the snapshot id it describes. It is written in a SQLite transaction
committed only once the catalog commit succeeded; after a crash in between,
or when another writer moved the table, it names another snapshot than the
table's current one and is rebuilt from the table (:func:`rebuild`: the
current snapshot's data files, their key columns, and the rows their delete
files name). It is never trusted for a snapshot it does not name.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

#: Field ids of a position-delete file's columns (Iceberg spec, reserved ids).
FILE_PATH_ID = 2147483546
POS_ID = 2147483545
#: The Arrow schema of a position-delete file.
POSITION_DELETE_SCHEMA = pa.schema([
    pa.field("file_path", pa.string(), nullable=False,
             metadata={b"PARQUET:field_id": str(FILE_PATH_ID).encode()}),
    pa.field("pos", pa.int64(), nullable=False,
             metadata={b"PARQUET:field_id": str(POS_ID).encode()}),
])
#: Keys looked up per SQL statement (below SQLite's variable limit).
LOOKUP_CHUNK = 4000


def write_position_deletes(io: Any, uri: str, paths: Sequence[str], positions: Sequence[int]
                           ) -> Any:
    """Write a position-delete file at ``uri`` (through pyiceberg's FileIO
    ``io``) deleting row ``positions[i]`` of data file ``paths[i]``; returns
    its ``DataFile`` (content ``POSITION_DELETES``, with the bounds of both
    columns, so that a reader applies it only to the data files it names)."""
    from pyiceberg.conversions import to_bytes
    from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
    from pyiceberg.typedef import Record
    from pyiceberg.types import LongType, StringType

    order = sorted(range(len(paths)), key=lambda i: (paths[i], positions[i]))
    table = pa.table({"file_path": pa.array([paths[i] for i in order], pa.string()),
                      "pos": pa.array([positions[i] for i in order], pa.int64())},
                     schema=POSITION_DELETE_SCHEMA)
    out = io.new_output(uri)
    with out.create(overwrite=True) as f:
        pq.write_table(table, f, compression="zstd")
    size = len(io.new_input(uri))
    first, last = order[0], order[-1]
    lo_pos, hi_pos = min(positions), max(positions)
    return DataFile.from_args(
        content=DataFileContent.POSITION_DELETES, file_path=uri,
        file_format=FileFormat.PARQUET, partition=Record(), record_count=len(paths),
        file_size_in_bytes=size,
        lower_bounds={FILE_PATH_ID: to_bytes(StringType(), paths[first]),
                      POS_ID: to_bytes(LongType(), lo_pos)},
        upper_bounds={FILE_PATH_ID: to_bytes(StringType(), paths[last]),
                      POS_ID: to_bytes(LongType(), hi_pos)},
        value_counts={FILE_PATH_ID: len(paths), POS_ID: len(paths)},
        null_value_counts={FILE_PATH_ID: 0, POS_ID: 0},
        spec_id=0, sort_order_id=None)


def _delete_manifest_writer(producer: Any) -> Any:
    """A manifest writer like the producer's own, of content DELETES."""
    from pyiceberg.manifest import ManifestContent, ManifestWriterV2

    class DeleteManifestWriter(ManifestWriterV2):
        def content(self) -> ManifestContent:
            return ManifestContent.DELETES

        @property
        def _meta(self) -> dict[str, str]:
            return {**super()._meta, "content": "deletes"}

    tx = producer._transaction
    return DeleteManifestWriter(tx.table_metadata.spec(), producer.schema(),
                                producer.new_manifest_output(), producer._snapshot_id,
                                producer._compression)


def row_delta(tx: Any, props: dict[str, str], *, add_data: Iterable[Any] = (),
              add_deletes: Iterable[Any] = (), remove: Iterable[str] = ()) -> Any:
    """Stage on ``tx`` ONE ``overwrite`` snapshot on top of its main branch that adds the
    data files ``add_data`` and the position-delete files ``add_deletes``
    and drops the files (data or delete) whose paths are in ``remove``; its
    summary carries ``props``. Returns the new snapshot's id."""
    from pyiceberg.manifest import ManifestContent, ManifestEntry, ManifestEntryStatus
    from pyiceberg.table.snapshots import Operation
    from pyiceberg.table.update.snapshot import _SnapshotProducer

    gone = set(remove)
    datas = list(add_data)
    deletes = list(add_deletes)

    class RowDelta(_SnapshotProducer[Any]):
        removed: list[Any]

        def _deleted_entries(self) -> list[Any]:
            return []

        def _existing_manifests(self) -> list[Any]:
            if self._parent_snapshot_id is None:
                return []
            parent = self._transaction.table_metadata.snapshot_by_id(self._parent_snapshot_id)
            if parent is None:
                raise ValueError(f"snapshot {self._parent_snapshot_id} is gone")
            kept = []
            for m in parent.manifests(self._io):
                if not gone:
                    kept.append(m)
                    continue
                entries = list(m.fetch_manifest_entry(self._io, discard_deleted=True))
                if not any(e.data_file.file_path in gone for e in entries):
                    kept.append(m)
                    continue
                rest = [e for e in entries if e.data_file.file_path not in gone]
                self.removed += [e.data_file for e in entries if e.data_file.file_path in gone]
                if not rest:
                    continue
                writer = (_delete_manifest_writer(self) if m.content == ManifestContent.DELETES
                          else self.new_manifest_writer(self.spec(m.partition_spec_id)))
                with writer:
                    for e in rest:
                        writer.add_entry(ManifestEntry.from_args(
                            status=ManifestEntryStatus.EXISTING, snapshot_id=e.snapshot_id,
                            sequence_number=e.sequence_number,
                            file_sequence_number=e.file_sequence_number,
                            data_file=e.data_file))
                kept.append(writer.to_manifest_file())
            return kept

        def _manifests(self) -> list[Any]:
            out = []
            existing = self._existing_manifests()
            for files, writer in ((datas, None), (deletes, "deletes")):
                if not files:
                    continue
                w = (_delete_manifest_writer(self) if writer
                     else self.new_manifest_writer(self._transaction.table_metadata.spec()))
                with w:
                    for f in files:
                        w.add(ManifestEntry.from_args(
                            status=ManifestEntryStatus.ADDED, snapshot_id=self._snapshot_id,
                            sequence_number=None, file_sequence_number=None, data_file=f))
                out.append(w.to_manifest_file())
            for f in self.removed:
                self._deleted_data_files.add(f)
            return out + existing

        def _summary(self, snapshot_properties: dict[str, str] = {}) -> Any:  # noqa: B006
            saved = self._added_data_files
            self._added_data_files = saved + deletes
            try:
                return super()._summary(snapshot_properties)
            finally:
                self._added_data_files = saved

    producer = RowDelta(Operation.OVERWRITE, tx, tx._table.io, snapshot_properties=props)
    producer._added_data_files = datas
    producer.removed = []
    snapshot_id = producer._snapshot_id
    producer.commit()
    return snapshot_id


# -- the key index ---------------------------------------------------------------------------


class KeyIndex:
    """The key index of a state table (see the module docstring), in the
    SQLite file ``path``. Keys are the text of the key's values (the
    caller's canonical form, equal for equal keys)."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a WAL transaction is atomic, and its durability against a
        # power loss does not matter: an index that lost its last change
        # names an older snapshot, and is rebuilt.
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript("""
            CREATE TABLE IF NOT EXISTS meta (snapshot INTEGER);
            CREATE TABLE IF NOT EXISTS files (id INTEGER PRIMARY KEY, path TEXT UNIQUE,
                                              rows INTEGER, deleted INTEGER);
            CREATE TABLE IF NOT EXISTS keys (key TEXT PRIMARY KEY, file INTEGER, pos INTEGER)
                WITHOUT ROWID;
            CREATE TABLE IF NOT EXISTS deletes (path TEXT, file INTEGER);
        """)

    def close(self) -> None:
        self.db.close()

    def snapshot(self) -> int | None:
        """The snapshot the index describes (None: none, or empty)."""
        row = self.db.execute("SELECT snapshot FROM meta").fetchone()
        return None if row is None else row[0]

    def lookup(self, keys: Sequence[str]) -> dict[str, tuple[str, int]]:
        """The data file path and row position of each of ``keys`` held."""
        out: dict[str, tuple[str, int]] = {}
        for i in range(0, len(keys), LOOKUP_CHUNK):
            chunk = keys[i:i + LOOKUP_CHUNK]
            q = ",".join("?" * len(chunk))
            for k, path, pos in self.db.execute(
                    f"SELECT k.key, f.path, k.pos FROM keys k JOIN files f ON f.id = k.file "
                    f"WHERE k.key IN ({q})", chunk):
                out[k] = (path, pos)
        return out

    def positions(self, paths: Sequence[str]) -> dict[str, list[int]]:
        """The row positions of the live keys of each data file of ``paths``,
        in order: one scan of the keys (no index by file: it would cost every
        commit, for compactions only)."""
        ids = {i: p for i, p in self.db.execute(
            f"SELECT id, path FROM files WHERE path IN ({','.join('?' * len(paths))})",
            list(paths))}
        out: dict[str, list[int]] = {p: [] for p in paths}
        for f, pos in self.db.execute("SELECT file, pos FROM keys"):
            p = ids.get(f)
            if p is not None:
                out[p].append(pos)
        for v in out.values():
            v.sort()
        return out

    def files(self) -> list[tuple[str, int, int]]:
        """Each data file: its path, rows, and rows deleted."""
        return list(self.db.execute("SELECT path, rows, deleted FROM files ORDER BY id"))

    def delete_files(self) -> dict[str, set[str]]:
        """Each delete file: the data files it names."""
        out: dict[str, set[str]] = {}
        for d, p in self.db.execute("SELECT d.path, f.path FROM deletes d "
                                    "LEFT JOIN files f ON f.id = d.file"):
            out.setdefault(d, set())
            if p is not None:
                out[d].add(p)
        return out

    @contextmanager
    def change(self, snapshot: int, base: int | None = None) -> Iterator[Change]:
        """A change of the index to describe ``snapshot``: applied if the
        block sets ``done``, rolled back otherwise. With ``base``: only if
        the index still describes ``base`` (else ``stale`` is set, and the
        block must change nothing)."""
        self.db.execute("BEGIN IMMEDIATE")
        ch = Change(self.db)
        ch.stale = base is not None and self.snapshot() != base
        try:
            yield ch
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        if ch.done:
            self.db.execute("DELETE FROM meta")
            self.db.execute("INSERT INTO meta VALUES (?)", (snapshot,))
            self.db.execute("COMMIT")
        else:
            self.db.execute("ROLLBACK")

    def reset(self) -> None:
        """Forget everything (before a rebuild)."""
        self.db.executescript("BEGIN; DELETE FROM meta; DELETE FROM files; DELETE FROM keys; "
                              "DELETE FROM deletes; COMMIT;")


class Change:
    """The statements of one :meth:`KeyIndex.change`."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.done = False
        self.stale = False

    def delete_keys(self, hits: dict[str, tuple[str, int]]) -> None:
        """Drop the keys of ``hits`` (as :meth:`KeyIndex.lookup` found them)
        and count their rows deleted in their files."""
        keys = list(hits)
        for i in range(0, len(keys), LOOKUP_CHUNK):
            chunk = keys[i:i + LOOKUP_CHUNK]
            self.db.execute(f"DELETE FROM keys WHERE key IN ({','.join('?' * len(chunk))})",
                            chunk)
        per: dict[str, int] = {}
        for path, _ in hits.values():
            per[path] = per.get(path, 0) + 1
        self.db.executemany("UPDATE files SET deleted = deleted + ? WHERE path = ?",
                            [(n, p) for p, n in per.items()])

    def add_file(self, path: str, keys: Sequence[str], positions: Sequence[int] | None = None,
                 rows: int | None = None) -> None:
        """A data file of ``rows`` rows (default: ``len(keys)``) whose live
        keys are ``keys`` at ``positions`` (default: 0, 1, ...)."""
        n = len(keys) if rows is None else rows
        cur = self.db.execute("INSERT INTO files (path, rows, deleted) VALUES (?, ?, ?)",
                              (path, n, n - len(keys)))
        fid = cur.lastrowid
        pos = range(len(keys)) if positions is None else positions
        self.db.executemany("INSERT INTO keys VALUES (?, ?, ?)",
                            zip(keys, [fid] * len(keys), pos, strict=True))

    def add_delete_file(self, path: str, data_paths: Iterable[str]) -> None:
        """A delete file naming rows of ``data_paths`` (files it names that
        are gone are remembered as NULL: the delete file no longer applies
        to them)."""
        self.db.executemany("INSERT INTO deletes (path, file) VALUES "
                            "(?, (SELECT id FROM files WHERE path = ?))",
                            [(path, p) for p in set(data_paths)])

    def drop_files(self, paths: Iterable[str]) -> None:
        """Forget data files (their keys too) and delete files."""
        for p in paths:
            row = self.db.execute("SELECT id FROM files WHERE path = ?", (p,)).fetchone()
            if row is not None:
                self.db.execute("DELETE FROM keys WHERE file = ?", (row[0],))
                self.db.execute("DELETE FROM files WHERE id = ?", (row[0],))
                self.db.execute("UPDATE deletes SET file = NULL WHERE file = ?", (row[0],))
            self.db.execute("DELETE FROM deletes WHERE path = ?", (p,))


def rebuild(index: KeyIndex, table: Any, key_columns: Sequence[str],
            keys_of: Callable[[pa.Table], list[str]]) -> None:
    """Rebuild ``index`` from ``table``'s current snapshot: every data file's
    key column values by position, less the positions its delete files name.
    A ValueError when the table holds equality deletes (not written here)."""
    from pyiceberg.io.pyarrow import _read_deletes
    from pyiceberg.manifest import DataFileContent

    snap = table.current_snapshot()
    index.reset()
    tasks = [] if snap is None else list(table.scan(snapshot_id=snap.snapshot_id).plan_files())
    deleted: dict[str, set[int]] = {}
    names: dict[str, set[str]] = {}
    for t in tasks:
        for d in t.delete_files:
            if d.content != DataFileContent.POSITION_DELETES:
                raise ValueError(f"delete file {d.file_path} holds equality deletes")
            if d.file_path in names:
                continue
            per = _read_deletes(table.io, d)
            names[d.file_path] = set(per)
            for path, pos in per.items():
                deleted.setdefault(path, set()).update(pos.to_pylist())
    with index.change(-1 if snap is None else snap.snapshot_id) as ch:
        for t in tasks:
            path = t.file.file_path
            with table.io.new_input(path).open() as f:
                cols = pq.read_table(f, columns=list(key_columns))
            gone = deleted.get(path, set())
            keep = [i for i in range(cols.num_rows) if i not in gone]
            keys = keys_of(cols.take(pa.array(keep, pa.int64())))
            ch.add_file(path, keys, keep, rows=cols.num_rows)
        for d, paths in names.items():
            ch.add_delete_file(d, paths)
        ch.done = True
