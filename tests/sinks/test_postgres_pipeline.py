"""A generator pipeline into PostgreSQL: the update log and a current-state
table, both committed with their uppers in one transaction per commit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg

from reclock.config import load_config
from reclock.pipeline import run
from reclock.verify import verify_pipeline


def test_generator_into_postgres_log_and_state(tmp_path: Path, spark: Any, pg_url: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(f"""
timestamp_interval: 200ms
sources:
  - name: shop
    generator: {{kind: orders, rate: 20000, max_records: 5000}}
    outputs:
      - name: customers
        sink: {{type: postgres, dsn: "{pg_url}", table: customers, mode: state,
               key: [customer_id]}}
      - name: orders
        sink: {{type: postgres, dsn: "{pg_url}", table: "order log"}}
""")
    cfg = load_config(path)
    runners = run(cfg, spark=spark, duration=120, out=None, install_signals=False)
    assert [r.health.status for r in runners] == ["finished"]
    with psycopg.connect(pg_url) as c:
        assert c.execute("select count(*) from customers").fetchone() == (1000,)
        assert c.execute('select count(*), count(distinct order_id) from "order log"'
                         ).fetchone() == (4000, 4000)
        uppers = dict(c.execute("select output, upper from reclock_uppers").fetchall())
    assert uppers == {"shop.customers": None, "shop.orders": None}  # finished: closed
    reports = verify_pipeline(cfg)
    assert all(r.ok for r in reports), [(o.output, o.breaches) for o in reports[0].outputs]
    assert reports[0].complete_checked == 4000  # the log output is audited in full
    orders = reports[0].outputs[1]
    assert orders.checks["values"] == "4000 positions"  # (without the sink's own rules)
    assert "the 0 error rows the output holds are taken as refused" in orders.unchecked["values"]
