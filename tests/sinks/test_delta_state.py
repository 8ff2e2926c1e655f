"""The Delta sink's state tables (``mode: state``): one row per live key,
kept with deletion vectors (sinks/delta_state.py). Every test compares the
table with an independent model: a dict of each key's current row, fed the
same updates."""

from __future__ import annotations

import os
import random
import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import reclock.sinks.delta as delta_mod
from reclock.contracts.rows import output_schema
from reclock.contracts.sink import SinkError, SinkFenced, SinkState
from reclock.core.errors import TransientError
from reclock.sinks.delta import DeltaSink, read_current
from reclock.sinks.delta_state import INDEX_NAME, KeyIndex, rebuild
from tests.peers import duckdb

USER = pa.schema([("k", pa.int64()), ("v", pa.string()), ("n", pa.float64())])
SCHEMA = output_schema(USER)
NAME = "st"

Row = tuple[str, float | None]


def updates(rows: list[tuple[int, str, float | None, int, int]],
            errors: int = 0) -> pa.Table:
    """Update rows of :data:`SCHEMA` from ``(k, v, n, into_time, diff)``,
    then ``errors`` error rows (key 10**9 + i) at the last IntoTime."""
    t = rows[-1][3] if rows else 0
    rows = rows + [(10**9 + i, "bad", None, t, 1) for i in range(errors)]
    m = len(rows)
    return pa.table({
        "k": [r[0] for r in rows], "v": [r[1] for r in rows], "n": [r[2] for r in rows],
        "_into_time": [r[3] for r in rows], "_diff": [r[4] for r in rows],
        "_src_part": pa.array([0] * m, pa.int32()), "_src_offset": list(range(m)),
        "_src_seq": pa.array([0] * m, pa.int32()), "_src_ts": pa.array([None] * m, pa.int64()),
        "_error": pa.array([None] * (m - errors) + ["refused"] * errors, pa.string()),
        "_raw_key": pa.array([None] * m, pa.binary()),
        "_raw_value": pa.array([None] * m, pa.binary())}, schema=SCHEMA)


