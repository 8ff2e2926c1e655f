"""One-shot loads without Spark: byte ranges of text files cut at line
starts (every line read once, by the range it starts in), the plan of a
load, and the config's checks."""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from reclock.core.clock import ManualClock
from reclock.core.frontier import Antichain
from reclock.core.time import Counter
from reclock.sources.oneshot.files import Store
from reclock.sources.oneshot.source import OneShotConfig, OneShotSource, lines_of


def test_ranges_read_every_line_once(tmp_path: Path) -> None:
    rng = random.Random(7)
    p = tmp_path / "a.txt"
    for _ in range(300):
        lines = [rng.choice([b"", b"x" * rng.randint(1, 12), b"y,z\r"])
                 for _ in range(rng.randint(0, 30))]
        data = b"\n".join(lines) + (b"\n" if rng.random() < 0.5 else b"")
        p.write_bytes(data)
        (f,) = Store().files(str(p))
        split = rng.randint(1, 20)
        got: list[bytes] = []
        for a in range(0, max(f.size, 1), split):
            got += lines_of(Store(), f, a, min(f.size, a + split)).to_pylist()
        want = [ln.removesuffix(b"\r") for ln in data.split(b"\n")]
        if data.endswith(b"\n") or not data:
            want = want[:-1]
        assert got == want, (data, split)


def test_plan_one_load_per_position(tmp_path: Path) -> None:
    d = tmp_path / "in"
    d.mkdir()
    for i in range(3):
        pq.write_table(pa.table({"id": list(range(1000))}), d / f"{i}.parquet",
                       row_group_size=250)
    src = OneShotSource("s", clock=ManualClock(1000), state_dir=tmp_path / "state",
                        format="parquet", columns={"id": "int64"}, split_size=4096,
                        output_names=["out"])
    src.open(Antichain.from_elem(Counter(0)), Antichain.from_elem(Counter(0)))
    req = src.describe("out", str(d / "*.parquet"), None)
    src.ledger.request(req, 1000)
    src.ledger.request(req, 1001)  # identical: skipped by the probe
    assert src.probe() == Antichain.from_elem(Counter(1))
    assert src.probe() == Antichain.from_elem(Counter(1))
    assert src.ledger.skipped(src.ledger.requests()[0]["id"]) is None  # the first is kept
    tasks, reached = src.plan(Antichain.from_elem(Counter(0)), Antichain.from_elem(Counter(1)),
                              10, 10)
    assert reached == Antichain.from_elem(Counter(1)) and len(tasks) > 1
    assert sum(t.records for t in tasks) == 3000
    rows = sum(b.num_rows for t in tasks for _, b in src.reader().read(t))
    assert rows == 3000
    src.acknowledge(Antichain.from_elem(Counter(1)))
    assert src.ledger.requests() == []


def test_config_checks() -> None:
    with pytest.raises(ValidationError, match="columns"):
        OneShotConfig.model_validate({"format": "parquet"})
    with pytest.raises(ValidationError, match="header"):
        OneShotConfig.model_validate({"format": "jsonl", "header": True})
    assert OneShotConfig.model_validate({"format": "csv", "header": True}).header


def test_schema_from_a_parquet_file_is_pinned(tmp_path: Path) -> None:
    f = tmp_path / "first.parquet"
    pq.write_table(pa.table({"id": pa.array([1], pa.int64()), "when": pa.array(
        [1], pa.timestamp("ms")), "tags": pa.array([["a"]])}), f)
    cfg = OneShotConfig.model_validate({"format": "parquet", "schema_from": str(f)})
    state = tmp_path / "state"

    def build() -> OneShotSource:
        return OneShotSource("s", clock=ManualClock(0), state_dir=state, format="parquet",
                             output_names=["out"], schema_from=cfg.schema_from)

    want = pa.schema([("id", pa.int64()), ("when", pa.timestamp("ms")),
                      ("tags", pa.list_(pa.string()))])
    (spec,) = build().outputs()
    assert spec.typed and spec.schema == want
    pq.write_table(pa.table({"other": [1]}), f)  # the file changes: the outputs do not
    assert build().outputs()[0].schema == want
    with pytest.raises(ValidationError, match="schema_from"):
        OneShotConfig.model_validate({"format": "parquet", "schema_from": "x",
                                      "columns": {"id": "int64"}})


def test_positions_are_fixed_by_the_load(tmp_path: Path) -> None:
    """A load re-read after the source's split_size or header changed (as
    verify does) yields the same records at the same positions."""
    f = tmp_path / "a.csv"
    f.write_text("h1,h2\n" + "".join(f"{i},{'x' * (i % 50)}\n" for i in range(2000)))

    def source(split: int, header: bool) -> OneShotSource:
        return OneShotSource("s", clock=ManualClock(0), state_dir=tmp_path / "state",
                             format="csv", header=header, split_size=split,
                             output_names=["out"])

    def records(src: OneShotSource) -> list[tuple[int, int, int, bytes]]:
        tasks, _ = src.plan(Antichain.from_elem(Counter(0)), Antichain.from_elem(Counter(1)),
                            100, 10_000)
        out = []
        for t in tasks:
            for _, b in src.reader().read(t):
                out += list(zip(*(b.column(c).to_pylist() for c in
                                  ("_src_part", "_src_offset", "_src_seq", "value")),
                                strict=True))
        return sorted(out)

    first = source(4096, True)
    first.open(Antichain.from_elem(Counter(0)), Antichain.from_elem(Counter(0)))
    first.ledger.request(first.describe("out", str(f), "csv"), 0)
    assert first.probe() == Antichain.from_elem(Counter(1))
    before = records(first)
    assert len(before) == 2000 and len({r[0] for r in before}) > 1
    assert records(source(65536, False)) == before


