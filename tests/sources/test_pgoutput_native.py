"""The C pgoutput decoder against the Python one, on generated streams.

``sources/postgres/_pgoutput_native.c`` must decode every frame as
``sources/postgres/pgoutput.py`` does (message by message), fail on the same
malformed frames with ProtocolError (never crash), and give
``PostgresReader`` the same batches row by row, errors included, as the
Python path. Hypothesis draws the streams (derandomized: the same examples
every run).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reclock.core.columns import SRC_DIFF, SRC_UNCHANGED
from reclock.core.errors import DefiniteError, ReclockError
from reclock.sources.postgres import pgoutput as po
from reclock.sources.postgres import source as pgsource
from reclock.sources.postgres.catalog import PgColumn, PgTable
from reclock.sources.postgres.source import PostgresReader, StreamSpec, _Decoding
from reclock.sources.postgres.types import INT8, TEXT, PgType

NATIVE = po.native()
pytestmark = pytest.mark.skipif(NATIVE is None, reason="the C extension was not built")
FUZZ = settings(max_examples=300, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# -- frames ------------------------------------------------------------------------


def cstr(s: str) -> bytes:
    return s.encode() + b"\0"


def tup(values: list[Any], binary: bool = False) -> bytes:
    out = [struct.pack("!h", len(values))]
    for v in values:
        if v is None:
            out.append(b"n")
        elif v is po.UNCHANGED_TOAST:
            out.append(b"u")
        else:
            out.append((b"b" if binary else b"t") + struct.pack("!i", len(v)) + v)
    return b"".join(out)


def xlog(msg: bytes, start: int = 0, end: int = 0, ts: int = 0) -> bytes:
    return b"w" + struct.pack("!QQq", start, end, ts) + msg


def keepalive(end: int, ts: int = 0, reply: int = 0) -> bytes:
    return b"k" + struct.pack("!QqB", end, ts, reply)


def begin(lsn: int, ts: int, xid: int = 1) -> bytes:
    return b"B" + struct.pack("!QqI", lsn, ts, xid)


def commit(lsn: int, ts: int = 0) -> bytes:
    return b"C" + struct.pack("!BQQq", 0, lsn, lsn + 8, ts)


def relation(relid: int, ns: str, name: str, ident: str,
             cols: list[tuple[int, str, int, int]]) -> bytes:
    return (b"R" + struct.pack("!I", relid) + cstr(ns) + cstr(name) + ident.encode()
            + struct.pack("!h", len(cols))
            + b"".join(struct.pack("!B", f) + cstr(n) + struct.pack("!Ii", o, m)
                       for f, n, o, m in cols))


def insert(relid: int, new: list[Any]) -> bytes:
    return b"I" + struct.pack("!I", relid) + b"N" + tup(new)


def update(relid: int, old: list[Any] | None, kind: bytes, new: list[Any]) -> bytes:
    head = b"" if old is None else kind + tup(old)
    return b"U" + struct.pack("!I", relid) + head + b"N" + tup(new)


def delete(relid: int, kind: bytes, old: list[Any]) -> bytes:
    return b"D" + struct.pack("!I", relid) + kind + tup(old)


def truncate(relids: list[int], opts: int = 0) -> bytes:
    return b"T" + struct.pack("!iB", len(relids), opts) + b"".join(
        struct.pack("!I", r) for r in relids)


# -- message by message ---------------------------------------------------------------

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
name = st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)),
               max_size=12)
value = st.one_of(st.none(), st.just(po.UNCHANGED_TOAST), st.binary(max_size=20),
                  st.text(max_size=8).map(str.encode))
values = st.lists(value, max_size=8)


@st.composite
def message(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from("BCRYOIUDTM"))
    if kind == "B":
        return b"B" + struct.pack("!QqI", draw(u64), draw(i64), draw(u32))
    if kind == "C":
        return b"C" + struct.pack("!BQQq", draw(st.integers(0, 255)), draw(u64), draw(u64),
                                  draw(i64))
    if kind == "R":
        cols = draw(st.lists(st.tuples(st.integers(0, 255), name, u32,
                                       st.integers(-(2**31), 2**31 - 1)), max_size=6))
        return relation(draw(u32), draw(name), draw(name), draw(st.sampled_from("dnfi")), cols)
    if kind == "Y":
        return b"Y" + struct.pack("!I", draw(u32)) + cstr(draw(name)) + cstr(draw(name))
    if kind == "O":
        return b"O" + struct.pack("!Q", draw(u64)) + cstr(draw(name))
    if kind == "I":
        return b"I" + struct.pack("!I", draw(u32)) + b"N" + tup(draw(values), draw(st.booleans()))
    if kind == "U":
        old = draw(st.one_of(st.none(), values))
        return update(draw(u32), old, draw(st.sampled_from([b"K", b"O"])), draw(values))
    if kind == "D":
        return delete(draw(u32), draw(st.sampled_from([b"K", b"O"])), draw(values))
    if kind == "T":
        return truncate(draw(st.lists(u32, max_size=4)), draw(st.integers(0, 255)))
    content = draw(st.binary(max_size=16))
    return (b"M" + struct.pack("!BQ", draw(st.integers(0, 255)), draw(u64)) + cstr(draw(name))
            + struct.pack("!i", len(content)) + content)


frame = st.one_of(
    st.builds(xlog, message(), u64, u64, i64),
    st.builds(keepalive, u64, i64, st.integers(0, 255)),
)


def outcome(parse: Callable[[bytes], Any], data: bytes) -> Any:
    """What parsing ``data`` gives: the frame, or the ProtocolError class."""
    try:
        return parse(data)
    except po.ProtocolError:
        return po.ProtocolError


@FUZZ
@given(st.lists(frame, min_size=1, max_size=20))
def test_frames_decode_alike(frames: list[bytes]) -> None:
    for f in frames:
        assert NATIVE.parse_frame(f) == po.parse_frame(f)


@FUZZ
@given(frame, st.data())
def test_truncated_and_corrupt_frames_fail_alike(f: bytes, data: st.DataObject) -> None:
    for cut in range(len(f)):  # every truncation
        assert outcome(NATIVE.parse_frame, f[:cut]) is po.ProtocolError
        assert outcome(po.parse_frame, f[:cut]) is po.ProtocolError
    bad = bytearray(f)
    for _ in range(data.draw(st.integers(1, 4))):  # a few bytes changed
        bad[data.draw(st.integers(0, len(bad) - 1))] = data.draw(st.integers(0, 255))
    assert outcome(NATIVE.parse_frame, bytes(bad)) == outcome(po.parse_frame, bytes(bad))
    tail = data.draw(st.binary(max_size=4))  # bytes past the message are ignored alike
    assert outcome(NATIVE.parse_frame, f + tail) == outcome(po.parse_frame, f + tail)


def test_unknown_tags_and_negative_lengths_are_protocol_errors() -> None:
    for bad in [b"", b"x", b"k\0", xlog(b""), xlog(b"Z"), xlog(b"I\0\0\0\1X"),
                xlog(b"I\0\0\0\1N\0\1t\xff\xff\xff\xff"), xlog(b"I\0\0\0\1N\xff\xff"),
                xlog(b"I\0\0\0\1N\0\1q"), xlog(truncate([1])[:-1]),
                xlog(b"T\xff\xff\xff\xff\0"), xlog(b"Y\0\0\0\1\xff\0x\0"),
                xlog(relation(1, "s", "t", "d", [])[:-2] + b"\x80\0")]:
        with pytest.raises(po.ProtocolError):
            NATIVE.parse_frame(bad)
        with pytest.raises(po.ProtocolError):
            po.parse_frame(bad)


# -- row by row through PostgresReader ----------------------------------------------------

I8, TX = PgType(INT8, -1, "bigint"), PgType(TEXT, -1, "text")
KEYED = PgTable(100, "public", "keyed", "keyed",
                (PgColumn("id", I8, True), PgColumn("a", TX, False), PgColumn("b", TX, False),
                 PgColumn("g", TX, False, gone=True)), "d", key=("id",), primary_key=("id",))
FULL = PgTable(200, "public", "full", "full", (PgColumn("id", I8, True),
                                                PgColumn("v", TX, False)),
               "f", key=("id",), primary_key=("id",))
TABLES = (KEYED, FULL)
#: relid -> (table name, its columns upstream: (name, oid))
RELS = {100: ("keyed", [("id", INT8), ("a", TEXT), ("b", TEXT)]),
        200: ("full", [("id", INT8), ("v", TEXT)]),
        300: ("other", [("x", TEXT)])}
text = st.one_of(st.none(), st.sampled_from(["", "a", "é", "日本", "x" * 30]),
                 st.text(max_size=6)).map(lambda s: None if s is None else s.encode())
key = st.integers(1, 4).map(lambda k: str(k).encode())


@st.composite
def stream(draw: st.DrawFn) -> tuple[list[bytes], StreamSpec, int]:
    """A replication stream of the three relations (upserts, diffs and a
    table no output reads), with keepalives, relation messages re-sent in
    another column order, logical/type/origin messages, and now and then a
    change the reader must refuse (an old row missing, TOAST it cannot
    fill, a diff log truncated)."""
    frames: list[bytes] = []
    order: dict[int, list[int]] = {}
    lsn = 1000
    odd = draw(st.integers(0, 3)) == 0  # changes that end in an error are allowed

    def rel(relid: int) -> None:
        cols = RELS[relid][1]
        idx = draw(st.permutations(range(len(cols))))
        order[relid] = idx
        frames.append(xlog(relation(relid, "public", RELS[relid][0], "f" if relid == 200
                                    else "d", [(1 if cols[j][0] == "id" else 0, cols[j][0],
                                                cols[j][1], -1) for j in idx])))

    def row(relid: int, vals: dict[str, Any]) -> list[Any]:
        cols = RELS[relid][1]
        return [vals.get(cols[j][0]) for j in order[relid]]

    for _ in range(draw(st.integers(2, 10))):
        lsn += draw(st.integers(1, 200))
        frames.append(xlog(begin(lsn, draw(st.integers(-(10**12), 10**15)))))
        for _ in range(draw(st.integers(1, 12))):
            what = draw(st.sampled_from(["ins", "ins", "upd", "upd", "del", "rel", "keep", "misc",
                                         "trunc"]))
            relid = draw(st.sampled_from([100, 100, 200, 200, 300]))
            if relid not in order and what != "keep":
                if relid == 300 and draw(st.booleans()):
                    frames.append(xlog(insert(300, [b"x"])))  # before any relation message
                    continue
                rel(relid)
            if what == "rel":
                rel(relid)
            elif what == "keep":
                frames.append(keepalive(draw(st.integers(0, lsn - 1)), 0, draw(st.integers(0, 1))))
            elif what == "misc":
                frames.append(xlog(draw(st.sampled_from([
                    b"Y" + struct.pack("!I", 9) + cstr("public") + cstr("mood"),
                    b"O" + struct.pack("!Q", 5) + cstr("origin"),
                    b"M" + struct.pack("!BQ", 1, lsn) + cstr("pfx") + struct.pack("!i", 2) + b"hi",
                ]))))
            elif what == "trunc":
                if relid == 200 and not odd:
                    continue
                frames.append(xlog(truncate([relid])))
            elif relid == 300:
                frames.append(xlog(insert(300, [draw(text)])))
            elif relid == 100:
                new = {"id": draw(key), "a": draw(text), "b": draw(text)}
                if what == "ins":
                    frames.append(xlog(insert(100, row(100, new))))
                elif what == "del":
                    frames.append(xlog(delete(100, b"K", row(100, {"id": draw(key)}))))
                else:
                    if draw(st.booleans()):
                        new["b"] = po.UNCHANGED_TOAST
                    if odd and draw(st.integers(0, 9)) == 0:
                        new["id"] = po.UNCHANGED_TOAST  # refused: a key left unchanged
                    old = row(100, {"id": draw(key)}) if draw(st.booleans()) else None
                    frames.append(xlog(update(100, old, b"K", row(100, new))))
            else:
                old = {"id": draw(key), "v": draw(text)}
                new = {"id": draw(key), "v": draw(text)}
                if what == "ins":
                    frames.append(xlog(insert(200, row(200, new))))
                elif what == "del":
                    kind = b"K" if odd and draw(st.integers(0, 5)) == 0 else b"O"
                    frames.append(xlog(delete(200, kind, row(200, old))))
                else:
                    if draw(st.booleans()):
                        new["v"] = po.UNCHANGED_TOAST  # filled from the old row
                    if odd and draw(st.integers(0, 5)) == 0:
                        old["v"] = po.UNCHANGED_TOAST  # refused: nowhere to fill it from
                    missing = odd and draw(st.integers(0, 5)) == 0
                    frames.append(xlog(update(200, None if missing else row(200, old), b"O",
                                              row(200, new))))
        frames.append(xlog(commit(lsn)))
    end = lsn + 1 if draw(st.booleans()) else draw(st.integers(1000, lsn + 1))
    if draw(st.booleans()):
        frames.insert(draw(st.integers(0, len(frames))), keepalive(draw(st.integers(0, lsn + 9))))
    snap = ((0, draw(st.integers(1000, lsn))),) if draw(st.integers(0, 3)) == 0 else ()
    return frames, StreamSpec(0, end, snap), draw(st.integers(1, 64))


def decode(frames: list[bytes], spec: StreamSpec, per_batch: int, native: bool
           ) -> tuple[list[tuple[int, list[dict[str, Any]]]], str | None, int]:
    reader = PostgresReader("pg", "postgresql://u@localhost/db", "s", "p", TABLES, 5.0,
                            native=native)
    st_ = _Decoding(reader, {}, spec)
    replies = []
    batches = [frames[i:i + per_batch] for i in range(0, len(frames), per_batch)]
    out: list[tuple[int, list[dict[str, Any]]]] = []
    err = None
    try:
        for i, b in reader.decode(st_, batches, lambda: replies.append(1)):
            out.append((i, b.to_pylist()))
        for i, b in st_.rest():
            out.append((i, b.to_pylist()))
    except (ReclockError, ValueError, IndexError, TypeError) as exc:
        err = f"{type(exc).__name__}: {exc}" if isinstance(exc, ReclockError) else \
            type(exc).__name__
    return out, err, len(replies)


@settings(FUZZ, max_examples=200)
@given(stream())
def test_the_reader_gets_the_same_rows(monkeypatch_batch: None,
                                       case: tuple[list[bytes], StreamSpec, int]) -> None:
    frames, spec, per_batch = case
    native = decode(frames, spec, per_batch, native=True)
    python = decode(frames, spec, per_batch, native=False)
    assert native == python


@pytest.fixture(scope="module")
def monkeypatch_batch() -> Any:
    """Small batches, so that the decoders' batch ends are compared too."""
    mp = pytest.MonkeyPatch()
    mp.setattr(pgsource, "BATCH_ROWS", 5)
    yield None
    mp.undo()


