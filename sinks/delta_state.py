"""A Delta state table (``mode: state`` of the Delta sink, see
:mod:`reclock.sinks.delta`): its commit path (:class:`StateTable`, a base
class of the sink: creating the table, the commit, reading the current
rows, compaction, the deletion vector files' expiry), deletion vectors and
the key index. What the log path shares with it: :mod:`reclock.sinks._deltalog`.

A state table holds one row per live key. A commit appends ONE data file
holding the new rows of the keys it changed, and marks the rows they replace
(or delete) as deleted with Delta *deletion vectors*: for every file holding
such a row, a ``remove`` of the file with its old deletion vector and an
``add`` of the same file with the new one (the old positions and the new),
in the same log entry as the data file and the output's txn. Readers
(Spark's Delta, delta-rs's DataFusion reader, DuckDB's delta extension) skip
the rows a file's deletion vector names.

Deletion vectors (Delta PROTOCOL.md, "Deletion Vector Format"): a set of row
positions of one file, serialized as a ``RoaringBitmapArray``: the magic
number 1681511377 (int32, little endian), the number of 32-bit buckets
(int64 LE), then per bucket its high 32 bits (uint32 LE) and a 32-bit
Roaring bitmap in the portable format (pyroaring's ``serialize``). A commit
writes the vectors it changes into one file ``deletion_vector_<uuid>.bin``
(version byte 1, then per vector its size as int32 big endian, the bitmap,
its CRC-32 big endian); a descriptor (``storageType: u``, the uuid in Z85,
the offset of the size field, the bitmap's size and cardinality) points at
each.

The key index (:class:`~reclock.sinks._keyindex.KeyIndex`, shared with the
Iceberg sink; its Delta parts here): a SQLite file beside the table
(``_reclock_keys.sqlite``, a name Delta's VACUUM leaves alone) mapping each
live key to the file and row position of its current row, and each data
file to its add action and current deletion vector, with the table version
it describes. A commit reads it to find the rows it replaces, and writes
its changes in a SQLite transaction that is committed only once the Delta
log entry exists: after a crash in between, the index names an older version
than the table, and it is rebuilt from the table (:func:`rebuild`: the log's
add actions and their deletion vectors, the files' key columns). It is never
trusted for a version it does not name.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
import struct
import time
import uuid
import zlib
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import DeltaTable, QueryBuilder, Schema
from deltalake.exceptions import TableNotFoundError
from pyroaring import BitMap

from reclock import faults
from reclock.contracts.rows import conform, output_schema
from reclock.contracts.sink import SinkError, SinkFenced, SinkState
from reclock.contracts.state_table import key_values, state_changes
from reclock.core.clock import Clock
from reclock.core.columns import (
    DIFF,
    ERROR,
    INTO_TIME,
    META_FIELDS,
    SRC_OFFSET,
    SRC_PART,
    SRC_SEQ,
)
from reclock.core.errors import ReclockError, TransientError
from reclock.sinks._compaction import bounded_pass
from reclock.sinks._deltalog import (
    _COMPACTED,
    _ENGINE,
    COMMIT_ATTEMPTS,
    KEY_MAINTENANCE,
    KEY_OUTPUT,
    KEY_PROGRESS,
    KEY_UPPER,
    RETENTION_PROPERTY,
    _check_descriptor,
    _decode_txn,
    _delta_schema,
    _encode_txn,
    _Evolution,
    _Head,
    _in_microseconds,
    _interval,
    _metadata_action,
    _write_parquet,
    storage_type,
)
from reclock.sinks._keyindex import LOOKUP_CHUNK, Changes
from reclock.sinks._keyindex import KeyIndex as KeyIndex
from reclock.sinks._store import Location

log = logging.getLogger("reclock.sinks.delta")

#: RoaringBitmapArray's magic number (Delta PROTOCOL.md).
DV_MAGIC = 1681511377
#: The key index's file name, in the table's directory.
INDEX_NAME = "_reclock_keys.sqlite"
#: A deletion vector file's name.
_DV_FILE = re.compile(r"deletion_vector_[0-9a-f-]{36}\.bin")

_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_Z85_VALUE = {c: i for i, c in enumerate(_Z85)}


def z85_encode(data: bytes) -> str:
    """Z85 (ZeroMQ's base 85) of ``data``, whose length is a multiple of 4."""
    out: list[str] = []
    for i in range(0, len(data), 4):
        v = int.from_bytes(data[i:i + 4], "big")
        chunk = []
        for _ in range(5):
            v, r = divmod(v, 85)
            chunk.append(_Z85[r])
        out.extend(reversed(chunk))
    return "".join(out)


def z85_decode(text: str) -> bytes:
    """The bytes :func:`z85_encode` made ``text`` of."""
    out = bytearray()
    for i in range(0, len(text), 5):
        v = 0
        for c in text[i:i + 5]:
            v = v * 85 + _Z85_VALUE[c]
        out += v.to_bytes(4, "big")
    return bytes(out)


def serialize_dv(positions: BitMap) -> bytes:
    """``positions`` (row positions of one file, each below 2**32) as a
    ``RoaringBitmapArray``."""
    head = struct.pack("<iq", DV_MAGIC, 1 if positions else 0)
    return head + (struct.pack("<I", 0) + positions.serialize() if positions else b"")


def deserialize_dv(data: bytes) -> BitMap:
    """The positions of a ``RoaringBitmapArray`` (files of reclock's size:
    bucket 0 only; another bucket is a SinkError)."""
    magic, buckets = struct.unpack_from("<iq", data)
    if magic != DV_MAGIC:
        raise SinkError(f"a deletion vector has magic number {magic}, not {DV_MAGIC}")
    if buckets == 0:
        return BitMap()
    (high,) = struct.unpack_from("<I", data, 12)
    if buckets != 1 or high != 0:
        raise SinkError("a deletion vector names row positions past 2**32")
    return BitMap.deserialize(data[16:])


def dv_path(descriptor: dict[str, Any]) -> str:
    """The path (relative to the table) of a ``u`` deletion vector's file."""
    text = str(descriptor["pathOrInlineDv"])
    prefix, code = text[:-20], text[-20:]
    name = f"deletion_vector_{uuid.UUID(bytes=z85_decode(code))}.bin"
    return f"{prefix}/{name}" if prefix else name


def _where(where: Location | str) -> Location:
    """A table's :class:`Location` (a local path: its directory)."""
    return where if isinstance(where, Location) else Location.of("state table", where)


def _input(where: Location, name: str) -> Any:
    """A readable, seekable binary file ``name`` of the table."""
    if where.s3 is None:
        return open(os.path.join(where.root, name), "rb")
    return where.s3.filesystem().open_input_file(f"{where.root}/{name}")


def _parquet(where: Location, name: str, columns: list[str] | None = None) -> pa.Table:
    if where.s3 is None:
        return pq.read_table(os.path.join(where.root, name), columns=columns)
    return pq.read_table(f"{where.root}/{name}", columns=columns,
                         filesystem=where.s3.filesystem())


def log_names(where: Location) -> list[str]:
    """The names in the table's ``_delta_log``."""
    if where.s3 is None:
        return os.listdir(os.path.join(where.root, "_delta_log"))
    infos = where.s3.filesystem().get_file_info(pafs.FileSelector(
        f"{where.root}/_delta_log", recursive=False, allow_not_found=True))
    return [i.base_name for i in infos if i.type == pafs.FileType.File]


def write_dvs(where: Location | str, vectors: Sequence[BitMap]
              ) -> tuple[str, list[dict[str, Any]]]:
    """Write ``vectors`` into one new deletion vector file of the table
    (synced, locally); its name and a descriptor per vector."""
    loc = _where(where)
    u = uuid.uuid4()
    name = f"deletion_vector_{u}.bin"
    blob = bytearray(b"\x01")
    descriptors = []
    for v in vectors:
        data = serialize_dv(v)
        descriptors.append({"storageType": "u", "pathOrInlineDv": z85_encode(u.bytes),
                            "offset": len(blob), "sizeInBytes": len(data),
                            "cardinality": len(v)})
        blob += struct.pack(">i", len(data)) + data + struct.pack(">I", zlib.crc32(data))
    if loc.s3 is not None:
        loc.write(name, lambda f: f.write(bytes(blob)))
        return name, descriptors
    path = os.path.join(loc.root, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, bytes(blob))
        os.fsync(fd)
    finally:
        os.close(fd)
    return name, descriptors


def read_dv(where: Location | str, descriptor: dict[str, Any]) -> BitMap:
    """The positions a deletion vector descriptor names (``u`` and ``i``)."""
    loc = _where(where)
    kind = descriptor["storageType"]
    if kind == "i":
        return deserialize_dv(z85_decode(str(descriptor["pathOrInlineDv"])))
    if kind == "p":
        path = unquote(str(descriptor["pathOrInlineDv"]).removeprefix("file://"))
        f = open(path, "rb")  # noqa: SIM115 (closed below)
    else:
        path = loc.child(dv_path(descriptor))
        f = _input(loc, dv_path(descriptor))
    with f:
        f.seek(int(descriptor.get("offset") or 1))
        (size,) = struct.unpack(">i", f.read(4))
        data = f.read(size)
        (crc,) = struct.unpack(">I", f.read(4))
    if zlib.crc32(data) != crc:
        raise SinkError(f"deletion vector file {path} is damaged (checksum)")
    return deserialize_dv(data)


def live_files(where: Location | str) -> tuple[int, dict[str, dict[str, Any]]]:
    """The newest version of the table and its add actions by path,
    replayed from the log itself (the newest classic checkpoint, then the
    JSON entries after it): the deletion vector descriptors with them,
    which delta-rs does not return."""
    loc = _where(where)
    root = loc.uri
    names = log_names(loc)
    versions = sorted(int(n[:20]) for n in names if n.endswith(".json") and n[:20].isdigit())
    adds: dict[str, dict[str, Any]] = {}
    start = 0
    last = loc.read_text("_delta_log/_last_checkpoint")
    cp = -1 if last is None else int(json.loads(last)["version"])
    if cp >= 0:
        part = f"_delta_log/{cp:020d}.checkpoint.parquet"
        if f"{cp:020d}.checkpoint.parquet" not in names:
            raise SinkError(f"the table at {root} has a checkpoint at version {cp} in a form "
                            "reclock does not read (multi-part or V2)",
                            hint="let only reclock write checkpoints of a state table, or "
                                 "re-read the output into a new path")
        for a in _parquet(loc, part, ["add"]).column("add").to_pylist():
            if a:
                a["partitionValues"] = dict(a.get("partitionValues") or [])
                a = {k: v for k, v in a.items() if v is not None}
                adds[unquote(a["path"])] = a
        start = cp + 1
    have = set(versions)
    missing = [v for v in range(start, versions[-1] + 1) if v not in have] if versions else []
    if missing:
        raise SinkError(f"the log of the table at {root} lacks entries {missing[:3]} after its "
                        "checkpoint", hint="re-read the output into a new path")
    for v in (x for x in versions if x >= start):
        text = loc.read_text(f"_delta_log/{v:020d}.json") or ""
        for line in text.splitlines():
            if not line.strip():
                continue
            doc = json.loads(line)
            if "remove" in doc:
                adds.pop(unquote(doc["remove"]["path"]), None)
            elif "add" in doc:
                adds[unquote(doc["add"]["path"])] = doc["add"]
    return (versions[-1] if versions else start - 1), adds


@dataclass
class FileEntry:
    """A data file of the table as the index holds it."""

    id: int
    path: str
    add: dict[str, Any]  # its add action as the log has it now (deletionVector included)
    dv: BitMap  # its deleted positions


# -- the key index's Delta parts (the index itself: :mod:`reclock.sinks._keyindex`) ----------


def file_entries(index: KeyIndex, ids: set[int] | None = None) -> dict[int, FileEntry]:
    """The live data files (those of ``ids`` only, if given: moved ones too)."""
    if ids is None:
        rows = index.db.execute("SELECT id, path, add_json, dv FROM files "
                                "WHERE moved_to IS NULL").fetchall()
    else:
        rows = []
        wanted = sorted(ids)
        for i in range(0, len(wanted), LOOKUP_CHUNK):
            chunk = wanted[i:i + LOOKUP_CHUNK]
            rows += index.db.execute(
                "SELECT id, path, add_json, dv FROM files WHERE id IN "
                f"({','.join('?' * len(chunk))})", chunk).fetchall()
    return {i: FileEntry(i, p, json.loads(a), BitMap.deserialize(d) if d else BitMap())
            for i, p, a, d in rows}


def dv_files_in_use(index: KeyIndex) -> set[str]:
    """The deletion vector files the live data files' vectors are in."""
    out = set()
    for (a,) in index.db.execute("SELECT add_json FROM files WHERE dv IS NOT NULL "
                                 "AND moved_to IS NULL"):
        d = json.loads(a).get("deletionVector")
        if d and d.get("storageType") == "u":
            out.add(dv_path(d))
    return out


def retired(index: KeyIndex, before_ms: int) -> list[str]:
    """Deletion vector files that no live file has used since ``before_ms``."""
    return [p for (p,) in index.db.execute("SELECT path FROM retired WHERE at < ?",
                                           (before_ms,))]


def forget_retired(index: KeyIndex, paths: Sequence[str]) -> None:
    index.db.executemany("DELETE FROM retired WHERE path = ?", [(p,) for p in paths])


def live_fraction(index: KeyIndex) -> list[tuple[int, str, int, int]]:
    """(id, path, rows, deleted) of every live file."""
    out = []
    for i, p, n, d in index.db.execute("SELECT id, path, rows, dv FROM files "
                                       "WHERE moved_to IS NULL"):
        out.append((i, p, n, len(BitMap.deserialize(d)) if d else 0))
    return out


def add_file(ch: Changes, path: str, rows: int, add: dict[str, Any]) -> int:
    """A new data file of ``rows`` rows with add action ``add``; its id."""
    return ch.add_file(path, rows, add_json=json.dumps(add))


def set_dv(ch: Changes, file_id: int, add: dict[str, Any], dv: BitMap) -> None:
    """File ``file_id``'s deletion vector is now ``dv`` (add action ``add``)."""
    ch.db.execute("UPDATE files SET add_json = ?, dv = ? WHERE id = ?",
                  (json.dumps(add), dv.serialize(), file_id))


def rename_file(ch: Changes, file_id: int, path: str, add: dict[str, Any]) -> None:
    """File ``file_id`` is now ``path`` (rewritten with its rows in their
    order: a widened column), with add action ``add``."""
    ch.db.execute("UPDATE files SET path = ?, add_json = ? WHERE id = ?",
                  (path, json.dumps(add), file_id))


def retire(ch: Changes, descriptors: Sequence[dict[str, Any] | None], now_ms: int) -> None:
    """Deletion vectors the commit replaces: their files may go once no
    live file uses them and they are past the retention (:func:`retired`)."""
    paths = {dv_path(d) for d in descriptors if d and d.get("storageType") == "u"}
    ch.db.executemany("INSERT OR REPLACE INTO retired VALUES (?, ?)",
                      [(p, now_ms) for p in paths])


def rebuild(index: KeyIndex, where: Location | str, key: Sequence[str], output: str) -> int:
    """Make ``index`` describe the newest version of the table at ``where``
    (local or on S3) from the table alone: its add actions (with their deletion
    vectors) and each file's key columns, less the deleted rows. Two live
    rows of one key are a SinkError (the table is not a state table of that
    key). Returns the version."""
    loc = _where(where)
    root = loc.uri
    version, adds = live_files(loc)
    seen: set[Any] = set()
    with index.change(version) as ch:
        ch.clear()
        for path, add in sorted(adds.items()):
            dv = read_dv(loc, add["deletionVector"]) if add.get("deletionVector") else BitMap()
            data = _parquet(loc, path, list(key))
            fid = add_file(ch, path, data.num_rows, add)
            if dv:
                set_dv(ch, fid, add, dv)
                keep = BitMap(range(data.num_rows)) - dv
                positions = list(keep)
                data = data.take(pa.array(positions, pa.int64()))
            else:
                positions = list(range(data.num_rows))
            keys = key_values(data, key)
            dup = seen.intersection(keys)
            if dup or len(set(keys)) != len(keys):
                raise SinkError(
                    f"output {output!r}: the state table at {root} holds two live rows of key "
                    f"{next(iter(dup)) if dup else keys[0]!r} (file {path})",
                    hint="the table was changed outside reclock; re-read the output into a new "
                         "path")
            seen.update(keys)
            ch.put_keys(keys, fid, positions)
        ch.done = True
    return version


def state_stats(table: pa.Table) -> str:
    """Delta statistics of a state file: record count, min/max of the flat
    orderable columns, null counts."""
    mins: dict[str, Any] = {}
    maxs: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for f in table.schema:
        if pa.types.is_nested(f.type):
            continue
        col = table.column(f.name)
        nulls[f.name] = col.null_count
        if pa.types.is_integer(f.type):
            mm = pc.min_max(col)
            if mm["min"].as_py() is not None:
                mins[f.name], maxs[f.name] = mm["min"].as_py(), mm["max"].as_py()
    return json.dumps({"numRecords": table.num_rows, "minValues": mins, "maxValues": maxs,
                       "nullCount": nulls, "tightBounds": True}, separators=(",", ":"))


def wide_stats(stats: str | None) -> str | None:
    """``stats`` of a file that now has deleted rows: the same bounds, no
    longer tight (PROTOCOL.md: numRecords stays the file's physical count)."""
    if not stats:
        return stats
    doc = json.loads(stats)
    doc["tightBounds"] = False
    return json.dumps(doc, separators=(",", ":"))


# -- the state-table commit path of the Delta sink --------------------------------------------


class _Retention(Protocol):
    @property
    def removes_kept_hours(self) -> int: ...


class _Stager(Protocol):
    def stage(self, batch_id: str, part: int, table: pa.Table) -> list[dict[str, Any]]: ...


class StateTable:
    """The state-table path of :class:`~reclock.sinks.delta.DeltaSink`
    (``mode: state``; the module docstring): creating the table, the
    commit (the staged updates consolidated per key, the deletion vectors,
    the key index), reading the current rows, compaction, and the deletion
    vector files' expiry and vacuum. A base class of the sink, which gives
    it what is declared below (the log path's pieces both paths use)."""

    if TYPE_CHECKING:
        name: str
        key: tuple[str, ...]
        location: Location
        uri: str
        app_id: str
        compaction: _Retention | None
        _clock: Clock
        _schema: pa.Schema | None
        _fresh: DeltaTable | None
        _evolution: _Evolution | None
        _head: _Head | None
        _index: KeyIndex | None
        _index_dir: str | None
        _user: pa.Schema | None
        _stored: pa.Schema | None
        _errors: StateTable | None

        def state(self) -> SinkState: ...
        def stager(self) -> _Stager: ...
        def commit(self, staged: list[dict[str, Any]], expected: SinkState,
                   new: SinkState) -> None: ...
        def ensure(self, user_schema: pa.Schema) -> None: ...
        def read_updates(self, as_of: int | None = None) -> pa.Table: ...
        def _checked(self, dt: DeltaTable, want: Schema) -> DeltaTable: ...
        def _exists(self) -> bool: ...
        def _open(self) -> DeltaTable: ...
        def _load(self) -> DeltaTable: ...
        def _locked(self) -> AbstractContextManager[None]: ...
        def _logged(self, version: int) -> bool: ...
        def _head_of(self, dt: DeltaTable) -> _Head: ...
        def _put_entry(self, version: int, entry: bytes) -> bool: ...
        def _housekeep(self, version: int, checkpoint: bool = False) -> None: ...
        def _owner_keys(self) -> dict[str, str]: ...
        def _os_error(self, exc: OSError, doing: str) -> ReclockError: ...

    def _orphan_dvs(self, listed: list[tuple[str, int, float]], before: float) -> list[str]:
        """Delete a state table's deletion vector files last written before
        ``before`` that no commit references: neither a live file (the key
        index) nor a replaced vector waiting for its retention, nor any log
        entry still present (older versions read it). A commit killed
        between writing its vectors and its log entry leaves such a file.
        The caller holds the lock."""
        index = self._index_at(self._head_of(self._load()).version)
        if index is None:
            return []
        known = dv_files_in_use(index) | set(retired(index, 2**62))
        old = {name for name, _, mtime in listed if _DV_FILE.fullmatch(name)
               and name not in known and mtime < before}
        if not old:
            return []
        codes = {z85_encode(uuid.UUID(name[16:52]).bytes): name for name in old}
        for entry in log_names(self.location):
            if entry.endswith(".json") and codes:
                text = self.location.read_text(f"_delta_log/{entry}") or ""
                for code in [c for c in codes if c in text]:
                    old.discard(codes.pop(code))
        for name in old:
            self.location.delete(name)
        return sorted(old)

    def _expire_dvs(self, retention_ms: int) -> list[str]:
        """A state table's deletion vector files that no live data file uses
        and that none has used for ``retention_ms`` (older versions, for
        time travel, still may until then); deleted, their names. delta-rs's
        vacuum does not know them: its remove actions name data files. The
        caller holds the lock."""
        index = self._index_at(self._head_of(self._load()).version)
        if index is None:
            return []
        in_use = dv_files_in_use(index)
        due = [p for p in retired(index, int(time.time() * 1000) - retention_ms)
               if p not in in_use]
        for p in due:
            self.location.delete(p)
        forget_retired(index, due)
        return due

    # -- state mode ------------------------------------------------------------------------
    def _ensure_state(self, user_schema: pa.Schema) -> None:
        """Create the state table for ``user_schema`` (one log entry of
        reclock's own: protocol with deletion vectors, metadata), or check
        the existing one holds its columns: new nullable columns and widened
        types are the table's evolution, which the next commit makes with
        its rows (:meth:`_apply_state`), as a log table's (:meth:`_checked`);
        any other difference is a SinkError naming the columns."""
        missing = [k for k in self.key if k not in user_schema.names]
        if missing:
            raise SinkError(f"output {self.name!r}: key columns {missing} are not among the "
                            f"output's columns {user_schema.names}",
                            hint="set key to columns the output has")
        self._user = user_schema
        want = _state_delta_schema(user_schema)
        self.location.makedirs()
        with self._locked():
            try:
                dt = self._open()
            except TableNotFoundError:
                if self.location.local:
                    os.makedirs(os.path.join(self.location.root, "_delta_log"), exist_ok=True)
                self._put_entry(0, _create_entry(want, self.compaction))  # or another's
                dt = self._load()
            p = dt.protocol()
            if "deletionVectors" not in (p.writer_features or []):
                raise SinkError(f"output {self.name!r}: the table at {self.uri} is not a state "
                                "table (no deletion vectors)",
                                hint="write a state output to a new path")
            dt = self._checked(dt, want)
            # the table's columns, in its order, which every file it gets has
            # (DuckDB's delta reader misreads a file whose columns differ)
            self._stored = pa.schema((dt.schema() if self._evolution is None
                                      else self._evolution.schema).to_arrow())
            self._schema = _staged_schema(user_schema)
            self._fresh = dt
        assert self._errors is not None
        self._errors.ensure(user_schema)

    def _index_at(self, version: int) -> KeyIndex | None:
        """The key index, describing ``version`` (rebuilt from the table when
        it describes another one and the log entries in between changed
        files); None when the table's newest version is not ``version``
        (someone committed meanwhile)."""
        try:
            if self._index is None:
                self._index = KeyIndex(self._index_path())
            index = self._index
            have = index.version
        except sqlite3.DatabaseError as exc:
            index = self._reset_index(exc)
            have = None
        if have is not None and have > version and self._logged(have):
            return None  # another committer moved the table on: retry from its version
        if have is not None and have < version and all(
                not _changes_files(self.location.read_text(f"_delta_log/{v:020d}.json"))
                for v in range(have + 1, version + 1)):
            index.mark(version)  # maintenance commits, a retention change: no file moved
            have = version
        if have != version:
            log.info("output %r: rebuilding the key index from the table (it described "
                     "version %s, the table is at %d)", self.name, have, version)
            try:
                if rebuild(index, self.location, self.key, self.name) != version:
                    return None
            except OSError as exc:
                raise self._os_error(exc, "index") from exc
        return index

    def _reset_index(self, exc: sqlite3.DatabaseError) -> KeyIndex:
        """A new, empty key index in place of a damaged one (rebuilt next).
        An index that is busy (another process's commit holds it: a second
        driver without the local lock) or unreadable for a reason of the
        system's is not damaged: a :class:`TransientError`, and it stays."""
        if isinstance(exc, sqlite3.OperationalError):
            raise TransientError(
                f"output {self.name!r}: cannot use the key index of {self.uri}: {exc}",
                hint="another process is committing to this table, or the disk failed; "
                     "retried") from exc
        log.warning("output %r: the key index is damaged (%s): rebuilding it from the table",
                    self.name, exc)
        if self._index is not None:
            with suppress(sqlite3.Error):
                self._index.close()
        for suffix in ("", "-wal", "-shm", "-journal"):
            with suppress(FileNotFoundError):
                os.unlink(self._index_path() + suffix)
        self._index = KeyIndex(self._index_path())
        return self._index

    def _index_path(self) -> str:
        """The key index's file (its directory made)."""
        assert self._index_dir is not None
        os.makedirs(self._index_dir, exist_ok=True)
        return os.path.join(self._index_dir, INDEX_NAME)

    def _commit_state(self, staged: list[dict[str, Any]], expected: SinkState,
                      new: SinkState) -> None:
        """:meth:`commit` of a state table (module docstring of
        :mod:`reclock.sinks.delta_state`): the staged updates consolidated
        per key (:func:`~reclock.contracts.state_table.state_changes`); their
        error rows committed to the errors table first; then one log entry
        v+1, created only if absent, holding the new rows' file, a remove and
        an add per file whose rows they replace or delete (its new deletion
        vector), the txn and the progress. The key index follows in a SQLite
        transaction committed only once the entry exists."""
        version = _encode_txn(new.upper)
        files = [_check_descriptor(self.name, d) for d in staged]
        custom = {KEY_OUTPUT: self.name, KEY_UPPER: _decode_txn(version),
                  KEY_PROGRESS: new.progress, **self._owner_keys()}
        assert self._user is not None, "ensure() first"
        user = self._user.names
        with self._locked():
            data = self._read_staged(files)
            bad = data.filter(pc.is_valid(data.column(ERROR)))
            rows = data.filter(pc.is_null(data.column(ERROR)))
            _check_state_diffs(self.name, rows)
            head = self._head
            for attempt in range(COMMIT_ATTEMPTS):
                head, self._head = self._head, None
                dt: DeltaTable | None = None
                if (attempt > 0 or head is None or head.state != expected
                        or self._evolution is not None or not self._logged(head.version)):
                    dt = self._load()
                    head = self._head_of(dt)
                if head.state != expected:
                    raise SinkFenced(
                        f"output {self.name!r} at {self.uri}: durable state is {head.state}, "
                        f"expected {expected}; nothing was written",
                        hint="another pipeline committed this output; re-read its state")
                evolve = (None if self._evolution is None or dt is None
                          else _metadata_action(dt, self._evolution.schema))
                if not head.direct:
                    raise SinkError(f"output {self.name!r}: the state table at {self.uri} "
                                    "has table features reclock does not write",
                                    hint="write the state output to a new path")
                if attempt == 0 and bad.num_rows:
                    self._commit_errors(bad, expected, new)
                try:
                    landed = self._apply_state(head, rows, user, version, custom, evolve)
                except sqlite3.DatabaseError as exc:
                    self._reset_index(exc)
                    continue
                if not landed:
                    continue
                evo, self._evolution = self._evolution, None
                if evo is not None:
                    log.info("output %r: added columns %s, widened %s", self.name,
                             list(evo.added), list(evo.widened))
                self._head = _Head(head.version + 1, new, True)
                break
            else:
                raise SinkFenced(
                    f"output {self.name!r} at {self.uri}: {COMMIT_ATTEMPTS} commit attempts "
                    "lost to concurrent commits", hint="another writer is busy on this table")
        for d in files:
            self.location.delete(d["path"])
        self._housekeep(head.version + 1)

    def _apply_state(self, head: _Head, rows: pa.Table, user: list[str], version: int,
                     custom: dict[str, Any], evolve: dict[str, Any] | None = None) -> bool:
        """One attempt of :meth:`_commit_state` on top of ``head``: whether
        its log entry landed (False: the version was taken, nothing of it left).
        ``evolve``: the metaData action of the pending evolution, which the
        entry carries first; with a widened column, every live file is
        rewritten in the new type (its rows in their order, so its deletion
        vector and the key index's positions still hold), a remove of the old
        file and an add of the new one (``dataChange: false``) in the entry."""
        index = self._index_at(head.version)
        if index is None:
            return False
        actions: list[dict[str, Any]] = [] if evolve is None else [evolve]
        written: list[str] = []
        now = int(time.time() * 1000)
        # file id -> (its add action, its add in the new type)
        rewritten: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
        evo = self._evolution
        if evolve is not None and evo is not None and evo.widened:
            wide = pa.schema(evo.schema.to_arrow())
            for e in file_entries(index).values():
                name = (f"part-{self._clock.now()}-widen-{uuid.uuid4().hex[:10]}"
                        "-00000-000.parquet")
                t = conform(self.name, self.location.dataset([e.path], wide).to_table(), wide)
                size = self.location.write(name, partial(_write_parquet, t))
                written.append(name)
                st = self.location.stat(name)
                rewritten[e.id] = (e.add, {**e.add, "path": name, "size": size,
                                           "modificationTime": st[1] if st else now,
                                           "dataChange": False})
        found: dict[Any, tuple[int, int]] = {}
        changes = state_changes(self.name, rows, self.key, user,
                                partial(_held, index, found), self.uri)
        changed = set(changes.upsert_keys).union(changes.deletes)
        old = {k: at for k, at in found.items() if k in changed}
        by_file: dict[int, list[int]] = {}
        for f, r in old.values():
            by_file.setdefault(f, []).append(r)
        entries = file_entries(index, set(by_file))
        new_dvs = []
        for fid, e in entries.items():
            dv = e.dv | BitMap(by_file[fid])
            new_dvs.append((e, dv))
        if new_dvs:
            name, descs = write_dvs(self.location, [dv for _, dv in new_dvs])
            written.append(name)
        new_adds = []
        for (e, _), desc in zip(new_dvs, descs if new_dvs else [], strict=True):
            actions.append({"remove": _remove_of(e.add, now)})
            add = {**rewritten.get(e.id, (e.add, e.add))[1], "dataChange": True,
                   "deletionVector": desc,
                   "stats": wide_stats(e.add.get("stats"))}
            actions.append({"add": add})
            new_adds.append(add)
        for fid, (was, add) in rewritten.items():
            if fid not in by_file:  # (those are in the entry with their new vector)
                actions.append({"remove": {**_remove_of(was, now), "dataChange": False}})
                actions.append({"add": add})
        data_add: dict[str, Any] | None = None
        if changes.upserts.num_rows:
            assert self._stored is not None
            table = conform(self.name, _in_microseconds(changes.upserts), self._stored)
            path = (f"part-{self._clock.now()}-state-{uuid.uuid4().hex[:10]}"
                    "-00000-000.parquet")
            data_add = self._write_state_file(path, table, now, written, data_change=True)
            actions.append({"add": data_add})
        entry = _state_entry(actions, self.app_id, version, custom, head.version)
        with index.change(head.version + 1) as ch:
            for fid, (_, add) in rewritten.items():
                rename_file(ch, fid, add["path"], add)
            retire(ch, [e.add.get("deletionVector") for e, _ in new_dvs], now)
            for (e, dv), add in zip(new_dvs, new_adds, strict=True):
                set_dv(ch, e.id, add, dv)
            ch.delete_keys(changes.deletes)
            if data_add is not None:
                fid = add_file(ch, data_add["path"], changes.upserts.num_rows, data_add)
                ch.put_keys(changes.upsert_keys, fid,
                            range(changes.upserts.num_rows))
            faults.crash_point("state_before_log")
            if self._put_entry(head.version + 1, entry):
                # a crash here leaves the index at v: rebuilt at the next commit
                faults.crash_point("state_logged")
                ch.done = True
        if not ch.done:
            for name in written:
                self.location.delete(name)
            return False
        return True

    def _read_staged(self, files: list[dict[str, Any]]) -> pa.Table:
        """The rows of the staged files, each checked to be there with its size."""
        schema = self._schema
        assert schema is not None
        tables = []
        for d in files:
            st = self.location.stat(d["path"])
            if st is None or st[0] != d["size"]:
                raise SinkError(
                    f"output {self.name!r}: staged file {self.location.child(d['path'])} is "
                    + ("gone" if st is None else f"{st[0]} bytes, staged as {d['size']}"),
                    hint="restage the batch")
            tables.append(conform(self.name, self.location.dataset([d["path"]], schema)
                                  .to_table(), schema))
        return pa.concat_tables(tables) if tables else schema.empty_table()

    def _write_state_file(self, path: str, table: pa.Table, now: int, written: list[str], *,
                          data_change: bool) -> dict[str, Any]:
        """Write ``table`` as the data file ``path`` of the state table, noted
        in ``written`` (what a failed commit removes) once it is there, and
        return its ``add`` action (``data_change``: False for a compaction's
        rewrite of rows already there)."""
        size = self.location.write(path, partial(_write_parquet, table))
        written.append(path)
        st = self.location.stat(path)
        return {"path": path, "partitionValues": {}, "size": size,
                "modificationTime": st[1] if st else now, "dataChange": data_change,
                "stats": state_stats(table)}

    def _commit_errors(self, bad: pa.Table, expected: SinkState, new: SinkState) -> None:
        """The error rows of a state commit into the errors table, unless an
        earlier attempt of this commit put them there: only rows at or past
        that table's upper go in (what is below it is there already), and
        only when ``new`` moves it."""
        errs = self._errors
        assert errs is not None
        have = errs.state()
        if have.upper is not None and new.upper is not None and have.upper >= new.upper:
            return
        if have.upper is None and have != SinkState():
            return  # closed
        if have.upper is not None:
            bad = bad.filter(pc.greater_equal(bad.column(INTO_TIME), have.upper))
        staged = errs.stager().stage(f"{self._clock.now()}-err-{uuid.uuid4().hex[:8]}", 0, bad)
        errs.commit(staged, have, SinkState(new.upper, new.progress))

    def _read_state(self, as_of: int | None) -> pa.Table:
        """The current rows (every one with ``_diff`` 1 and provenance zero:
        a state table keeps no source positions), then the error rows up to
        ``as_of`` and below the output's upper; read through delta-rs's
        DataFusion reader, which applies deletion vectors (its Arrow dataset
        refuses such tables)."""
        if not self._exists():
            return pa.schema(META_FIELDS).empty_table()
        current = read_current(self.location)
        user = self._user or pa.schema([f for f in current.schema if f.name != INTO_TIME])
        schema = output_schema(pa.schema([f.with_type(storage_type(f.type)) for f in user]))
        n = current.num_rows
        zeros32 = pa.array([0] * n, pa.int32())
        extra = {DIFF: pa.array([1] * n, pa.int64()), SRC_PART: zeros32,
                 SRC_OFFSET: pa.array([0] * n, pa.int64()), SRC_SEQ: zeros32}
        data = conform(self.name, pa.table(
            {**{c: current.column(c) for c in current.column_names}, **extra}), schema)
        errs = self._errors
        if errs is None or not errs._exists():
            return data
        # the errors table is committed before the state: after a commit that
        # failed in between it holds rows past the output's upper, which the
        # output shows once its own commit lands
        upper = self.state().upper
        if upper is not None:
            as_of = upper - 1 if as_of is None else min(as_of, upper - 1)
        return pa.concat_tables([data, conform(self.name, errs.read_updates(as_of), schema)])

    def _compact_state(self, target_size: int, min_files: int,
                       max_files: int) -> dict[str, int]:
        """Compaction of a state table: the files smaller than ``target_size``
        (when at least ``min_files``) and the files whose deleted share is
        :data:`STATE_PURGE_SHARE` or more are rewritten with only their live
        rows, in one log entry that removes them (with their deletion
        vectors) and adds the new files (``dataChange: false``), carrying
        the output's txn and progress; the key index follows as in a commit."""
        with self._locked():
            dt = self._load()
            head = self._head_of(dt)
            txn = dt.transaction_version(self.app_id)
            if txn is None or not head.direct:
                return {}
            index = self._index_at(head.version)
            if index is None:
                return {}
            stats = live_fraction(index)
            entries = file_entries(index)
            small = [i for i, _, n, d in stats if n - d < STATE_SMALL_ROWS]
            purge = [i for i, _, n, d in stats
                     if n and d / n >= STATE_PURGE_SHARE and n - d >= STATE_SMALL_ROWS]
            candidates = purge + (small if len(small) >= min_files else [])
            live = {i: n - d for i, _, n, d in stats}
            take = bounded_pass(candidates, live, max_files, STATE_PASS_ROWS)
            if len(take) < 2 and not purge:
                return {}
            schema = pa.schema(dt.schema().to_arrow())
            batch = f"{self._clock.now()}{_COMPACTED}{uuid.uuid4().hex[:10]}"
            now = int(time.time() * 1000)
            actions: list[dict[str, Any]] = []
            parts = []
            for fid in take:
                e = entries[fid]
                t = self.location.dataset([e.path], schema).to_table()
                if e.dv:
                    keep = np.ones(t.num_rows, dtype=bool)
                    keep[np.fromiter(e.dv, dtype=np.int64, count=len(e.dv))] = False
                    t = t.filter(pa.array(keep))
                parts.append(t)
                actions.append({"remove": {**_remove_of(e.add, now), "dataChange": False}})
            merged = pa.concat_tables(parts)
            written: list[str] = []
            add: dict[str, Any] | None = None
            new_path = f"part-{batch}-00000-000.parquet"
            if merged.num_rows:
                add = self._write_state_file(new_path, merged, now, written,
                                             data_change=False)
                actions.append({"add": add})
            custom = {KEY_OUTPUT: self.name, KEY_UPPER: _decode_txn(txn),
                      KEY_PROGRESS: head.state.progress, KEY_MAINTENANCE: "compact",
                      **self._owner_keys()}
            entry = _state_entry(actions, self.app_id, txn, custom, head.version,
                                 operation="OPTIMIZE")
            with index.change(head.version + 1) as ch:
                retire(ch, [entries[i].add.get("deletionVector") for i in take], now)
                nid = 0 if add is None else add_file(ch, new_path, merged.num_rows, add)
                moves, base = [], 0
                for i, part in zip(take, parts, strict=True):
                    moves.append((i, nid, base, entries[i].dv))
                    base += part.num_rows
                ch.move_files(moves)
                if self._put_entry(head.version + 1, entry):
                    ch.done = True
            if not ch.done:
                for name in written:
                    self.location.delete(name)
                return {}
            if self._head is not None and self._head.version == head.version:
                self._head = _Head(head.version + 1, self._head.state, True)
        removed = sum(int(entries[i].add["size"]) for i in take)
        log.info("output %r: compacted %d state files into %d", self.name, len(take),
                 len(written))
        self._housekeep(head.version + 1)
        return {"files_removed": len(take), "files_added": len(written),
                "bytes_removed": removed, "bytes_added": int(add["size"]) if add else 0,
                "files_left": len(candidates) - len(take)}


#: State tables: a compaction rewrites a file once this share of its rows is
#: deleted, and merges files of fewer live rows than this (when there are
#: ``min_files`` of them), at most this many live rows a pass (the next pass
#: follows on the next tick).
STATE_PURGE_SHARE = 0.3
STATE_SMALL_ROWS = 100_000
STATE_PASS_ROWS = 1_000_000


def _staged_schema(user: pa.Schema) -> pa.Schema:
    """What a state output's stager writes: the update rows, as a log's."""
    return pa.schema(_delta_schema(user).to_arrow())


def _state_delta_schema(user: pa.Schema) -> Schema:
    """A state table's Delta schema: the user columns as Delta stores them,
    then ``_into_time`` (the IntoTime of the row's last change)."""
    return Schema.from_arrow(pa.schema(
        [*(f.with_type(storage_type(f.type)) for f in user),
         pa.field(INTO_TIME, pa.int64(), nullable=False)]))


def _create_entry(schema: Schema, compaction: _Retention | None) -> bytes:
    """Log entry 0 of a state table: reader 3 / writer 7 with the
    ``deletionVectors`` feature (and ``invariants``, which its NOT NULL
    ``_into_time`` implies, and ``timestampNtz`` when a column needs it)."""
    ntz = any(pa.types.is_timestamp(f.type) and f.type.tz is None
              for f in pa.schema(schema.to_arrow()))
    reader = ["deletionVectors", *(["timestampNtz"] if ntz else [])]
    writer = ["deletionVectors", "invariants", *(["timestampNtz"] if ntz else [])]
    conf = {"delta.enableDeletionVectors": "true"}
    if compaction is not None:
        conf[RETENTION_PROPERTY] = _interval(compaction.removes_kept_hours)
    now = int(time.time() * 1000)
    lines = [
        {"commitInfo": {"timestamp": now, "operation": "CREATE TABLE",
                        "operationParameters": {"mode": "ErrorIfExists"},
                        "engineInfo": _ENGINE, "clientVersion": _ENGINE}},
        {"protocol": {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": reader,
                      "writerFeatures": writer}},
        {"metaData": {"id": str(uuid.uuid4()), "format": {"provider": "parquet", "options": {}},
                      "schemaString": schema.to_json(), "partitionColumns": [],
                      "configuration": conf, "createdTime": now}},
    ]
    return "".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines).encode()


