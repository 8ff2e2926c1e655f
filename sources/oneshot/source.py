"""The ``oneshot`` source: files loaded into an output at one IntoTime, once.

FromTime is a counter of loads (:class:`~reclock.core.time.Counter`): load
``k`` is position ``k``, and every record of it sits there (``_src_offset =
k``; ``_src_part`` numbers the load's chunks, ``_src_seq`` the records of a
chunk). ``reclock load`` queues a request (:mod:`reclock.sources.oneshot.ledger`);
the probe writes the oldest one to the ledger as the next position and
reports the counter one further, so the driver mints a binding for it and
the whole load lands at that binding's IntoTime, in one commit of every
output (its progress past ``k`` says the load is done). A crash before the
commit leaves the output as it was and the rerun reads position ``k`` again
from the same ledger entry; a crash after it finds the output's progress
past ``k`` and reads nothing. One probe takes at most one request, so two
loads never share an IntoTime.

The plan turns a load into tasks: JSON-lines files in byte ranges of about
``split_size`` (a record belongs to the range its line starts in; a range
reads on to the end of its last line), CSV files in ranges that start at the
first record at or after each multiple of ``split_size`` (a quoted field may
hold newlines: ``reclock load`` finds those record starts, reading each file
once, :mod:`reclock.sources.oneshot.records`), Parquet files by row groups;
these chunks are packed into tasks of about ``split_size`` bytes and at most
the driver's records per task (a small file shares a task with others).
CSV and JSON lines are raw records decoded by the output's ``format``: a bad
line is an error row with its bytes. Parquet outputs are typed, with the
source's ``columns``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import Field
from pydantic_core import InitErrorDetails

from reclock.clients.s3 import S3Access
from reclock.contracts.config import ByteSize, ColumnType, problem
from reclock.contracts.source import (
    ConnectorConfig,
    OutputSpec,
    ReadTask,
    SourceBase,
    SourceContext,
    SourcePlugin,
)
from reclock.core.clock import Clock
from reclock.core.columns import SRC_OFFSET, SRC_PART, SRC_SEQ, SRC_TS
from reclock.core.errors import TASK_STOPPED, DefiniteError
from reclock.core.frontier import Antichain
from reclock.core.time import Counter
from reclock.sources.oneshot.files import FileRef, Store
from reclock.sources.oneshot.ledger import CANCELLED, Ledger, fingerprint
from reclock.sources.oneshot.records import record_starts, records

FORMATS = ("csv", "jsonl", "parquet")
#: Lines per record batch a task yields.
BATCH_LINES = 131_072
#: Bytes per line assumed when sizing a job of CSV / JSON lines.
LINE_BYTES = 100


def arrow_type(name: str) -> pa.DataType:
    """The Arrow type of a configured column type (as the formats read them)."""
    simple: dict[str, pa.DataType] = {
        "int32": pa.int32(), "int64": pa.int64(), "float64": pa.float64(),
        "bool": pa.bool_(), "string": pa.string(), "binary": pa.binary(),
        "timestamp": pa.timestamp("us", tz="UTC"), "date": pa.date32(), "json": pa.string()}
    if name in simple:
        return simple[name]
    p, s = name[len("decimal("):-1].split(",")
    return pa.decimal128(int(p), int(s))


@dataclass(frozen=True)
class Chunk:
    """A piece of one file: bytes ``[lo, hi)`` of a text file, or row groups.
    ``delimiter``: a CSV file cut at record starts (:mod:`reclock.sources.oneshot.records`),
    read record by record; None: lines (JSON lines, and CSV loads requested
    before records were found this way)."""

    file: FileRef
    part: int
    lo: int = 0
    hi: int = 0
    groups: tuple[int, ...] = ()
    delimiter: bytes | None = None


class LoadCancelled(InterruptedError):
    """Raised by a task of a load that ``reclock load`` cancelled. Not a
    reclock error on purpose: those a task returns as its result while the
    job goes on, this one fails the task, so Spark aborts the load's job and
    kills its other tasks at once (in a Spark job shared by small jobs of
    several sources, any task error is its own source's result: the load's
    other tasks fail as they start). The driver sees the job fail
    (transient: an interruption), and its next plan of the load finds it
    cancelled."""


def _check_cancel(path: str | None, k: int) -> None:
    if path is not None and os.path.exists(path):
        raise LoadCancelled(f"{TASK_STOPPED} load #{k} was cancelled (reclock load was "
                            "interrupted): its job stops and nothing of it is committed; the "
                            "next plan of the load reads nothing")


@dataclass(frozen=True)
class OneShotReader:
    """Executor side: a task's chunks into record batches."""

    store: Store
    format: str
    schema: pa.Schema | None

    def read(self, task: ReadTask) -> Iterator[tuple[int, pa.RecordBatch]]:
        k, output, ts, chunks, header, cancel = task.spec
        checked: set[FileRef] = set()
        _check_cancel(cancel, k)
        for c in chunks:
            if c.file not in checked:
                self.store.check(c.file)  # the load's files, as they were
                checked.add(c.file)
            for cols in (self._rows(c) if self.format == "parquet"
                         else self._lines(c, header)):
                n = len(cols[0]) if cols else 0
                if n == 0:
                    continue
                seq0 = cols.pop()
                positions = [pa.array(np.full(n, c.part, np.int32)),
                             pa.array(np.full(n, k, np.int64)),
                             pa.array(np.arange(seq0, seq0 + n, dtype=np.int32)),
                             pa.array(np.full(n, ts, np.int64))]
                names = ([SRC_PART, SRC_OFFSET, SRC_SEQ, SRC_TS]
                         + (list(self.schema.names) if self.schema is not None
                            else ["key", "value"]))
                _check_cancel(cancel, k)  # a cancelled load stops between batches
                yield output, pa.RecordBatch.from_arrays([*positions, *cols], names=names)

    def _lines(self, c: Chunk, header: bool) -> Iterator[list[Any]]:
        if c.delimiter is None:
            values = lines_of(self.store, c.file, c.lo, c.hi)
        else:
            values = pa.array(records(self.store.read_range(c.file, c.lo, c.hi), c.delimiter),
                              pa.binary())
        if header and c.lo == 0 and len(values):
            values = values.slice(1)
        if len(values):
            values = values.filter(pc.greater(pc.binary_length(values), 0))
        for i in range(0, len(values), BATCH_LINES):
            v = values.slice(i, BATCH_LINES)
            yield [pa.nulls(len(v), pa.binary()), v, i]

    def _rows(self, c: Chunk) -> Iterator[list[Any]]:
        assert self.schema is not None
        with self.store.open(c.file) as fh:
            pf = pq.ParquetFile(fh)
            have = set(pf.schema_arrow.names)
            seq = 0
            for g in c.groups:
                t = pf.read_row_group(g, columns=[n for n in self.schema.names if n in have])
                n = t.num_rows
                try:
                    cols = [t.column(f.name).cast(f.type).combine_chunks() if f.name in have
                            else pa.nulls(n, f.type) for f in self.schema]
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                    raise DefiniteError(
                        f"{c.file.url}: row group {g} does not convert to the output's "
                        f"columns: {exc}", hint="the source stalls on this load (there is no way "
                        "to cancel a load yet): drop the source") from None
                yield [*cols, seq]
                seq += n


