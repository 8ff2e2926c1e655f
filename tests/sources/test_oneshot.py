"""One-shot loads (``reclock load``) on Spark, against models of the files
computed here with Python's csv and json modules and pyarrow.parquet: every
load lands at one IntoTime, once; an identical request is a no-op unless
forced; a driver killed before the load's commit leaves the output as it was
and the rerun loads it once; S3 and globs."""

from __future__ import annotations

import functools
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from reclock.config import load_config
from reclock.core.columns import ERROR, INTO_TIME, RAW_VALUE, SRC_OFFSET
from reclock.load import load
from reclock.verify import verify_pipeline
from tests.running import crash_env, read_updates, running, start_driver, wait_exit, wait_for
from tests.sources.test_oneshot_split import csv_records

pytestmark = pytest.mark.integration

PIPELINE = """
state_dir: {state}
timestamp_interval: 200ms
progress_log: true
sources:
  - name: people
    oneshot: {{format: csv, header: true, split_size: 4096}}
    outputs:
      - name: people
        format: {{type: csv, columns: [id, name, score], types: {{id: int64, score: float64}}}}
        sink: file
  - name: events
    oneshot: {{format: jsonl, split_size: 4096}}
    outputs:
      - name: events
        format: {{type: json, schema: {{id: int64, kind: string}}}}
        sink: file
  - name: facts
    oneshot: {{format: parquet, columns: {{id: int64, v: float64, tag: string}}, split_size: 4096}}
    outputs:
      - name: facts
        sink: file
"""


def _write(tmp: Path, state: Path) -> Path:
    p = tmp / "pipeline.yaml"
    p.write_text(PIPELINE.format(state=state))
    return p


# -- the files and their models (plain Python) ---------------------------------------------


def csv_files(d: Path, n_files: int = 3, rows: int = 400) -> None:
    """CSV files with a header, bad rows, and quoted fields holding newlines,
    commas and quotes (one of them across the first split boundary, 4096)."""
    d.mkdir(parents=True, exist_ok=True)
    for f in range(n_files):
        lines = ["id,name,score"]
        size = len(lines[0]) + 1
        straddled = False
        for i in range(rows):
            rid = f * rows + i
            if i % 97 == 13:
                lines.append(f"{rid},only-two")  # wrong number of fields
            elif i % 89 == 7:
                lines.append(f"x{rid},bad-id,1.5")  # id does not convert
            elif i % 53 == 9:
                lines.append(f'"{rid}\nx",bad-quoted-id,2.5')  # a bad row over two lines
            elif i % 11 == 3 or (not straddled and size > 4000):
                long = "x" * (150 if size > 4000 and not straddled else 3)
                straddled = straddled or size > 4000
                lines.append(f'{rid},"name {rid},\n""{long}""\nend",{rid / 4}')
            else:
                lines.append(f"{rid},name-{rid},{rid / 4}")
            size += len(lines[-1]) + 1
        text = "\n".join(lines) + "\n"
        at = text.index("x" * 150)
        assert at < 4096 < text.index("end", at)  # a quoted newline across the boundary
        (d / f"people-{f}.csv").write_text(text)


def csv_model(paths: list[Path]) -> tuple[list[tuple[Any, ...]], list[bytes]]:
    good, bad = [], []
    for p in paths:
        for rec, raw in csv_records(p.read_bytes())[1:]:
            try:
                if len(rec) != 3:
                    raise ValueError
                good.append((int(rec[0]), rec[1], float(rec[2])))
            except ValueError:
                bad.append(raw)
    return good, bad


def jsonl_files(d: Path, n_files: int = 2, rows: int = 500) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for f in range(n_files):
        lines = []
        for i in range(rows):
            rid = f * rows + i
            lines.append('{"id": oops' if i % 71 == 5
                         else json.dumps({"id": rid, "kind": ["a", "b", "c"][rid % 3]}))
        (d / f"events-{f}.jsonl").write_text("\n".join(lines) + "\n")


