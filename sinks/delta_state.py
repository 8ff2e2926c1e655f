"""The pieces of a Delta state table (``mode: state`` of the Delta sink, see
:mod:`reclock.sinks.delta`): deletion vectors and the key index.

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
import os
import struct
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pyroaring import BitMap

from reclock.contracts.sink import SinkError
from reclock.contracts.state_table import key_values
from reclock.sinks._keyindex import LOOKUP_CHUNK, Changes
from reclock.sinks._keyindex import KeyIndex as KeyIndex
from reclock.sinks._store import Location

#: RoaringBitmapArray's magic number (Delta PROTOCOL.md).
DV_MAGIC = 1681511377
#: The key index's file name, in the table's directory.
INDEX_NAME = "_reclock_keys.sqlite"

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
