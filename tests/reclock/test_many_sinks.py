"""One output, many sinks (``sinks: [...]``): each sink commits on its own,
with its own upper, progress, ledger entry, key state and health; the source
resumes from the least of them; a failing sink stalls only itself and
catches up once it is back, a kill -9 in between included. Checked against
an independent model of the generator's records, not only ``verify``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

from reclock.cli import main
from reclock.config import load_config
from reclock.pipeline import Pipeline, run
from reclock.verify import verify_pipeline
from tests.running import (
    close_driver,
    config_errors,
    counter_source,
    kv_source,
    read_updates,
    request_resnapshot,
    start_driver,
    status_sources,
    stop_driver,
    wait_for,
    wait_running,
)
from tests.sources.cdc import execute
from tests.sources.test_generator_kv import generate, replay

# -- configuration: checked when the file loads, before anything starts ------------------------


def test_sink_and_sinks_names_and_targets_are_checked_at_load(tmp_path: Path) -> None:
    assert config_errors(tmp_path, """
        sources:
          - name: a
            generator: {kind: counter}
            outputs:
              - name: v
                sink: file
                sinks: [console]
          - name: b
            generator: {kind: counter}
            outputs:
              - {name: v, sinks: [delta, {type: delta, path: x}]}
          - name: c
            generator: {kind: counter}
            outputs:
              - {name: v, sinks: [{type: console, name: s}, {type: delta, name: s}]}
          - name: d
            generator: {kind: counter}
            outputs:
              - {name: v, sink: {type: console, name: s}}
          - name: e
            generator: {kind: counter}
            outputs:
              - {name: v}
          - name: f
            generator: {kind: counter}
            outputs:
              - name: v
                sinks: [{type: delta, name: one, path: lake/t}, {type: delta, name: two,
                                                                 path: ./lake/t/}]
        """) == [
        (7, "sources[0].outputs[0].sinks", "give either sink (the output's one sink) or "
                                           "sinks (a list of sinks), not both"),
        (11, "sources[1].outputs[0].sinks[1]",
         "two sinks named 'delta' (a sink is named by its type unless it says otherwise): "
         "give each a name (name: ...) (also at sources[1].outputs[0].sinks[0], line 11)"),
        (15, "sources[2].outputs[0].sinks[1]", "duplicate sink name 's' (also at "
                                               "sources[2].outputs[0].sinks[0], line 15)"),
        (19, "sources[3].outputs[0].sink", "a sink is named in a list of sinks only "
                                                "(sinks: [...]); the one sink of sink: is named "
                                                "by its output"),
        (23, "sources[4].outputs[0]", "missing required key 'sink' (or 'sinks': a list of "
                                      "sinks)"),
        (28, "sources[5].outputs[0].sinks[1]",
         "sink 'two' of output f.v writes the same path as sink 'one' of output f.v "
         "('lake/t'): their rows would mix; give each sink its own path (also at "
         "sources[5].outputs[0].sinks[0], line 28)"),
    ]
    # a sink of one output against a sink of another, and a state key per sink
    assert config_errors(tmp_path, """
        sources:
          - name: a
            generator: {kind: counter}
            outputs:
              - {name: v, sinks: [console, {type: delta, path: lake/t}]}
          - name: k
            kafka: {bootstrap_servers: "b:9092", topic: t}
            outputs:
              - name: v
                sinks:
                  - {type: delta, path: lake/t}
                  - {type: postgres, dsn: "postgresql://h/db", table: t, mode: state,
                     key: [id]}
        """) == [
        (11, "sources[1].outputs[0].sinks[0]",
         "sink 'delta' of output k.v writes the same path as sink 'delta' of output a.v "
         "('lake/t'): their rows would mix; give each sink its own path (also at "
         "sources[0].outputs[0].sinks[1], line 5)"),
        (13, "sources[1].outputs[0].sinks[1].key",
         "a state table keeps one row per key, and nothing keeps this output at one row per "
         "['id'] (envelope none: every record is an insertion, and none retracts an earlier "
         "one); read it with an envelope that has a key ({type: upsert, key: [...]} or "
         "{type: debezium, key: [...]}) and key the table by it, or keep the update log "
         "(mode: log)"),
    ]


def test_output_counts_a_source_cannot_feed_are_refused_before_spark_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A key-value generator and a Kafka source over one topic have one output;
    an orders generator has exactly its two; a Kafka source with an output per
    topic has those of its topics, a CDC source with listed tables those of
    its tables. Said by ``reclock check`` (and every
    command that loads the file), which starts nothing: these were reported
    only once ``run`` built the sources."""
    path = tmp_path / "pipeline.yaml"
    path.write_text(textwrap.dedent("""
        sources:
          - name: kv
            generator: {kind: key-value}
            outputs: [{name: a, sink: console}, {name: b, sink: console}]
          - name: k
            kafka: {bootstrap_servers: "b:9092", topic: t}
            outputs: [{name: a, sink: console}, {name: b, sink: console}]
          - name: o
            generator: {kind: orders}
            outputs: [{name: orders, sink: console}]
          - name: p
            kafka: {bootstrap_servers: "b:9092", topics: [x, y.z], output_per_topic: true}
            outputs: [{name: x, sink: console}, {name: z, sink: console}]
          - name: pg
            postgres: {dsn: "postgresql://h/db", tables: [public.a, {table: "b c", output: bc}]}
            outputs: [{name: a, sink: console}, {name: x, sink: console}]
        """).lstrip("\n"))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"reclock: {path}:4:14: sources[0].outputs: source 'kv': a key-value generator has "
        "exactly one output, got ['a', 'b']; keep one output; to land it in several places, "
        "give that output a list of sinks (sinks: [...]), or add a second source",
        f"{path}:7:14: sources[1].outputs: source 'k': a Kafka source has one output, got "
        "['a', 'b']; keep one output, and give it a list of sinks (sinks: [...]) to land it "
        "in several places; to split several topics into an output each, list them under "
        "topics with output_per_topic: true",
        f"{path}:10:14: sources[2].outputs: source 'o': an orders generator has the outputs "
        "'customers', 'orders', got ['orders']; give the source exactly the outputs "
        "customers, orders",
        f"{path}:13:14: sources[3].outputs: source 'p': with output_per_topic its topics have "
        "the outputs ['x', 'y_z']: no entry under outputs for ['y_z']; no topic feeds ['z']; "
        "give each topic's output an entry under outputs (its name: the topic's, or "
        "topic_outputs), and no other",
        f"{path}:16:14: sources[4].outputs: source 'pg': its tables feed the outputs ['a', "
        "'bc']: no entry under outputs for ['bc']; none of them feeds ['x']; give each of its "
        "tables an entry under outputs (named after it, or as its output: says), and no other",
    ]
    path.write_text(textwrap.dedent("""
        sources:
          - name: kv
            generator: {kind: key-value}
            outputs: [{name: a, sinks: [console, {type: delta, name: lake}]}]
          - name: p
            kafka: {bootstrap_servers: "b:9092", topics: [x, y.z], output_per_topic: true}
            outputs: [{name: x, sink: console}, {name: y_z, sink: console}]
        """).lstrip("\n"))
    assert main(["check", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "source kv [generator]: a -> console, lake", "source p [kafka]: x, y_z",
        f"{path}: ok"]


# -- a keyed output into Delta and PostgreSQL ----------------------------------------------------

TOTAL, KEYS, EVERY, SIZE, SEED = 3_000, 200, 7, 12, 5


def _kv(tmp_path: Path, pg_url: str) -> Path:
    sinks = (f'sinks: [delta, {{type: postgres, dsn: "{pg_url}", table: kv_state, '
             "mode: state, key: [key]}]")
    path = tmp_path / "pipeline.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
sources:
{kv_source(KEYS, SEED, 2000, TOTAL, EVERY, SIZE, sinks)}""")
    return path


def _read(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[int, tuple[int, str]]:
    assert main(["read", *argv, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return {r["key"]: (r["n"], r["payload"]) for r in rows}


def test_a_keyed_output_lands_in_delta_and_postgres_each_key_once(
        tmp_path: Path, spark: Any, pg_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """An upsert output into a Delta log and a PostgreSQL state table: each
    ends equal to the replayed records (a plain dict of the generator's
    records), each with its own ledger entry, key state and status line."""
    path = _kv(tmp_path, pg_url)
    cfg = load_config(path)
    runners = run(cfg, spark=spark, duration=120, out=None, install_signals=False)
    assert [r.health.status for r in runners] == ["finished"]
    want, _ = replay(generate(0, TOTAL, seed=SEED, keys=KEYS, delete_every=EVERY,
                              value_size=SIZE)[0])
    assert [(o.key, o.sink_name, o.state.upper) for o in runners[0].outputs] == [
        ("state.delta", "delta", None), ("state.postgres", "postgres", None)]
    with psycopg.connect(pg_url) as c:
        held = {k: (n, p) for k, n, p in c.execute("select key, n, payload from kv_state")}
        uppers = dict(c.execute("select output, upper from reclock_uppers").fetchall())
    assert held == want
    assert uppers == {"kv.state.postgres": None}
    assert _read(capsys, str(path), "kv.state", "--sink", "delta") == want
    assert _read(capsys, str(path), "kv.state", "--sink", "postgres") == want
    assert main(["read", str(path), "kv.state"]) == 2
    assert "has several sinks (delta, postgres): say which one to read with --sink NAME" in (
        capsys.readouterr().err)
    assert main(["read", str(path), "kv.state", "--sink", "lake"]) == 2
    assert "has no sink 'lake'; its sinks: delta, postgres" in capsys.readouterr().err
    # each sink's own state: default Delta path, ledger entry, key state file
    state = tmp_path / "state"
    assert (state / "outputs" / "kv" / "state.delta" / "_delta_log").is_dir()
    assert sorted(p.name for p in (state / "keys" / "kv").glob("*.sqlite")) == [
        "state.delta.sqlite", "state.postgres.sqlite"]
    pipe = Pipeline(cfg)
    try:
        ledger = {k: json.loads(v) for k, v in pipe.store.facts("kv").items()
                  if k.startswith("sink:")}
    finally:
        pipe.close()
    assert ledger == {"sink:state.delta": {"upper": None}, "sink:state.postgres": {"upper": None}}
    # verify: every sink by its own upper, one entry each; --sink picks one
    reports = verify_pipeline(cfg)
    assert reports[0].ok
    assert [(o.output, o.breaches) for o in reports[0].outputs] == [
        ("state.delta", {}), ("state.postgres", {})]
    assert reports[0].outputs[0].checks.get("history")  # (the Delta log's)
    assert [o.output for o in verify_pipeline(cfg, sink="postgres")[0].outputs] == [
        "state.postgres"]
    doc = json.loads((state / "status.json").read_text())
    assert [(o["name"], o["sink"], o["upper"]) for o in doc["sources"][0]["outputs"]] == [
        ("state.delta", "delta", None), ("state.postgres", "postgres", None)]
    assert main(["status", str(path)]) == 3  # (the driver is gone: read from the sinks)
    lines = capsys.readouterr().out.splitlines()
    assert "  output state sink delta: sink upper closed, lag - ms" in lines, lines
    assert "  output state sink postgres: sink upper closed, lag - ms" in lines, lines


# -- one sink failing while the other goes on, a kill -9 in between ----------------------------

N = 8_000


def _counter(tmp_path: Path, pg_url: str) -> Path:
    sinks = f'[delta, {{type: postgres, dsn: "{pg_url}", table: log}}]'
    path = tmp_path / "pipeline.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
max_retry_backoff: 1s
spark: {{master: "local[2]"}}
sources:
{counter_source(400, N, None, sinks=sinks)}
""")
    return path


