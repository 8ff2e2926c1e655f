"""Delta Lake persist sink: one output is one Delta table, in a local directory
or under an S3 prefix (``s3://bucket/prefix``, see :mod:`reclock.sinks._store`).

Layout of an output at ``path``::

    path/
      _delta_log/00000000000000000007.json     the Delta log (appends: reclock; the rest:
                                               delta-rs)
      _reclock.lock                            flock held across check + commit (local)
      part-{batch}-{part:05d}-{n:03d}.parquet  data files (staged, then committed;
                                               compacted files too: batch "<ms>-compact-<id>")

The commit path (numbering of :mod:`reclock.contracts.sink`)::

    1. DeltaStager.stage   executors write Parquet files straight into ``path``
                           under deterministic names; the Delta log does not
                           mention them, so no reader sees them.
    2. DeltaSink.commit    driver: take snapshot v, check its state equals
                           ``expected``, then ONE Delta transaction from
                           snapshot v adding every staged file together with
                           the new state. Atomic: the log entry v+1 appears
                           whole or not at all.

Where the :class:`~reclock.contracts.sink.SinkState` lives, inside the Delta log itself:

* ``upper`` -- the Delta *application transaction* (``txn`` action) with
  ``appId = "reclock:<name>"`` and ``version = upper`` (``2**63 - 1`` for the
  empty frontier). Delta keeps the latest ``txn`` per appId in checkpoints, so
  the upper survives log cleanup.
* ``progress`` -- the ``commitInfo`` of the commit carrying that ``txn``
  (custom keys ``reclock.upper``, ``reclock.progress``). It is found by reading
  ``_delta_log/<v>.json`` backwards from the snapshot version, however many
  commits of other writers lie between; a progress whose log entry was
  cleaned up is a loud error, never a silent fallback to the upper alone.
  ``DeltaTable.history()`` is not used for this: on a snapshot that is not
  the newest, delta-rs 1.6.6 returns the newest commits labelled with older
  version numbers, which would pair an upper from one version with the
  progress of another.

Appends written by reclock. On a local table, a commit writes its log entry
v+1 itself (commitInfo, the add actions, the txn) and creates it only if no
entry v+1 exists (:func:`~reclock.sinks._fs.create_exclusive`: a synced temp file
hard-linked to the name). Snapshot v is the one this sink loaded or itself
committed last: versions never change once written, so when the entry v+1
is created the state checked at v was the newest, and the commit is a
compare-and-swap with no read of the log. When entry v+1 exists (another
writer, a compaction, a zombie driver), the sink loads the newest snapshot
with delta-rs, checks the state again (which fences a writer of this output)
and writes the entry after it. A blind append conflicts with no other commit
but a metadata or protocol change, and such a change is in the snapshot
loaded before retrying. delta-rs loading a snapshot and committing cost
12-18 ms of CPU per commit (some of it in its own threads); this costs about
2 ms (``bench/delta_commit_bench.py``), which a driver of a hundred outputs
committing every second needs.
Tables with writer features outside :data:`_DIRECT_FEATURES`, and tables on
S3 (put-if-absent there is a conditional PUT that pyarrow does not make),
are committed to by delta-rs as below.

Fencing. ``commit`` reads the state from snapshot v and commits *from the same
snapshot*. delta-rs's conflict checker rejects (``CommitFailedError:
Concurrent transaction failed``) a commit when any commit after its read
version carries a ``txn`` with the same appId, so check + commit is a
compare-and-swap on the state even between machines, as far as the storage's
put-if-absent is atomic (it is on a local filesystem). Other concurrent
commits (a schema change, another output's writer) make delta-rs fail or
retry; we reload and retry while our state is still ``expected``. On top of
that an ``flock`` on ``_reclock.lock`` serializes committers and
:meth:`DeltaSink.vacuum_orphans` on one machine, so a vacuum can never delete a
file that a commit is about to reference. ``flock`` is local only (unreliable
on NFS); it is not what makes the fence correct.

On S3 the put-if-absent is S3's conditional write (``If-None-Match: *``),
which delta-rs 1.x uses for every log entry: two committers of one version
cannot both succeed, with no locking provider. There is no ``flock`` there;
:meth:`DeltaSink.vacuum_orphans` relies on its grace period alone (a staged
file younger than it is never deleted). A commit whose request reached S3 but
whose answer was lost is ambiguous only until the next state read: a retry
finds the log entry there and is fenced, and the driver re-reads the state
it itself committed.

Compaction (:meth:`DeltaSink.compact`, run on a schedule by
:meth:`DeltaSink.maintain`, which the driver calls between ticks). An output
commits every interval, so its table gathers a small file per commit, and
every reader slows with their number. A compaction pass merges the files
smaller than ``target_size``, in IntoTime order, into files of about that size,
and swaps them in with ONE Delta transaction from snapshot v: a remove action
per merged file, an add action per new file (both ``dataChange: false``: the
rows are the same ones; streaming readers skip the commit), and the output's
txn and commitInfo (upper, progress) exactly as snapshot v has them. So the
state read after a compaction is the state before it. The swap commits only
if none of the files it removes was removed meanwhile, by anyone
(:meth:`DeltaSink._swap`): reclock reads the log entries after v up to the
newest, w, and drops the pass if one of them removed one of its files (an
outside ``OPTIMIZE`` or ``DELETE``, another driver's compaction), committed
this output (its txn: a compaction is fenced like a commit) or changed the
schema or protocol; else it writes the swap as entry w+1, created only if
absent, and reads again from there when someone else wrote w+1 first. On a
local table reclock writes that entry itself; elsewhere (S3, tables with
writer features it does not write) delta-rs writes it, with no retries:
delta-rs's own rebase over a newer commit lets a second removal of one file
through when ``dataChange`` is false, which put the rows both merged in the
table twice (tests/sinks/test_delta_compaction.py pins it). A commit built
on a snapshot older than the compaction is rejected, re-checked (the state
is unchanged) and retried by :meth:`DeltaSink.commit`. The pass's reading
of the table (which files are small), its merges and a delta-rs swap run in
a short-lived child process, as do checkpoints, expiry and the orphan vacuum
(see "maintenance that reads the whole table" below): the driver's memory
stays flat however long it runs. delta-rs's own
``optimize.compact`` is not used: it drops the ``app_transactions`` of its
commit properties (so nothing fences it), and two of its compactions from one
snapshot both commit -- delta-rs 1.6.6 lets concurrent removes of one file
through when ``dataChange`` is false -- which duplicates every row both merged
(tests/sinks/test_delta_compaction.py pins both). A kill during a pass leaves
at most new files no commit references, named like staged files:
:meth:`DeltaSink.vacuum_orphans` deletes them.

Retention. Files a compaction removed stay ``retention`` long, so that readers
of older versions (time travel, a reader still scanning one) keep working;
then :meth:`DeltaSink.expire_removed` (delta-rs's ``vacuum`` in lite mode: only
files a remove action names, once that remove is older than the retention by
the wall clock) deletes them, writing commits of its own (``VACUUM START`` and
``VACUUM END``: no txn, so the state is found behind them like behind any
other writer's commit). The table's ``delta.deletedFileRetentionDuration`` is
set to the retention plus an hour: a checkpoint drops the remove actions older
than that (and delta-rs's vacuum no longer sees them), so the extra hour lets a
pass find each removed file past its retention; other Delta tools (Spark's
``VACUUM``) honour it too. :meth:`DeltaSink.vacuum_orphans` never deletes a
file a remove action of the log names; a removed file whose remove action a
checkpoint dropped (the driver was down meanwhile) is past its retention, and
is deleted by it like an orphan when named like ours (by its next pass that
reads the table: within :data:`FULL_VACUUM_EVERY` passes).

Types. Delta has no time of day, duration, unsigned or half-float types:
such columns are stored as :func:`storage_type` says (times and durations as
int64 microseconds) and read back in the stored type.

Rules this sink relies on (and the data plane keeps): batch ids are unique per
staging attempt (the driver uses ``<now>-<random>``), so restaging never
overwrites a file that is already committed; and staged files are committed
within ``vacuum_orphans``'s grace period.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass
from functools import partial, wraps
from pathlib import Path
from typing import Annotated, Any, BinaryIO, ClassVar, Literal, ParamSpec, TypeVar
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable, Field, Schema, TableFeatures
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from deltalake.transaction import (
    AddAction,
    CommitProperties,
    PostCommitHookProperties,
    RemoveAction,
    Transaction,
)
from pydantic import AfterValidator, BeforeValidator
from pydantic import Field as Setting
from pydantic_core import InitErrorDetails

from reclock import faults
from reclock.clients.s3 import put_if_absent
from reclock.contracts.config import DurationMs, problem
from reclock.contracts.encoding import is_nanos
from reclock.contracts.rows import conform, refuse_rows
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
    Mode,
    check_state_settings,
    refuse_null_keys,
    state_check_raw,
    state_key_of,
)
from reclock.core.clock import Clock, SystemClock
from reclock.core.columns import (
    ERROR,
    INTO_TIME,
    META_FIELDS,
    META_NAMES,
    SRC_OFFSET,
)
from reclock.core.errors import ReclockError
from reclock.core.schema_change import widens
from reclock.sinks._apart import run_apart
from reclock.sinks._compaction import (
    COMPACT_MAX_FILES,
    COMPACT_TARGET_SIZE,
    FIRST_PASS_MS,
    compact_switch,
)
from reclock.sinks._compaction import CompactConfig as LakeCompactConfig
from reclock.sinks._compaction import Compaction as LakeCompaction
from reclock.sinks._deltalog import (
    _COMPACTED,
    _ENGINE,
    _STAGED,
    CLOSED,
    COMMIT_ATTEMPTS,
    KEY_MAINTENANCE,
    KEY_OUTPUT,
    KEY_PIPELINE,
    KEY_PIPELINE_STATE,
    KEY_PROGRESS,
    KEY_UPPER,
    RETENTION_PROPERTY,
    _check_descriptor,
    _decode_txn,
    _delta_schema,
    _encode_txn,
    _Evolution,
    _Head,
    _in_microseconds,
    _interval,
    _metadata_action,
    _write_parquet,
)
from reclock.sinks._deltalog import dictionary_columns as dictionary_columns
from reclock.sinks._fs import (
    check_stage_args,
    create_exclusive,
    exclusive_lock,
    sink_os_error,
)
from reclock.sinks._keyindex import KeyIndex
from reclock.sinks._store import Location, S3Access, S3StorageConfig, split_uri, store_error
from reclock.sinks.delta_state import (
    StateTable,
    _staged_schema,
)
from reclock.sinks.delta_state import read_current as read_current

log = logging.getLogger("reclock.sinks.delta")

#: At most this many rows per Parquet file.
ROWS_PER_FILE = 1_000_000
#: Write a checkpoint when the log has grown this many versions past the last.
#: A commit reads the log entries since the last checkpoint through delta-rs's
#: blocking thread pool, many at once; at a commit a second the pool's threads
#: never idle the 10 s it takes them to exit, so a driver keeps about as many
#: threads as the longest log it reads (100: ~85-120 threads; 25: ~35;
#: bench/soak.py).
CHECKPOINT_INTERVAL = 25
#: Clean up expired log files after every this-many checkpoints.
CLEANUP_EVERY_CHECKPOINTS = 10
#: Default age before an unreferenced staged file counts as an orphan.
ORPHAN_GRACE_SECONDS = 6 * 3600.0
#: Every this-many-th orphan vacuum of a sink (and its first) reads the
#: table even when the directory shows no file it does not know.
FULL_VACUUM_EVERY = 60
#: Every this-many-th maintenance pass (and the first) looks for removed
#: files to expire even when this sink's compactions left none waiting.
EXPIRY_CHECK_EVERY = 6

#: Files a compaction removed are kept a day (the rest of the ``compact``
#: block's defaults: :mod:`reclock.sinks._compaction`).
RETENTION_MS = 24 * 3600_000
#: Rows per Parquet row group of a compacted file (what a reader can skip).
COMPACT_ROW_GROUP = 128 * 1024
#: Small files read ahead while compacting (an object store's latency).
COMPACT_READERS = 32

LOCK_NAME = "_reclock.lock"
#: A state table's error rows: a log table in this directory of the table's
#: (a name Delta's VACUUM leaves alone).
ERRORS_DIR = "_errors"

_STAGED_TMP = re.compile(r"\.part-[A-Za-z0-9_.-]+-\d{5,}-\d{3}\.parquet\.[0-9a-f]+\.tmp")
_MAX_FILES_PER_PART = 1000  # the three digits of {n:03d}
# Temp files of the log entries reclock writes (reclock.sinks._fs.create_exclusive).
_LOG_TMP = re.compile(r"\.\d{20}\.json\.[0-9a-f]{32}\.tmp")

# The names in ``_delta_log`` that make a directory a table for delta-rs:
# a commit, a checksum, a compacted range of commits, or a checkpoint
# (classic, multi-part, or V2 named by a UUID).
_LOG_FILE = re.compile(
    r"\d{20}\.(json|crc|\d{20}\.compacted\.json|checkpoint\.parquet"
    r"|checkpoint\.\d{10}\.\d{10}\.parquet|checkpoint\.[0-9a-f-]{36}\.(json|parquet))")


def has_log(root: str) -> bool:
    """Whether the local table at ``root`` has a log entry or a checkpoint
    (what delta-rs's ``is_deltatable`` asks), read from the file system; a
    scan that stops at the first one."""
    try:
        with os.scandir(os.path.join(root, "_delta_log")) as entries:
            return any(_LOG_FILE.fullmatch(e.name) for e in entries)
    except (FileNotFoundError, NotADirectoryError):
        return False


# We decide ourselves when to checkpoint (see ``_housekeep``): a failing
# post-commit hook must not turn a durable commit into a raised error.
_NO_HOOKS = PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False)


# -- executor side -----------------------------------------------------------------------


@dataclass(frozen=True)
class DeltaStager:
    """Writes staged Parquet files into the table directory (picklable).

    ``schema`` is the table's stored schema as Arrow: every file is cast to it
    so that what readers of the Delta table expect is what the files hold
    (Delta stores e.g. only microsecond timestamps).
    """

    name: str
    location: Location
    schema: pa.Schema
    rows_per_file: int = ROWS_PER_FILE
    #: a state table's key (``mode: state``): rows with a null key are refused
    key: tuple[str, ...] = ()

    def screen(self, table: pa.Table) -> pa.Table:
        """Rows Delta cannot store become error rows (see
        :func:`reclock.contracts.rows.refuse_rows`): a timestamp, time or duration with a
        sub-microsecond part (Delta keeps microseconds; rounding would change
        the value). Nested values are cast as a whole and fail loudly."""
        for f in table.schema:
            if f.name in META_NAMES or not is_nanos(f.type):
                continue
            ns = pc.fill_null(pc.cast(table.column(f.name), pa.int64()), 0)
            hit = pa.array(ns.to_numpy() % 1000 != 0)
            table = refuse_rows(table, hit, f"column {f.name!r} holds a value with "
                                            "nanoseconds, which Delta (microseconds) cannot "
                                            "store exactly")
        if self.key:
            table = refuse_null_keys(table, self.key)
        return table

    def stage(self, batch_id: str, part: int, table: pa.Table) -> list[dict[str, Any]]:
        """Write ``table`` as ``part-{batch_id}-{part:05d}-{n:03d}.parquet`` files.

        Returns one descriptor per file: ``path`` (relative to the table),
        ``size`` (bytes), ``rows``, ``errors`` (error rows among them) and
        ``stats`` (Delta statistics JSON). Rows Delta cannot store become error
        rows first (:meth:`screen`).
        Restaging the same ``(batch_id, part)`` overwrites the same names; files
        of an earlier, longer attempt are left for :meth:`DeltaSink.vacuum_orphans`
        (deleting here could delete a committed file if a batch id were reused).
        """
        check_stage_args(batch_id, part)
        if table.num_rows == 0:
            return []
        data = conform(self.name, _in_microseconds(self.screen(table)), self.schema)
        nfiles = -(-data.num_rows // self.rows_per_file)
        if nfiles > _MAX_FILES_PER_PART:
            raise SinkError(
                f"output {self.name!r}: {data.num_rows} rows in one stage call need "
                f"{nfiles} files (at most {_MAX_FILES_PER_PART})",
                hint="stage smaller parts",
            )
        staged = []
        for n in range(nfiles):
            chunk = data.slice(n * self.rows_per_file, self.rows_per_file)
            target = f"part-{batch_id}-{part:05d}-{n:03d}.parquet"
            size = self.location.write(target, partial(_write_parquet, chunk))
            staged.append({"path": target, "size": size, "rows": chunk.num_rows,
                           "errors": chunk.num_rows - chunk.column(ERROR).null_count,
                           "stats": stats(chunk)})
        return staged








def stats(table: pa.Table) -> str:
    """Delta per-file statistics (JSON): record count, min/max of the
    IntoTime and source offset (what readers prune ``as of`` queries on) and
    null counts of the flat columns. Readers trust these to skip files, so
    they are computed from exactly the rows written."""
    return FileStats().add(table).json()


class FileStats:
    """:func:`stats` of a file written in pieces (a compacted file): the
    same document as for the pieces' concatenation."""

    def __init__(self) -> None:
        self.rows = 0
        self._mins: dict[str, Any] = {INTO_TIME: None, SRC_OFFSET: None}
        self._maxs: dict[str, Any] = {INTO_TIME: None, SRC_OFFSET: None}
        self._nulls: dict[str, int] = {}

    def add(self, table: pa.Table) -> FileStats:
        self.rows += table.num_rows
        for name in (INTO_TIME, SRC_OFFSET):
            mm = pc.min_max(table.column(name))
            lo, hi = mm["min"].as_py(), mm["max"].as_py()
            if lo is not None:
                old = self._mins[name]
                self._mins[name] = lo if old is None else min(old, lo)
                old = self._maxs[name]
                self._maxs[name] = hi if old is None else max(old, hi)
        for f in table.schema:
            if not pa.types.is_nested(f.type):
                self._nulls[f.name] = self._nulls.get(f.name, 0) + table.column(f.name).null_count
        return self

    def json(self) -> str:
        doc = {"numRecords": self.rows, "minValues": self._mins, "maxValues": self._maxs,
               "nullCount": self._nulls}
        return json.dumps(doc, separators=(",", ":"))


# -- driver side --------------------------------------------------------------------------


@dataclass(frozen=True)
class Compaction(LakeCompaction):
    """When :meth:`DeltaSink.maintain` compacts an output, and how long the
    files a compaction removed are kept (the file sink's ``compact`` block)."""

    retention_ms: int = RETENTION_MS
    #: maintenance (merges, table reads) in short-lived child processes
    #: (``sinks/_apart.py``)
    in_child: bool = True
    #: the first pass up to ``every_ms`` later, at a random point (a
    #: pipeline's outputs: a hundred outputs started together otherwise
    #: compacted together, every pass, and their sources' ticks waited)
    spread: bool = False

    @property
    def retention_hours(self) -> int:
        """The retention in whole hours, rounded up (delta-rs vacuums in hours)."""
        return -(-self.retention_ms // 3_600_000)

    @property
    def removes_kept_hours(self) -> int:
        """The table's ``delta.deletedFileRetentionDuration``: how long
        checkpoints keep remove actions. An hour past the retention, so that a
        pass sees each removed file past its retention before a checkpoint
        drops its remove action (a file it misses is deleted by
        :meth:`DeltaSink.vacuum_orphans`)."""
        return self.retention_hours + 1


@dataclass(frozen=True)
class _Small:
    """A data file a compaction may merge."""

    path: str
    size: int
    order: tuple[int, int, int]  # (min IntoTime, min offset, modification time)


def merge_files(location: Location, paths: list[str], name: str,
                schema: pa.Schema) -> dict[str, Any]:
    """Write the rows of the files ``paths`` (of the output at ``location``),
    in order, as file ``name`` in row groups of :data:`COMPACT_ROW_GROUP`
    rows; its descriptor, as :meth:`DeltaStager.stage` gives. The files are scanned as one Arrow
    dataset of the table's schema (a file older than a column reads it as
    nulls), :data:`COMPACT_READERS` files ahead, batches in file order."""
    acc = FileStats()
    data = location.dataset(paths, schema)

    def write(out: BinaryIO) -> None:
        writer: pq.ParquetWriter | None = None
        buffered: list[pa.RecordBatch] = []
        rows = 0

        def flush() -> None:
            nonlocal writer, rows
            t = conform(location.name, pa.Table.from_batches(buffered, schema), schema)
            buffered.clear()
            rows = 0
            if writer is None:
                writer = pq.ParquetWriter(out, schema, use_dictionary=dictionary_columns(t))
            writer.write_table(t, row_group_size=COMPACT_ROW_GROUP)
            acc.add(t)

        for batch in data.to_batches(use_threads=True, fragment_readahead=COMPACT_READERS):
            buffered.append(batch)
            rows += batch.num_rows
            if rows >= COMPACT_ROW_GROUP:
                flush()
        if buffered or writer is None:
            flush()
        assert writer is not None
        writer.close()

    size = location.write(name, write)
    return {"path": name, "size": size, "rows": acc.rows, "stats": acc.json()}


# -- maintenance that reads the whole table (run in a child, see DeltaSink._apart) --------
#
# Each of these loads the table with delta-rs: every file's add action, the
# log since the last checkpoint. Done by the driver, each load leaves
# delta-rs's allocator and runtime, glibc and Python holding a little more,
# hour after hour (bench/soak.py: delta-rs's jemalloc +6 MiB/h with
# checkpoints every 25 commits and a compaction pass every few minutes). So
# they run in a short-lived child (sinks/_apart.py), take plain values and
# return plain values; the driver keeps the lock, the schedule, the crash
# points and the log messages.


def checkpoint_table(location: Location, cleanup_every: int) -> int:
    """Checkpoint the newest version of the table at ``location``; at every
    ``cleanup_every``-th checkpoint interval, then delete the log entries
    older than the table's ``delta.logRetentionDuration`` (30 days) *before*
    that checkpoint: the newest commit, which holds the output's progress,
    stays. Returns the version checkpointed."""
    dt = DeltaTable(location.uri, storage_options=location.storage_options())
    version = dt.version()
    dt.create_checkpoint()
    if (version // CHECKPOINT_INTERVAL) % cleanup_every == 0:
        dt.cleanup_metadata()
    return version


@dataclass(frozen=True)
class _Plan:
    """A compaction pass chosen from snapshot ``version`` (:func:`plan_compaction`)."""

    version: int
    txn: int  # the output's txn as of ``version``
    schema: pa.Schema
    direct: bool  # reclock may write the swap's log entry itself
    runs: list[list[_Small]]
    files_left: int  # small files this pass does not take


def plan_compaction(location: Location, app_id: str, target_size: int, min_files: int,
                    max_files: int) -> _Plan | str:
    """The pass :meth:`DeltaSink.compact` makes over the newest snapshot, or
    why it makes none (``"unmergeable"``: files a raw Parquet read cannot
    merge; ``""``: nothing to do)."""
    dt = DeltaTable(location.uri, storage_options=location.storage_options())
    txn = dt.transaction_version(app_id)
    if txn is None:
        return ""  # nothing of ours committed yet
    if not _can_merge(dt):
        return "unmergeable"
    small = _small_files(dt, target_size)
    if len(small) < max(2, min_files):
        return ""
    take = small
    if len(small) > max_files:
        # Catching up: merge files as they were committed, not the files
        # earlier passes wrote, which every pass would otherwise read and
        # write again; the last pass merges those.
        fresh = [f for f in small if _COMPACTED not in f.path]
        take = fresh if len(fresh) >= max(2, min_files) else small
    runs = _runs(take[:max_files], target_size)
    if not runs:
        return ""
    return _Plan(dt.version(), txn, pa.schema(dt.schema().to_arrow()),
                 location.local and _direct_ok(dt), runs,
                 len(small) - min(len(take), max_files))


def swap_files(location: Location, version: int, actions: list[dict[str, Any]],
               custom: dict[str, Any], app_id: str, txn: int) -> bool:
    """Commit a compaction's removes and adds (``{"remove": {...}}`` /
    ``{"add": {...}}``) with delta-rs as log entry ``version + 1`` exactly
    (a table reclock does not write log entries of itself); False when that
    entry exists. delta-rs is given no retries: its own rebase over a newer
    commit would let a concurrent remove of the same files through (its
    conflict checker does when ``dataChange`` is false), so the caller
    checks the entries in between itself (:meth:`DeltaSink._swap`)."""
    dt = DeltaTable(location.uri, version=version, storage_options=location.storage_options())
    acts: list[AddAction | RemoveAction] = [
        AddAction(**a["add"]) if "add" in a else RemoveAction(**a["remove"]) for a in actions]
    try:
        dt.create_write_transaction(
            acts, "append", dt.schema(),
            commit_properties=CommitProperties(app_transactions=[Transaction(app_id, txn)],
                                               custom_metadata=custom, max_commit_retries=0),
            post_commithook_properties=_NO_HOOKS)
    except CommitFailedError:
        return False
    return True


def swap_conflict(text: str, removes: set[str], app_id: str) -> str | None:
    """Why a compaction that removes the files ``removes`` may not commit
    after the log entry ``text`` (None: it may): the entry removed one of
    them (another compaction, an outside ``OPTIMIZE`` or ``DELETE``: the
    swap would add their rows a second time), committed the output (a txn
    of ``app_id``: the swap would carry the state from before it), or
    changed the table's schema or protocol (the merged files were written
    for the old one)."""
    for line in text.splitlines():
        if not line.strip():
            continue
        doc = json.loads(line)
        if "remove" in doc and unquote(str(doc["remove"].get("path", ""))) in removes:
            return f"it removed {doc['remove']['path']}, which this pass merged"
        if "txn" in doc and doc["txn"].get("appId") == app_id:
            return "it committed this output"
        if "metaData" in doc or "protocol" in doc:
            return "it changed the table's schema or protocol"
    return None


def expire_files(location: Location, hours: int,
                 custom: dict[str, Any]) -> tuple[list[str], int]:
    """:meth:`DeltaSink.expire_removed`'s work: ``(the files deleted, how
    many files remove actions name that are still there and not yet due)``."""
    dt = DeltaTable(location.uri, storage_options=location.storage_options())
    present = {name for name, _, _ in location.files()}

    def removed(retention: int) -> set[str]:
        return present & {os.path.basename(n) for n in dt.vacuum(
            retention_hours=retention, dry_run=True, enforce_retention_duration=False)}

    due = removed(hours)
    waiting = len(removed(0) - due)
    if due:
        dt.vacuum(retention_hours=hours, dry_run=False, enforce_retention_duration=False,
                  commit_properties=CommitProperties(custom_metadata=custom),
                  post_commithook_properties=_NO_HOOKS)
    return sorted(due), waiting


def set_retention(location: Location, name: str, hours: int) -> str | None:
    """Set ``delta.deletedFileRetentionDuration`` of the table at
    ``location`` to ``hours`` (:meth:`DeltaSink._set_retention`); what it
    said before (``""``: nothing), or None when it already said so."""
    want = _interval(hours)
    dt = DeltaTable(location.uri, storage_options=location.storage_options())
    have = (dt.metadata().configuration or {}).get(RETENTION_PROPERTY)
    if have == want or (have is None and hours == DEFAULT_RETENTION_HOURS):
        return None
    dt.alter.set_table_properties(
        {RETENTION_PROPERTY: want},
        commit_properties=CommitProperties(custom_metadata={
            KEY_OUTPUT: name, KEY_MAINTENANCE: "retention"}),
        post_commithook_properties=_NO_HOOKS)
    return have or ""


def orphan_files(location: Location, now: float, grace_seconds: float,
                 kept_after: float) -> tuple[list[str], list[str]]:
    """``(orphans, kept)`` of the table at ``location``: the staged files
    (and their temp files) no version references, last written
    ``grace_seconds`` before ``now`` or earlier (:meth:`DeltaSink.vacuum_orphans`
    deletes them); and the names of the files in its directory that the
    newest version references or a remove action keeps (no orphans), of
    those last written after ``kept_after`` (seconds since the epoch)."""
    dt = DeltaTable(location.uri, storage_options=location.storage_options())
    referenced = {os.path.basename(str(p)) for p in
                  pa.table(dt.get_add_actions(flatten=False)).column("path").to_pylist()}
    # a lite vacuum's dry run with no retention lists exactly the files
    # remove actions name that are still there; it writes nothing
    referenced |= {os.path.basename(n) for n in dt.vacuum(
        retention_hours=0, dry_run=True, enforce_retention_duration=False)}
    listed = location.files()
    return (_old_staged(listed, referenced, now, grace_seconds),
            [name for name, _, mtime in listed if name in referenced and mtime > kept_after])


def _old_staged(listed: list[tuple[str, int, float]], known: set[str], now: float,
                grace_seconds: float) -> list[str]:
    """The files of ``listed`` (``(name, size, mtime)``) named like staged
    files or their temp files, not in ``known``, last written
    ``grace_seconds`` before ``now`` or earlier: younger ones may belong to
    a job still running.

    Ages compare in whole milliseconds, the sink clock's resolution: ``now``
    is that clock's millisecond, and a file written earlier in the same
    millisecond has a file-system time (in nanoseconds) after it, so
    compared exactly it would be younger than no grace at all."""
    return [name for name, _size, mtime in listed
            if (_STAGED.fullmatch(name) or _STAGED_TMP.fullmatch(name))
            and name not in known and now - math.floor(mtime * 1000) / 1000 >= grace_seconds]


def _small_files(dt: DeltaTable, target_size: int) -> list[_Small]:
    """The data files below ``target_size`` a compaction may merge, in
    IntoTime order (then source offset, then age), from their statistics."""
    adds = pa.table(dt.get_add_actions(flatten=True))
    n = adds.num_rows

    def col(name: str) -> list[Any]:
        return adds.column(name).to_pylist() if name in adds.column_names else [None] * n

    out = []
    for path, size, mtime, t0, o0 in zip(
            col("path"), col("size_bytes"), col("modification_time"),
            col(f"min.{INTO_TIME}"), col(f"min.{SRC_OFFSET}"), strict=True):
        if size < target_size and _PLAIN.fullmatch(str(path)):
            out.append(_Small(str(path), int(size), (
                -1 if t0 is None else int(t0), -1 if o0 is None else int(o0), int(mtime))))
    out.sort(key=lambda f: (f.order, f.path))
    return out


def _can_merge(dt: DeltaTable) -> bool:
    """Whether merging raw Parquet files keeps the table's rows: not with
    deletion vectors (rows deleted outside the file) or column mapping
    (stored column names differ)."""
    p = dt.protocol()
    conf = dt.metadata().configuration or {}
    return "deletionVectors" not in (p.reader_features or []) and conf.get(
        "delta.columnMapping.mode", "none") == "none"


# Names of data files a compaction reads (plain names, no escaping needed).
_PLAIN = re.compile(r"[A-Za-z0-9_.=-]+\.parquet")




#: Writer features a blind append of reclock's own honours by what it writes
#: (add actions of files the stager wrote, a txn, a commitInfo). A table with
#: any other one (row tracking, in-commit timestamps, column mapping, check
#: constraints, generated or identity columns, ...) is committed to by
#: delta-rs, which knows them.
_DIRECT_FEATURES = frozenset({"appendOnly", "invariants", "timestampNtz", "changeDataFeed",
                              "deletionVectors", "vacuumProtocolCheck"})


def _direct_ok(dt: DeltaTable) -> bool:
    """Whether reclock may write an append to ``dt``'s table itself: writer
    protocol 2 or below (append-only tables and NOT NULL invariants, which
    the stager's files keep), or table features all in
    :data:`_DIRECT_FEATURES`."""
    p = dt.protocol()
    if p.min_writer_version <= 2:
        return True
    return p.min_writer_version == 7 and set(p.writer_features or ()) <= _DIRECT_FEATURES


def _log_entry(operation: str, parameters: Mapping[str, str], blind: bool, app_id: str,
               txn: int, custom: Mapping[str, Any], actions: list[dict[str, Any]],
               read_version: int) -> bytes:
    """A log entry reclock writes itself: commitInfo, then ``actions``
    (``{"add": ...}`` / ``{"remove": ...}`` with the fields of delta-rs's
    ``AddAction`` / ``RemoveAction``), then the output's txn."""
    now = int(time.time() * 1000)
    info = {"timestamp": now, "operation": operation, "operationParameters": dict(parameters),
            "readVersion": read_version, "isBlindAppend": blind, "engineInfo": _ENGINE,
            "clientVersion": _ENGINE, **custom}
    lines: list[dict[str, Any]] = [{"commitInfo": info}]
    for action in actions:
        if "add" in action:
            a = action["add"]
            lines.append({"add": {
                "path": a["path"], "partitionValues": a["partition_values"], "size": a["size"],
                "modificationTime": a["modification_time"], "dataChange": a["data_change"],
                "stats": a["stats"]}})
        elif "metaData" in action:
            lines.append(action)
        else:
            r = action["remove"]
            lines.append({"remove": {
                "path": r["path"], "deletionTimestamp": r["deletion_timestamp"],
                "dataChange": r["data_change"], "extendedFileMetadata": True,
                "partitionValues": r.get("partition_values") or {}, "size": r["size"]}})
    lines.append({"txn": {"appId": app_id, "version": txn, "lastUpdated": now}})
    return "".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines).encode()


class _Checkpointer:
    """The thread that writes the checkpoints of the process's sinks made
    with ``checkpoint_aside`` (the file sink of a pipeline), one at a time,
    so that no commit waits for one.

    A checkpoint is delta-rs loading the table and writing it whole; among a
    hundred sources' threads, delta-rs's own threads wait for the GIL, and
    one took 1-2 s (0.9 s median) where it takes 10 ms alone: every 25th
    commit of each output kept its source's tick that much longer. A
    checkpoint is only a shortcut for readers; commits do not read the log,
    so its moment does not matter.

    At interpreter exit (:meth:`stop`, registered with :mod:`atexit`) the
    thread finishes the checkpoint it is writing and ends; the ones still
    asked for are dropped. A daemon thread left inside delta-rs while the
    interpreter finalized killed a stopping driver with SIGSEGV (the
    standalone-cluster test, once)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[int, DeltaSink] = {}  # in order of asking
        self._thread: threading.Thread | None = None
        self._stopping = False

    def ask(self, sink: DeltaSink) -> None:
        """Checkpoint ``sink``'s table soon (once, however often asked meanwhile)."""
        with self._cond:
            self._due.setdefault(id(sink), sink)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="delta-checkpoints",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def pending(self) -> int:
        """Checkpoints asked for and not yet written (nor being written)."""
        with self._cond:
            return len(self._due)

    def stop(self, timeout: float = 60.0) -> None:
        """End the thread once its current checkpoint is written."""
        with self._cond:
            self._stopping = True
            self._due.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                sink = self._due.pop(next(iter(self._due)))
            sink._checkpoint()  # logs its own failures


_CHECKPOINTER = _Checkpointer()
atexit.register(_CHECKPOINTER.stop)


#: delta-rs calls in flight at once, over every output of the process. Its
#: runtime does blocking work on at most 512 threads: a thousand outputs
#: opened (or created) at once by a driver of a thousand sources took them
#: all and every call hung (1,000 threads, each ensure() then state(): hung
#: for good; 100 at once: 0.2 s).
_DELTA_CALLS = threading.BoundedSemaphore(64)
_in_call = threading.local()
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _bounded(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """``method`` run holding one of :data:`_DELTA_CALLS` (once per thread:
    the sink's methods that call each other take one)."""

    @wraps(method)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if getattr(_in_call, "held", False):
            return method(*args, **kwargs)
        with _DELTA_CALLS:
            _in_call.held = True
            try:
                return method(*args, **kwargs)
            finally:
                _in_call.held = False

    return call


class DeltaSink(StateTable):
    """A :class:`~reclock.contracts.sink.PersistSink` backed by a Delta table at ``path``
    (a local directory or ``s3://bucket/prefix``; ``storage`` says how to
    reach S3, by default from the ``AWS_*`` environment variables).

    ``lock=False`` drops the local ``flock`` and relies on delta-rs's conflict
    detection alone (the tests use it to show that the fence holds without
    it); keep it on in production so that :meth:`vacuum_orphans` cannot race a
    commit. ``clock`` (seconds since the epoch) only decides file ages for
    :meth:`vacuum_orphans` and the schedule of :meth:`maintain`.
    ``compaction``: compact on a schedule (see :meth:`maintain`); ``None``
    (the default here; the file sink's config turns it on) never does.
    ``owner``: the pipeline this output belongs to, recorded in the commit
    info of every commit (``reclock.pipeline``, ``reclock.pipeline_state``)
    and compared whenever the state is read: a state another pipeline
    committed is :class:`~reclock.contracts.sink.OutputOwned` (None: not recorded nor
    compared).
    """

    holds_state = False  # an update log

    def __init__(
        self,
        name: str,
        path: str | Path,
        *,
        storage: S3Access | None = None,
        lock: bool = True,
        rows_per_file: int = ROWS_PER_FILE,
        clock: Clock | None = None,
        compaction: Compaction | None = None,
        create_lazily: bool = False,
        checkpoint_aside: bool = False,
        owner: Owner | None = None,
        mode: Mode = "log",
        key: tuple[str, ...] | list[str] = (),
        index_dir: str | Path | None = None,
    ) -> None:
        self.name = name
        self.owner = owner
        self.mode: Mode = mode
        self.key = tuple(key)
        check_state_settings(name, mode, self.key)
        self.holds_state = mode == "state"
        self.location = Location.of(name, path, storage)
        self.uri = self.location.uri
        self.app_id = f"reclock:{name}"
        self._lock = lock
        self._rows_per_file = rows_per_file
        self._clock: Clock = clock or SystemClock()  # ms; file ages compare in seconds
        self._schema: pa.Schema | None = None  # cached stored schema, for stager()
        self._fresh: DeltaTable | None = None  # snapshot loaded by ensure(), used once
        self.compaction: Compaction | None = compaction
        self._maintain_at: int | None = None  # clock ms of the next maintenance pass
        self._retention_set = False  # the table's retention property checked once
        self._passes = 0  # maintenance passes run
        #: files a compaction removed wait for their retention (see maintain)
        self._expiring = False
        #: the small files a maintenance pass counts (see maintain): those
        #: last written after the listing of this sink's last compaction
        #: (seconds since the epoch), and the ``files_left`` it did not take.
        #: (What a compaction removed stays in the directory for the
        #: retention, a day of names by default: not held by name.)
        self._compacted_upto = -math.inf
        self._compaction_left = 0
        #: ensure() leaves creating a table that is absent to the first commit
        self._lazily = create_lazily
        #: checkpoints written by the process's checkpointer thread, not in commit
        self._aside = checkpoint_aside
        self._to_create: pa.Schema | None = None  # the user schema of a table to create
        #: the schema change the next commit makes (see _checked)
        self._evolution: _Evolution | None = None
        self._seen_absent = False  # ensure() just found no table (for the next state())
        #: the version this sink committed or loaded last; a commit that finds
        #: the next version taken (another writer's, or a maintenance commit
        #: of this sink's own) loads the newest instead (see :meth:`commit`)
        self._head: _Head | None = None
        #: files of the directory last written after ``_judged`` known not
        #: to be orphans: referenced or kept by the table at the last
        #: vacuum's read, or committed since (see vacuum_orphans)
        self._kept: set[str] = set()
        #: files last written at or before this (seconds since the epoch) were
        #: judged by an earlier vacuum pass
        self._judged = -math.inf
        self._vacuums = 0  # vacuum_orphans passes
        #: a state table's key index is a local file: beside the table, or
        #: for a table on S3 in ``index_dir`` (the pipeline's state dir)
        self._index_dir = (self.location.root if self.location.local and index_dir is None
                           else None if index_dir is None else os.path.abspath(index_dir))
        if self.holds_state and self._index_dir is None:
            raise SinkError(f"output {name!r}: a state table on S3 ({self.uri}) needs a local "
                            "directory for its key index",
                            hint="give the sink index_dir (a pipeline gives its state dir)")
        #: state mode: the user schema ensure() was given, the key index (opened
        #: at the first commit) and the table of error rows beside the table
        self._user: pa.Schema | None = None
        #: a state table's Arrow schema (set by ensure())
        self._stored: pa.Schema | None = None
        self._index: KeyIndex | None = None
        self._errors: DeltaSink | None = None
        if self.holds_state:
            self._lazily = False
            self._errors = DeltaSink(name, self.location.child(ERRORS_DIR)
                                     if not self.location.local
                                     else os.path.join(self.location.root, ERRORS_DIR),
                                     storage=self.location.s3, lock=False, clock=clock,
                                     owner=None)

    def __repr__(self) -> str:
        return f"DeltaSink({self.name!r}, {self.uri!r})"

    @property
    def path(self) -> Path:
        """The table's local directory (a ValueError for a table on S3)."""
        if not self.location.local:
            raise ValueError(f"output {self.name!r} is not on the local filesystem: {self.uri}")
        return Path(self.location.root)

    # -- schema ----------------------------------------------------------------------------
    @_bounded
    def ensure(self, user_schema: pa.Schema) -> None:
        """Create the table with ``output_schema(user_schema)``, or check the
        existing one: the same columns, or a superset of them (extra nullable
        columns are filled with nulls on write). New nullable user columns are
        added by schema evolution; any other difference is a SinkError naming
        the columns. A sink made with ``create_lazily`` (the file sink of a
        pipeline) leaves creating an absent table to its first commit: a
        driver opening a thousand outputs then writes no table it does not
        need yet (:meth:`state` of an output not created is ``SinkState()``,
        as before its first commit). A state table (``mode: state``) is
        created at once (:meth:`_ensure_state`)."""
        if self.holds_state:
            self._ensure_state(user_schema)
            return
        if self._lazily and self._absent():
            self._to_create = user_schema
            self._schema = self._fresh = None
            self._seen_absent = True
            return
        self.location.makedirs()
        with self._locked():
            dt = self._open_or_create(user_schema)
            evolved = self._evolution
            self._schema = pa.schema((dt.schema() if evolved is None else evolved.schema)
                                     .to_arrow())
            # The first state() after ensure() (the driver's open) reuses this
            # snapshot instead of loading the log again.
            self._fresh = dt

    def _open_or_create(self, user_schema: pa.Schema) -> DeltaTable:
        """The table, created for ``user_schema`` if absent, else checked
        against it (see :meth:`ensure`); under the local lock."""
        want = _delta_schema(user_schema)
        conf = (None if self.compaction is None else
                {RETENTION_PROPERTY: _interval(self.compaction.removes_kept_hours)})
        try:
            try:
                dt = self._open()
            except TableNotFoundError:
                try:
                    dt = DeltaTable.create(self.uri, want, mode="error", configuration=conf,
                                           storage_options=self.location.storage_options())
                except DeltaError as exc:
                    try:  # another writer may have created it first
                        dt = self._open()
                    except TableNotFoundError:
                        raise exc from None
                    dt = self._checked(dt, want)
            else:
                dt = self._checked(dt, want)
            dt = self._list_legacy_features(dt)
        except OSError as exc:
            raise self._os_error(exc, "create") from exc
        except DeltaError as exc:
            raise _delta_error(self.name, self.location, exc, "create") from exc
        self._to_create = None
        return dt

    def _checked(self, dt: DeltaTable, want: Schema) -> DeltaTable:
        """``dt`` if its schema holds ``want``, else a SinkError naming the
        columns that differ. Columns ``want`` adds (nullable) and types it
        widens (int -> long) are the table's evolution: the next commit
        applies it with its rows (:meth:`commit`), and the stager writes the
        evolved schema meanwhile."""
        missing, clashes = _compare(dt.schema(), want)
        widened = [c for c in clashes if c.startswith(_WIDENS)]
        clashes = [c for c in clashes if not c.startswith(_WIDENS)]
        if clashes:
            raise SinkError(
                f"output {self.name!r} at {self.uri}: the stored schema differs: "
                + "; ".join(clashes),
                hint="write to a new path, or migrate the table",
            )
        self._evolution = None
        if missing or widened:
            stored = {f.name: f for f in dt.schema().fields}
            target = {f.name: f for f in want.fields}
            fields = [target[n] if n in target and _type_of(target[n]) != _type_of(f) else f
                      for n, f in stored.items()]
            fields += missing
            self._evolution = _Evolution(
                Schema(fields), tuple(f.name for f in missing),
                tuple(c[len(_WIDENS):].split("'")[1] for c in widened))
            log.info("output %r: its next commit adds columns %s and widens %s", self.name,
                     list(self._evolution.added), list(self._evolution.widened))
        return dt

    def _absent(self) -> bool:
        """No table here, known without loading one: a local directory whose
        ``_delta_log`` holds nothing (on S3 this is never known this way)."""
        if not self.location.local:
            return False
        try:
            with os.scandir(os.path.join(self.location.root, "_delta_log")) as entries:
                return next(entries, None) is None
        except FileNotFoundError:
            return True
        except OSError:
            return False

    def _list_legacy_features(self, dt: DeltaTable) -> DeltaTable:
        """List ``invariants`` among the writer features of a table on table
        features (writer version 7, which a timestamp without a zone needs).

        delta-rs lists only the features it needs itself when a table moves to
        table features, not the legacy ones its metadata implies: reclock's
        NOT NULL columns (``_into_time``, ``_diff``, positions) imply
        ``invariants``, and Spark's Delta refuses such a table
        (``DELTA_FEATURES_PROTOCOL_METADATA_MISMATCH``). A commit of its own,
        so a table whose protocol lists ``invariants`` is mended when it is
        next opened."""
        p = dt.protocol()
        if (p.min_writer_version < 7 or "invariants" in (p.writer_features or [])
                or all(f.nullable for f in dt.schema().fields)):
            return dt
        log.info("output %r: listing the invariants writer feature (Spark needs it)", self.name)
        dt.alter.add_feature(TableFeatures.Invariants)
        return self._load()

    @_bounded
    def stager(self) -> DeltaStager:
        if self.holds_state:
            if self._user is None:
                raise SinkError(f"output {self.name!r}: stager() before ensure()",
                                hint="call ensure() first")
            return DeltaStager(self.name, self.location, _staged_schema(self._user),
                               self._rows_per_file, self.key)
        if self._to_create is not None:  # the first commit creates the table
            self.location.makedirs()  # where the stager writes (ensure() did not)
            if self._schema is None:
                self._schema = pa.schema(_delta_schema(self._to_create).to_arrow())
        if self._schema is None:
            evolved = self._evolution
            self._schema = pa.schema((self._load().schema() if evolved is None
                                      else evolved.schema).to_arrow())
        return DeltaStager(self.name, self.location, self._schema, self._rows_per_file)

    # -- state -----------------------------------------------------------------------------
    @_bounded
    def state(self) -> SinkState:
        """The committed state; ``SinkState()`` if the table does not exist."""
        dt, self._fresh = self._fresh, None
        if dt is not None:
            dt.update_incremental()  # only the log entries since ensure()
        elif self._to_create is not None and (self._seen_absent or self._absent()):
            self._seen_absent = False
            return SinkState()  # its first commit creates it
        else:
            try:
                dt = self._open()
            except TableNotFoundError:
                return SinkState()
        self._head = self._head_of(dt)
        return self._head.state

    def _state_of(self, dt: DeltaTable) -> SinkState:
        """The state as of ``dt``'s snapshot (and only that snapshot)."""
        return self._state_at(dt.version(), dt.transaction_version(self.app_id))

    def _state_at(self, version: int, txn: int | None) -> SinkState:
        """The state as of ``version``, where the output's txn is ``txn``."""
        if txn is None:
            return SinkState()
        upper = None if txn == CLOSED else txn
        return SinkState(upper, self._progress_at(version, txn))

    def _progress_at(self, version: int, txn: int) -> str | None:
        """``reclock.progress`` of the newest commit ``<= version`` carrying our
        txn, however many other commits lie between. Never a silent guess: if
        that commit's log entry was cleaned up, or the log disagrees with
        itself, this is a :class:`SinkError` (an upper without its progress
        would make the driver write records again)."""
        for v in range(version, -1, -1):
            text = self.location.read_text(f"_delta_log/{v:020d}.json")
            if text is None:
                raise SinkError(
                    f"output {self.name!r}: the Delta log no longer holds the commit that "
                    f"carries this output's progress (entries up to v{v} were cleaned up, "
                    f"{version - v} newer commits are not ours)",
                    hint="raise the table's delta.logRetentionDuration, or let only reclock "
                         "commit to the output's table; then restart the output from a new "
                         "path (its exact position is lost)") from None
            info, ours = _scan_commit(text, self.app_id)
            if ours is None:
                continue
            if ours != txn or info.get(KEY_UPPER) != _decode_txn(txn):
                raise SinkError(
                    f"output {self.name!r}: commit {v} carries txn {ours} / upper "
                    f"{info.get(KEY_UPPER)!r}, but the snapshot says {txn}: the Delta log "
                    "disagrees with itself",
                    hint="another writer uses this output's application id; give the output "
                         "its own table")
            if self.owner is not None:
                self.owner.check(self.name, self.uri, _text(info.get(KEY_PIPELINE)),
                                 _text(info.get(KEY_PIPELINE_STATE)))
            progress = info.get(KEY_PROGRESS)
            return progress if isinstance(progress, str) else None
        return None  # the table's whole log, and no commit of ours: never committed

    # -- commit ----------------------------------------------------------------------------
    @_bounded
    def commit(self, staged: list[dict[str, Any]], expected: SinkState, new: SinkState) -> None:
        """Make ``staged`` visible and move the state ``expected -> new``.

        1. Check the request: ``new`` does not go backwards, descriptors name
           plain files in the table directory.
        2. Take the local lock (serializes committers and vacuum on this host).
        3. Load snapshot v and check its state equals ``expected``, else
           :class:`SinkFenced` (nothing written).
        4. Check every staged file is still there with its staged size (a
           vacuum or a second attempt did not touch it), else :class:`SinkError`.
        5. One Delta transaction from snapshot v: an add action per file, the
           txn ``(reclock:<name>, upper)``, the progress in commitInfo. delta-rs
           rejects it if a commit after v carries our txn (lost race: step 3
           again, which fences); an unrelated concurrent commit means retry
           from step 3.
        6. Housekeeping: checkpoint every :data:`CHECKPOINT_INTERVAL` versions,
           log cleanup now and then. Best effort: the commit is already durable.
        """
        if not expected.less_equal(new):
            raise ValueError(f"output {self.name!r}: upper would go backwards {expected} -> {new}")
        if self.holds_state:
            self._commit_state(staged, expected, new)
            return
        version = _encode_txn(new.upper)
        adds = [_check_descriptor(self.name, d) for d in staged]
        custom = {KEY_OUTPUT: self.name, KEY_UPPER: _decode_txn(version),
                  KEY_PROGRESS: new.progress, **self._owner_keys()}
        props = CommitProperties(app_transactions=[Transaction(self.app_id, version)],
                                 custom_metadata=custom)
        if self._to_create is not None:
            self.location.makedirs()  # (its lock file lives there)
        with self._locked():
            last: Exception | str | None = None
            for attempt in range(COMMIT_ATTEMPTS):
                head, self._head = self._head, None  # trusted again once this commit lands
                dt: DeltaTable | None = None
                if (attempt > 0 or head is None or not head.direct or head.state != expected
                        or self._evolution is not None or not self._logged(head.version)):
                    dt = self._load() if self._to_create is None else self._open_or_create(
                        self._to_create)
                    head = self._head_of(dt)
                if head.state != expected:
                    raise SinkFenced(
                        f"output {self.name!r} at {self.uri}: durable state is {head.state}, "
                        f"expected {expected}; nothing was written",
                        hint="another pipeline committed this output; re-read its state",
                    )
                if head.direct:
                    evolve: list[dict[str, Any]] = []
                    if self._evolution is not None:
                        assert dt is not None
                        evolve = self._evolve_actions(dt)
                    entry = _log_entry(
                        "WRITE", {"mode": "Append"}, not evolve, self.app_id, version, custom,
                        [*evolve, *({"add": self._add_action(d)} for d in adds)], head.version)
                    if not self._put_entry(head.version + 1, entry):
                        last = f"version {head.version + 1} was written by another commit"
                        for a in evolve:  # the files the evolution rewrote: never referenced
                            if "add" in a:
                                self.location.delete(a["add"]["path"])
                        continue  # someone committed after v: re-check from a new snapshot
                    evo, self._evolution = self._evolution, None
                    if evo is not None:
                        self._kept.update(a["add"]["path"] for a in evolve if "add" in a)
                        log.info("output %r: added columns %s, widened %s", self.name,
                                 list(evo.added), list(evo.widened))
                    self._head = _Head(head.version + 1, new, True)
                    break
                assert dt is not None
                if self._evolution is not None:
                    dt = self._evolve_apart(dt)
                actions: list[AddAction | RemoveAction] = [
                    AddAction(**self._add_action(d)) for d in adds]
                try:
                    dt.create_write_transaction(
                        actions, "append", dt.schema(),
                        commit_properties=props, post_commithook_properties=_NO_HOOKS,
                    )
                except CommitFailedError as exc:
                    last = exc  # someone committed after v: re-check from a new snapshot
                    continue
                except OSError as exc:
                    raise self._os_error(exc, "commit to") from exc
                except DeltaError as exc:
                    raise _delta_error(self.name, self.location, exc, "commit to") from exc
                break
            else:
                raise SinkFenced(
                    f"output {self.name!r} at {self.uri}: {COMMIT_ATTEMPTS} commit attempts "
                    f"lost to concurrent commits (last: {last})",
                    hint="another writer is busy on this table; retry",
                )
            self._kept.update(d["path"] for d in adds)  # committed: no orphans
        self._housekeep(head.version + 1)

    def _evolve_actions(self, dt: DeltaTable) -> list[dict[str, Any]]:
        """The actions that make the pending evolution in a log entry of
        reclock's own, with the commit's rows: the table's metadata with the
        new schema and, for each widened column, every data file rewritten in
        the new type (removed and added again, ``dataChange: false``: the
        same rows). Readers need no table feature for it (delta-rs reads no
        table with type widening)."""
        evo = self._evolution
        assert evo is not None
        actions: list[dict[str, Any]] = [_metadata_action(dt, evo.schema)]
        if not evo.widened:
            return actions
        schema = pa.schema(evo.schema.to_arrow())
        files = pa.table(dt.get_add_actions(flatten=True))
        batch = f"{self._clock.now()}-widen-{uuid.uuid4().hex[:10]}"
        now = int(time.time() * 1000)
        for k, (path, size) in enumerate(zip(files.column("path").to_pylist(),
                                             files.column("size_bytes").to_pylist(),
                                             strict=True)):
            d = merge_files(self.location, [str(path)], f"part-{batch}-{k:05d}-000.parquet",
                            schema)
            actions.append({"remove": {"path": str(path), "data_change": False,
                                       "deletion_timestamp": now, "size": int(size)}})
            actions.append({"add": self._add_action(d, data_change=False)})
        return actions

    def _evolve_apart(self, dt: DeltaTable) -> DeltaTable:
        """The pending evolution on a table delta-rs commits to (S3, other
        writer features): columns are added by a commit of their own just
        before the rows' (delta-rs writes no schema change with an append);
        a widening cannot be made there."""
        evo = self._evolution
        assert evo is not None
        if evo.widened:
            raise SinkError(
                f"output {self.name!r} at {self.uri}: columns {list(evo.widened)} widened "
                "upstream, and this table (on S3, or with writer features reclock does not "
                "write itself) cannot be widened by reclock",
                hint="re-read the output into a new path (`reclock resnapshot` with a new "
                     "target), or set the output's schema_change: freeze to keep the type")
        try:
            dt.alter.add_columns([f for f in evo.schema.fields if f.name in evo.added])
        except DeltaError as exc:
            raise _delta_error(self.name, self.location, exc, "add columns to") from exc
        self._evolution = None
        return self._load()

    def _owner_keys(self) -> dict[str, str]:
        """The commit info keys that name this output's pipeline."""
        if self.owner is None:
            return {}
        keys = {KEY_PIPELINE: self.owner.pipeline}
        if self.owner.state is not None:
            keys[KEY_PIPELINE_STATE] = self.owner.state
        return keys

    def _head_of(self, dt: DeltaTable) -> _Head:
        """What snapshot ``dt`` tells a commit on top of it (reclock writes the
        log entries of a local table, and of a state table on S3 too)."""
        return _Head(dt.version(), self._state_of(dt),
                     (self.location.local or self.holds_state) and _direct_ok(dt))

    def _logged(self, version: int) -> bool:
        """Whether log entry ``version`` is still there (a table removed and
        made again under the same path starts its versions over)."""
        return self.location.stat(f"_delta_log/{version:020d}.json") is not None

    def _put_entry(self, version: int, entry: bytes) -> bool:
        """Write log entry ``version`` unless it exists: locally a hard link
        (:func:`create_exclusive`), on S3 a conditional PUT
        (``If-None-Match: *``, :func:`reclock.clients.s3.put_if_absent`; 412:
        another writer's entry is there)."""
        if self.location.s3 is not None:
            bucket, _, prefix = self.location.root.partition("/")
            key = f"{prefix}/_delta_log/{version:020d}.json" if prefix else \
                f"_delta_log/{version:020d}.json"
            try:
                return put_if_absent(self.location.s3, bucket, key, entry)
            except OSError as exc:
                raise store_error(self.name, self.location.child(f"_delta_log/{version:020d}"
                                                                 ".json"), exc, "commit to"
                                  ) from exc
        target = os.path.join(self.location.root, "_delta_log", f"{version:020d}.json")
        try:
            return create_exclusive(target, entry)
        except OSError as exc:
            raise self._os_error(exc, "commit to") from exc

    def _add_action(self, d: dict[str, Any], data_change: bool = True) -> dict[str, Any]:
        """The add action of staged file ``d`` (the fields of delta-rs's
        ``AddAction``, in its order), once the file is checked to be there
        with its staged size."""
        st = self.location.stat(d["path"])
        if st is None or st[0] != d["size"]:
            raise SinkError(
                f"output {self.name!r}: staged file {self.location.child(d['path'])} is "
                + ("gone" if st is None else f"{st[0]} bytes, staged as {d['size']}"),
                hint="restage the batch (was vacuum_orphans' grace period shorter than "
                "the time from stage to commit, or was the batch id reused?)",
            )
        return {"path": d["path"], "size": d["size"], "partition_values": {},
                "modification_time": st[1], "data_change": data_change, "stats": d["stats"]}

    def _apart(self, fn: Callable[..., _R], *args: Any, doing: str) -> _R:
        """``fn(*args)`` in a short-lived child (:func:`~reclock.sinks._apart.run_apart`),
        or here when the compaction settings say ``in_child: false``; an
        OSError or delta-rs error it raises becomes a located error (``cannot
        <doing> <table>``)."""
        try:
            if self.compaction is not None and not self.compaction.in_child:
                return fn(*args)
            return run_apart(fn, *args, what=f"output {self.name!r}: {doing}")
        except OSError as exc:
            raise self._os_error(exc, doing) from exc
        except DeltaError as exc:
            raise _delta_error(self.name, self.location, exc, doing) from exc

    def _housekeep(self, version: int, checkpoint: bool = False) -> None:
        """Checkpoint every :data:`CHECKPOINT_INTERVAL` versions (or now, with
        ``checkpoint``: after a compaction, so that readers need not replay
        its long log entry), log cleanup now and then. ``version``: the
        version just committed, or (a commit delta-rs rebased past others)
        one below it: such a commit only checkpoints a little later."""
        if not checkpoint and version - self._last_checkpoint() < CHECKPOINT_INTERVAL:
            return
        if self._aside and not checkpoint:
            _CHECKPOINTER.ask(self)
            return
        self._checkpoint()

    def _checkpoint(self) -> None:
        """Checkpoint the newest version, and clean the log up now and then
        (in a child: :func:`checkpoint_table`)."""
        try:
            self._apart(checkpoint_table, self.location, CLEANUP_EVERY_CHECKPOINTS,
                        doing="checkpoint")
        except Exception as exc:  # the commit is durable; a failed checkpoint only costs speed
            log.warning("output %r: checkpoint/cleanup failed: %s", self.name, exc)

    def _last_checkpoint(self) -> int:
        try:
            doc = json.loads(self.location.read_text("_delta_log/_last_checkpoint") or "{}")
            return int(doc["version"])
        except (ReclockError, ValueError, KeyError, TypeError):
            return 0

    # -- reading ---------------------------------------------------------------------------
    @_bounded
    def read_updates(self, as_of: int | None = None) -> pa.Table:
        """Committed rows with ``_into_time <= as_of`` (all rows if ``None``).

        Reads go through the Delta log, so staged-but-uncommitted files are
        never seen. An output never created reads as an empty table of
        reclock's own columns (its user columns are not known yet).
        """
        if self.holds_state:
            return self._read_state(as_of)
        if not self._exists():
            return pa.schema(META_FIELDS).empty_table()
        dataset = self._load().to_pyarrow_dataset()
        if as_of is None:
            return dataset.to_table()
        return dataset.to_table(filter=pc.field(INTO_TIME) <= as_of)

    # -- maintenance -----------------------------------------------------------------------
    @_bounded
    def vacuum_orphans(self, grace_seconds: float = ORPHAN_GRACE_SECONDS) -> list[str]:
        """Delete staged files the table does not reference, older than
        ``grace_seconds``; return their names.

        Only files named like ours (and our temp files) are considered, so
        files of other writers are left alone, and so is every file a remove
        action of the log names (a compaction's, or an external OPTIMIZE's):
        older versions still reference it until :meth:`expire_removed` deletes
        it past its retention. deltalake's own ``vacuum`` is not used here: it
        works in whole hours from the wall clock and writes commits of its
        own. Under the commit lock, a file cannot be deleted between a
        commit's existence check and its Delta commit.

        Which files are referenced takes reading the whole table (in a child:
        :func:`orphan_files`). A pass whose directory holds no old staged
        file it cannot account for reads nothing but the directory (every
        :data:`FULL_VACUUM_EVERY`-th pass, and the first, read the table
        anyway): a driver of a thousand outputs vacuums 17 a second at the
        default minute. So a removed file whose remove action a checkpoint
        dropped (past its retention, when :meth:`expire_removed` did not
        delete it in time) is deleted by the next pass that reads the table,
        not the next pass.

        Accounting for a file takes no memory per file of the directory
        (which holds a day of small files with the default retention): each
        pass judges every file last written ``grace_seconds`` before it or
        earlier -- by the sink's clock and by the file system's, whichever
        is behind -- and later passes look only at files written after that
        (``_judged``) and not among the names the table kept at its last
        read or this sink committed since (``_kept``, pruned to those
        written after ``_judged``). A file written before a pass but moved
        into the directory after its listing (a staged file's rename) had
        its temp file listed; one that appears with an older time than that
        (a clock more than ``grace_seconds`` off the store's) waits for the
        next pass that reads the table.
        """
        if not self._exists():
            return []
        with self._locked():
            now = self._clock.now() / 1000.0
            judged = min(now, time.time()) - grace_seconds
            listed = self.location.files()
            self._vacuums += 1
            removed: list[str] = []
            after = [f for f in listed if f[2] > self._judged]
            if (_old_staged(after, self._kept, now, grace_seconds)
                    or self._vacuums % FULL_VACUUM_EVERY == 1):
                removed, kept = self._apart(orphan_files, self.location, now, grace_seconds,
                                            judged, doing="vacuum")
                self._kept = set(kept)
            else:
                self._kept = {name for name, _, mtime in listed
                              if mtime > judged and name in self._kept}
            self._judged = judged
            for name in removed:
                self.location.delete(name)
            removed += self._vacuum_log_temps(now - grace_seconds)
            if self.holds_state:
                removed += self._orphan_dvs(listed, now - grace_seconds)
        if removed:
            log.info("output %r: removed %d orphan files", self.name, len(removed))
        return sorted(removed)

    def _vacuum_log_temps(self, before: float) -> list[str]:
        """Delete the temp files of log entries (:func:`~reclock.sinks._fs.create_exclusive`)
        last written before ``before`` (seconds since the epoch): a commit
        killed before it linked or unlinked one left it; nothing reads them.
        Their names, as ``_delta_log/<name>``."""
        if not self.location.local:
            return []
        logdir = os.path.join(self.location.root, "_delta_log")
        out = []
        try:
            with os.scandir(logdir) as entries:
                old = [e.name for e in entries
                       if _LOG_TMP.fullmatch(e.name) and e.stat().st_mtime < before]
            for name in old:
                with suppress(FileNotFoundError):
                    os.unlink(os.path.join(logdir, name))
                out.append(f"_delta_log/{name}")
        except OSError as exc:
            raise self._os_error(exc, "vacuum") from exc
        return out

    @_bounded
    def maintain(self, now_ms: int) -> dict[str, int]:
        """Compact the output and expire what compactions removed, when due
        (see the module docstring): nothing without :attr:`compaction`.

        The first pass runs :data:`FIRST_PASS_MS` after the first call (or
        ``every_ms``, if shorter; with ``spread``, a pipeline's outputs, up
        to ``every_ms`` later still, at a random point, so that outputs
        started together do not compact together): a driver that just
        started catches up first; then one every ``every_ms``. While a pass leaves at least
        ``min_files`` small files (it merges at most :data:`COMPACT_MAX_FILES`),
        the next pass runs on the next call. A pass that fails is not retried
        before its time. Each pass: set the table's
        retention property (first pass only, when it differs), :meth:`compact`
        when at least ``min_files`` files are below ``target_size`` (not even
        reading the table while the directory holds fewer), then
        :meth:`expire_removed` while files it removed wait for their retention
        (after a compaction, until an expiry finds none waiting; and every
        :data:`EXPIRY_CHECK_EVERY`-th pass, the first included, for removes
        of other writers). Returns the counts of :meth:`compact` and
        ``files_expired`` (``{}``: nothing was done or due)."""
        c = self.compaction
        if c is None:
            return {}
        if self._maintain_at is None:
            self._maintain_at = now_ms + min(c.every_ms, FIRST_PASS_MS) + (
                random.randrange(c.every_ms) if c.spread else 0)
        if now_ms < self._maintain_at:
            return {}
        self._maintain_at = now_ms + c.every_ms
        if not self._exists():
            return {}
        if not self._retention_set:
            self._set_retention(c.removes_kept_hours)
            self._retention_set = True
        self._passes += 1
        # Choosing the files to merge reads the whole table (in a child): not
        # while the directory holds fewer small data files than min_files
        # (a thousand young outputs each forked a child at their first pass),
        # not counting those this sink's compactions removed: of the files
        # its last compaction listed, only those it left count.
        small = self._compaction_left + sum(
            1 for name, size, mtime in self.location.files()
            if size < c.target_size and _PLAIN.fullmatch(name) and mtime > self._compacted_upto)
        done = (self.compact(c.target_size, c.min_files, COMPACT_MAX_FILES)
                if small >= c.min_files else {})
        if done.pop("files_left", 0) >= c.min_files:
            self._maintain_at = now_ms  # catching up: the next pass on the next tick
        if done or self._expiring or self._passes % EXPIRY_CHECK_EVERY == 1:
            expired = self.expire_removed(c.retention_ms)
            if expired:
                done["files_expired"] = len(expired)
        return done

    @_bounded
    def compact(self, target_size: int = COMPACT_TARGET_SIZE, min_files: int = 2,
                max_files: int = COMPACT_MAX_FILES) -> dict[str, int]:
        """One compaction pass, if at least ``min_files`` data files are
        smaller than ``target_size`` (see the module docstring).

        Under the local lock, from snapshot v: the small files in IntoTime
        order (at most ``max_files``) are cut into runs of at most
        ``target_size`` bytes; each run of two or more files is merged into
        one new file named like a staged file; then one transaction removes
        the merged files and adds the new ones, carrying the output's txn and
        progress unchanged from v. A commit of this output after v (or another
        compaction) makes delta-rs refuse it: the pass is dropped (its files
        deleted) and nothing changed. Returns ``files_removed``,
        ``files_added``, ``bytes_removed``, ``bytes_added`` and ``files_left``
        (small files this pass did not take); ``{}`` when nothing was merged.
        Tables whose files a raw Parquet read cannot merge (deletion vectors,
        column mapping) are never compacted."""
        if not self._exists():
            return {}
        if self.holds_state:
            return self._compact_state(target_size, min_files, max_files)
        with self._locked():
            listing_at = time.time()  # (files last written before this are in its plan)
            plan = self._apart(plan_compaction, self.location, self.app_id, target_size,
                               min_files, max_files, doing="compact")
            if plan == "unmergeable":
                log.warning("output %r: not compacted: its table uses deletion vectors "
                            "or column mapping", self.name)
            if not isinstance(plan, _Plan):
                return {}
            done, swapped = self._merge_and_swap(plan,
                                                 self._state_at(plan.version, plan.txn))
            if swapped is None:
                return {}
            done["files_left"] = plan.files_left
            self._compacted_upto, self._compaction_left = listing_at, plan.files_left
        log.info("output %r: compacted %d files into %d", self.name, done["files_removed"],
                 done["files_added"])
        faults.crash_point("after_compaction")
        self._housekeep(swapped, checkpoint=True)
        return done

    def _merge_and_swap(self, plan: _Plan,
                        state: SinkState) -> tuple[dict[str, int], int | None]:
        """Write one file per run, then the one transaction that swaps them
        in (the caller holds the lock): the pass's counts and the version
        the swap became, ``({}, None)`` when the pass was dropped
        (:meth:`_swap`): the new files are deleted again. The sink's head
        moves past the swap, so that the next commit need not load the
        table."""
        batch = f"{self._clock.now()}{_COMPACTED}{uuid.uuid4().hex[:10]}"
        written: list[dict[str, Any]] = []
        for i, run in enumerate(plan.runs):
            name = f"part-{batch}-{i:05d}-000.parquet"
            written.append(self._apart(merge_files, self.location, [f.path for f in run], name,
                                       plan.schema, doing="compact"))
            faults.crash_point("mid_compaction")
        now = int(time.time() * 1000)  # delta-rs's vacuum ages removes by the wall clock
        actions: list[dict[str, Any]] = [
            {"remove": {"path": f.path, "data_change": False, "deletion_timestamp": now,
                        "size": f.size}} for run in plan.runs for f in run]
        actions += [{"add": self._add_action(d, data_change=False)} for d in written]
        custom = {KEY_OUTPUT: self.name, KEY_UPPER: _decode_txn(plan.txn),
                  KEY_PROGRESS: state.progress, KEY_MAINTENANCE: "compact",
                  **self._owner_keys()}
        swapped = self._swap(plan, actions, custom)
        if swapped is None:
            for d in written:
                self.location.delete(d["path"])
            return {}, None
        self._kept.update(d["path"] for d in written)
        head = self._head
        if head is not None and head.version == swapped - 1:
            self._head = _Head(swapped, head.state, head.direct)
        return {"files_removed": sum(len(r) for r in plan.runs), "files_added": len(written),
                "bytes_removed": sum(f.size for r in plan.runs for f in r),
                "bytes_added": sum(int(d["size"]) for d in written)}, swapped

    def _swap(self, plan: _Plan, actions: list[dict[str, Any]],
              custom: dict[str, Any]) -> int | None:
        """Commit a pass's swap; the version it became, or None when the pass
        is dropped (the caller holds the lock).

        1. Read the log entries after ``plan.version`` up to the newest, v.
           If one of them removed a file the swap removes, committed the
           output or changed the schema or protocol (:func:`swap_conflict`),
           drop the pass: whoever removed a file first owns its rows.
        2. Write the swap as log entry v+1, only if it is absent: reclock's
           own entry (:meth:`_put_entry`), or on tables it does not write
           entries of (S3 included) delta-rs with no retries
           (:func:`swap_files`, in a child), whose put-if-absent is S3's
           conditional write there. delta-rs's own rebase is never used: it
           lets a second remove of one file through when ``dataChange`` is
           false, which duplicated every row two compactions both merged.
        3. Entry v+1 exists (someone committed after step 1): step 1 again
           from there, at most :data:`COMMIT_ATTEMPTS` times."""
        removes = {a["remove"]["path"] for a in actions if "remove" in a}
        at = plan.version
        for _ in range(COMMIT_ATTEMPTS):
            while (text := self.location.read_text(f"_delta_log/{at + 1:020d}.json")) \
                    is not None:
                why = swap_conflict(text, removes, self.app_id)
                if why is not None:
                    log.info("output %r: compaction dropped: version %d came first (%s)",
                             self.name, at + 1, why)
                    return None
                at += 1
            if plan.direct:
                swapped = self._put_entry(at + 1, _log_entry(
                    "OPTIMIZE", {"reclock": "compact"}, False, self.app_id, plan.txn, custom,
                    actions, at))
            else:
                swapped = self._apart(swap_files, self.location, at, actions, custom,
                                      self.app_id, plan.txn, doing="compact")
            if swapped:
                return at + 1
        log.info("output %r: compaction dropped: %d attempts lost to concurrent commits",
                 self.name, COMMIT_ATTEMPTS)
        return None

    @_bounded
    def expire_removed(self, retention_ms: int) -> list[str]:
        """Delete the files that remove actions name (compactions' removals)
        once those removes are ``retention_ms`` old by the wall clock, rounded
        up to whole hours (delta-rs's lite ``vacuum``: files no log entry
        removed are never touched); return their names. Writes two commits
        when it deletes anything (``VACUUM START``/``END``), none otherwise:
        a dry run first tells whether any such file is still there (the
        remove actions outlive their files until a checkpoint drops them)."""
        if not self._exists():
            return []
        hours = -(-retention_ms // 3_600_000)
        custom = {KEY_OUTPUT: self.name, KEY_MAINTENANCE: "expire"}
        with self._locked():
            present, waiting = self._apart(expire_files, self.location, hours, custom,
                                           doing="vacuum")
            if self.holds_state:
                present = [*present, *self._expire_dvs(hours * 3_600_000)]
        self._expiring = waiting > 0
        if not present:
            return []
        log.info("output %r: deleted %d files removed more than %d h ago", self.name,
                 len(present), hours)
        return sorted(present)



    def _set_retention(self, hours: int) -> None:
        """Set the table's ``delta.deletedFileRetentionDuration`` to ``hours``
        if it says otherwise (a metadata commit of its own; a concurrent
        commit of ours retries over it), in a child (:func:`set_retention`):
        the driver loads no table while it runs (a load in the driver at the
        first maintenance pass mapped 4.5 MiB more of delta-rs's code)."""
        with self._locked():
            have = self._apart(set_retention, self.location, self.name, hours,
                               doing="configure")
        if have is not None:
            log.info("output %r: set %s to %r (was %r)", self.name, RETENTION_PROPERTY,
                     _interval(hours), have or None)

    def close(self) -> None:
        """Nothing to release: every call opens what it needs."""











    # -- helpers ---------------------------------------------------------------------------
    def _open(self) -> DeltaTable:
        """The newest snapshot (TableNotFoundError if there is no table)."""
        try:
            return DeltaTable(self.uri, storage_options=self.location.storage_options())
        except TableNotFoundError:
            raise
        except OSError as exc:
            raise self._os_error(exc, "open") from exc
        except DeltaError as exc:
            raise _delta_error(self.name, self.location, exc, "open") from exc

    def _exists(self) -> bool:
        """Whether the table has a log (a commit or a checkpoint). A local
        table's is looked at directly: delta-rs's ``is_deltatable`` spawns a
        thread in its runtime's blocking pool on every call, and maintenance
        asks every pass (a driver's thread count would swing with it)."""
        try:
            if self.location.local:
                return has_log(self.location.root)
            return DeltaTable.is_deltatable(self.uri, self.location.storage_options())
        except OSError as exc:
            raise self._os_error(exc, "open") from exc
        except DeltaError as exc:
            raise _delta_error(self.name, self.location, exc, "open") from exc

    def _load(self) -> DeltaTable:
        try:
            return self._open()
        except TableNotFoundError as exc:
            raise SinkError(
                f"output {self.name!r}: no Delta table at {self.uri}", hint="call ensure() first"
            ) from exc

    def _os_error(self, exc: OSError, doing: str) -> ReclockError:
        if self.location.local:
            return sink_os_error(self.name, self.uri, exc, doing)
        return store_error(self.name, self.uri, exc, doing)

    def _locked(self) -> AbstractContextManager[None]:
        if not self._lock or not self.location.local:
            return nullcontext()
        return exclusive_lock(self.path / LOCK_NAME, output=self.name)


#: delta-rs's retention of removed files when the table does not set it (a week).
DEFAULT_RETENTION_HOURS = 168




def _runs(files: list[_Small], target_size: int) -> list[list[_Small]]:
    """``files`` cut, in order, into runs of at most ``target_size`` bytes
    (a file alone may be larger); runs of one file are left out (nothing to
    merge)."""
    runs: list[list[_Small]] = []
    run: list[_Small] = []
    size = 0
    for f in files:
        if run and size + f.size > target_size:
            runs.append(run)
            run, size = [], 0
        run.append(f)
        size += f.size
    runs.append(run)
    return [r for r in runs if len(r) > 1]








def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _scan_commit(text: str, app_id: str) -> tuple[dict[str, Any], int | None]:
    """(commitInfo, version of our txn or None) of one log entry. Only the
    commitInfo and txn lines are parsed: add lines carry stats and may be many."""
    info: dict[str, Any] = {}
    ours: int | None = None
    for line in text.splitlines():
        head = line.lstrip()[:20]
        if '"commitInfo"' in head:
            info = json.loads(line)["commitInfo"]
        elif '"txn"' in head:
            txn = json.loads(line)["txn"]
            if txn.get("appId") == app_id:
                ours = int(txn["version"])
    return info, ours










def _type_of(field: Field) -> Any:
    return json.loads(field.to_json())["type"]


def _describe(field: Field) -> str:
    t = _type_of(field)
    return (t if isinstance(t, str) else json.dumps(t)) + ("" if field.nullable else " not null")


#: prefix of a difference :func:`_compare` finds that is a legal widening
_WIDENS = "widens: "


def _arrow_of(field: Field) -> pa.DataType:
    return pa.schema(Schema([field]).to_arrow()).field(0).type




def _compare(have: Schema, want: Schema) -> tuple[list[Field], list[str]]:
    """(columns to add, human-readable clashes) going from ``have`` to ``want``."""
    stored = {f.name: f for f in have.fields}
    wanted = {f.name for f in want.fields}
    missing: list[Field] = []
    clashes: list[str] = []
    for f in want.fields:
        h = stored.get(f.name)
        if h is None:
            if f.nullable and f.name not in META_NAMES:
                missing.append(f)
            else:
                clashes.append(f"column {f.name!r} ({_describe(f)}) is missing")
        elif h.nullable == f.nullable and _type_of(h) != _type_of(f) and widens(
                _arrow_of(h), _arrow_of(f)):
            clashes.append(f"{_WIDENS}column {f.name!r}: stored {_describe(h)}, wanted "
                           f"{_describe(f)}")
        elif _type_of(h) != _type_of(f) or h.nullable != f.nullable:
            clashes.append(f"column {f.name!r}: stored {_describe(h)}, wanted {_describe(f)}")
    for h in have.fields:
        if h.name not in wanted and not h.nullable:
            clashes.append(f"column {h.name!r} ({_describe(h)}) is stored NOT NULL but not wanted")
    return missing, clashes


def _delta_error(output: str, where: Location, exc: DeltaError, doing: str) -> ReclockError:
    """A located error for a delta-rs failure: on S3 sorted like any object
    store failure (:func:`reclock.sinks._store.store_error`), locally by its reason."""
    if not where.local:
        return store_error(output, where.uri, exc, doing)
    text = str(exc)
    lower = text.lower()
    if "no space left" in lower:
        reason = "disk full"
    elif "permission denied" in lower:
        reason = "permission denied"
    elif "read-only file system" in lower:
        reason = "read-only file system"
    else:
        reason = text
    return SinkError(f"output {output!r}: cannot {doing} {where.uri}: {reason}")


# -- state tables (mode: state) ------------------------------------------------------






















# -- configuration ----------------------------------------------------------------


def _path_text(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _check_target(value: str | None) -> str | None:
    if value is not None:
        split_uri(value)  # a ValueError names the schemes that work
    return value


class CompactConfig(LakeCompactConfig):
    """When the driver compacts a file output's small files, and how long it
    keeps the files a compaction replaced. An output commits every
    ``timestamp_interval``, so without compaction its table gathers a small
    file per commit (tens of thousands a day) and every reader slows down.
    Compaction merges them into files of about ``target_size`` between two
    ticks of the source (the source waits meanwhile); it changes neither the
    rows nor the output's upper and progress. While a pass leaves
    ``min_files`` small files behind (one pass merges at most 5,000), the
    next one follows on the next tick; small files are merged in runs of at
    most ``target_size`` bytes, in IntoTime order."""

    retention: DurationMs = Setting(default=RETENTION_MS, ge=3_600_000)
    """How long the files a compaction replaced are kept (default ``1d``, at
    least ``1h``, at most ``30d``; rounded up to whole hours), so that readers
    of older table versions -- time travel, a scan that started before the
    compaction -- keep working; then they are deleted. Also written to the
    table as ``delta.deletedFileRetentionDuration``. Longer keeps more files
    in the output's directory."""

    in_child: bool = True
    """Run the output's maintenance -- compaction passes (choosing and
    merging the files), checkpoints, expiry, the orphan vacuum: whatever
    reads the whole table -- in short-lived child processes (forked from a
    helper process started once) rather than in the driver, so that the
    memory it needs goes back to the system when it ends instead of staying
    with the driver's allocators (default ``true``). A child that dies fails
    that piece of maintenance, which is retried on schedule; the driver goes
    on."""

    def settings(self) -> Compaction:
        return Compaction(self.every, self.min_files, self.target_size, self.retention,
                          self.in_child, spread=True)


class FileSinkConfig(SinkConfigBase):
    """A durable table (a Delta table: Parquet files and a log) in a local
    directory or under an ``s3://`` prefix; data and the output's upper are
    committed in one atomic step."""

    type: Literal["delta", "file"] = "file"
    """``delta`` (its name) or ``file`` (the name it had first, still accepted
    and kept as written)."""
    path: Annotated[str | None, BeforeValidator(_path_text), AfterValidator(_check_target)] = None
    """Where the output lives: a directory (relative paths resolve against the
    YAML file's directory), ``file:///abs/path``, or ``s3://bucket/prefix``.
    Any other scheme is an error. The default is
    ``<state_dir>/outputs/<source>/<output>`` (filled in when the pipeline is
    loaded)."""
    storage: S3StorageConfig | None = None
    """For an ``s3://`` path: endpoint, region and credentials (all optional;
    the ``AWS_*`` environment variables otherwise)."""
    compact: Annotated[CompactConfig | None, BeforeValidator(compact_switch)] = Setting(
        default_factory=CompactConfig)
    """Merge the output's small files on a schedule: ``{every: 10m, min_files:
    50, target_size: 128MiB, retention: 1d}`` (the default; give only the keys
    to change). ``compact: off`` never compacts."""
    mode: Literal["log", "state"] = "log"
    """``log``: every update with ``_into_time``, ``_diff`` and provenance.
    ``state``: the current rows, one per ``key`` (plus ``_into_time`` of the
    row's last change); each commit applies the sum of every IntoTime's
    updates per key, with deletion vectors (local tables only, for now).
    Error rows go to the log table ``<path>/_errors``."""
    key: tuple[str, ...] = ()
    """With ``mode: state``: the key columns. They must contain the output's
    upstream key (:func:`~reclock.contracts.config.state_key_problem`)."""

    TARGET: ClassVar[str] = "path"

    @classmethod
    def target_of(cls, raw: Mapping[str, Any]) -> tuple[str, ...] | None:
        if not isinstance(raw.get("path"), str):
            return None
        path = str(raw["path"])
        try:
            scheme, rest = split_uri(path)
        except ValueError:
            return None  # reported by the field's own validator
        if scheme:
            return ("file", f"{scheme}://{rest}")
        return ("file", os.path.normpath(rest))

    def resolved(self, default: Path, base: Path) -> FileSinkConfig:
        """A copy whose path is absolute (local) or a canonical ``s3://`` URI."""
        scheme, rest = split_uri(str(self.path)) if self.path is not None else ("", str(default))
        path = (f"{scheme}://{rest}" if scheme
                else os.path.abspath(base / Path(rest).expanduser()))
        return self.model_copy(update={"path": path})

    @classmethod
    def state_key_of(cls, raw: Mapping[str, Any]) -> tuple[str, ...] | None:
        return state_key_of(raw)

    @classmethod
    def check_raw(cls, data: Mapping[str, Any]) -> list[InitErrorDetails]:
        path = data.get("path")
        if data.get("storage") is not None and not (
                isinstance(path, str) and path.lower().startswith(("s3://", "s3a://"))):
            return [problem(("storage",), "only applies to an s3:// path", on_key=True)]
        return state_check_raw(data)

    def build(self, ctx: SinkContext) -> DeltaSink:
        path = self.path or str(ctx.state_dir / "outputs" / ctx.source / ctx.output)
        storage = None
        if split_uri(path)[0] == "s3":
            storage = (self.storage or S3StorageConfig()).access()
        # (a state table on S3 keeps its key index in the state dir)
        index_dir = (ctx.state_dir / "outputs" / ctx.source / ctx.output
                     if storage is not None and self.mode == "state" else None)
        return DeltaSink(ctx.name, path, storage=storage, create_lazily=True,
                         checkpoint_aside=True, owner=ctx.owner,
                         compaction=None if self.compact is None else self.compact.settings(),
                         mode=self.mode, key=tuple(self.key), index_dir=index_dir)


PLUGIN = SinkPlugin(name="delta", aliases=("file",), config=FileSinkConfig)
