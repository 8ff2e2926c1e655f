"""Other engines query reclock's outputs with the queries the README shows.

A Postgres table captured into a Delta update log, changed in two rounds
(inserts, updates, deletes, a primary key moved), then queried by DuckDB and
by Spark SQL with the README's queries, run as written there (its example
path and IntoTime replaced by the test's). The model is independent of
reclock's reading code: the update log summed per row in plain Python as of
each IntoTime, and the Postgres table itself at the end.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
from deltalake import DeltaTable

from reclock.config import load_config
from tests.peers import duckdb, spark_reads
from tests.running import running, wait_for
from tests.sources.cdc import flushed_lsn, resumed_past

README = Path(__file__).resolve().parents[2] / "README.md"
#: what the README's queries name, replaced by the test's own
EXAMPLE_PATH = "state/outputs/shop/customers"
EXAMPLE_AS_OF = "1767225600000"


def readme_queries() -> list[tuple[str, str]]:
    """(engine, query) for every statement of the README's SQL blocks in its
    section on other engines; the engine is the ``-- comment`` before it."""
    text = README.read_text()
    section = text[text.index("## Query the outputs from other engines"):]
    section = section[:section.index("\n## ", 1)]
    found: list[tuple[str, str]] = []
    for block in re.findall(r"```sql\n(.*?)```", section, re.S):
        engine = ""
        lines: list[str] = []
        for line in block.splitlines():
            if line.startswith("-- "):
                engine = line[3:].split(" (")[0]
            elif line.strip():
                lines.append(line)
                if line.rstrip().endswith(";"):
                    found.append((engine, " ".join(lines).rstrip(";")))
                    lines = []
    return found


def held_as_of(log: list[dict[str, Any]], columns: list[str], as_of: int
               ) -> list[tuple[Any, ...]]:
    """The model: rows whose summed multiplicity up to ``as_of`` is positive
    (asserting none is held more than once: the output is keyed)."""
    sums: Counter[tuple[Any, ...]] = Counter()
    for r in log:
        if r["_error"] is None and r["_into_time"] <= as_of:
            sums[tuple(r[c] for c in columns)] += r["_diff"]
    assert all(n in (0, 1) for n in sums.values()), sums
    return sorted((row for row, n in sums.items() if n == 1), key=repr)


def test_duckdb_and_spark_query_a_delta_log_with_the_readmes_queries(
        tmp_path: Path, spark: Any, cdc_url: str) -> None:
    queries = readme_queries()
    assert {e for e, _ in queries} >= {"DuckDB", "Spark SQL"}, queries
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table customers (id int primary key, name text, email text)")
        c.execute("insert into customers select i, 'n' || i, 'e' || i || '@x' "
                  "from generate_series(1, 30) i")
    path = tmp_path / "p.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
sources:
  - name: shop
    postgres: {{dsn: "{cdc_url}", tables: [customers], slot: reclock_engines}}
    outputs:
      - {{name: customers, sink: delta}}
""")
    cfg = load_config(path)
    with running(cfg, spark) as runners:
        wait_for(resumed_past(runners, flushed_lsn(cdc_url)), 90, "the snapshot")
        with psycopg.connect(cdc_url, autocommit=True) as c:
            c.execute("update customers set email = 'new' || id where id % 4 = 0")
            c.execute("delete from customers where id % 7 = 0")
            c.execute("update customers set id = id + 100 where id in (1, 2)")
            c.execute("insert into customers values (31, 'late', null)")
        wait_for(resumed_past(runners, flushed_lsn(cdc_url)), 90, "the changes")
    table = tmp_path / "state" / "outputs" / "shop" / "customers"
    log = DeltaTable(str(table)).to_pyarrow_table().to_pylist()
    columns = ["id", "name", "email"]
    times = sorted({r["_into_time"] for r in log})
    assert len(times) >= 2, "the snapshot and the changes landed at one IntoTime"
    with psycopg.connect(cdc_url) as c:
        upstream = sorted(c.execute("select id, name, email from customers").fetchall(),
                          key=repr)
    assert held_as_of(log, columns, times[-1]) == upstream
    # an IntoTime before the last one: what the log held then differs from now
    as_of = times[0]
    then = held_as_of(log, columns, as_of)
    assert then != upstream

    def text(query: str) -> str:
        return query.replace(EXAMPLE_PATH, str(table)).replace(EXAMPLE_AS_OF, str(as_of))

    conn = duckdb()
    for engine, query in queries:
        if engine == "DuckDB":
            got = sorted(conn.execute(text(query)).fetchall(), key=repr)
            assert got == then, query
    spark_sql = [text(q) for e, q in queries if e == "Spark SQL"]
    seen = spark_reads([f"sql:{q}" for q in spark_sql])
    for q in spark_sql:
        got = sorted((tuple(r) for r in seen[f"sql:{q}"]["rows"]), key=repr)
        assert got == then, q
        assert seen[f"sql:{q}"]["types"] == {"id": "int", "name": "string", "email": "string"}