def _allow(admin: str, db: str, allowed: bool) -> None:
    """Let connections to ``db`` in, or refuse them and end those it has:
    the PostgreSQL sink's target unreachable."""
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS {str(allowed).lower()}')
        if not allowed:
            c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                      "WHERE datname = %s", (db,))


def _outputs(state: Path) -> dict[str, dict[str, Any]]:
    src = status_sources(state).get("counter") or {}
    return {o["name"]: o for o in src.get("outputs", [])}


def _events(state: Path, kind: str) -> list[dict[str, Any]]:
    return [e for line in (state / "progress.jsonl").read_text().splitlines()
            if (e := json.loads(line))["kind"] == kind]


def _frontier(value: Any) -> Any:
    from reclock.core.frontier import Antichain

    return Antichain.decode("counter", value)


def _stalled_behind(state: Path, margin: int) -> bool:
    """The PostgreSQL sink stalled and the Delta sink at least ``margin`` ms
    past it (or complete), the source itself running."""
    outs = _outputs(state)
    pg, delta = outs.get("value.postgres"), outs.get("value.delta")
    if pg is None or delta is None or (pg.get("health") or {}).get("status") != "stalled":
        return False
    src = status_sources(state)["counter"]
    return src["health"]["status"] == "running" and (
        delta["upper"] is None or delta["upper"] >= (pg["upper"] or 0) + margin)


