"""A damaged key-state file heals itself: it is rebuilt from the output,
with an event saying so, and the source never stalls on it.

Issue: 32 KiB overwritten in the middle of ``keys/<source>/<output>.sqlite``
halted a keyed source. The file was reused because its marker row still
read; every settle then failed with ``database disk image is malformed``,
classified as transient, and the source retried forever.

Damage is found at two moments: when the driver opens the file (checked
before it is reused) and while it runs (a page read during settle or the
key commit). Either way the file is discarded and rebuilt from the output;
the job in progress was not committed, so it is read and settled again:
nothing is lost and nothing doubled. The outputs are compared with a plain
dictionary replay of the generated records (the final value per key).
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest

from reclock import faults
from reclock.config import load_config
from reclock.pipeline import Pipeline
from reclock.runtime.driver import SourceRunner
from reclock.verify import verify_pipeline
from tests.running import (
    close_driver,
    read_updates,
    running,
    start_driver,
    status_sources,
    wait_for,
    wait_running,
)
from tests.sources.test_generator_kv import generate, replay

pytestmark = pytest.mark.integration

# 20,000 keys of ~250 bytes: a key file of several MiB, eight times the
# 1 MiB page cache of its store, so that pages are read from the file again
# while the driver runs (damage done then is met, not hidden by the cache)
TOTAL, KEYS, EVERY, SIZE, SEED = 60_000, 20_000, 9, 200, 5
PIPELINE = f"""
timestamp_interval: 200ms
housekeeping: {{key_state_cache: 1MiB}}
spark: {{max_records_per_job: 8000}}
sources:
  - name: kv
    generator: {{kind: key-value, keys: {KEYS}, seed: {SEED}, rate: {{RATE}},
                 max_records: {TOTAL}, delete_every: {EVERY}, value_size: {SIZE}}}
    outputs:
      - name: state
        format: {{type: json, schema: {{n: int64, payload: string}}}}
        key_format: {{type: json, schema: {{key: int64}}}}
        envelope: {{type: upsert, key: [key]}}
        sink: file