def _changes_files(text: str | None) -> bool:
    """Whether a log entry adds or removes files (None: it is gone: assume so)."""
    if text is None:
        return True
    return any(line.lstrip()[:8] in ('{"add":', '{"remove') or '"add"' in line[:10]
               or '"remove"' in line[:12] for line in text.splitlines())


def _held(index: KeyIndex, found: dict[Any, tuple[int, int]], keys: list[Any]) -> set[Any]:
    """Which of ``keys`` have a row (their places go into ``found``)."""
    found.update(index.lookup(keys))
    return set(found)


def _check_state_diffs(output: str, rows: pa.Table) -> None:
    bad = pc.sum(pc.invert(pc.is_in(rows.column(DIFF), pa.array([-1, 1], pa.int64()))))
    if (bad.as_py() or 0) > 0:
        raise SinkError(
            f"output {output!r}: {bad.as_py()} rows have a _diff other than -1 or 1; a state "
            "table applies retractions (-1) and insertions (+1) only",
            hint="write consolidated updates (an upsert or debezium envelope)")


def _remove_of(add: dict[str, Any], now: int) -> dict[str, Any]:
    """The remove action of the logical file ``add`` (its deletion vector
    included: it names which version of the file goes)."""
    r = {"path": add["path"], "deletionTimestamp": now, "dataChange": True,
         "extendedFileMetadata": True, "partitionValues": add.get("partitionValues") or {},
         "size": add["size"]}
    if add.get("deletionVector"):
        r["deletionVector"] = add["deletionVector"]
    return r