def test_a_failing_sink_stalls_only_itself_and_catches_up_after_a_kill(
        tmp_path: Path, pg_url: str, pg_admin_url: str) -> None:
    """The PostgreSQL sink's database refuses connections while the driver
    runs: the Delta sink keeps committing, the PostgreSQL one stalls with
    an error naming output and sink, and the resumption frontier stays at
    its progress. A kill -9, a restart with the database still away (the
    Delta sink goes on from where it was), then the database back: the
    PostgreSQL sink catches up. Each holds every record once (the model:
    the counter's positions 0..N-1)."""
    path = _counter(tmp_path, pg_url)
    state = tmp_path / "state"
    db = pg_url.rsplit("/", 1)[1]
    proc = start_driver(path)
    try:
        assert wait_running(state, proc)
        wait_for(lambda: all((o.get("upper") or 0) > 0 for o in _outputs(state).values())
                 and len(_outputs(state)) == 2, 120, "both sinks to commit")
        _allow(pg_admin_url, db, False)
        wait_for(lambda: _stalled_behind(state, 1_000), 120,
                 lambda: f"the Delta sink to go on alone: {_outputs(state)}")
        error = _outputs(state)["value.postgres"]["health"]["error"]
        assert error.startswith("source 'counter' output 'value' sink 'postgres': "), error
        # what the source resumes from (and acknowledges) is the stalled sink's progress
        ups = _events(state, "sink_upper")
        pg_at = [e for e in ups if e.get("sink") == "postgres"][-1]["progress"]
        delta_at = [e for e in ups if e.get("sink") == "delta"][-1]["progress"]
        assert _events(state, "resume")[-1]["frontier"] == pg_at
        assert not _frontier(delta_at).less_equal(_frontier(pg_at))  # (Delta is further)
        delta_upper = _outputs(state)["value.delta"]["upper"]
        proc.kill()
        proc.wait()
    finally:
        close_driver(proc)
    # started again, the database still away: the Delta sink goes on, and
    # nothing is acknowledged past the PostgreSQL sink's progress
    proc = start_driver(path)
    try:
        assert wait_running(state, proc)
        wait_for(lambda: _stalled_behind(state, 0) and (
            (up := _outputs(state)["value.delta"]["upper"]) is None or up > delta_upper),
            120, lambda: f"the Delta sink to go on after the restart: {_outputs(state)}")
        assert all(_frontier(e["frontier"]).less_equal(_frontier(pg_at))
                   for e in _events(state, "resume")[-3:])
        _allow(pg_admin_url, db, True)
        wait_for(lambda: status_sources(state)["counter"]["health"]["status"] == "finished",
                 180, lambda: f"the end: {status_sources(state).get('counter')}")
    finally:
        _allow(pg_admin_url, db, True)
        rc, err = stop_driver(proc)
    assert rc == 0, err
    cfg = load_config(path)
    with psycopg.connect(pg_url) as c:
        pg = Counter(n for (n,) in c.execute("select n from log where _diff = 1"))
        assert c.execute("select count(*) from log where _diff <> 1 or _error is not null"
                         ).fetchone() == (0,)
    lake = read_updates(cfg, "counter", "value", "delta")
    assert set(lake.column("_diff").to_pylist()) == {1}
    model = Counter(range(N))
    assert pg == model, (len(pg), sorted((pg - model).items())[:5], sorted(model - pg)[:5])
    assert Counter(lake.column("n").to_pylist()) == model
    reports = verify_pipeline(cfg)
    assert reports[0].ok, [(o.output, o.breaches) for o in reports[0].outputs]


