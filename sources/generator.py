"""Deterministic load generators: FromTime is a counter.

Record ``n`` is a pure function of ``(kind, seed, n)``, so a generator restarts
from any resume upper with identical data, on any executor. The *probe* is
rate-limited: at start the generator anchors on the last bound counter value
and the clock, and from then on ``rate`` records per second become available::

    available(now) = anchor_value + rate * (now - anchor_time)   (capped by max_records)

Kinds:

* ``counter`` -- one output of raw bytes in ``value_format`` (json, text, csv,
  bytes), key = the counter in ASCII. With ``bad_every = k`` every k-th record
  is malformed for its format, to exercise the error collection.
* ``orders`` -- two typed outputs from one counter: ``customers`` (every fifth
  record) and ``orders`` (the rest, each referencing an existing customer).
* ``key-value`` -- one output of raw key/value bytes for the ``upsert``
  envelope (like Materialize's KEY VALUE load generator, plus deletes): the
  key ``{"key": k}`` with ``k`` in ``[0, keys)``, the value
  ``{"n": n, "payload": "<value_size characters>"}`` (the payload a window of
  a pool of random characters made from the seed). Records ``n < keys``
  insert key ``n`` (the initial snapshot); later records update the key
  ``splitmix64(n) % keys``, except that every ``delete_every``-th of them
  deletes it instead (a null value, a tombstone; it may hit a key already
  deleted, and a key deleted is inserted again by its next update).
* ``auction`` -- the tables of Materialize's AUCTION load generator, five
  typed outputs: ``organizations`` (id, name), ``users`` (id, org_id,
  name), ``accounts`` (id, org_id, balance), ``auctions`` (id, seller, item,
  end_time) and ``bids`` (id, buyer, auction_id, amount, bid_time). Records
  ``n < 240`` are the 20 organizations, then 200 users and 20 accounts; from
  then on each group of 10 positions is one auction (the first) and its
  bids (2 to 9 of the next 9 positions, the rest hold nothing), every bid by
  an existing user on the auction before it. Times are fixed by ``n`` (one
  second per position from 2024-01-01 UTC; an auction ends 10 s after it
  starts), so a replay makes the same rows.

A finite generator (``max_records``) binds the empty frontier once everything
is available: the source finishes and its outputs close.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field
from pydantic_core import InitErrorDetails

from reclock.contracts.config import problem
from reclock.contracts.source import (
    ConnectorConfig,
    OutputSpec,
    ReadTask,
    SourceBase,
    SourceContext,
    SourcePlugin,
)
from reclock.core.clock import Clock
from reclock.core.columns import SRC_OFFSET, SRC_PART, SRC_SEQ, SRC_TS
from reclock.core.errors import DefiniteError
from reclock.core.frontier import Antichain
from reclock.core.time import Counter

CHUNK = 65_536
#: key-value: payload characters (JSON-safe, 6 bits each)
_ALPHABET = np.frombuffer(
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_", dtype=np.uint8)
#: key-value: a payload is ``value_size`` characters of a pool of random
#: characters (made once per seed and size), from an offset hashed with this
#: added to the seed (so that it does not repeat the hash that picks the key)
_PAYLOAD_SEED = 0x5EED
_POOL = 1 << 16
#: key-value: the value bytes of one chunk, about (so that large values make
#: short chunks, and 32-bit offsets never overflow)
_CHUNK_BYTES = 16 << 20
MAX_VALUE_SIZE = 1 << 20
_CITIES = ["Amsterdam", "Berlin", "Lisbon", "Oslo", "Prague", "Rome", "Vienna", "Zurich"]
_STATUS = ["new", "paid", "shipped", "delivered"]

CUSTOMERS_SCHEMA = pa.schema(
    [
        pa.field("customer_id", pa.int64()),
        pa.field("name", pa.string()),
        pa.field("city", pa.string()),
    ]
)
#: auction: the fixed tables' sizes, positions per auction, and its outputs
AUCTION_ORGS, AUCTION_USERS = 20, 200
AUCTION_FIXED = 2 * AUCTION_ORGS + AUCTION_USERS
AUCTION_GROUP = 10
AUCTION_BASE_US = 1_704_067_200_000_000  # 2024-01-01T00:00:00Z
_ITEMS = ["Vintage Poster", "Concert Tickets", "Handmade Quilt", "Tasting Menu", "Sailing Trip"]
_TS = pa.timestamp("us", tz="UTC")
AUCTION_SCHEMAS = {
    "organizations": pa.schema([("id", pa.int64()), ("name", pa.string())]),
    "users": pa.schema([("id", pa.int64()), ("org_id", pa.int64()), ("name", pa.string())]),
    "accounts": pa.schema([("id", pa.int64()), ("org_id", pa.int64()),
                           ("balance", pa.int64())]),
    "auctions": pa.schema([("id", pa.int64()), ("seller", pa.int64()), ("item", pa.string()),
                           ("end_time", _TS)]),
    "bids": pa.schema([("id", pa.int64()), ("buyer", pa.int64()), ("auction_id", pa.int64()),
                       ("amount", pa.int32()), ("bid_time", _TS)]),
}
ORDERS_SCHEMA = pa.schema(
    [
        pa.field("order_id", pa.int64()),
        pa.field("customer_id", pa.int64()),
        pa.field("amount", pa.float64()),
        pa.field("status", pa.string()),
    ]
)


def splitmix64(x: npt.NDArray[np.uint64], seed: int) -> npt.NDArray[np.uint64]:
    """A fast, well-mixed 64-bit hash of each value (vectorized)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64((0x9E3779B97F4A7C15 * (seed + 1)) & 0xFFFFFFFFFFFFFFFF)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


