"""How many rows each table's snapshot holds, for snapshot progress.

Two numbers, one after the other:

* **the catalog's estimate**, at once when the snapshot is taken:
  ``pg_class.reltuples`` scaled to the table's current size in pages, as the
  planner does (:func:`estimate`). Free, but only as good as the last
  ``VACUUM``/``ANALYZE``: unknown for a table never analyzed, stale after a
  bulk load -- which is exactly when a first snapshot is taken;
* **an exact ``count(*)`` under the exported snapshot**, in a thread of the
  driver on a connection of its own (:class:`SnapshotSizes`): the number of
  rows the snapshot's chunks will read, no more and no fewer. The first
  data is not delayed: the chunks are planned and read meanwhile, and the
  estimate is shown until the count is done (tables counted smallest first).

The count costs one more scan of each table (PostgreSQL may answer it from
an index and the visibility map instead), on the server, while the snapshot
reads the same table. It lasts at most as long as the snapshot: once the
snapshot is released (read and durable everywhere, or abandoned) the count
is cancelled, and the number read is then exact anyway. With
``snapshot_count: false`` (the source's configuration) only the estimate is
used, for tables so large that a second scan costs too much. Materialize
offers the same choice for its ``snapshot_records_known``
(``pg_source_snapshot_collect_strict_count``: a strict count, or the
statistics).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg import sql

from reclock.contracts.source import SnapshotSize
from reclock.sources.postgres.catalog import Connection, PgTable, connect, pg_error

log = logging.getLogger("reclock.postgres")


def estimate(pages: int | None, reltuples: float | None, relpages: int | None) -> int | None:
    """A table's rows from its statistics (``pg_class.reltuples`` over
    ``relpages``) and its size now in ``pages``; None when the statistics
    say nothing: never analyzed (``reltuples`` -1), or taken while the table
    had no pages although it has some now."""
    if reltuples is None or reltuples < 0:
        return None
    pages = int(pages or 0)
    relpages = int(relpages or 0)
    if relpages > 0:
        return round(reltuples / relpages * pages)
    if pages == 0:
        return round(reltuples)  # empty (0), or partitioned: the parent has no pages
    return None


def table_label(t: PgTable) -> str:
    return f"{t.schema}.{t.name}"


class SnapshotSizes:
    """The rows of each output's snapshot (``tables``: output index -> its
    table; ``stats``: output index -> its table's pages now, ``reltuples``
    and ``relpages``), estimated at first, each replaced by its exact count
    once :meth:`start` has counted it; :meth:`current` may be called from any
    thread."""

    def __init__(self, tables: Mapping[int, PgTable],
                 stats: Mapping[int, tuple[int, float, int]]) -> None:
        self._lock = threading.Lock()
        self._tables = dict(tables)
        self._stats = dict(stats)
        self._sizes = {i: SnapshotSize(estimate(*stats.get(i, (0, -1.0, 0))), False,
                                       table_label(t)) for i, t in tables.items()}
        self._cancelled = False
        self._conn: Connection | None = None

    def current(self) -> dict[int, SnapshotSize]:
        with self._lock:
            return dict(self._sizes)

    def start(self, dsn: str, params: dict[str, Any], secrets: list[str], snapshot: str,
              who: str, app: str, timeout_s: float) -> None:
        """Count every table under the exported ``snapshot`` in a thread."""
        threading.Thread(target=self._count,
                         args=(dsn, params, secrets, snapshot, who, app, timeout_s),
                         name=app, daemon=True).start()

    def cancel(self) -> None:
        """Stop counting (the snapshot is released): the query in flight is
        cancelled, no other starts."""
        with self._lock:
            self._cancelled = True
            conn = self._conn
        if conn is not None:
            try:
                conn.cancel_safe(timeout=5.0)
            except Exception:  # best effort: the connection may be gone already
                log.debug("cancelling the snapshot count failed", exc_info=True)

    def _count(self, dsn: str, params: dict[str, Any], secrets: list[str], snapshot: str,
               who: str, app: str, timeout_s: float) -> None:
        # smallest first (by the estimate, else its pages at 100 rows each, as
        # the chunks are planned): small tables get their exact number at once
        def size(i: int) -> int:
            rows = self._sizes[i].rows
            return rows if rows is not None else self._stats.get(i, (0, 0.0, 0))[0] * 100

        order = sorted(self._tables, key=lambda i: (size(i), i))
        try:
            with connect(dsn, params, app=app, timeout_s=timeout_s) as conn:
                with self._lock:
                    if self._cancelled:
                        return
                    self._conn = conn
                conn.autocommit = False
                conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                conn.read_only = True
                conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(
                    sql.Literal(snapshot)))
                for i in order:
                    if self._cancelled:
                        break
                    t = self._tables[i]
                    row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(
                        t.ident)).fetchone()
                    n = int(row[0]) if row is not None else 0
                    with self._lock:
                        self._sizes[i] = SnapshotSize(n, True, table_label(t))
                conn.rollback()
        except Exception as exc:  # the count only informs: the snapshot goes on without it
            if not self._cancelled:
                err = pg_error(exc, f"{who}: cannot count the snapshot's rows", secrets)
                log.warning("%s (snapshot progress shows the catalog's estimate)",
                            err.args[0])
        finally:
            with self._lock:
                self._conn = None