def _slot_flush(url: str) -> int:
    """The CDC slot's ``confirmed_flush_lsn``: what was acknowledged upstream."""
    from reclock.core.time import Lsn

    with psycopg.connect(url) as c:
        [(flush,)] = c.execute("select confirmed_flush_lsn::text from pg_replication_slots "
                               "where database = current_database() and not temporary"
                               ).fetchall()
    return int(Lsn.parse(flush))


def test_a_cdc_sink_unreachable_when_the_driver_starts_stalls_only_itself(
        tmp_path: Path, cdc_url: str, pg_url: str, pg_admin_url: str) -> None:
    """A CDC source is killed, and started again while its PostgreSQL sinks'
    database refuses connections: the table whose other sink (Delta) can be
    read goes on landing changes there, and the output whose only sink is
    away waits, both parked at the upper the driver's ledger recorded;
    upstream, the slot is not advanced past what the parked sinks hold. Once
    the database is back they catch up. Each sink ends equal to the upstream
    tables (read there: the model), every row once."""
    from tests.sources.cdc import flushed_lsn, output_rows, source_rows

    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table acct (id int primary key, owner text, bal int)")
        c.execute("create table memo (id int primary key, body text)")
        c.execute("insert into acct select i, 'o' || i, i * 10 from generate_series(1, 200) i")
        c.execute("insert into memo select i, 'm' || i from generate_series(1, 50) i")
    path = tmp_path / "pipeline.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
