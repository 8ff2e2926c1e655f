"""The remap store on SQLite and PostgreSQL: compare-and-append, reads as of a
time, listening, compaction, and two minters racing on one shard."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest

from reclock.contracts.remap_store import RemapStore
from reclock.core.bindings import Binding, Bindings
from reclock.core.clock import ManualClock, SystemClock
from reclock.core.errors import (
    BindingError,
    FrontierRegression,
    ShardNotFound,
    SinceViolation,
    UpperMismatch,
)
from reclock.core.frontier import Antichain, kafka_frontier
from reclock.core.mint import RemapOperator
from reclock.core.time import Counter, IntoTime, Lsn, Partitioned
from reclock.registry import open_store
from reclock.remap_store.sql import redact_url


def up(v: int | None) -> Antichain[IntoTime]:
    return Antichain.empty() if v is None else Antichain.from_elem(IntoTime(v))


def lsn(v: int) -> Antichain[Lsn]:
    return Antichain.from_elem(Lsn(v))


@pytest.fixture
def store(store_url: str) -> Any:
    s = open_store(store_url)
    yield s
    s.close()


def test_compare_and_append_and_mismatch(store: RemapStore) -> None:
    store.create_shard("pg", "lsn")
    store.create_shard("pg", "lsn")  # idempotent
    with pytest.raises(BindingError, match="holds lsn times"):
        store.create_shard("pg", "kafka")
    assert store.upper("pg") == up(0)
    store.compare_and_append("pg", [Binding(IntoTime(1000), lsn(10))], up(0), up(1001))
    with pytest.raises(UpperMismatch) as info:
        store.compare_and_append("pg", [Binding(IntoTime(2000), lsn(20))], up(0), up(2001))
    assert info.value.actual == up(1001)
    # nothing was written by the failed append
    assert store.read("pg") == Bindings("lsn", [Binding(IntoTime(1000), lsn(10))], upper=1001)
    # the upper alone may advance
    store.compare_and_append("pg", [], up(1001), up(1500))
    store.compare_and_append("pg", [Binding(IntoTime(2000), lsn(20))], up(1500), up(2001))
    assert [int(b.time) for b in store.read("pg").bindings] == [1000, 2000]


def test_append_and_read_from_is_an_append_then_a_read(store: RemapStore,
                                                        store_url: str) -> None:
    """The minting tick's call: what compare_and_append then read_from would
    give, on success and on a lost race (not raised: the winner's bindings);
    an invalid append raises and moves nothing."""
    store.create_shard("m", "lsn")
    other = open_store(store_url)  # another driver's handle, no shared cache
    try:
        b1 = Binding(IntoTime(1000), lsn(10))
        assert store.append_and_read_from("m", [b1], up(0), up(1001)) == (
            True, ([b1], up(1001), IntoTime(0)))
        assert store.append_and_read_from("m", [], up(1001), up(1500)) == (
            True, ([], up(1500), IntoTime(0)))
        b2 = Binding(IntoTime(2000), lsn(20))
        other.compare_and_append("m", [b2], up(1500), up(2001))  # wins the race
        assert store.append_and_read_from(
            "m", [Binding(IntoTime(1600), lsn(15))], up(1500), up(1601)) == (
            False, ([b2], up(2001), IntoTime(0)))
        # the cached tail after a lost race: the next append and read go on from it
        b3 = Binding(IntoTime(3000), lsn(30))
        assert store.append_and_read_from("m", [b3], up(2001), up(3001)) == (
            True, ([b3], up(3001), IntoTime(0)))
        assert other.read_from("m", 1500) == ([b2, b3], up(3001), IntoTime(0))
        with pytest.raises(BindingError):  # a frontier going backwards: rolled back
            store.append_and_read_from("m", [Binding(IntoTime(4000), lsn(5))], up(3001),
                                       up(4001))
        assert other.upper("m") == up(3001)
        b4 = Binding(IntoTime(5000), Antichain.empty())  # the source finished
        assert store.append_and_read_from("m", [b4], up(3001), up(None)) == (
            True, ([b4], up(None), IntoTime(0)))
        final = store.read("m")
        assert final == other.read("m")
        assert list(final.bindings) == [b1, b2, b3, b4] and final.is_closed
    finally:
        other.close()


def test_appends_arriving_together_each_go_as_alone(store: RemapStore,
                                                    store_url: str) -> None:
    """Forty minters append at the same moment, round after round: each gets
    what it would alone. Some lose races to another driver's handle, some
    append a frontier that goes backwards. The stored shards equal a model
    built from what each minter was told."""
    from reclock.core.errors import TransientError

    n, rounds = 40, 12
    other = open_store(store_url)
    for i in range(n):
        store.create_shard(f"g{i}", "lsn")
    model: dict[str, list[Binding[Lsn]]] = {f"g{i}": [] for i in range(n)}
    outcomes: dict[str, list[str]] = {f"g{i}": [] for i in range(n)}
    barrier = threading.Barrier(n, timeout=60)
    problems: list[str] = []

    def minter(i: int) -> None:
        try:
            mint_rounds(i)
        except threading.BrokenBarrierError:  # another minter failed or hung
            problems.append(f"g{i}: the round's barrier broke")
        except BaseException as exc:
            problems.append(f"g{i}: {exc!r}")
            barrier.abort()

    def mint_rounds(i: int) -> None:
        shard, upper, value = f"g{i}", 0, 0
        for r in range(1, rounds + 1):
            if i % 7 == 3 and r % 4 == 2:  # another driver appends first
                value += 1
                won = Binding(IntoTime(1000 * r - 500), lsn(value))
                other.compare_and_append(shard, [won], up(upper), up(1000 * r - 499))
                model[shard].append(won)
                upper = 1000 * r - 499
                expected = upper - 1  # this minter's stale view
            else:
                expected = upper
            backwards = i % 5 == 1 and r % 3 == 0
            b = Binding(IntoTime(1000 * r), lsn(0 if backwards else value + 1))
            barrier.wait()
            try:
                ok, (new, got_upper, _since) = store.append_and_read_from(
                    shard, [b], up(expected), up(1000 * r + 1))
            except BindingError:
                outcomes[shard].append("invalid")
                if not backwards:
                    problems.append(f"{shard} round {r}: refused a valid append")
                continue
            except TransientError:
                outcomes[shard].append("failed")
                continue
            if ok and backwards:  # (a stale one loses its race first)
                problems.append(f"{shard} round {r}: took a frontier going backwards")
            if ok:
                outcomes[shard].append("appended")
                if expected != upper:
                    problems.append(f"{shard} round {r}: appended on a stale upper")
                model[shard].append(b)
                value += 1
                upper = 1000 * r + 1
                if (new, got_upper) != ([b], up(upper)):
                    problems.append(f"{shard} round {r}: read back {new} {got_upper}")
            else:
                outcomes[shard].append("lost")
                if expected == upper:
                    problems.append(f"{shard} round {r}: lost a race nobody ran")
                if (new, got_upper) != (model[shard][-1:], up(upper)):
                    problems.append(f"{shard} round {r}: read back {new} {got_upper}")

    threads = [threading.Thread(target=minter, args=(i,)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a minter hung"
        assert not problems, problems[:5]
        for shard, bs in model.items():
            assert list(store.read(shard).bindings) == bs, shard
            assert list(other.read(shard).bindings) == bs, shard
        seen = {o for os in outcomes.values() for o in os}
        assert {"appended", "lost", "invalid"} <= seen
    finally:
        other.close()


def test_open_shards_creates_and_reads_many_at_once(store: RemapStore) -> None:
    # a driver starting many sources: what create_shard + read give each
    store.create_shard("old", "lsn")
    store.compare_and_append("old", [Binding(IntoTime(1000), lsn(10))], up(0), up(1001))
    store.create_shard("other", "counter")
    got = store.open_shards({"old": "lsn", "new": "kafka", "other": "lsn", "odd": "nope"})
    assert sorted(got) == ["new", "old"]  # a kind that differs is left to create_shard
    assert got["old"] == store.read("old") and got["new"] == store.read("new")
    assert got["new"].kind == "kafka" and store.upper("new") == up(0)
    assert store.open_shards({"new": "kafka"}) == {"new": store.read("new")}  # idempotent
    with pytest.raises(BindingError, match="holds counter times"):
        store.create_shard("other", "lsn")
    op = RemapOperator(store, "old", "lsn", initial_frontier=lsn(0), clock=SystemClock(),
                       snapshot=got["old"])
    assert op.bindings is got["old"]


def test_read_encoded_is_read_left_encoded(store: RemapStore) -> None:
    # reclock bindings shows frontiers as stored: change rows (a few of 40
    # partitions moving) give the canonical order of Antichain.encode()
    store.create_shard("k", "kafka")
    offsets = dict.fromkeys(range(40), 0)
    bs = []
    for i in range(6):
        offsets[(7 * i) % 40] += 3
        offsets[39 - i] += 1
        bs.append(Binding(IntoTime(1000 * (i + 1)), kafka_frontier(offsets, partitions=41 + i)))
    store.compare_and_append("k", bs, up(0), up(7000))
    b = store.read("k")
    assert store.read_encoded("k") == (
        "kafka", 0, 7000, [(int(x.time), x.frontier.encode()) for x in b.bindings])
    store.create_shard("pg", "lsn")
    store.compare_and_append("pg", [Binding(IntoTime(5), lsn(10))], up(0), up(None))
    assert store.read_encoded("pg") == ("lsn", 0, None, [(5, ["0/A"])])


def test_append_validation_rolls_back(store: RemapStore) -> None:
    store.create_shard("k", "kafka")
    store.compare_and_append(
        "k", [Binding(IntoTime(1000), kafka_frontier({0: 5}))], up(0), up(1001)
    )
    with pytest.raises(BindingError, match="monotone"):
        store.compare_and_append(
            "k", [Binding(IntoTime(2000), kafka_frontier({0: 3}))], up(1001), up(2001)
        )
    with pytest.raises(BindingError, match="below the current upper"):
        store.compare_and_append(
            "k", [Binding(IntoTime(500), kafka_frontier({0: 9}))], up(1001), up(2001)
        )
    with pytest.raises(BindingError, match="must advance"):
        store.compare_and_append("k", [], up(1001), up(1001))
    assert store.upper("k") == up(1001)  # the upper move was rolled back too
    with pytest.raises(ShardNotFound, match="no shard 'nope'"):
        store.upper("nope")


def test_read_as_of_listen_and_close(store: RemapStore) -> None:
    store.create_shard("c", "counter")
    for i, t in enumerate((1000, 2000, 3000)):
        store.compare_and_append(
            "c",
            [Binding(IntoTime(t), Antichain.from_elem(Counter(10 * (i + 1))))],
            store.upper("c"),
            up(t + 1),
        )
    snap = store.read("c", as_of=2500)
    assert [int(b.time) for b in snap.bindings] == [1000, 2000] and snap.upper == up(2501)
    assert store.read("c", as_of=99999).upper == up(3001)
    new, upper = store.listen("c", up(3001), timeout=0.1)
    assert new == [] and upper == up(3001)
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(store.listen("c", up(3001), timeout=10)))
    t.start()
    store.compare_and_append("c", [Binding(IntoTime(4000), Antichain.empty())], up(3001), up(None))
    t.join()
    new, upper = got[0]
    assert upper == up(None) and [int(b.time) for b in new] == [4000]
    assert store.read("c").is_closed
    with pytest.raises(BindingError, match="empty upper"):
        store.compare_and_append("c", [], up(None), up(None))


def test_compaction_keeps_frontiers_from_since(store: RemapStore) -> None:
    store.create_shard("k", "kafka")
    times = (1000, 2000, 3000, 4000)
    for i, t in enumerate(times):
        store.compare_and_append(
            "k",
            [Binding(IntoTime(t), kafka_frontier({0: 5 * (i + 1)}))],
            store.upper("k"),
            up(t + 1),
        )
    before = store.read("k")
    assert store.compact("k", 2999) == 1  # 1000 and 2000 consolidated into one at 2999
    after = store.read("k")
    assert int(after.since) == 2999
    assert [int(b.time) for b in after.bindings] == [2999, 3000, 4000]
    for t in range(2999, 4001, 250):
        assert after.frontier_at(t) == before.frontier_at(t)
    assert store.compact("k", 1000) == 0  # backwards: no-op
    assert int(store.since("k")) == 2999
    with pytest.raises(SinceViolation):
        store.read("k", as_of=2000)
    with pytest.raises(SinceViolation, match="below the upper"):
        store.compact("k", 4001)
    # appending still works after compaction
    store.compare_and_append(
        "k", [Binding(IntoTime(5000), kafka_frontier({0: 30}))], up(4001), up(5001)
    )
    assert store.read("k").frontier_at(5000) == kafka_frontier({0: 30})


def test_drop_shard(store: RemapStore) -> None:
    store.create_shard("gone", "lsn")
    assert "gone" in store.shards()
    store.drop_shard("gone")
    assert "gone" not in store.shards()


def test_redacted_urls_hide_passwords() -> None:
    assert "s3cret" not in redact_url("postgresql+psycopg://u:s3cret@h/db")


# -- minting ------------------------------------------------------------------


def test_minting_rules(store: RemapStore) -> None:
    clock = ManualClock(10_250)
    op: RemapOperator[Lsn] = RemapOperator(
        store, "src", "lsn", initial_frontier=lsn(5), clock=clock, timestamp_interval_ms=1000
    )
    b = op.mint(lsn(5))
    # first binding: the initial frontier at as_of (default: now rounded down)
    assert [(int(x.time), x.frontier) for x in b.bindings] == [(10_000, lsn(5))]
    assert b.upper == up(10_001)
    # same interval again: nothing new, never ahead of the clock
    clock.advance(500)
    assert op.mint(lsn(9)).upper == up(10_001)
    clock.advance(300)  # 11_050
    b = op.mint(lsn(9))
    assert int(b.bindings[-1].time) == 11_000 and b.upper == up(11_001)
    assert all(int(x.time) <= clock.now() for x in b.bindings)
    # far behind: one binding covers everything available
    clock.advance(60_000)
    b = op.mint(lsn(100))
    assert [int(x.time) for x in b.bindings] == [10_000, 11_000, 71_000]
    # unchanged frontier: the upper moves, no new binding
    clock.advance(1000)
    b = op.mint(lsn(100))
    assert len(b) == 3 and b.upper == up(72_001)
    # backwards: a definite error, nothing appended
    clock.advance(1000)
    with pytest.raises(FrontierRegression, match="behind the last binding"):
        op.mint(lsn(50))
    assert store.upper("src") == up(72_001)
    # finished: the empty frontier is bound and the shard closes
    b = op.mint(Antichain.empty())
    assert b.is_closed and b.bindings[-1].frontier == Antichain.empty()
    assert op.mint(lsn(500)).is_closed
    # what the operator uses is exactly what the store holds
    assert store.read("src") == op.bindings


def test_as_of_and_start_position_fixed_at_construction(store: RemapStore) -> None:
    clock = ManualClock(5_000)
    op: RemapOperator[Any] = RemapOperator(
        store,
        "k",
        "kafka",
        initial_frontier=kafka_frontier({0: 40, 1: 7}),
        clock=clock,
        as_of=3_000,
    )
    b = op.mint(kafka_frontier({0: 50, 1: 7}))
    assert [int(x.time) for x in b.bindings] == [3_000, 5_000]
    assert b.source_upper_at(3_000) == kafka_frontier({0: 40, 1: 7})  # resume at the start
    assert b.reclock(Partitioned.point(0, 45)) == 5_000
    assert b.reclock(Partitioned.point(0, 50)) is None


def test_stale_minter_resyncs(store: RemapStore, store_url: str) -> None:
    clock = ManualClock(1_000)
    other = open_store(store_url)
    a: RemapOperator[Lsn] = RemapOperator(store, "s", "lsn", initial_frontier=lsn(0), clock=clock)
    b: RemapOperator[Lsn] = RemapOperator(other, "s", "lsn", initial_frontier=lsn(0), clock=clock)
    a.mint(lsn(0))
    clock.advance(1000)
    a.mint(lsn(10))
    assert len(b.bindings) == 0  # b is stale
    clock.advance(1000)
    res = b.mint(lsn(20))  # syncs first, then appends after a's bindings
    assert [int(x.time) for x in res.bindings] == [1000, 2000, 3000]
    assert res == a.sync() == store.read("s")
    other.close()


class _Recorder:
    """Wraps a store and records every successful compare_and_append."""

    def __init__(self, inner: RemapStore, log: list[Any], lock: threading.Lock) -> None:
        self._inner = inner
        self._log = log
        self._lock = lock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def compare_and_append(self, shard: str, bindings: Any, expected: Any, new: Any) -> None:
        self._inner.compare_and_append(shard, bindings, expected, new)
        with self._lock:
            self._log.append((tuple(bindings), expected, new))

    def append_and_read_from(self, shard: str, bindings: Any, expected: Any, new: Any) -> Any:
        ok, read = self._inner.append_and_read_from(shard, bindings, expected, new)
        if ok:
            with self._lock:
                self._log.append((tuple(bindings), expected, new))
        return ok, read


@pytest.mark.parametrize("rounds", [150])
def test_two_minters_race_on_one_store(store_url: str, rounds: int) -> None:
    """Two minters on one shard with a 1 ms interval: the history stays valid
    and monotone; every successful append is in the store exactly once, and
    the store holds nothing else."""
    upstream = itertools.count(1)
    level = [0]
    level_lock = threading.Lock()

    def probe() -> Antichain[Counter]:
        with level_lock:  # a monotone upstream that keeps moving
            level[0] = next(upstream)
            return Antichain.from_elem(Counter(level[0]))

    log: list[Any] = []
    log_lock = threading.Lock()
    errors: list[BaseException] = []
    ops = []
    stores = [open_store(store_url) for _ in range(2)]
    for s in stores:
        ops.append(
            RemapOperator(
                _Recorder(s, log, log_lock),
                "race",
                "counter",  # type: ignore[arg-type]
                initial_frontier=Antichain.from_elem(Counter(0)),
                clock=SystemClock(),
                timestamp_interval_ms=1,
            )
        )

    def run(op: RemapOperator[Counter]) -> None:
        try:
            for _ in range(rounds):
                op.mint(probe)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(op,)) for op in ops]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    final = stores[0].read("race")  # validates: increasing times, monotone frontiers
    appended = [b for bs, _, _ in log for b in bs]
    assert sorted(appended, key=lambda b: int(b.time)) == list(final.bindings)
    assert len({int(b.time) for b in appended}) == len(appended)  # nothing doubled
    # the uppers chain: each successful append started where the previous ended
    chain = sorted(log, key=lambda e: int(e[1].elements[0]))
    for prev, nxt in itertools.pairwise(chain):
        assert prev[2] == nxt[1]
    assert chain[-1][2] == final.upper
    # the race really happened: stale writers hit the mismatch path and re-synced
    assert sum(op.lost_races for op in ops) > 0, "no lost race: the test did not race"
    for op in ops:
        assert op.sync() == final
    for s in stores:
        s.close()


def test_coordinates_are_dense_durable_and_shared(store: RemapStore, store_url: str) -> None:
    """A multi-topic source's (topic, partition) ids: assigned once in the
    order asked, never changed, seen alike by a second store handle (another
    driver), and gone with the shard."""
    assert store.coordinates("multi") == {}
    got = store.coordinates("multi", ['["a",0]', '["a",1]', '["a",0]'])
    assert got == {'["a",0]': 0, '["a",1]': 1}
    other = open_store(store_url)
    try:
        # the other handle asks for a known one and two new ones: ids go on from 2
        assert other.coordinates("multi", ['["b",0]', '["a",1]', '["c",0]']) == {
            '["a",0]': 0, '["a",1]': 1, '["b",0]': 2, '["c",0]': 3}
    finally:
        other.close()
    assert store.coordinates("multi", ['["a",0]'])['["b",0]'] == 2
    assert store.coordinates("other", ['["z",5]']) == {'["z",5]': 0}  # per shard
    store.create_shard("multi", "kafka")
    store.drop_shard("multi")
    assert store.coordinates("multi") == {}
    assert store.coordinates("other") == {'["z",5]': 0}


def test_facts_are_durable_per_shard_replaced_removed_and_dropped(
        store: RemapStore, store_url: str) -> None:
    """Facts a shard's state depends on: set and replaced in one call,
    removed by None, seen alike by a second handle, per shard, and gone with
    the shard (a re-created source must not inherit an old topic's id)."""
    assert store.facts("s") == {}
    store.put_facts("s", {"kafka.topic:a": '{"ids": ["x"]}', "sink:o": '{"upper": 5}'})
    store.put_facts("t", {"sink:o": '{"upper": 1}'})
    other = open_store(store_url)
    try:
        assert other.facts("s") == {"kafka.topic:a": '{"ids": ["x"]}', "sink:o": '{"upper": 5}'}
        other.put_facts("s", {"sink:o": '{"upper": 9}', "kafka.topic:a": None, "new": "1"})
    finally:
        other.close()
    assert store.facts("s") == {"sink:o": '{"upper": 9}', "new": "1"}
    store.put_facts("s", {})  # nothing to do
    store.create_shard("s", "kafka")
    store.drop_shard("s")
    assert store.facts("s") == {}
    assert store.facts("t") == {"sink:o": '{"upper": 1}'}


def test_coordinates_race(store_url: str) -> None:
    """Two assigners at once never give one id to two names, or two ids to one."""
    results: list[dict[str, int]] = []
    errors: list[BaseException] = []

    def assign(names: list[str]) -> None:
        try:
            s = open_store(store_url)  # both open a new store at once, too
            try:
                for n in names:
                    results.append(s.coordinates("race", [n]))
            finally:
                s.close()
        except BaseException as exc:  # a thread's failure fails the test
            errors.append(exc)

    a = [f'["t",{i}]' for i in range(0, 20)]
    b = [f'["t",{i}]' for i in range(10, 30)]
    threads = [threading.Thread(target=assign, args=(x,)) for x in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    final = open_store(store_url)
    try:
        ids = final.coordinates("race")
    finally:
        final.close()
    assert sorted(ids.values()) == list(range(30))
    for r in results:  # every answer agrees with the final assignment
        assert all(ids[n] == c for n, c in r.items())


def _rows(store: Any, shard: str) -> list[tuple[int, str]]:
    import sqlalchemy as sa

    from reclock.remap_store.sql import bindings_table

    with store.engine.connect() as conn:
        return [(int(t), str(f)) for t, f in conn.execute(
            sa.select(bindings_table.c.into_time, bindings_table.c.frontier)
            .where(bindings_table.c.shard == shard).order_by(bindings_table.c.into_time))]


def _moving(n: int, parts: int, seed: int) -> list[Binding[Partitioned]]:
    """``n`` Kafka bindings over ``parts`` partitions, a few moving each time
    and partitions appearing now and then (the frontier grows)."""
    import random

    rng = random.Random(seed)
    offsets = dict.fromkeys(range(parts // 2), 0)
    out = []
    for i in range(n):
        for p in rng.sample(range(parts), 3):
            if p in offsets:
                offsets[p] += rng.randint(1, 50)
        if i % 40 == 39 and len(offsets) < parts:
            offsets[len(offsets)] = rng.randint(0, 5)
        out.append(Binding(IntoTime(1000 + 1000 * i), kafka_frontier(dict(offsets))))
    return out


def test_bindings_are_stored_as_changes_and_read_back_whole(store: Any) -> None:
    from reclock.remap_store.delta import CHECKPOINT, is_whole

    bs = _moving(300, 256, 1)
    store.create_shard("d", "kafka")
    upper = up(0)
    for lo in range(0, 300, 7):  # appends of several bindings, and of one
        chunk = bs[lo:lo + 7] if lo % 2 else bs[lo:lo + 1] + bs[lo + 1:lo + 7]
        new = up(int(chunk[-1].time) + 1)
        store.compare_and_append("d", chunk, upper, new)
        upper = new
    rows = _rows(store, "d")
    whole = [i for i, (_t, text) in enumerate(rows) if is_whole(text)]
    assert whole[0] == 0 and all(b - a <= CHECKPOINT for a, b in itertools.pairwise(whole))
    assert len(whole) < len(rows) / 10
    full = sum(len(b.frontier.encode_json()) for b in bs)
    assert sum(len(text) for _t, text in rows) < full / 10
    got = store.read("d")
    assert got.bindings == tuple(bs)
    for lower in (0, 1000, 5500, 64_000, 65_000, 150_500, 299_000, 300_000):
        new, _, _ = store.read_from("d", lower)
        assert new == [b for b in bs if int(b.time) >= lower], lower
    assert store.read("d", as_of=100_000).bindings == tuple(bs[:100])
    # compaction rewrites the head whole; later frontiers read as before
    store.compact("d", 130_500)
    rows = _rows(store, "d")
    assert rows[0][0] == 130_500 and is_whole(rows[0][1])
    after = store.read("d")
    for t in (130_500, 131_000, 200_000, 299_000):
        assert after.frontier_at(t) == got.frontier_at(t), t


def test_a_store_of_whole_bindings_is_migrated_once(store_url: str) -> None:
    """A store written before changes were stored (every row whole, no
    format key) reads the same after it is migrated on open."""
    import sqlalchemy as sa

    from reclock.remap_store.delta import is_whole
    from reclock.remap_store.sql import bindings_table, pipeline_table

    s = open_store(store_url)
    bs = _moving(150, 64, 2)
    s.create_shard("old", "kafka")
    s.create_shard("lsn", "lsn")
    s.compare_and_append("old", bs, up(0), up(int(bs[-1].time) + 1))
    s.compare_and_append("lsn", [Binding(IntoTime(5), lsn(7)), Binding(IntoTime(9), lsn(8))],
                         up(0), up(10))
    before = {sh: s.read(sh) for sh in ("old", "lsn")}
    with s.engine.begin() as conn:  # as an older reclock left it
        for b in bs:
            conn.execute(sa.update(bindings_table).where(
                bindings_table.c.shard == "old", bindings_table.c.into_time == int(b.time)
            ).values(frontier=b.frontier.encode_json()))
        conn.execute(sa.delete(pipeline_table).where(pipeline_table.c.key == "bindings_format"))
    assert all(is_whole(text) for _t, text in _rows(s, "old"))
    assert s.read("old") == before["old"]  # whole rows read as they always did
    s.close()
    migrated = open_store(store_url)
    try:
        rows = _rows(migrated, "old")
        assert sum(not is_whole(text) for _t, text in rows) > 100
        assert {sh: migrated.read(sh) for sh in ("old", "lsn")} == before
        again = open_store(store_url)  # the next open finds it done
        assert _rows(again, "old") == rows
        again.close()
    finally:
        migrated.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_stores_that_remember_where_rows_end_agree_with_a_model(store_url: str,
                                                                seed: int) -> None:
    """Two store objects on one shard (a driver and a zombie, say), each
    remembering where the rows it last read or wrote end: appends through
    either (some with a stale upper), compactions through either, and reads
    from any lower through either all agree with a plain list of the
    bindings appended."""
    import random

    rng = random.Random(seed)
    stores = [open_store(store_url), open_store(store_url)]
    shard = f"tails{seed}"
    stores[0].create_shard(shard, "kafka")
    bs = _moving(260, 32, seed)
    model: list[Binding[Partitioned]] = []  # what the store must hold
    upper, since, nxt = 0, 0, 0
    seen = [0, 0]  # the upper each store object last saw
    try:
        for _ in range(400):
            i = rng.randrange(2)
            s = stores[i]
            op = rng.random()
            if op < 0.45 and nxt < len(bs):
                take = bs[nxt:nxt + rng.choice([1, 1, 1, 3])]
                expected = seen[i] if rng.random() < 0.3 else upper  # stale or not
                new = int(take[-1].time) + 1
                try:
                    s.compare_and_append(shard, take, up(expected), up(new))
                except UpperMismatch as exc:
                    assert expected != upper and exc.actual == up(upper)
                    seen[i] = upper
                    continue
                assert expected == upper
                model += take
                nxt += len(take)
                upper = seen[i] = new
            elif op < 0.5 and nxt < len(bs):  # the upper alone moves
                expected, new = upper, upper + rng.randint(1, 400)
                if model and new > int(bs[nxt].time):
                    continue
                s.compare_and_append(shard, [], up(expected), up(new))
                upper = seen[i] = new
            elif op < 0.55 and model and upper > 1:
                target = rng.randint(since, upper - 1)
                s.compact(shard, target)
                since = max(since, target)
            else:
                lower = rng.choice([seen[i], upper, rng.randint(0, upper)])
                if lower < since:
                    lower = upper
                new_bs, got_upper, got_since = s.read_from(shard, lower)
                assert got_upper == up(upper) and int(got_since) == since
                want = [b for b in model if int(b.time) >= lower]
                assert new_bs == want, (lower, since)
                seen[i] = upper
        for s in stores:  # whole reads agree with the model from since on
            got = s.read(shard)
            for t in range(since, upper, 997):
                assert got.frontier_at(t) == Bindings("kafka", model, upper=upper).frontier_at(t)
    finally:
        for s in stores:
            s.close()