@functools.lru_cache(maxsize=16)
def payload_pool(seed: int, size: int) -> npt.NDArray[np.uint8]:
    """key-value: ``_POOL + size`` random characters of ``_ALPHABET``; record
    ``n``'s payload is ``size`` of them from ``splitmix64(n) % _POOL``."""
    i = np.arange(_POOL + size, dtype=np.uint64)
    pool = _ALPHABET[(splitmix64(i, seed + _PAYLOAD_SEED + 1) & np.uint64(63)).astype(np.int64)]
    pool.setflags(write=False)
    return pool


@dataclass(frozen=True)
class GeneratorSpec:
    """What defines the data (and nothing that varies between runs)."""

    kind: str = "counter"
    seed: int = 0
    value_format: str = "json"
    bad_every: int = 0
    #: key-value only: the key space, every delete_every-th update a delete
    #: (0 = none), the payload's length in characters
    keys: int = 1000
    delete_every: int = 10
    value_size: int = 16


@dataclass(frozen=True)
class GeneratorReader:
    """Executor side: turns ``[lo, hi)`` of the counter into record batches."""

    spec: GeneratorSpec

    def read(self, task: ReadTask) -> Iterator[tuple[int, pa.RecordBatch]]:
        lo, hi, anchor_value, anchor_time, rate = task.spec
        chunk = CHUNK
        if self.spec.kind == "key-value":
            chunk = max(1, min(CHUNK, _CHUNK_BYTES // (self.spec.value_size + 32)))
        for start in range(lo, hi, chunk):
            n = np.arange(start, min(hi, start + chunk), dtype=np.int64)
            ts = (anchor_time + np.maximum(n - anchor_value, 0) * 1000.0 / rate).astype(np.int64)
            if self.spec.kind == "counter":
                yield 0, self._counter(n, ts)
            elif self.spec.kind == "key-value":
                yield 0, self._key_value(n, ts)
            elif self.spec.kind == "auction":
                yield from self._auction(n, ts)
            else:
                yield from self._orders(n, ts)

    # -- counter ---------------------------------------------------------------
    def _positions(self, n: npt.NDArray[np.int64], ts: npt.NDArray[np.int64]) -> list[pa.Array]:
        return [
            pa.array(np.zeros(len(n), dtype=np.int32)),
            pa.array(n),
            pa.array(np.zeros(len(n), dtype=np.int32)),
            pa.array(ts),
        ]

    def _counter(self, n: npt.NDArray[np.int64], ts: npt.NDArray[np.int64]) -> pa.RecordBatch:
        h = splitmix64(n.astype(np.uint64), self.spec.seed)
        nstr = pc.cast(pa.array(n), pa.string())
        payload = pc.utf8_lower(pc.cast(pa.array(h), pa.string()))
        fmt = self.spec.value_format
        if fmt == "json":
            value = pc.binary_join_element_wise(
                '{"n":', nstr, ',"payload":"p', payload, '","even":',
                pc.if_else(pc.equal(pc.bit_wise_and(pa.array(n), 1), 0), "true", "false"), "}",
                "",
            )
        elif fmt == "csv":
            value = pc.binary_join_element_wise(nstr, ",p", payload, "")
        elif fmt == "text":
            value = pc.binary_join_element_wise("record ", nstr, " p", payload, "")
        elif fmt == "bytes":
            value = pc.cast(pa.array(h.view(np.int64)), pa.string())
        else:
            raise DefiniteError(f"unknown generator value_format {fmt!r}")
        value = pc.cast(value, pa.binary())
        if self.spec.bad_every > 0 and fmt != "bytes":
            bad = (n % self.spec.bad_every) == (self.spec.bad_every - 1)
            if bad.any():
                broken = {"json": b'{"n": oops', "csv": b"lonely",
                          "text": b"\xff\xfe bad utf-8"}[fmt]
                value = pc.if_else(pa.array(bad), pa.scalar(broken, pa.binary()), value)
        key = pc.cast(nstr, pa.binary())
        return pa.RecordBatch.from_arrays(
            [*self._positions(n, ts), key, value],
            names=[SRC_PART, SRC_OFFSET, SRC_SEQ, SRC_TS, "key", "value"],
        )

    # -- key-value -------------------------------------------------------------
    def _key_value(self, n: npt.NDArray[np.int64], ts: npt.NDArray[np.int64]) -> pa.RecordBatch:
        spec = self.spec
        h = splitmix64(n.astype(np.uint64), spec.seed)
        snapshot = n < spec.keys
        key = np.where(snapshot, n, (h % np.uint64(spec.keys)).astype(np.int64))
        key_bytes = pc.cast(pc.binary_join_element_wise(
            '{"key":', pc.cast(pa.array(key), pa.string()), "}", ""), pa.binary())
        size = spec.value_size
        at = (splitmix64(n.astype(np.uint64), spec.seed + _PAYLOAD_SEED)
              % np.uint64(_POOL)).astype(np.int64)
        window = np.lib.stride_tricks.sliding_window_view(payload_pool(spec.seed, size), size)
        chars = np.ascontiguousarray(window[at])  # len(n) x size, one copy
        offsets = np.arange(len(n) + 1, dtype=np.int32) * np.int32(size)
        payload = pa.Array.from_buffers(
            pa.string(), len(n), [None, pa.py_buffer(offsets), pa.py_buffer(chars)])
        value = pc.cast(pc.binary_join_element_wise(
            '{"n":', pc.cast(pa.array(n), pa.string()), ',"payload":"', payload, '"}', ""),
            pa.binary())
        if spec.delete_every > 0:
            delete = ~snapshot & ((n % spec.delete_every) == (spec.delete_every - 1))
            if delete.any():
                value = pc.if_else(pa.array(delete), pa.scalar(None, pa.binary()), value)
        return pa.RecordBatch.from_arrays(
            [*self._positions(n, ts), key_bytes, value],
            names=[SRC_PART, SRC_OFFSET, SRC_SEQ, SRC_TS, "key", "value"],
        )

    # -- auction ---------------------------------------------------------------
    def _auction(self, n: npt.NDArray[np.int64], ts: npt.NDArray[np.int64]
                 ) -> Iterator[tuple[int, pa.RecordBatch]]:
        """The rows of positions ``n`` (see the module docstring), per output."""
        def batch(i: int, pick: npt.NDArray[np.bool_], cols: list[Any]
                  ) -> tuple[int, pa.RecordBatch]:
            schema = list(AUCTION_SCHEMAS.values())[i]
            arrays = [c.cast(f.type) if isinstance(c, pa.Array) else pa.array(c, f.type)
                      for c, f in zip(cols, schema, strict=True)]
            return i, pa.RecordBatch.from_arrays(
                [*self._positions(n[pick], ts[pick]), *arrays],
                names=[SRC_PART, SRC_OFFSET, SRC_SEQ, SRC_TS, *schema.names])

        orgs, users = AUCTION_ORGS, AUCTION_USERS
        org = n < orgs
        if org.any():
            oid = n[org] + 1
            yield batch(0, org, [oid, pc.binary_join_element_wise(
                "Organization ", pc.cast(pa.array(oid), pa.string()), "")])
        user = (n >= orgs) & (n < orgs + users)
        if user.any():
            uid = n[user] - orgs + 1
            yield batch(1, user, [uid, (uid - 1) % orgs + 1, pc.binary_join_element_wise(
                "user-", pc.cast(pa.array(uid), pa.string()), "")])
        acct = (n >= orgs + users) & (n < AUCTION_FIXED)
        if acct.any():
            oid = n[acct] - orgs - users + 1
            yield batch(2, acct, [oid + 42, oid, np.full(len(oid), 10_000, np.int64)])
        m = n - AUCTION_FIXED
        group, slot = m // AUCTION_GROUP + 1, m % AUCTION_GROUP  # group: the auction's id
        hg = splitmix64(np.maximum(group, 0).astype(np.uint64), self.spec.seed)
        hn = splitmix64(n.astype(np.uint64), self.spec.seed)
        at_us = AUCTION_BASE_US + n * 1_000_000
        auction = (m >= 0) & (slot == 0)
        if auction.any():
            h = hg[auction]
            yield batch(3, auction, [
                group[auction], (h % np.uint64(users)).astype(np.int64) + 1,
                np.array(_ITEMS, dtype=object)[((h >> np.uint64(16)) % np.uint64(len(_ITEMS)))
                                               .astype(np.int64)],
                at_us[auction] + 10_000_000])
        bids = 2 + (hg % np.uint64(8)).astype(np.int64)  # 2 .. 9 per auction
        bid = (m >= 0) & (slot >= 1) & (slot <= bids)
        if bid.any():
            h = hn[bid]
            yield batch(4, bid, [
                group[bid] * AUCTION_GROUP + slot[bid] - 1,
                (h % np.uint64(users)).astype(np.int64) + 1, group[bid],
                ((h >> np.uint64(20)) % np.uint64(99)).astype(np.int64) + 1, at_us[bid]])

    # -- orders ----------------------------------------------------------------
    def _orders(
        self, n: npt.NDArray[np.int64], ts: npt.NDArray[np.int64]
    ) -> Iterator[tuple[int, pa.RecordBatch]]:
        h = splitmix64(n.astype(np.uint64), self.spec.seed)
        is_customer = n % 5 == 0
        c = n[is_customer]
        if len(c):
            hc = h[is_customer]
            cid = c // 5
            yield 0, pa.RecordBatch.from_arrays(
                [
                    *self._positions(c, ts[is_customer]),
                    pa.array(cid),
                    pc.binary_join_element_wise("customer-", pc.cast(pa.array(cid), pa.string()),
                                                ""),
                    pa.array(np.array(_CITIES, dtype=object)[(hc % len(_CITIES)).astype(np.int64)],
                             pa.string()),
                ],
                names=[SRC_PART, SRC_OFFSET, SRC_SEQ, SRC_TS, "customer_id", "name",
                       "city"],
            )
        o = n[~is_customer]
        if len(o):
            ho = h[~is_customer]
            # a customer that already exists: ids 0 .. o // 5
            cust = (ho % (o // 5 + 1).astype(np.uint64)).astype(np.int64)
            amount = ((ho >> np.uint64(20)) % np.uint64(100_000)).astype(np.float64) / 100.0
            status = np.array(_STATUS, dtype=object)[((ho >> np.uint64(40)) % 4).astype(np.int64)]
            yield 1, pa.RecordBatch.from_arrays(
                [*self._positions(o, ts[~is_customer]), pa.array(o), pa.array(cust),
                 pa.array(amount), pa.array(status, pa.string())],
                names=[SRC_PART, SRC_OFFSET, SRC_SEQ, SRC_TS, "order_id",
                       "customer_id", "amount", "status"],
            )


class GeneratorSource(SourceBase):
    """Driver side of a generator (see the module docstring)."""

    kind = Counter.KIND

    def __init__(
        self,
        name: str,
        *,
        clock: Clock,
        kind: str = "counter",
        rate: float = 1000.0,
        max_records: int | None = None,
        start: int = 0,
        seed: int = 0,
        value_format: str = "json",
        bad_every: int = 0,
        keys: int = 1000,
        delete_every: int = 10,
        value_size: int = 16,
        output_names: list[str] | None = None,
    ) -> None:
        if kind not in ("counter", "orders", "key-value", "auction"):
            raise DefiniteError(f"source {name!r}: unknown generator kind {kind!r}")
        if rate <= 0:
            raise DefiniteError(f"source {name!r}: rate must be positive, got {rate}")
        if keys < 1 or delete_every < 0 or not 0 <= value_size <= MAX_VALUE_SIZE:
            raise DefiniteError(
                f"source {name!r}: expected keys >= 1, delete_every >= 0 and value_size in "
                f"[0, {MAX_VALUE_SIZE}], got {keys}, {delete_every}, {value_size}")
        self.name = name
        self.clock = clock
        self.spec = GeneratorSpec(kind, seed, value_format, bad_every, keys, delete_every,
                                  value_size)
        self.rate = rate
        self.start = start
        self.end = None if max_records is None else start + max_records
        self._anchor: tuple[int, int] | None = None
        fixed = {"orders": ["customers", "orders"], "auction": list(AUCTION_SCHEMAS)}
        natural = fixed.get(kind, ["value"])
        names = output_names or natural
        if kind in fixed and sorted(names) != sorted(natural):
            raise DefiniteError(
                f"source {name!r}: an {kind} generator has the outputs "
                f"{', '.join(repr(n) for n in natural)}, got {names}"
            )
        if kind not in fixed and len(names) != 1:
            raise DefiniteError(
                f"source {name!r}: a {kind} generator has exactly one output, got {names}"
            )
        self._names = natural if kind in fixed else names

    def outputs(self) -> list[OutputSpec]:
        if self.spec.kind == "auction":
            return [OutputSpec(name, typed=True, schema=schema, key=("id",))
                    for name, schema in AUCTION_SCHEMAS.items()]
        if self.spec.kind == "orders":
            return [
                OutputSpec("customers", typed=True, schema=CUSTOMERS_SCHEMA, key=("customer_id",)),
                OutputSpec("orders", typed=True, schema=ORDERS_SCHEMA, key=("order_id",)),
            ]
        return [OutputSpec(self._names[0], typed=False)]

    def initial_frontier(self) -> Antichain[Counter]:
        return Antichain.from_elem(Counter(self.start))

    def open(self, resume: Antichain[Counter], bound: Antichain[Counter],
             held: Sequence[Antichain[Counter] | None] = (),
             resnapshot: Sequence[int] = ()) -> None:
        b = bound.as_option()
        value = self.start if b is None else max(int(b), self.start)
        self._anchor = (value, self.clock.now())

    def _available(self) -> int:
        if self._anchor is None:
            raise DefiniteError(f"source {self.name!r}: probe before open")
        value, at = self._anchor
        n = value + int((self.clock.now() - at) * self.rate / 1000.0)
        return n if self.end is None else min(n, self.end)

    def probe(self) -> Antichain[Counter]:
        n = self._available()
        if self.end is not None and n >= self.end:
            return Antichain.empty()
        return Antichain.from_elem(Counter(n))

    def plan(
        self, lower: Antichain[Counter], upper: Antichain[Counter], max_task: int, max_job: int
    ) -> tuple[list[ReadTask], Antichain[Counter]]:
        lo_t = lower.as_option()
        if lo_t is None:
            return [], lower
        lo = int(lo_t)
        up_t = upper.as_option()
        hi = self.end if up_t is None else int(up_t)
        if hi is None:
            raise DefiniteError(f"source {self.name!r}: cannot read to the empty frontier")
        stop = min(hi, lo + max_job)
        anchor_value, anchor_time = self._anchor or (self.start, self.clock.now())
        tasks = [
            ReadTask(self.name, i, (a, min(stop, a + max_task), anchor_value, anchor_time,
                                    self.rate), min(stop, a + max_task) - a)
            for i, a in enumerate(range(lo, stop, max_task))
        ]
        reached: Antichain[Counter] = (
            Antichain.empty() if up_t is None and stop == hi else Antichain.from_elem(Counter(stop))
        )
        return tasks, reached

    def reader(self) -> GeneratorReader:
        return GeneratorReader(self.spec)

    def acknowledge(self, frontier: Antichain[Any]) -> None:
        """A generator holds no upstream resources."""

    def close(self) -> None:
        """Nothing to release."""

    # -- for verification --------------------------------------------------------
    replayable = True
    plan_again = True
    can_resnapshot = True  # by replay: every record can be made again


# -- configuration ----------------------------------------------------------------


class GeneratorConfig(ConnectorConfig):
    """A deterministic load generator; its FromTime is a counter."""

    kind: Literal["counter", "orders", "key-value", "auction"]
    """``counter``: one output of raw bytes in ``value_format``. ``orders``: two
    typed outputs, ``customers`` and ``orders``. ``key-value``: one output of
    JSON keys and values (null: a delete) for the ``upsert`` envelope.
    ``auction``: Materialize's AUCTION tables, five typed outputs
    (``organizations``, ``users``, ``accounts``, ``auctions``, ``bids``)."""
    rate: float = Field(default=1000.0, gt=0, le=1e9)
    """Records per second that become available."""
    max_records: int | None = Field(default=None, ge=0)
    """Finite generator: after this many records the source finishes and its
    outputs close. Unset: runs forever."""
    start: int = Field(default=0, ge=0)
    """The first counter value (the start position)."""
    seed: int = 0
    """Seed of the generated data (same seed, same data)."""
    value_format: Literal["json", "text", "csv", "bytes"] = "json"
    """``counter`` only: the encoding of the emitted value bytes."""
    bad_every: int = Field(default=0, ge=0)
    """``counter`` only: every Nth record is malformed for its format, to
    exercise the error collection; 0 = never."""
    keys: int = Field(default=1000, ge=1)
    """``key-value`` only: the number of distinct keys (``0 .. keys - 1``); the
    first ``keys`` records insert them."""
    delete_every: int = Field(default=10, ge=0)
    """``key-value`` only: every Nth record after the first ``keys`` deletes
    its key (a null value); 0 = never."""
    value_size: int = Field(default=16, ge=0, le=MAX_VALUE_SIZE)
    """``key-value`` only: the characters of each value's ``payload``."""

    @classmethod
    def check_raw(cls, data: Mapping[str, Any]) -> list[InitErrorDetails]:
        kind = data.get("kind")
        if kind not in ("counter", "orders", "key-value", "auction"):
            return []  # the kind's own error says enough
        only = {"counter": ("value_format", "bad_every"),
                "key-value": ("keys", "delete_every", "value_size")}
        return [
            problem((k,), f"only applies to kind {owner!r}")
            for owner, keys in only.items() if kind != owner for k in keys if k in data
        ]

    @classmethod
    def output_problem(cls, data: Mapping[str, Any], outputs: Sequence[str]
                       ) -> tuple[str, str] | None:
        kind = data.get("kind")
        fixed = {"orders": ["customers", "orders"], "auction": list(AUCTION_SCHEMAS)}
        if kind in fixed:
            natural = fixed[kind]
            if sorted(outputs) == sorted(natural):
                return None
            return (f"an {kind} generator has the outputs "
                    f"{', '.join(repr(n) for n in natural)}, got {list(outputs)}",
                    f"give the source exactly the outputs {', '.join(natural)}")
        if kind in ("counter", "key-value") and len(outputs) != 1:
            return (f"a {kind} generator has exactly one output, got {list(outputs)}",
                    "keep one output; to land it in several places, give that output a list "
                    "of sinks (sinks: [...]), or add a second source")
        return None

    def build(self, name: str, ctx: SourceContext) -> GeneratorSource:
        return GeneratorSource(
            name, clock=ctx.clock, kind=self.kind, rate=self.rate,
            max_records=self.max_records, start=self.start, seed=self.seed,
            value_format=self.value_format, bad_every=self.bad_every, keys=self.keys,
            delete_every=self.delete_every, value_size=self.value_size,
            output_names=list(ctx.output_names))


PLUGIN = SourcePlugin(name="generator", config=GeneratorConfig, rank=1)
