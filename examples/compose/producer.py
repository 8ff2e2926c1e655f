"""Demo load for the docker compose deployment (the ``producer`` service).

Until stopped (SIGTERM, Ctrl-C) or for ``--duration`` seconds it keeps

* producing JSON records to a Kafka topic (``demo-events``), keyed by the
  customer id, e.g.::

      {"id": 1732200000123456, "customer_id": 3, "kind": "purchase",
       "amount": 12.5, "ts": "2025-11-21T12:00:00.123456+00:00"}

  which the pipeline's ``events`` source ingests (``examples/compose/pipeline.yaml``);
* inserting, updating and deleting rows of the ``customers`` and ``orders``
  tables of the shop database (``examples/compose/init.sql``), one small
  transaction at a time, which the pipeline's ``shop`` source captures.

Before the first record it makes sure the topic exists (creating it with
``--partitions`` partitions when the broker supports CreateTopics; otherwise
the broker's auto-creation applies). While running it touches ``--ready-file``
about once a second, which the compose healthcheck watches. At the end it
prints one JSON line with what it did (``records``, ``inserts``, ``updates``,
``deletes``) and exits 0; an error exits 1 (compose restarts the service).

Every option has an environment variable as its default::

    --bootstrap-servers  KAFKA_BOOTSTRAP_SERVERS  kafka:9092
    --topic              DEMO_TOPIC               demo-events
    --partitions         DEMO_PARTITIONS          4
    --dsn                SHOP_DSN                 postgresql://POSTGRES_USER:POSTGRES_PASSWORD@
                                                  POSTGRES_HOST:POSTGRES_PORT/SHOP_DB
                                                  (postgres, reclock-demo-pw, postgres, 5432, shop)
    --rate               PRODUCER_RATE            Kafka records per second (50)
    --pg-rate            PRODUCER_PG_RATE         Postgres transactions per second (5)
    --duration           PRODUCER_DURATION        seconds, unset: forever
    --ready-file         PRODUCER_READY_FILE      /tmp/producer.ready
    --seed               PRODUCER_SEED            random seed (unset: random)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

EVENT_KINDS = ("view", "cart", "purchase")
ORDER_FLOW = {"new": "paid", "paid": "shipped", "shipped": "delivered"}
TIERS = ("basic", "silver", "gold")


@dataclass(frozen=True)
class Settings:
    """What to connect to and how fast to write."""

    bootstrap_servers: str
    topic: str
    partitions: int
    dsn: str
    rate: float
    pg_rate: float
    duration: float | None
    ready_file: Path | None
    seed: int | None


@dataclass
class Counts:
    """What the producer did (printed as JSON at the end)."""

    records: int = 0  # Kafka records acknowledged by the broker
    failed: int = 0  # Kafka records the broker did not take
    transactions: int = 0  # Postgres transactions committed
    inserts: int = 0
    updates: int = 0
    deletes: int = 0


def default_dsn(env: Mapping[str, str]) -> str:
    """``SHOP_DSN``, else a URL built from the ``POSTGRES_*`` variables of compose.yaml."""
    if env.get("SHOP_DSN"):
        return env["SHOP_DSN"]
    user = quote(env.get("POSTGRES_USER", "postgres"), safe="")
    password = quote(env.get("POSTGRES_PASSWORD", "reclock-demo-pw"), safe="")
    host = env.get("POSTGRES_HOST", "postgres")
    port = env.get("POSTGRES_PORT", "5432")
    db = env.get("SHOP_DB", "shop")
    return f"postgresql://{user}:{password}@{host}:{port}/{db}"


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] = os.environ
               ) -> Settings:
    """Command-line options, defaulting to the environment (see the module docstring)."""
    p = argparse.ArgumentParser(
        prog="producer.py",
        description="Demo load: JSON records to Kafka and row changes to Postgres.")
    p.add_argument("--bootstrap-servers",
                   default=env.get("KAFKA_BOOTSTRAP_SERVERS", "kafka:9092"))
    p.add_argument("--topic", default=env.get("DEMO_TOPIC", "demo-events"))
    p.add_argument("--partitions", type=int, default=int(env.get("DEMO_PARTITIONS", "4")),
                   help="partitions of the topic when it is created")
    p.add_argument("--dsn", default=default_dsn(env), help="the shop database")
    p.add_argument("--rate", type=float, default=float(env.get("PRODUCER_RATE", "50")),
                   help="Kafka records per second")
    p.add_argument("--pg-rate", type=float, default=float(env.get("PRODUCER_PG_RATE", "5")),
                   help="Postgres transactions per second")
    p.add_argument("--duration", type=float,
                   default=float(env["PRODUCER_DURATION"]) if env.get("PRODUCER_DURATION")
                   else None, help="stop after this many seconds (default: run until stopped)")
    p.add_argument("--ready-file", default=env.get("PRODUCER_READY_FILE", "/tmp/producer.ready"),
                   help="touched about once a second while running ('' for none)")
    p.add_argument("--seed", type=int,
                   default=int(env["PRODUCER_SEED"]) if env.get("PRODUCER_SEED") else None)
    a = p.parse_args(argv)
    if a.rate < 0 or a.pg_rate < 0 or a.partitions < 1:
        p.error("--rate and --pg-rate must be >= 0, --partitions >= 1")
    return Settings(
        bootstrap_servers=a.bootstrap_servers, topic=a.topic, partitions=a.partitions,
        dsn=a.dsn, rate=a.rate, pg_rate=a.pg_rate, duration=a.duration,
        ready_file=Path(a.ready_file) if a.ready_file else None, seed=a.seed,
    )


# -- Kafka ------------------------------------------------------------------------------


def ensure_topic(bootstrap_servers: str, topic: str, partitions: int,
                 timeout: float = 15.0) -> None:
    """Create ``topic`` unless it exists. A broker that cannot create topics
    (e.g. librdkafka's mock cluster) leaves it to auto-creation on first produce."""
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    md = admin.list_topics(timeout=timeout)
    existing = md.topics.get(topic)
    if existing is not None and existing.error is None:
        return
    futures = admin.create_topics([NewTopic(topic, partitions, 1)],
                                  request_timeout=timeout, operation_timeout=timeout)
    try:
        futures[topic].result()
    except KafkaException as exc:
        err = exc.args[0]
        if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
            return
        log(f"cannot create topic {topic!r} ({err}); relying on the broker's auto-creation")


class Events:
    """JSON records to the demo topic, keyed by customer id."""

    def __init__(self, bootstrap_servers: str, topic: str, counts: Counts) -> None:
        self.topic = topic
        self.counts = counts
        self.producer = Producer({
            "bootstrap.servers": bootstrap_servers,
            "enable.idempotence": True,
            "linger.ms": 20,
        })
        # Event ids: microseconds since the epoch at first, then strictly
        # increasing, so they stay unique within a run and across restarts.
        self.next_id = time.time_ns() // 1000

    def _delivered(self, err: KafkaError | None, _msg: Any) -> None:
        if err is None:
            self.counts.records += 1
        else:
            self.counts.failed += 1
            log(f"record not delivered: {err}")

    def send(self, rng: random.Random, customer_id: int) -> None:
        now = dt.datetime.now(dt.UTC)
        event_id = self.next_id
        self.next_id = max(event_id + 1, time.time_ns() // 1000)
        value = {
            "id": event_id,
            "customer_id": customer_id,
            "kind": rng.choice(EVENT_KINDS),
            "amount": round(rng.uniform(1, 500), 2),
            "ts": now.isoformat(),
        }
        payload = json.dumps(value, separators=(",", ":")).encode()
        while True:
            try:
                self.producer.produce(self.topic, key=str(customer_id).encode(), value=payload,
                                      on_delivery=self._delivered)
                break
            except BufferError:  # the local queue is full: let deliveries drain
                self.producer.poll(0.5)
        self.producer.poll(0)

    def flush(self, timeout: float = 30.0) -> int:
        """Wait for outstanding deliveries; returns how many are still unacknowledged."""
        left: int = self.producer.flush(timeout)
        return left


# -- Postgres ---------------------------------------------------------------------------


@dataclass
class Shop:
    """Row changes to the shop tables, one short transaction per :meth:`step`."""

    conn: psycopg.Connection[Any]
    counts: Counts
    customers: list[int] = field(default_factory=list)
    orders: dict[int, str] = field(default_factory=dict)  # id -> status
    next_customer: int = 1
    next_order: int = 1

    @classmethod
    def open(cls, dsn: str, counts: Counts) -> Shop:
        conn = psycopg.connect(dsn, autocommit=True, connect_timeout=10,
                               application_name="reclock-demo-producer")
        shop = cls(conn, counts)
        with conn.transaction():
            shop.customers = [r[0] for r in conn.execute("SELECT id FROM customers ORDER BY id")]
            shop.orders = dict(conn.execute("SELECT id, status FROM orders").fetchall())
            row = conn.execute("SELECT coalesce(max(id), 0) FROM orders").fetchone()
        shop.next_customer = (max(shop.customers) if shop.customers else 0) + 1
        shop.next_order = (int(row[0]) if row else 0) + 1
        return shop

    def close(self) -> None:
        self.conn.close()

    def random_customer(self, rng: random.Random) -> int:
        """An existing customer's id (customer 1 when there are none yet)."""
        return rng.choice(self.customers) if self.customers else 1

    def step(self, rng: random.Random) -> None:
        """One transaction: a new order (and sometimes a new customer), and
        sometimes an order moved along its flow, a delivered order deleted, a
        customer's tier changed."""
        c = self.counts
        with self.conn.transaction():
            if not self.customers or rng.random() < 0.2:
                cid = self.next_customer
                self.conn.execute(
                    "INSERT INTO customers (id, name, email, tier) VALUES (%s, %s, %s, %s)",
                    (cid, f"customer {cid}", f"c{cid}@example.com", "basic"))
                self.next_customer += 1
                self.customers.append(cid)
                c.inserts += 1
            oid = self.next_order
            self.conn.execute(
                "INSERT INTO orders (id, customer_id, amount) VALUES (%s, %s, %s)",
                (oid, self.random_customer(rng), round(rng.uniform(5, 900), 2)))
            self.next_order += 1
            self.orders[oid] = "new"
            c.inserts += 1
            if self.orders and rng.random() < 0.7:
                oid = rng.choice(list(self.orders))
                status = self.orders[oid]
                if status in ORDER_FLOW:
                    self.conn.execute(
                        "UPDATE orders SET status = %s, updated_at = now() WHERE id = %s",
                        (ORDER_FLOW[status], oid))
                    self.orders[oid] = ORDER_FLOW[status]
                    c.updates += 1
                else:  # delivered: done with it
                    self.conn.execute("DELETE FROM orders WHERE id = %s", (oid,))
                    del self.orders[oid]
                    c.deletes += 1
            if self.customers and rng.random() < 0.1:
                self.conn.execute(
                    "UPDATE customers SET tier = %s, updated_at = now() WHERE id = %s",
                    (rng.choice(TIERS), self.random_customer(rng)))
                c.updates += 1
        c.transactions += 1


# -- main loop ------------------------------------------------------------------------


def log(message: str) -> None:
    sys.stderr.write(f"producer: {message}\n")
    sys.stderr.flush()


def run(settings: Settings, stop: threading.Event) -> Counts:
    """Write until ``stop`` is set or the duration is over; returns the counts."""
    counts = Counts()
    rng = random.Random(settings.seed)
    if settings.ready_file is not None:
        settings.ready_file.unlink(missing_ok=True)
    ensure_topic(settings.bootstrap_servers, settings.topic, settings.partitions)
    events = Events(settings.bootstrap_servers, settings.topic, counts)
    shop = Shop.open(settings.dsn, counts)
    log(f"writing to topic {settings.topic!r} at {settings.bootstrap_servers} "
        f"({settings.rate:g}/s) and to the shop tables ({settings.pg_rate:g} tx/s)")
    started = time.monotonic()
    deadline = None if settings.duration is None else started + settings.duration
    next_event = next_tx = started
    last_touch = last_report = 0.0
    try:
        while not stop.is_set():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            if settings.pg_rate > 0 and now >= next_tx:
                shop.step(rng)
                next_tx += 1 / settings.pg_rate
            if settings.rate > 0 and now >= next_event:
                events.send(rng, shop.random_customer(rng))
                next_event += 1 / settings.rate
            if settings.ready_file is not None and now - last_touch >= 1:
                settings.ready_file.touch()
                last_touch = now
            if now - last_report >= 10:
                log(f"{json.dumps(asdict(counts))}")
                last_report = now
            events.producer.poll(0)
            due = [t for t, r in ((next_tx, settings.pg_rate), (next_event, settings.rate)) if r]
            wake = min([*due, now + 1] + ([deadline] if deadline is not None else []))
            stop.wait(max(0.0, wake - time.monotonic()))
    finally:
        left = events.flush()
        if left:
            counts.failed += left
            log(f"{left} record(s) still unacknowledged at exit")
        shop.close()
        if settings.ready_file is not None:
            settings.ready_file.unlink(missing_ok=True)
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        counts = run(settings, stop)
    except (psycopg.Error, KafkaException) as exc:
        log(f"error: {type(exc).__name__}: {exc}")
        return 1
    print(json.dumps(asdict(counts)), flush=True)
    return 1 if counts.failed else 0


if __name__ == "__main__":
    sys.exit(main())
