"""The private logical-replication cluster the Postgres CDC tests run against,
and the replication protocol through psycopg 3's libpq layer."""

from __future__ import annotations

import time
from typing import Any

import psycopg
from psycopg import pq


def test_private_cluster_has_logical_wal_and_speaks_replication(pg_logical: Any) -> None:
    with psycopg.connect(pg_logical.url, autocommit=True) as c:
        assert c.execute("show wal_level").fetchone() == ("logical",)
        c.execute("create table if not exists smoke (id int primary key, v text)")
        c.execute("drop publication if exists smoke_pub")
        c.execute("create publication smoke_pub for table smoke")
        c.execute("select pg_create_logical_replication_slot('smoke_slot', 'pgoutput')")
        c.execute("insert into smoke values (1, 'a')")
    # START_REPLICATION on a walsender connection: COPY BOTH via libpq
    conn = psycopg.connect(pg_logical.url, replication="database", autocommit=True)
    try:
        pg = conn.pgconn
        pg.send_query(b"START_REPLICATION SLOT smoke_slot LOGICAL 0/0 "
                      b"(proto_version '1', publication_names 'smoke_pub')")
        res = pg.get_result()
        assert res is not None and res.status == pq.ExecStatus.COPY_BOTH
        kinds = set()
        for _ in range(50):
            n, data = pg.get_copy_data(0)
            if n <= 0:
                break
            if data[:1] == b"w":  # XLogData: header 1+8+8+8 bytes, then pgoutput
                kinds.add(bytes(data[25:26]))
            if {b"B", b"I", b"C"} <= kinds:
                break
        assert {b"B", b"R", b"I", b"C"} <= kinds, kinds  # begin, relation, insert, commit
    finally:
        conn.close()
        # (the walsender of the connection just closed may still hold the
        # slot for a moment: its drop waits for it, as `wait => true` would)
        with psycopg.connect(pg_logical.url, autocommit=True) as c:
            for _ in range(200):
                try:
                    c.execute("select pg_drop_replication_slot('smoke_slot')")
                    break
                except psycopg.errors.ObjectInUse:
                    time.sleep(0.05)
