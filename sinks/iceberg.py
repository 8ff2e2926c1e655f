"""Apache Iceberg persist sink: one output is one Iceberg table in a catalog
(pyiceberg's SQL catalog on SQLite or PostgreSQL, a REST catalog, or the
AWS Glue Data Catalog), its files in a local warehouse or under an
``s3://`` prefix (pyiceberg's ``PyArrowFileIO``).

Layout of an output (``<location>`` is the table's location in the catalog)::

    <location>/metadata/...                    Iceberg metadata (pyiceberg writes it)
    <location>/data/reclock-{batch}-{part:05d}-{n:03d}.parquet
                                               log mode: staged data files (then committed);
                                               compacted files too (batch "<ms>-compact-<id>")
    <location>/reclock-staging/reclock-{batch}-{part:05d}-{n:03d}.parquet
                                               state mode: staged updates (read by the commit)

The commit path (numbering of :mod:`reclock.contracts.sink`)::

    1. IcebergStager.stage   executors write Parquet files (with the table's
                             field ids) under deterministic names; no
                             snapshot names them, so no reader sees them.
                             The stager holds no catalog connection.
    2. IcebergSink.commit    driver: load the table (snapshot s), check the
                             state s carries equals ``expected``, then ONE
                             catalog commit of ONE Iceberg snapshot on top of
                             s, whose summary carries the new state.

Where the :class:`~reclock.contracts.sink.SinkState` lives: in the summary of
the snapshot that committed it (``reclock.upper``: the upper, ``closed`` for
the empty frontier; ``reclock.progress``; ``reclock.output``: the output's
name; ``reclock.pipeline`` and ``reclock.pipeline_state``: its
:class:`~reclock.contracts.sink.Owner`). :meth:`IcebergSink.state` reads it from
the table's current snapshot, walking back through the parents written by
others (an outside ``rewrite_data_files``, an ``expire_snapshots`` that kept
the current one); reclock's own compactions carry the state forward, so the
walk is short.

Fencing. The catalog commit carries the requirements ``assert-table-uuid``
and ``assert-ref-snapshot-id(main = s)``: the catalog applies it only if the
table's current snapshot is still s, the one whose state was checked (the
SQL catalog: an ``UPDATE ... WHERE metadata_location = <s's>``; a REST
catalog checks the requirements itself; pyiceberg's Glue catalog reads the
Glue table, checks the requirements against it and sends ``UpdateTable``
with the ``VersionId`` it read, which Glue refuses with
``ConcurrentModificationException`` once another commit moved the table on:
a ``CommitFailedException`` like the others). So check + commit is a
compare-and-swap on the state, across machines. (moto's Glue, 5.2.5, does
not enforce ``VersionId``: there a writer landing between that read and
the update is overwritten; tests/gluelock.py adds the lock for the tests.) pyiceberg's own
``Transaction.commit_transaction`` is not used for it: it retries a failed
commit by rebasing the new snapshot on whatever the table holds then, which
would let a zombie's rows in after another driver's commit (pyiceberg
0.12.0's ``commit.retry.num-retries``, default 4). A commit that loses the
race re-reads the state: changed (another writer of the output) is
:class:`~reclock.contracts.sink.SinkFenced`; unchanged (a compaction, an
outside writer) is retried from the new snapshot.

Log mode (``mode: log``): the update log, every column of
:func:`~reclock.contracts.rows.output_schema`. A commit is an append of the
staged files (``Transaction.update_snapshot(snapshot_properties=...)
.merge_append()``: the summary carries the state; manifests are merged once
100 pile up), each file's ``DataFile`` built from its Parquet footer as
pyiceberg's ``add_files`` does, which also checks the staged file is still
there whole.

Upkeep (:meth:`IcebergSink.maintain`): small data files are compacted on a
schedule by a snapshot that carries the state forward and is fenced like a
commit; snapshots past the retention are expired on any tick (never those
from the current one back to the one carrying the state), deleting the data
files only they referenced; staged files no snapshot references are deleted
by :meth:`IcebergSink.vacuum_orphans` past its grace period. A commit costs
time in proportion to the snapshots kept (every commit writes the metadata
file anew, listing them all): hence a retention of minutes, not a day.

State mode (``mode: state``, ``key: [...]``): one row per live key, the
user's columns and ``_into_time`` (the IntoTime of the key's last change),
nothing else: ``SELECT * FROM`` the table is the upstream table plus
``_into_time``. Error rows (refused, undecodable: with their reason and
position) go to a log table of their own beside it, ``<table>_errors`` in
the same namespace (``errors_table``), as the Postgres sink's
``<table>_errors``. A state commit with error rows commits them there first,
with the new state in that snapshot's summary, then the main table; a retry
after a crash between the two finds the errors table's upper at (or past)
the new one and skips that commit (rows below the errors table's upper are
there already), so nothing is lost or doubled. :meth:`IcebergSink.state`
reads the main table only. A commit reads the staged updates, sums each
IntoTime's updates per key by the rule every state table shares
(:func:`~reclock.contracts.state_table.state_changes`: a key's IntoTime
must retract exactly the row it has, if any, and leave at most one; else a
:class:`~reclock.contracts.sink.SinkError` naming the key, and nothing is
written), then writes, in one catalog commit of one snapshot carrying the
new state (``write_mode``):

* ``merge-on-read`` (the default): one data file of the changed keys' new
  rows and one position-delete file of the rows they replace or delete,
  located by the key index (:mod:`reclock.sinks.iceberg_mor`), in one
  ``overwrite`` snapshot of reclock's own producer; compaction rewrites
  the files with many deleted rows (their deletes applied) and merges
  those of few live rows, in passes of at most :data:`STATE_PASS_ROWS`
  rows, moving their entries in the key index file by file, and drops
  the delete files that name no live file;
* ``copy-on-write``: pyiceberg's delete of the changed keys' rows (it
  rewrites each data file holding one) and an append of their new rows.

Types. Iceberg (format 2) has no unsigned, half-float, time-zone-named,
nanosecond or duration types: unsigned integers are stored in the next
wider signed type (uint64 as decimal(20,0)), float16 as float, timestamps in
microseconds (a value with nanoseconds is an error row), with a zone as
``timestamptz`` (UTC), durations as int64 microseconds, times in
microseconds.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Any, BinaryIO, ClassVar, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BeforeValidator, SecretStr
from pydantic import Field as Setting
from pydantic_core import InitErrorDetails

from reclock import faults
from reclock.contracts.config import ConfigModel, DurationMs, problem
from reclock.contracts.consolidate import row_keys
from reclock.contracts.encoding import is_nanos
from reclock.contracts.rows import conform, output_schema, refuse_rows
from reclock.contracts.sink import (
    Owner,
    SinkConfigBase,
    SinkContext,
    SinkError,
    SinkFenced,
    SinkPlugin,
    SinkState,
)
from reclock.contracts.state_table import (
    key_values,
    refuse_null_keys,
    state_changes,
    state_check_raw,
    state_key_of,
)
from reclock.core.clock import Clock, SystemClock
from reclock.core.columns import (
    DIFF,
    ERROR,
    INTO_TIME,
    META_FIELDS,
    META_NAMES,
    SRC_OFFSET,
    SRC_PART,
    SRC_SEQ,
)
from reclock.core.errors import ReclockError, TransientError
from reclock.core.secrets import MASK, Secret, register
from reclock.core.secrets import scrub as _scrub
from reclock.core.urls import URL_SECRET, url_secrets
from reclock.sinks._compaction import (
    COMPACT_MAX_FILES,
    COMPACT_TARGET_SIZE,
    FIRST_PASS_MS,
    bounded_pass,
    compact_switch,
)
from reclock.sinks._compaction import CompactConfig as LakeCompactConfig
from reclock.sinks._compaction import Compaction as LakeCompaction
from reclock.sinks._fs import check_descriptor, check_stage_args
from reclock.sinks._keyindex import KeyIndex
from reclock.sinks._store import (
    AwsAccessConfig,
    Location,
    S3Access,
    S3StorageConfig,
    split_uri,
)
from reclock.sinks.iceberg_mor import (
    add_delete_file,
    add_keyed_file,
    compacted,
    delete_files,
    live_files,
    lookup_paths,
    mark_deleted,
    of_another_layout,
    rebuild,
    row_delta,
    write_position_deletes,
)

log = logging.getLogger("reclock.sinks.iceberg")

#: At most this many rows per staged Parquet file.
ROWS_PER_FILE = 1_000_000
_MAX_FILES_PER_PART = 1000  # the three digits of {n:03d}
#: Commit attempts lost to writers that are not this output's before giving up.
COMMIT_ATTEMPTS = 8
#: Staged files no snapshot references are deleted once older than this.
ORPHAN_GRACE_SECONDS = 6 * 3600.0
#: Snapshots older than this (but never the current one) are expired, and
#: the data files only they referenced deleted. Ten minutes, not Delta's
#: day: every commit writes the table's metadata file anew, listing every
#: snapshot, and parses and copies it (pyiceberg 0.12), so a commit costs
#: time in proportion to the snapshots kept (45 ms at 50, 236 ms at 800;
#: docs/design.md).
RETENTION_MS = 10 * 60_000
#: Expiry runs once the oldest snapshot is this much past the retention.
EXPIRE_SLACK_MS = 60_000
#: A merge-on-read state table's compaction rewrites a data file once this
#: share of its rows is deleted (the Delta sink's state tables' rule,
#: :data:`reclock.sinks.delta_state.STATE_PURGE_SHARE`) ...
PURGE_SHARE = 0.3
#: ... and merges its data files of fewer live rows than this (when
#: ``min_files`` of them pile up): each commit adds one, of the rows it
#: changed; a file of more live rows is left alone, however many small
#: files there are, until its deletes add up ...
STATE_SMALL_ROWS = 100_000
#: ... at most this many live rows a pass (a pass that leaves ``min_files``
#: candidates is followed by the next on the next tick), so that no pass
#: costs time in proportion to the table.
STATE_PASS_ROWS = 1_000_000

#: Attempts of each Glue call (boto3's standard retry mode, exponential
#: backoff): pyiceberg's default, 10, holds a commit up to a minute and
#: more against an unreachable endpoint (77 s measured), where the driver's
#: own retry of a transient error would do; ``properties: {glue.max-retries:
#: N}`` sets another.
GLUE_MAX_RETRIES = 3

#: The properties of a table the sink creates: deletes are copy-on-write
#: (what pyiceberg writes; a merge-on-read state table says merge-on-read,
#: which Spark's own writes to it then follow too); pyiceberg's own commit retries off (reclock
#: fences and retries itself); appends merge manifests once 100 pile up, so
#: a table committed every second keeps few; each commit deletes the
#: metadata files beyond the newest 100 (every commit writes one).
TABLE_PROPERTIES = {
    "format-version": "2",
    "write.delete.mode": "copy-on-write",
    "commit.retry.num-retries": "0",
    "commit.manifest-merge.enabled": "true",
    "commit.manifest.min-count-to-merge": "100",
    "write.metadata.delete-after-commit.enabled": "true",
    "write.metadata.previous-versions-max": "100",
}

KEY_OUTPUT = "reclock.output"
KEY_UPPER = "reclock.upper"
KEY_PROGRESS = "reclock.progress"
KEY_PIPELINE = "reclock.pipeline"
KEY_PIPELINE_STATE = "reclock.pipeline_state"
KEY_OPERATION = "reclock.operation"
CLOSED_TEXT = "closed"

DATA_DIR = "data"
STAGING_DIR = "reclock-staging"
_STAGED = re.compile(r"reclock-[A-Za-z0-9_.-]+-\d{5,}-\d{3}\.parquet")
_COMPACTED = "-compact-"

Mode = Literal["log", "state"]
#: How a state commit replaces rows: position-delete files (the default), or
#: rewriting the data files that hold them.
WriteMode = Literal["merge-on-read", "copy-on-write"]

#: The columns a state table keeps besides the user's.
STATE_META = [f for f in META_FIELDS if f.name == INTO_TIME]
#: The default name of a state table's errors table: ``<table>_errors``
#: (the Postgres sink's too).
ERRORS_SUFFIX = "_errors"


# -- types ---------------------------------------------------------------------------------


def storage_type(t: pa.DataType) -> pa.DataType:
    """The Arrow type a column of type ``t`` is stored as (see the module
    docstring, "Types")."""
    if pa.types.is_dictionary(t):
        return storage_type(t.value_type)
    if pa.types.is_time(t):
        return pa.time64("us")
    if pa.types.is_duration(t):
        return pa.int64()
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", tz=None if t.tz is None else "UTC")
    if pa.types.is_date64(t):
        return pa.date32()
    if pa.types.is_unsigned_integer(t):
        return {8: pa.int32(), 16: pa.int32(), 32: pa.int64()}.get(t.bit_width,
                                                                  pa.decimal128(20, 0))
    if pa.types.is_integer(t) and t.bit_width < 32:
        return pa.int32()
    if pa.types.is_float16(t):
        return pa.float32()
    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return pa.binary()
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return pa.list_(storage_type(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(storage_type(t.field(i).type))
                          for i in range(t.num_fields)])
    if pa.types.is_map(t):
        return pa.map_(storage_type(t.key_type), storage_type(t.item_type))
    return t


def _storable(table: pa.Table) -> pa.Table:
    """Values in the types :func:`storage_type` stores them as: durations as
    int64 microseconds, times and timestamps in microseconds."""
    for i, f in enumerate(table.schema):
        t = f.type
        col = table.column(i)
        if pa.types.is_dictionary(t):
            col, t = col.cast(t.value_type), t.value_type
        if pa.types.is_duration(t):
            col = col.cast(pa.duration("us")).cast(pa.int64())
        elif pa.types.is_time(t) and t != pa.time64("us"):
            col = col.cast(pa.time64("us"))
        elif pa.types.is_timestamp(t) and t.unit == "ns":
            col = col.cast(pa.timestamp("us", tz=t.tz))
        table = table.set_column(i, f.with_type(col.type), col)
    return table


def stored_schema(user: pa.Schema, mode: Mode) -> pa.Schema:
    """The Arrow schema of an output's table (before field ids)."""
    users = pa.schema([f.with_type(storage_type(f.type)) for f in user])
    if mode == "log":
        return output_schema(users)
    output_schema(users)  # (its checks of the names)
    return pa.schema([f.with_nullable(True) for f in users] + STATE_META)