"""


def _config(tmp_path: Path, rate: int) -> Any:
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE.replace("{RATE}", str(rate)))
    return load_config(path)


def _key_file(cfg: Any) -> Path:
    return Pipeline(cfg).state_dir / "keys" / "kv" / "state.sqlite"


def _committed(r: SourceRunner) -> int:
    """Records the output holds (its progress: the next generator counter)."""
    held = r.outputs[0].state.held(r.source.kind)
    if held is None:
        return 0
    at = held.as_option()
    return TOTAL if at is None else int(at)


def _overwrite_middle(path: Path, nbytes: int = 32 * 1024) -> int:
    """Overwrite ``nbytes`` in the middle of ``path`` (page-aligned) with
    fixed pseudo-random bytes; returns the offset."""
    size = path.stat().st_size
    assert size > 4 * nbytes, f"{path} is too small to damage in the middle ({size} bytes)"
    at = (size // 2) // 4096 * 4096
    with path.open("r+b") as f:
        f.seek(at)
        f.write(random.Random(at).randbytes(nbytes))
    return at


def _check_output(cfg: Any) -> None:
    """The output holds each key's final value once, as a replay of the
    generated records says, and nothing else; verify agrees."""
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
    assert ops["delete"] > 0 and ops["update"] > 0
    assert got == model
    reports = verify_pipeline(cfg)
    assert all(rep.ok for rep in reports), [(o.breaches, o.samples) for o in reports[0].outputs]


def _rebuilds(r: SourceRunner) -> list[dict[str, Any]]:
    return [e for e in r.events.recent if e["kind"] == "keys_rebuilt"]


def _warm(spark: Any) -> None:
    # Python workers started (run alone, the first job would take seconds,
    # and the generator's clock would run past the first stop meanwhile)
    spark.sparkContext.parallelize(range(4), 2).map(lambda x: x).collect()


def _first_part(cfg: Any, spark: Any, upto: int) -> None:
    """Run until the output holds at least ``upto`` records, then stop cleanly."""
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: _committed(r) >= upto, 120, lambda: f"{upto} records: {r.status()}")
    assert _committed(r) < TOTAL, "the first part ran to the end: nothing left to settle"


def _finish(cfg: Any, spark: Any) -> SourceRunner:
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: r.health.status == "finished", 120,
                 lambda: f"the end: {r.health} {[e for e in r.events.recent][-5:]}")
    return r


@pytest.mark.parametrize("summed", [True, False], ids=["checksum", "no-checksum"])
def test_a_key_file_damaged_while_stopped_is_rebuilt_at_open(
    tmp_path: Path, spark: Any, summed: bool
) -> None:
    """The reported failure: 32 KiB overwritten in the middle of the key
    file of a stopped driver. The marker still reads, but the file fails its
    check at open (the checksum its clean close kept; without one, as a file
    of an older version, quick_check): it is rebuilt from the output (an
    event names the source, output, file and reason) and the source
    finishes with every key right."""
    cfg = _config(tmp_path, rate=4_000)
    _warm(spark)
    _first_part(cfg, spark, KEYS + 5_000)
    path = _key_file(cfg)
    assert path.exists() and not Path(f"{path}-wal").exists()  # a clean stop
    if not summed:
        Path(f"{path}.sum").unlink()
    _overwrite_middle(path)
    r = _finish(cfg, spark)
    rebuilt = _rebuilds(r)
    assert len(rebuilt) == 1, rebuilt
    ev = rebuilt[0]
    assert ev["source"] == "kv" and ev["output"] == "state" and ev["file"] == str(path)
    assert ev["reason"].startswith("damaged: "), ev
    assert ("bytes changed since it was closed" if summed else "quick_check") in ev["reason"]
    assert next(e.get("keys") for e in r.events.recent if e["kind"] == "open") == {
        "state": "rebuilt"}
    _never_stalled_on_sqlite(r)
    _check_output(cfg)


def test_a_crashed_driver_whose_wal_file_is_gone_rebuilds_its_key_state(
    tmp_path: Path, spark: Any
) -> None:
    """A driver killed (kill -9) with its key file open leaves the file's
    -wal file; when that is lost too (the file copied alone, a clean-up),
    the file may hold part of its last transactions whatever its marker
    says: the next driver rebuilds the key state, never reuses it, never
    stalls, and the output ends right."""
    cfg = _config(tmp_path, rate=3_000)
    _warm(spark)
    state = Pipeline(cfg).state_dir
    path = _key_file(cfg)
    proc = start_driver(tmp_path / "pipeline.yaml")
    try:
        assert wait_running(state, proc), "the driver exited"
        wait_for(lambda: _read_from(state) >= KEYS + 2_000, 120,
                 lambda: f"records committed: {status_sources(state)}")
    finally:
        proc.kill()
        proc.wait()
        close_driver(proc)
    assert _read_from(state) < TOTAL, "the driver ran to the end before it was killed"
    wal = Path(f"{path}-wal")
    assert wal.exists()  # as kill -9 leaves it
    wal.unlink()
    Path(f"{path}-shm").unlink(missing_ok=True)
    r = _finish(cfg, spark)
    rebuilt = _rebuilds(r)
    assert len(rebuilt) == 1, rebuilt
    ev = rebuilt[0]
    assert ev["output"] == "state" and ev["file"] == str(path)
    assert ev["reason"].startswith("damaged: ") and "-wal" in ev["reason"], ev
    _never_stalled_on_sqlite(r)
    _check_output(cfg)


def _read_from(state: Path) -> int:
    """Where a driver process's source reads from (what its outputs hold)."""
    src = status_sources(state).get("kv")
    at = None if src is None else src.get("read_from")
    return 0 if not at else int(at[0])


