"""Keyed outputs settled a few key buckets at a time against a key state in
SQLite give exactly what one settlement in memory gives, and what a plain
dictionary model of the intents says the output must hold.

The intents are random: values, tombstones, updates that move a row to
another key without sending a column (the value takes it from the row the
tombstone removed), truncations and error rows, cut into tasks at random
positions, some written to files, settled in rounds of one key group each.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from reclock.contracts.consolidate import consolidate
from reclock.core.columns import TRUNCATED
from reclock.core.errors import DefiniteError, classify
from reclock.runtime import upsert_state
from reclock.runtime.keystate import (
    ALL,
    DEFAULT_CACHE,
    KEY_BUCKETS,
    CacheShares,
    IntentWriter,
    KeyedIntents,
    KeyStateDamaged,
    MemoryKeys,
    SqliteKeys,
    canonical,
    key_bucket,
    split_intents,
)
from reclock.runtime.upsert_state import UpsertState

pytestmark = pytest.mark.unit

COLS = ["k", "v", "w"]
SCHEMA = pa.schema([
    ("k", pa.int64()), ("v", pa.string()), ("w", pa.int64()),
    ("_into_time", pa.int64()), ("_diff", pa.int64()), ("_src_part", pa.int32()),
    ("_src_offset", pa.int64()), ("_src_seq", pa.int32()), ("_src_ts", pa.int64()),
    ("_error", pa.string()), ("_raw_key", pa.binary()), ("_raw_value", pa.binary()),
])
INTENTS = SCHEMA.append(pa.field("_unchanged", pa.list_(pa.int32())))


def _random_batches(rng: random.Random, batches: int, positions: int
                    ) -> tuple[list[pa.Table], dict[int, tuple[Any, ...]]]:
    """Random intents in ``batches`` (one per commit), and the model: the
    final row per key, by a plain dictionary applied in position order."""
    model: dict[int, tuple[Any, ...]] = {}
    out = []
    pos = 0
    for _ in range(batches):
        rows: list[dict[str, Any]] = []
        for _ in range(positions):
            at = {"_into_time": 10 + pos // 4, "_src_part": 0, "_src_offset": pos}
            here: list[dict[str, Any]] = []

            def emit(here: list[dict[str, Any]] = here, at: dict[str, int] = at,
                     **kw: Any) -> None:
                here.append({**at, "_src_seq": len(here), **kw})

            r = rng.random()
            if r < 0.02:
                emit(_diff=TRUNCATED)
                model.clear()
            elif r < 0.05:
                emit(_diff=1, k=rng.randrange(50), _error="cannot decode")
            elif r < 0.2 and model:
                old = rng.choice(sorted(model))
                # (a key that is not live: upstream keys are unique)
                new = rng.choice([k for k in range(400) if k not in model])
                kept = model.pop(old)
                v = f"moved{pos}"
                emit(_diff=0, k=old)
                emit(_diff=1, k=new, v=v, w=None, _unchanged=[2])
                model[new] = (new, v, kept[2])
            else:
                for _ in range(rng.randrange(1, 4)):
                    k = rng.randrange(400)
                    if rng.random() < 0.25:
                        emit(_diff=0, k=k)
                        model.pop(k, None)
                    else:
                        v, w = f"v{rng.randrange(5)}", rng.randrange(3)
                        emit(_diff=1, k=k, v=v, w=w)
                        model[k] = (k, v, w)
            rows.extend(here)
            pos += 1
        out.append(pa.Table.from_pylist(rows, schema=INTENTS))
    return out, model


def _tasks(rng: random.Random, batch: pa.Table, spill: Path, n: int) -> KeyedIntents:
    """The batch as ``n`` tasks would split it (cut between positions), some
    writing their intents to files as they read them (a moved row's
    tombstone and value then fall into different pieces too)."""
    offs = batch.column("_src_offset").to_pylist()
    cuts = sorted(rng.sample(sorted(set(offs)), min(n - 1, len(set(offs)) - 1)))
    parts = []
    lo = None
    for i, hi in enumerate([*cuts, None]):
        keep = [(lo is None or o >= lo) and (hi is None or o < hi) for o in offs]
        t = batch.filter(pa.array(keep))
        if i % 2:  # read in batches of 7 rows, written out every 1,000 bytes
            w = IntentWriter(("k",), spill, 1000, f"t{i}")
            for start in range(0, t.num_rows, 7):
                w.add(t.slice(start, 7))
            parts.append(w.done())
        else:
            parts.append(split_intents(t, ("k",), spill, 1 << 40, f"t{i}"))
        lo = hi
    return KeyedIntents.merged(parts)


def _held(updates: list[pa.Table]) -> dict[int, tuple[Any, ...]]:
    c = consolidate(pa.concat_tables(updates), None, COLS)
    assert set(c.column("_count").to_pylist()) <= {1}
    return {r["k"]: (r["k"], r["v"], r["w"]) for r in c.to_pylist()}


@pytest.mark.parametrize("seed", range(12))
def test_settling_by_bucket_in_sqlite_equals_one_settlement_and_the_model(
        tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    if seed % 2:  # Python values of 5 intents at a time, key changes written after each
        monkeypatch.setattr(upsert_state, "SLICE_ROWS", 5)
    batches, model = _random_batches(rng, 3, 120)
    whole = UpsertState(COLS, ("k",))
    path = tmp_path / "keys.sqlite"
    log_whole: list[pa.Table] = []
    log_rounds: list[pa.Table] = []
    for n, batch in enumerate(batches):
        upd, pending = whole.apply(batch, SCHEMA)
        whole.accept(pending)
        log_whole.append(upd)
        # a new driver each commit: the store is reopened from its file
        disk = UpsertState(COLS, ("k",), SqliteKeys(path))
        assert disk.store.marker == (None if n == 0 else f"m{n - 1}")
        intents = _tasks(rng, batch, tmp_path / f"spill{n}", 3)
        assert intents.files() and any(isinstance(p, pa.Table)
                                       for ps in intents.parts.values() for p in ps)
        rounds = intents.rounds(1)
        assert len(rounds) > 1
        for a, b in intents.links:  # a moved row's two buckets settle together
            assert any(a in r and b in r for r in rounds)
        log_rounds.extend(disk.settle(intents, SCHEMA, 1))
        disk.commit(f"m{n}")
        disk.store.close()
    final = UpsertState(COLS, ("k",), SqliteKeys(path))
    assert final.rows == whole.rows == {(k,): row for k, row in model.items()}
    assert _held(log_rounds) == _held(log_whole) == model
    errors = pa.concat_tables(log_rounds).column("_error").drop_null().to_pylist()
    assert errors and set(errors) == {"cannot decode"}


def test_a_rolled_back_settlement_leaves_the_store_as_committed(tmp_path: Path) -> None:
    rng = random.Random(7)
    batches, _ = _random_batches(rng, 2, 80)
    path = tmp_path / "keys.sqlite"
    st = UpsertState(COLS, ("k",), SqliteKeys(path))
    list(st.settle(_tasks(rng, batches[0], tmp_path / "s0", 2), SCHEMA, 1))
    st.commit("first")
    before = st.rows
    list(st.settle(_tasks(rng, batches[1], tmp_path / "s1", 2), SCHEMA, 1))
    assert st.rows != before  # (the open changes are visible to the settling driver)
    st.rollback()  # the sink commit failed
    assert st.rows == before and st.store.marker == "first"
    st.store.close()
    again = UpsertState(COLS, ("k",), SqliteKeys(path))
    assert again.rows == before and again.store.marker == "first"


def test_truncation_settles_every_bucket_and_empty_ones_stay_empty(tmp_path: Path) -> None:
    st = UpsertState(COLS, ("k",), SqliteKeys(tmp_path / "k.sqlite"))
    rows = [{"_into_time": 1, "_src_part": 0, "_src_offset": i, "_src_seq": 0, "_diff": 1,
             "k": i, "v": "a", "w": 0} for i in range(300)]
    first = split_intents(pa.Table.from_pylist(rows, schema=INTENTS), ("k",), None, 0, "t")
    list(st.settle(first, SCHEMA, 1))
    st.commit("one")
    trunc = pa.Table.from_pylist([{"_into_time": 2, "_src_part": 0, "_src_offset": 300,
                                   "_src_seq": 0, "_diff": TRUNCATED}], schema=INTENTS)
    second = split_intents(trunc, ("k",), None, 0, "t")
    assert len(second.rounds(1)) == KEY_BUCKETS  # every bucket loses its keys
    out = list(st.settle(second, SCHEMA, 1))
    st.commit("two")
    retracted = pa.concat_tables(out)
    assert sorted(retracted.column("k").to_pylist()) == list(range(300))
    assert set(retracted.column("_diff").to_pylist()) == {-1} and st.rows == {}


def test_rebuild_into_sqlite_equals_memory_and_refuses_a_key_held_twice(tmp_path: Path) -> None:
    rng = random.Random(3)
    batches, model = _random_batches(rng, 2, 150)
    mem = UpsertState(COLS, ("k",))
    log = []
    for b in batches:
        upd, pending = mem.apply(b, SCHEMA)
        mem.accept(pending)
        log.append(upd)
    updates = pa.concat_tables(log)
    disk = UpsertState.rebuild(updates, COLS, ("k",), SqliteKeys(tmp_path / "a.sqlite"), "m")
    assert disk.rows == UpsertState.rebuild(updates, COLS, ("k",)).rows == mem.rows
    assert disk.store.marker == "m" and len(disk.store) == len(model)
    k = next(iter(model))
    twice = pa.concat_tables([updates, updates.filter(pa.array(
        [x == k and d == 1 for x, d in zip(updates.column("k").to_pylist(),
                                           updates.column("_diff").to_pylist(), strict=True)]
    )).slice(0, 1).set_column(1, "v", pa.array(["other"]))])
    with pytest.raises(DefiniteError, match="more than once"):
        UpsertState.rebuild(twice, COLS, ("k",), SqliteKeys(tmp_path / "b.sqlite"), "m")


def test_an_unreadable_store_is_replaced_by_an_empty_one(tmp_path: Path) -> None:
    path = tmp_path / "k.sqlite"
    path.write_bytes(b"not a database" * 100)
    store = SqliteKeys(path)
    assert store.marker is None and len(store) == 0
    store.write({"(1,)": (1, "a", 0)})
    store.commit("m")
    assert SqliteKeys(path).lookup(["(1,)"]) == {"(1,)": (1, "a", 0)}


def _filled(path: Path, n: int = 20_000, marker: str = "m") -> dict[str, tuple[Any, ...]]:
    """A key file of ``n`` keys (a few MiB), committed with ``marker`` and
    closed; returns its rows."""
    rows = {canonical((k,)): (k, f"value-{k}-" + "x" * 60, k * 3) for k in range(n)}
    store = SqliteKeys(path)
    store.write(dict(rows))
    store.commit(marker)
    store.close()
    return rows


def _overwrite(path: Path, at: int, data: bytes) -> None:
    with path.open("r+b") as f:
        f.seek(at)
        f.write(data)


def _middle(path: Path) -> int:
    return path.stat().st_size // 2 // 4096 * 4096


@pytest.mark.parametrize("summed", [True, False], ids=["checksum", "no-checksum"])
@pytest.mark.parametrize("damage", ["middle-32k", "middle-32k-zeros", "unaligned-32k",
                                    "in-a-row", "truncated", "cut-to-50-bytes", "garbage",
                                    "empty"])
def test_a_damaged_file_is_replaced_by_an_empty_one_at_open(
    tmp_path: Path, damage: str, summed: bool
) -> None:
    """Issue: 32 KiB overwritten in the middle of a key file left its marker
    readable, so the file was reused and every settle failed. Now opening a
    file checks it: against the checksum its last clean close kept, or, with
    none (a file of an older version, or a lost checksum), with quick_check.
    A damaged file is thrown away: the store is empty with no marker (the
    driver rebuilds it) and says why. A few bytes inside a row escape
    quick_check (they are met when the row is read: see below), not the
    checksum."""
    path = tmp_path / "k.sqlite"
    rows = _filled(path)
    if not summed:
        Path(f"{path}.sum").unlink()
    size = path.stat().st_size
    rng = random.Random(damage)
    if damage == "middle-32k":
        _overwrite(path, _middle(path), rng.randbytes(32 * 1024))
    elif damage == "middle-32k-zeros":
        _overwrite(path, _middle(path), bytes(32 * 1024))
    elif damage == "unaligned-32k":
        _overwrite(path, _middle(path) + 1234, rng.randbytes(32 * 1024))
    elif damage == "in-a-row":  # the bytes of one row's value, in place
        data = path.read_bytes()
        at = data.index(rows[canonical((12_345,))][1].encode())
        _overwrite(path, at, b"X" * 8)
    elif damage == "truncated":
        os.truncate(path, size // 2 + 1000)
    elif damage == "cut-to-50-bytes":
        os.truncate(path, 50)
    elif damage == "garbage":
        path.write_bytes(rng.randbytes(size))
    else:
        os.truncate(path, 0)
    with sqlite3.connect(path) as raw:  # the marker alone may still read
        still: Any = None
        found: Any = None
        with contextlib.suppress(sqlite3.DatabaseError):
            still = raw.execute("SELECT v FROM meta WHERE k = 'marker'").fetchone()
            found = raw.execute("PRAGMA quick_check").fetchall()
    raw.close()
    if damage in ("middle-32k", "middle-32k-zeros", "unaligned-32k", "in-a-row"):
        assert still == ("m",)
    if damage == "in-a-row":
        assert found == [("ok",)]  # quick_check does not read inside a row
    store = SqliteKeys(path)
    if damage == "in-a-row" and not summed:
        assert store.discarded is None and store.marker == "m"  # see the test below
        return
    assert store.marker is None and len(store) == 0
    if summed:
        assert store.discarded is not None and "bytes changed" in store.discarded
    elif damage == "empty":
        assert store.discarded is None  # an empty file is an empty database: no marker
    else:
        assert store.discarded is not None
        if damage in ("middle-32k", "middle-32k-zeros", "unaligned-32k"):
            assert "quick_check" in store.discarded, store.discarded
    # the new file works, and is reused when sound
    store.write({"(1,)": (1, "a", 0)})
    store.commit("m2")
    store.close()
    again = SqliteKeys(path)
    assert again.discarded is None and again.marker == "m2"
    assert again.lookup(["(1,)"]) == {"(1,)": (1, "a", 0)}


def test_a_crashed_store_is_reused_with_its_wal_and_rebuilt_without_it(tmp_path: Path) -> None:
    """A driver killed while its key file is open leaves the file with its
    -wal file (SQLite removes it only at the last close): with it, the
    store opens at its last commit; a file whose -wal file is gone (copied
    alone, cleaned away) may hold part of its last transactions, so it is
    thrown away, never reused."""
    path = tmp_path / "k.sqlite"
    rows = _filled(path, 5_000, marker="m1")
    store = SqliteKeys(path)  # running: the file marked open
    more = {canonical((k,)): (k, "changed", 0) for k in range(0, 5_000, 3)}
    store.write(dict(more))
    store.commit("m2")
    wal = Path(f"{path}-wal")
    assert wal.exists() and wal.stat().st_size > 0
    # the files as a kill -9 leaves them (the process's memory is gone)
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    shutil.copy(path, crashed / "k.sqlite")
    shutil.copy(wal, crashed / "k.sqlite-wal")
    lost = tmp_path / "lost"
    lost.mkdir()
    shutil.copy(path, lost / "k.sqlite")
    store.close()
    assert not wal.exists()  # a clean close folds it in

    recovered = SqliteKeys(crashed / "k.sqlite")
    assert recovered.discarded is None and recovered.marker == "m2"
    assert dict(recovered.live(ALL)) == {**rows, **more}
    recovered.close()
    gone = SqliteKeys(lost / "k.sqlite")
    assert gone.discarded is not None and "-wal" in gone.discarded
    assert gone.marker is None and len(gone) == 0
    gone.close()
    # and a clean close leaves a file that is simply reused
    assert SqliteKeys(path).marker == "m2"


def test_damage_met_after_open_raises_key_state_damaged(tmp_path: Path) -> None:
    """Damage the check at open cannot see (a row's bytes: SQLite does not
    read inside a row) or that happens after it (pages overwritten while the
    store is open) is raised as KeyStateDamaged, a definite error that names
    the file, not as an error retried forever."""
    path = tmp_path / "k.sqlite"
    rows = _filled(path, 2_000)
    Path(f"{path}.sum").unlink()  # no checksum to compare with: quick_check
    with sqlite3.connect(path) as raw:  # one row's bytes garbled, the pages sound
        raw.execute("UPDATE keys SET row = ? WHERE key = ?",
                    (b"\x80\x05garbage", f"{key_bucket('(7,)'):02x}:(7,)"))
    raw.close()
    store = SqliteKeys(path)
    assert store.discarded is None and store.marker == "m"
    assert store.lookup(["(8,)"]) == {"(8,)": rows["(8,)"]}
    with pytest.raises(KeyStateDamaged, match="does not decode") as info:
        store.lookup(["(7,)", "(8,)"])
    assert info.value.path == path and str(path) in str(info.value)
    assert isinstance(classify(info.value), DefiniteError)
    store.close()

    # pages overwritten while the store is open: met when SQLite reads them
    # again (another connection's commit makes it drop its page cache)
    path = tmp_path / "open.sqlite"
    _filled(path)
    store = SqliteKeys(path)
    assert store.discarded is None
    _overwrite(path, _middle(path), random.Random(3).randbytes(32 * 1024))
    with sqlite3.connect(path, isolation_level=None) as other:
        other.execute("INSERT INTO meta (k, v) VALUES ('x', 'y')")
    other.close()
    with pytest.raises(KeyStateDamaged, match="malformed") as info:
        store.lookup([canonical((k,)) for k in range(20_000)])
    assert isinstance(info.value.__cause__, sqlite3.DatabaseError)
    store.remove()
    assert not path.exists()
    assert SqliteKeys(path).marker is None  # made anew


def test_memory_and_sqlite_stores_agree_on_clears_and_open_changes(tmp_path: Path) -> None:
    rng = random.Random(11)
    stores = [MemoryKeys(), SqliteKeys(tmp_path / "k.sqlite")]
    for step in range(40):
        changes = {repr((rng.randrange(200),)): (None if rng.random() < 0.3 else (step,))
                   for _ in range(rng.randrange(1, 20))}
        cleared = frozenset(rng.sample(range(KEY_BUCKETS), 3)) if rng.random() < 0.2 \
            else frozenset()
        for s in stores:
            s.write({}, cleared)
            s.write(changes)
        probe = [repr((k,)) for k in range(200)]
        assert stores[0].lookup(probe) == stores[1].lookup(probe)
        assert sorted(stores[0].live(ALL)) == sorted(stores[1].live(ALL))
        some = frozenset(rng.sample(range(KEY_BUCKETS), 5))
        assert sorted(stores[0].live(some)) == sorted(stores[1].live(some))
        assert all(key_bucket(k) in some for k, _ in stores[1].live(some))
        keep = rng.random() < 0.7
        for s in stores:
            if keep:
                s.commit(f"{step}")
            else:
                s.rollback()
        assert sorted(stores[0].live(ALL)) == sorted(stores[1].live(ALL))


def _cache_kib(store: SqliteKeys) -> int:
    return -int(store._conn.execute("PRAGMA cache_size").fetchone()[0])


def test_key_stores_share_one_page_cache_budget(tmp_path: Path) -> None:
    mib = 2**20
    shares = CacheShares(12 * mib, most=8 * mib, least=2 * mib)
    a = SqliteKeys(tmp_path / "a.sqlite", shares)
    assert _cache_kib(a) == 8 * 1024  # alone: capped at `most`
    b = SqliteKeys(tmp_path / "b.sqlite", shares)
    assert _cache_kib(b) == 6 * 1024
    a.write({"(1,)": (1, "x", 0)})  # a's next transaction takes its new share up
    a.commit("m")
    assert _cache_kib(a) == 6 * 1024
    more = [SqliteKeys(tmp_path / f"{i}.sqlite", shares) for i in range(8)]
    assert _cache_kib(more[-1]) == 2 * 1024  # 12 MiB over 10 stores: at least `least`
    for s in more:
        s.close()
    b.close()
    assert a.lookup(["(1,)"]) == {"(1,)": (1, "x", 0)}
    a.write({"(2,)": (2, "y", 0)})
    assert _cache_kib(a) == 8 * 1024  # alone again
    a.rollback()
    # Without a budget, a store keeps a cache of its own.
    assert _cache_kib(SqliteKeys(tmp_path / "own.sqlite")) == DEFAULT_CACHE // 1024


def test_the_budget_is_a_setting_every_keyed_output_of_a_pipeline_shares(tmp_path: Path) -> None:
    from reclock.config import load_config
    from reclock.pipeline import Pipeline

    cfg = tmp_path / "p.yaml"
    cfg.write_text("housekeeping: {key_state_cache: 96MiB}\nsources:\n" + "".join(
        f"  - {{name: {n}, generator: {{kind: counter}}, outputs: [{{name: {n}, sink: file}}]}}\n"
        for n in "ab"))
    p = Pipeline(load_config(cfg))
    sa, sb = (p.settings(s) for s in p.cfg.sources)
    assert sa.key_cache is sb.key_cache is p.key_cache
    assert p.key_cache.total == 96 * 2**20