class Model:
    """What the table must hold: each live key's row and IntoTime."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[str, float | None, int]] = {}

    def step(self, rnd: random.Random, t: int, nkeys: int) -> list[tuple[Any, ...]]:
        """Random changes at IntoTime ``t`` (inserts, updates, deletes, key
        re-inserts, and a key inserted and retracted within ``t``), applied
        to the model; the updates that say them, shuffled."""
        out: list[tuple[Any, ...]] = []
        for k in rnd.sample(range(nkeys), min(nkeys, 12)):
            old = self.rows.get(k)
            if old is not None:
                out.append((k, old[0], old[1], t, -1))
                if rnd.random() < 0.3:
                    del self.rows[k]
                    continue
            new = (f"v{t}-{k}", rnd.choice([None, float(k) / 3]), t)
            out.append((k, new[0], new[1], t, 1))
            self.rows[k] = new
        ghost = nkeys + t  # inserted and retracted within one IntoTime: never a row
        out += [(ghost, "g", 1.0, t, 1), (ghost, "g", 1.0, t, -1)]
        rnd.shuffle(out)
        return out

    def expected(self) -> list[tuple[Any, ...]]:
        return sorted((k, v, n, t) for k, (v, n, t) in self.rows.items())


def current(table: pa.Table) -> list[tuple[Any, ...]]:
    d = table.to_pydict()
    return sorted(zip(d["k"], d["v"], d["n"], d["_into_time"], strict=True))


def by_duckdb_query(path: Path, query: str) -> list[tuple[Any, ...]]:
    """The rows of ``query`` in DuckDB with its delta extension."""
    return duckdb().execute(query).fetchall()  # type: ignore[no-any-return]


def by_duckdb(path: Path) -> list[tuple[Any, ...]]:
    return sorted(by_duckdb_query(path, f"SELECT k, v, n, _into_time FROM delta_scan('{path}')"))


def make(path: Path, **kw: Any) -> DeltaSink:
    sink = DeltaSink(NAME, path, mode="state", key=["k"], **kw)
    sink.ensure(USER)
    return sink


def commit(sink: DeltaSink, table: pa.Table, expected: SinkState, upper: int) -> SinkState:
    new = SinkState(upper, f'"{upper}"')
    sink.commit(sink.stager().stage(f"b{upper}-{random.randrange(10**9)}", 0, table),
                expected, new)
    return new


def test_state_commits_equal_the_model_across_readers(tmp_path: Path) -> None:
    sink = make(tmp_path / "t")
    model, rnd, st = Model(), random.Random(7), SinkState()
    for c in range(8):
        # two IntoTimes per commit: a key's later IntoTime decides
        rows = model.step(rnd, 2 * c + 1, 40) + model.step(rnd, 2 * c + 2, 40)
        st = commit(sink, updates(rows, errors=1 if c == 3 else 0), st, 2 * c + 3)
        assert current(read_current(sink.location)) == model.expected()
    assert sink.state() == st
    got = sink.read_updates()
    assert set(got.column("_diff").to_pylist()) == {1}
    errors = got.filter(pa.compute.is_valid(got.column("_error")))
    assert errors.column("k").to_pylist() == [10**9]  # the error row, in the errors table
    assert by_duckdb(tmp_path / "t") == model.expected()
    # a fresh sink (a restarted driver) reads the same state and continues
    again = make(tmp_path / "t")
    assert again.state() == st
    rows = model.step(rnd, 100, 40)
    commit(again, updates(rows), st, 101)
    assert current(read_current(again.location)) == model.expected()


def test_updates_summing_to_nothing_change_nothing_but_the_state(tmp_path: Path) -> None:
    sink = make(tmp_path / "t")
    st = commit(sink, updates([(1, "a", 1.0, 1, 1)]), SinkState(), 2)
    files = sorted(p.name for p in (tmp_path / "t").glob("*.parquet"))
    st = commit(sink, updates([(1, "a", 1.0, 2, -1), (1, "a", 1.0, 2, 1),
                               (2, "b", None, 2, 1), (2, "b", None, 2, -1)]), st, 3)
    assert sorted(p.name for p in (tmp_path / "t").glob("*.parquet")) == files
    assert current(read_current(sink.location)) == [(1, "a", 1.0, 1)]
    assert sink.state() == st


def test_a_commit_with_another_expected_state_is_fenced_and_writes_nothing(
        tmp_path: Path) -> None:
    sink = make(tmp_path / "t")
    st = commit(sink, updates([(1, "a", 1.0, 1, 1)]), SinkState(), 2)
    other = make(tmp_path / "t")
    st2 = commit(other, updates([(1, "a", 1.0, 2, -1), (1, "b", 2.0, 2, 1)]), st, 3)
    log = sorted(os.listdir(tmp_path / "t" / "_delta_log"))
    staged = sink.stager().stage("late", 0, updates([(1, "b", 2.0, 2, -1)]))
    with pytest.raises(SinkFenced):
        sink.commit(staged, st, SinkState(4, '"4"'))  # a zombie: its state is old
    assert sorted(os.listdir(tmp_path / "t" / "_delta_log")) == log
    assert current(read_current(sink.location)) == [(1, "b", 2.0, 2)]
    assert sink.state() == st2


def test_updates_that_break_the_key_are_refused_whole(tmp_path: Path) -> None:
    sink = make(tmp_path / "t")
    st = commit(sink, updates([(1, "a", 1.0, 1, 1)]), SinkState(), 2)
    staged = sink.stager().stage("bad", 0, updates([(1, "b", None, 2, 1), (3, "c", None, 2, 1)]))
    with pytest.raises(SinkError, match=r"IntoTime 2 leave key \(k=1\).*2 live rows"):
        sink.commit(staged, st, SinkState(3, None))
    assert sink.state() == st
    assert current(read_current(sink.location)) == [(1, "a", 1.0, 1)]


class Killed(BaseException):
    pass


def killed_second_commit(sink: DeltaSink, model: Model, rnd: random.Random, point: str,
                         monkeypatch: pytest.MonkeyPatch
                         ) -> tuple[SinkState, list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Commits the model's first step (30 rows, upper 2), then kills the
    commit of its second (upper 3) at crash point ``point``; (the state of
    the first commit, the rows the model held then, the killed commit's
    updates)."""
    st = commit(sink, updates(model.step(rnd, 1, 30)), SinkState(), 2)
    before = model.expected()
    rows = model.step(rnd, 2, 30)

    def crash(name: str) -> None:
        if name == point:
            raise Killed

    monkeypatch.setattr(delta_mod.faults, "crash_point", crash)
    with pytest.raises(Killed):
        commit(sink, updates(rows), st, 3)
    monkeypatch.undo()
    return st, before, rows