def _plain(t: pa.DataType) -> pa.DataType:
    """``t`` with plain strings and binaries where pyiceberg has large ones;
    nested fields keep their names and field ids (a reader resolves a
    list's element, a map's key and value, a struct's fields by them)."""
    if pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_large_binary(t):
        return pa.binary()
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(t.value_field.with_type(_plain(t.value_type)))
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(_plain(t.field(i).type))
                          for i in range(t.num_fields)])
    if pa.types.is_map(t):
        return pa.map_(t.key_field.with_type(_plain(t.key_type)),
                       t.item_field.with_type(_plain(t.item_type)))
    return t


def _without_ids(schema: pa.Schema) -> pa.Schema:
    return pa.schema([pa.field(f.name, _plain(f.type), f.nullable) for f in schema])


# -- executor side -------------------------------------------------------------------------


@dataclass(frozen=True)
class IcebergStager:
    """Writes staged Parquet files next to the table's data (picklable; no
    catalog connection). ``schema`` is the table's Arrow schema with its
    field ids (``PARQUET:field_id``), so that readers resolve columns by id;
    ``location`` the directory the files go to."""

    name: str
    location: Location
    schema: pa.Schema
    mode: Mode = "log"
    key: tuple[str, ...] = ()
    rows_per_file: int = ROWS_PER_FILE

    def screen(self, table: pa.Table) -> pa.Table:
        """Rows the table cannot store become error rows
        (:func:`reclock.contracts.rows.refuse_rows`): a timestamp, time or
        duration with a sub-microsecond part, and in a state table a null
        key (a tombstone intent, ``_diff`` 0, carries the envelope's key
        alone: only a wholly null key is refused there)."""
        for f in table.schema:
            if f.name in META_NAMES or not is_nanos(f.type):
                continue
            ns = pc.fill_null(pc.cast(table.column(f.name), pa.int64()), 0)
            hit = pa.array(ns.to_numpy() % 1000 != 0)
            table = refuse_rows(table, hit, f"column {f.name!r} holds a value with "
                                            "nanoseconds, which Iceberg (microseconds) cannot "
                                            "store exactly")
        if self.mode == "state" and self.key:
            table = refuse_null_keys(table, self.key)
        return table

    def stage(self, batch_id: str, part: int, table: pa.Table) -> list[dict[str, Any]]:
        """Write ``table`` as ``reclock-{batch_id}-{part:05d}-{n:03d}.parquet``.

        Log mode: rows of the table's schema, in its data directory. State
        mode: the updates (every column of the output, ``_diff`` included),
        in the staging directory, for the commit to sum. One descriptor per
        file: ``path`` (relative to the directory), ``size``, ``rows``,
        ``errors``. Restaging the same ``(batch_id, part)`` overwrites the
        same names (files of an earlier, longer attempt are left for
        :meth:`IcebergSink.vacuum_orphans`)."""
        check_stage_args(batch_id, part)
        if table.num_rows == 0:
            return []
        screened = self.screen(table)
        if self.mode == "log":
            data = conform(self.name, _storable(screened), _without_ids(self.schema))
            data = data.cast(self.schema)
        else:
            users = pa.schema([f for f in self.schema if f.name not in META_NAMES])
            want = output_schema(_without_ids(users))
            data = conform(self.name, _storable(screened), want)
        nfiles = -(-data.num_rows // self.rows_per_file)
        if nfiles > _MAX_FILES_PER_PART:
            raise SinkError(
                f"output {self.name!r}: {data.num_rows} rows in one stage call need "
                f"{nfiles} files (at most {_MAX_FILES_PER_PART})", hint="stage smaller parts")
        staged = []
        for n in range(nfiles):
            chunk = data.slice(n * self.rows_per_file, self.rows_per_file)
            target = f"reclock-{batch_id}-{part:05d}-{n:03d}.parquet"
            size = self.location.write(target, partial(_write_parquet, chunk))
            staged.append({"path": target, "size": size, "rows": chunk.num_rows,
                           "errors": chunk.num_rows - chunk.column(ERROR).null_count})
        return staged


def _write_parquet(table: pa.Table, f: BinaryIO) -> None:
    pq.write_table(table, f, compression="zstd")


# -- driver side ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Compaction(LakeCompaction):
    """When and how :meth:`IcebergSink.maintain` compacts and expires."""

    retention_ms: int = RETENTION_MS


@dataclass(frozen=True)
class _Head:
    """What a table's current snapshot says: its id (``None``: no snapshot),
    the output's state, and the summary keys that carry it."""

    snapshot_id: int | None
    state: SinkState
    keys: dict[str, str]


@dataclass(frozen=True)
class CatalogAccess:
    """How to reach the catalog: pyiceberg's properties (secrets among them,
    never shown: ``repr`` names the type and the masked URI)."""

    kind: str
    properties: dict[str, Any] = field(repr=False)
    shown: str = ""
    #: the catalog's name: the SQL catalog keeps it with every table (its
    #: ``catalog_name`` column), so every engine reading the catalog names it alike
    name: str = "reclock"

    def secrets(self) -> list[str]:
        return url_secrets(self.properties.get("uri", "")) + _property_secrets(self.properties)


class IcebergSink:
    """A :class:`~reclock.contracts.sink.PersistSink` backed by an Iceberg table
    ``table`` (``namespace.name``) of the catalog ``catalog``. ``storage``:
    how the driver and executors reach an ``s3://`` warehouse (also given to
    pyiceberg's FileIO). ``mode``/``key``: the update log, or one row per
    key (see the module docstring). ``owner``: recorded in every snapshot
    summary and compared whenever the state is read. ``clock`` decides file
    ages (:meth:`vacuum_orphans`) and the schedule of :meth:`maintain`."""

    def __init__(self, name: str, catalog: CatalogAccess, table: str, *,
                 storage: S3Access | None = None, mode: Mode = "log",
                 key: Sequence[str] = (), owner: Owner | None = None,
                 clock: Clock | None = None, compaction: Compaction | None = None,
                 rows_per_file: int = ROWS_PER_FILE, errors_table: str | None = None,
                 write_mode: WriteMode = "merge-on-read", index_path: str | None = None
                 ) -> None:
        if mode not in ("log", "state"):
            raise SinkError(f"output {name!r}: mode {mode!r} is not 'log' or 'state'")
        if mode == "state" and not key:
            raise SinkError(f"output {name!r}: mode 'state' needs a key",
                            hint="name the key columns: key: [id]")
        if mode == "log" and key:
            raise SinkError(f"output {name!r}: key only applies to mode 'state'",
                            hint="drop the key, or use mode: state")
        if mode == "log" and errors_table is not None:
            raise SinkError(f"output {name!r}: errors_table only applies to mode 'state'",
                            hint="drop errors_table: a log keeps its error rows in itself")
        parts = table.split(".")
        if len(parts) < 2 or not all(parts):
            raise SinkError(f"output {name!r}: table {table!r} is not namespace.name",
                            hint="name the table with its namespace, e.g. table: lake.orders")
        self.name = name
        self.access = catalog
        self.table_name = table
        self.namespace = tuple(parts[:-1])
        self.storage = storage
        self.mode: Mode = mode
        self.key = tuple(key)
        self.holds_state = mode == "state"
        self.owner = owner
        self.compaction = compaction
        self._clock: Clock = clock or SystemClock()
        self._rows_per_file = rows_per_file
        self._secrets = catalog.secrets() + [s for s in (
            storage.secret_access_key if storage else None,
            storage.session_token if storage else None) if s]
        register(self._secrets)
        self._catalog: Any = None
        self._table: Any = None  # the table as last loaded or committed
        self._user: pa.Schema | None = None
        self._maintain_at: int | None = None
        #: manifest list -> its manifests; manifest -> its files (see _referenced)
        self._manifest_lists: dict[str, list[Any]] = {}
        self._manifest_files: dict[str, frozenset[str]] = {}
        #: state mode: how commits replace rows, and the key index (merge-on-read)
        self.write_mode: WriteMode = write_mode
        self._index_path = index_path
        self._index: KeyIndex | None = None
        self._index_dir: str | None = None  # a temporary index's directory
        #: state mode: the log table of the error rows (see the module docstring)
        self._errors: IcebergSink | None = None
        if mode == "state":
            errors_name = errors_table or table + ERRORS_SUFFIX
            if errors_name == table:
                raise SinkError(f"output {name!r}: errors_table {errors_name!r} is the table "
                                "itself", hint="name another table, or drop errors_table")
            self._errors = IcebergSink(name, catalog, errors_name, storage=storage, clock=clock,
                                       compaction=compaction)

    def __repr__(self) -> str:
        return f"IcebergSink({self.name!r}, {self.access.shown}, table={self.table_name!r})"

    @property
    def target(self) -> str:
        return f"{self.table_name} in {self.access.shown}"

    # -- catalog ---------------------------------------------------------------------------
    def _scrub(self, text: str) -> str:
        return _scrub(text, self._secrets)

    def _fail(self, exc: BaseException, doing: str) -> ReclockError:
        """A located error for a catalog or storage failure: a connection
        refused, a timeout, a server error are transient; the rest definite."""
        text = self._scrub(f"{type(exc).__name__}: {exc}".strip())
        transient = isinstance(exc, ConnectionError | TimeoutError) or re.search(
            r"(?i)connection|timed? ?out|temporar|unavailable|\b50[0234]\b|throttl|"
            r"database is locked", text) is not None
        msg = f"output {self.name!r}: cannot {doing} {self.target}: {text}"
        if transient:
            return TransientError(msg, hint="retried; check the catalog and storage are up")
        return SinkError(msg, hint="check the catalog settings and the table")

    def _cat(self) -> Any:
        if self._catalog is None:
            from pyiceberg.catalog import load_catalog

            try:
                self._catalog = load_catalog(self.access.name, **self.access.properties)
            except ModuleNotFoundError as exc:
                if exc.name != "boto3":
                    raise self._fail(exc, "open the catalog of") from exc
                raise SinkError(f"output {self.name!r}: cannot open {self.target}: a Glue "
                                "catalog needs boto3, which is not installed",
                                hint="pip install 'reclock[glue]' (or boto3)") from exc
            except Exception as exc:
                raise self._fail(exc, "open the catalog of") from exc
        return self._catalog

    def _load(self) -> Any | None:
        """The table as the catalog has it now (``None``: absent)."""
        from pyiceberg.exceptions import NoSuchTableError

        try:
            self._table = self._cat().load_table(self.table_name)
        except NoSuchTableError:
            self._table = None
        except ReclockError:
            raise
        except Exception as exc:
            raise self._fail(exc, "load") from exc
        return self._table

    def _data(self, table: Any) -> Location:
        return self._location(table, DATA_DIR)

    def _location(self, table: Any, sub: str) -> Location:
        base = str(table.location()).rstrip("/")
        scheme, _ = split_uri(base)
        return Location.of(self.name, f"{base}/{sub}",
                           (self.storage or S3Access.resolve()) if scheme == "s3" else None)

    def _staged_dir(self, table: Any) -> Location:
        return self._location(table, DATA_DIR if self.mode == "log" else STAGING_DIR)

    def _file_uri(self, loc: Location, name: str) -> str:
        return f"file://{loc.root}/{name}" if loc.local else f"s3://{loc.root}/{name}"

    # -- schema ----------------------------------------------------------------------------
    def ensure(self, user_schema: pa.Schema) -> None:
        """Create the table (and its namespace) with the output's stored
        schema, or check the existing one. Columns the output gained
        (nullable) are added and widened types (int -> long, float ->
        double, a wider decimal) promoted by a schema update of their own,
        which changes neither the rows nor the current snapshot (so neither
        the state); anything else is a SinkError naming the columns."""
        from pyiceberg.exceptions import NamespaceAlreadyExistsError, TableAlreadyExistsError

        missing = [k for k in self.key if user_schema.get_field_index(k) < 0]
        if missing:
            raise SinkError(f"output {self.name!r}: key columns {missing} of {self.target} are "
                            f"not among the output's columns {user_schema.names}",
                            hint="name the key by output column names (after rename)")
        want = stored_schema(user_schema, self.mode)
        self._user = user_schema
        table = self._load()
        if table is None:
            cat = self._cat()
            try:
                with suppress(NamespaceAlreadyExistsError):
                    cat.create_namespace(self.namespace)
                props = dict(TABLE_PROPERTIES)
                if self.mode == "state" and self.write_mode == "merge-on-read":
                    props.update({"write.delete.mode": "merge-on-read",
                                  "write.update.mode": "merge-on-read",
                                  "write.merge.mode": "merge-on-read"})
                table = cat.create_table(self.table_name, schema=want, properties=props)
            except TableAlreadyExistsError:
                table = self._load()
            except ReclockError:
                raise
            except Exception as exc:
                raise self._fail(exc, "create") from exc
            self._table = table
        if self.mode == "state" and ERROR in self._stored(table).names:
            raise SinkError(f"output {self.name!r}: {self.target} holds error rows beside the "
                            "current ones (the layout before error rows went to a table of "
                            "their own)", hint="write the state output to a new table")
        self._evolve(table, want)
        if self._errors is not None:
            self._errors.ensure(user_schema)

    def _evolve(self, table: Any, want: pa.Schema) -> None:
        from pyiceberg.exceptions import CommitFailedException, ResolveError, ValidationError
        from pyiceberg.io.pyarrow import schema_to_pyarrow

        have = _without_ids(schema_to_pyarrow(table.schema()))
        clashes = []
        for f in want:
            i = have.get_field_index(f.name)
            if i < 0:
                if not f.nullable:
                    clashes.append(f"column {f.name!r} ({f.type} not null) is missing")
                continue
            h = have.field(i)
            if h.nullable != f.nullable and not (h.nullable and not f.nullable):
                clashes.append(f"column {f.name!r}: stored {h.type}"
                               f"{'' if h.nullable else ' not null'}, wanted {f.type}"
                               f"{'' if f.nullable else ' not null'}")
        for h in have:
            if want.get_field_index(h.name) < 0 and not h.nullable:
                clashes.append(f"column {h.name!r} ({h.type} not null) is stored NOT NULL but "
                               "not wanted")
        if clashes:
            raise SinkError(f"output {self.name!r}: the stored schema of {self.target} "
                            "differs: " + "; ".join(clashes),
                            hint="write to a new table, or migrate the table")
        added = [f.name for f in want if have.get_field_index(f.name) < 0]
        changed = [f.name for f in want if have.get_field_index(f.name) >= 0
                   and _plain(have.field(f.name).type) != _plain(f.type)]
        if not added and not changed:
            return
        try:
            with table.update_schema() as update:
                update.union_by_name(pa.schema([f.with_nullable(True) if f.name in added else f
                                                for f in want if f.name in added + changed]))
        except CommitFailedException as exc:
            raise TransientError(f"output {self.name!r}: the schema update of {self.target} "
                                 f"lost to a concurrent commit ({exc})",
                                 hint="retried") from exc
        except (ValueError, TypeError, ResolveError, ValidationError) as exc:
            raise SinkError(f"output {self.name!r}: the stored schema of {self.target} "
                            f"cannot take columns {changed}: {exc}",
                            hint="write to a new table, or set the output's schema_change: "
                                 "freeze to keep the stored types") from exc
        log.info("output %r: added columns %s, widened %s", self.name, added, changed)
        self._load()

    def stager(self) -> IcebergStager:
        from pyiceberg.io.pyarrow import schema_to_pyarrow

        table = self._table or self._load()
        if table is None:
            raise SinkError(f"output {self.name!r}: {self.target} does not exist",
                            hint="call ensure() first")
        schema = schema_to_pyarrow(table.schema())
        # (pyiceberg maps strings to large_string; files store plain ones)
        schema = pa.schema([f.with_type(_plain(f.type)) for f in schema])
        loc = self._staged_dir(table)
        loc.makedirs()
        return IcebergStager(self.name, loc, schema, self.mode, self.key, self._rows_per_file)

    # -- state -----------------------------------------------------------------------------
    def state(self) -> SinkState:
        """The committed state (``SinkState()`` for a table without a
        snapshot of this output, or no table)."""
        table = self._load()
        return SinkState() if table is None else self._head(table).state

    def _head(self, table: Any) -> _Head:
        """The state as of ``table``'s current snapshot: from its summary,
        or its nearest ancestor's that carries reclock's keys."""
        snap = table.current_snapshot()
        head_id = None if snap is None else snap.snapshot_id
        walked = 0
        while snap is not None:
            props = dict(snap.summary.additional_properties) if snap.summary else {}
            if KEY_UPPER in props:
                ours = {k: v for k, v in props.items() if k.startswith("reclock.")}
                return _Head(head_id, self._state_of(props, snap.snapshot_id), ours)
            parent = snap.parent_snapshot_id
            walked += 1
            snap = None if parent is None else table.metadata.snapshot_by_id(parent)
            if snap is None and parent is not None:
                raise SinkError(
                    f"output {self.name!r}: {self.target} no longer holds the snapshot that "
                    f"carries this output's state (snapshot {parent} was expired; "
                    f"{walked} newer snapshots are not reclock's)",
                    hint="let only reclock expire the table's snapshots (it carries its state "
                         "forward), or restart the output into a new table")
        return _Head(head_id, SinkState(), {})

    def _state_of(self, props: Mapping[str, str], snapshot_id: int) -> SinkState:
        output = props.get(KEY_OUTPUT)
        if output is not None and output != self.name:
            raise SinkError(
                f"output {self.name!r}: {self.target} holds the state of output {output!r} "
                f"(snapshot {snapshot_id})",
                hint="two outputs must not write one table: give this output a table of its own")
        if self.owner is not None:
            self.owner.check(self.name, self.target, props.get(KEY_PIPELINE),
                             props.get(KEY_PIPELINE_STATE))
        text = props[KEY_UPPER]
        upper = None if text == CLOSED_TEXT else int(text)
        return SinkState(upper, props.get(KEY_PROGRESS))

    def _summary(self, state: SinkState, operation: str) -> dict[str, str]:
        keys = {KEY_OUTPUT: self.name,
                KEY_UPPER: CLOSED_TEXT if state.upper is None else str(state.upper),
                KEY_OPERATION: operation}
        if state.progress is not None:
            keys[KEY_PROGRESS] = state.progress
        if self.owner is not None:
            keys[KEY_PIPELINE] = self.owner.pipeline
            if self.owner.state is not None:
                keys[KEY_PIPELINE_STATE] = self.owner.state
        return keys

    # -- commit ----------------------------------------------------------------------------
    def commit(self, staged: list[dict[str, Any]], expected: SinkState, new: SinkState) -> None:
        """Make ``staged`` visible and move the state ``expected -> new``:
        load the table, check its state is ``expected`` (else
        :class:`SinkFenced`, nothing written), then one catalog commit of
        one snapshot (state mode: a delete and an append) on top of the
        snapshot checked, fenced by ``assert-ref-snapshot-id`` (see the
        module docstring). A commit that loses to another writer is checked
        again from the newer snapshot."""
        from pyiceberg.exceptions import CommitFailedException

        if not expected.less_equal(new):
            raise ValueError(f"output {self.name!r}: upper would go backwards {expected} -> {new}")
        for d in staged:
            check_descriptor(self.name, "Iceberg", d, _STAGED, {"size": int, "rows": int})
        last: Exception | None = None
        updates: pa.Table | None = None
        settle: Callable[[], None] | None = None
        for _ in range(COMMIT_ATTEMPTS):
            table = self._load()
            if table is None:
                raise SinkError(f"output {self.name!r}: {self.target} does not exist",
                                hint="call ensure() first")
            head = self._head(table)
            if head.state != expected:
                raise SinkFenced(
                    f"output {self.name!r} at {self.target}: durable state is {head.state}, "
                    f"expected {expected}; nothing was written",
                    hint="another pipeline committed this output; re-read its state")
            tx = _transaction(table)
            props = self._summary(new, "commit")
            if self.mode == "log":
                self._append(table, tx, staged, props)
            else:
                if updates is None:  # the first attempt: the error rows go first
                    updates = self._read_staged(table, staged)
                    bad = updates.filter(pc.is_valid(updates.column(ERROR)))
                    if bad.num_rows:
                        self._commit_errors(bad, new)
                        faults.crash_point("after_errors_commit")
                    updates = updates.filter(pc.is_null(updates.column(ERROR)))
                settle = self._apply(table, tx, updates, props, head.snapshot_id)
            try:
                self._commit_tx(table, tx, head.snapshot_id)
            except CommitFailedException as exc:
                last = exc
                if settle is not None:  # its files: referenced by no snapshot
                    loc = self._data(table)
                    for name in getattr(settle, "written", []):
                        with suppress(ReclockError):
                            loc.delete(name)
                    settle = None
                continue
            break
        else:
            raise SinkFenced(
                f"output {self.name!r} at {self.target}: {COMMIT_ATTEMPTS} commit attempts lost "
                f"to concurrent commits (last: {self._scrub(str(last))})",
                hint="another writer is busy on this table; retry")
        if settle is not None:
            try:
                settle()
            except Exception as exc:  # the commit is durable; the index names the old snapshot
                log.warning("output %r: the key index of %s was not updated (%s); the next "
                            "commit rebuilds it", self.name, self.target, exc)
        if self.mode == "state":
            loc = self._staged_dir(table)
            for d in staged:  # read by the commit, referenced by nothing
                try:
                    loc.delete(d["path"])
                except ReclockError as exc:
                    log.warning("output %r: cannot delete staged file %s: %s", self.name,
                                d["path"], exc)

    def _commit_errors(self, bad: pa.Table, new: SinkState) -> None:
        """State mode: the error rows of a commit into the errors table,
        unless an earlier attempt of this commit put them there: only rows at
        or past that table's upper go in (those below it are there already),
        and only when ``new`` moves it (the errors table's state is the upper
        of the last commit that had error rows)."""
        errs = self._errors
        assert errs is not None
        have = errs.state()
        if have.upper is None and have != SinkState():
            return  # closed: every error row is there
        if have.upper is not None and new.upper is not None and have.upper >= new.upper:
            return
        if have.upper is not None:
            bad = bad.filter(pc.greater_equal(bad.column(INTO_TIME), have.upper))
        staged = errs.stager().stage(f"{self._clock.now()}-err-{uuid.uuid4().hex[:8]}", 0, bad)
        errs.commit(staged, have, new)

    def _commit_tx(self, table: Any, tx: Any, base: int | None) -> None:
        """Send ``tx``'s updates to the catalog with the fence: the table is
        the same table, and its main branch still at ``base``. Not
        ``Transaction.commit_transaction``: its retries rebase the snapshot
        over a newer one (see the module docstring)."""
        from pyiceberg.exceptions import CommitFailedException
        from pyiceberg.table import update as _update

        # (pyiceberg's pydantic models: their aliases confuse the type checker)
        AssertRefSnapshotId: Any = _update.AssertRefSnapshotId
        AssertTableUUID: Any = _update.AssertTableUUID
        reqs = [r for r in tx._requirements
                if not isinstance(r, AssertRefSnapshotId | AssertTableUUID)]
        reqs += [AssertTableUUID(uuid=table.metadata.table_uuid),
                 AssertRefSnapshotId(ref="main", snapshot_id=base)]
        try:
            response = self._cat().commit_table(table, tuple(reqs), tuple(tx._updates))
        except CommitFailedException:
            raise
        except ReclockError:
            raise
        except Exception as exc:
            raise self._fail(exc, "commit to") from exc
        old = table.metadata
        table.metadata = response.metadata
        table.metadata_location = response.metadata_location
        self._table = table
        try:  # (what Table._do_commit does after a commit: metadata files beyond the newest)
            self._cat()._delete_old_metadata(table.io, old, response.metadata)
        except Exception as exc:
            log.warning("output %r: old metadata files not deleted: %s", self.name,
                        self._scrub(str(exc)))

    def _append(self, table: Any, tx: Any, staged: list[dict[str, Any]],
                props: dict[str, str]) -> None:
        """Log mode: one append snapshot of the staged files (merging
        manifests once enough pile up: a fast append keeps one per commit)."""
        files = self._data_files(table, staged)
        with tx.update_snapshot(snapshot_properties=props).merge_append() as append:
            for f in files:
                append.append_data_file(f)

    def _data_files(self, table: Any, staged: list[dict[str, Any]]) -> list[Any]:
        """The ``DataFile`` of each staged file, from its Parquet footer (a
        file that is gone or not its staged size is a SinkError)."""
        from pyiceberg.io.pyarrow import parquet_file_to_data_file

        loc = self._staged_dir(table)
        out = []
        for d in staged:
            uri = self._file_uri(loc, d["path"])
            try:
                f = parquet_file_to_data_file(table.io, table.metadata, uri)
            except FileNotFoundError as exc:
                raise SinkError(f"output {self.name!r}: staged file {uri} is gone",
                                hint="restage the batch") from exc
            except ReclockError:
                raise
            except Exception as exc:
                raise self._fail(exc, f"read staged file {d['path']} of") from exc
            if f.file_size_in_bytes != d["size"] or f.record_count != d["rows"]:
                raise SinkError(
                    f"output {self.name!r}: staged file {uri} holds {f.file_size_in_bytes} "
                    f"bytes and {f.record_count} rows, staged as {d['size']} and {d['rows']}",
                    hint="restage the batch")
            out.append(f)
        return out

    def _read_staged(self, table: Any, staged: list[dict[str, Any]]) -> pa.Table:
        loc = self._staged_dir(table)
        user = pa.schema([f for f in self._stored(table) if f.name not in META_NAMES])
        schema = output_schema(user)
        parts = []
        for d in staged:
            uri = self._file_uri(loc, d["path"])
            try:
                with table.io.new_input(uri).open() as f:
                    t = pq.read_table(f)
            except FileNotFoundError as exc:
                raise SinkError(f"output {self.name!r}: staged file {uri} is gone",
                                hint="restage the batch") from exc
            except Exception as exc:
                raise self._fail(exc, f"read staged file {d['path']} of") from exc
            if t.num_rows != d["rows"]:
                raise SinkError(f"output {self.name!r}: staged file {uri} holds {t.num_rows} "
                                f"rows, staged as {d['rows']}", hint="restage the batch")
            parts.append(conform(self.name, t, schema))
        return pa.concat_tables(parts) if parts else schema.empty_table()

    def _stored(self, table: Any) -> pa.Schema:
        from pyiceberg.io.pyarrow import schema_to_pyarrow

        return _without_ids(schema_to_pyarrow(table.schema()))

    def _apply(self, table: Any, tx: Any, good: pa.Table, props: dict[str, str],
               base: int | None) -> Callable[[], None] | None:
        """State mode: the updates ``good`` (no error rows) onto the table, in
        ``tx``: merge-on-read (the default: :meth:`_merge_on_read`) or a
        copy-on-write delete of the changed keys' rows and an append of their
        new rows. The rule of each key's IntoTimes is the Postgres sink's
        (see the module docstring). Returns what to run once the catalog
        commit succeeded (the key index's change), if anything."""
        if self.write_mode == "merge-on-read":
            return self._merge_on_read(table, tx, good, props, base)
        from pyiceberg.io.pyarrow import schema_to_pyarrow

        keys = list(self.key)

        def held_of(values: list[tuple[Any, ...]]) -> list[bool]:
            have = set(_keys_of(self._current(table, values), keys))
            return [a in have for a in _keys_of(self._key_rows(table, values), keys)]

        changed, gone = self._plan(table, good, held_of)
        if gone:
            tx.delete(_match_filter(gone, keys), snapshot_properties=props)
        arrow = schema_to_pyarrow(tx.table_metadata.schema(), include_field_ids=False)
        tx.append(changed.cast(pa.schema([arrow.field(f.name) for f in changed.schema])),
                  snapshot_properties=props)
        return None

    def _plan(self, table: Any, good: pa.Table,
              held_of: Callable[[list[tuple[Any, ...]]], list[bool]]
              ) -> tuple[pa.Table, list[tuple[Any, ...]]]:
        """What the updates ``good`` do to the state table, by the shared rule
        (:func:`~reclock.contracts.state_table.state_changes`): the new rows
        of the keys they leave with a row (in the stored schema), and the key
        values of the keys held before that they change or delete.
        ``held_of`` says, for some keys' values, whether the table holds a
        row for each (values may be unhashable: lists, structs)."""
        stored = self._stored(table)
        user = [f.name for f in stored if f.name not in META_NAMES]
        # each key (as state_changes names it) -> its values in ``good``
        values_of: dict[Any, tuple[Any, ...]] = {}
        cols = [good.column(k).to_pylist() for k in self.key]
        for k, vals in zip(key_values(good, self.key), zip(*cols, strict=True), strict=True):
            values_of.setdefault(k, vals)
        had: set[Any] = set()

        def held(keys: list[Any]) -> set[Any]:
            values = [values_of[k] for k in keys]
            have = held_of(values) if values else []
            had.update(k for k, h in zip(keys, have, strict=True) if h)
            return had

        changes = state_changes(self.name, good, self.key, user, held, self.target)
        gone = [values_of[k] for k in changes.upsert_keys if k in had]
        gone += [values_of[k] for k in changes.deletes]
        return conform(self.name, changes.upserts, stored), gone

    def _key_rows(self, table: Any, values: list[tuple[Any, ...]]) -> pa.Table:
        """The key columns holding ``values``, in the stored types."""
        stored = self._stored(table)
        return pa.table({k: pa.array([v[i] for v in values], stored.field(k).type)
                         for i, k in enumerate(self.key)})

    def _key_texts(self, table: Any, rows: pa.Table) -> list[str]:
        """Each row's key as the key index keeps it: the text of its values,
        in the stored types (equal keys, equal texts)."""
        stored = self._stored(table)
        cols = pa.table({k: rows.column(k).cast(stored.field(k).type) for k in self.key})
        return [repr(k) for k in _keys_of(cols, list(self.key))]

    def _index_at(self, table: Any) -> KeyIndex:
        """The key index, describing ``table``'s current snapshot (rebuilt
        from the table when it describes another)."""
        if self._index is None:
            path = self._index_path
            if path is None:
                self._index_dir = tempfile.mkdtemp(prefix="reclock-iceberg-keys-")
                path = os.path.join(self._index_dir, "keys.sqlite")
            self._index = KeyIndex(path)
            if of_another_layout(self._index):
                self._index.forget()
        snap = table.current_snapshot()
        want = -1 if snap is None else snap.snapshot_id

        def rebuilt(index: KeyIndex) -> None:
            log.info("output %r: rebuilding the key index of %s at snapshot %s", self.name,
                     self.target, want)
            try:
                rebuild(index, table, self.key, partial(self._key_texts, table))
            except ValueError as exc:
                raise SinkError(f"output {self.name!r}: {self.target}: {exc}",
                                hint="write the state output to a new table") from exc

        return self._index.at(want, rebuilt)

    def _merge_on_read(self, table: Any, tx: Any, good: pa.Table, props: dict[str, str],
                       base: int | None) -> Callable[[], None]:
        """Merge-on-read (see :mod:`reclock.sinks.iceberg_mor`): one data file
        of the changed keys' new rows and one position-delete file of the
        rows they replace or delete, in one ``overwrite`` snapshot."""
        from pyiceberg.io.pyarrow import parquet_file_to_data_file

        index = self._index_at(table)
        hits: dict[str, tuple[str, int]] = {}

        def held_of(values: list[tuple[Any, ...]]) -> list[bool]:
            texts = self._key_texts(table, self._key_rows(table, values))
            hits.update(lookup_paths(index, texts))
            return [t in hits for t in texts]

        changed, gone = self._plan(table, good, held_of)
        loc = self._data(table)
        batch = f"{self._clock.now()}-state-{uuid.uuid4().hex[:10]}"
        written: list[str] = []
        data_files, delete_files = [], []
        gone_hits = {t: hits[t] for t in self._key_texts(table, self._key_rows(table, gone))}
        try:
            loc.makedirs()
            if changed.num_rows:
                name = f"reclock-{batch}-00000-000.parquet"
                loc.write(name, partial(_write_parquet, changed.cast(self._arrow_ids(table))))
                written.append(name)
                data_files.append(parquet_file_to_data_file(
                    table.io, table.metadata, self._file_uri(loc, name)))
            if gone_hits:
                name = f"reclock-{batch}-00001-000.parquet"
                written.append(name)
                pairs = list(gone_hits.values())
                delete_files.append(write_position_deletes(
                    table.io, self._file_uri(loc, name), [p for p, _ in pairs],
                    [q for _, q in pairs]))
            snapshot_id = row_delta(tx, props, add_data=data_files,
                                    add_deletes=delete_files)
        except BaseException:
            for name in written:
                with suppress(Exception):
                    loc.delete(name)
            raise
        new_keys = self._key_texts(table, changed)
        base_index = -1 if base is None else base

        def settle() -> None:
            with index.change(snapshot_id, base_index) as ch:
                if ch.stale:  # another writer's rebuild: the next commit rebuilds
                    return
                ch.delete_keys(list(gone_hits))
                mark_deleted(ch, gone_hits)
                if data_files:
                    add_keyed_file(ch, data_files[0].file_path, new_keys)
                if delete_files:
                    add_delete_file(ch, delete_files[0].file_path,
                                    {p for p, _ in gone_hits.values()})
                ch.done = True

        settle.written = written  # type: ignore[attr-defined]
        return settle

    def _arrow_ids(self, table: Any) -> pa.Schema:
        """The table's Arrow schema with its field ids, plain strings."""
        from pyiceberg.io.pyarrow import schema_to_pyarrow

        schema = schema_to_pyarrow(table.schema())
        return pa.schema([f.with_type(_plain(f.type)) for f in schema])

    def _current(self, table: Any, values: list[tuple[Any, ...]]) -> pa.Table:
        """The table's live rows of the keys ``values`` (their key columns only)."""
        keys = list(self.key)
        if table.current_snapshot() is None:
            stored = self._stored(table)
            return pa.table({k: pa.array([], stored.field(k).type) for k in keys})
        scan = table.scan(row_filter=_match_filter(values, keys), selected_fields=tuple(keys))
        try:
            return scan.to_arrow()
        except Exception as exc:
            raise self._fail(exc, "read the keys of") from exc

    # -- reading ---------------------------------------------------------------------------
    def read_updates(self, as_of: int | None = None) -> pa.Table:
        """Log mode: the committed rows with ``_into_time <= as_of`` (all if
        None). State mode: the current rows (``_diff`` 1, positions 0), and
        the error rows up to ``as_of``. Only snapshots are read: staged files
        never show. An output with no table reads as an empty table."""
        from pyiceberg import expressions as ex

        LessThanOrEqual: Any = ex.LessThanOrEqual
        table = self._load()
        if table is None:
            user = self._user if self._user is not None else pa.schema([])
            return output_schema(pa.schema([f.with_type(storage_type(f.type))
                                            for f in user])).empty_table()
        stored = self._stored(table)
        user = pa.schema([f for f in stored if f.name not in META_NAMES])
        schema = output_schema(user)
        try:
            if self.mode == "log":
                scan = (table.scan() if as_of is None
                        else table.scan(row_filter=LessThanOrEqual(INTO_TIME, as_of)))
                data = scan.to_arrow()
                return conform(self.name, data.cast(_without_ids(data.schema)), schema)
            data = table.scan().to_arrow()
        except Exception as exc:
            raise self._fail(exc, "read") from exc
        live = data.cast(_without_ids(data.schema))
        n = live.num_rows
        zeros32 = pa.array([0] * n, pa.int32())
        live = live.append_column(DIFF, pa.array([1] * n, pa.int64())).append_column(
            SRC_PART, zeros32).append_column(SRC_OFFSET, pa.array([0] * n, pa.int64())
                                             ).append_column(SRC_SEQ, zeros32)
        assert self._errors is not None
        errs = self._errors.read_updates(as_of)
        errs = errs.filter(pc.is_valid(errs.column(ERROR)))
        return pa.concat_tables([conform(self.name, live, schema),
                                 conform(self.name, errs, schema)])

    # -- maintenance -----------------------------------------------------------------------
    def _referenced(self, table: Any) -> set[str]:
        """The file names any snapshot of ``table`` references (see
        :meth:`_referenced_paths`)."""
        return {p.rsplit("/", 1)[-1] for p in self._referenced_paths(table)}

    def _referenced_paths(self, table: Any) -> set[str]:
        """The data files (their paths) any snapshot of ``table`` references.
        Manifest lists and manifests never change once written: each is read
        once per sink (a table committed every interval has many snapshots,
        sharing most of their manifests)."""
        paths: set[str] = set()
        for snap in table.metadata.snapshots:
            lists = self._manifest_lists.get(snap.manifest_list)
            if lists is None:
                lists = self._manifest_lists[snap.manifest_list] = list(
                    snap.manifests(table.io))
            for m in lists:
                files = self._manifest_files.get(m.manifest_path)
                if files is None:
                    files = self._manifest_files[m.manifest_path] = frozenset(
                        e.data_file.file_path
                        for e in m.fetch_manifest_entry(table.io, discard_deleted=True))
                paths |= files
        live = {snap.manifest_list for snap in table.metadata.snapshots}
        for gone in set(self._manifest_lists) - live:  # expired snapshots' lists
            del self._manifest_lists[gone]
        return paths

    def vacuum_orphans(self, grace_seconds: float = ORPHAN_GRACE_SECONDS) -> list[str]:
        """Delete files named like reclock's (staged or compacted) that no
        snapshot of the table references, last written more than
        ``grace_seconds`` ago: those of failed commits and discarded jobs,
        and those only snapshots expired since referenced. Files of other
        writers are left alone."""
        table = self._load()
        if table is None:
            return []
        now = self._clock.now() / 1000.0
        try:
            referenced = self._referenced(table)
        except Exception as exc:
            raise self._fail(exc, "read the files of") from exc
        removed: list[str] = []
        for sub in (DATA_DIR, STAGING_DIR):
            loc = self._location(table, sub)
            for name, _size, mtime in loc.files():
                if (_STAGED.fullmatch(name) and name not in referenced
                        and mtime < now - grace_seconds):
                    loc.delete(name)
                    removed.append(f"{sub}/{name}")
        if removed:
            log.info("output %r: removed %d orphan files", self.name, len(removed))
        if self._errors is not None:
            removed += [f"{self._errors.table_name}:{p}"
                        for p in self._errors.vacuum_orphans(grace_seconds)]
        return sorted(removed)

    def maintain(self, now_ms: int) -> dict[str, int]:
        """Compact small data files when due (every ``every_ms``, the first
        pass :data:`FIRST_PASS_MS` after the first call), and expire old
        snapshots whenever the oldest is past the retention by
        :data:`EXPIRE_SLACK_MS` (checked on every call, from the table as
        this sink last loaded or committed it: no I/O): a pyiceberg commit
        costs time in proportion to the snapshots the table keeps (see
        :data:`RETENTION_MS`). Nothing without :attr:`compaction`; neither
        changes the rows nor the state."""
        c = self.compaction
        if c is None:
            return {}
        done: dict[str, int] = {}
        if self._maintain_at is None:
            self._maintain_at = now_ms + min(c.every_ms, FIRST_PASS_MS)
        if now_ms >= self._maintain_at:
            self._maintain_at = now_ms + c.every_ms
            done = self.compact(c.target_size, c.min_files)
            if done.pop("files_left", 0) >= c.min_files:
                self._maintain_at = now_ms  # catching up: the next pass on the next tick
        snaps = self._table.metadata.snapshots if self._table is not None else []
        if snaps and now_ms - min(s.timestamp_ms for s in snaps) > (
                c.retention_ms + EXPIRE_SLACK_MS):
            expired = self.expire(c.retention_ms, now_ms)
            if expired:
                done["snapshots_expired"] = expired
        if self._errors is not None:
            for k, v in self._errors.maintain(now_ms).items():
                done[f"errors_{k}"] = v
        return done

    def compact(self, target_size: int = COMPACT_TARGET_SIZE, min_files: int = 2,
                max_files: int = COMPACT_MAX_FILES) -> dict[str, int]:
        """Merge the data files smaller than ``target_size`` (at least
        ``min_files`` of them, at most ``max_files``) into files of about
        that size, swapped in by one snapshot on top of the current one
        (deleting the small files, adding the merged ones: the same rows)
        whose summary carries the output's state as it is. Fenced like a
        commit: if anything committed meanwhile the pass is dropped (its
        files are orphans for :meth:`vacuum_orphans`)."""
        from pyiceberg.exceptions import CommitFailedException

        table = self._load()
        if table is None or table.current_snapshot() is None:
            return {}
        head = self._head(table)
        if not head.keys:
            return {}
        if self.mode == "state" and self.write_mode == "merge-on-read":
            return self._compact_state(table, head, target_size, min_files, max_files)
        try:
            small = [t.file for t in table.scan().plan_files()
                     if t.file.file_size_in_bytes < target_size and not t.delete_files]
        except Exception as exc:
            raise self._fail(exc, "plan the compaction of") from exc
        if len(small) < min_files:
            return {}
        small = small[:max_files]
        loc = self._data(table)
        batch = f"{self._clock.now()}{_COMPACTED}{uuid.uuid4().hex[:10]}"
        runs: list[list[Any]] = [[]]
        size = 0
        for f in small:
            if runs[-1] and size + f.file_size_in_bytes > target_size:
                runs.append([])
                size = 0
            runs[-1].append(f)
            size += f.file_size_in_bytes
        from pyiceberg.io.pyarrow import schema_to_pyarrow

        schema = schema_to_pyarrow(table.schema())
        schema = pa.schema([f.with_type(_plain(f.type)) for f in schema])
        new_files = []
        for n, run in enumerate(runs):
            if len(run) < 2:
                continue
            parts = []
            for f in run:
                with table.io.new_input(f.file_path).open() as src:
                    t = pq.read_table(src)
                parts.append(conform(self.name, t.cast(_without_ids(t.schema)),
                                     _without_ids(schema)))
            merged = pa.concat_tables(parts).cast(schema)
            name = f"reclock-{batch}-{n:05d}-000.parquet"
            loc.write(name, partial(_write_parquet, merged))
            new_files.append((run, name))
        if not new_files:
            return {}
        from pyiceberg.io.pyarrow import parquet_file_to_data_file

        tx = _transaction(table)
        props = {**head.keys, KEY_OPERATION: "compact"}
        with tx.update_snapshot(snapshot_properties=props).overwrite() as swap:
            for run, name in new_files:
                for f in run:
                    swap.delete_data_file(f)
                swap.append_data_file(parquet_file_to_data_file(
                    table.io, table.metadata, self._file_uri(loc, name)))
        try:
            self._commit_tx(table, tx, head.snapshot_id)
        except CommitFailedException:
            log.info("output %r: a commit came first; the compaction pass is dropped",
                     self.name)
            for _, name in new_files:
                loc.delete(name)
            return {}
        merged_n = sum(len(run) for run, _ in new_files)
        log.info("output %r: compacted %d files into %d", self.name, merged_n, len(new_files))
        return {"files_compacted": merged_n, "files_written": len(new_files)}

    def _compact_state(self, table: Any, head: _Head, target_size: int, min_files: int,
                       max_files: int) -> dict[str, int]:
        """Compaction of a merge-on-read state table, in bounded passes (the
        Delta sink's state tables' rule): the data files with
        :data:`PURGE_SHARE` or more of their rows deleted (and at least
        :data:`STATE_SMALL_ROWS` live), the files of no live row, and the
        files of fewer than :data:`STATE_SMALL_ROWS` live rows (when at least
        ``min_files``), oldest first, at most :data:`STATE_PASS_ROWS` live
        rows and ``max_files`` files a pass, are rewritten with only their
        live rows (their deletes applied) into one file, in one snapshot
        that also drops the delete files that name no other live file; the
        state is carried forward. The key index records, per rewritten file,
        where its live rows went (:func:`~reclock.sinks.iceberg_mor.compacted`),
        rewriting no key. Fenced like a commit; after a kill between the
        catalog commit and the index's change the index names the older
        snapshot and is rebuilt. ``target_size``: unused (the row limits
        bound a pass)."""
        from pyiceberg.exceptions import CommitFailedException
        from pyiceberg.io.pyarrow import parquet_file_to_data_file

        index = self._index_at(table)
        files = live_files(index)
        live = {i: n - len(dv) for i, _, n, dv in files}
        empty = [i for i, _, n, dv in files if live[i] == 0]
        purge = [i for i, _, n, dv in files
                 if live[i] >= STATE_SMALL_ROWS and len(dv) / n >= PURGE_SHARE]
        small = [i for i, _, n, dv in files if 0 < live[i] < STATE_SMALL_ROWS]
        candidates = empty + purge + (small if len(small) >= min_files else [])
        take = bounded_pass(candidates, live, max_files, STATE_PASS_ROWS)
        by_id = {i: (p, n, dv) for i, p, n, dv in files}
        taken = {by_id[i][0] for i in take}
        dropped = [d for d, named in delete_files(index).items() if named <= taken]
        if not dropped and (not take or (len(take) == 1 and not empty and not purge)):
            return {}
        loc = self._data(table)
        schema = self._arrow_ids(table)
        parts = []
        for i in take:
            path, n, dv = by_id[i]
            if live[i] == 0:
                parts.append(schema.empty_table())
                continue
            with table.io.new_input(path).open() as src:
                t = pq.read_table(src)
            if t.num_rows != n:  # not the file the index knows
                log.warning("output %r: data file %s of %s holds %d rows, its key index %d: "
                            "the pass is dropped and the index rebuilt", self.name, path,
                            self.target, t.num_rows, n)
                index.forget()
                return {}
            t = conform(self.name, t.cast(_without_ids(t.schema)), _without_ids(schema))
            if dv:
                keep = np.ones(n, dtype=bool)
                keep[np.fromiter(dv, dtype=np.int64, count=len(dv))] = False
                t = t.filter(pa.array(keep))
            parts.append(t)
        merged = pa.concat_tables(parts).cast(schema) if parts else schema.empty_table()
        written: list[str] = []
        added = []
        if merged.num_rows:
            batch = f"{self._clock.now()}{_COMPACTED}{uuid.uuid4().hex[:10]}"
            name = f"reclock-{batch}-00000-000.parquet"
            loc.write(name, partial(_write_parquet, merged))
            written.append(name)
            added.append(parquet_file_to_data_file(table.io, table.metadata,
                                                   self._file_uri(loc, name)))
        faults.crash_point("mid_compaction")
        tx = _transaction(table)
        props = {**head.keys, KEY_OPERATION: "compact"}
        snapshot_id = row_delta(tx, props, add_data=added, remove=sorted(taken) + dropped)
        try:
            self._commit_tx(table, tx, head.snapshot_id)
        except CommitFailedException:
            log.info("output %r: a commit came first; the compaction pass is dropped",
                     self.name)
            for name in written:
                loc.delete(name)
            return {}
        faults.crash_point("after_compaction")
        with index.change(snapshot_id, -1 if head.snapshot_id is None else head.snapshot_id
                          ) as ch:
            if not ch.stale:
                new = ch.add_file(added[0].file_path, merged.num_rows) if added else 0
                moves, base = [], 0
                for i, part in zip(take, parts, strict=True):
                    moves.append((i, new, base, by_id[i][2]))
                    base += part.num_rows
                compacted(ch, moves, dropped)
                ch.done = True
        left = len(candidates) - len(take)
        log.info("output %r: compacted %d files (%d live rows) into %d, dropped %d delete "
                 "files; %d candidates left", self.name, len(take), merged.num_rows,
                 len(added), len(dropped), left)
        return {"files_compacted": len(take), "files_written": len(added),
                "delete_files_dropped": len(dropped), "files_left": left}

    def expire(self, retention_ms: int, now_ms: int | None = None) -> int:
        """Expire the snapshots older than ``retention_ms`` (never the
        current one, nor one a branch or tag names), fenced on the current
        snapshot, and delete the data files that only they referenced (as
        Iceberg's own expiry does). Returns how many snapshots expired."""
        from pyiceberg.exceptions import CommitFailedException
        from pyiceberg.table.update.snapshot import ExpireSnapshots

        table = self._load()
        if table is None or table.current_snapshot() is None:
            return 0
        now = self._clock.now() if now_ms is None else now_ms
        cutoff = dt.datetime.fromtimestamp((now - retention_ms) / 1000.0, tz=dt.UTC)
        head = self._head(table)
        before = self._referenced_paths(table)
        tx = _transaction(table)
        exp = ExpireSnapshots(tx).older_than(cutoff)
        # Never the snapshots from the current one back to the one carrying
        # the output's state (other writers' snapshots may lie between).
        keep: set[int] = set()
        snap = table.current_snapshot()
        while snap is not None:
            keep.add(snap.snapshot_id)
            if KEY_UPPER in (snap.summary.additional_properties if snap.summary else {}):
                break
            parent = snap.parent_snapshot_id
            snap = None if parent is None else table.metadata.snapshot_by_id(parent)
        ids = set(exp._snapshot_ids_to_expire) - keep
        if not ids:
            return 0
        exp._snapshot_ids_to_expire = ids
        tx._apply(*exp._commit())
        try:
            self._commit_tx(table, tx, head.snapshot_id)
        except CommitFailedException:
            return 0
        # What only the expired snapshots referenced: reclock's files, and the
        # files pyiceberg wrote for its state commits (a copy-on-write delete
        # rewrites files under names of its own), as Iceberg's own expiry does.
        for path in sorted(before - self._referenced_paths(table)):
            try:
                table.io.delete(path)
            except FileNotFoundError:
                pass
            except Exception as exc:
                log.warning("output %r: cannot delete expired file %s: %s", self.name, path,
                            self._scrub(str(exc)))
        return len(ids)

    def close(self) -> None:
        """Drop the catalog (nothing is held between commits)."""
        engine = getattr(self._catalog, "engine", None)
        if engine is not None:
            engine.dispose()
        self._catalog = self._table = None
        if self._errors is not None:
            self._errors.close()
        if self._index is not None:
            self._index.close()
            self._index = None
        if self._index_dir is not None:
            shutil.rmtree(self._index_dir, ignore_errors=True)
            self._index_dir = None


@functools.cache
def _transaction_class() -> Any:
    """pyiceberg's ``Transaction``, with its ``table_metadata`` computed once
    per staged update instead of on every access: pyiceberg 0.12 applies the
    staged updates to the table's metadata and copies the result deeply each
    time, and a snapshot producer asks a dozen times per commit, which made a
    commit cost ~1.2 ms per snapshot the table keeps. The metadata models are
    frozen, so sharing one copy is safe."""
    from pyiceberg.table import Transaction

    class CachedTransaction(Transaction):
        _cached: tuple[Any, Any, Any] | None = None

        @property
        def table_metadata(self) -> Any:
            if not self._updates:  # nothing staged: the table's own (frozen) metadata
                return self._table.metadata
            c = self._cached
            if c is None or c[0] is not self._updates or c[1] is not self._table.metadata:
                c = self._cached = (self._updates, self._table.metadata,
                                    Transaction.table_metadata.fget(self))  # type: ignore[attr-defined]
            return c[2]

    return CachedTransaction


def _transaction(table: Any) -> Any:
    """A transaction on ``table`` (see :func:`_transaction_class`)."""
    return _transaction_class()(table)


def _keys_of(table: pa.Table, keys: list[str]) -> list[Hashable]:
    """Each row's key, comparable across tables: the tuple of its values
    when they are plain scalars (not floats: NaN is not equal to itself),
    else a canonical JSON text (:func:`~reclock.contracts.consolidate.row_keys`)."""
    types = [table.schema.field(k).type for k in keys]
    if all(not pa.types.is_nested(t) and not pa.types.is_floating(t) for t in types):
        cols = [table.column(k).to_pylist() for k in keys]
        return list(zip(*cols, strict=True))
    return list(row_keys(table, keys))


def _match_filter(values: Iterable[tuple[Any, ...]], keys: list[str]) -> Any:
    """An Iceberg expression that matches the rows whose ``keys`` are one
    of ``values``."""
    from pyiceberg import expressions as ex

    AlwaysFalse: Any = ex.AlwaysFalse
    And: Any = ex.And
    EqualTo: Any = ex.EqualTo
    In: Any = ex.In
    Or: Any = ex.Or

    vals = list(values)
    if not vals:
        return AlwaysFalse()
    if len(keys) == 1:
        return In(keys[0], {v[0] for v in vals})
    expr: Any = None
    for v in vals:
        term: Any = EqualTo(keys[0], v[0])
        for k, x in zip(keys[1:], v[1:], strict=True):
            term = And(term, EqualTo(k, x))
        expr = term if expr is None else Or(expr, term)
    return expr


# -- configuration -------------------------------------------------------------------------


#: Catalog properties whose values are secrets, by name (pyiceberg's own
#: secret properties: ``credential``, ``token``, ``s3.secret-access-key``,
#: ``s3.session-token``, ``adls.account-key``, ``gcs.oauth2.token``, ...).
_SECRET_PROPERTY = re.compile(r"(?i)secret|password|token|credential|account-key|sas-token")


def _property_secrets(value: Any) -> list[str]:
    if not isinstance(value, Mapping):
        return []
    return [str(v) for k, v in value.items() if _SECRET_PROPERTY.search(str(k)) and v]


def _shown_properties(value: Any) -> Any:
    if not isinstance(value, Mapping):
        return value
    return {k: MASK if _SECRET_PROPERTY.search(str(k)) else v for k, v in value.items()}


#: A mapping of catalog properties (the secret ones by name).
CATALOG_PROPERTIES = Secret(_property_secrets, _shown_properties)


class CatalogConfig(ConfigModel):
    """The Iceberg catalog that holds the table (pyiceberg's catalogs)."""

    type: Literal["sql", "rest", "glue"]
    """``sql``: pyiceberg's SQL catalog, a SQLite file or a PostgreSQL
    database (``uri``); ``rest``: an Iceberg REST catalog; ``glue``: the
    AWS Glue Data Catalog (pyiceberg's ``GlueCatalog``, reached as ``glue``
    says)."""
    name: str = Setting(default="reclock", min_length=1)
    """The catalog's name (default ``reclock``). A SQL catalog keeps it with
    each table: other engines reading the same catalog database (Spark's
    JDBC catalog, pyiceberg) must use the same name to see the tables."""
    uri: Annotated[str | None, URL_SECRET] = Setting(default=None, min_length=1)
    """``sqlite:////abs/catalog.db``, ``postgresql+psycopg://user:${PW}@host/db``
    (SQLAlchemy URLs; psycopg 3), or the REST catalog's ``https://...``. A
    password in it is never printed. Required for ``sql`` and ``rest``; a
    Glue catalog has none (its endpoint goes in ``glue``)."""
    warehouse: str | None = None
    """Where new tables' files go: a local directory (``/abs/wh`` or
    ``file:///abs/wh``) or ``s3://bucket/prefix``; for a REST catalog, the
    warehouse name it knows (optional); for Glue, ``s3://bucket/prefix``
    (tables go to ``<warehouse>/<namespace>.db/<name>``)."""
    credential: SecretStr | None = None
    """REST: the OAuth2 client credential ``id:secret``."""
    token: SecretStr | None = None
    """REST: a bearer token."""
    glue: AwsAccessConfig | None = None
    """Glue: endpoint, region and credentials of the Glue service (the
    fields of ``storage``, without ``allow_http``). Absent: the sink's
    ``storage`` block's, which suits AWS (no endpoint) and one endpoint
    serving both (LocalStack, moto). Settings given nowhere are left to the
    AWS SDK (``AWS_ENDPOINT_URL_GLUE``, ``AWS_REGION``, the credential
    chain)."""
    properties: Annotated[dict[str, str], CATALOG_PROPERTIES] = Setting(default_factory=dict)
    """Any other pyiceberg catalog property, passed through (e.g.
    ``oauth2-server-uri``, ``scope``, ``header.X-Iceberg-Access-Delegation``;
    Glue: ``glue.id``, the account id of another account's catalog)."""

    @classmethod
    def check_raw(cls, data: Mapping[str, Any]) -> list[InitErrorDetails]:
        kind = data.get("type")
        if kind in ("sql", "rest") and not data.get("uri"):
            return [problem(("uri",), f"required for a {kind} catalog")]
        if kind == "glue" and data.get("uri") is not None:
            return [problem(("uri",), "a glue catalog has no uri: put its endpoint in "
                                      "glue: {endpoint: ...}", on_key=True)]
        if kind != "glue" and data.get("glue") is not None:
            return [problem(("glue",), "only applies to type: glue", on_key=True)]
        props = data.get("properties")
        retries = props.get("glue.max-retries") if isinstance(props, Mapping) else None
        if retries is not None and not re.fullmatch(r"\s*[1-9][0-9]*\s*", str(retries)):
            return [problem(("properties", "glue.max-retries"), "must be a whole number of "
                                                                "attempts, at least 1")]
        return []

    def access(self, storage: S3Access | None,
               storage_given: Mapping[str, str] | None = None) -> CatalogAccess:
        """pyiceberg's properties. ``storage``: how the warehouse is reached
        (its FileIO); ``storage_given``: the ``storage`` block's settings as
        written (:meth:`AwsAccessConfig.given`), what a Glue catalog without
        a ``glue`` block is reached with."""
        from reclock.core.urls import mask_url

        props: dict[str, Any] = {**self.properties, "type": self.type}
        if self.uri is not None:
            props["uri"] = self.uri
        if self.warehouse is not None:
            wh = self.warehouse
            props["warehouse"] = f"file://{wh}" if wh.startswith("/") else wh
        if self.credential is not None:
            props["credential"] = self.credential.get_secret_value()
        if self.token is not None:
            props["token"] = self.token.get_secret_value()
        if storage is not None:
            props.update(_fileio_props(storage))
        if self.type != "glue":
            return CatalogAccess(self.type, props,
                                 f"{self.type} catalog {mask_url(self.uri or '')}", self.name)
        # boto3's retries, a number (pyiceberg passes the property on as given)
        props["glue.max-retries"] = int(self.properties.get("glue.max-retries",
                                                            GLUE_MAX_RETRIES))
        glue = self.glue.given() if self.glue is not None else dict(storage_given or {})
        for key, prop in (("endpoint", "glue.endpoint"), ("region", "glue.region"),
                          ("access_key_id", "glue.access-key-id"),
                          ("secret_access_key", "glue.secret-access-key"),
                          ("session_token", "glue.session-token")):
            if glue.get(key):
                props[prop] = glue[key]
        where = glue.get("endpoint") or glue.get("region") or "of the AWS account"
        return CatalogAccess("glue", props, f"glue catalog {mask_url(where)}", self.name)


def _fileio_props(s3: S3Access) -> dict[str, str]:
    props = {"py-io-impl": "pyiceberg.io.pyarrow.PyArrowFileIO"}
    for key, value in (("s3.endpoint", s3.endpoint), ("s3.region", s3.region),
                       ("s3.access-key-id", s3.access_key_id),
                       ("s3.secret-access-key", s3.secret_access_key),
                       ("s3.session-token", s3.session_token)):
        if value:
            props[key] = value
    return props


class CompactConfig(LakeCompactConfig):
    """When the driver compacts an Iceberg output's small files and expires
    its old snapshots (neither changes its rows nor its state)."""

    retention: DurationMs = Setting(default=RETENTION_MS, ge=60_000)
    """Snapshots older than this are expired (default ``10m``, at least a
    minute; never the current one), checked on every tick, and the data
    files only they referenced deleted: a reader of an older snapshot
    (time travel, a long scan) has this long. A commit costs about 1.2 ms
    per snapshot the table keeps (pyiceberg 0.12), so keep retention over
    the output's interval in the hundreds (one-second interval: ``2m``)."""

    def settings(self) -> Compaction:
        return Compaction(self.every, self.min_files, self.target_size, self.retention)


class IcebergSinkConfig(SinkConfigBase):
    """An Apache Iceberg table in a SQL, REST or Glue catalog: data and the
    output's upper committed in one snapshot, fenced by the catalog."""

    type: Literal["iceberg"] = "iceberg"
    """``iceberg``."""
    catalog: CatalogConfig
    """The catalog: ``{type: sql, uri: sqlite:////abs/cat.db, warehouse: /abs/wh}``,
    ``{type: sql, uri: postgresql+psycopg://..., warehouse: s3://bucket/wh}``,
    ``{type: rest, uri: https://..., credential: ${ID_SECRET}}`` or
    ``{type: glue, warehouse: s3://bucket/wh}``."""
    table: str = Setting(min_length=3, pattern=r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)+$")
    """``namespace.name`` (created with the namespace when absent)."""
    storage: S3StorageConfig | None = None
    """For an ``s3://`` warehouse: endpoint, region and credentials (the
    ``AWS_*`` environment variables otherwise)."""
    mode: Literal["log", "state"] = "log"
    """``log``: every update with ``_into_time``, ``_diff`` and provenance.
    ``state``: the current rows by ``key`` (each commit applies the sum of
    every IntoTime's updates per key, in one snapshot)."""
    key: tuple[str, ...] = ()
    """With ``mode: state``: the key columns; they must contain the output's
    upstream key (:func:`~reclock.contracts.config.state_key_problem`)."""
    errors_table: str | None = Setting(default=None, min_length=3,
                                       pattern=r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)+$")
    """With ``mode: state``: the log table (``namespace.name``) of the error
    rows; default ``<table>_errors``."""
    write_mode: Literal["merge-on-read", "copy-on-write"] = "merge-on-read"
    """With ``mode: state``: how a commit replaces rows: ``merge-on-read``
    (position-delete files; the key index lives in the state directory) or
    ``copy-on-write`` (rewrites every data file holding a changed key)."""
    compact: Annotated[CompactConfig | None, BeforeValidator(compact_switch)] = Setting(
        default_factory=CompactConfig)
    """Compaction and snapshot expiry on a schedule (``compact: off``: never)."""

    TARGET: ClassVar[str] = "table"

    @classmethod
    def target_of(cls, raw: Mapping[str, Any]) -> tuple[str, ...] | None:
        cat = raw.get("catalog")
        if not isinstance(raw.get("table"), str) or not isinstance(cat, Mapping):
            return None
        if cat.get("type") == "glue":
            # one Glue catalog per account, region (and endpoint)
            glue: Any = cat.get("glue") if cat.get("glue") is not None else raw.get("storage")
            glue = glue if isinstance(glue, Mapping) else {}
            props: Any = cat.get("properties")
            props = props if isinstance(props, Mapping) else {}
            where = ":".join(str(x or "") for x in (glue.get("endpoint"), glue.get("region"),
                                                     props.get("glue.id")))
            return ("iceberg", f"glue:{where}", str(raw["table"]))
        return ("iceberg", str(cat.get("uri")), str(raw["table"]))

    @classmethod
    def state_key_of(cls, raw: Mapping[str, Any]) -> tuple[str, ...] | None:
        return state_key_of(raw)

    @classmethod
    def check_raw(cls, data: Mapping[str, Any]) -> list[InitErrorDetails]:
        found = state_check_raw(data)
        if found:
            return found
        if data.get("mode") != "state" and data.get("key"):
            return [problem(("key",), "only applies to mode: state", on_key=True)]
        if data.get("mode") != "state" and data.get("errors_table"):
            return [problem(("errors_table",), "only applies to mode: state", on_key=True)]
        if data.get("errors_table") is not None and data.get("errors_table") == data.get(
                "table"):
            return [problem(("errors_table",), "must differ from table")]
        return []

    def resolved(self, default: Path, base: Path) -> IcebergSinkConfig:
        """A copy whose relative SQLite catalog path and local warehouse
        resolve against the YAML file's directory."""
        cat = self.catalog
        update: dict[str, Any] = {}
        if (cat.uri is not None and cat.uri.startswith("sqlite:///")
                and not cat.uri.startswith("sqlite:////")):
            rel = cat.uri[len("sqlite:///"):]
            update["uri"] = f"sqlite:///{(base / rel).resolve()}"
        wh = cat.warehouse
        if wh is not None and "://" not in wh and not wh.startswith("/"):
            update["warehouse"] = str((base / wh).resolve())
        if not update:
            return self
        return self.model_copy(update={"catalog": cat.model_copy(update=update)})

    def build(self, ctx: SinkContext) -> IcebergSink:
        storage = None
        wh = self.catalog.warehouse or ""
        if self.storage is not None or wh.lower().startswith(("s3://", "s3a://")):
            storage = (self.storage or S3StorageConfig()).access()
        given = self.storage.given() if self.storage is not None else None
        return IcebergSink(ctx.name, self.catalog.access(storage, given), self.table,
                           storage=storage, mode=self.mode, key=self.key, owner=ctx.owner,
                           compaction=None if self.compact is None else self.compact.settings(),
                           errors_table=self.errors_table, write_mode=self.write_mode,
                           index_path=str(ctx.state_dir / "iceberg-keys"
                                          / f"{ctx.name}-{self.table}.sqlite"))


PLUGIN = SinkPlugin(name="iceberg", config=IcebergSinkConfig)