def test_rows_carry_positions_diffs_and_unchanged_columns(monkeypatch_batch: None) -> None:
    """A worked example, against the model: what each change becomes."""
    t = 10**12
    frames = [xlog(begin(2000, t)),
              xlog(relation(100, "public", "keyed", "d", [(1, "id", INT8, -1),
                                                          (0, "b", TEXT, -1),
                                                          (0, "a", TEXT, -1)])),
              xlog(insert(100, [b"1", None, "é".encode()])),
              xlog(update(100, [b"1", None, None], b"K", [b"2", po.UNCHANGED_TOAST, b""])),
              xlog(delete(100, b"K", [b"2", None, None])),
              xlog(relation(200, "public", "full", "f", [(1, "id", INT8, -1),
                                                         (0, "v", TEXT, -1)])),
              xlog(update(200, [b"7", b"old"], b"O", [b"7", po.UNCHANGED_TOAST])),
              xlog(commit(2000)),
              keepalive(2100),
              xlog(begin(3000, t)),  # at the end: not read
              xlog(insert(100, [b"9", None, None])),
              xlog(commit(3000))]
    rows, err, replies = decode(frames, StreamSpec(0, 3000), 3, native=True)
    assert err is None and replies == 1
    ts = (t + po.PG_EPOCH_US) // 1000
    meta = {"_src_part": 0, "_src_offset": 2000, "_src_ts": ts}
    assert rows == [
        (0, [{"id": 1, "a": "é", "b": None, "g": None, **meta, "_src_seq": 1, SRC_DIFF: 1,
              SRC_UNCHANGED: None},
             {"id": 1, "a": None, "b": None, "g": None, **meta, "_src_seq": 2, SRC_DIFF: 0,
              SRC_UNCHANGED: None},
             {"id": 2, "a": "", "b": None, "g": None, **meta, "_src_seq": 3, SRC_DIFF: 1,
              SRC_UNCHANGED: [2]},
             {"id": 2, "a": None, "b": None, "g": None, **meta, "_src_seq": 4, SRC_DIFF: 0,
              SRC_UNCHANGED: None}]),
        (1, [{"id": 7, "v": "old", **meta, "_src_seq": 6, SRC_DIFF: -1},
             {"id": 7, "v": "old", **meta, "_src_seq": 7, SRC_DIFF: 1}]),
    ]
    assert decode(frames, StreamSpec(0, 3000), 3, native=False)[:2] == (rows, None)


def test_refused_changes_are_the_python_paths_errors() -> None:
    frames = [xlog(begin(2000, 0)),
              xlog(relation(200, "public", "full", "f", [(1, "id", INT8, -1),
                                                         (0, "v", TEXT, -1)])),
              xlog(update(200, None, b"O", [b"7", b"v"]))]
    got = decode(frames, StreamSpec(0, 9000), 10, native=True)
    assert got[1] is not None and "came without its old row" in got[1]
    assert got == decode(frames, StreamSpec(0, 9000), 10, native=False)
    with pytest.raises(DefiniteError, match="truncated at LSN"):
        reader = PostgresReader("pg", "postgresql://u@localhost/db", "s", "p", TABLES, 5.0)
        list(reader.decode(_Decoding(reader, {}, StreamSpec(0, 9000)),
                           [[*frames[:2], xlog(truncate([200]))]], lambda: None))
