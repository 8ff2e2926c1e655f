"""Helpers of the MariaDB CDC tests: a writer of random transactions that
keeps its own model of what the tables must hold, and reading positions."""

from __future__ import annotations

import random
import threading
import time
from decimal import Decimal
from typing import Any

import pymysql

from reclock.core.frontier import Antichain
from reclock.core.time import Gtid
from reclock.sources.mysql import gtid

SCHEMA = [
    "create table acct (id int primary key, owner varchar(40) not null, bal decimal(12,2), "
    "note text)",
    # no primary key: a diff log (an update retracts the old row, inserts the new)
    "create table ledger (txn int not null, acct int, amount decimal(12,2), tag varchar(20))",
]


def connect(url: str) -> pymysql.Connection[Any]:
    from reclock.sources.mysql.config import parse_url

    s = parse_url(url)
    return pymysql.connect(host=s["host"], port=s["port"], user=s["user"],
                           password=s["password"], database=s["database"], autocommit=True)


class Model:
    """What the tables hold, kept by the writer (the only writer) as it commits."""

    def __init__(self) -> None:
        self.acct: dict[int, tuple[int, str, Decimal, str | None]] = {}
        self.ledger: list[tuple[int, int, Decimal, str | None]] = []


def create_schema(url: str, accounts: int, ledger: int) -> Model:
    m = Model()
    with connect(url) as c, c.cursor() as cur:
        for s in SCHEMA:
            cur.execute(s)
        rows = [(i, f"owner {i}", Decimal(i * 10), None) for i in range(1, accounts + 1)]
        cur.executemany("insert into acct values (%s, %s, %s, %s)", rows)
        led = [(0, i % accounts + 1, Decimal(i), "seed") for i in range(ledger)]
        cur.executemany("insert into ledger values (%s, %s, %s, %s)", led)
    m.acct = {r[0]: r for r in rows}
    m.ledger = led
    return m


class Writer:
    """Random multi-statement transactions until stopped: each inserts 1-3
    ledger rows carrying its number, and updates, inserts or deletes an
    account, or updates a ledger row; the model follows every commit."""

    def __init__(self, url: str, model: Model, seed: int = 1, pause: float = 0.003,
                 accounts: int = 1000, start: int = 0) -> None:
        self.url, self.model, self.pause, self.accounts = url, model, pause, accounts
        self.rng = random.Random(seed)
        self.txns = start
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with connect(self.url) as c:
                c.autocommit(False)
                while not self._stop.is_set():
                    self._one(c)
                    time.sleep(self.pause)
        except BaseException as exc:  # surfaced by stop()
            self.errors.append(exc)

    def _one(self, c: pymysql.Connection[Any]) -> None:
        r, m = self.rng, self.model
        self.txns += 1
        n = self.txns
        acct = dict(m.acct)
        ledger = list(m.ledger)
        with c.cursor() as cur:
            for _ in range(r.randint(1, 3)):
                row = (n, r.randint(1, self.accounts), Decimal(r.randint(-500, 500)) / 4,
                       None if r.random() < 0.2 else f"t{n}")
                cur.execute("insert into ledger values (%s, %s, %s, %s)", row)
                ledger.append(row)
            a = r.randint(1, self.accounts * 2)
            op = r.random()
            if op < 0.45:
                if a in acct:
                    i, owner, bal, _ = acct[a]
                    acct[a] = (i, owner, bal + 1, f"txn {n}")
                cur.execute("update acct set bal = bal + 1, note = %s where id = %s",
                            (f"txn {n}", a))
            elif op < 0.7:
                cur.execute("insert into acct values (%s, %s, 0, 'new') on duplicate key update "
                            "owner = values(owner)", (a, f"owner {a} v{n}"))
                old = acct.get(a)
                acct[a] = (a, f"owner {a} v{n}", old[2] if old else Decimal(0),
                           old[3] if old else "new")
            elif op < 0.85:
                cur.execute("delete from acct where id = %s", (a,))
                acct.pop(a, None)
            else:
                mine = [row for row in ledger if row[0] == n - 1]
                if mine:
                    old_row = mine[0]
                    cur.execute("update ledger set amount = amount + 1 where txn = %s and "
                                "acct = %s and amount = %s and tag <=> %s limit 1", old_row)
                    ledger.remove(old_row)
                    ledger.append((old_row[0], old_row[1], old_row[2] + 1, old_row[3]))
        c.commit()
        m.acct, m.ledger = acct, ledger

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(60)
        if self.errors:
            raise self.errors[0]
        return self.txns