def lines_of(store: Store, f: FileRef, lo: int, hi: int) -> pa.Array:
    """The lines (without their ``\\n``, nor a ``\\r`` before it) that start
    in ``[lo, hi)`` of the file, as one binary array."""
    start = max(0, lo - 1)
    data = store.read_range(f, start, hi)
    want = hi - 1 - start  # the last line ends at the first newline from here
    while True:
        end = data.find(b"\n", max(0, want))
        if end >= 0 or start + len(data) >= f.size:
            break
        more = store.read_range(f, start + len(data), start + len(data) + (1 << 20))
        if not more:
            break
        data += more
    end = len(data) if end < 0 else end
    first = 0 if lo == 0 else data.find(b"\n") + 1
    if (lo > 0 and first == 0) or start + first >= hi or first > end:
        return pa.array([], pa.binary())
    region = data[first:end]
    if b"\r" in region:
        return pa.array([ln[:-1] if ln.endswith(b"\r") else ln for ln in region.split(b"\n")],
                        pa.binary())
    arr = np.frombuffer(region, dtype=np.uint8)
    nl = np.flatnonzero(arr == 10)
    values = arr[arr != 10] if len(nl) else arr
    offsets = np.concatenate([[0], nl - np.arange(len(nl)), [len(values)]]).astype(np.int32)
    if len(values) >= 2**31:
        raise DefiniteError(f"{f.url}: a range of 2 GiB or more; lower split_size")
    return pa.Array.from_buffers(pa.binary(), len(offsets) - 1,
                                 [None, pa.py_buffer(offsets), pa.py_buffer(values.tobytes())])


