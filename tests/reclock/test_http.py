"""The operator's HTTP endpoint: /metrics, /status.json, /history.json and the
status page (rendered by a headless Chromium), against a running pipeline."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from reclock.config import ConfigError, PipelineConfig, load_config, parse_config
from reclock.core.errors import DefiniteError
from reclock.metrics import families, frontier_position, frontier_value, make_registry, render
from reclock.pipeline import Runners, run
from reclock.statuspage import HISTORY_POINTS, History, StatusServer
from tests.running import running, wait_for

REPO = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    """Every sample of a Prometheus text exposition: (name, labels) -> value."""
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(ss: Samples, name: str, **labels: str) -> float | None:
    return ss.get((name, frozenset(labels.items())))


def get(url: str, timeout: float = 10) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def get_json(url: str) -> Any:
    code, ctype, body = get(url)
    assert code == 200 and ctype.startswith("application/json"), (code, ctype, body[:200])
    return json.loads(body)


def upper_metric(v: int | None) -> float:
    """A JSON upper (ms) as the metric shows it, in seconds: ``None`` (closed) is +Inf."""
    return math.inf if v is None else v / 1000


# ---------------------------------------------------------------------------
# the collector on fake status documents
# ---------------------------------------------------------------------------


def fake_doc() -> dict[str, Any]:
    health = {"status": "running", "error": None, "hint": None, "since_ms": 5, "definite": False}
    return {
        "pid": 1, "updated_ms": 1_700_000_010_000, "http": None,
        "sources": [
            {"source": "gen", "kind": "counter", "health": health,
             "probe": [1500], "bound": [1200], "remap_upper": 1_700_000_009_001,
             "bindings": 7, "read_from": [1000], "resume": [900], "records": 1000,
             "records_per_s": 250.5, "lag_records": 500, "job_seconds": 1.25,
             "outputs": [
                 {"name": "value", "upper": 1_700_000_008_000, "lag_ms": 2000, "rows": 990,
                  "errors": 10, "health": health},
                 {"name": "done", "upper": None, "lag_ms": None, "rows": 0, "errors": 0,
                  "health": {**health, "status": "finished"}},
             ]},
            {"source": "topic", "kind": "kafka",
             "health": {**health, "status": "stalled", "error": "TransientError: broker down",
                        "hint": "start the broker"},
             "probe": [[0, 0, 40], [1, 1, 12], [2, None, 0]],
             "bound": [[0, 0, 30], [1, 1, 12], [2, None, 0]],
             "remap_upper": None, "bindings": 2, "read_from": None, "resume": [],
             "records": 42, "records_per_s": 0.0, "lag_records": None, "job_seconds": 0.0,
             "outputs": [{"name": "value", "upper": 0, "lag_ms": None, "rows": 42, "errors": 0,
                          "health": health}]},
            {"source": "pg", "kind": "lsn", "health": health, "probe": ["1/10"], "bound": None,
             "remap_upper": 5, "bindings": 1, "read_from": None, "resume": None, "records": 0,
             "records_per_s": 0.0, "lag_records": None, "job_seconds": 0.0, "outputs": []},
        ],
        "dropped": ["old", "topic"],
    }


def test_per_partition_series_are_bounded_to_those_most_behind() -> None:
    """At 2,048 partitions a scrape holds the 32 partitions most behind and
    the sums, not 8,192 offset series."""
    from reclock.core.frontier import kafka_frontier
    from reclock.metrics import PARTITION_SERIES

    n = 2048
    resume = {p: 100 for p in range(n)}
    probe = {p: 100 + (p * 7919) % 1000 for p in range(n)}  # lags 0..999, scattered
    doc = fake_doc()
    topic = doc["sources"][1]
    topic.update(probe=kafka_frontier(probe, partitions=n).encode(),
                 bound=kafka_frontier(probe, partitions=n).encode(),
                 read_from=kafka_frontier(resume, partitions=n).encode(),
                 resume=kafka_frontier(resume, partitions=n).encode())
    ss = samples(render(make_registry(lambda: doc)).decode())
    shown = {dict(k[1])["partition"] for k in ss if k[0] == "reclock_source_partition_offset"
             and dict(k[1])["source"] == "topic"}
    most = sorted(range(n), key=lambda p: -(probe[p] - resume[p]))[:PARTITION_SERIES]
    assert shown == {str(p) for p in most}
    assert len(ss) < 400, len(ss)
    assert value(ss, "reclock_source_offsets", source="topic",
                 frontier="probe") == sum(probe.values())
    assert value(ss, "reclock_source_partitions", source="topic", frontier="probe") == n


def test_collector_renders_the_status_document() -> None:
    doc = fake_doc()
    text = render(make_registry(lambda: doc)).decode()
    ss = samples(text)
    v = lambda name, **kw: value(ss, name, **kw)  # noqa: E731
    # per source
    assert v("reclock_source_info", source="gen", kind="counter") == 1
    assert v("reclock_source_frontier", source="gen", frontier="probe") == 1500
    assert v("reclock_source_frontier", source="gen", frontier="bound") == 1200
    assert v("reclock_source_frontier", source="gen", frontier="read_from") == 1000
    assert v("reclock_source_frontier", source="gen", frontier="resume") == 900
    assert v("reclock_source_lag_records", source="gen") == 500
    assert v("reclock_source_records_total", source="gen") == 1000
    assert v("reclock_source_records_per_second", source="gen") is None  # rate() does that
    assert v("reclock_source_job_seconds_total", source="gen") == 1.25
    assert v("reclock_source_bindings", source="gen") == 7
    assert v("reclock_source_remap_upper_timestamp_seconds", source="gen") == 1_700_000_009.001
    # health: a labelled gauge, 1 for the current status only
    gen_health = {dict(k[1])["status"]: val for k, val in ss.items()
                  if k[0] == "reclock_source_health" and dict(k[1])["source"] == "gen"}
    assert gen_health["running"] == 1 and sum(gen_health.values()) == 1
    assert v("reclock_source_health", source="topic", status="stalled") == 1
    assert v("reclock_source_health", source="topic", status="running") == 0
    # dropped before the run: health only; dropped while running: its runner reports it once
    assert v("reclock_source_health", source="old", status="dropped") == 1
    assert v("reclock_source_health", source="topic", status="dropped") == 0
    # per output
    assert v("reclock_output_upper_timestamp_seconds", source="gen", output="value") == \
        1_700_000_008.0
    assert v("reclock_output_upper_timestamp_seconds", source="gen", output="done") == math.inf
    assert v("reclock_output_lag_seconds", source="gen", output="value") == 2.0
    # complete: no lag, no sample
    assert v("reclock_output_lag_seconds", source="gen", output="done") is None
    assert v("reclock_output_rows_total", source="gen", output="value") == 990
    assert v("reclock_output_errors_total", source="gen", output="value") == 10
    assert v("reclock_output_health", source="gen", output="done", status="finished") == 1
    assert v("reclock_output_health", source="gen", output="done", status="running") == 0
    # Kafka: per-partition offsets, no scalar frontier; an empty frontier has no partitions
    assert v("reclock_source_partition_offset", source="topic", frontier="probe",
             partition="0") == 40
    assert v("reclock_source_partition_offset", source="topic", frontier="bound",
             partition="0") == 30
    assert v("reclock_source_partition_offset", source="topic", frontier="bound",
             partition="1") == 12
    assert v("reclock_source_offsets", source="topic", frontier="bound") == 42
    assert v("reclock_source_partitions", source="topic", frontier="probe") == 2
    assert v("reclock_source_partitions", source="topic", frontier="resume") == 0
    assert v("reclock_source_frontier", source="topic", frontier="probe") is None
    assert v("reclock_source_remap_upper_timestamp_seconds", source="topic") == math.inf
    assert v("reclock_output_upper_timestamp_seconds", source="topic", output="value") == 0
    # LSN: the WAL position as a number
    assert v("reclock_source_frontier", source="pg", frontier="probe") == (1 << 32) + 0x10
    assert v("reclock_source_frontier", source="pg", frontier="bound") is None
    assert v("reclock_status_updated_timestamp_seconds") == 1_700_000_010.0
    # build and process metrics
    [(_, build)] = [(k, val) for k, val in ss.items() if k[0] == "reclock_build_info"]
    assert build == 1
    assert (v("process_resident_memory_bytes") or 0) > 10_000_000
    assert v("process_cpu_seconds_total") is not None
    # the documentation of every family is there
    assert "# HELP reclock_output_lag_seconds" in text
    assert "# TYPE reclock_output_rows_total counter" in text


def test_collector_reads_at_scrape_time_on_a_private_registry() -> None:
    doc_a, doc_b = fake_doc(), fake_doc()
    reg_a, reg_b = make_registry(lambda: doc_a), make_registry(lambda: doc_b)
    doc_b["sources"][0]["records"] = 5
    assert value(samples(render(reg_a).decode()), "reclock_source_records_total",
                 source="gen") == 1000
    assert value(samples(render(reg_b).decode()), "reclock_source_records_total",
                 source="gen") == 5
    doc_a["sources"][0]["records"] = 1234  # no cached gauges: the next scrape sees it
    assert value(samples(render(reg_a).decode()), "reclock_source_records_total",
                 source="gen") == 1234
    # nothing global: the default registry holds no reclock metrics
    from prometheus_client import REGISTRY, generate_latest

    assert b"reclock_" not in generate_latest(REGISTRY)
    # an empty document renders only the build and process samples, and is valid
    assert {k[0] for k in samples(render(make_registry(lambda: {"sources": []})).decode())
            if not k[0].startswith("process_")} == {"reclock_build_info"}
    assert [f.name for f in families({"sources": [], "dropped": ["x"]})
            if f.samples] == ["reclock_build_info", "reclock_source_health"]


def test_frontier_numbers() -> None:
    assert frontier_value("counter", [7]) == 7
    assert frontier_value("counter", []) == math.inf
    assert frontier_value("counter", None) is None
    assert frontier_value("lsn", ["0/FF"]) == 255
    assert frontier_value("kafka", [[0, None, 0]]) is None
    assert frontier_position("kafka", [[0, 0, 5], [1, 1, 7], [2, None, 0]]) == 12
    assert frontier_position("kafka", []) is None
    assert frontier_position("counter", []) is None


def test_history_is_bounded_and_incremental() -> None:
    h = History(maxlen=5)
    doc = fake_doc()
    for i in range(8):
        doc = {**doc, "updated_ms": 1000 + i * 1000}
        h.record(doc)
    h.record(doc)  # same instant again: not a new point
    snap = h.snapshot()
    gen = snap["sources"]["gen"]
    assert gen["kind"] == "counter"
    assert [p["t"] for p in gen["points"]] == [4000, 5000, 6000, 7000, 8000]
    p = gen["points"][-1]
    assert (p["probe"], p["bound"], p["read_from"], p["resume"]) == (1500, 1200, 1000, 900)
    assert p["sink_upper"] == 1_700_000_008_000  # the least finite output upper
    assert p["uppers"] == {"value": 1_700_000_008_000, "done": None}
    assert p["errors"] == {"value": 10, "done": 0} and p["records"] == 1000
    topic = snap["sources"]["topic"]["points"][-1]
    assert topic["bound"] == 42 and topic["resume"] is None and topic["resume_closed"]
    assert [p["t"] for p in h.snapshot(since=6000)["sources"]["gen"]["points"]] == [7000, 8000]
    assert len(h) == 5


def test_history_holds_its_hour_from_the_first_point() -> None:
    """A series is allocated whole when it starts: an hour of points later
    it holds the same buffer, so a long run's memory does not climb while
    the ring fills (bench/soak.py's hour)."""
    h = History()
    doc = fake_doc()
    h.record({**doc, "updated_ms": 1000})
    buffers = {name: s.data.buffer_info() for name, s in h._series.items()}
    for i in range(1, HISTORY_POINTS + 10):
        h.record({**doc, "updated_ms": 1000 + i * 1000})
    assert {name: s.data.buffer_info() for name, s in h._series.items()} == buffers
    assert len(h) == HISTORY_POINTS


def _model_point(doc: dict[str, Any], st: dict[str, Any]) -> dict[str, Any]:
    """What a point of ``st`` must say, built from the document directly."""
    kind = st["kind"]
    outs = st["outputs"]
    uppers = {o["name"]: o["upper"] for o in outs}
    point: dict[str, Any] = {"t": doc["updated_ms"]}
    for f in ("probe", "bound", "read_from", "resume"):
        point[f] = frontier_position(kind, st[f])
        if st[f] == []:
            point[f + "_closed"] = True
    finite = [u for u in uppers.values() if u is not None]
    point.update(remap_upper=st["remap_upper"], sink_upper=min(finite) if finite else None,
                 uppers=uppers, rows={o["name"]: o["rows"] for o in outs},
                 errors={o["name"]: o["errors"] for o in outs}, records=st["records"],
                 lag_records=st["lag_records"])
    return point


_maybe_int = st.none() | st.integers(0, 2**52)


@st.composite
def _docs(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A run's status documents: sources come and go, clocks may stand still."""
    names = draw(st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=4,
                          unique=True))
    outs = st.lists(st.sampled_from(["x", "y", "z"]), max_size=3, unique=True)
    outputs = {n: (draw(outs), draw(outs)) for n in names}  # the usual, and another
    docs, t = [], 1_700_000_000_000
    for _ in range(draw(st.integers(1, 40))):
        t += draw(st.sampled_from([0, 1, 1000, 1001]))
        present = draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
        frontier = st.none() | st.just([]) | st.lists(st.integers(0, 2**40), min_size=1,
                                                      max_size=1)
        sources = [{
            "source": n, "kind": "counter", "probe": draw(frontier), "bound": draw(frontier),
            "read_from": draw(frontier), "resume": draw(frontier),
            "remap_upper": draw(_maybe_int), "records": draw(_maybe_int),
            "lag_records": draw(_maybe_int),
            "outputs": [{"name": o, "upper": draw(_maybe_int), "rows": draw(_maybe_int),
                         "errors": draw(_maybe_int)}
                        for o in outputs[n][draw(st.sampled_from([0, 0, 0, 1]))]],
        } for n in present]
        docs.append({"updated_ms": t, "sources": sources})
    return docs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(docs=_docs(), maxlen=st.integers(1, 8), budget=st.integers(1, 12),
       least=st.integers(1, 3), since=st.none() | st.integers(0, 40))
def test_history_keeps_what_a_model_of_the_documents_says(
        docs: list[dict[str, Any]], maxlen: int, budget: int, least: int,
        since: int | None) -> None:
    """The stored rows give back, per source, the newest points a model
    built from the documents holds: as many as the budget allows the
    sources of the document that last named a source (at least ``least``),
    at most ``maxlen``, one per instant, each exactly as the document said;
    a source whose outputs changed starts afresh."""
    h = History(maxlen=maxlen, budget=budget, min_points=least)
    model: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        h.record(doc)
        cap = min(maxlen, max(least, budget // len(doc["sources"])))
        for s in doc["sources"]:
            pts = model.setdefault(s["source"], [])
            if pts and list(pts[-1]["uppers"]) != [o["name"] for o in s["outputs"]]:
                pts.clear()
            del pts[:-cap]
            if pts and pts[-1]["t"] >= doc["updated_ms"]:
                continue
            pts.append(_model_point(doc, s))
            del pts[:-cap]
    snap = h.snapshot()["sources"]
    assert set(snap) == set(model)
    for name, pts in model.items():
        assert snap[name]["kind"] == "counter"
        got = snap[name]["points"]
        assert got == pts
        cut = 1_700_000_000_000 + (since or 0) * 1000
        later = h.snapshot(since=cut)["sources"][name]["points"]
        assert later == [p for p in got if p["t"] > cut]


def test_history_of_many_sources_shares_one_budget() -> None:
    """A hundred sources keep ``budget / 100`` points each, two keep
    ``maxlen``; when sources are added the others give up their oldest."""
    h = History(maxlen=360, budget=3_600, min_points=10)
    doc = fake_doc()
    gen = doc["sources"][0]
    many = {**doc, "sources": [{**gen, "source": f"s{i}"} for i in range(100)]}
    for i in range(100):
        h.record({**many, "updated_ms": 1000 * (i + 1)})
    pts = h.snapshot()["sources"]["s7"]["points"]
    assert [p["t"] for p in pts] == [1000 * (i + 1) for i in range(64, 100)]
    two = {**doc, "sources": [{**gen, "source": "s7"}, {**gen, "source": "s8"}]}
    for i in range(100, 500):
        h.record({**two, "updated_ms": 1000 * (i + 1)})
    assert len(h.snapshot()["sources"]["s7"]["points"]) == 360
    assert len(h.snapshot()["sources"]["s9"]["points"]) == 36  # not recorded since
    h.record({**many, "updated_ms": 10_000_000})
    pts = h.snapshot()["sources"]["s7"]["points"]
    assert len(pts) == 36 and pts[-1]["t"] == 10_000_000 and pts[-2]["t"] == 500_000
    assert pts[-1] == {**pts[-2], "t": 10_000_000}


# ---------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------

MINIMAL = """
sources:
  - name: gen
    generator: {kind: counter}
    outputs: [{name: value, sink: console}]
"""


def test_http_config(tmp_path: Path) -> None:
    assert parse_config(MINIMAL, base_dir=tmp_path).http is None  # off by default
    cfg = parse_config("http: {port: 0}\n" + MINIMAL, base_dir=tmp_path)
    assert cfg.http is not None and (cfg.http.host, cfg.http.port) == ("127.0.0.1", 0)
    cfg = parse_config("http: {host: 0.0.0.0}\n" + MINIMAL, base_dir=tmp_path)
    assert cfg.http is not None and (cfg.http.host, cfg.http.port) == ("0.0.0.0", 9464)
    with pytest.raises(ConfigError) as e:
        parse_config("http: {port: 70000, prot: 1}\n" + MINIMAL, "p.yaml", base_dir=tmp_path)
    assert str(e.value).splitlines() == [
        "p.yaml:1:14: http.port: expected a number <= 65535",
        "p.yaml:1:21: http: unknown key 'prot' (expected one of: host, max_connections, port, "
        "ready_max_lag, request_timeout)",
    ]
    assert "http" in PipelineConfig.model_fields


# ---------------------------------------------------------------------------
# the server on a fake document
# ---------------------------------------------------------------------------


def test_server_routes_on_a_fake_document() -> None:
    doc = fake_doc()
    history = History()
    history.record(doc)
    server = StatusServer("127.0.0.1", 0, lambda: doc, history).start()
    try:
        base = server.url
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", base) and server.port > 0
        code, ctype, body = get(base + "/metrics")
        assert code == 200 and ctype.startswith("text/plain")
        assert value(samples(body.decode()), "reclock_source_records_total", source="gen") == 1000
        assert get_json(base + "/status.json") == json.loads(json.dumps(doc))
        h = get_json(base + "/history.json")
        assert [p["t"] for p in h["sources"]["gen"]["points"]] == [doc["updated_ms"]]
        assert get_json(base + f"/history.json?since={doc['updated_ms']}")["sources"]["gen"][
            "points"] == []
        assert get(base + "/history.json?since=soon")[0] == 400
        code, ctype, body = get(base + "/")
        assert code == 200 and ctype.startswith("text/html")
        page = body.decode()
        assert '<svg id="chart"' in page
        # self-contained: no external scripts, styles or fonts
        assert not re.search(r"<(script|link|img)[^>]+(src|href)=", page)
        assert "https://" not in page
        assert get(base + "/nope")[0] == 404
        # the port is taken: a definite error with a hint, not a traceback
        with pytest.raises(DefiniteError, match="cannot listen") as e:
            StatusServer("127.0.0.1", server.port, lambda: doc, history)
        assert e.value.hint and "http.port" in e.value.hint
    finally:
        server.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()


def test_bad_query_parameters_are_answered_400(caplog: pytest.LogCaptureFixture) -> None:
    doc = fake_doc()
    history = History()
    history.record(doc)
    server = StatusServer("127.0.0.1", 0, lambda: doc, history).start()
    try:
        for bad in ("1e400", "nan", "inf", "-1", "1.5", "99999999999999999999",
                    "9223372036854775808", "%E2%91%A0", "0x10"):
            code, _ctype, body = get(server.url + f"/history.json?since={bad}")
            assert (code, body[:6]) == (400, b"since:"), (bad, code, body)
        assert get(server.url + "/history.json?since=9223372036854775807")[0] == 200
        assert get(server.url + "/history.json?since=")[0] == 200
    finally:
        server.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_healthz_follows_the_loop_and_readyz_the_sources() -> None:
    doc = fake_doc()
    history = History()
    history.record(doc)
    server = StatusServer("127.0.0.1", 0, lambda: doc, history, ready_max_lag_ms=5000,
                          live_within_s=1.0).start()
    try:
        assert get(server.url + "/healthz")[:3:2] == (200, b"ok\n")
        code, ctype, body = get(server.url + "/readyz")
        assert (code, ctype) == (503, "application/json")
        assert json.loads(body) == {"ready": False, "problems": [
            "source topic is stalled: TransientError: broker down"]}
        doc["sources"] = doc["sources"][:1]  # without the stalled source: ready
        assert json.loads(get(server.url + "/readyz")[2]) == {"ready": True, "problems": []}
        doc["sources"][0]["outputs"][0]["lag_ms"] = 7500  # over the bound
        code, _ctype, body = get(server.url + "/readyz")
        assert code == 503 and json.loads(body)["problems"] == [
            "output gen.value lags 7.5 s (more than 5 s)"]
        doc["sources"][0]["outputs"][0].update(upper=0, lag_ms=900)  # never committed
        assert json.loads(get(server.url + "/readyz")[2])["problems"] == [
            "output gen.value has committed nothing yet"]
        time.sleep(1.2)  # the loop stops recording: no longer live
        code, _ctype, body = get(server.url + "/healthz")
        assert code == 503 and body.startswith(b"the driver loop has not ticked for 1 s")
        history.record(doc)
        assert get(server.url + "/healthz")[0] == 200
    finally:
        server.close()


def _slow_client(port: int) -> socket.socket:
    """A connection that sends half a request line and then nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"GET /metr")
    return sock


def test_slow_clients_neither_pile_up_nor_block_the_endpoint() -> None:
    """Slow clients are cut off after the request timeout; while they hold
    connections, others are still served up to the cap, and past the cap a
    client gets 503 at once instead of waiting behind them."""
    doc = fake_doc()
    history = History()
    # The slow clients must still be held when the 13th connection comes: a
    # timeout of 1.5 s passed before that on a loaded machine (10 renders of
    # /metrics took longer), and the slots were free again.
    server = StatusServer("127.0.0.1", 0, lambda: doc, history, max_connections=12,
                          timeout_s=10.0).start()

    def held_slots(n: int) -> None:
        """Wait until the server holds ``n`` connections (it takes them up in
        a thread of its own: on a loaded machine, later than a fixed pause)."""
        slots = server._httpd.slots
        deadline = time.monotonic() + 5
        while 12 - slots._value < n:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, f"{12 - slots._value} held, wanted {n}"  # type: ignore[attr-defined]
            time.sleep(0.01)

    held: list[socket.socket] = []
    try:
        held = [_slow_client(server.port) for _ in range(8)]
        held_slots(8)
        for _ in range(10):  # under the cap: served alongside the slow ones
            assert get(server.url + "/metrics", timeout=5)[0] == 200
        held += [_slow_client(server.port) for _ in range(4)]  # the cap is reached
        held_slots(12)
        started = time.monotonic()
        code, _ctype, body = get(server.url + "/metrics", timeout=5)
        assert (code, body) == (503, b"too many connections, retry\n")
        assert time.monotonic() - started < 3.0  # not behind the 10 s timeout
        # The server hangs up on every slow client once its timeout passes...
        for sock in held:
            sock.settimeout(15)
            assert sock.recv(100) == b""  # closed without an answer
        # ... which frees the slots.
        assert get(server.url + "/metrics", timeout=5)[0] == 200
        assert threading.active_count() < 40
    finally:
        for sock in held:
            sock.close()
        server.close()


# ---------------------------------------------------------------------------
# a running pipeline
# ---------------------------------------------------------------------------

PIPELINE = """
timestamp_interval: 200ms
http: {port: 0}
sources:
  - name: done
    generator: {kind: counter, rate: 400, max_records: 2000, bad_every: 100}  # ~5 s: charted
    outputs:
      - name: value
        format: {type: json, schema: {n: int64, payload: string, even: bool}}
        sink: file
  - name: live
    generator: {kind: counter, rate: 400}
    outputs:
      - name: value
        format: {type: json, schema: {n: int64, payload: string, even: bool}}
        sink: file
  - name: shop  # two outputs that share their upper: two distinguishable lines
    generator: {kind: orders, rate: 200}
    outputs:
      - {name: customers, sink: file}
      - {name: orders, sink: file}
  - name: stuck  # no broker there: stalled from the start, never binds anything
    kafka: {bootstrap_servers: "127.0.0.1:9", topic: nowhere, timeout: 1s}
    outputs:
      - {name: value, sink: file}
"""


class Live:
    def __init__(self, path: Path, url: str) -> None:
        self.path = path
        self.url = url


@pytest.fixture(scope="module")
def live(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """A pipeline running for the whole module: ``done`` finishes (its
    numbers are final), ``live`` keeps going."""
    d = tmp_path_factory.mktemp("http")
    path = d / "pipeline.yaml"
    path.write_text(PIPELINE)
    cfg = load_config(path)
    status = d / "state" / "status.json"

    def doc() -> dict[str, Any]:
        try:
            return dict(json.loads(status.read_text()))
        except (OSError, ValueError):
            return {}

    with running(cfg, spark):
        # the bound address is discoverable from status.json
        wait_for(lambda: bool(doc().get("http")), what="status.json with the http address")
        url = str(doc()["http"])
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url), url

        def ready() -> bool:
            st = {s["source"]: s for s in get_json(url + "/status.json")["sources"]}
            hist = get_json(url + "/history.json")["sources"]
            on_disk = {x["source"]: x for x in doc().get("sources", [])}
            return (st["done"]["health"]["status"] == "finished"
                    # `reclock status` reads the file, written once a second
                    and on_disk.get("done", {}).get("health", {}).get("status") == "finished"
                    and st["live"]["records"] > 0
                    and st["stuck"]["health"]["status"] == "stalled"
                    and all(len(hist.get(n, {}).get("points", [])) >= 3
                            for n in ("done", "live", "shop")))

        wait_for(ready, timeout=180, what="source done to finish and history to fill")
        yield Live(path, url)


def test_metrics_match_reclock_status_json(live: Live) -> None:
    code, ctype, body = get(live.url + "/metrics")
    assert code == 200 and ctype.startswith("text/plain")
    ss = samples(body.decode())
    proc = subprocess.run([sys.executable, "-m", "reclock", "status", str(live.path), "--json"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert proc.returncode == 1, proc.stderr  # `stuck` is stalled
    st = json.loads(proc.stdout)
    assert st["driver_running"] and st["http"] == live.url
    by = {s["source"]: s for s in st["sources"]}
    # `done` has finished: every number is final, so both views must agree exactly
    s = by["done"]
    v = lambda name, **kw: value(ss, name, source="done", **kw)  # noqa: E731
    assert s["health"]["status"] == "finished"
    assert v("reclock_source_health", status="finished") == 1
    assert v("reclock_source_info", kind=s["kind"]) == 1
    assert v("reclock_source_records_total") == s["records"] == 2000
    assert v("reclock_source_bindings") == s["bindings"] > 0
    assert v("reclock_source_remap_upper_timestamp_seconds") == upper_metric(s["remap_upper"])
    assert v("reclock_source_frontier", frontier="bound") == frontier_value(
        s["kind"], s["bound"]) == math.inf  # finished: the empty frontier
    assert v("reclock_source_frontier", frontier="probe") == frontier_value(s["kind"], s["probe"])
    assert v("reclock_source_frontier", frontier="read_from") == frontier_value(
        s["kind"], s["read_from"])
    assert v("reclock_source_frontier", frontier="resume") == frontier_value(
        s["kind"], s["resume"])
    assert v("reclock_source_lag_records") == s["lag_records"]  # None: no sample either
    assert v("reclock_source_job_seconds_total") == s["job_seconds"]
    [o] = s["outputs"]
    ov = lambda name, **kw: v(name, output=o["name"], **kw)  # noqa: E731
    assert ov("reclock_output_upper_timestamp_seconds") == upper_metric(o["upper"]) == \
        math.inf
    assert ov("reclock_output_lag_seconds") is None and o["lag_ms"] is None  # complete
    assert ov("reclock_output_rows_total") == o["rows"] == 1980
    assert ov("reclock_output_errors_total") == o["errors"] == 20
    assert ov("reclock_output_health", status=o["health"]["status"]) == 1
    # `reclock status --json` names every field as /status.json does
    served = {x["source"]: x for x in get_json(live.url + "/status.json")["sources"]}["done"]
    for key in ("health", "probe", "bound", "read_from", "resume", "remap_upper", "bindings",
                "records", "lag_records", "job_seconds", "tick_ms"):
        assert s[key] == served[key], key
    assert s["tick_ms"] is not None and s["tick_ms"] > 0
    assert value(ss, "reclock_source_tick_seconds", source="done") == s["tick_ms"] / 1000.0
    fields = ("name", "upper", "lag_ms", "rows", "errors", "health")
    assert [{k: x[k] for k in fields} for x in s["outputs"]] == \
        [{k: x[k] for k in fields} for x in served["outputs"]]
    # `live` keeps moving: the same series exist, counters only grow
    s = by["live"]
    lv = lambda name, **kw: value(ss, name, source="live", **kw)  # noqa: E731
    assert lv("reclock_source_health", status="running") == 1 == (
        s["health"]["status"] == "running")
    assert (lv("reclock_source_records_total") or 0) > 0 and s["records"] > 0
    for f in ("probe", "bound", "read_from", "resume"):
        assert lv("reclock_source_frontier", frontier=f) is not None
    assert lv("reclock_output_upper_timestamp_seconds", output="value") is not None
    assert lv("reclock_output_lag_seconds", output="value") is not None
    # the in-process status collector gives `reclock status` the same document
    from reclock.cli import collect_status

    again = {x["source"]: x for x in collect_status(str(live.path))["sources"]}
    assert again["done"] == by["done"] | {"records_per_s": again["done"]["records_per_s"],
                                          "live": again["done"]["live"]}


def test_status_json_route(live: Live) -> None:
    doc = get_json(live.url + "/status.json")
    on_disk = json.loads((live.path.parent / "state" / "status.json").read_text())
    assert set(doc) == set(on_disk) == {"pid", "updated_ms", "http", "config", "sources",
                                        "dropped"}
    assert doc["http"] == live.url and doc["pid"] == os.getpid()
    assert doc["config"] == on_disk["config"] == load_config(live.path).fingerprint
    assert [s["source"] for s in doc["sources"]] == ["done", "live", "shop", "stuck"]
    done = doc["sources"][0]
    assert done == next(s for s in on_disk["sources"] if s["source"] == "done") | {
        "records_per_s": done["records_per_s"]}  # final, except the decaying rate


def test_history_route(live: Live) -> None:
    h = get_json(live.url + "/history.json")["sources"]
    assert set(h) == {"done", "live", "shop", "stuck"}
    for name in ("done", "live"):
        series = h[name]
        pts = series["points"]
        assert series["kind"] == "counter"
        ts = [p["t"] for p in pts]
        assert ts == sorted(set(ts)) and len(ts) >= 3, name
        for key in ("t", "probe", "bound", "read_from", "resume", "remap_upper", "sink_upper",
                    "uppers", "rows", "errors", "records", "lag_records"):
            assert key in pts[-1], key
        assert set(pts[-1]["uppers"]) == {"value"}
        bounds = [p["bound"] for p in pts if p["bound"] is not None]
        assert bounds == sorted(bounds), name  # the bindings only move forward
        uppers = [p["uppers"]["value"] for p in pts if p["uppers"]["value"] is not None]
        assert uppers == sorted(uppers), name
    assert h["done"]["points"][-1]["bound_closed"] is True
    assert h["done"]["points"][-1]["uppers"] == {"value": None}  # finished: closed
    assert h["live"]["points"][-1]["bound"] > 0
    last = h["live"]["points"][-1]["t"]
    newer = get_json(live.url + f"/history.json?since={last}")["sources"]["live"]["points"]
    assert all(p["t"] > last for p in newer)


# ---------------------------------------------------------------------------
# the status page in a headless Chromium
# ---------------------------------------------------------------------------


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium is required for the status page test: "
                    "apt-get install -y chromium (.ci/run installs it)")
    return exe


def browse(url: str, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu",
           "--hide-scrollbars", f"--user-data-dir={tmp / 'profile'}",
           "--window-size=1200,900", "--virtual-time-budget=5000", *args, url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False,
                          env={**os.environ, "HOME": str(tmp)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def read_png(path: Path) -> np.ndarray:
    """A minimal PNG decoder (8-bit RGB/RGBA, not interlaced) -> HxWx3 uint8."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, hdr = 8, b"", None
    while pos < len(data):
        (n,), tag = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        chunk = data[pos + 8:pos + 8 + n]
        pos += 12 + n
        if tag == b"IHDR":
            hdr = struct.unpack(">IIBBBBB", chunk)
        elif tag == b"IDAT":
            idat += chunk
        elif tag == b"IEND":
            break
    assert hdr is not None
    width, height, depth, ctype, _, _, interlace = hdr
    assert depth == 8 and ctype in (2, 6) and interlace == 0, hdr
    bpp = 3 if ctype == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8)
    stride = width * bpp
    rows = raw.reshape(height, stride + 1)
    out = np.zeros((height, stride), dtype=np.int32)
    prev = np.zeros(stride, dtype=np.int32)
    for y in range(height):
        f, line = rows[y, 0], rows[y, 1:].astype(np.int32)
        if f == 0:
            cur = line
        elif f == 2:
            cur = (line + prev) & 0xFF
        else:  # sub, average, paeth depend on the pixel to the left: per byte
            cur = np.zeros(stride, dtype=np.int32)
            for i in range(stride):
                a = cur[i - bpp] if i >= bpp else 0
                b = prev[i]
                c = prev[i - bpp] if i >= bpp else 0
                if f == 1:
                    p = a
                elif f == 3:
                    p = (a + b) // 2
                else:
                    pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                    p = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                cur[i] = (line[i] + p) & 0xFF
        out[y] = cur
        prev = cur
    return out.reshape(height, width, bpp)[:, :, :3].astype(np.uint8)


def chart_dom(dom: str) -> str:
    m = re.search(r'<svg id="chart".*?</svg>', dom, re.S)
    assert m, dom[:2000]
    return m.group(0)


def test_status_page_in_chromium(live: Live, tmp_path: Path) -> None:
    url = live.url + "/"

    def drawn(dom: str) -> bool:
        chart = chart_dom(dom)
        for name in ("done", "live"):
            panel = re.search(rf'<g class="panel" data-source="{name}">(.*?)</g>', chart, re.S)
            assert panel, (name, chart[:2000])
            paths = re.findall(r"<path [^>]*>", panel.group(1))
            bound = [p for p in paths if 'class="bound"' in p]
            if not (bound and re.search(r' d="M[\d.]+ [\d.]+H', bound[0])):
                return False
        return True

    # The page fetches its data after loading: on a loaded machine the first
    # load may end before it arrived, so load it again (a user would wait).
    for _ in range(5):
        dom = browse(url, tmp_path, "--dump-dom").stdout
        if drawn(dom):
            break
    else:
        raise AssertionError(f"no bindings drawn in #chart: {chart_dom(dom)[:2000]}")
    chart = chart_dom(dom)
    assert int(re.search(r'data-points="(\d+)"', chart).group(1)) >= 6  # type: ignore[union-attr]
    # the sink uppers chart and the tables
    uppers = re.search(r'<svg id="uppers".*?</svg>', dom, re.S)
    assert uppers and 'data-output="live.value"' in uppers.group(0)
    # one source's two outputs share their upper, yet their lines differ
    lines = {o: re.search(rf'<path [^>]*d="([^"]*)"[^>]*data-output="shop.{o}"',
                          uppers.group(0)) for o in ("customers", "orders")}
    assert all(lines.values()), uppers.group(0)[:2000]
    assert lines["customers"].group(1) != lines["orders"].group(1)  # type: ignore[union-attr]
    assert "the outputs of one source are drawn 3 px apart" in uppers.group(0)
    # a source stalled from the start has no data yet: it is not "complete"
    stuck = re.search(r'<g class="panel" data-source="stuck">(.*?)</g>', chart, re.S)
    assert stuck and "no data yet" in stuck.group(1) and "complete" not in stuck.group(1)
    # every column explains itself
    heads = re.findall(r"<th[ >][^>]*>", dom)
    assert len(heads) == 25 and all("title=" in h for h in heads), heads
    assert "finished" in dom and "running" in dom
    assert re.search(r"<td[^>]*>done</td><td[^>]*>value</td>", dom)
    box = json.loads(re.search(r"data-box=\"([^\"]+)\"", chart).group(1)  # type: ignore[union-attr]
                     .replace("&quot;", '"'))
    assert box["width"] > 500 and box["height"] > 300, box

    shot = tmp_path / "page.png"
    browse(url, tmp_path, f"--screenshot={shot}")
    img = read_png(shot)
    assert img.shape[:2] == (900, 1200), img.shape
    area = img[box["y"]:box["y"] + box["height"], box["x"]:box["x"] + box["width"]].astype(int)
    assert area.shape[0] > 300 and area.shape[1] > 500, (box, area.shape)
    # the chart draws each source's step line in its palette colour
    for colour in ((0xE6, 0x19, 0x4B), (0x3C, 0xB4, 0x4B)):  # done, live
        near = (np.abs(area - np.array(colour)).max(axis=2) <= 12).sum()
        assert near >= 100, (colour, near)


# ---------------------------------------------------------------------------
# run() exposes the address and closes the server when it ends
# ---------------------------------------------------------------------------


def test_run_exposes_the_address_and_stops_serving(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_text("""
timestamp_interval: 100ms
http: {port: 0}
sources:
  - name: gen
    generator: {kind: counter, rate: 100000, max_records: 300}
    outputs: [{name: value, sink: console}]
""")
    cfg = load_config(path)
    seen: list[Runners] = []
    scraped: list[str] = []

    def on_ready(rs: list[Any]) -> None:
        assert isinstance(rs, Runners) and rs.http_url
        seen.append(rs)
        scraped.append(get(rs.http_url + "/metrics")[2].decode())

    stop = threading.Event()
    runners = run(cfg, use_spark=False, duration=30, stop=stop, out=None,
                  install_signals=False, on_ready=on_ready)
    assert runners is seen[0] and runners.http_url
    assert 'reclock_source_info{kind="counter",source="gen"} 1.0' in scraped[0]
    doc = json.loads((tmp_path / "state" / "status.json").read_text())
    assert doc["http"] == runners.http_url
    assert doc["sources"][0]["health"]["status"] == "finished"
    port = int(runners.http_url.rsplit(":", 1)[1])
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