max_retry_backoff: 1s
spark: {{master: "local[2]"}}
sources:
  - name: bank
    postgres: {{dsn: "{cdc_url}", tables: [acct, memo]}}
    outputs:
      - name: acct
        sinks:
          - delta
          - {{type: postgres, dsn: "{pg_url}", table: acct_copy, mode: state, key: [id]}}
      - name: memo
        sink: {{type: postgres, dsn: "{pg_url}", table: memo_copy, mode: state, key: [id]}}
""")
    state = tmp_path / "state"
    db = pg_url.rsplit("/", 1)[1]
    cfg = load_config(path)

    def lake() -> list[tuple[Any, ...]]:
        pipe = Pipeline(cfg)
        try:
            src = cfg.sources[0]
            return output_rows(pipe.sink(src, src.outputs[0], "delta").read_updates(),
                               ["id", "owner", "bal"])
        finally:
            pipe.close()

    def outs() -> dict[str, dict[str, Any]]:
        src = status_sources(state).get("bank") or {}
        return {o["name"]: o for o in src.get("outputs", [])}

    acct, memo = "select id, owner, bal from acct", "select id, body from memo"
    proc = start_driver(path)
    try:
        assert wait_running(state, proc)
        wait_for(lambda: source_rows(pg_url, acct.replace("acct", "acct_copy"))
                 == source_rows(cdc_url, acct)
                 and source_rows(pg_url, memo.replace("memo", "memo_copy"))
                 == source_rows(cdc_url, memo) if _has_tables(pg_url) else False,
                 120, "the snapshot in every sink")
        proc.kill()
        proc.wait()
    finally:
        close_driver(proc)
    _allow(pg_admin_url, db, False)
    proc = start_driver(path)
    try:
        assert wait_running(state, proc)
        before = flushed_lsn(cdc_url)
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("update acct set bal = bal + 1, owner = owner || 'x' where id % 3 = 0")
            c.execute("delete from acct where id % 7 = 0")
            c.execute("insert into acct select i, 'n' || i, i from generate_series(201, 260) i")
            c.execute("update acct set id = id + 1000 where id between 10 and 20")
            c.execute("update memo set body = body || 'y' where id < 10")
        want = source_rows(cdc_url, acct)
        wait_for(lambda: lake() == want, 120,
                 lambda: f"the Delta sink to land the changes alone: {outs()}")
        wait_for(lambda: {n: (o.get("health") or {}).get("status") for n, o in outs().items()}
                 == {"acct.delta": "running", "acct.postgres": "stalled", "memo": "stalled"},
                 60, lambda: f"the PostgreSQL sinks parked, the Delta one running: {outs()}")
        error = outs()["memo"]["health"]["error"]
        assert error.startswith("source 'bank' output 'memo'"), error
        assert _slot_flush(cdc_url) <= before  # nothing acknowledged past the parked sinks
        _allow(pg_admin_url, db, True)
        wait_for(lambda: source_rows(pg_url, acct.replace("acct", "acct_copy")) == want
                 and source_rows(pg_url, memo.replace("memo", "memo_copy"))
                 == source_rows(cdc_url, memo), 120,
                 lambda: f"the PostgreSQL sinks to catch up: {outs()}")
        wait_for(lambda: {(o.get("health") or {}).get("status") for o in outs().values()}
                 == {"running"}, 60, lambda: f"every sink running: {outs()}")
    finally:
        _allow(pg_admin_url, db, True)
        rc, err = stop_driver(proc)
    assert rc == 0, err
    assert lake() == want
    assert _slot_flush(cdc_url) > before  # acknowledged once every sink holds the changes
    [report] = verify_pipeline(cfg)
    assert report.ok, [(o.output, o.breaches, o.samples) for o in report.outputs]


def _has_tables(url: str) -> bool:
    with psycopg.connect(url) as c:
        return c.execute("select count(*) from information_schema.tables "
                         "where table_name in ('acct_copy', 'memo_copy')").fetchone() == (2,)


# -- a single-sink pipeline written before sinks: existed resumes unchanged --------------------

#: the last commit before ``sinks:``: a state directory its driver wrote must
#: resume under today's code with nothing read again and the same names
BEFORE = "49590b6e776af177947f35632afc3773561f0c9f"
ROOT = Path(__file__).resolve().parents[2]
OLD_TOTAL = 6_000


def _old_tree(dest: Path) -> Path | None:
    """The code of :data:`BEFORE` (its packages, with this tree's built
    extensions), or None when this checkout does not hold that commit."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", BEFORE, "reclock", "sources",
                              "sinks", "remap_store"], capture_output=True)
    if archive.returncode != 0:
        return None
    dest.mkdir()
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    for built in [*ROOT.glob("reclock/_json_native*.so"), *ROOT.glob("sources/_kafka_native*.so")]:
        (dest / built.relative_to(ROOT)).write_bytes(built.read_bytes())
    return dest