def jsonl_model(paths: list[Path]) -> tuple[list[tuple[Any, ...]], list[bytes]]:
    good, bad = [], []
    for p in paths:
        for line in p.read_text().splitlines():
            try:
                doc = json.loads(line)
                good.append((doc["id"], doc["kind"]))
            except ValueError:
                bad.append(line.encode())
    return good, bad


def parquet_files(d: Path, n_files: int = 2, rows: int = 3000) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for f in range(n_files):
        ids = list(range(f * rows, (f + 1) * rows))
        t = pa.table({"id": ids, "v": [i * 0.5 for i in ids],
                      "tag": [f"t{i % 7}" for i in ids], "ignored": ids})
        pq.write_table(t, d / f"facts-{f}.parquet", row_group_size=700)


def parquet_model(paths: list[Path]) -> list[tuple[Any, ...]]:
    out = []
    for p in paths:
        t = pq.read_table(p)
        assert pq.ParquetFile(p).metadata.num_row_groups > 1
        out += list(zip(t.column("id").to_pylist(), t.column("v").to_pylist(),
                        t.column("tag").to_pylist(), strict=True))
    return out


# -- checks -----------------------------------------------------------------------------


def _held(cfg: Any, source: str, cols: list[str], position: int | None = None
          ) -> tuple[list[tuple[Any, ...]], list[bytes], set[int]]:
    """Data rows, error rows' raw bytes and the IntoTimes of one output (of
    one load's position)."""
    t = read_updates(cfg, source, source)
    if position is not None:
        t = t.filter(pc.equal(t.column(SRC_OFFSET), position))
    ok = t.filter(pc.is_null(t.column(ERROR)))
    err = t.filter(pc.is_valid(t.column(ERROR)))
    rows = list(zip(*(ok.column(c).to_pylist() for c in cols), strict=True)) if ok.num_rows \
        else []
    return rows, err.column(RAW_VALUE).to_pylist(), set(t.column(INTO_TIME).to_pylist())