def _csv_text(rng: random.Random, rows: int, stray: bool) -> bytes:
    """Random CSV: plain and quoted fields holding delimiters, newlines and
    doubled quotes; with ``stray``, also quotes a well-formed file has not
    (inside a plain field, after a closing one)."""
    def field() -> str:
        r = rng.random()
        if r < 0.4:
            return "".join(rng.choice("ab 1") for _ in range(rng.randint(0, 4)))
        if r < 0.8 or not stray:
            body = "".join(rng.choice(['a', ',', '\n', '""', '\r\n', ' ']) for _ in
                           range(rng.randint(0, 5)))
            return f'"{body}"'
        return rng.choice(['a"b', '"ab"c', 'x""', '"'])
    lines = [",".join(field() for _ in range(rng.randint(1, 4))) for _ in range(rows)]
    return ("\n".join(lines) + ("\n" if rng.random() < 0.7 else "")).encode()


def csv_records(data: bytes) -> list[tuple[list[str], bytes]]:
    """Python's csv module's records: each row, and the raw bytes it spans
    (without the newline that ends it)."""
    import csv
    import io

    lines = io.StringIO(data.decode(), newline="").readlines()
    used = 0

    def feed() -> Any:
        nonlocal used
        while used < len(lines):
            used += 1
            yield lines[used - 1]

    out: list[tuple[list[str], bytes]] = []
    done = 0
    for row in csv.reader(feed()):
        text = "".join(lines[done:used]).encode()
        done = used
        if used == len(lines) and len(list(csv.reader(io.StringIO(
                (text + b"x\n").decode(), newline="")))) == 1:
            out.append((row, text))  # a quote never closed: the rest of the file, as it is
        else:
            out.append((row, text.removesuffix(b"\n").removesuffix(b"\r")))
    return out


@pytest.mark.parametrize("stray", [False, True])
def test_csv_records_with_quoted_newlines(tmp_path: Path, stray: bool) -> None:
    """Records end at newlines outside quotes as Python's csv reads them
    (the fast path and the quote-by-quote one alike), and byte ranges that
    start at :func:`record_starts` read every record once, whole."""
    import numpy as np

    from reclock.sources.oneshot.records import NL, _exact, record_ends, record_starts, records

    rng = random.Random(11 if stray else 3)
    p = tmp_path / "a.csv"
    for _ in range(100):
        data = _csv_text(rng, rng.randint(0, 40), stray)
        want = [raw for _, raw in csv_records(data)]
        assert records(data, b",") == want, data
        arr = np.frombuffer(data, np.uint8)
        fast = record_ends(data, b",")
        slow = _exact(data, arr, np.flatnonzero(arr == NL), np.flatnonzero(arr == ord('"')),
                      b",", ord('"'), False, NL)
        assert fast[0].tolist() == slow[0].tolist() and fast[1] == slow[1], data
        p.write_bytes(data)
        (f,) = Store().files(str(p))
        split = rng.randint(1, 60)
        starts = record_starts(functools.partial(Store().read_range, f), f.size, split, b",")
        got: list[bytes] = []
        for a, b in zip(starts, [*starts[1:], f.size], strict=True):
            got += records(Store().read_range(f, a, b), b",")
        assert got == records(data, b","), (data, split, starts)
        assert starts == sorted(set(starts))


def test_cancelled_loads_hold_nothing(tmp_path: Path) -> None:
    """A cancel before the probe skips the request; a load in the ledger is
    found cancelled by the driver's next plan (only by a driver's: a re-read
    before that decision still reads it), which reads nothing from then on,
    for every reader; a task planned before the cancel stops; a cancelled
    load matches no later request."""
    from reclock.core.errors import TransientError, classified, classify
    from reclock.sources.oneshot.source import LoadCancelled

    f = tmp_path / "a.csv"
    f.write_text("".join(f"{i},x\n" for i in range(100)))

    def source() -> OneShotSource:
        return OneShotSource("s", clock=ManualClock(0), state_dir=tmp_path / "state",
                             format="csv", output_names=["out"])

    def plan(src: OneShotSource, k: int) -> list[Any]:
        tasks, reached = src.plan(Antichain.from_elem(Counter(k)),
                                  Antichain.from_elem(Counter(k + 1)), 1000, 1000)
        assert reached == Antichain.from_elem(Counter(k + 1))
        return tasks

    driver = source()
    driver.open(Antichain.from_elem(Counter(0)), Antichain.from_elem(Counter(0)))
    req = driver.describe("out", str(f), "csv")
    first = driver.ledger.request(req, 0)
    driver.ledger.cancel(first, 1)
    assert driver.probe() == Antichain.from_elem(Counter(0))  # skipped
    assert driver.status_of(first) == ("cancelled", None)
    second = driver.ledger.request(req, 2)
    assert driver.probe() == Antichain.from_elem(Counter(1))
    driver.ledger.cancel(second, 3)
    assert plan(source(), 0)  # not decided yet: a re-read still reads it
    assert plan(driver, 0) == [] and driver.status_of(second) == ("cancelled", 0)
    assert plan(source(), 0) == []  # decided, for good
    assert driver.ledger.same_as(req["fingerprint"]) is None
    third = driver.ledger.request(req, 4)
    assert driver.probe() == Antichain.from_elem(Counter(2))
    (task,) = plan(driver, 1)
    assert sum(b.num_rows for _, b in driver.reader().read(task)) == 100
    driver.ledger.cancel(third, 5)
    with pytest.raises(LoadCancelled, match="load #1 was cancelled") as info:
        list(driver.reader().read(task))

    class PythonException(Exception):  # how PySpark hands the driver a task's exception
        pass

    failed = PythonException(f"An exception was thrown from the Python worker: {info.value}")
    assert classified(failed) and isinstance(classify(failed), TransientError)