def test_a_single_sink_pipeline_written_before_sinks_existed_resumes_unchanged(
        tmp_path: Path, spark: Any) -> None:
    """A keyed ``sink:`` output run by the code before ``sinks:`` and stopped
    part way; today's code resumes it from its durable progress (nothing read
    again), reuses its key state, keeps its ledger entry's name, and ends
    with the output equal to the replayed records."""
    old = _old_tree(tmp_path / "old")
    if old is None:
        pytest.skip(f"this checkout does not hold commit {BEFORE} (a shallow clone)")
    path = tmp_path / "pipeline.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
spark: {{master: "local[2]"}}
sources:
{kv_source(KEYS, SEED, 300, OLD_TOTAL, EVERY, SIZE)}""")
    state = tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-m", "reclock.cli", "run", str(path)],
                            env={**os.environ, "PYTHONPATH": str(old),
                                 "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert wait_running(state, proc)
        wait_for(lambda: (status_sources(state)["kv"]["outputs"][0]["upper"] or 0) > 0
                 and status_sources(state)["kv"]["records"] >= 500, 120,
                 "the old driver to commit")
    finally:
        rc, err = stop_driver(proc)
    assert rc == 0, err
    cfg = load_config(path)
    pipe = Pipeline(cfg)
    try:
        ledger_before = {k for k in pipe.store.facts("kv") if k.startswith("sink:")}
        src = cfg.sources[0]
        held = pipe.sink(src, src.outputs[0]).state().held("counter")
    finally:
        pipe.close()
    assert ledger_before == {"sink:state"}
    assert held is not None and 0 < held.encode()[0] < OLD_TOTAL
    assert (state / "keys" / "kv" / "state.sqlite").exists()
    runners = run(cfg, spark=spark, duration=120, out=None, install_signals=False)
    r = runners[0]
    assert r.health.status == "finished"
    opened = [e for e in r.events.recent if e["kind"] == "open"]
    assert opened[0]["read_from"] == held.encode()  # from what the output holds
    assert opened[0].get("keys") == {"state": "reused"}  # its key state, as it was
    assert r.records == OLD_TOTAL - held.encode()[0]  # nothing read again
    assert [(o.key, o.sink_name) for o in r.outputs] == [("state", "file")]
    pipe = Pipeline(cfg)
    try:
        assert {k for k in pipe.store.facts("kv") if k.startswith("sink:")} == ledger_before
    finally:
        pipe.close()
    assert sorted(p.name for p in (state / "outputs" / "kv").iterdir()) == ["state"]
    want, _ = replay(generate(0, OLD_TOTAL, seed=SEED, keys=KEYS, delete_every=EVERY,
                              value_size=SIZE)[0])
    from reclock.runtime.reading import read_output

    pipe = Pipeline(cfg)
    try:
        table = read_output(pipe.build_source(src).outputs[0], None, "collection")
    finally:
        pipe.close()
    got = {k: (n, p) for k, n, p in zip(table.column("key").to_pylist(),
                                        table.column("n").to_pylist(),
                                        table.column("payload").to_pylist(), strict=True)}
    assert got == want
    assert verify_pipeline(cfg)[0].ok


# -- a PostgreSQL CDC table into Delta, and PostgreSQL and Iceberg state tables --------------


#: the CDC tests' upstream table: 300 accounts
ACCT = ("create table acct (id int primary key, owner text, bal int)",
        "insert into acct select i, 'o' || i, i * 10 from generate_series(1, 300) i")


def _bank(tmp_path: Path, cdc_url: str, sinks: str, create: bool = True) -> Any:
    """The loaded config of source ``bank`` reading table ``acct`` (made
    first, unless ``create`` is false) into output ``acct`` with ``sinks``
    (the YAML after ``sinks:``)."""
    if create:
        execute(cdc_url, *ACCT)
    path = tmp_path / "pipeline.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
sources:
  - name: bank
    postgres: {{dsn: "{cdc_url}", tables: [acct]}}
    outputs:
      - name: acct
        sinks: {sinks}
""")
    return load_config(path)


