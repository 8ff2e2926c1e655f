"""Capture/replay: the protocol's rules, and N writers replayed on M readers."""

from __future__ import annotations

import io
import random
from collections import Counter as Multiset
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reclock.core.frontier import Antichain
from reclock.core.time import IntoTime, Partitioned
from tests.capture import (
    Capture,
    Event,
    InvalidEventStream,
    Message,
    Progress,
    combine,
    interleave,
    read_events,
    replay,
    split,
    validate,
    write_events,
)

T0 = IntoTime(0)


def it(v: int) -> IntoTime:
    return IntoTime(v)


def test_valid_stream_and_final_frontier() -> None:
    events: list[Event] = [
        Message(it(0), ("a",)),
        Progress(((it(5), 1), (it(0), -1))),
        Message(it(7), ("b", "c")),
        Progress(((it(5), -1),)),
    ]
    state = validate(events, T0)
    assert state.capabilities.frontier() == Antichain.empty()
    assert state.collection == Multiset({("a", it(0)): 1, ("b", it(7)): 1, ("c", it(7)): 1})


@pytest.mark.parametrize(
    ("events", "index", "rule"),
    [
        # a message before the held capability
        ([Progress(((it(5), 1), (it(0), -1))), Message(it(3), ("x",))], 1, "message-in-advance"),
        # the last capability released before a message that needs it
        ([Progress(((it(0), -1),)), Message(it(0), ("x",))], 1, "message-in-advance"),
        # a capability minted behind the frontier
        ([Progress(((it(5), 1), (it(0), -1))), Progress(((it(2), 1),))], 1, "progress-in-advance"),
        # releasing what is not held
        ([Progress(((it(0), -1),)), Progress(((it(0), -1),))], 1, "release-held"),
        ([Message(it(1), ("ok",)), Progress(((it(4), -1),))], 1, "release-held"),
    ],
)
def test_broken_streams_name_event_and_rule(events: list[Event], index: int, rule: str) -> None:
    with pytest.raises(InvalidEventStream) as info:
        validate(events, T0)
    assert info.value.index == index
    assert info.value.rule == rule
    assert f"event #{index}" in str(info.value) and rule in str(info.value)


def test_moving_a_release_before_its_message_is_invalid() -> None:
    ok: list[Event] = [Message(it(2), ("x",)), Progress(((it(0), -1),))]
    validate(ok, T0)
    with pytest.raises(InvalidEventStream, match="message-in-advance"):
        validate([ok[1], ok[0]], T0)


def test_capture_partitioned_time() -> None:
    cap: Capture[Partitioned] = Capture(Partitioned.minimum())
    cap.send(Partitioned.point(0, 0), ["r0"])
    cap.downgrade(Antichain([Partitioned.point(0, 1), Partitioned.above(1)]))
    cap.send(Partitioned.point(3, 0), ["r1"])  # a new partition: still covered
    with pytest.raises(InvalidEventStream):
        cap.send(Partitioned.point(0, 0), ["late"])
    cap.close()
    state = validate(cap.events, Partitioned.minimum())
    assert state.capabilities.is_empty()
    assert sum(state.collection.values()) == 2


@st.composite
def writer_stream(draw: st.DrawFn, writer: int) -> tuple[list[Event], Multiset[Any], int | None]:
    """A writer's captured stream, its data, and its final frontier (None: closed)."""
    cap: Capture[IntoTime] = Capture(T0)
    data: Multiset[Any] = Multiset()
    frontier = 0
    for step in range(draw(st.integers(0, 12))):
        if draw(st.booleans()):
            t = frontier + draw(st.integers(0, 3))
            batch = [(writer, step, i) for i in range(draw(st.integers(1, 3)))]
            cap.send(it(t), batch)
            for r in batch:
                data[(r, it(t))] += 1
        else:
            frontier += draw(st.integers(1, 3))
            cap.downgrade(Antichain.from_elem(it(frontier)))
    if draw(st.booleans()):
        cap.close()
        return cap.events, data, None
    return cap.events, data, frontier


@given(data=st.data(), n=st.integers(0, 5), m=st.integers(1, 4), seed=st.integers(0, 2**32))
def test_n_writers_replay_on_m_readers(data: st.DataObject, n: int, m: int, seed: int) -> None:
    writers = [data.draw(writer_stream(w)) for w in range(n)]
    streams = [w[0] for w in writers]
    for s in streams:
        validate(s, T0)
    original: Multiset[Any] = Multiset()
    for _, d, _ in writers:
        original.update(d)
    fronts = [f for _, _, f in writers if f is not None]
    expected_frontier: Antichain[IntoTime] = Antichain(it(f) for f in fronts)

    readers = split(streams, m)
    states = [replay(assigned, T0, seed + i) for i, assigned in enumerate(readers)]
    merged = combine(states, T0)
    assert merged.collection == original
    assert merged.capabilities.frontier() == expected_frontier
    # also: any interleaving of all N streams on one reader
    one = validate(interleave(streams, T0, seed), T0)
    assert one.collection == original
    assert one.capabilities.frontier() == expected_frontier


@given(data=st.data(), seed=st.integers(0, 2**32))
def test_messages_earlier_progress_later_stays_valid(data: st.DataObject, seed: int) -> None:
    events, original, _ = data.draw(writer_stream(0))
    rng = random.Random(seed)
    evs = list(events)
    for _ in range(len(evs)):
        # swap adjacent (Progress, Message) into (Message, Progress)
        i = rng.randrange(max(1, len(evs) - 1))
        if i + 1 < len(evs) and isinstance(evs[i], Progress) and isinstance(evs[i + 1], Message):
            evs[i], evs[i + 1] = evs[i + 1], evs[i]
    state = validate(evs, T0)
    assert state.collection == original


def test_events_round_trip_through_files() -> None:
    cap: Capture[IntoTime] = Capture(T0)
    cap.send(it(1), [["a", 1], ["b", 2]])
    cap.downgrade(Antichain.from_elem(it(4)))
    cap.close()
    buf = io.StringIO()
    write_events(cap.events, buf)
    back = read_events("into", buf.getvalue().splitlines())
    assert validate(back, T0).collection == Multiset({(("a", 1), it(1)): 1, (("b", 2), it(1)): 1})
