"""The MariaDB CDC source end to end, against the run's private MariaDB
server: the snapshot (parallel key-range chunks) handed off under a writer of
random transactions, transactions kept whole, outputs equal to the writer's
own model and to the tables, ``verify`` clean, ``reclock bindings --at``
showing the GTID frontier, the column types, and two schema events under the
writer: a column added upstream (the source re-opens, the output gains it)
and a TRUNCATE of a keyed table (every row it held is retracted)."""

from __future__ import annotations

import datetime as dt
import json
import time
from decimal import Decimal
from itertools import pairwise
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from reclock import cli
from reclock.config import load_config
from reclock.verify import verify_pipeline
from tests.running import read_updates, running, wait_for
from tests.sources.cdc import output_rows
from tests.sources.mycdc import (
    Writer,
    binlog_pos,
    connect,
    create_schema,
    passed,
    source_rows,
)

PIPELINE = """
state_dir: {tmp}/state
timestamp_interval: 300ms
spark: {{max_records_per_task: 300}}
sources:
  - name: bank
    mysql: {{url: "{url}", tables: [acct, ledger, kinds, tr]}}
    outputs:
      - {{name: acct, sink: file}}
      - {{name: ledger, sink: file}}
      - {{name: kinds, sink: file}}
      - {{name: tr, sink: file}}
"""

KINDS = ("create table kinds (id int primary key, ti tinyint, bi bigint, ub bigint unsigned, "
         "de decimal(20,4), fl float, db double, vc varchar(10), tx text, en enum('a','b'), "
         "st set('x','y','z'), bn varbinary(8), bl blob, js json, dd date, dtm datetime(6), "
         "ts timestamp(3) null, tm time(2), yr year, bt bit(9))")
KROW = ("insert into kinds values ({}, -128, -9223372036854775808, 18446744073709551615, "
        "-1234567890123456.7891, 1.1, 2.5e-300, 'héllo', 'a\\nb \"q\"', 'b', 'x,z', "
        "x'00ff10', x'deadbeef', '{{\"k\": [1, null]}}', '2024-02-29', "
        "'2024-02-29 12:34:56.789012', '2024-01-01 00:00:00.125', '-838:59:58.5', 2155, "
        "b'100000001')")


