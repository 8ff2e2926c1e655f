"""Other engines query reclock's outputs with the queries the README shows.

One Postgres table, one replication slot, one output into five sinks: a
Delta state table, a Delta update log, an Iceberg state table, an Iceberg
update log (one SQLite SQL catalog) and a Postgres state table. The table
is changed in two rounds (inserts, updates, deletes, a primary key moved).
Then every query of the README's section on other engines runs as written
there (its example paths, catalog file and IntoTime replaced by the
test's): DuckDB, Spark SQL (delta-spark and Iceberg's runtime, through a
JDBC catalog on the sink's SQLite catalog) and pyiceberg.

The models are independent of reclock's reading code: the state tables must
equal ``SELECT *`` of the upstream table (plus ``_into_time``), and agree
with each other on each key's ``_into_time``; the update logs, summed per
row in plain Python as of an IntoTime, must equal what the README's
consolidating queries return, and the two logs must hold the same updates.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
from deltalake import DeltaTable
from pyiceberg.catalog import load_catalog

from reclock.config import load_config
from reclock.sinks._store import Location
from reclock.sinks.delta import read_current
from tests.peers import duckdb, spark_reads
from tests.running import running, wait_for
from tests.sources.cdc import flushed_lsn, resumed_past

README = Path(__file__).resolve().parents[2] / "README.md"
#: what the README's queries name, replaced by the test's own (longest first)
EXAMPLE_LOG = "state/outputs/shop/customers_log"
EXAMPLE_STATE = "state/outputs/shop/customers"
EXAMPLE_CATALOG = "sqlite:///lake/catalog.db"
EXAMPLE_AS_OF = "1767225600000"
COLUMNS = ["id", "name", "email"]


def readme_queries() -> list[tuple[str, str]]:
    """(engine, query) for every statement of the code blocks in the README's
    section on other engines; the engine is the comment line before it
    (``-- DuckDB (...)``, ``# pyiceberg``), its parenthesis kept."""
    text = README.read_text()
    section = text[text.index("## Query the outputs from other engines"):]
    section = section[:section.index("\n## ", 1)]
    found: list[tuple[str, str]] = []
    for lang, block in re.findall(r"```(sql|python)\n(.*?)```", section, re.S):
        engine = ""
        lines: list[str] = []
        for line in block.splitlines():
            if line.startswith(("-- ", "# ")):
                engine = line.split(" ", 1)[1]
            elif line.strip():
                lines.append(line)
                if lang == "python" or line.rstrip().endswith(";"):
                    found.append((engine, " ".join(lines).rstrip(";")))
                    lines = []
    return found


def held_as_of(log: list[dict[str, Any]], as_of: int) -> list[tuple[Any, ...]]:
    """The model: rows whose summed multiplicity up to ``as_of`` is positive
    (asserting none is held more than once: the output is keyed)."""
    sums: Counter[tuple[Any, ...]] = Counter()
    for r in log:
        if r["_error"] is None and r["_into_time"] <= as_of:
            sums[tuple(r[c] for c in COLUMNS)] += r["_diff"]
    assert all(n in (0, 1) for n in sums.values()), sums
    return sorted((row for row, n in sums.items() if n == 1), key=repr)


def updates(log: list[dict[str, Any]]) -> Counter[tuple[Any, ...]]:
    return Counter(tuple(r[c] for c in [*COLUMNS, "_into_time", "_diff"]) for r in log
                   if r["_error"] is None)


def test_engines_query_every_kind_of_output_with_the_readmes_queries(
        tmp_path: Path, spark: Any, cdc_url: str) -> None:
    queries = readme_queries()
    engines = {e.split(" (")[0] for e, _ in queries}
    assert engines == {"DuckDB", "Spark SQL", "pyiceberg"}, queries
    with psycopg.connect(cdc_url, autocommit=True) as c:
        c.execute("create table customers (id int primary key, name text, email text)")
        c.execute("insert into customers select i, 'n' || i, 'e' || i || '@x' "
                  "from generate_series(1, 30) i")
    catalog_uri = f"sqlite:///{tmp_path}/catalog.db"
    catalog = (f'{{type: sql, name: lake, uri: "{catalog_uri}", '
               f'warehouse: "{tmp_path}/wh"}}')
    state_path = tmp_path / EXAMPLE_STATE
    log_path = tmp_path / EXAMPLE_LOG
    path = tmp_path / "p.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
sources:
  - name: shop
    postgres: {{dsn: "{cdc_url}", tables: [customers], slot: reclock_engines}}
    outputs:
      - name: customers
        sinks:
          - {{name: lake, type: delta, path: "{state_path}", mode: state, key: [id]}}
          - {{name: lakelog, type: delta, path: "{log_path}"}}
          - {{name: ice, type: iceberg, catalog: {catalog}, table: shop.customers,
              mode: state, key: [id]}}
          - {{name: icelog, type: iceberg, catalog: {catalog}, table: shop.customers_log}}
          - {{name: pg, type: postgres, dsn: "{cdc_url}", table: customers_now, mode: state,
              key: [id]}}
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
    with psycopg.connect(cdc_url) as c:
        upstream = sorted(c.execute("select id, name, email from customers").fetchall(),
                          key=repr)
        (slots,) = c.execute("select count(*) from pg_replication_slots "
                             "where database = current_database()").fetchone() or (0,)
        pg_state = {r[0]: r for r in c.execute(
            "select id, name, email, _into_time from customers_now")}
    assert slots == 1  # five sinks, one slot

    # the logs: the Delta log summed in Python is the model; the Iceberg log
    # holds the same updates
    log = DeltaTable(str(log_path)).to_pyarrow_table().to_pylist()
    ice = load_catalog("lake", type="sql", uri=catalog_uri, warehouse=str(tmp_path / "wh"))
    ice_log = ice.load_table("shop.customers_log").scan().to_arrow().to_pylist()
    assert updates(ice_log) == updates(log)
    times = sorted({r["_into_time"] for r in log})
    assert len(times) >= 2, "the snapshot and the changes landed at one IntoTime"
    assert held_as_of(log, times[-1]) == upstream
    as_of = times[0]  # before the changes: what the logs held then differs from now
    then = held_as_of(log, as_of)
    assert then != upstream

    # the state tables: SELECT * is the upstream table plus each key's
    # _into_time, the same in all three
    delta_state = read_current_rows(state_path)
    assert sorted((r[:3] for r in delta_state.values()), key=repr) == upstream
    assert delta_state == pg_state

    ours = {EXAMPLE_LOG: str(log_path), EXAMPLE_STATE: str(state_path),
            EXAMPLE_CATALOG: catalog_uri, EXAMPLE_AS_OF: str(as_of)}
    examples = re.compile("|".join(map(re.escape, sorted(ours, key=len, reverse=True))))

    def text(query: str) -> str:
        """The query with the README's example names replaced, in one pass
        (the test's paths contain the example's)."""
        return examples.sub(lambda m: ours[m.group(0)], query)

    def check(engine: str, query: str, got: list[tuple[Any, ...]], names: list[str]) -> None:
        if query.lstrip().upper().startswith("SELECT *") or engine == "pyiceberg":
            assert names == [*COLUMNS, "_into_time"], (engine, query, names)
            assert {r[0]: tuple(r) for r in got} == delta_state, (engine, query)
            assert len(got) == len(delta_state)
        else:
            assert sorted(got, key=repr) == then, (engine, query)

    conn = duckdb()
    for engine, query in queries:
        if engine.startswith("DuckDB"):
            cur = conn.execute(text(query))
            check(engine, query, cur.fetchall(), [d[0] for d in cur.description])
        elif engine == "pyiceberg":
            table: pa.Table = eval(text(query), {"load_catalog": load_catalog})
            check(engine, query, [tuple(r.values()) for r in table.to_pylist()],
                  table.column_names)
    spark_sql = [(e, text(q)) for e, q in queries if e.startswith("Spark SQL")]
    seen = spark_reads([f"sql:{q}" for _, q in spark_sql],
                       (f"lake=jdbc:sqlite:{tmp_path}/catalog.db,file://{tmp_path}/wh",))
    for engine, q in spark_sql:
        got = seen[f"sql:{q}"]
        check(engine, q, [tuple(r) for r in got["rows"]], list(got["types"]))
        assert {c: got["types"][c] for c in COLUMNS} == {
            "id": "int", "name": "string", "email": "string"}, q


def read_current_rows(path: Path) -> dict[int, tuple[Any, ...]]:
    """A Delta state table's rows by key, read by delta-rs."""
    table = read_current(Location.of("shop.customers", path))
    return {r["id"]: (r["id"], r["name"], r["email"], r["_into_time"])
            for r in table.to_pylist()}
