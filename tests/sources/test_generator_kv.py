"""The ``key-value`` generator: upserts (inserts, updates, deletes) of JSON
keys and values, record ``n`` a pure function of ``(seed, n)``; checked
against a plain-Python reference of the record function, its config errors,
and end to end through the ``upsert`` envelope (with a restart in between)
against a dict replayed from the generated records, audited by ``verify``."""

from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from reclock import faults
from reclock.config import load_config
from reclock.contracts.source import ReadTask
from reclock.core.clock import SystemClock
from reclock.core.errors import DefiniteError
from reclock.pipeline import Pipeline
from reclock.sources.generator import (
    _ALPHABET,
    _CHUNK_BYTES,
    _PAYLOAD_SEED,
    _POOL,
    CHUNK,
    GeneratorReader,
    GeneratorSource,
    GeneratorSpec,
)
from reclock.verify import verify_pipeline
from tests.running import config_errors, kv_source, read_updates, running, wait_for

M64 = (1 << 64) - 1
Record = tuple[bytes, bytes | None]


# -- a reference of the record function, one record at a time in plain Python ---------------


def mix(x: int, seed: int) -> int:
    """splitmix64 on Python integers."""
    z = (x + 0x9E3779B97F4A7C15 * (seed + 1)) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


@functools.cache
def pool(seed: int, size: int) -> bytes:
    """The characters payloads are windows of."""
    return bytes(_ALPHABET[mix(i, seed + _PAYLOAD_SEED + 1) & 63] for i in range(_POOL + size))


def reference(n: int, seed: int, keys: int, delete_every: int, value_size: int) -> Record:
    """Record ``n`` as the module docstring of sources/generator.py describes it."""
    snapshot = n < keys
    key = n if snapshot else mix(n, seed) % keys
    if not snapshot and delete_every and n % delete_every == delete_every - 1:
        return f'{{"key":{key}}}'.encode(), None
    at = mix(n, seed + _PAYLOAD_SEED) % _POOL
    payload = pool(seed, value_size)[at:at + value_size]
    return (f'{{"key":{key}}}'.encode(),
            b'{"n":' + str(n).encode() + b',"payload":"' + payload + b'"}')


def generate(lo: int, hi: int, seed: int = 7, keys: int = 1000, delete_every: int = 10,
             value_size: int = 16) -> tuple[list[Record], list[pa.RecordBatch]]:
    """Records ``[lo, hi)`` read by one task of the generator, and its batches."""
    reader = GeneratorReader(GeneratorSpec("key-value", seed, keys=keys,
                                           delete_every=delete_every, value_size=value_size))
    batches = []
    for output, batch in reader.read(ReadTask("kv", 0, (lo, hi, lo, 1_000, 1000.0), hi - lo)):
        assert output == 0
        batches.append(batch)
    t = pa.Table.from_batches(batches)
    assert t.column("_src_offset").to_pylist() == list(range(lo, hi))
    return list(zip(t.column("key").to_pylist(), t.column("value").to_pylist(),
                    strict=True)), batches


def replay(records: list[Record], start: int = 0
           ) -> tuple[dict[int, tuple[int, str]], Counter[str]]:
    """The latest value per key (deletes remove it), and how many records
    were inserts, updates, deletes and deletes of an absent key."""
    state: dict[int, tuple[int, str]] = {}
    ops: Counter[str] = Counter()
    for n, (k, v) in enumerate(records, start):
        key = json.loads(k)["key"]
        if v is None:
            ops["delete" if state.pop(key, None) is not None else "delete-absent"] += 1
        else:
            value = json.loads(v)
            assert value["n"] == n
            ops["update" if key in state else "insert"] += 1
            state[key] = (n, value["payload"])
    return state, ops


# -- the record function ----------------------------------------------------------------------


def test_records_equal_the_plain_python_reference() -> None:
    for lo, hi, kw in [(0, 2_000, {}),  # the snapshot and after it
                       (CHUNK - 50, CHUNK + 50, {}),  # across a chunk boundary
                       (10**12, 10**12 + 100, {"seed": -3, "value_size": 0}),
                       (0, 300, {"keys": 7, "delete_every": 0, "value_size": 45})]:
        got, _ = generate(lo, hi, **kw)
        args = {"seed": 7, "keys": 1000, "delete_every": 10, "value_size": 16, **kw}
        assert got == [reference(n, **args) for n in range(lo, hi)], (lo, hi, kw)