def _tasks(state: Path, source: str) -> list[int]:
    out = []
    for line in (state / "progress.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["source"] == source and e["kind"] == "read" and e.get("tasks"):
            out.append(int(e["tasks"]))
    return out


def test_loads_land_once_at_one_into_time(tmp_path: Path, spark: Any) -> None:
    t0 = time.monotonic()
    state = tmp_path / "state"
    data = tmp_path / "data"
    csv_files(data / "csv")
    jsonl_files(data / "jsonl")
    parquet_files(data / "parquet")
    cfg = load_config(_write(tmp_path, state))
    people = sorted((data / "csv").glob("*.csv"))
    exp_people, exp_bad = csv_model(people)
    exp_events, exp_ebad = jsonl_model(sorted((data / "jsonl").glob("*.jsonl")))
    exp_facts = parquet_model(sorted((data / "parquet").glob("*.parquet")))
    with running(cfg, spark):
        # a directory of CSV files with a header and bad rows
        r = load(cfg, "people", "people", str(data / "csv"), "csv", wait=True, timeout_s=60)
        assert (r.state, r.position, r.files) == ("loaded", 0, 3)
        assert (r.rows, r.errors) == (len(exp_people), len(exp_bad))
        rows, bad, into = _held(cfg, "people", ["id", "name", "score"])
        assert sorted(rows) == sorted(exp_people) and sorted(bad) == sorted(exp_bad)
        assert into == {r.into_time}
        # a glob of JSON lines
        e = load(cfg, "events", "events", str(data / "jsonl" / "events-*.jsonl"), wait=True,
                 timeout_s=60)
        assert (e.state, e.files, e.rows, e.errors) == ("loaded", 2, len(exp_events),
                                                        len(exp_ebad))
        rows, bad, into = _held(cfg, "events", ["id", "kind"])
        assert sorted(rows) == sorted(exp_events) and sorted(bad) == sorted(exp_ebad)
        assert into == {e.into_time}
        # Parquet with several row groups
        f = load(cfg, "facts", "facts", str(data / "parquet"), wait=True, timeout_s=60)
        assert (f.state, f.files, f.rows, f.errors) == ("loaded", 2, len(exp_facts), 0)
        rows, _, into = _held(cfg, "facts", ["id", "v", "tag"])
        assert sorted(rows) == sorted(exp_facts) and into == {f.into_time}
        # every load was split into parallel tasks
        assert max(_tasks(state, "people")) > 1 and max(_tasks(state, "facts")) > 1
        # the same request again: nothing to do
        again = load(cfg, "people", "people", str(data / "csv"), wait=True, timeout_s=60)
        assert (again.state, again.position, again.into_time) == ("already loaded", 0,
                                                                   r.into_time)
        assert len(_held(cfg, "people", ["id"])[0]) == len(exp_people)
        # a changed file makes it another load; --force loads the same again
        forced = load(cfg, "people", "people", str(data / "csv"), force=True, wait=True,
                      timeout_s=60)
        assert (forced.state, forced.position) == ("loaded", 1)
        assert forced.into_time is not None and r.into_time is not None
        assert forced.into_time > r.into_time
        rows, bad, into = _held(cfg, "people", ["id", "name", "score"], position=1)
        assert sorted(rows) == sorted(exp_people) and into == {forced.into_time}
        assert len(_held(cfg, "people", ["id"])[0]) == 2 * len(exp_people)
        # requests are gone once durable; the ledger keeps the loads
        wait_for(lambda: not list((state / "loads" / "people" / "requests").glob("*.json")),
                 timeout=10, what="the requests to be removed")
    reports = verify_pipeline(cfg)
    for rep in reports:
        assert rep.ok, (rep.source, [(o.output, o.breaches, o.samples) for o in rep.outputs])
    checked = {rep.source: rep.complete_checked for rep in reports}
    assert checked == {"people": 2 * (len(exp_people) + len(exp_bad)),
                       "events": len(exp_events) + len(exp_ebad), "facts": len(exp_facts)}
    # a loaded file replaced: that source's loads can no longer be re-read
    people[0].write_text(people[0].read_text().replace("name-1,", "name-X,"))
    reports = {rep.source: rep for rep in verify_pipeline(cfg)}
    assert all(rep.ok for rep in reports.values())
    assert reports["people"].complete_checked == 0
    assert any("cannot be re-read" in n for n in reports["people"].notes)
    assert reports["facts"].complete_checked == len(exp_facts)
    print(f"oneshot loads: {time.monotonic() - t0:.1f} s")


def test_s3_glob_load(tmp_path: Path, spark: Any, s3: Any,
                      monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    bucket = s3.bucket()
    data = tmp_path / "data"
    jsonl_files(data, n_files=3, rows=300)
    client = s3.client()
    for p in sorted(data.glob("*.jsonl")):
        client.put_object(Bucket=bucket, Key=f"in/{p.name}", Body=p.read_bytes())
    client.put_object(Bucket=bucket, Key="in/skip.txt", Body=b"not matched")
    exp, exp_bad = jsonl_model(sorted(data.glob("*.jsonl")))
    state = tmp_path / "state"
    cfg = load_config(_write(tmp_path, state))
    with running(cfg, spark):
        r = load(cfg, "events", "events", f"s3://{bucket}/in/*.jsonl", wait=True, timeout_s=60)
        assert (r.state, r.files, r.rows, r.errors) == ("loaded", 3, len(exp), len(exp_bad))
        rows, bad, into = _held(cfg, "events", ["id", "kind"])
        assert sorted(rows) == sorted(exp) and sorted(bad) == sorted(exp_bad)
        assert into == {r.into_time}
        # another object matching the glob makes it another load: of every file again
        client.put_object(Bucket=bucket, Key="in/events-9.jsonl",
                          Body=(data / "events-0.jsonl").read_bytes())
        r2 = load(cfg, "events", "events", f"s3://{bucket}/in/*.jsonl", wait=True, timeout_s=60)
        assert (r2.state, r2.position, r2.files) == ("loaded", 1, 4)
        assert r2.rows == len(exp) + len(jsonl_model([data / "events-0.jsonl"])[0])
        assert r2.into_time is not None and r.into_time is not None
        assert r2.into_time > r.into_time
    assert all(rep.ok for rep in verify_pipeline(cfg))


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with ETags and single byte ranges (as object stores serve)."""

    def log_message(self, *args: Any) -> None:
        pass

    def end_headers(self) -> None:
        path = self.translate_path(self.path)
        if os.path.isfile(path):
            st = os.stat(path)
            self.send_header("ETag", f'"{st.st_size}-{st.st_mtime_ns}"')
        super().end_headers()

    def do_GET(self) -> None:
        rng = self.headers.get("Range")
        path = self.translate_path(self.path)
        if not rng or not os.path.isfile(path):
            return super().do_GET()
        lo, hi = (int(x) for x in rng.removeprefix("bytes=").split("-"))
        body = Path(path).read_bytes()[lo:hi + 1]
        self.send_response(206)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_http_load(tmp_path: Path, spark: Any) -> None:
    data = tmp_path / "data"
    jsonl_files(data, n_files=1, rows=600)
    exp, exp_bad = jsonl_model([data / "events-0.jsonl"])
    handler = functools.partial(_RangeHandler, directory=str(data))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/events-0.jsonl"
    cfg = load_config(_write(tmp_path, tmp_path / "state"))
    try:
        with running(cfg, spark):
            r = load(cfg, "events", "events", url, wait=True, timeout_s=60)
            assert (r.state, r.files, r.rows, r.errors) == ("loaded", 1, len(exp), len(exp_bad))
            rows, bad, into = _held(cfg, "events", ["id", "kind"])
            assert sorted(rows) == sorted(exp) and sorted(bad) == sorted(exp_bad)
            assert into == {r.into_time}
            assert load(cfg, "events", "events", url, wait=True).state == "already loaded"
        assert all(rep.ok for rep in verify_pipeline(cfg))
    finally:
        server.shutdown()


FACTS_ONLY = """
state_dir: {state}
timestamp_interval: 200ms
sources:
  - name: facts
    oneshot: {{format: parquet, columns: {{id: int64, v: float64, tag: string}}, split_size: 4096}}
    outputs:
      - name: facts
        sink: file
"""


def test_kill_around_the_commit_then_once(tmp_path: Path) -> None:
    state = tmp_path / "state"
    data = tmp_path / "data"
    parquet_files(data, n_files=2, rows=2000)
    exp = parquet_model(sorted(data.glob("*.parquet")))
    path = tmp_path / "facts.yaml"
    path.write_text(FACTS_ONLY.format(state=state))
    cfg = load_config(path)
    requests = state / "loads" / "facts" / "requests"
    q = load(cfg, "facts", "facts", str(data), wait=False)
    assert q.state == "queued"
    base = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # 1. the load is read and staged, and the driver dies before it commits
    proc = start_driver(path, crash_env(base, "after_stage", 1.0, 1))
    assert wait_exit(proc, 120) == -9
    assert read_updates(cfg, "facts", "facts").num_rows == 0
    assert list(requests.glob("*.json"))  # still asked
    # 2. the rerun commits the load and dies before acknowledging it
    proc = start_driver(path, crash_env(base, "after_sink_commit", 1.0, 2))
    assert wait_exit(proc, 120) == -9
    rows, _, into = _held(cfg, "facts", ["id", "v", "tag"])
    assert sorted(rows) == sorted(exp) and len(into) == 1
    assert list(requests.glob("*.json"))  # not removed yet
    # 3. the next run reads nothing again and removes the request
    proc = start_driver(path, base)
    try:
        wait_for(lambda: not list(requests.glob("*.json")), timeout=120,
                 what="the request to be removed")
    finally:
        proc.kill()  # one more kill: after the request went, nothing is left to do
        proc.wait(30)
    rows, _, into2 = _held(cfg, "facts", ["id", "v", "tag"])
    assert sorted(rows) == sorted(exp) and into2 == into
    # the request is done: asking again is a no-op
    again = load(cfg, "facts", "facts", str(data), wait=False)
    assert (again.state, again.position, again.rows) == ("already loaded", 0, len(exp))
    assert all(rep.ok for rep in verify_pipeline(cfg))
    out = subprocess.run([sys.executable, "-m", "reclock.cli", "load", str(path), "facts",
                          "facts", "--from", str(data)], capture_output=True, text=True)
    assert out.returncode == 0 and "already loaded as load #0" in out.stdout, out


def test_interrupted_load_is_cancelled_then_loads_once(tmp_path: Path, spark: Any,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """``reclock load`` (a real process) interrupted: SIGTERM with no driver
    running (the request is skipped when a driver starts), then SIGINT while
    the load's Spark job runs (its tasks stop, the job commits nothing):
    each exits 128 + the signal with a line saying so, the output is as it
    was, and the same load asked again lands once."""
    state = tmp_path / "state"
    d = tmp_path / "big"
    d.mkdir()
    rows = [f"{i},name-{i:08d},{i / 4}" for i in range(6_000)]
    (d / "people.csv").write_text("id,name,score\n" + "\n".join(rows) + "\n")  # ~40 tasks
    exp, exp_bad = csv_model([d / "people.csv"])
    path = _write(tmp_path, state)
    # The load's ~40 tasks in a job of their own: shared with others (a job
    # this small would be), they run as a few Spark tasks and the whole load
    # can be durable before the signal lands (0.6 s in a CI run)
    path.write_text(path.read_text().replace(
        "progress_log: true\n", "progress_log: true\nspark: {shared_jobs_max_records: 0}\n"))
    cfg = load_config(path)
    cmd = [sys.executable, "-m", "reclock.cli", "load", str(path), "people", "people", "--from",
           str(d)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    requests = state / "loads" / "people" / "requests"

    def interrupt(proc: subprocess.Popen[str], sig: int) -> tuple[int, str, float]:
        t = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        assert "Traceback" not in err, err
        return proc.returncode, out, time.monotonic() - t

    # 1. no driver runs: SIGTERM cancels the queued request
    proc = subprocess.Popen([*cmd, "--wait"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for(lambda: bool(list(requests.glob("*.json"))), 60, "the request to be queued")
    rc, out, _ = interrupt(proc, signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM and "cancelled (SIGTERM)" in out, out
    with running(cfg, spark):
        wait_for(lambda: not list(requests.glob("*.json")), 10, "the request to be skipped")
        # 2. SIGINT while the load's job runs
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        tracker = spark.sparkContext.statusTracker()
        wait_for(lambda: bool(tracker.getActiveJobsIds()) or proc.poll() is not None, 60,
                 "the load's Spark job to run")
        rc, out, took = interrupt(proc, signal.SIGINT)
        assert rc == 128 + signal.SIGINT, out
        assert "cancelled (SIGINT)" in out and "load #0 holds nothing" in out, out
        assert took < 30, took  # a task sees the cancel as it starts or between batches
        wait_for(lambda: not tracker.getActiveJobsIds(), 10, "the job to stop")
        assert read_updates(cfg, "people", "people").num_rows == 0  # as it was
        # 3. asked again: loaded once, at the next position
        r = load(cfg, "people", "people", str(d), wait=True, timeout_s=60)
        assert (r.state, r.position, r.rows, r.errors) == ("loaded", 1, len(exp), len(exp_bad))
        held, _, into = _held(cfg, "people", ["id", "name", "score"])
        assert sorted(held) == sorted(exp) and into == {r.into_time}
    events = [json.loads(line) for line in (state / "progress.jsonl").read_text().splitlines()]
    assert any("LoadCancelled" in str(e.get("error")) for e in events)  # its tasks stopped
    assert "unclassified" not in caplog.text  # the job's failure: an expected one
    assert all(rep.ok for rep in verify_pipeline(cfg))