class OneShotSource(SourceBase):
    """Driver side (see the module docstring)."""

    kind = Counter.KIND

    def __init__(self, name: str, *, clock: Clock, state_dir: Path, format: str,
                 columns: Mapping[str, str] | None = None, header: bool = False,
                 split_size: int = 64 * 2**20, replayable: bool = True,
                 output_names: Sequence[str] = (), schema_from: str | None = None) -> None:
        self.name = name
        self.clock = clock
        self.format = format
        self.header = header
        self.split_size = split_size
        self._replayable = replayable
        self._unchanged: bool | None = None
        self.schema = (None if format != "parquet" or not columns else
                       pa.schema([pa.field(c, arrow_type(t)) for c, t in columns.items()]))
        self._names = list(output_names) or ["value"]
        self.ledger = Ledger(state_dir, name)
        self.store = Store(S3Access.resolve())
        if format == "parquet" and self.schema is None and schema_from:
            self.schema = self._pinned_schema(schema_from)
        self._next = 0
        #: opened by a driver: its plans decide whether a cancelled load is
        #: cancelled for good (``reclock verify``'s re-reads only follow them)
        self._driving = False

    def _pinned_schema(self, spec: str) -> pa.Schema:
        """The Parquet schema of ``spec`` (its first file), read once and kept
        in the ledger's directory: the outputs' columns stay what they were
        at the first start, whatever becomes of that file."""
        pinned = self.ledger.root / "schema.arrow"
        if pinned.exists():
            return pa.ipc.read_schema(pa.py_buffer(pinned.read_bytes()))
        first = self.store.files(spec)[0]
        with self.store.open(first) as fh:
            schema = pq.ParquetFile(fh).schema_arrow.remove_metadata()
        pinned.parent.mkdir(parents=True, exist_ok=True)
        tmp = pinned.with_name(f".schema.{os.getpid()}.tmp")
        tmp.write_bytes(schema.serialize().to_pybytes())
        os.replace(tmp, pinned)
        return schema

    @property
    def replayable(self) -> bool:  # type: ignore[override]
        """Whether every load can be read again (``reclock verify`` re-reads
        them): configured so, and every file of every load still has the
        size and version recorded (checked once per instance)."""
        if not self._replayable:
            return False
        if self._unchanged is None:
            self._unchanged = True
            for doc in self.ledger.loads().values():
                for fd in doc.get("files", []):
                    try:
                        self.store.check(FileRef.of_json(fd))
                    except DefiniteError:
                        self._unchanged = False
                        return False
        return self._unchanged

    # -- contract ----------------------------------------------------------------------
    def outputs(self) -> list[OutputSpec]:
        if self.schema is not None:
            return [OutputSpec(n, typed=True, schema=self.schema) for n in self._names]
        return [OutputSpec(n) for n in self._names]

    def initial_frontier(self) -> Antichain[Counter]:
        return Antichain.from_elem(Counter(0))

    def open(self, resume: Antichain[Counter], bound: Antichain[Counter],
             held: Sequence[Antichain[Counter] | None] = (),
             resnapshot: Sequence[int] = ()) -> None:
        b = bound.as_option()
        loads = self.ledger.loads()
        self._next = max(0 if b is None else int(b), max(loads, default=-1) + 1)
        self._driving = True

    def probe(self) -> Antichain[Counter]:
        """The loads taken up: at most one more per probe (one IntoTime each)."""
        taken = {d.get("id") for d in self.ledger.loads().values()}
        for req in self.ledger.requests():
            if req["id"] in taken:
                continue  # durable in the ledger; removed once acknowledged
            if req.get("output") not in self._names:
                self.ledger.skip(req, -1)
                continue
            if self.ledger.cancel_requested(str(req["id"])):
                self.ledger.skip(req, CANCELLED)  # cancelled before it had a position
                self.ledger.forget_cancel(str(req["id"]))
                continue
            same = self.ledger.same_as(str(req.get("fingerprint")))
            if same is not None and not req.get("force"):
                self.ledger.skip(req, same)  # an identical load: nothing to do
                continue
            self.ledger.assign(self._next, req, self.clock.now())
            self._next += 1
            break
        return Antichain.from_elem(Counter(self._next))

    def plan(self, lower: Antichain[Counter], upper: Antichain[Counter], max_task: int,
             max_job: int) -> tuple[list[ReadTask], Antichain[Counter]]:
        lo_t, up_t = lower.as_option(), upper.as_option()
        if lo_t is None:
            return [], lower
        lo = int(lo_t)
        hi = self._next if up_t is None else int(up_t)
        tasks: list[ReadTask] = []
        k, records = lo, 0
        # whole loads only (a load is one position); at least one
        while k < hi and (k == lo or records < max_job):
            doc = self.ledger.load(k)
            if doc is None:
                raise DefiniteError(f"source {self.name!r}: load {k} is bound but missing "
                                    f"from {self.ledger.root / 'ledger'}",
                                    hint="the state directory lost a file")
            for spec, n in self._tasks(k, doc, max_task):
                tasks.append(ReadTask(self.name, len(tasks), spec, n))
                records += n
            k += 1
        return tasks, Antichain.from_elem(Counter(k))

    def _tasks(self, k: int, doc: dict[str, Any], max_task: int) -> list[tuple[Any, int]]:
        """A load's chunks (its positions' ``_src_part``: a Parquet row group,
        a byte range of ``split_size`` of a text file; fixed by the load alone)
        packed into tasks of at most ``split_size`` bytes and ``max_task``
        records (a chunk at least)."""
        if doc["output"] not in self._names:
            return []
        cancel = None
        if self._driving:  # a cancel asked for before this plan: k holds nothing
            rid = str(doc.get("id"))
            if not self.ledger.cancelled(k) and self.ledger.cancel_requested(rid):
                self.ledger.mark_cancelled(k)
            cancel = str(self.ledger.cancel_path(rid))
        if self.ledger.cancelled(k):
            return []
        output = self._names.index(doc["output"])
        ts = int(doc["assigned_ms"])
        out: list[tuple[Any, int]] = []
        pending: list[Chunk] = []
        size = rows = 0

        def flush() -> None:
            nonlocal pending, size, rows
            if pending:
                out.append(((k, output, ts, tuple(pending), header, cancel), rows))
            pending, size, rows = [], 0, 0

        # what fixes the load's positions comes from its ledger entry, not
        # from the configuration now (verify re-reads it after any change)
        header = bool(doc.get("options", {}).get("header", False))
        split = int(doc.get("split_size", self.split_size))
        part = 0
        for fd in doc["files"]:
            f = FileRef.of_json(fd)
            pieces: list[tuple[Chunk, int, int]] = []
            if doc["format"] == "parquet":
                for g, (n, b) in enumerate(fd.get("row_groups", [])):
                    pieces.append((Chunk(f, part, groups=(g,)), b, n))
                    part += 1
            else:
                # a CSV file's ranges start at records (found when the load was
                # requested), other text files' at multiples of split
                delim = fd.get("delimiter")
                starts = fd.get("starts") or range(0, max(f.size, 1), split)
                ends = [*list(starts)[1:], f.size]
                for a, b in zip(starts, ends, strict=True):
                    pieces.append((Chunk(f, part, a, b, delimiter=None if delim is None
                                         else delim.encode()),
                                   b - a, max(1, (b - a) // LINE_BYTES)))
                    part += 1
            for chunk, nbytes, nrows in pieces:
                if size and (size + nbytes > self.split_size or rows + nrows > max_task):
                    flush()
                pending.append(chunk)
                size, rows = size + nbytes, rows + nrows
        flush()
        return out

    def reader(self) -> OneShotReader:
        return OneShotReader(self.store, self.format, self.schema)

    def acknowledge(self, frontier: Antichain[Any]) -> None:
        """Loads before ``frontier`` are durable everywhere: their requests go."""
        f = frontier.as_option()
        loads = self.ledger.loads()
        for req in self.ledger.requests():
            k = next((p for p, d in loads.items() if d.get("id") == req["id"]), None)
            if k is not None and (f is None or k < int(f)):
                self.ledger.remove_request(str(req["id"]))
                self.ledger.forget_cancel(str(req["id"]))

    def close(self) -> None:
        """Nothing to release."""

    # -- reclock load --------------------------------------------------------------
    def describe(self, output: str, spec: str, fmt: str | None,
                 delimiter: str = ",") -> dict[str, Any]:
        """A request for loading ``spec`` into ``output``: its files as they
        are now (Parquet: with their row groups, checked against the
        output's columns; CSV: where its byte ranges start, records with
        ``delimiter`` as the output's format reads them, which reads each
        file once), options and fingerprint."""
        if output not in self._names:
            raise DefiniteError(f"source {self.name!r} has no output {output!r}",
                                hint=f"its outputs: {', '.join(self._names)}")
        fmt = fmt or self.format
        if fmt != self.format:
            raise DefiniteError(f"source {self.name!r} loads {self.format} files, not {fmt}",
                                hint="a source's outputs hold one format: configure another "
                                     "oneshot source for it")
        files = []
        for f in self.store.files(spec):
            d = f.as_json()
            if fmt == "parquet":
                d["row_groups"] = self._row_groups(f)
            elif fmt == "csv":
                d["delimiter"] = delimiter
                d["starts"] = record_starts(
                    functools.partial(self.store.read_range, f), f.size, self.split_size,
                    delimiter.encode())
            files.append(d)
        options = {"header": self.header}
        return {"output": output, "from": spec, "format": fmt, "options": options,
                "split_size": self.split_size, "files": files,
                "fingerprint": fingerprint(output, fmt, options, files)}

    def _row_groups(self, f: FileRef) -> list[tuple[int, int]]:
        assert self.schema is not None
        try:
            with self.store.open(f) as fh:
                pf = pq.ParquetFile(fh)
                meta, have = pf.metadata, pf.schema_arrow
        except pa.ArrowInvalid as exc:
            raise DefiniteError(f"{f.url} is not a Parquet file: {exc}") from None
        common = [c for c in self.schema.names if c in have.names]
        if not common:
            raise DefiniteError(f"{f.url} has none of the columns {self.schema.names} "
                                f"(it has {have.names})")
        for c in common:
            want = self.schema.field(c).type
            try:
                pa.array([], have.field(c).type).cast(want)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                raise DefiniteError(f"{f.url}: column {c!r} is {have.field(c).type}, which "
                                    f"does not convert to {want}") from None
        return [(meta.row_group(g).num_rows, meta.row_group(g).total_byte_size)
                for g in range(meta.num_row_groups)]

    def status_of(self, rid: str) -> tuple[str, int | None]:
        """``("queued"|"loaded"|"skipped"|"cancelled", position)`` of a
        request ("loaded": given a position, durable or not yet)."""
        k = self.ledger.position_of(rid)
        if k is not None:
            return ("cancelled" if self.ledger.cancelled(k) else "loaded"), k
        s = self.ledger.skipped(rid)
        if s == CANCELLED:
            return "cancelled", None
        return ("skipped", s) if s is not None else ("queued", None)




# -- configuration ----------------------------------------------------------------


class OneShotConfig(ConnectorConfig):
    """One-shot loads of files (``reclock load``): FromTime counts the loads;
    each lands in its output at one IntoTime, once."""

    format: Literal["csv", "jsonl", "parquet"]
    """What the loads read. ``csv`` and ``jsonl``: one record per line, decoded
    by the output's ``format`` (``csv`` / ``json`` with a schema); a line that
    does not decode is an error row. ``parquet``: typed rows with ``columns``."""
    columns: dict[str, ColumnType] | None = None
    """``parquet`` only: the outputs' columns and types; a file's columns of
    these names are converted, missing ones are null."""
    schema_from: str | None = None
    """``parquet`` only, instead of ``columns``: a Parquet file (path, glob,
    S3 or HTTP URL: its first file) whose schema the outputs take, read at the
    first start and kept in the state directory from then on."""
    header: bool = False
    """``csv`` only: each file's first line is a header, skipped."""
    split_size: ByteSize = Field(default=64 * 2**20, ge=4096, le=2**30)
    """Bytes per Spark task: large CSV / JSON-lines files are read in byte
    ranges of this size, Parquet files in row groups adding up to about it;
    smaller files share a task."""
    replayable: bool = True
    """Whether ``reclock verify`` re-reads the loads (completeness) while all
    their files are as they were loaded; ``false``: never."""

    @classmethod
    def check_raw(cls, data: Mapping[str, Any]) -> list[InitErrorDetails]:
        out = []
        if data.get("format") == "parquet" and (
                bool(data.get("columns")) == bool(data.get("schema_from"))):
            out.append(problem(("columns",), "parquet loads need the outputs' columns, or "
                                              "schema_from (one of them)"))
        for key in ("columns", "schema_from"):
            if data.get("format") != "parquet" and key in data:
                out.append(problem((key,), "only applies to format 'parquet' (a csv or jsonl "
                                            "output takes its columns from its format)"))
        if data.get("format") != "csv" and "header" in data:
            out.append(problem(("header",), "only applies to format 'csv'"))
        return out

    def build(self, name: str, ctx: SourceContext) -> OneShotSource:
        if ctx.state_dir is None:
            raise DefiniteError(f"source {name!r}: a oneshot source needs the state directory")
        return OneShotSource(name, clock=ctx.clock, state_dir=ctx.state_dir, format=self.format,
                             columns=self.columns, header=self.header,
                             split_size=self.split_size, replayable=self.replayable,
                             output_names=ctx.output_names, schema_from=self.schema_from)


PLUGIN = SourcePlugin(name="oneshot", config=OneShotConfig, rank=5)
