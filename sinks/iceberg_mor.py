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

The key index (:class:`~reclock.sinks._keyindex.KeyIndex`, shared with the
Delta sink; its Iceberg parts here): a SQLite file mapping each live key to
the data file and row position of its current row, each data file to its
row count and deleted positions (a Roaring bitmap), each delete file to
the data files it names, with the snapshot id it describes. A compaction
moves the live rows of the files it rewrites into a new one and records
the move per file (:func:`compacted`), not per key: a lookup follows it.
It is written in a SQLite transaction
committed only once the catalog commit succeeded; after a crash in between,
or when another writer moved the table, it names another snapshot than the
table's current one and is rebuilt from the table (:func:`rebuild`: the
current snapshot's data files, their key columns, and the rows their delete
files name). It is never trusted for a snapshot it does not name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyroaring import BitMap

from reclock.sinks._keyindex import Changes
from reclock.sinks._keyindex import KeyIndex as KeyIndex

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


#: The transaction of a key index change (its name here before the index was shared).
Change = Changes


def lookup_paths(index: KeyIndex, keys: Sequence[str]) -> dict[str, tuple[str, int]]:
    """The data file path and row position of each of ``keys`` held."""
    found = index.lookup(keys)
    paths = index.paths([f for f, _ in found.values()])
    return {k: (paths[f], r) for k, (f, r) in found.items()}


def live_files(index: KeyIndex) -> list[tuple[int, str, int, BitMap]]:
    """Each live data file (none a compaction moved), oldest first: its id,
    path, rows, and deleted positions."""
    return [(i, p, n, BitMap.deserialize(d) if d else BitMap())
            for i, p, n, d in index.db.execute(
                "SELECT id, path, rows, dv FROM files WHERE moved_to IS NULL ORDER BY id")]


def delete_files(index: KeyIndex) -> dict[str, set[str]]:
    """Each delete file: the live data files it names."""
    out: dict[str, set[str]] = {}
    for d, p in index.db.execute("SELECT d.path, f.path FROM deletes d "
                                 "LEFT JOIN files f ON f.id = d.file"):
        out.setdefault(d, set())
        if p is not None:
            out[d].add(p)
    return out


def of_another_layout(index: KeyIndex) -> bool:
    """Whether ``index`` was written before it kept each data file's
    deleted positions (only their count): then it cannot say which rows a
    compaction moves, and is rebuilt."""
    return index.db.execute("SELECT 1 FROM files WHERE moved_to IS NULL AND deleted > 0 "
                            "AND dv IS NULL LIMIT 1").fetchone() is not None


def mark_deleted(ch: Changes, hits: dict[str, tuple[str, int]]) -> None:
    """The rows of ``hits`` (as :func:`lookup_paths` found them) are
    deleted in their files: added to each file's deleted positions (a
    Roaring bitmap, as a Delta file's deletion vector: what a compaction
    drops and :meth:`~reclock.sinks._keyindex.Changes.move_files` records)
    and count."""
    per: dict[str, list[int]] = {}
    for path, pos in hits.values():
        per.setdefault(path, []).append(pos)
    out = []
    for path, positions in per.items():
        row = ch.db.execute("SELECT dv FROM files WHERE path = ?", (path,)).fetchone()
        dv = BitMap.deserialize(row[0]) if row is not None and row[0] else BitMap()
        dv.update(positions)
        out.append((len(dv), dv.serialize(), path))
    ch.db.executemany("UPDATE files SET deleted = ?, dv = ? WHERE path = ?", out)


def add_keyed_file(ch: Changes, path: str, keys: Sequence[str],
                   positions: Sequence[int] | None = None, rows: int | None = None,
                   deleted: BitMap | None = None) -> int:
    """A data file of ``rows`` rows (default: ``len(keys)``) whose live
    keys are ``keys`` at ``positions`` (default: 0, 1, ...), and whose other
    rows (``deleted``: their positions; needed when there are any) are
    deleted; its id."""
    n = len(keys) if rows is None else rows
    fid = ch.add_file(path, n, deleted=n - len(keys))
    if n != len(keys):
        assert deleted is not None and len(deleted) == n - len(keys), path
        ch.db.execute("UPDATE files SET dv = ? WHERE id = ?", (deleted.serialize(), fid))
    ch.put_keys(keys, fid, range(len(keys)) if positions is None else positions)
    return fid


def add_delete_file(ch: Changes, path: str, data_paths: Iterable[str]) -> None:
    """A delete file naming rows of ``data_paths`` (files it names that
    are gone are remembered as NULL: the delete file no longer applies
    to them)."""
    ch.db.executemany("INSERT INTO deletes (path, file) VALUES "
                      "(?, (SELECT id FROM files WHERE moved_to IS NULL AND path = ?))",
                      [(path, p) for p in set(data_paths)])


def compacted(ch: Changes, moves: Sequence[tuple[int, int, int, BitMap]],
              dropped: Iterable[str]) -> None:
    """A compaction: the live rows of each data file ``(old, new, base,
    deleted)`` moved to rows ``base, base + 1, ...`` of file ``new``
    (:meth:`~reclock.sinks._keyindex.Changes.move_files`: its keys are not
    rewritten; no delete file applies to the old file any more), and the
    delete files ``dropped`` are gone."""
    ch.move_files(moves)
    ch.db.executemany("UPDATE deletes SET file = NULL WHERE file = ?",
                      [(old,) for old, _, _, _ in moves])
    ch.db.executemany("DELETE FROM deletes WHERE path = ?", [(p,) for p in dropped])


def rebuild(index: KeyIndex, table: Any, key_columns: Sequence[str],
            keys_of: Callable[[pa.Table], list[str]]) -> None:
    """Rebuild ``index`` from ``table``'s current snapshot: every data file's
    key column values by position, less the positions its delete files name.
    A ValueError when the table holds equality deletes (not written here)."""
    from pyiceberg.io.pyarrow import _read_deletes
    from pyiceberg.manifest import DataFileContent

    snap = table.current_snapshot()
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
        ch.clear()
        for t in tasks:
            path = t.file.file_path
            with table.io.new_input(path).open() as f:
                cols = pq.read_table(f, columns=list(key_columns))
            gone = deleted.get(path, set())
            keep = [i for i in range(cols.num_rows) if i not in gone]
            keys = keys_of(cols.take(pa.array(keep, pa.int64())))
            add_keyed_file(ch, path, keys, keep, rows=cols.num_rows,
                           deleted=BitMap(p for p in gone if p < cols.num_rows))
        for d, paths in names.items():
            add_delete_file(ch, d, paths)
        ch.done = True
