"""The pgoutput parser on real messages from the private logical cluster."""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import pq

from reclock.sources.postgres.pgoutput import (
    UNCHANGED_TOAST,
    Begin,
    Commit,
    Delete,
    Insert,
    Keepalive,
    ProtocolError,
    Relation,
    Truncate,
    Update,
    parse_frame,
    parse_message,
    standby_status,
)


def stream(url: str, slot: str, pub: str, want: int, timeout: float = 10) -> list[Any]:
    """The parsed pgoutput messages of ``slot`` until ``want`` commits arrived."""
    conn = psycopg.connect(url, replication="database", autocommit=True)
    out: list[Any] = []
    try:
        pg = conn.pgconn
        pg.send_query(f"START_REPLICATION SLOT {slot} LOGICAL 0/0 "
                      f"(proto_version '1', publication_names '{pub}')".encode())
        res = pg.get_result()
        assert res is not None and res.status == pq.ExecStatus.COPY_BOTH
        deadline = time.monotonic() + timeout
        commits = 0
        while commits < want and time.monotonic() < deadline:
            n, data = pg.get_copy_data(0)
            if n <= 0:
                break
            frame = parse_frame(data)
            if isinstance(frame, Keepalive):
                if frame.reply_requested:
                    pg.put_copy_data(standby_status(0, 0, 0, time.time_ns() // 1000))
                    pg.flush()
                continue
            out.append(frame.message)
            commits += isinstance(frame.message, Commit)
    finally:
        conn.close()
    return out


def test_messages_of_real_transactions(pg_logical: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    slot, pub, table = f"s_{tag}", f"p_{tag}", f"t_{tag}"
    big = "x" * 10_000  # TOASTed
    with psycopg.connect(pg_logical.url, autocommit=True) as c:
        c.execute(f"create table {table} (id int primary key, v text, n numeric(10,2), "
                  "j jsonb, b bytea, big text)")
        # out of line, uncompressed: an update that leaves it alone does not send it
        c.execute(f"alter table {table} alter column big set storage external")
        c.execute(f"create publication {pub} for table {table}")
        c.execute(f"select pg_create_logical_replication_slot('{slot}', 'pgoutput')")
        with c.transaction():
            c.execute(f"insert into {table} values (1, 'a', 1.50, '{{\"k\": 1}}', '\\x0102', %s)",
                      (big,))
            c.execute(f"insert into {table} values (2, null, null, null, null, null)")
        c.execute(f"update {table} set v = 'b' where id = 1")  # big unchanged: TOAST
        c.execute(f"delete from {table} where id = 2")
        c.execute(f"truncate {table}")
    try:
        msgs = stream(pg_logical.url, slot, pub, want=4)
    finally:
        with psycopg.connect(pg_logical.url, autocommit=True) as c:
            c.execute(f"select pg_drop_replication_slot('{slot}')")
    kinds = [type(m).__name__ for m in msgs]
    assert kinds == ["Begin", "Relation", "Insert", "Insert", "Commit",
                     "Begin", "Update", "Commit", "Begin", "Delete", "Commit",
                     "Begin", "Relation", "Truncate", "Commit"], kinds
    rel = next(m for m in msgs if isinstance(m, Relation))
    assert rel.name == table and rel.namespace == "public" and rel.replica_identity == "d"
    assert [c.name for c in rel.columns] == ["id", "v", "n", "j", "b", "big"]
    assert [c.key for c in rel.columns] == [True, False, False, False, False, False]
    ins = [m for m in msgs if isinstance(m, Insert)]
    assert ins[0].new[:5] == (b"1", b"a", b"1.50", b'{"k": 1}', b"\\x0102")
    assert ins[0].new[5] == big.encode()
    assert ins[1].new == (b"2", None, None, None, None, None)
    upd = next(m for m in msgs if isinstance(m, Update))
    assert upd.old is None and upd.new[:2] == (b"1", b"b") and upd.new[5] is UNCHANGED_TOAST
    dele = next(m for m in msgs if isinstance(m, Delete))
    assert dele.old_is_key and dele.old[0] == b"2"
    tr = next(m for m in msgs if isinstance(m, Truncate))
    assert tr.relids == (rel.relid,)
    begins = [m for m in msgs if isinstance(m, Begin)]
    commits = [m for m in msgs if isinstance(m, Commit)]
    assert all(b.final_lsn == c.commit_lsn for b, c in zip(begins, commits, strict=True))
    assert [c.commit_lsn for c in commits] == sorted(c.commit_lsn for c in commits)


def test_bad_bytes_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError, match="unknown pgoutput message"):
        parse_message(b"Z")
    with pytest.raises(ProtocolError, match="truncated"):
        parse_message(b"B\x00\x00")
    with pytest.raises(ProtocolError, match="unknown replication frame"):
        parse_frame(b"x")
