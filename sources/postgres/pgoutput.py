"""The logical replication wire format, as plain values.

A walsender in ``START_REPLICATION ... LOGICAL`` mode sends CopyData frames::

    'w' XLogData       wal_start, wal_end, send_time, then one pgoutput message
    'k' keepalive      wal_end, send_time, reply_requested

and the client answers with standby status updates (``'r'``: written,
flushed, applied LSNs). Only the flushed LSN releases WAL: reclock reports the
resumption frontier there and nothing else.

pgoutput messages (protocol version 1; text-format tuples)::

    B begin     final_lsn, commit_ts, xid
    C commit    flags, commit_lsn, end_lsn, commit_ts
    R relation  relid, namespace, name, replica identity, columns (flags, name, type oid, typmod)
    Y type      oid, namespace, name
    O origin    lsn, name
    I insert    relid, new tuple
    U update    relid, old key / old tuple (optional), new tuple
    D delete    relid, old key / old tuple
    T truncate  relids, options
    M message   flags, lsn, prefix, content

Tuple columns are ``None`` (NULL), :data:`UNCHANGED_TOAST` (a TOASTed value
the update did not change and the server did not send), or the value's text
form as ``bytes``. Everything here is pure: no connection, no state. A
frame that does not follow the protocol (truncated, an unknown tag, a
negative length or count, a name that is not UTF-8) is a
:class:`ProtocolError`.

:func:`native` is the C twin of this module
(``sources/postgres/_pgoutput_native.c``): its ``parse_frame`` returns the
same dataclasses (tests/sources/test_pgoutput_native.py fuzzes the two
against each other), and its ``Decoder`` turns batches of frames into the
source's column buffers (see ``PostgresReader`` in source.py).
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from typing import Any

from reclock.core.errors import DefiniteError

log = logging.getLogger("reclock.postgres")


class ProtocolError(DefiniteError):
    """A frame or message that does not follow the protocol."""


class _Unchanged:
    _instance: _Unchanged | None = None

    def __new__(cls) -> _Unchanged:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED_TOAST"


#: A TOASTed column value that an UPDATE left unchanged (not sent).
UNCHANGED_TOAST = _Unchanged()

Value = bytes | None | _Unchanged
Tuple = tuple[Value, ...]


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type_oid: int
    type_modifier: int
    key: bool


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int
    commit_ts: int  # microseconds since 2000-01-01
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int


@dataclass(frozen=True, slots=True)
class Relation:
    relid: int
    namespace: str
    name: str
    replica_identity: str  # 'd' default, 'n' nothing, 'f' full, 'i' index
    columns: tuple[Column, ...]


@dataclass(frozen=True, slots=True)
class TypeInfo:
    oid: int
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class Origin:
    lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class Insert:
    relid: int
    new: Tuple


@dataclass(frozen=True, slots=True)
class Update:
    relid: int
    old: Tuple | None  # old key ('K') or old row ('O'), when sent
    old_is_key: bool
    new: Tuple


@dataclass(frozen=True, slots=True)
class Delete:
    relid: int
    old: Tuple
    old_is_key: bool


@dataclass(frozen=True, slots=True)
class Truncate:
    relids: tuple[int, ...]
    cascade: bool
    restart_identity: bool


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


Message = (Begin | Commit | Relation | TypeInfo | Origin | Insert | Update | Delete | Truncate
           | LogicalMessage)


@dataclass(frozen=True, slots=True)
class XLogData:
    wal_start: int
    wal_end: int
    send_time: int
    message: Message


@dataclass(frozen=True, slots=True)
class Keepalive:
    wal_end: int
    send_time: int
    reply_requested: bool


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> bytes:
        if n < 0:
            raise ProtocolError(f"negative length {n} at {self.pos}")
        if self.pos + n > len(self.buf):
            raise ProtocolError(f"message truncated: wanted {n} bytes at {self.pos} of "
                                f"{len(self.buf)}")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def i16(self) -> int:
        return int(struct.unpack("!h", self.take(2))[0])

    def i32(self) -> int:
        return int(struct.unpack("!i", self.take(4))[0])

    def u32(self) -> int:
        return int(struct.unpack("!I", self.take(4))[0])

    def i64(self) -> int:
        return int(struct.unpack("!q", self.take(8))[0])

    def u64(self) -> int:
        return int(struct.unpack("!Q", self.take(8))[0])

    def string(self) -> str:
        end = self.buf.find(b"\0", self.pos)
        if end < 0:
            raise ProtocolError("unterminated string")
        try:
            s = self.buf[self.pos:end].decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(f"string at {self.pos} is not UTF-8") from None
        self.pos = end + 1
        return s

    def count(self, n: int) -> int:
        if n < 0:
            raise ProtocolError(f"negative column count {n}")
        return n

    def tuple(self) -> Tuple:
        n = self.count(self.i16())
        out: list[Value] = []
        for _ in range(n):
            kind = self.take(1)
            if kind == b"n":
                out.append(None)
            elif kind == b"u":
                out.append(UNCHANGED_TOAST)
            elif kind in (b"t", b"b"):
                out.append(self.take(self.i32()))
            else:
                raise ProtocolError(f"unknown tuple column kind {kind!r}")
        return tuple(out)


def parse_message(data: bytes) -> Message:
    """One pgoutput message."""
    r = _Reader(bytes(data))
    tag = r.take(1)
    if tag == b"B":
        return Begin(r.u64(), r.i64(), r.u32())
    if tag == b"C":
        return Commit(r.u8(), r.u64(), r.u64(), r.i64())
    if tag == b"R":
        relid, ns, name, ident = r.u32(), r.string(), r.string(), chr(r.u8())
        cols = []
        for _ in range(r.count(r.i16())):
            flags = r.u8()
            cname = r.string()
            cols.append(Column(cname, r.u32(), r.i32(), bool(flags & 1)))
        return Relation(relid, ns, name, ident, tuple(cols))
    if tag == b"Y":
        return TypeInfo(r.u32(), r.string(), r.string())
    if tag == b"O":
        return Origin(r.u64(), r.string())
    if tag == b"I":
        relid = r.u32()
        if r.take(1) != b"N":
            raise ProtocolError("insert without a new tuple")
        return Insert(relid, r.tuple())
    if tag == b"U":
        relid = r.u32()
        kind = r.take(1)
        old: Tuple | None = None
        old_is_key = False
        if kind in (b"K", b"O"):
            old_is_key = kind == b"K"
            old = r.tuple()
            kind = r.take(1)
        if kind != b"N":
            raise ProtocolError(f"update without a new tuple (got {kind!r})")
        return Update(relid, old, old_is_key, r.tuple())
    if tag == b"D":
        relid = r.u32()
        kind = r.take(1)
        if kind not in (b"K", b"O"):
            raise ProtocolError(f"delete without an old tuple (got {kind!r})")
        return Delete(relid, r.tuple(), kind == b"K")
    if tag == b"T":
        n = r.i32()
        opts = r.u8()
        if n < 0:
            raise ProtocolError(f"negative relation count {n}")
        return Truncate(tuple(r.u32() for _ in range(n)), bool(opts & 1), bool(opts & 2))
    if tag == b"M":
        flags = r.u8()
        lsn = r.u64()
        prefix = r.string()
        return LogicalMessage(bool(flags & 1), lsn, prefix, r.take(r.i32()))
    raise ProtocolError(f"unknown pgoutput message {tag!r}")


def parse_frame(data: bytes) -> XLogData | Keepalive:
    """One CopyData frame of the replication stream."""
    r = _Reader(bytes(data))
    tag = r.take(1)
    if tag == b"w":
        start, end, ts = r.u64(), r.u64(), r.i64()
        return XLogData(start, end, ts, parse_message(r.buf[r.pos:]))
    if tag == b"k":
        return Keepalive(r.u64(), r.i64(), bool(r.u8()))
    raise ProtocolError(f"unknown replication frame {tag!r}")


#: Microseconds between the Unix epoch and Postgres' epoch (2000-01-01).
PG_EPOCH_US = 946_684_800_000_000


def standby_status(written: int, flushed: int, applied: int, now_us: int,
                   reply: bool = False) -> bytes:
    """A standby status update ('r') reporting LSNs; ``now_us`` is Unix time in us."""
    return b"r" + struct.pack("!QQQqB", written, flushed, applied, now_us - PG_EPOCH_US,
                              1 if reply else 0)


_native: Any = None  # the C module once loaded and initialized; False if it cannot be


def native() -> Any:
    """``reclock.sources.postgres._pgoutput_native``, initialized with this
    module's error and dataclasses, or None where it was not built (no C
    compiler at install) or cannot load: the callers then use this module."""
    global _native
    if _native is None:
        try:
            from reclock.clients.native import load_extension

            mod = load_extension("reclock.sources.postgres", "_pgoutput_native")
            if mod is None:
                raise ImportError("reclock.sources.postgres._pgoutput_native was not built "
                                  "(no C compiler?)")
            mod.init(ProtocolError, UNCHANGED_TOAST, {
                c.__name__: c for c in (XLogData, Keepalive, Begin, Commit, Relation, Column,
                                        TypeInfo, Origin, Insert, Update, Delete, Truncate,
                                        LogicalMessage)})
            _native = mod
        except (ImportError, OSError) as exc:
            log.warning("the native pgoutput decoder is unavailable (%s); decoding in Python",
                        exc)
            _native = False
    return _native or None
