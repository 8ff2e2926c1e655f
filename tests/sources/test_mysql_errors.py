"""The MariaDB source's definite errors, each with its hint, against the run's
private server: binlog_format not ROW, a user without replication
privileges, a resume position whose binary logs were purged, and a column
retyped upstream so that its output cannot hold it."""

from __future__ import annotations

import time
from typing import Any

import pytest

from reclock.core.clock import SystemClock
from reclock.core.errors import DefiniteError
from reclock.sources.mysql import gtid
from reclock.sources.mysql.source import MySqlSource
from tests.sources.mycdc import binlog_pos, connect


def _source(url: str, table: str = "t") -> MySqlSource:
    db = url.rsplit("/", 1)[1]
    return MySqlSource("s", url, SystemClock(), tables=[(db, table, table)], timeout_s=5)


def _sql(url: str, *statements: str) -> None:
    with connect(url) as c, c.cursor() as cur:
        for s in statements:
            cur.execute(s)


def test_binlog_format_not_row(mariadb: Any, mysql_url: str) -> None:
    _sql(mysql_url, "create table t (id int primary key)")
    mariadb.execute("SET GLOBAL binlog_format = 'STATEMENT'")
    try:
        src = _source(mysql_url)
        src.current_outputs()
        with pytest.raises(DefiniteError, match="binlog_format is STATEMENT, not ROW") as e:
            src.open(src.initial_frontier(), src.initial_frontier(), [None])
        assert "binlog_format = 'ROW'" in (e.value.hint or "")
        src.close()
    finally:
        mariadb.execute("SET GLOBAL binlog_format = 'ROW'")


def test_missing_privileges(mariadb: Any, mysql_url: str) -> None:
    db = mysql_url.rsplit("/", 1)[1]
    _sql(mysql_url, "create table t (id int primary key)")
    user = f"u_{db[-8:]}"
    mariadb.execute(f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw-secret'",
                    f"GRANT SELECT ON `{db}`.* TO '{user}'@'%'")
    try:
        url = mysql_url.replace("root@", f"{user}:pw-secret@")
        src = _source(url)
        src.current_outputs()
        with pytest.raises(DefiniteError, match="lacks REPLICATION SLAVE and REPLICATION "
                                                "CLIENT") as e:
            src.open(src.initial_frontier(), src.initial_frontier(), [None])
        assert "GRANT SELECT, REPLICATION SLAVE, REPLICATION CLIENT" in (e.value.hint or "")
        assert "pw-secret" not in str(e.value)
        src.close()
    finally:
        mariadb.execute(f"DROP USER '{user}'@'%'")


def test_resuming_from_purged_binlogs(mariadb: Any, mysql_url: str) -> None:
    _sql(mysql_url, "create table t (id int primary key)", "insert into t values (1)")
    old = binlog_pos(mysql_url)
    _sql(mysql_url, "insert into t values (2)")
    logs = mariadb.execute("FLUSH BINARY LOGS", "SHOW BINARY LOGS")
    for _ in range(100):  # a binlog goes once InnoDB's checkpoint no longer needs it
        if len(mariadb.execute(f"PURGE BINARY LOGS TO '{logs[-1][0]}'", "SHOW BINARY LOGS")) == 1:
            break
        time.sleep(0.1)
    _sql(mysql_url, "insert into t values (3)")
    src = _source(mysql_url)
    src.current_outputs()
    held = gtid.frontier(old)  # the output holds data up to the purged position
    with pytest.raises(DefiniteError, match="were purged") as e:
        src.open(held, held, [held])
    assert "keep binlogs longer" in (e.value.hint or "")
    src.close()


def test_retyped_column(mysql_url: str) -> None:
    _sql(mysql_url, "create table t (id int primary key, v int)", "insert into t values (1, 1)")
    src = _source(mysql_url)
    src.current_outputs()
    src.open(src.initial_frontier(), src.initial_frontier(), [None])
    _sql(mysql_url, "alter table t modify v varchar(20)", "insert into t values (2, 'two')")
    hi = src.probe()
    tasks, _ = src.plan(src.initial_frontier(), hi, 1000, 100_000)
    stream = [t for t in tasks if t.snapshot is None]
    with pytest.raises(DefiniteError, match="column 'v' changed type upstream") as e:
        for t in stream:
            list(src.reader().read(t))
    assert "drop and re-create the output" in (e.value.hint or "")
    src.close()