def _acct(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return sorted(((int(r[0]), r[1], Decimal(r[2]), r[3]) for r in rows), key=repr)


@pytest.mark.timeout(300)
def test_snapshot_hand_off_under_a_writer(tmp_path: Path, spark: Any, mysql_url: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    model = create_schema(mysql_url, accounts=1000, ledger=1500)
    with connect(mysql_url) as c, c.cursor() as cur:
        cur.execute(KINDS)
        cur.execute(KROW.format(1))
        cur.execute("insert into kinds (id) values (2)")
        cur.execute("create table tr (id int primary key, v int)")
        cur.execute("insert into tr values (1, 1), (2, 2), (3, 3)")
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(tmp=tmp_path, url=mysql_url))
    cfg = load_config(path)
    seeded = binlog_pos(mysql_url)
    writer = Writer(mysql_url, model, seed=5)
    with running(cfg, spark) as runners:
        # the snapshot is taken and read while the writer runs
        wait_for(lambda: passed(runners[0].status().get("resume"), seeded),
                 60, "the snapshot to be durable")
        with connect(mysql_url) as c, c.cursor() as cur:
            cur.execute(KROW.format(11))  # streamed
            cur.execute("insert into kinds (id) values (12)")
            # a column added upstream, then a TRUNCATE, while the writer runs
            cur.execute("alter table tr add column w varchar(10)")
            cur.execute("insert into tr values (4, 4, 'four')")
            cur.execute("update tr set w = 'one' where id = 1")
            cur.execute("truncate table tr")
            cur.execute("insert into tr values (5, 5, 'five')")
        time.sleep(1)
        txns = writer.stop()
        target = binlog_pos(mysql_url)
        wait_for(lambda: passed(runners[0].status().get("resume"), target), 60,
                 "the outputs to catch up")
        assert runners[0].health.status == "running", runners[0].health
    assert txns > 50
    # the keyed output equals the writer's model and the table
    acct = read_updates(cfg, "bank", "acct")
    held = _acct(output_rows(acct, ["id", "owner", "bal", "note"]))
    assert held == _acct(list(model.acct.values()))
    assert held == _acct(source_rows(mysql_url, "select id, owner, bal, note from acct"))
    # the diff log (no key) consolidates to the model and the table
    ledger = read_updates(cfg, "bank", "ledger")
    cols = ["txn", "acct", "amount", "tag"]
    state = ledger.group_by(cols).aggregate([("_diff", "sum")])
    counted = sorted((tuple(r[c] for c in cols), r["_diff_sum"]) for r in state.to_pylist()
                     if r["_diff_sum"])
    want: dict[tuple[Any, ...], int] = {}
    for r in model.ledger:
        want[r] = want.get(r, 0) + 1
    assert counted == sorted(want.items())
    # the added column: the output gained it (the rows before it: null); the
    # TRUNCATE retracted every row held then, each at the truncate's IntoTime
    tr = read_updates(cfg, "bank", "tr")
    assert "w" in tr.schema.names
    assert output_rows(tr, ["id", "v", "w"]) == [(5, 5, "five")]
    hist = {(r["id"], r["v"], r["w"], r["_diff"]) for r in tr.to_pylist()}
    assert {(1, 1, None, 1), (4, 4, "four", 1), (1, 1, "one", 1)} <= hist
    gone = [r for r in tr.to_pylist() if r["_diff"] < 0]
    assert sorted(((r["id"], r["w"]) for r in gone), key=repr) == [
        (1, "one"), (1, None), (2, None), (3, None), (4, "four")]  # (1, None): the update
    assert len({r["_into_time"] for r in gone if r["id"] != 1 or r["w"] == "one"}) == 1
    # the snapshot: several chunks, one position, before every streamed change
    snap = acct.filter(pa.compute.is_null(acct.column("_src_ts")))
    assert len(set(snap.column("_src_offset").to_pylist())) == 1
    chunks = {s >> 21 for s in snap.column("_src_seq").to_pylist()}  # chunk * 2**21 + row
    assert len(chunks) >= 3, "the snapshot was not read in key-range chunks"
    first_streamed = min(t for t, ts in zip(acct.column("_into_time").to_pylist(),
                                            acct.column("_src_ts").to_pylist(), strict=True)
                         if ts is not None)
    assert set(snap.column("_into_time").to_pylist()) <= {
        t for t in snap.column("_into_time").to_pylist() if t <= first_streamed}
    # every transaction is one point (domain 0, its seq) and all its rows share one IntoTime
    for out in (acct, ledger):
        streamed = out.filter(pa.compute.is_valid(out.column("_src_ts")))
        times: dict[int, set[int]] = {}
        for off, t in zip(streamed.column("_src_offset").to_pylist(),
                          streamed.column("_into_time").to_pylist(), strict=True):
            times.setdefault(off, set()).add(t)
        assert not {k: v for k, v in times.items() if len(v) > 1}
        assert set(streamed.column("_src_part").to_pylist()) <= {0}
    ins = ledger.filter(pa.compute.greater(ledger.column("txn"), 0))
    assert len(set(ins.column("_src_offset").to_pylist())) > 50
    # the audit: every row at its bindings' IntoTime, no position twice
    [report] = verify_pipeline(cfg)
    assert report.ok, [(o.output, o.breaches, o.samples) for o in report.outputs]
    # `reclock bindings --at T`: the GTID frontier (domain 0's next sequence number)
    at = int(ins.column("_into_time").to_pylist()[-1])
    capsys.readouterr()
    assert cli.main(["bindings", str(path), "bank", "--at", str(at), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    offsets = {lo: off for lo, hi, off in doc["frontier"] if hi == lo}
    assert offsets[0] > max(off for off, t in zip(ins.column("_src_offset").to_pylist(),
                                                  ins.column("_into_time").to_pylist(),
                                                  strict=True) if t <= at)
    # new domains: covered (above the highest the run's shared server has seen)
    assert [lo for lo, hi, off in doc["frontier"] if hi is None] == [max(offsets) + 1]
    assert cli.main(["bindings", str(path), "bank", "--at", str(at)]) == 0
    assert f"domain 0: seq {offsets[0]}" in capsys.readouterr().out
    assert cli.main(["bindings", str(path), "bank"]) == 0
    assert "source bank [gtid]" in capsys.readouterr().out
    # types: the snapshot's row and the streamed one read alike
    kinds = {r["id"]: r for r in read_updates(cfg, "bank", "kinds").to_pylist()}
    strip = [{k: v for k, v in kinds[i].items() if not k.startswith("_") and k != "id"}
             for i in (1, 11)]
    assert strip[0] == strip[1]
    r = strip[0]
    assert (r["ti"], r["bi"], r["ub"]) == (-128, -(2**63), Decimal(2**64 - 1))
    assert r["de"] == Decimal("-1234567890123456.7891") and r["db"] == 2.5e-300
    assert abs(r["fl"] - 1.1) < 1e-6 and r["vc"] == "héllo" and r["tx"] == 'a\nb "q"'
    assert (r["en"], r["st"], r["bn"], r["bl"]) == ("b", "x,z", b"\x00\xff\x10",
                                                    b"\xde\xad\xbe\xef")
    assert r["js"] == '{"k": [1, null]}' and r["dd"] == dt.date(2024, 2, 29)
    assert r["dtm"] == dt.datetime(2024, 2, 29, 12, 34, 56, 789012)
    assert r["ts"] == dt.datetime(2024, 1, 1, 0, 0, 0, 125000, tzinfo=dt.UTC)
    assert (r["tm"], r["yr"], r["bt"]) == ("-838:59:58.500000", 2155, 257)
    nulls = [{k: v for k, v in kinds[i].items() if not k.startswith("_") and k != "id"}
             for i in (2, 12)]
    assert all(v is None for n in nulls for v in n.values())


MULTI = """
state_dir: {tmp}/state
timestamp_interval: 100ms
progress_log: true
spark: {{max_records_per_job: 20}}
sources:
  - name: multi
    mysql: {{url: "{url}", tables: [{tables}]}}
    outputs: [{outputs}]
"""


@pytest.mark.timeout(180)
def test_snapshot_with_replication_domains(tmp_path: Path, spark: Any,
                                           mysql_url: str) -> None:
    """Domains 0 and 1 written concurrently; domain 0 then idle while
    domain 1 goes on and bindings are minted; the pipeline stops while
    domains 1 and 2 write a backlog; then an output of their table is added
    (a snapshot at Q, with bindings from before Q). As of every IntoTime the
    output holds, it equals a model of the table: the transactions whose GTID
    the bindings reclock to that IntoTime or earlier. Stamped in domain 0
    (as before), the snapshot's rows took the IntoTime at which domain 0 had
    reached S, before other domains' last transactions they hold. The
    backlog of two domains is read in jobs of at most max_records_per_job
    transactions (20), each domain's share cut in proportion."""
    from reclock.core.frontier import Antichain
    from reclock.core.time import Gtid
    from reclock.pipeline import Pipeline
    from reclock.sources.mysql import gtid
    from tests.sources.mycdc import DomainWriter

    with connect(mysql_url) as c, c.cursor() as cur:
        cur.execute("create table dd (id int primary key, dom int not null, n int not null)")
        cur.execute("create table one (id int primary key)")
        cur.execute("insert into one values (1)")
    path = tmp_path / "p.yaml"

    def config(tables: list[str]) -> Any:
        path.write_text(MULTI.format(tmp=tmp_path, url=mysql_url, tables=", ".join(tables),
                                     outputs=", ".join(f"{{name: {t}, sink: file}}"
                                                       for t in tables)))
        return load_config(path)

    # ~20 transactions a second each: what jobs of 20 keep up with
    writers = [DomainWriter(mysql_url, d, seed=d + 1, pause=0.04, paused=d == 2)
               for d in range(3)]
    try:
        cfg = config(["one"])
        with running(cfg, spark) as runners:
            def resume() -> Any:
                return runners[0].status().get("resume")

            time.sleep(0.6)  # both domains written concurrently, bound every 100 ms
            writers[0].pause()
            at = binlog_pos(mysql_url)
            wait_for(lambda: passed(resume(), at), 30, "a binding past domain 0's last")
            time.sleep(0.3)  # domain 1 alone, bound some more times
        writers[2].resume()
        time.sleep(1.2)  # a backlog of domains 1 and 2 (about 25 transactions each)
        cfg = config(["one", "dd"])  # dd: a snapshot, at Q, with bindings from before Q
        log = tmp_path / "state" / "progress.jsonl"
        first_event = len(log.read_text().splitlines())
        with running(cfg, spark) as runners:
            at = binlog_pos(mysql_url)
            wait_for(lambda: passed(resume(), at), 60, "the snapshot to be durable")
            writers[0].resume()
            time.sleep(0.5)
            for w in writers:
                w.pause()
            at = binlog_pos(mysql_url)
            wait_for(lambda: passed(resume(), at), 60, "the outputs to catch up")
            assert runners[0].health.status == "running", runners[0].health
    finally:
        for w in writers:
            w.stop()
    assert all(len(w.txns) > 10 for w in writers), [len(w.txns) for w in writers]
    # every job after the first reads at most 20 transactions; the backlog
    # before the snapshot (the output `one` is behind it) takes several
    reads = [e for e in map(json.loads, log.read_text().splitlines()[first_event:])
             if e["kind"] == "read"]
    pos = [gtid.of(Antichain.decode(Gtid.KIND, e["frontier"])) for e in reads]
    steps = [sum(n - gtid.nxt(a, d) for d, n in b.items()) for a, b in pairwise(pos)]
    chunk_job = next(i for i, e in enumerate(reads) if e["tasks"] > 1)
    assert chunk_job >= 2 and 0 < max(steps) <= 20, (chunk_job, steps)
    pipe = Pipeline(cfg)
    try:
        bindings = pipe.store.read("multi")
    finally:
        pipe.close()
    txns = [(bindings.reclock(Gtid.point(d, n)), changes)
            for w in writers for d, n, changes in w.txns]
    dd = read_updates(cfg, "multi", "dd")
    snap = dd.filter(pa.compute.is_null(dd.column("_src_ts")))
    snap_parts = set(snap.column("_src_part").to_pylist())
    assert snap.num_rows and snap_parts in ({1}, {2}), snap_parts  # the last one's domain
    times = sorted(set(dd.column("_into_time").to_pylist()))
    assert min(times) == snap.column("_into_time")[0].as_py()
    for t in times:
        want: dict[int, tuple[int, int, int] | None] = {}
        for into, changes in txns:
            if into is not None and into <= t:
                want.update(changes)  # keys of one domain: in its own order
        model = sorted((r for r in want.values() if r is not None), key=repr)
        as_of = dd.filter(pa.compute.less_equal(dd.column("_into_time"), t))
        assert output_rows(as_of, ["id", "dom", "n"]) == model, f"as of {t}"
    assert output_rows(dd, ["id", "dom", "n"]) == source_rows(mysql_url,
                                                               "select id, dom, n from dd")
    [report] = verify_pipeline(cfg)
    assert report.ok, [(o.output, o.breaches, o.samples) for o in report.outputs]
