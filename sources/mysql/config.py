"""The MariaDB (MySQL protocol) connector's configuration (light: no driver
imported until :meth:`MySqlConfig.build`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field
from pydantic_core import InitErrorDetails

from reclock.contracts.config import (
    ConfigModel,
    DurationMs,
    Name,
    problem,
    table_output_problems,
)
from reclock.contracts.source import ConnectorConfig, SourcePlugin, listed_outputs_problem
from reclock.core.urls import URL_SECRET
from reclock.sources.mysql.url import parse_url

if TYPE_CHECKING:
    from reclock.contracts.source import SourceContext
    from reclock.sources.mysql.source import MySqlSource


def _checked_url(url: str) -> str:
    parse_url(url)
    return url


class MyTableConfig(ConfigModel):
    """One replicated table and its output."""

    table: str = Field(min_length=1, max_length=64)
    """The table's name as the server spells it (no quoting needed)."""
    database: str | None = Field(default=None, min_length=1, max_length=64)
    """Its database (schema); default the URL's database."""
    output: Name | None = None
    """The output it feeds; default the table's name."""


def _table_entry(value: Any) -> Any:
    """``"database.table"`` / ``"table"`` as the mapping form."""
    if isinstance(value, str):
        db, dot, table = value.partition(".")
        return {"database": db, "table": table} if dot else {"table": value}
    return value


class MySqlConfig(ConnectorConfig):
    """MariaDB change data capture (the binary log in ROW format, read as a
    replica); its FromTime is the GTID position: one coordinate per
    replication domain, every transaction stamped as a unit. One output per
    table, named after the table unless given."""

    url: Annotated[str, AfterValidator(_checked_url), URL_SECRET] = Field(min_length=1)
    """``mysql://user:${MYSQL_PASSWORD}@host:3306/database`` (a password
    holding reserved characters percent-encoded); checked when the file is
    loaded; the password is never printed. The user needs REPLICATION SLAVE,
    REPLICATION CLIENT (BINLOG MONITOR) and SELECT on the tables."""
    tables: tuple[Annotated[MyTableConfig, BeforeValidator(_table_entry)], ...] = Field(
        min_length=1)
    """``[database.table, table, {table, database, output}, ...]``; each feeds
    the output named after the table, or ``output``."""
    snapshot: bool = True
    """Read the tables' existing rows first (in parallel Spark tasks by
    primary key ranges), then continue from exactly the GTID position they
    were read at. ``false``: changes only, from the position at the first start."""
    server_id: int | None = Field(default=None, ge=1, le=4293967295)
    """The server ids reclock's binlog connections present (every replica of a
    server needs its own): each one this plus an offset below 1,000,000;
    default derived from the pipeline id and the source name."""
    timeout: DurationMs = 30_000
    """Timeout of connecting, and of a read task waiting for its range."""

    @classmethod
    def check_raw(cls, data: Mapping[str, Any]) -> list[InitErrorDetails]:
        problems: list[InitErrorDetails] = []
        seen: dict[str, int] = {}
        default_db = None
        url = data.get("url")
        if isinstance(url, str):
            try:
                default_db = parse_url(url)["database"]
            except ValueError:
                return []  # the field's own validation names it
        for i, raw in enumerate(data.get("tables") or ()):
            t = _table_entry(raw)
            if not isinstance(t, Mapping):
                continue
            name = str(t.get("table", ""))
            if not t.get("database") and not default_db:
                problems.append(problem(("tables", i), f"table {name!r} names no database "
                                         "and the URL has none: write database.table"))
            problems += table_output_problems(i, name, t.get("output"), seen)
        return problems

    @classmethod
    def output_problem(cls, data: Mapping[str, Any], outputs: Sequence[str]
                       ) -> tuple[str, str] | None:
        tables = data.get("tables")
        if not isinstance(tables, list | tuple):
            return None  # (the publication's tables: known once the source describes them)
        return listed_outputs_problem("tables", [_table_entry(t) for t in tables], outputs)

    def table_outputs(self) -> list[tuple[str, str, str]]:
        """``(database, table, output)`` per configured table."""
        default_db = parse_url(self.url)["database"] or ""
        return [(t.database or default_db, t.table, t.output or t.table) for t in self.tables]

    def build(self, name: str, ctx: SourceContext) -> MySqlSource:
        from reclock.sources.mysql.source import MySqlSource

        return MySqlSource(name, self.url, ctx.clock, tables=self.table_outputs(),
                           snapshot=self.snapshot, server_id=self.server_id,
                           identity=ctx.identity, timeout_s=self.timeout / 1000.0,
                           facts=ctx.facts, policies=ctx.schema_change)


PLUGIN = SourcePlugin(name="mysql", config=MySqlConfig, rank=4)