def binlog_pos(url: str) -> gtid.Pos:
    with connect(url) as c, c.cursor() as cur:
        cur.execute("select @@gtid_binlog_pos")
        row = cur.fetchone()
    return gtid.position(row[0] if row else "")


def passed(encoded: Any, target: gtid.Pos) -> bool:
    """Whether an encoded frontier (a status document's) is at or past ``target``."""
    if not encoded:
        return False
    return gtid.le(target, gtid.of(Antichain.decode(Gtid.KIND, encoded)))


def source_rows(url: str, query: str) -> list[tuple[Any, ...]]:
    with connect(url) as c, c.cursor() as cur:
        cur.execute(query)
        return sorted((tuple(r) for r in cur.fetchall()), key=repr)


class DomainWriter:
    """Transactions in one replication domain (``SET gtid_domain_id``) on
    table ``dd (id, dom, n)``, on keys of its own (``domain * 1000 + k``):
    each upserts a key with its own number (so it always changes a row and
    gets a GTID) and may delete another. ``txns``: ``(domain, seq, {id: row
    or None})`` per commit, its GTID read back with ``@@last_gtid``.
    ``pause()``/``resume()`` hold it between transactions."""

    def __init__(self, url: str, domain: int, seed: int, pause: float = 0.01,
                 paused: bool = False) -> None:
        self.url, self.domain, self.pause_s = url, domain, pause
        self.rng = random.Random(seed)
        self.txns: list[tuple[int, int, dict[int, tuple[int, int, int] | None]]] = []
        self.errors: list[BaseException] = []
        self._go = threading.Event()
        if not paused:
            self._go.set()
        self._idle = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with connect(self.url) as c, c.cursor() as cur:
                cur.execute(f"SET SESSION gtid_domain_id = {self.domain}")
                c.autocommit(False)
                while not self._stop.is_set():
                    if not self._go.is_set():
                        self._idle.set()
                        self._go.wait(0.05)
                        continue
                    self._idle.clear()
                    n = len(self.txns) + 1
                    base = self.domain * 1000
                    k = base + self.rng.randrange(50)
                    changes: dict[int, tuple[int, int, int] | None] = {k: (k, self.domain, n)}
                    cur.execute("insert into dd values (%s, %s, %s) on duplicate key update "
                                "n = values(n)", changes[k])
                    if self.rng.random() < 0.3:
                        gone = base + self.rng.randrange(50)
                        if gone != k:
                            cur.execute("delete from dd where id = %s", (gone,))
                            changes[gone] = None
                    c.commit()
                    cur.execute("select @@last_gtid")
                    d, _, seq = (int(x) for x in str(cur.fetchone()[0]).split("-"))
                    assert d == self.domain, (d, self.domain)
                    self.txns.append((d, seq, changes))
                    time.sleep(self.pause_s)
        except BaseException as exc:  # surfaced by stop()
            self.errors.append(exc)

    def pause(self) -> None:
        """Returns once no transaction of it is open or will start."""
        self._go.clear()
        self._idle.clear()
        assert self._idle.wait(30) or self.errors, "the writer did not pause"

    def resume(self) -> None:
        self._go.set()

    def stop(self) -> None:
        self._stop.set()
        self._go.set()
        self._thread.join(60)
        if self.errors:
            raise self.errors[0]
