"""The session's job gate: at most ``slots`` jobs at once, in arrival order;
the first small job admitted takes the small jobs waiting into its shared
job. Threads stand in for sources; no Spark (the gate never calls it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

import reclock.runtime.dataplane as dp
from reclock.runtime.dataplane import JobGate, _Shared

pytestmark = pytest.mark.unit


def small(name: str) -> _Shared:
    return _Shared(ctx=None, tasks=[], group=name)  # type: ignore[arg-type]


class Log:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[str] = []
        self.running = 0
        self.most = 0

    def add(self, event: str) -> None:
        with self.lock:
            self.events.append(event)


def until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_jobs_run_in_arrival_order_and_waiting_small_jobs_share_one() -> None:
    gate = JobGate(1)
    log = Log()
    release = threading.Event()

    def plain(name: str, hold: threading.Event | None = None) -> None:
        with gate:
            log.add(f"start {name}")
            if hold is not None:
                assert hold.wait(10)
            log.add(f"end {name}")

    def run_small(req: _Shared) -> None:
        def execute(batch: list[_Shared]) -> None:
            log.add("shared " + "+".join(r.group for r in batch))
            for r in batch:
                r.results.append(f"result of {r.group}")  # type: ignore[arg-type]

        gate.shared(req, execute)
        log.add(f"woken {req.group}")

    reqs = {n: small(n) for n in ("a", "b", "c")}
    threads = [threading.Thread(target=plain, args=("first", release))]
    threads[0].start()
    until(lambda: log.events == ["start first"], "the first job did not start")
    # queued behind it, in this order: a, p (a plain job), b, c
    for target, args in ((run_small, (reqs["a"],)), (plain, ("p",)),
                         (run_small, (reqs["b"],)), (run_small, (reqs["c"],))):
        t = threading.Thread(target=target, args=args)
        t.start()
        threads.append(t)
        queued = len(threads) - 1
        until(lambda q=queued: len(gate._queue) == q, "not queued")
    release.set()
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    ev = log.events
    # a came first of the waiting: its job took b and c, which p did not hold back
    assert ev[:3] == ["start first", "end first", "shared a+b+c"]
    assert ev.index("start p") > ev.index("shared a+b+c")
    assert {e for e in ev if e.startswith("woken")} == {"woken a", "woken b", "woken c"}
    assert all(r.results == [f"result of {r.group}"] for r in reqs.values())
    assert gate._running == 0 and not gate._queue


def test_no_more_than_slots_jobs_run_and_a_shared_job_holds_at_most_shared_max(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dp, "SHARED_MAX", 3)
    gate = JobGate(2)
    log = Log()
    batches: list[int] = []

    def execute(batch: list[_Shared]) -> None:
        with log.lock:
            log.running += 1
            log.most = max(log.most, log.running)
            batches.append(len(batch))
        time.sleep(0.02)
        with log.lock:
            log.running -= 1

    def plain() -> None:
        with gate:
            execute([])

    threads = [threading.Thread(target=gate.shared, args=(small(f"s{i}"), execute))
               for i in range(40)] + [threading.Thread(target=plain) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
        assert not t.is_alive()
    assert log.most <= 2
    assert max(batches) <= 3
    assert sum(batches) == 40  # every small job ran once (the plain ones count 0)
    assert gate._running == 0 and not gate._queue


def test_a_failing_shared_job_frees_its_slot() -> None:
    gate = JobGate(1)

    def boom(batch: list[_Shared]) -> None:
        raise RuntimeError("the job failed")

    with pytest.raises(RuntimeError):
        gate.shared(small("x"), boom)
    with gate:  # the slot is free again
        pass
    assert gate._running == 0