def test_a_cdc_table_lands_in_delta_and_postgres_and_iceberg_state_tables_equal_to_upstream(
        tmp_path: Path, spark: Any, cdc_url: str) -> None:
    """One CDC output, three sinks: its snapshot and then inserts, updates,
    deletes and a primary-key change each land once in each; each ends equal
    to the upstream table (read there, not from reclock): the Delta log
    consolidated, the PostgreSQL state table, and the Iceberg state table as
    a plain pyiceberg reader sees it."""
    from tests.running import running
    from tests.sources.cdc import flushed_lsn, output_rows, resumed_past, source_rows

    cfg = _bank(tmp_path, cdc_url, f"""
          - delta
          - {{type: postgres, dsn: "{cdc_url}", table: acct_copy, mode: state, key: [id]}}
          - {{type: iceberg, catalog: {{type: sql, uri: "sqlite:///{tmp_path}/iceberg.db",
             warehouse: "{tmp_path}/warehouse"}}, table: bank.acct, mode: state, key: [id]}}""")
    with running(cfg, spark) as runners:
        wait_for(lambda: all((o.state.upper or 0) > 0 for o in runners[0].outputs), 90,
                 "the snapshot in both sinks")
        with psycopg.connect(cdc_url, autocommit=True) as c:
            for i in range(1, 301, 3):
                c.execute("update acct set bal = bal + 1, owner = owner || 'x' where id = %s",
                          (i,))
            c.execute("delete from acct where id % 7 = 0")
            c.execute("insert into acct select i, 'n' || i, i from generate_series(301, 400) i")
            c.execute("update acct set id = id + 1000 where id between 10 and 20")
        wait_for(resumed_past(runners, flushed_lsn(cdc_url)), 90, "both sinks to catch up")
        assert [o.health.status for o in runners[0].outputs] == ["running"] * 3
    want = source_rows(cdc_url, "select id, owner, bal from acct")
    assert len(want) == 300 - 42 + 100
    lake = read_updates(cfg, "bank", "acct", "delta")
    assert output_rows(lake, ["id", "owner", "bal"]) == want
    assert source_rows(cdc_url, "select id, owner, bal from acct_copy") == want
    from pyiceberg.catalog import load_catalog

    ice = load_catalog("reclock", type="sql", uri=f"sqlite:///{tmp_path}/iceberg.db"
                       ).load_table("bank.acct").scan().to_arrow()
    assert ice.column_names == ["id", "owner", "bal", "_into_time"]
    assert sorted(zip(*(ice.column(c).to_pylist() for c in ("id", "owner", "bal")),
                      strict=True)) == sorted(want)
    [report] = verify_pipeline(cfg)
    assert report.ok, [(o.output, o.breaches, o.samples) for o in report.outputs]
    assert [o.output for o in report.outputs] == ["acct.delta", "acct.postgres", "acct.iceberg"]


# -- a re-snapshot of an output with several sinks ---------------------------------------------


def test_a_resnapshot_heals_every_sink_of_the_output(tmp_path: Path, spark: Any) -> None:
    """Both Delta sinks of a generator's output are damaged behind reclock's
    back, each its own way; one ``reclock resnapshot`` of the output corrects
    each (its own correction, at its own upper), and the request ends once
    both committed theirs."""
    from reclock.runtime.resnapshot import Requests
    from tests.running import running
    from tests.sources.test_kafka_resnapshot import damage, held

    path = tmp_path / "pipeline.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
sources:
  - name: gen
    generator: {{kind: counter, rate: 400}}
    outputs:
      - name: n
        format: {{type: json, schema: {{n: int64}}}}
        sinks: [{{type: delta, name: a}}, {{type: delta, name: b}}]