def _state_entry(actions: list[dict[str, Any]], app_id: str, txn: int, custom: Mapping[str, Any],
                 read_version: int, operation: str = "MERGE") -> bytes:
    """A state table's log entry: commitInfo, ``actions`` (Delta's own field
    names), the output's txn."""
    now = int(time.time() * 1000)
    info = {"timestamp": now, "operation": operation,
            "operationParameters": {"reclock": "state"}, "readVersion": read_version,
            "isBlindAppend": False, "engineInfo": _ENGINE, "clientVersion": _ENGINE, **custom}
    lines: list[dict[str, Any]] = [{"commitInfo": info}, *actions,
                                   {"txn": {"appId": app_id, "version": txn, "lastUpdated": now}}]
    return "".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines).encode()


def read_current(location: Location) -> pa.Table:
    """The live rows of a state table (deletion vectors applied), through
    delta-rs's DataFusion reader."""
    dt = DeltaTable(location.uri, storage_options=location.storage_options())
    reader = QueryBuilder().register("t", dt).execute("SELECT * FROM t")
    table = pa.table(reader.read_all())
    # DataFusion answers strings and binaries as views: back to the plain types
    plain = {pa.string_view(): pa.string(), pa.binary_view(): pa.binary()}
    return table.cast(pa.schema([f.with_type(plain.get(f.type, f.type)) for f in table.schema]))