@pytest.mark.parametrize("point", ["state_before_log", "state_logged"])
def test_a_crash_in_a_commit_loses_and_doubles_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    """Killed before the log entry: nothing happened; after it, before the
    key index caught up: the commit happened, and the next commit rebuilds
    the index from the table."""
    sink = make(tmp_path / "t")
    model, rnd = Model(), random.Random(3)
    st, before, rows = killed_second_commit(sink, model, rnd, point, monkeypatch)
    fresh = make(tmp_path / "t")  # the restarted driver
    landed = fresh.state()
    if point == "state_before_log":
        assert landed == st and current(read_current(fresh.location)) == before
        # the killed commit's data and deletion vector files: orphans
        left = {p.name for p in (tmp_path / "t").iterdir() if p.is_file()}
        gone = fresh.vacuum_orphans(0)
        assert any(n.startswith("deletion_vector_") for n in gone), gone
        assert any("-state-" in n for n in gone), gone
        assert {p.name for p in (tmp_path / "t").iterdir() if p.is_file()} == left - set(gone)
        assert current(read_current(fresh.location)) == before
        landed = commit(fresh, updates(rows), st, 3)  # the retry
    assert landed == SinkState(3, '"3"')
    assert current(read_current(fresh.location)) == model.expected()
    rows = model.step(rnd, 3, 30)
    commit(fresh, updates(rows), landed, 4)
    assert not [n for n in fresh.vacuum_orphans(0) if n.startswith("deletion_vector_")]
    assert current(read_current(fresh.location)) == model.expected()
    assert by_duckdb(tmp_path / "t") == model.expected()


def _index_rows(path: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path / INDEX_NAME) as db:
        return sorted(db.execute("SELECT k, f.path, r FROM keys JOIN files f ON f.id = keys.f"))


@pytest.mark.parametrize("damage", ["deleted", "stale", "garbage"])
def test_the_key_index_is_rebuilt_from_the_table(tmp_path: Path, damage: str) -> None:
    sink = make(tmp_path / "t")
    model, rnd, st = Model(), random.Random(5), SinkState()
    for c in range(4):
        st = commit(sink, updates(model.step(rnd, c + 1, 30)), st, c + 2)
    good = _index_rows(tmp_path / "t")
    assert len(good) == len(model.rows)
    sink.close()
    assert sink._index is not None
    sink._index.close()
    index = tmp_path / "t" / INDEX_NAME
    if damage == "deleted":
        for p in tmp_path.glob(f"t/{INDEX_NAME}*"):
            p.unlink()
    elif damage == "stale":
        with sqlite3.connect(index) as db:
            db.execute("UPDATE meta SET value = value - 1 WHERE name = 'version'")
            db.execute("DELETE FROM keys WHERE k IN (SELECT k FROM keys LIMIT 3)")
    else:
        for p in tmp_path.glob(f"t/{INDEX_NAME}*"):
            p.unlink()
        index.write_bytes(b"\0garbage" * 4096)
    fresh = make(tmp_path / "t")
    st = commit(fresh, updates(model.step(rnd, 9, 30)), st, 10)
    assert current(read_current(fresh.location)) == model.expected()
    rebuilt = KeyIndex(str(tmp_path / "u.sqlite"))
    rebuild(rebuilt, str(tmp_path / "t"), ["k"], NAME)
    rebuilt.close()
    assert _index_rows(tmp_path / "t") == sorted(
        sqlite3.connect(tmp_path / "u.sqlite").execute(
            "SELECT k, f.path, r FROM keys JOIN files f ON f.id = keys.f"))


def test_compaction_checkpoints_and_vacuums_keep_the_state(tmp_path: Path) -> None:
    sink = make(tmp_path / "t", compaction=delta_mod.Compaction(in_child=False))
    model, rnd, st = Model(), random.Random(11), SinkState()
    for c in range(30):  # past a checkpoint (every 25 versions)
        st = commit(sink, updates(model.step(rnd, c + 1, 30)), st, c + 2)
    root = tmp_path / "t"
    assert (root / "_delta_log" / "_last_checkpoint").exists()
    done = sink.compact(min_files=5)
    assert done["files_removed"] >= 5
    assert sink.state() == st
    assert current(read_current(sink.location)) == model.expected()
    for c in range(30, 34):
        st = commit(sink, updates(model.step(rnd, c + 1, 30)), st, c + 2)
    sink._checkpoint()
    dvs = {p.name for p in root.glob("deletion_vector_*.bin")}
    expired = sink.expire_removed(0)
    assert any(p.startswith("deletion_vector_") for p in expired)  # superseded vectors
    in_use = {p.name for p in root.glob("deletion_vector_*.bin")}
    assert in_use < dvs
    sink.vacuum_orphans(0)
    assert sink.state() == st
    assert current(read_current(sink.location)) == model.expected()
    assert by_duckdb(root) == model.expected()
    fresh = make(tmp_path / "t")  # the index, rebuilt from checkpoint + log, agrees
    for p in root.glob(f"{INDEX_NAME}*"):
        p.unlink()
    st = commit(fresh, updates(model.step(rnd, 50, 30)), st, 51)
    assert current(read_current(fresh.location)) == model.expected()


