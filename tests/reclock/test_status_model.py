"""The status model (reclock/runtime/status.py): a driver's document reads
back as it was written; a source's status from durable state agrees with
what the remap store and the sinks hold; a runner that has not opened is
completed from durable state, keeping what it shows. And the as-of that
``reclock read`` picks or refuses (reclock/runtime/reading.py)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

import reclock.cli as cli
import reclock.pipeline as pipeline
from reclock.config import load_config
from reclock.contracts.sink import SinkState
from reclock.core.errors import ReclockError
from reclock.core.frontier import Antichain
from reclock.core.time import IntoTime
from reclock.runtime.reading import choose_as_of
from reclock.runtime.status import (
    NOT_RUNNING,
    OutputStatus,
    PipelineStatus,
    RunNumbers,
    SourceStatus,
)
from tests.reclock.test_status_fast import PIPELINE


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pipeline of two generator sources, run for two seconds and stopped."""
    tmp = tmp_path_factory.mktemp("status-model")
    path = tmp / "p.yaml"
    path.write_text(PIPELINE.format(state=tmp / "state"))
    pipeline.run(load_config(path, env={}), use_spark=False, out=None, install_signals=False,
                 duration=2.0)
    return path


def test_a_drivers_document_reads_back_as_written(ran: Path) -> None:
    doc = json.loads((ran.parent / "state" / "status.json").read_text())
    assert doc["stopped"] and [s["source"] for s in doc["sources"]] == ["a", "b"]
    status = PipelineStatus.from_json(doc)
    assert status.to_json() == doc
    assert all(s.whole and s.run is not None and s.run.records for s in status.sources)


def test_the_durable_status_is_what_the_store_and_the_sinks_hold(ran: Path) -> None:
    cfg = load_config(ran, env={})
    doc = cli.collect_status(str(ran))
    assert not doc["driver_running"]
    pipe = pipeline.Pipeline(cfg)
    try:
        for entry, src in zip(doc["sources"], cfg.sources, strict=True):
            built = pipe.build_source(src)
            b = pipe.store.read(src.name)
            uppers = [o.sink.state().upper for o in built.outputs]
            assert entry["health"] == NOT_RUNNING and "live" not in entry
            assert entry["bindings"] == len(b) > 0
            assert entry["remap_upper"] == b.upper.as_option()
            assert entry["bound"] == b.last.frontier.encode()  # type: ignore[union-attr]
            assert [(o["name"], o["upper"]) for o in entry["outputs"]] == [
                (o.name, u) for o, u in zip(built.outputs, uppers, strict=True)]
            assert all(set(o) == {"name", "upper", "lag_ms", "health"}
                       for o in entry["outputs"])
            assert entry["resume_into"] == min(u for u in uppers if u is not None)
            assert entry["resume"] == b.source_upper_at(
                Antichain.from_elem(IntoTime(entry["resume_into"]))).encode()
            assert "records" not in entry  # a runner's numbers: none
    finally:
        pipe.close()


def test_a_runner_not_opened_is_completed_from_durable_state(ran: Path) -> None:
    cfg = load_config(ran, env={})
    pipe = pipeline.Pipeline(cfg)
    try:
        built = pipe.build_source(cfg.source("b"))
        states = [(o.name, o.sink.state()) for o in built.outputs]
        read: list[str] = []

        def state(i: int) -> SinkState:
            read.append(states[i][0])
            return states[i][1]

        orders = OutputStatus("orders", 7, 3, {"status": "running"}, True, 5, 0, None, None)
        live = SourceStatus("b", None, {"status": "starting"}, None, None, 0, None,
                            (orders,), RunNumbers(records=0))
        assert not live.whole
        b = pipe.store.read("b")
        st = SourceStatus.from_durable("b", built.source, lambda: b,
                                       [(n, partial(state, i)) for i, (n, _) in
                                        enumerate(states)], 10**13, live=live)
    finally:
        pipe.close()
    assert read == ["customers"]  # the output the runner shows is not read again
    assert st.whole and st.kind == built.source.kind
    assert st.health == {"status": "starting"} and st.run == live.run  # the runner's
    assert st.bindings == 0 and st.bound is None
    assert [o.name for o in st.outputs] == ["customers", "orders"]
    assert st.outputs[1] == orders
    assert st.outputs[0] == OutputStatus.from_sink("customers", states[0][1].upper, 10**13)
    assert st.resume_into == min(7, states[0][1].upper or 7)
    assert st.resume == b.source_upper_at(
        Antichain.from_elem(IntoTime(st.resume_into))).encode()
    view = st.view_json(live=live, history=[])
    assert view["live"] == live.to_json() and view["records"] == 0 and view["history"] == []


@pytest.mark.unit
def test_an_output_status_keeps_its_shape() -> None:
    out = OutputStatus("o", 0, None, {"status": "running"}, True, 1, 2, {"cast": 3}, None)
    assert list(out.to_json()) == ["name", "upper", "lag_ms", "rows", "errors", "health",
                                   "dropped_values", "snapshot"]
    assert OutputStatus.from_json(out.to_json()) == out
    assert OutputStatus.from_sink("o", 0, 100).to_json() == {
        "name": "o", "upper": 0, "lag_ms": None, "health": None}  # nothing committed
    assert OutputStatus.from_sink("o", 40, 100).lag_ms == 60
    assert OutputStatus.from_sink("o", None, 100).lag_ms is None  # closed


@pytest.mark.unit
def test_the_as_of_read_is_the_latest_complete_one_and_no_later() -> None:
    a, b = ("s.a", SinkState(upper=10)), ("s.b", SinkState(upper=25))
    assert choose_as_of([a, b], None) == 9
    assert choose_as_of([a, ("s.c", SinkState(upper=None))], None) == 9  # closed: complete
    assert choose_as_of([("s.c", SinkState(upper=None))], None) is None
    assert choose_as_of([a, ("s.d", SinkState(upper=0))], None) == -1  # nothing committed
    assert choose_as_of([a, b], 9) == 9
    with pytest.raises(ReclockError, match=r"output s\.a is durable only below 10; "
                                           r"as of 10 is not complete yet"):
        choose_as_of([b, a], 10)
    with pytest.raises(ReclockError, match=r"output s\.b .* as of 30"):
        choose_as_of([b, a], 30)
