"""Bindings held as changes (``reclock/core/frontier_log.py``) against a
plain model: the list of ``(time, frontier)`` pairs, each frontier a whole
:class:`Antichain`, and the reclocking rule read literally (the first
binding, oldest first, whose frontier does not contain the time).

However a snapshot was made -- built whole, appended to in chunks from an
empty shard, read back from the store's change rows, unpickled, held from
a time, compacted or cut for a job -- it answers as the model does."""

from __future__ import annotations

import json
import pickle
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from reclock.core.bindings import UNBOUND, Binding, Bindings
from reclock.core.frontier import Antichain, kafka_frontier
from reclock.core.time import Counter, IntoTime, Partitioned
from reclock.remap_store import delta
from tests.strategies import antichains, partitioned

Model = list[tuple[int, Antichain[Any]]]


@st.composite
def chains(draw: st.DrawFn) -> tuple[str, Model, Antichain[IntoTime]]:
    """A monotone history: each frontier the join of the one before and a
    drawn one (intervals and all), or a Kafka frontier with partitions
    appearing; a counter's rising values; sometimes closed at the end."""
    kind = draw(st.sampled_from(["kafka", "kafka", "counter"]))
    n = draw(st.integers(0, 14))
    t = draw(st.integers(0, 3)) * 1000
    out: Model = []
    if kind == "counter":
        v = 0
        for _ in range(n):
            v += draw(st.integers(0, 4))
            out.append((t, Antichain.from_elem(Counter(v))))
            t += draw(st.integers(1, 3)) * 1000
    elif draw(st.booleans()):
        f: Antichain[Any] = draw(antichains(partitioned(), max_size=4))
        for _ in range(n):
            out.append((t, f))
            f = f.join(draw(antichains(partitioned(), max_size=3))) if draw(st.booleans()) else f
            t += draw(st.integers(1, 3)) * 1000
    else:
        offsets: dict[int, int] = {}
        parts = 0
        for _ in range(n):
            parts = max(parts, draw(st.integers(0, 5)))
            for p in draw(st.lists(st.integers(0, max(parts - 1, 0)), max_size=3)):
                if p < parts:
                    offsets[p] = offsets.get(p, 0) + draw(st.integers(0, 5))
            out.append((t, kafka_frontier(offsets, partitions=parts)))
            t += draw(st.integers(1, 3)) * 1000
    if out and draw(st.booleans()):
        out.append((t, Antichain.empty()))
        return kind, out, Antichain.empty()
    return kind, out, Antichain.from_elem(IntoTime(t))


def model_reclock(model: Model, upper: Antichain[IntoTime], time: Any) -> int | None:
    for t, f in model:
        if not f.less_equal_time(time):
            return t
    return None


def snapshots(kind: str, model: Model, upper: Antichain[IntoTime], cuts: list[int]
              ) -> dict[str, Bindings[Any]]:
    """The same history made every way the code makes one."""
    whole = Bindings(kind, [Binding(IntoTime(t), f) for t, f in model], upper=upper)
    # appended in chunks after an empty shard, as the mint reads them back
    grown: Bindings[Any] = Bindings(kind, [], upper=0)
    at = 0
    for c in [*sorted(cuts), len(model)]:
        c = min(max(c, at), len(model))
        last = c == len(model)
        grown = grown.extended([Binding(IntoTime(t), f) for t, f in model[at:c]],
                               upper if last else Antichain.from_elem(
                                   IntoTime(model[c - 1][0] + 1 if c else 0)))
        at = c
    # read back from the store's rows: whole, or changes from the row before
    w = delta.Writer(None, 0)
    rows = [(t, w.text(f.encode())) for t, f in model]
    times, log = delta.build(kind, rows)
    stored = Bindings.from_log(kind, times, log, upper=upper)
    encoded = Bindings.from_encoded(kind, [(t, f.encode()) for t, f in model], upper=upper)
    return {"whole": whole, "grown": grown, "stored": stored, "encoded": encoded,
            "unpickled": pickle.loads(pickle.dumps(stored))}


def probes(kind: str, data: st.DataObject) -> list[Any]:
    if kind == "counter":
        return [Counter(v) for v in data.draw(st.lists(st.integers(0, 60), max_size=12))]
    return data.draw(st.lists(st.one_of(partitioned(max_offset=30),
                                        st.builds(Partitioned.point, st.integers(0, 8),
                                                  st.integers(0, 30))), max_size=12))


