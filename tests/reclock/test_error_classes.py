"""Every error the driver meets is transient or definite (reclock.core.errors.classify):
reclock's own say so, library errors are classified by what they are, and
anything else is flagged as unclassified (a bug) and retried."""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest
from confluent_kafka import KafkaError, KafkaException

from reclock.core.errors import DefiniteError, TransientError, classified, classify


def _kind(exc: BaseException) -> str:
    err = classify(exc)
    assert isinstance(err, TransientError | DefiniteError)
    return "definite" if isinstance(err, DefiniteError) else "transient"


def test_a_database_that_is_not_there_is_transient() -> None:
    with pytest.raises(psycopg.OperationalError) as got:
        psycopg.connect("postgresql://nobody@127.0.0.1:1/x", connect_timeout=2)
    assert classified(got.value) and _kind(got.value) == "transient"


def test_bad_data_for_the_database_is_definite(pg_url: str) -> None:
    with psycopg.connect(pg_url) as c, pytest.raises(psycopg.DataError) as got:
        c.execute("select 'not a number'::int")
    assert _kind(got.value) == "definite"
    with psycopg.connect(pg_url) as c, pytest.raises(psycopg.ProgrammingError) as got2:
        c.execute("select * from no_such_table")
    assert _kind(got2.value) == "definite"


@pytest.mark.parametrize("code, kind", [
    (KafkaError._TRANSPORT, "transient"),
    (KafkaError._ALL_BROKERS_DOWN, "transient"),
    (KafkaError.TOPIC_AUTHORIZATION_FAILED, "definite"),
])
def test_kafka_errors_by_their_own_flags(code: int, kind: str) -> None:
    exc = KafkaException(KafkaError(code))
    assert classified(exc) and _kind(exc) == kind


def test_a_fatal_kafka_error_is_definite() -> None:
    exc = KafkaException(KafkaError(KafkaError._FENCED, fatal=True))
    assert _kind(exc) == "definite"


@pytest.mark.parametrize("no, kind", [
    (errno.ENOSPC, "transient"), (errno.EACCES, "definite"), (errno.EROFS, "definite"),
    (errno.ECONNRESET, "transient"),
])
def test_os_errors(no: int, kind: str) -> None:
    assert _kind(OSError(no, "x")) == kind


def test_arrow_data_errors_are_definite() -> None:
    with pytest.raises(pa.ArrowInvalid) as got:
        pa.array(["x"]).cast(pa.int64())
    assert _kind(got.value) == "definite"


def test_reclocks_own_errors_keep_their_class_and_others_are_flagged() -> None:
    own = DefiniteError("x")
    assert classify(own) is own and classified(own)
    assert not classified(KeyError("a bug")) and _kind(KeyError("a bug")) == "transient"


def test_a_busy_connection_pool_is_transient(tmp_path: Path) -> None:
    """Every pooled connection of the remap store busy past the pool's
    timeout (a hundred sources minting at once) is retried, not a bug."""
    import sqlalchemy as sa

    engine = sa.create_engine(f"sqlite:///{tmp_path}/s.db", pool_size=1, max_overflow=0,
                              pool_timeout=0.1)
    with engine.connect(), pytest.raises(sa.exc.TimeoutError) as got:
        engine.connect()
    assert classified(got.value) and isinstance(classify(got.value), TransientError)
    engine.dispose()


def test_a_damaged_sqlite_file_is_definite_a_locked_one_transient(tmp_path: Path) -> None:
    """Issue: a key-state file with 32 KiB overwritten failed every settle
    with ``database disk image is malformed``, unclassified, so retried as
    transient forever. A malformed image or a file that is not a database
    is definite (reading it again fails the same way; the driver rebuilds
    key state that meets it), a lock timeout transient: real SQLite errors."""
    path = tmp_path / "k.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (k TEXT PRIMARY KEY, v BLOB) WITHOUT ROWID")
        conn.executemany("INSERT INTO t VALUES (?, ?)", ((str(i), b"x" * 200) for i in range(5000)))
    conn.close()
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.seek(size // 2 // 4096 * 4096)
        f.write(bytes(32 * 1024))
    conn = sqlite3.connect(path)
    with pytest.raises(sqlite3.DatabaseError, match="malformed") as damaged:
        conn.execute("SELECT count(*), sum(length(v)) FROM t").fetchone()
    conn.close()
    assert classified(damaged.value) and _kind(damaged.value) == "definite"

    garbage = tmp_path / "text.sqlite"
    garbage.write_text("not a database\n" * 300)
    conn = sqlite3.connect(garbage)
    with pytest.raises(sqlite3.DatabaseError, match="not a database") as notadb:
        conn.execute("SELECT 1 FROM sqlite_master").fetchone()
    conn.close()
    assert classified(notadb.value) and _kind(notadb.value) == "definite"

    lock = tmp_path / "lock.sqlite"
    a = sqlite3.connect(lock, isolation_level=None, timeout=0)
    a.execute("CREATE TABLE t (x)")
    a.execute("BEGIN IMMEDIATE")
    b = sqlite3.connect(lock, isolation_level=None, timeout=0)
    with pytest.raises(sqlite3.OperationalError, match="locked") as busy:
        b.execute("BEGIN IMMEDIATE")
    a.close()
    b.close()
    assert classified(busy.value) and _kind(busy.value) == "transient"