def test_large_values_make_short_chunks_of_the_same_records() -> None:
    size = 100_000
    got, batches = generate(0, 400, keys=50, value_size=size)
    per_chunk = _CHUNK_BYTES // (size + 32)
    assert [b.num_rows for b in batches] == [per_chunk, per_chunk, 400 - 2 * per_chunk]
    assert got == [reference(n, 7, 50, 10, size) for n in range(400)]
    assert all(v is None or len(v) == size + len(f'{{"n":{n},"payload":""}}')
               for n, (_, v) in enumerate(got))


def test_same_seed_same_records_different_seed_different() -> None:
    whole, _ = generate(0, 5_000)
    # any split into tasks (a restart from any resume upper) makes the same records
    assert generate(0, 1_234)[0] + generate(1_234, 4_321)[0] + generate(4_321, 5_000)[0] == whole
    assert generate(0, 5_000)[0] == whole
    other, _ = generate(0, 5_000, seed=8)
    # the snapshot inserts the same keys with other payloads; later keys differ too
    assert [k for k, _ in other[:1000]] == [k for k, _ in whole[:1000]]
    assert all(a[1] != b[1] for a, b in zip(whole[:1000], other[:1000], strict=True))
    differ = sum(a[0] != b[0] for a, b in zip(whole[1000:], other[1000:], strict=True))
    assert differ > 0.99 * 4_000, differ


def test_the_mix_of_inserts_updates_and_deletes() -> None:
    total, keys, every = 20_000, 1_000, 10
    records, _ = generate(0, total, keys=keys, delete_every=every)
    state, ops = replay(records)
    # the first `keys` records insert every key once
    assert replay(records[:keys])[1] == Counter(insert=keys)
    deletes = sum(1 for n in range(keys, total) if n % every == every - 1)
    assert deletes == 1_900
    assert ops["delete"] + ops["delete-absent"] == deletes
    assert ops["insert"] + ops["update"] == total - deletes
    # deleted keys come back (inserts after the snapshot); most deletes hit a live key
    assert ops["insert"] > keys and ops["delete-absent"] > 0
    assert ops["delete"] > 0.8 * deletes and ops["update"] > 10 * ops["insert"] // 2
    assert 0.8 * keys < len(state) < keys
    # updates spread over the keys
    hits = Counter(json.loads(k)["key"] for k, _ in records[keys:])
    assert len(hits) == keys and max(hits.values()) < 3 * (total - keys) / keys
    # no deletes: every key stays live
    state, ops = replay(generate(0, 5_000, keys=100, delete_every=0)[0])
    assert len(state) == 100 and ops == Counter(insert=100, update=4_900)


def test_one_output_only() -> None:
    with pytest.raises(DefiniteError, match="a key-value generator has exactly one output"):
        GeneratorSource("kv", clock=SystemClock(), kind="key-value", output_names=["a", "b"])
    assert [o.name for o in GeneratorSource("kv", clock=SystemClock(), kind="key-value",
                                            output_names=["kv"]).outputs()] == ["kv"]


# -- configuration ----------------------------------------------------------------------------