def check_answers(b: Bindings[Any], kind: str, model: Model, upper: Antichain[IntoTime],
                  data: st.DataObject) -> None:
    assert [(int(x.time), x.frontier) for x in b.bindings] == model
    assert len(b) == len(model)
    assert (b.last is None) == (not model)
    if model:
        assert (int(b.last.time), b.last.frontier) == model[-1]  # type: ignore[union-attr]
    for t, f in model:
        assert b.frontier_at(t) == f
    times = [probe for probe in probes(kind, data)]
    for probe in times:
        want = model_reclock(model, upper, probe)
        got = b.reclock(probe)
        assert (None if got is None else int(got)) == want, (probe, got, want)
    points = [p for p in times if kind == "counter" or p.hi == p.lo]
    if points:
        if kind == "counter":
            got = b.reclock_values([int(p) for p in points]).tolist()
        else:
            got = b.reclock_offsets([p.lo for p in points], [p.offset for p in points]).tolist()
        want = [model_reclock(model, upper, p) for p in points]
        assert got == [UNBOUND if w is None else w for w in want]
    # the frontier of any of them, or a drawn one, element by element
    if model:
        f = model[data.draw(st.integers(0, len(model) - 1))][1]
        expect: list[IntoTime] = []
        for e in f:
            w = model_reclock(model, upper, e)
            expect += list(upper) if w is None else [IntoTime(w)]
        assert b.reclock_frontier(f) == Antichain(expect)


@settings(max_examples=150, deadline=None)
@given(chains(), st.lists(st.integers(0, 15), max_size=3), st.data())
def test_every_way_of_making_bindings_answers_as_the_model(
        chain: tuple[str, Model, Antichain[IntoTime]], cuts: list[int],
        data: st.DataObject) -> None:
    kind, model, upper = chain
    made = snapshots(kind, model, upper, cuts)
    for name, b in made.items():
        assert b == made["whole"], name
        check_answers(b, kind, model, upper, data)


@settings(max_examples=150, deadline=None)
@given(chains(), st.data())
def test_held_compacted_and_covering_answer_as_the_model(
        chain: tuple[str, Model, Antichain[IntoTime]], data: st.DataObject) -> None:
    kind, model, upper = chain
    if not model:
        return
    b = snapshots(kind, model, upper, [])[data.draw(st.sampled_from(["whole", "stored"]))]
    end = int(upper.elements[0]) if upper else model[-1][0] + 1
    u = data.draw(st.integers(model[0][0], end))
    # held from u: the latest binding before u and those after it
    before = [i for i, (t, _f) in enumerate(model) if t < u]
    held = b.held_from(u)
    sub = model[before[-1]:] if len(before) >= 2 else model
    check_answers(held, kind, sub, upper, data)
    if len(before) >= 2:
        assert int(held.since) == sub[0][0]
    for v in range(u, end + 1, max(1, (end - u) // 5)):
        if v <= end:
            assert held.source_upper_at(v) == b.source_upper_at(v)
    # compacted to a time: the binding in force moves there
    s = data.draw(st.integers(model[0][0], end - 1))
    comp = b.compacted(s)
    cm = [(t, f) for t, f in model if t > s]
    past = [(t, f) for t, f in model if t <= s]
    if past:
        cm = [(s, past[-1][1]), *cm]
    assert [(int(x.time), x.frontier) for x in comp.bindings] == cm
    assert int(comp.since) == s
    # covering: every position the job's lower contains stamps alike
    lower = model[data.draw(st.integers(0, len(model) - 1))][1]
    cut = b.covering(lower)
    assert cut.upper == b.upper and len(cut) <= len(b)
    assert [(int(x.time), x.frontier) for x in cut.bindings] == model[len(model) - len(cut):]
    remote = pickle.loads(pickle.dumps(cut))
    for probe in probes(kind, data):
        if kind != "counter" and probe.hi != probe.lo:
            continue
        if lower.less_equal_time(probe):
            assert remote.reclock(probe) == b.reclock(probe), probe


def test_a_day_of_one_partition_moving_is_held_by_what_moved() -> None:
    """86,400 bindings of 512 partitions, one partition moving per binding:
    held, compiled and pickled for a job in proportion to the changes."""
    parts, n = 512, 86_400
    offsets = np.zeros(parts, dtype=np.int64)
    b = Binding(IntoTime(0), kafka_frontier({}, partitions=parts))
    w = delta.Writer(None, 0)
    rows = [(0, w.text(b.frontier.encode()))]
    for i in range(1, n):
        p = i % parts
        offsets[p] += 1
        prev, new = [p, p, int(offsets[p]) - 1], [p, p, int(offsets[p])]
        rows.append((i * 1000, json.dumps({"-": [prev], "+": [new]})))
    times, log = delta.build("kafka", rows)
    big = Bindings.from_log("kafka", times, log, upper=n * 1000)
    c = big._compiled
    assert len(c.at) < n + 2 * parts  # the moves, not partitions x bindings
    job = pickle.dumps(big.covering(big.frontier_at(0)))  # type: ignore[arg-type]
    assert len(job) < 64 * n  # bytes: a few int64s per change
    assert big.last is not None and big.last.frontier == kafka_frontier(
        {p: int(o) for p, o in enumerate(offsets)}, partitions=parts)
    # partition 5 moved at bindings 5, 517, ...: offset 0 is stamped at 5
    assert big.reclock_offsets([5, 5], [0, 1]).tolist() == [5000, 517_000]