def test_state_mode_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(SinkError, match="needs key columns"):
        DeltaSink(NAME, tmp_path / "a", mode="state")
    with pytest.raises(SinkError, match="only applies to mode 'state'"):
        DeltaSink(NAME, tmp_path / "a", key=["k"])
    with pytest.raises(SinkError, match="needs a local directory for its key index"):
        DeltaSink(NAME, "s3://bucket/x", mode="state", key=["k"])
    with pytest.raises(SinkError, match=r"key columns \['nope'\]"):
        DeltaSink(NAME, tmp_path / "a", mode="state", key=["nope"]).ensure(USER)


def test_a_delta_state_output_in_a_pipeline_needs_a_key_the_upstream_keeps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The config checks of the Postgres sink's state tables, shared: a key
    is required, and it must contain the output's upstream key (refused
    before Spark starts)."""
    import reclock.runtime.spark
    from reclock.config import ConfigError, load_config
    from reclock.core.errors import DefiniteError
    from reclock.pipeline import run

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("Spark was started")

    monkeypatch.setattr(reclock.runtime.spark, "spark_session", refuse)

    def pipeline(sink: str) -> Path:
        f = tmp_path / "p.yaml"
        f.write_text(f"state_dir: {tmp_path}/state\nsources:\n  - name: shop\n"
                     "    generator: {kind: orders, rate: 100, max_records: 50}\n"
                     f"    outputs:\n      - name: customers\n        sink: {sink}\n"
                     "      - name: orders\n        sink: console\n")
        return f

    with pytest.raises(ConfigError, match="key: required with mode: state"):
        load_config(pipeline("{type: delta, mode: state}"))
    with pytest.raises(DefiniteError, match=r"sink key \['name'\]: a state table's key must "
                                            r"contain the output's upstream key"):
        run(load_config(pipeline("{type: delta, mode: state, key: [name]}")), out=None,
            install_signals=False)
    cfg = load_config(pipeline("{type: delta, mode: state, key: [customer_id]}"))
    assert cfg.sources[0].outputs[0].sink.state_key == ("customer_id",)
    with pytest.raises(AssertionError, match="Spark was started"):
        run(cfg, out=None, install_signals=False)


def _race(sink: DeltaSink, w: int, r: int, expected: SinkState, barrier: Any,
          outcome: dict[int, str]) -> None:
    """Committer ``w`` of round ``r``: stage its row, wait for the other,
    commit (again after a transient error, as the driver does)."""
    staged = sink.stager().stage(f"w{w}r{r}", 0, updates([(w * 1000 + r, f"w{w}", None,
                                                            r + 1, 1)]))
    barrier.wait()
    for _ in range(50):
        try:
            sink.commit(staged, expected, SinkState(r + 2, f'"w{w}"'))
            outcome[w] = "ok"
        except SinkFenced:
            outcome[w] = "fenced"
        except TransientError:
            # the other committer holds the key index (SQLite busy): retried,
            # as the driver retries a transient error
            time.sleep(0.05)
            continue
        return


def test_two_committers_without_the_lock_one_wins_each_round(tmp_path: Path) -> None:
    """Two sinks of one state table (two drivers, the local lock off so that
    only the log's put-if-absent and the state check fence them) commit the
    same round at once: one lands, the other is fenced, and the table holds
    exactly the winner's rows."""
    import threading

    sinks = [make(tmp_path / "t", lock=False) for _ in range(2)]
    model, st = Model(), SinkState()
    for r in range(6):
        barrier = threading.Barrier(2)
        outcome: dict[int, str] = {}
        threads = [threading.Thread(target=_race, args=(sinks[w], w, r, st, barrier, outcome))
                   for w in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcome.values()) == ["fenced", "ok"], outcome
        winner = next(w for w, o in outcome.items() if o == "ok")
        model.rows[winner * 1000 + r] = (f"w{winner}", None, r + 1)
        st = SinkState(r + 2, f'"w{winner}"')
        assert sinks[0].state() == st
        assert current(read_current(sinks[0].location)) == model.expected()


class Failed(Exception):
    """A failure between the errors table's commit and the state commit."""


def _with_errors(rows: list[tuple[Any, ...]], errors: list[tuple[int, int]]) -> pa.Table:
    """Updates of ``rows``, then an error row per ``(key, into_time)``."""
    t = updates(rows) if rows else updates([(0, "x", None, 0, 1)]).slice(0, 0)
    bad = updates([(k, "bad", None, at, 1) for k, at in errors])
    bad = bad.set_column(bad.schema.get_field_index("_error"), "_error",
                         pa.array(["refused"] * bad.num_rows, pa.string()))
    return pa.concat_tables([t, bad])


def _error_rows(sink: DeltaSink, as_of: int | None = None) -> Counter[tuple[int, int]]:
    got = sink.read_updates(as_of)
    bad = got.filter(pa.compute.is_valid(got.column("_error")))
    return Counter(zip(bad.column("k").to_pylist(), bad.column("_into_time").to_pylist(),
                       strict=True))


@pytest.mark.parametrize("retry", ["same", "split"])
def test_a_failure_between_the_errors_commit_and_the_state_commit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, retry: str) -> None:
    """The errors table is committed first; a state commit that then fails
    (at either crash point, as a transient failure the driver retries) and
    is retried with the same bounds, or split into smaller commits as a
    restarted driver's smaller jobs would, leaves every refused row in the
    output once: the model is the set of refused rows the updates carried."""
    sink = make(tmp_path / "t")
    model, rnd = Model(), random.Random(11)
    refused: Counter[tuple[int, int]] = Counter()
    errs = [(1001, 1)]
    st = commit(sink, _with_errors(model.step(rnd, 1, 20), errs), SinkState(), 2)
    refused.update(errs)
    t = 2
    for point in ["state_before_log", "state_logged", "state_before_log"]:
        a, b = model.step(rnd, t, 20), model.step(rnd, t + 1, 20)
        ea, eb = [(2000 + t, t)], [(3000 + t, t + 1), (4000 + t, t + 1)]
        refused.update(ea + eb)

        def fail(name: str, point: str = point) -> None:
            if name == point:
                raise Failed(name)

        monkeypatch.setattr(delta_mod.faults, "crash_point", fail)
        new = SinkState(t + 2, f'"{t + 2}"')
        with pytest.raises(Failed):
            sink.commit(sink.stager().stage(f"f{t}", 0, _with_errors(a + b, ea + eb)), st, new)
        monkeypatch.undo()
        assert sink._errors is not None and sink._errors.state().upper == t + 2
        # the output reads as of its own upper: the errors table's rows past
        # it (the failed commit's) do not show before the commit lands
        landed = make(tmp_path / "t").state()
        assert landed.upper is not None
        assert _error_rows(make(tmp_path / "t")) == Counter(
            {e: n for e, n in refused.items() if e[1] < landed.upper})
        if point == "state_logged":  # the log entry landed: the commit happened
            assert landed == new
            sink = make(tmp_path / "t")  # a restarted driver
        elif retry == "same":
            commit(sink, _with_errors(a + b, ea + eb), st, t + 2)
        else:
            mid = commit(sink, _with_errors(a, ea), st, t + 1)
            commit(sink, _with_errors(b, eb), mid, t + 2)
        st = SinkState(t + 2, f'"{t + 2}"')
        assert sink.state() == st
        assert current(read_current(sink.location)) == model.expected()
        assert _error_rows(sink) == refused
        t += 2
    errs = [(9000, t)]
    commit(sink, _with_errors(model.step(rnd, t, 20), errs), st, t + 1)
    refused.update(errs)
    assert _error_rows(sink) == refused
    assert current(read_current(sink.location)) == model.expected()
    assert by_duckdb(tmp_path / "t") == model.expected()