def test_config_errors_are_located(tmp_path: Path) -> None:
    assert config_errors(tmp_path, """
        sources:
          - name: a
            generator: {kind: key-value, value_format: csv, bad_every: 2}
            outputs: [{name: v, sink: file}]
          - name: b
            generator: {kind: key-value, keys: 0, delete_every: -1, value_size: 2000000}
            outputs: [{name: v, sink: file}]
          - name: c
            generator: {kind: counter, keys: 5, delete_every: 3, value_size: 10}
            outputs: [{name: v, sink: file}]
          - name: d
            generator: {kind: orders, keys: 5}
            outputs: [{name: orders, sink: file}, {name: customers, sink: file}]
          - name: e
            generator: {kind: key_value}
            outputs: [{name: v, sink: file}]
        """) == [
        (3, "sources[0].generator.value_format", "only applies to kind 'counter'"),
        (3, "sources[0].generator.bad_every", "only applies to kind 'counter'"),
        (6, "sources[1].generator.keys", "expected a number >= 1"),
        (6, "sources[1].generator.delete_every", "expected a number >= 0"),
        (6, "sources[1].generator.value_size", "expected a number <= 1048576"),
        (9, "sources[2].generator.keys", "only applies to kind 'key-value'"),
        (9, "sources[2].generator.delete_every", "only applies to kind 'key-value'"),
        (9, "sources[2].generator.value_size", "only applies to kind 'key-value'"),
        (12, "sources[3].generator.keys", "only applies to kind 'key-value'"),
        (15, "sources[4].generator.kind", "expected 'counter', 'orders', 'key-value' or 'auction'"),
    ]


# -- end to end -------------------------------------------------------------------------------

TOTAL, KEYS, EVERY, SIZE, SEED = 5_000, 300, 7, 24, 11
PIPELINE = f"""
timestamp_interval: 200ms
spark: {{max_bytes_per_settle: 16KiB}}
sources:
{kv_source(KEYS, SEED, 1000, TOTAL, EVERY, SIZE)}"""


def test_an_upsert_output_ends_equal_to_the_replayed_records(tmp_path: Path, spark: Any) -> None:
    """Jobs' intents are settled in rounds of a few key buckets (a 16 KiB
    budget), the larger ones written to files by the tasks; a failed stage
    and a failed commit in the middle lose nothing."""
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE)
    cfg = load_config(path)
    # Python workers started (run alone, the first job would take seconds, and
    # the generator's clock would run past the end meanwhile)
    spark.sparkContext.parallelize(range(4), 2).map(lambda x: x).collect()
    # stopped part way, then started again: the generator makes the same
    # records from the resume upper and the key state is read back from its
    # store, which a clean stop left at the output's committed version
    with running(cfg, spark) as runners:
        wait_for(lambda: runners[0].records >= TOTAL // 5, what="a fifth of the records")
    assert 0 < runners[0].records < TOTAL
    faults.arm("stage:2,commit:1")
    try:
        with running(cfg, spark) as runners:
            r = runners[0]
            wait_for(lambda: r.health.status == "finished", 60, lambda: f"the end: {r.status()}")
    finally:
        faults.disarm()
    injected = [e for e in r.events.recent
                if e["kind"] == "health" and "InjectedFault" in str(e.get("error"))]
    assert len(injected) >= 2, injected  # the stage (twice in a row) and the commit
    opened = [e.get("keys") for e in r.events.recent if e["kind"] == "open"]
    assert opened[0] == {"state": "reused"}, opened
    keys = Pipeline(cfg).state_dir / "keys" / "kv"
    assert (keys / "state.sqlite").exists()
    assert not list((keys / "spill").glob("*/*")), "intents written for a job are removed"
    t = read_updates(cfg, "kv", "state")
    assert t.filter(pc.invert(pc.is_null(t.column("_error")))).num_rows == 0
    net: Counter[tuple[int, int, str]] = Counter()
    for key, n, payload, diff in zip(*(t.column(c).to_pylist()
                                       for c in ("key", "n", "payload", "_diff")), strict=True):
        net[key, n, payload] += diff
    assert all(d in (0, 1) for d in net.values()), [x for x in net.items() if x[1] not in (0, 1)]
    got = {key: (n, payload) for (key, n, payload), d in net.items() if d}
    model, ops = replay(generate(0, TOTAL, seed=SEED, keys=KEYS, delete_every=EVERY,
                                 value_size=SIZE)[0])
    assert ops["delete"] > 0 and ops["update"] > 0 and ops["insert"] > KEYS
    assert got == model
    reports = verify_pipeline(cfg)
    assert all(rep.ok for rep in reports), [(o.breaches, o.samples) for o in reports[0].outputs]
    assert reports[0].complete_checked == TOTAL, (reports[0].complete_checked, reports[0].notes)
