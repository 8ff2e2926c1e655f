"""The PostgreSQL connector's configuration (light: no driver imported until
:meth:`PostgresConfig.build`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field
from pydantic_core import InitErrorDetails

from reclock.clients.postgres import DSN_SECRET, checked_dsn
from reclock.contracts.config import (
    SLOT_PATTERN,
    ConfigModel,
    DurationMs,
    Name,
    problem,
    table_output_problems,
)
from reclock.contracts.source import ConnectorConfig, SourcePlugin, listed_outputs_problem

if TYPE_CHECKING:
    from reclock.contracts.source import SourceContext
    from reclock.sources.postgres.source import PostgresSource


class PgTableConfig(ConfigModel):
    """One replicated table, named exactly (any characters), and its output."""

    table: str = Field(min_length=1, max_length=63)
    """The table's name as the catalog spells it (no quoting needed)."""
    schema_: str = Field(default="public", alias="schema", min_length=1, max_length=63)
    """Its schema."""
    output: Name | None = None
    """The output it feeds; default the table's name (which must then be a
    valid output name)."""


def _table_entry(value: Any) -> Any:
    """``"schema.table"`` / ``"table"`` as the mapping form."""
    if isinstance(value, str):
        schema, dot, table = value.partition(".")
        return {"schema": schema, "table": table} if dot else {"table": value}
    return value


class PostgresConfig(ConnectorConfig):
    """PostgreSQL change data capture (logical replication, ``pgoutput``); its
    FromTime is the LSN, every transaction stamped at its commit LSN. One
    output per table, named after the table unless given."""

    dsn: Annotated[str, AfterValidator(checked_dsn), DSN_SECRET] = Field(min_length=1)
    """``postgresql://user:${PGPASSWORD}@host:port/db`` (a password holding
    reserved characters percent-encoded) or ``host=... dbname=...``; checked
    when the file is loaded; the password is never printed. The role needs
    REPLICATION (or superuser) and SELECT on the tables."""
    tables: tuple[Annotated[PgTableConfig, BeforeValidator(_table_entry)], ...] | None = None
    """``[schema.table, table, {table, schema, output}, ...]`` (schema
    ``public`` by default); each feeds the output named after the table, or
    ``output``. The mapping form takes any table name (spaces, quotes,
    unicode, dots) and gives its output a name. Unset: every table of
    ``publication``."""
    publication: str | None = Field(default=None, min_length=1, max_length=63)
    """Publication name (created for ``tables`` when absent). Default
    ``reclock_<pipeline id>_<source name>`` (see ``slot``)."""
    slot: str | None = Field(default=None, pattern=SLOT_PATTERN)
    """Replication slot name (created when absent). Default
    ``reclock_<pipeline id>_<source name>``: the pipeline id is minted once in
    the remap store, so two pipelines never share a slot. A slot confirmed
    past what the outputs hold (advanced by something else) is a definite
    error. A deployment from before pipeline ids keeps its
    ``reclock_<source name>`` slot."""
    snapshot: bool = True
    """Read the tables' existing rows first (an exported snapshot, in parallel
    Spark tasks), then continue from exactly that point. ``false``: changes only."""
    snapshot_count: bool = True
    """Count each table's rows under the snapshot, in the background while it
    is read, so that snapshot progress (``reclock status``, the metrics) has
    an exact total: one more scan of each table, stopped when the snapshot is
    read. ``false``: the catalog's estimate (``pg_class.reltuples``) only."""
    drop_slot: bool = False
    """``reclock drop`` also drops the replication slot (releasing its WAL)."""
    timeout: DurationMs = 30_000
    """Timeout of connecting, and of a read task waiting for its range."""

    @classmethod
    def check_raw(cls, data: Mapping[str, Any]) -> list[InitErrorDetails]:
        tables = data.get("tables")
        if tables is None and not data.get("publication"):
            return [problem(("tables",), "give tables, or the publication to read them from")]
        problems: list[InitErrorDetails] = []
        seen: dict[str, int] = {}
        for i, raw in enumerate(tables or ()):
            t = _table_entry(raw)
            if not isinstance(t, Mapping):
                continue  # the field's own validation names it
            name = str(t.get("table", ""))
            problems += table_output_problems(i, name, t.get("output"), seen)
        return problems

    @classmethod
    def output_problem(cls, data: Mapping[str, Any], outputs: Sequence[str]
                       ) -> tuple[str, str] | None:
        tables = data.get("tables")
        if not isinstance(tables, list | tuple):
            return None  # (the publication's tables: known once the source describes them)
        return listed_outputs_problem("tables", [_table_entry(t) for t in tables], outputs)

    def table_outputs(self) -> list[tuple[str, str, str]] | None:
        """``(schema, table, output)`` per configured table; None: the publication's."""
        if self.tables is None:
            return None
        return [(t.schema_, t.table, t.output or t.table) for t in self.tables]

    def build(self, name: str, ctx: SourceContext) -> PostgresSource:
        from reclock.sources.postgres.source import PostgresSource

        return PostgresSource(
            name, self.dsn, ctx.clock, publication=self.publication, slot=self.slot,
            identity=ctx.identity, tables=self.table_outputs(), snapshot=self.snapshot,
            snapshot_count=self.snapshot_count, drop_slot=self.drop_slot,
            timeout_s=self.timeout / 1000.0,
            output_names=list(ctx.output_names), facts=ctx.facts,
            policies=ctx.schema_change,
        )


PLUGIN = SourcePlugin(name="postgres", config=PostgresConfig, rank=3)
