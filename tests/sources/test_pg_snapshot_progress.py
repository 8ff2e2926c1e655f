"""Snapshot progress of the Postgres CDC source, against the private cluster:
while a table's snapshot is read in many chunk tasks, ``/status.json``
shows its rows read rising chunk by chunk to its rows in all, and
``/metrics`` and the status page the same numbers; the total is the exact
count under the snapshot (or, with ``snapshot_count: false``, the catalog's
estimate), and the count never outlives the snapshot."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import psycopg

from reclock.clients.postgres import parse_dsn
from reclock.config import load_config
from reclock.contracts.source import SnapshotSize
from reclock.sources.postgres.catalog import PgTable
from reclock.sources.postgres.snapshot_size import SnapshotSizes
from tests.reclock.test_http import browse, get, get_json, samples, value
from tests.running import running, wait_for

PIPELINE = """
state_dir: {tmp}/state
timestamp_interval: 200ms
http: {{port: 0}}
spark: {{max_records_per_task: 400}}
sources:
  - name: shop
    postgres: {{dsn: "{url}", tables: [orders, customers]{extra}}}
    outputs:
      - {{name: orders, sink: file}}
      - {{name: customers, sink: file}}
"""

ORDERS = 40_000
CUSTOMERS = 300


def _tables(url: str, analyze: bool) -> None:
    # Never analyzed means no autovacuum either: its analyze, or its vacuum
    # of an insert-only table, would give the planner an estimate midway.
    opts = "" if analyze else " with (autovacuum_enabled = false)"
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(f"create table orders (id int primary key, customer int, note text){opts}")
        c.execute("insert into orders select g, g %% 300, 'order ' || g "
                  "from generate_series(1, %s) g", (ORDERS,))
        c.execute(f"create table customers (id int primary key, name text){opts}")
        c.execute("insert into customers select g, 'c' || g from generate_series(1, %s) g",
                  (CUSTOMERS,))
        if analyze:
            c.execute("analyze orders")
            c.execute("analyze customers")


def _watch(tmp_path: Path, spark: Any, url: str, extra: str = "", page: bool = False
           ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any], str, str]:
    """Run the pipeline until both snapshots are done; returns every
    ``orders`` snapshot entry seen in /status.json (polled as fast as it
    answers), the ``customers`` ones, the last document, the metrics then
    and (``page``) the status page as Chromium draws it."""
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(tmp=tmp_path, url=url, extra=extra))
    cfg = load_config(path)
    seen: list[dict[str, Any]] = []
    small: list[dict[str, Any]] = []
    status = tmp_path / "state" / "status.json"

    def address() -> str | None:
        try:
            return json.loads(status.read_text()).get("http")  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return None

    with running(cfg, spark):
        wait_for(lambda: bool(address()), what="status.json with the HTTP address")
        base = str(address())
        deadline = time.monotonic() + 60
        doc: dict[str, Any] = {}
        while time.monotonic() < deadline:
            doc = get_json(base + "/status.json")
            [src] = doc["sources"]
            outs = {o["name"]: o for o in src["outputs"]}
            if outs["orders"]["snapshot"] is not None:
                seen.append(outs["orders"]["snapshot"])
            if outs["customers"]["snapshot"] is not None:
                small.append(outs["customers"]["snapshot"])
            if seen and seen[-1]["done"] and small and small[-1]["done"]:
                break
        else:
            raise AssertionError(f"the snapshots did not finish: {seen[-3:]} {small[-3:]}")
        metrics = get(base + "/metrics")[2].decode()
        dom = ""
        for _ in range(5 if page else 0):  # the page fetches its data after loading
            dom = browse(base + "/", tmp_path, "--dump-dom").stdout
            if 'class="snap"' in dom:
                break
    return seen, small, doc, metrics, dom


def _rises_to_the_total(seen: list[dict[str, Any]], total: int) -> None:
    reads = [s["rows_read"] for s in seen]
    assert reads == sorted(reads), reads  # never backwards
    assert seen[-1] == {"table": "public.orders", "rows_read": total, "rows_total": total,
                        "exact": True, "done": True}
    # read chunk by chunk while the job ran, not all at once when it ended
    partial = {s["rows_read"] for s in seen if 0 < s["rows_read"] < total}
    assert len(partial) >= 3, sorted(set(reads))
    assert all(s["rows_total"] is None or s["rows_read"] <= s["rows_total"] for s in seen)
    assert all(not s["done"] for s in seen if s["rows_read"] < total)


def _metrics_show(metrics: str, output: str, rows: int) -> None:
    ss = samples(metrics)
    v = lambda name: value(ss, name, source="shop", output=output)  # noqa: E731
    assert v("reclock_snapshot_rows_read") == rows
    assert v("reclock_snapshot_rows") == rows
    assert v("reclock_snapshot_rows_exact") == 1
    assert v("reclock_snapshot_done") == 1


def test_snapshot_progress_rises_to_the_exact_count(tmp_path: Path, spark: Any,
                                                    cdc_url: str) -> None:
    _tables(cdc_url, analyze=False)  # never analyzed: no estimate, the count gives the total
    seen, small, doc, metrics, dom = _watch(tmp_path, spark, cdc_url, page=True)
    _rises_to_the_total(seen, ORDERS)
    # the total is the count under the snapshot as soon as it is known: never another number
    assert {s["rows_total"] for s in seen if s["exact"]} == {ORDERS}
    assert any(s["exact"] and not s["done"] for s in seen)  # counted while it was read
    assert all(s["rows_total"] is None for s in seen if not s["exact"])
    assert small[-1] == {"table": "public.customers", "rows_read": CUSTOMERS,
                         "rows_total": CUSTOMERS, "exact": True, "done": True}
    _metrics_show(metrics, "orders", ORDERS)
    _metrics_show(metrics, "customers", CUSTOMERS)
    # what the outputs hold is what was counted
    [src] = doc["sources"]
    assert {o["name"]: o["rows"] for o in src["outputs"]} == {"orders": ORDERS,
                                                              "customers": CUSTOMERS}
    # the status page's outputs table: a snapshot column
    shown = {m.group(1): m.group(2) for m in re.finditer(
        r'<tr><td class="l">shop</td><td class="l">(\w+)</td>.*?<td class="snap">([^<]*)</td>'
        r'</tr>', dom)}
    assert shown == {"orders": "done, 40,000 rows", "customers": "done, 300 rows"}, dom[-3000:]


def test_without_the_count_the_total_is_the_catalogs_estimate(tmp_path: Path, spark: Any,
                                                                cdc_url: str) -> None:
    _tables(cdc_url, analyze=True)
    seen, _small, _doc, metrics, _ = _watch(tmp_path, spark, cdc_url,
                                            ", snapshot_count: false")
    _rises_to_the_total(seen, ORDERS)
    estimates = [s for s in seen if not s["done"]]
    assert estimates and not any(s["exact"] for s in estimates)
    # ANALYZE of a table this small reads every page: the estimate is close
    assert all(0.9 * ORDERS <= s["rows_total"] <= 1.1 * ORDERS for s in estimates), estimates
    _metrics_show(metrics, "orders", ORDERS)


def _exported(url: str) -> tuple[psycopg.Connection[Any], str]:
    """A transaction that exports its snapshot (held open by the connection)."""
    conn = psycopg.connect(url)
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    row = conn.execute("select pg_export_snapshot()").fetchone()
    assert row is not None
    return conn, str(row[0])


def _counting(url: str, app: str) -> int:
    with psycopg.connect(url) as c:
        row = c.execute("select count(*) from pg_stat_activity where application_name = %s",
                        (app,)).fetchone()
    return int(row[0]) if row else 0


def test_the_count_ends_with_the_snapshot(cdc_url: str, caplog: Any) -> None:
    """Releasing the snapshot cancels a count under way (it never outlives
    the snapshot), quietly; a count that fails leaves the estimate, with a
    warning."""
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table quick (id int)")
        c.execute("insert into quick select generate_series(1, 25)")
        c.execute("create view slow as select 1 as x from pg_sleep(60)")  # a count that waits
        oids = dict(c.execute("select relname::text, oid::int from pg_class "
                              "where relname in ('quick', 'slow')").fetchall())
    params, secrets = parse_dsn(cdc_url, "test")
    tables = {0: PgTable(oids["quick"], "public", "quick", "quick", (), "d"),
              1: PgTable(oids["slow"], "public", "slow", "slow", (), "d")}
    exporter, snapshot = _exported(cdc_url)
    app = "reclock test snapshot count"
    try:
        sizes = SnapshotSizes(tables, {0: (1, 25.0, 1), 1: (5, -1.0, 0)})  # slow: larger
        assert sizes.current() == {0: SnapshotSize(25, False, "public.quick"),
                                   1: SnapshotSize(None, False, "public.slow")}
        sizes.start(cdc_url, params, secrets, snapshot, "test", app, 10.0)
        wait_for(lambda: sizes.current()[0].exact, 30, "the small table's count")
        assert _counting(cdc_url, app) == 1  # counting the view, which sleeps
        sizes.cancel()
        wait_for(lambda: _counting(cdc_url, app) == 0, 10, "the count to end")
        assert sizes.current() == {0: SnapshotSize(25, True, "public.quick"),
                                   1: SnapshotSize(None, False, "public.slow")}
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
        # a snapshot that is gone: the estimate stays, and the log says why
        gone = SnapshotSizes({0: tables[0]}, {0: (1, 20.0, 1)})
        gone.start(cdc_url, params, secrets, "00000003-0000001B-1", "test", app, 10.0)
        wait_for(lambda: any("cannot count" in r.getMessage() for r in caplog.records), 30,
                 "the warning")
        assert gone.current() == {0: SnapshotSize(20, False, "public.quick")}
    finally:
        exporter.close()