def test_a_key_file_damaged_while_running_is_rebuilt_and_the_job_settled_again(
    tmp_path: Path, spark: Any
) -> None:
    """32 KiB overwritten in the middle of the key file while the driver
    runs: a settle meets a malformed page (a definite fault of the file, not
    a transient error retried forever). The file is thrown away, the source
    re-opens, the key state is rebuilt from the output and the job that was
    being settled, never committed, is read and settled again: the output
    ends with every key's final value once."""
    cfg = _config(tmp_path, rate=3_000)
    _warm(spark)
    path = _key_file(cfg)
    with running(cfg, spark) as runners:
        r = runners[0]
        wait_for(lambda: _committed(r) >= KEYS + 2_000, 120,
                 lambda: f"the snapshot committed: {r.status()}")
        assert _committed(r) < TOTAL - 20_000, "too little left to settle after the damage"
        _overwrite_middle(path)
        wait_for(lambda: r.health.status == "finished", 180,
                 lambda: f"the end: {r.health} {list(r.events.recent)[-5:]}")
    rebuilt = _rebuilds(r)
    assert rebuilt and rebuilt[0]["reason"] == "no key state saved yet", rebuilt
    damaged = rebuilt[1:]
    assert len(damaged) == 1, rebuilt
    ev = damaged[0]
    assert ev["source"] == "kv" and ev["output"] == "state" and ev["file"] == str(path)
    assert "damaged" in ev["reason"] and "malformed" in ev["reason"], ev
    assert "settling a job" in ev["reason"] or "saving the key state" in ev["reason"], ev
    _never_stalled_on_sqlite(r)
    _check_output(cfg)


def test_damage_again_before_any_commit_is_a_definite_error_then_heals(
    tmp_path: Path, spark: Any
) -> None:
    """A disk that damages the key file again right after it was rebuilt
    (``RECLOCK_FAIL_AT=damage_keys:2``: 32 KiB in the middle overwritten
    before two settles in a row) does not loop fast on rebuilds: the second
    damage, before any commit since the first rebuild, stalls the source
    with a definite error that points at the disk; the retry rebuilds again
    and, the disk sound now, the source finishes with every key right."""
    cfg = _config(tmp_path, rate=3_000)
    _warm(spark)
    try:
        with running(cfg, spark) as runners:
            r = runners[0]
            wait_for(lambda: _committed(r) >= KEYS + 2_000, 120,
                     lambda: f"the snapshot committed: {r.status()}")
            assert _committed(r) < TOTAL - 20_000, "too little left to settle after the damage"
            faults.arm("damage_keys:2")
            wait_for(lambda: r.health.status == "finished", 180,
                     lambda: f"the end: {r.health} {list(r.events.recent)[-5:]}")
    finally:
        faults.disarm()
    reasons = [e["reason"] for e in _rebuilds(r)]
    assert reasons[0] == "no key state saved yet" and len(reasons) == 3, reasons
    assert all(w.startswith("damaged: ") and "malformed" in w for w in reasons[1:]), reasons
    stalls = [e for e in r.events.recent if e["kind"] == "health" and e.get("error")]
    assert [e["error"].split(":")[0] for e in stalls] == ["Reopen", "DefiniteError"], stalls
    assert "damaged again" in stalls[1]["error"] and "disk" in stalls[1]["hint"], stalls
    _check_output(cfg)


def _never_stalled_on_sqlite(r: SourceRunner) -> None:
    """No stall on a SQLite error as such (the old failure: ``DatabaseError:
    database disk image is malformed (transient)``, forever); at most the
    one re-open that rebuilds a damaged key state."""
    errors = [e["error"] for e in r.events.recent if e["kind"] == "health" and e.get("error")]
    assert not [e for e in errors if "DatabaseError" in e or "KeyStateDamaged" in e], errors
    assert all(e.startswith("Reopen:") and "is damaged" in e for e in errors), errors
    assert len(errors) <= 1, errors