""")
    cfg = load_config(path)
    lake = tmp_path / "state" / "outputs" / "gen"

    def counts(sink: str) -> Counter[tuple[Any, ...]]:
        return held(read_updates(cfg, "gen", "n", sink), ["n"])[0]

    def once(sink: str) -> bool:
        c = counts(sink)
        return sorted(c.elements()) == [(i,) for i in range(len(c))]

    with running(cfg, spark) as runners:
        wait_for(lambda: runners[0].records >= 400, 60, "records in both sinks")
        damage(lake / "n.a", lambda t: t.delete("n % 3 = 1"))
        damage(lake / "n.b", lambda t: t.delete("n % 5 = 0"))
        assert not once("a") and not once("b")
        request_resnapshot(cfg, "gen", "n")
        requests = Requests(tmp_path / "state", "gen")
        wait_for(lambda: not requests.pending(), 90, "the re-snapshot of both sinks")
        assert [o.health.status for o in runners[0].outputs] == ["running"] * 2
    assert once("a") and once("b")
    events = [e for e in runners[0].events.recent if e["kind"] == "resnapshot"]
    assert [e["state"] for e in events] == ["taken", "committed"], events
    [report] = verify_pipeline(cfg)
    assert report.ok, [(o.output, o.breaches, o.samples) for o in report.outputs]


def test_a_keyed_output_whose_sinks_fail_in_turn_lands_every_key_once(
        tmp_path: Path, spark: Any) -> None:
    """Commits and stages fail now in one sink, now in the other (injected):
    the failing one is parked while the other commits, its key state left as
    its last commit made it, and it catches up when it is back. Both end
    equal to the replayed records, and no failure ever stalled the source."""
    from reclock import faults
    from tests.running import running

    path = tmp_path / "pipeline.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
max_retry_backoff: 1s
sources:
{kv_source(KEYS, SEED, 200, TOTAL, EVERY, SIZE,
           "sinks: [{type: delta, name: a}, {type: delta, name: b}]")}""")
    cfg = load_config(path)

    def stalled() -> list[dict[str, Any]]:
        return [e for e in r.events.recent if e["kind"] == "sink_stalled"]

    try:
        with running(cfg, spark) as runners:
            r = runners[0]
            wait_for(lambda: r.records >= TOTAL // 10, 60, "a tenth of the records")
            for k, point in enumerate(("commit", "stage", "commit")):  # one sink at a time
                faults.arm(f"{point}:1")
                wait_for(lambda: len(stalled()) > k and all(  # noqa: B023
                    o.health.status == "running" for o in r.outputs), 60,
                    lambda: f"the sinks back: {r.status()}")
            wait_for(lambda: r.health.status == "finished", 90, lambda: f"the end: {r.status()}")
    finally:
        faults.disarm()
    stalls = stalled()
    assert len(stalls) == 3 and {e["sink"] for e in stalls} <= {"a", "b"}, stalls
    assert all("InjectedFault" in e["error"] for e in stalls), stalls
    assert not [e for e in r.events.recent if e["kind"] == "health"
                and e.get("status") == "stalled"]  # (the source itself never stalled)
    want, _ = replay(generate(0, TOTAL, seed=SEED, keys=KEYS, delete_every=EVERY,
                              value_size=SIZE)[0])
    from reclock.runtime.reading import read_output

    pipe = Pipeline(cfg)
    try:
        for out in pipe.build_source(cfg.sources[0]).outputs:
            t = read_output(out, None, "collection")
            got = {k: (n, p) for k, n, p in zip(t.column("key").to_pylist(),
                                                t.column("n").to_pylist(),
                                                t.column("payload").to_pylist(), strict=True)}
            assert got == want, out.key
    finally:
        pipe.close()
    [report] = verify_pipeline(cfg)
    assert report.ok, [(o.output, o.breaches, o.samples) for o in report.outputs]


def test_a_sink_added_to_a_cdc_output_takes_a_snapshot_the_other_does_not_hold_twice(
        tmp_path: Path, spark: Any, cdc_url: str) -> None:
    """``sinks: [delta]``, run, then a second sink added: the new one is
    filled from a new snapshot of the table, the first one skips it (its
    progress holds it), and both follow the changes after; each equals the
    upstream table."""
    from tests.running import running
    from tests.sources.cdc import flushed_lsn, output_rows, resumed_past, source_rows

    execute(cdc_url, *ACCT)

    def pipeline(sinks: str) -> Any:
        return _bank(tmp_path, cdc_url, sinks, create=False)

    for cfg, change in ((pipeline("[delta]"), "update acct set bal = bal + 1 where id < 50"),
                        (pipeline("[delta, {type: delta, name: copy}]"),
                         "update acct set bal = bal + 1 where id > 250")):
        with running(cfg, spark) as runners:
            with psycopg.connect(cdc_url, autocommit=True) as c:
                c.execute(change)
            wait_for(resumed_past(runners, flushed_lsn(cdc_url)), 90, "the sinks to catch up")
    want = source_rows(cdc_url, "select id, owner, bal from acct")
    for name in ("delta", "copy"):
        lake = read_updates(cfg, "bank", "acct", name)
        assert output_rows(lake, ["id", "owner", "bal"]) == want, name
    [report] = verify_pipeline(cfg)
    assert report.ok, [(o.output, o.breaches, o.samples) for o in report.outputs]