def test_a_state_table_gains_a_column_and_widens_one(tmp_path: Path) -> None:
    """A new nullable column: the commit's log entry carries the new schema,
    the rows of older files read null there; a widened column (int -> long):
    that commit rewrites the live files in the new type, keeping their
    deletion vectors and the key index. The model: each key's row (k, v, c,
    w, IntoTime), w null where a row's change did not carry it; delta-rs,
    DuckDB and the key index rebuilt from the table agree with it."""
    narrow = pa.schema([("k", pa.int64()), ("v", pa.string()), ("c", pa.int32())])
    added = narrow.append(pa.field("w", pa.string()))
    wide = pa.schema([("k", pa.int64()), ("v", pa.string()), ("c", pa.int64()),
                      ("w", pa.string())])
    path = tmp_path / "t"
    model: dict[int, tuple[Any, ...]] = {}

    def batch(schema: pa.Schema, rows: list[tuple[Any, ...]], t: int) -> pa.Table:
        """Updates at IntoTime ``t`` in ``schema``: a retraction of each
        key's model row, then ``rows`` (``(k, v, c, w)``; ``v`` None: delete)."""
        out: list[tuple[tuple[Any, ...], int]] = []
        for r in rows:
            old = model.pop(r[0], None)
            if old is not None:
                out.append((old[:4], -1))
            if r[1] is not None:
                out.append((r, 1))
                model[r[0]] = (*r, t)
        m = len(out)
        cols = {n: [row[i] for row, _ in out] for i, n in enumerate(schema.names)}
        return pa.table({**cols, "_into_time": [t] * m, "_diff": [d for _, d in out],
                         "_src_part": pa.array([0] * m, pa.int32()),
                         "_src_offset": list(range(m)),
                         "_src_seq": pa.array([0] * m, pa.int32()),
                         "_src_ts": pa.array([None] * m, pa.int64()),
                         "_error": pa.array([None] * m, pa.string()),
                         "_raw_key": pa.array([None] * m, pa.binary()),
                         "_raw_value": pa.array([None] * m, pa.binary())},
                        schema=output_schema(schema))

    def by_rs() -> list[tuple[Any, ...]]:
        d = read_current(DeltaSink(NAME, path).location).to_pydict()
        return sorted(zip(*(d.get(n, [None] * len(d["k"]))
                            for n in ["k", "v", "c", "w", "_into_time"]), strict=True))

    def by_duck() -> list[tuple[Any, ...]]:
        return sorted(by_duckdb_query(
            path, f"SELECT k, v, c, w, _into_time FROM delta_scan('{path}')"))

    sink = DeltaSink(NAME, path, mode="state", key=["k"])
    sink.ensure(narrow)
    st = SinkState()
    for t in (1, 2):
        rows = [(k, f"v{t}-{k}", k * t, None) for k in range(t * 5)]
        rows += [(0, None, None, None)] * (t - 1)
        new = SinkState(t + 1, f'"{t + 1}"')
        sink.commit(sink.stager().stage(f"n{t}", 0, batch(narrow, rows, t)), st, new)
        st = new
    assert by_rs() == sorted(model.values())

    # a new nullable column, met by a restarted driver
    sink = DeltaSink(NAME, path, mode="state", key=["k"])
    sink.ensure(added)
    rows = [(3, "w3", 30, "x3"), (20, "w20", 200, "x20"), (4, None, None, None)]
    sink.commit(sink.stager().stage("a", 0, batch(added, rows, 3)), st, SinkState(4, '"4"'))
    st = SinkState(4, '"4"')
    assert by_rs() == by_duck() == sorted(model.values())
    assert sink.state() == st

    # a widened column, on the running sink
    sink.ensure(wide)
    rows = [(5, "w5", 2**40, None), (2, None, None, None)]
    sink.commit(sink.stager().stage("w", 0, batch(wide, rows, 4)), st, SinkState(5, '"5"'))
    st = SinkState(5, '"5"')
    assert read_current(sink.location).schema.field("c").type == pa.int64()
    assert by_rs() == by_duck() == sorted(model.values())
    # the key index goes on naming each live row; rebuilt from the table, it agrees
    rows = [(k, f"z{k}", k, "z") for k in range(0, 25, 3)]
    sink.commit(sink.stager().stage("z", 0, batch(wide, rows, 5)), st, SinkState(6, '"6"'))
    assert by_rs() == by_duck() == sorted(model.values())
    rebuilt = KeyIndex(str(tmp_path / "u.sqlite"))
    rebuild(rebuilt, str(path), ["k"], NAME)
    assert sorted(k for (k,) in rebuilt.db.execute("SELECT k FROM keys")) == sorted(model)
