"""PostgreSQL persist sink: one output is one table, loaded with COPY.

Tables of an output writing ``schema.table`` (every identifier quoted, so any
characters work)::

    schema.reclock_uppers   one row per table of this schema that reclock
                            writes: target text PRIMARY KEY (the table's
                            name), output text (the output that last
                            committed), upper bigint (NULL = closed),
                            progress text, updated_at timestamptz,
                            commit_id text, pipeline text and
                            pipeline_state text (the pipeline that
                            committed: its identity and state directory,
                            see :class:`~reclock.contracts.sink.Owner`; added to a
                            table of an earlier layout), target_oid bigint
                            (the table's OID when it was committed: added
                            likewise). The state belongs
                            to the table: two pipelines whose outputs share
                            a name never share a state, two writers of one
                            table fence each other, and a pipeline finding
                            another's identity there is refused. A row
                            whose table was dropped (or dropped and made
                            again: another OID) holds no state: the rows it
                            counted are gone, so the output reads as never
                            committed, which the driver compares with what
                            it knows it committed (runtime/ledger.py).
    schema.table            mode "log":   user columns + reclock's columns
                                          (the update log: _into_time, _diff,
                                          provenance, _error, raw bytes)
                            mode "state": user columns + _into_time (when the
                                          row last changed), PRIMARY KEY (key)
    schema.table_errors     mode "state" only: error rows (reclock's columns)

The commit path (numbering of :mod:`reclock.contracts.sink`)::

    1. PostgresStager.stage   executors: rows conformed to the stored types,
                              nested values turned into JSON text, written to
                              an Arrow IPC file under staging_dir/<name>/.
                              Executors hold no connection and no transaction.
    2. PostgresSink.commit    driver, ONE transaction:
        a. BEGIN; insert the table's row in reclock_uppers if absent
        b. SELECT upper, progress ... FOR UPDATE: unless it is ``expected``,
           ROLLBACK and SinkFenced (nothing written)
        c. COPY ... FROM STDIN (FORMAT BINARY) every staged file
             log:   straight into the table
             state: into a temp table (ON COMMIT DROP); error rows go to
                    table_errors; the others are consolidated in SQL (see
                    "State tables" below): per key, the sum of each
                    IntoTime's updates, the IntoTimes in time order; the
                    last one's row is upserted (INSERT ... ON CONFLICT (key)
                    DO UPDATE), or the key deleted when it leaves none
        d. UPDATE reclock_uppers SET upper, progress, updated_at, commit_id
        e. COMMIT
        f. delete the staged files

Everything is staged before the transaction begins and the row lock of step b
is the fence, so two committers of one output (a zombie pipeline, a lost
race) serialize on it and the second one is fenced, on any number of
machines. A crash or a terminated backend before e. leaves nothing: the
server rolls the transaction back. If the connection is lost *during* e. the
outcome is unknown to the client; ``commit`` then reads ``commit_id`` back
on a new connection: if it is this attempt's, the commit went through and
``commit`` returns normally, otherwise it raises :class:`TransientError`
(nothing was written; retrying with the same ``expected`` is safe).

State tables. The updates of one IntoTime are a multiset with no order in
it (partitions and jobs interleave as they come), so a state table holds
their sum: per IntoTime, equal rows are added up (zeros dropped), and a key
is then applicable when every count is -1 or +1, it retracts exactly the
row the key has (if any: a retraction removes the key's row whatever its
other columns hold, as a diff log's before image may miss a column dropped
upstream since), and it is left with at most one row. A moved value (id 1
releases email x, id 2 takes it) is -old +new for key x: one row remains,
whatever order the two updates come in. Updates that would leave a key with
two rows or a negative count are a SinkError naming the key, the IntoTime
and the positions, and nothing of the commit is written: never a row
dropped or overwritten in silence (an error row instead would leave the key
with a row the updates do not say, and each later update of the key would
then not fit either). The configuration keeps this from happening: a state
table's key must contain the output's upstream key (the envelope's key, or
the primary key of a CDC table; :func:`reclock.contracts.config.state_key_problem`),
which makes one row per key true at every IntoTime; a table changed behind
reclock's back, or an upstream that breaks its own key, still meets the
error. Commits of one IntoTime consolidate without sorting the keys; a
commit holding several orders each key's IntoTimes with a window. Either
way the table is probed once per key (by its primary key) and written by
one upsert and one delete: the work grows with the commit, not the table.

Why COPY in binary format. Measured with psycopg 3.3 against PostgreSQL 15 on
one host, 200k rows of the test schema (two text/bytea columns, the rest
integers), Arrow -> Python conversion included: ``write_row`` in text format
~680k rows/s, in binary format ~850k rows/s. Binary also needs no escaping.
Each column is sent with the type of the *stored* column (its OID from the
catalog), so a compatible wider stored type (bigint for int32) is written
exactly. ``test_copy_throughput`` prints the whole commit's rate; a state
table is slower (the upsert into a primary key and the consolidation
dominate, not the COPY).

Types, Arrow -> PostgreSQL (``read_updates`` returns the staged Arrow type:
timestamps, times and durations in microseconds, date64 as date32, uint64 as
decimal128(20,0), float16 as float32, dictionaries decoded)::

    bool -> boolean                      int8, int16, uint8 -> smallint
    int32, uint16 -> integer             int64, uint32 -> bigint
    uint64 -> numeric(20,0) (decimal)    float16, float32 -> real
    float64 -> double precision          decimal(p,s) -> numeric(p,s)
    string (all kinds) -> text           binary (all kinds) -> bytea
    timestamp[any, tz] -> timestamptz    timestamp[any] -> timestamp
      (stored in microseconds: a value with nanoseconds is a SinkError)
    date32, date64 -> date               time32, time64 -> time (microseconds)
    duration -> interval (microseconds)  list of a scalar type -> <type>[]
    arrow.json extension -> jsonb        struct, map, list of nested -> jsonb

jsonb values of struct/map/list columns use the Kafka sink's JSON encoding:
temporal values as integers in their unit, decimals as strings, binary as
base64, non-finite floats as "NaN"/"Infinity"/"-Infinity", a map as a list of
``[key, value]`` pairs, so every value reads back exactly. PostgreSQL text
cannot hold NUL characters: staging rejects them (SinkError naming the column).

Reading. ``read_updates`` uses the schema given to :meth:`PostgresSink.ensure`;
a sink that was not ensured (``reclock read`` in a new process) maps the
catalog types back (smallint -> int16, integer -> int32, timestamptz ->
timestamp[us, UTC], numeric(p,s) -> decimal, arrays -> lists, ...; jsonb as
arrow.json text; unconstrained numeric and unknown types as text). In state mode the table
holds only the current state, so ``read_updates`` returns it whatever
``as_of`` is: every row once, with ``_diff`` 1, ``_into_time`` the time it last
changed and provenance zero (state tables keep no source positions), plus the
error rows of ``table_errors`` up to ``as_of``.

Secrets. The DSN's password never appears in a repr or a message: both name
the server as ``user@host:port/dbname``, and error texts are scrubbed of the
password and of ``password=``/URL credentials.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import psycopg
import psycopg.errors
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql
from psycopg.adapt import Dumper
from psycopg.pq import Format
from psycopg.rows import TupleRow
from pydantic import AfterValidator, Field
from pydantic_core import InitErrorDetails

from reclock.clients.postgres import (
    DSN_SECRET,
    checked_dsn,
    connect_defaults,
    parse_dsn,
    scrub,
    server_label,
)
from reclock.contracts.encoding import from_json, is_binary, is_listlike, to_json, write_ipc
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
    Mode,
    check_state_settings,
    refuse_null_keys,
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
from reclock.sinks._fs import (
    atomic_write,
    check_descriptor,
    check_stage_args,
    check_staged_file,
    remove_staged,
    sink_os_error,
    staging_root,
    vacuum_staged,
)

log = logging.getLogger("reclock.sinks.postgres")

Connection = psycopg.Connection[TupleRow]

#: The table holding every output's state, in the output table's schema.
UPPERS_TABLE = "reclock_uppers"
#: columns of ``reclock_uppers`` naming the pipeline that committed
#: (:class:`~reclock.contracts.sink.Owner`)
OWNER_COLUMNS = ("pipeline", "pipeline_state")
#: the column of ``reclock_uppers`` holding the OID of the table its state counts the rows of
OID_COLUMN = "target_oid"
#: Suffix of the error-row table of a state-mode output.
ERRORS_SUFFIX = "_errors"
#: The temp table a state-mode commit loads into.
STAGE_TABLE = "_reclock_stage"
#: PostgreSQL truncates longer identifiers (NAMEDATALEN - 1 bytes).
MAX_IDENTIFIER_BYTES = 63
#: Rows converted and sent per step of a COPY (bounds memory on big files).
COPY_CHUNK_ROWS = 10_000
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_LOCK_TIMEOUT_S = 60.0
ORPHAN_GRACE_SECONDS = 6 * 3600.0

#: The order rows are read back in: by IntoTime, then source position.
POSITION_ORDER = (INTO_TIME, SRC_PART, SRC_OFFSET, SRC_SEQ)
#: The temp tables a state-mode commit consolidates in (see :meth:`PostgresSink._apply`).
NET_TABLE = "_reclock_net"
STEPS_TABLE = "_reclock_steps"
#: work_mem of a state-mode commit's transaction (see :meth:`PostgresSink._apply`).
STATE_WORK_MEM = "64MB"
#: Keys a refused state-mode commit names at most (it counts the others).
NAMED_BREACHES = 5

_STAGED = re.compile(r"[A-Za-z0-9_.-]{1,128}-\d{5,}\.arrow")

_JSONB_OID = 3802
_JSON_OID = 114


# -- types ---------------------------------------------------------------------------------


def _is_string(t: pa.DataType) -> bool:
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t)
                or pa.types.is_string_view(t))






def _is_json_ext(t: pa.DataType) -> bool:
    return isinstance(t, pa.JsonType)


def _with_value_type(t: pa.DataType, value: pa.DataType) -> pa.DataType:
    field = t.value_field.with_type(value)
    if pa.types.is_fixed_size_list(t):
        return pa.list_(field, t.list_size)
    if pa.types.is_large_list(t) or pa.types.is_large_list_view(t):
        return pa.large_list(field)
    return pa.list_(field)


def storage_type(t: pa.DataType) -> pa.DataType:
    """The Arrow type a column of type ``t`` is staged and read back as."""
    if pa.types.is_dictionary(t):
        return storage_type(t.value_type)
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", t.tz)
    if pa.types.is_time(t):
        return pa.time64("us")
    if pa.types.is_date64(t):
        return pa.date32()
    if pa.types.is_float16(t):
        return pa.float32()
    if pa.types.is_duration(t):
        return pa.duration("us")
    if pa.types.is_uint64(t):
        return pa.decimal128(20, 0)
    if is_listlike(t) and not _is_nested(t.value_type):
        return _with_value_type(t, storage_type(t.value_type))
    return t


def _is_nested(t: pa.DataType) -> bool:
    """Whether ``t`` is stored as jsonb (not a scalar or an array of scalars)."""
    if pa.types.is_dictionary(t):
        return _is_nested(t.value_type)
    if _is_json_ext(t) or pa.types.is_struct(t) or pa.types.is_map(t):
        return True
    if is_listlike(t):
        return is_listlike(t.value_type) or _is_nested(t.value_type)
    return False


def pg_type(t: pa.DataType, *, output: str = "?", column: str = "?") -> str:
    """The PostgreSQL type of a column of Arrow type ``t``, as ``format_type``
    spells it. Raises :class:`SinkError` for types without one."""
    t = storage_type(t)
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_int8(t) or pa.types.is_int16(t) or pa.types.is_uint8(t):
        return "smallint"
    if pa.types.is_int32(t) or pa.types.is_uint16(t):
        return "integer"
    if pa.types.is_int64(t) or pa.types.is_uint32(t):
        return "bigint"
    if pa.types.is_float32(t):
        return "real"
    if pa.types.is_float64(t):
        return "double precision"
    if pa.types.is_decimal(t) and 1 <= t.precision <= 1000:
        return f"numeric({t.precision},{t.scale})"
    if _is_string(t):
        return "text"
    if is_binary(t):
        return "bytea"
    if pa.types.is_timestamp(t):
        return "timestamp with time zone" if t.tz else "timestamp without time zone"
    if pa.types.is_date32(t):
        return "date"
    if pa.types.is_time64(t):
        return "time without time zone"
    if pa.types.is_duration(t):
        return "interval"
    if _is_nested(t):
        return "jsonb"
    if is_listlike(t):
        return pg_type(t.value_type, output=output, column=column) + "[]"
    raise SinkError(
        f"output {output!r}: column {column!r} has Arrow type {t}, which has no PostgreSQL "
        "type here",
        hint="cast the column in the source's schema (e.g. to string or a struct)",
    )


_META_PG = {f.name: pg_type(f.type) for f in META_FIELDS}

# Stored types accepted for a wanted type besides itself: writing is exact
# (values are sent with the stored column's type), reading casts back.
_WIDER = {
    "smallint": ("integer", "bigint"),
    "integer": ("bigint",),
    "real": ("double precision",),
    "jsonb": ("json",),
}


def _widens_to(stored: str, wanted: str) -> bool:
    """Whether a stored column of type ``stored`` can be widened to
    ``wanted`` in place (``ALTER COLUMN ... TYPE``), every value kept."""
    if stored.endswith("[]") and wanted.endswith("[]"):
        return _widens_to(stored[:-2], wanted[:-2])
    if wanted in ("integer", "bigint") and stored in ("smallint", "integer"):
        return True
    if wanted == "double precision" and stored in ("real", "smallint", "integer"):
        return True
    a, b = _NUMERIC.fullmatch(stored), _NUMERIC.fullmatch(wanted)
    if a and b:
        p, sc, p2, sc2 = int(a[1]), int(a[2]), int(b[1]), int(b[2])
        return sc2 >= sc and p2 - sc2 >= p - sc
    return False


def _compatible(stored: str, wanted: str) -> bool:
    if stored == wanted:
        return True
    if stored.endswith("[]") and wanted.endswith("[]"):
        return _compatible(stored[:-2], wanted[:-2])
    if wanted.startswith("numeric(") and stored == "numeric":
        return True
    return stored in _WIDER.get(wanted, ())


_NUMERIC = re.compile(r"numeric\((\d+),(-?\d+)\)")
_FROM_PG: dict[str, pa.DataType] = {
    "boolean": pa.bool_(),
    "smallint": pa.int16(),
    "integer": pa.int32(),
    "bigint": pa.int64(),
    "real": pa.float32(),
    "double precision": pa.float64(),
    "text": pa.string(),
    "bytea": pa.binary(),
    "timestamp with time zone": pa.timestamp("us", "UTC"),
    "timestamp without time zone": pa.timestamp("us"),
    "date": pa.date32(),
    "time without time zone": pa.time64("us"),
    "interval": pa.duration("us"),
    "jsonb": pa.json_(),
    "json": pa.json_(),
}


def arrow_type(stored: str) -> pa.DataType:
    """The Arrow type a stored column of PostgreSQL type ``stored``
    (``format_type`` spelling) reads back as, when no schema was ensured."""
    if stored in _FROM_PG:
        return _FROM_PG[stored]
    if stored.endswith("[]"):
        return pa.list_(arrow_type(stored[:-2]))
    m = _NUMERIC.fullmatch(stored)
    if m:
        p, s = int(m[1]), int(m[2])
        if p <= 38:
            return pa.decimal128(p, s)
        if p <= 76:
            return pa.decimal256(p, s)
    return pa.string()  # read as the server's text form


def _read_as_text(t: pa.DataType, stored: str) -> bool:
    """Whether a column is selected as ``::text`` (JSON, and types read as text)."""
    if stored in ("jsonb", "json") or _is_nested(t):
        return True
    return _is_string(t) and stored not in ("text", "character varying") \
        and not stored.startswith(("character varying(", "character("))


# -- JSON encoding of nested values (as the Kafka sink's) -----------------------------------

def _plain_type(t: pa.DataType) -> pa.DataType:
    """The type ``t`` is cast to before its values become JSON."""
    if pa.types.is_dictionary(t):
        return _plain_type(t.value_type)
    if pa.types.is_date32(t) or pa.types.is_time32(t):
        return pa.int32()
    if (pa.types.is_timestamp(t) or pa.types.is_date64(t) or pa.types.is_time64(t)
            or pa.types.is_duration(t)):
        return pa.int64()
    if pa.types.is_decimal(t):
        return pa.string()
    if is_listlike(t):
        return _with_value_type(t, _plain_type(t.value_type))
    if pa.types.is_map(t):
        return pa.map_(t.key_field.with_type(_plain_type(t.key_type)),
                       t.item_field.with_type(_plain_type(t.item_type)))
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(_plain_type(t.field(i).type))
                          for i in range(t.num_fields)])
    return t






def _dumps(doc: Any) -> str:
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _json_texts(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """A nested (or arrow.json) column as JSON text."""
    t = col.type
    if _is_json_ext(t):
        return pa.chunked_array([c.storage for c in col.chunks], pa.string())
    plain = col.cast(_plain_type(t))
    texts = [None if v is None else _dumps(to_json(v, plain.type)) for v in plain.to_pylist()]
    return pa.chunked_array([pa.array(texts, pa.string())])


def _from_json_texts(texts: list[Any], t: pa.DataType) -> pa.Array:
    if _is_json_ext(t):
        return pa.ExtensionArray.from_storage(t, pa.array(texts, pa.string()))
    # Built with the stored type directly, not parsed as the plain type and cast:
    # a cast would also convert the placeholders under null structs.
    return pa.array([None if v is None else from_json(json.loads(v), t) for v in texts], t)


# -- executor side ---------------------------------------------------------------------------


def wire_schema(schema: pa.Schema) -> pa.Schema:
    """The staged files' schema for an output schema: jsonb columns as JSON text."""
    return pa.schema([f.with_type(pa.string()) if _is_nested(f.type) else f for f in schema])


@dataclass(frozen=True)
class PostgresStager:
    """Writes staged rows to Arrow IPC files (picklable; holds no connection).

    ``root`` is this output's staging directory, which the driver must be able
    to read; ``schema`` is the stored output schema (storage types).
    """

    name: str
    root: str
    schema: pa.Schema
    mode: Mode = "log"
    key: tuple[str, ...] = ()

    def stage(self, batch_id: str, part: int, table: pa.Table) -> list[dict[str, Any]]:
        """Write ``table`` to ``<root>/<batch_id>-<part:05d>.arrow``.

        The rows are conformed to the stored schema (a SinkError names a
        column that does not fit), state-mode rows are checked (``_diff`` is
        -1 or 1 and the key is set, except on error rows: a row on its own;
        what the rows of an IntoTime leave per key is checked at commit, when
        all of them are there), and nested values
        become JSON text. Returns one descriptor: ``path`` (relative to the
        root), ``rows``, ``errors`` (error rows among them) and ``size``
        (bytes). Restaging the same ``(batch_id, part)`` replaces the file.
        """
        check_stage_args(batch_id, part)
        if table.num_rows == 0:
            return []
        data = self.screen(conform(self.name, table, self.schema))
        if self.mode == "state":
            self._check_state_rows(data)
        wire = self._to_wire(data)
        name = f"{batch_id}-{part:05d}.arrow"
        target = os.path.join(self.root, name)  # (a str: see reclock.sinks._fs._temp_of)
        try:
            os.makedirs(self.root, exist_ok=True)
            size = atomic_write(target, partial(write_ipc, wire))
        except OSError as exc:
            raise sink_os_error(self.name, target, exc) from exc
        errors = data.num_rows - data.column(ERROR).null_count
        return [{"path": name, "rows": data.num_rows, "errors": errors, "size": size}]

    def screen(self, data: pa.Table) -> pa.Table:
        """Rows PostgreSQL cannot store become error rows (see
        :func:`reclock.contracts.rows.refuse_rows`): a NUL character in text or jsonb
        (also inside lists), and, in a state table, a null key (in a
        tombstone intent, which holds the envelope's key only: a wholly
        null key)."""
        for f in data.schema:
            if f.name in META_NAMES:
                continue
            col = data.column(f.name)
            if _is_nested(f.type):
                hit = pc.match_substring(_json_texts(col), "\\u0000")
            elif _is_string(f.type):
                hit = pc.match_substring(col, "\x00")
            elif is_listlike(f.type) and _is_string(f.type.value_type):
                whole = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
                flat = pc.match_substring(pc.list_flatten(whole), "\x00")
                ids = pc.list_parent_indices(whole)
                hit_ids = set(pc.filter(ids, flat).to_pylist())
                hit = pa.array([i in hit_ids for i in range(len(col))])
            else:
                continue
            data = refuse_rows(data, hit, f"column {f.name!r} holds a NUL character, which "
                                          "PostgreSQL text and jsonb cannot store")
        if self.mode == "state" and self.key:
            data = refuse_null_keys(data, self.key)
        return data

    def _check_state_rows(self, data: pa.Table) -> None:
        ok = data.filter(pc.is_null(data.column(ERROR)))
        bad = pc.sum(pc.invert(pc.is_in(ok.column(DIFF), pa.array([-1, 1], pa.int64()))))
        if (bad.as_py() or 0) > 0:
            raise SinkError(
                f"output {self.name!r}: {bad.as_py()} rows have a _diff other than -1 or 1; a "
                "state table applies retractions (-1) and insertions (+1) only",
                hint="write consolidated updates (an upsert or debezium envelope)",
            )

    def _to_wire(self, data: pa.Table) -> pa.Table:
        cols = []
        for f in data.schema:
            col = data.column(f.name)
            if _is_nested(f.type):
                col = _json_texts(col)  # (NUL characters were refused by screen)
            cols.append(col)
        return pa.Table.from_arrays(cols, schema=wire_schema(data.schema))






# -- COPY dumpers: JSON text straight into json/jsonb columns -------------------------------


class _JsonbTextDumper(Dumper):
    """Already-serialized JSON text into a jsonb column (binary format: a
    version byte, then the text). Registered by OID only, so it is used where
    COPY was told the column is jsonb, never for ordinary strings."""

    format = Format.BINARY
    oid = _JSONB_OID

    def dump(self, obj: Any) -> bytes:
        return b"\x01" + str(obj).encode()


class _JsonTextDumper(Dumper):
    format = Format.BINARY
    oid = _JSON_OID

    def dump(self, obj: Any) -> bytes:
        return str(obj).encode()


# -- the catalog ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Column:
    name: str
    type: str  # format_type spelling
    oid: int
    not_null: bool
    has_default: bool


@dataclass(frozen=True)
class _Table:
    oid: int
    columns: dict[str, _Column]  # in attnum order
    primary_key: tuple[str, ...]


def _describe_table(conn: Connection, schema: str, table: str) -> _Table | None:
    """Columns and primary key of ``schema.table``; None if it does not exist."""
    row = conn.execute(
        "SELECT c.oid, c.relkind FROM pg_catalog.pg_class c "
        "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = %s",
        (schema, table),
    ).fetchone()
    if row is None:
        return None
    oid, kind = int(row[0]), str(row[1])
    if kind not in ("r", "p"):
        raise SinkError(
            f"{_qualified(schema, table)} is not a table (relkind {kind!r})",
            hint="point the output at a table name that is free or a table",
        )
    cols = conn.execute(
        "SELECT attname, format_type(atttypid, atttypmod), atttypid, attnotnull, atthasdef "
        "FROM pg_catalog.pg_attribute WHERE attrelid = %s AND attnum > 0 "
        "AND NOT attisdropped ORDER BY attnum",
        (oid,),
    ).fetchall()
    pk = conn.execute(
        "SELECT a.attname FROM pg_catalog.pg_index i JOIN pg_catalog.pg_attribute a "
        "ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
        "WHERE i.indrelid = %s AND i.indisprimary "
        "ORDER BY array_position(i.indkey::int2[], a.attnum)",
        (oid,),
    ).fetchall()
    return _Table(
        oid,
        {str(c[0]): _Column(str(c[0]), str(c[1]), int(c[2]), bool(c[3]), bool(c[4]))
         for c in cols},
        tuple(str(r[0]) for r in pk),
    )


def _qualified(schema: str, table: str) -> str:
    """``"schema"."table"`` for messages (the way SQL spells it)."""
    return ".".join('"' + part.replace('"', '""') + '"' for part in (schema, table))


def _ident(*parts: str) -> sql.Identifier:
    return sql.Identifier(*parts)


def _idents(names: Iterable[str]) -> sql.Composed:
    return sql.SQL(", ").join(sql.Identifier(n) for n in names)


# -- driver side -----------------------------------------------------------------------------


class PostgresSink:
    """A :class:`~reclock.contracts.sink.PersistSink` writing to a PostgreSQL table (see
    the module docstring).

    ``mode`` is ``"log"`` (the update log, every column) or ``"state"`` (the
    current state by ``key``, maintained from the updates; error rows in
    ``<table>_errors``). ``staging_dir`` is a directory the executors write
    and the driver reads. ``connect_timeout_s`` bounds connecting,
    ``lock_timeout_s`` how long a commit waits for another committer of the
    same output. ``clock`` (seconds since the epoch) only decides file ages
    for :meth:`vacuum_orphans`.
    """

    def __init__(
        self,
        name: str,
        *,
        dsn: str,
        table: str,
        schema: str = "public",
        mode: Mode = "log",
        key: Sequence[str] = (),
        staging_dir: str | Path,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
        clock: Clock | None = None,
        owner: Owner | None = None,
    ) -> None:
        self.name = name
        self.owner = owner
        self.table = table
        self.schema = schema
        self.mode: Mode = mode
        self.holds_state = mode == "state"
        self.key = tuple(key)
        self.errors_table = table + ERRORS_SUFFIX
        self.staging_root = staging_root(staging_dir, name)
        self.connect_timeout_s = connect_timeout_s
        self.lock_timeout_s = lock_timeout_s
        self._clock: Clock = clock or SystemClock()  # ms; file ages compare in seconds
        self._dsn = dsn
        self._params, self._secrets = parse_dsn(dsn, f"output {name!r}", SinkError)
        self.server = server_label(self._params)
        self.target = _qualified(schema, table)
        self._check_settings()
        self._user: pa.Schema | None = None  # stored user schema, from ensure()
        self._conn: Connection | None = None
        #: the schema change ensure() found the output needs (columns to add,
        #: types to widen): the next commit makes it, in its transaction
        self._evolve: list[sql.Composed] = []
        self._evolve_said: list[str] = []

    def _check_settings(self) -> None:
        check_state_settings(self.name, self.mode, self.key)
        names = [("schema", self.schema), ("table", self.table)]
        if self.mode == "state":
            names.append(("errors table", self.errors_table))
        for what, ident in names:
            self._check_identifier(what, ident)
        if UPPERS_TABLE in (self.table, self.errors_table if self.mode == "state" else None):
            raise SinkError(f"output {self.name!r}: {UPPERS_TABLE!r} is reclock's own table",
                            hint="choose another table name")

    def _check_identifier(self, what: str, ident: str) -> None:
        if not ident or "\x00" in ident or len(ident.encode()) > MAX_IDENTIFIER_BYTES:
            raise SinkError(
                f"output {self.name!r}: {what} name {ident!r} is empty, holds a NUL or is longer "
                f"than {MAX_IDENTIFIER_BYTES} bytes (PostgreSQL would truncate it)",
                hint="choose a shorter name",
            )

    def __repr__(self) -> str:
        # Never the DSN: it may hold a password.
        return (f"PostgresSink({self.name!r}, table={self.target!r}, mode={self.mode!r}, "
                f"server={self.server!r})")

    # -- connections ---------------------------------------------------------------------------
    def _connect(self) -> Connection:
        conn = self._conn
        if conn is not None and not conn.closed and not conn.broken:
            return conn
        self._drop_connection()
        kwargs = connect_defaults(self._params, f"reclock sink {self.name}",
                                  self.connect_timeout_s)
        try:
            conn = psycopg.connect(self._dsn, autocommit=True, **kwargs)
        except psycopg.Error as exc:
            raise self._error(exc, "connect to") from None
        conn.adapters.register_dumper(None, _JsonbTextDumper)
        conn.adapters.register_dumper(None, _JsonTextDumper)
        self._conn = conn
        return conn

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with suppress(psycopg.Error):
                conn.close()

    def _error(self, exc: psycopg.Error, doing: str) -> ReclockError:
        """A TransientError or SinkError for ``exc`` (its text scrubbed), naming
        the output, the table and the server."""
        text = scrub(str(exc).strip(), self._secrets)
        state = exc.sqlstate
        msg = (f"output {self.name!r}: cannot {doing} {self.target} on {self.server}: "
               f"{text}" + (f" (SQLSTATE {state})" if state else ""))
        lower = text.lower()
        definite_connect = (
            state is None and ("does not exist" in lower or "authentication failed" in lower
                               or "no pg_hba.conf entry" in lower)
        )
        if state == "53100":  # disk_full
            return SinkError(msg, hint="free space on the database server, then retry")
        if (state is not None and state.startswith("28")) or definite_connect:
            return SinkError(msg, hint="check the DSN's database, user and credentials")
        if isinstance(exc, psycopg.errors.InsufficientPrivilege):
            return SinkError(msg, hint=f"grant the pipeline's user access to {self.target} and "
                                       f"{UPPERS_TABLE} in schema {self.schema!r}")
        if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
            return TransientError(msg, hint="the database is unreachable, restarting or busy; "
                                            "retried with backoff")
        return SinkError(msg)

    def _fail(self, exc: psycopg.Error, doing: str) -> ReclockError:
        if self._conn is not None and (self._conn.broken or self._conn.closed):
            self._drop_connection()
        return self._error(exc, doing)

    # -- schema --------------------------------------------------------------------------------
    def ensure(self, user_schema: pa.Schema) -> None:
        """Create the schema, ``reclock_uppers`` and the output's table(s) if
        absent, with the types of the module docstring; or check existing ones.

        An existing table is compatible when every column reclock writes has
        the same type (or a wider one: bigint for integer, double precision
        for real, json for jsonb, numeric for numeric(p,s)), no column that
        may be written null is NOT NULL, every other column is nullable or has
        a default, and a state table's primary key is ``key``. New user
        columns are added (nullable). Anything else is a SinkError naming the
        table and the columns. One ensure at a time per schema (an advisory
        lock), so that concurrent pipelines do not race creating tables.
        """
        output_schema(user_schema)  # no clash with reclock's columns
        stored_user = pa.schema([f.with_type(storage_type(f.type)) for f in user_schema])
        wanted: dict[str, tuple[str, bool]] = {}  # name -> (pg type, not null)
        for f in stored_user:
            self._check_identifier("column", f.name)
            typ = pg_type(f.type, output=self.name, column=f.name)
            wanted[f.name] = (typ, self.mode == "state" and f.name in self.key)
        missing_key = [k for k in self.key if k not in wanted]
        if missing_key:
            raise SinkError(
                f"output {self.name!r}: key columns {missing_key} are not columns of the output",
                hint=f"choose key columns among {user_schema.names}",
            )
        meta = {f.name: (_META_PG[f.name], not f.nullable) for f in META_FIELDS}
        if self.mode == "log":
            wanted.update(meta)
        else:
            wanted[INTO_TIME] = meta[INTO_TIME]
        conn = self._connect()
        self._evolve, self._evolve_said = [], []
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                             (f"reclock ensure {self.schema}",))
                self._ensure_schema(conn)
                self._ensure_uppers(conn)
                self._ensure_table(conn, self.table, wanted, user_names=stored_user.names,
                                   key=self.key if self.mode == "state" else ())
                if self.mode == "state":
                    self._ensure_table(conn, self.errors_table, meta, user_names=[], key=())
        except psycopg.Error as exc:
            raise self._fail(exc, "create") from exc
        self._user = stored_user

    def _ensure_schema(self, conn: Connection) -> None:
        row = conn.execute("SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %s",
                           (self.schema,)).fetchone()
        if row is None:
            log.info("output %r: creating schema %r", self.name, self.schema)
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(_ident(self.schema)))

    def _ensure_uppers(self, conn: Connection) -> None:
        conn.execute(sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (target text PRIMARY KEY, output text, "
            "upper bigint, progress text, updated_at timestamptz NOT NULL DEFAULT now(), "
            "commit_id text, pipeline text, pipeline_state text, target_oid bigint)"
        ).format(_ident(self.schema, UPPERS_TABLE)))
        have = _describe_table(conn, self.schema, UPPERS_TABLE)
        assert have is not None
        missing = [(c, "text") for c in OWNER_COLUMNS if c not in have.columns]
        if OID_COLUMN not in have.columns:
            missing.append((OID_COLUMN, "bigint"))
        if missing and "target" in have.columns:
            # A table of an earlier layout: its rows record no owner and no
            # OID; the first pipeline to commit adopts each, with its table.
            conn.execute(sql.SQL("ALTER TABLE {} {}").format(
                _ident(self.schema, UPPERS_TABLE), sql.SQL(", ").join(
                    sql.SQL("ADD COLUMN IF NOT EXISTS {} {}").format(_ident(c), sql.SQL(t))
                    for c, t in missing)))
            have = _describe_table(conn, self.schema, UPPERS_TABLE)
            assert have is not None
        if have.primary_key == ("output",) and "target" not in have.columns:
            raise SinkError(
                f"{_qualified(self.schema, UPPERS_TABLE)} on {self.server} has an earlier "
                "layout (one row per output name, which two pipelines could share)",
                hint="rename or drop it; reclock now keeps one row per target table",
            )
        need = {"target": "text", "output": "text", "upper": "bigint", "progress": "text",
                "commit_id": "text", **dict.fromkeys(OWNER_COLUMNS, "text"),
                OID_COLUMN: "bigint"}
        bad = [f"{c!r} ({have.columns[c].type if c in have.columns else 'missing'})"
               for c, t in need.items()
               if c not in have.columns or have.columns[c].type != t]
        if bad or have.primary_key != ("target",):
            raise SinkError(
                f"{_qualified(self.schema, UPPERS_TABLE)} on {self.server} is not reclock's "
                f"upper table: columns {', '.join(bad) or 'fine'}, primary key "
                f"{list(have.primary_key)}",
                hint="rename that table, or use another schema",
            )

    def _ensure_table(
        self, conn: Connection, table: str, wanted: dict[str, tuple[str, bool]],
        user_names: Sequence[str], key: tuple[str, ...],
    ) -> None:
        ident = _ident(self.schema, table)
        have = _describe_table(conn, self.schema, table)
        if have is None:
            log.info("output %r: creating table %s", self.name, _qualified(self.schema, table))
            defs = [
                sql.SQL("{} {}{}").format(_ident(name), sql.SQL(typ),
                                          sql.SQL(" NOT NULL" if not_null else ""))
                for name, (typ, not_null) in wanted.items()
            ]
            if key:
                defs.append(sql.SQL("PRIMARY KEY ({})").format(_idents(key)))
            conn.execute(sql.SQL("CREATE TABLE {} ({})").format(ident, sql.SQL(", ").join(defs)))
            return
        clashes: list[str] = []
        add: list[str] = []
        widen: list[str] = []
        for name, (typ, not_null) in wanted.items():
            col = have.columns.get(name)
            if col is None:
                if name in user_names and name not in key:
                    add.append(name)
                else:
                    clashes.append(f"column {name!r} ({typ}) is missing")
            elif not _compatible(col.type, typ):
                if name in user_names and _widens_to(col.type, typ):
                    widen.append(name)
                else:
                    clashes.append(f"column {name!r}: stored {col.type}, wanted {typ}")
            elif col.not_null and not not_null:
                clashes.append(f"column {name!r} is NOT NULL but reclock writes nulls to it")
        for col in have.columns.values():
            if col.name not in wanted and col.not_null and not col.has_default:
                clashes.append(f"column {col.name!r} ({col.type}) is NOT NULL without a default "
                               "and reclock does not write it")
        if key and set(have.primary_key) != set(key):
            clashes.append(f"primary key is {list(have.primary_key)}, wanted {list(key)}")
        if clashes:
            raise SinkError(
                f"output {self.name!r}: table {_qualified(self.schema, table)} on {self.server} "
                "does not fit the output: " + "; ".join(clashes),
                hint="write to a new table, or migrate this one",
            )
        # Made by the next commit, in its transaction: the rows that need
        # the change and the change itself are visible together.
        for name in add:
            self._evolve.append(sql.SQL("ALTER TABLE {} ADD COLUMN {} {}").format(
                ident, _ident(name), sql.SQL(wanted[name][0])))
            self._evolve_said.append(f"add column {name!r} {wanted[name][0]}")
        for name in widen:
            self._evolve.append(sql.SQL("ALTER TABLE {} ALTER COLUMN {} TYPE {}").format(
                ident, _ident(name), sql.SQL(wanted[name][0])))
            self._evolve_said.append(f"widen column {name!r} from {have.columns[name].type} "
                                     f"to {wanted[name][0]}")

    def stager(self) -> PostgresStager:
        if self._user is None:
            raise SinkError(f"output {self.name!r}: schema unknown", hint="call ensure() first")
        return PostgresStager(self.name, str(self.staging_root), output_schema(self._user),
                              self.mode, self.key)

    # -- state ---------------------------------------------------------------------------------
    def state(self) -> SinkState:
        """The committed state; ``SinkState()`` if the output (or the upper
        table) does not exist."""
        conn = self._connect()
        try:
            row = conn.execute(
                sql.SQL("SELECT upper, progress, pipeline, pipeline_state, {}, "
                        "to_regclass(%s)::oid FROM {} WHERE target = %s").format(
                    _ident(OID_COLUMN), _ident(self.schema, UPPERS_TABLE)),
                (self.target, self.table),
            ).fetchone()
        except psycopg.errors.UndefinedTable:
            return SinkState()
        except psycopg.errors.UndefinedColumn:
            return self._state_before_owners(conn)
        except psycopg.Error as exc:
            raise self._fail(exc, "read the state of") from exc
        if row is None:
            return SinkState()
        self._check_owner(row[2], row[3])
        return self._held(SinkState(row[0], row[1]), row[4], row[5])

    def _held(self, recorded: SinkState, oid: int | None, now: int | None) -> SinkState:
        """The state ``recorded`` for the table whose OID was ``oid`` when it
        was committed, now that the table's OID is ``now`` (None: no such
        table): nothing, if it is another table (dropped, made again)."""
        if oid is None or oid == now or recorded.progress is None:
            return recorded  # (a row of an earlier layout: adopted with its table)
        log.warning("output %r: table %s was dropped%s since its last commit (upper %s): the "
                    "rows its state counted are gone", self.name, self.target,
                    "" if now is None else " and made again", recorded.upper)
        return SinkState()

    def _state_before_owners(self, conn: Connection) -> SinkState:
        """:meth:`state` from an upper table of the layout before owners
        (ensure() has not added the columns yet: a reader)."""
        try:
            row = conn.execute(
                sql.SQL("SELECT upper, progress FROM {} WHERE target = %s").format(
                    _ident(self.schema, UPPERS_TABLE)),
                (self.table,),
            ).fetchone()
        except psycopg.Error as exc:
            raise self._fail(exc, "read the state of") from exc
        return SinkState() if row is None else SinkState(row[0], row[1])

    def _check_owner(self, pipeline: str | None, pipeline_state: str | None) -> None:
        """:class:`~reclock.contracts.sink.OutputOwned` when another pipeline
        committed the table."""
        if self.owner is not None:
            self.owner.check(self.name, f"{self.target} on {self.server}", pipeline,
                             pipeline_state)

    # -- commit --------------------------------------------------------------------------------
    def commit(self, staged: list[dict[str, Any]], expected: SinkState, new: SinkState) -> None:
        """Make ``staged`` visible and move the state ``expected -> new``.

        1. Check the request: ``new`` does not go backwards; descriptors name
           staged files.
        2. BEGIN (lock_timeout set); the output's row in ``reclock_uppers``
           inserted if absent; ``SELECT ... FOR UPDATE``: unless it is
           ``expected``, :class:`SinkFenced` and nothing is written. A
           concurrent committer waits here until the first one is done, then
           is fenced.
        3. Every staged file must still be there with its staged size (else
           SinkError), and is COPYed (binary) into the table (log mode) or a
           temp table that is then consolidated and applied (state mode, see
           the module docstring: updates that would leave a key with two
           rows or a negative count are a SinkError naming it); the server's
           row count must match the staged one.
        4. ``UPDATE reclock_uppers`` with ``new`` and a fresh ``commit_id``.
        5. COMMIT. When it fails, the outcome is looked up by ``commit_id``
           on a new connection: committed -> return normally.
        6. Delete the staged files (best effort: the commit is durable).

        Errors: connection loss, a restart, lock timeouts and the like are
        :class:`TransientError` (nothing was written, retry); data the server
        refuses is :class:`SinkError`.
        """
        if not expected.less_equal(new):
            raise ValueError(f"output {self.name!r}: upper would go backwards {expected} -> {new}")
        files = [self._check_descriptor(d) for d in staged]
        commit_id = uuid.uuid4().hex
        conn = self._connect()
        try:
            conn.execute("BEGIN")
            try:
                self._lock_and_check(conn, expected)
                self._step("locked")
                for stmt in self._evolve:  # the output's schema change, with its rows
                    conn.execute(stmt)
                if files:
                    self._load(conn, files)
                self._step("loaded")
                owner = self.owner
                conn.execute(
                    sql.SQL("UPDATE {} SET output = %s, upper = %s, progress = %s, "
                            "updated_at = now(), commit_id = %s, "
                            "pipeline = coalesce(%s, pipeline), "
                            "pipeline_state = coalesce(%s, pipeline_state), "
                            "{} = to_regclass(%s)::oid "
                            "WHERE target = %s").format(_ident(self.schema, UPPERS_TABLE),
                                                        _ident(OID_COLUMN)),
                    (self.name, new.upper, new.progress, commit_id,
                     None if owner is None else owner.pipeline,
                     None if owner is None else owner.state, self.target, self.table),
                )
                self._step("upper_set")
            except BaseException:
                self._rollback(conn)
                raise
        except psycopg.Error as exc:
            raise self._fail(exc, "commit to") from exc
        try:
            self._send_commit(conn)
        except psycopg.Error as exc:
            self._drop_connection()
            if not self._committed_anyway(commit_id, exc):
                raise self._error(exc, "commit to") from exc
        self._step("committed")
        if self._evolve:
            log.info("output %r: %s (%s)", self.name, "; ".join(self._evolve_said), self.target)
            self._evolve, self._evolve_said = [], []
        remove_staged(self.name, [p for p, _ in files], log)

    def _step(self, step: str, count: int = 0) -> None:
        """Called at each step of :meth:`commit`: ``locked``, ``copied`` (after
        each chunk of a COPY, with the rows sent so far), ``loaded``,
        ``upper_set``, ``committed``. Does nothing; tests override it to take
        the server away at a precise point."""

    def _send_commit(self, conn: Connection) -> None:
        """Step 5 on its own, so that tests can lose its reply."""
        conn.execute("COMMIT")

    def _rollback(self, conn: Connection) -> None:
        if conn.broken or conn.closed:
            self._drop_connection()
            return
        try:
            conn.execute("ROLLBACK")
        except psycopg.Error:
            self._drop_connection()

    def _lock_and_check(self, conn: Connection, expected: SinkState) -> None:
        uppers = _ident(self.schema, UPPERS_TABLE)
        conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(
            sql.Literal(f"{max(1, int(self.lock_timeout_s * 1000))}ms")))
        try:
            conn.execute(
                sql.SQL("INSERT INTO {} (target, output, upper, progress) "
                        "VALUES (%s, %s, 0, NULL) ON CONFLICT (target) DO NOTHING").format(uppers),
                (self.table, self.name),
            )
        except psycopg.errors.UndefinedTable as exc:
            raise SinkError(
                f"output {self.name!r}: {_qualified(self.schema, UPPERS_TABLE)} does not exist "
                f"on {self.server}", hint="call ensure() first",
            ) from exc
        row = conn.execute(
            sql.SQL("SELECT upper, progress, pipeline, pipeline_state, {}, "
                    "to_regclass(%s)::oid FROM {} WHERE target = %s FOR UPDATE").format(
                _ident(OID_COLUMN), uppers),
            (self.target, self.table),
        ).fetchone()
        assert row is not None
        self._check_owner(row[2], row[3])
        actual = self._held(SinkState(row[0], row[1]), row[4], row[5])
        if actual != expected:
            raise SinkFenced(
                f"output {self.name!r}: durable state in {_qualified(self.schema, UPPERS_TABLE)} "
                f"is {actual}, expected {expected}; nothing was written",
                hint="another pipeline committed this output; re-read its state",
            )

    def _load(self, conn: Connection, files: list[tuple[str, dict[str, Any]]]) -> None:
        have = _describe_table(conn, self.schema, self.table)
        if have is None:
            raise SinkError(f"output {self.name!r}: table {self.target} does not exist on "
                            f"{self.server}", hint="call ensure() first")
        tables = [(self._open_staged(path, d), d) for path, d in files]
        if self.mode == "log":
            for table, d in tables:
                self._copy(conn, _ident(self.schema, self.table), have, table, d)
            return
        # State mode: every staged user column, then reclock's columns.
        user: list[str] = []
        for table, _ in tables:
            user += [n for n in table.column_names if n not in META_NAMES and n not in user]
        self._check_columns(have, user)
        stage_cols = sql.SQL(", ").join(
            [sql.SQL("t.{}").format(_ident(n)) for n in user]
            + [sql.SQL("NULL::{} AS {}").format(sql.SQL(_META_PG[m]), _ident(m))
               for m in META_NAMES]
        )
        conn.execute(sql.SQL("CREATE TEMP TABLE {} ON COMMIT DROP AS SELECT {} FROM {} t "
                             "WITH NO DATA").format(
            _ident(STAGE_TABLE), stage_cols, _ident(self.schema, self.table)))
        stage = _describe_table(conn, _temp_schema(conn), STAGE_TABLE)
        assert stage is not None
        for table, d in tables:
            self._copy(conn, _ident(STAGE_TABLE), stage, table, d)
        self._apply(conn, user, stage)

    def _check_columns(self, have: _Table, names: Iterable[str]) -> None:
        unknown = [n for n in names if n not in have.columns]
        if unknown:
            raise SinkError(
                f"output {self.name!r}: staged columns {unknown} are not in {self.target}",
                hint="call ensure() with the new schema before staging",
            )

    def _copy(self, conn: Connection, into: sql.Identifier, have: _Table, table: pa.Table,
              d: dict[str, Any]) -> None:
        names = table.column_names
        self._check_columns(have, names)
        oids = [have.columns[n].oid for n in names]
        sent = 0
        with conn.cursor() as cur:
            with cur.copy(sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(
                    into, _idents(names))) as cp:
                cp.set_types(oids)
                for start in range(0, table.num_rows, COPY_CHUNK_ROWS):
                    chunk = table.slice(start, COPY_CHUNK_ROWS)
                    cols = [c.to_pylist() for c in chunk.columns]
                    for row in zip(*cols, strict=True):
                        cp.write_row(row)
                    sent += chunk.num_rows
                    self._step("copied", sent)
            if cur.rowcount != d["rows"]:
                raise SinkError(
                    f"output {self.name!r}: staged file {d['path']} holds {d['rows']} rows, "
                    f"the server took {cur.rowcount}", hint="restage the batch",
                )

    def _apply(self, conn: Connection, user: list[str], stage: _Table) -> None:
        """State mode: the staged updates (in the temp table) onto the table,
        and error rows into the errors table.

        The updates of one IntoTime are a multiset, in no order: they are
        consolidated (rows of one IntoTime summed by value, zeros dropped)
        and checked per key and IntoTime, the IntoTimes of a key in time
        order. Let ``before`` be whether the key has a row before the
        IntoTime (in the table, or after the key's previous IntoTime of this
        commit), ``del``/``ins`` its consolidated rows with a negative /
        positive count: the IntoTime is applicable when every count is -1 or
        +1, ``del == before`` (it retracts exactly the row the key has, if
        any) and ``ins <= 1`` (it leaves at most one). A retraction removes
        the key's row whatever its other columns hold (a diff log's before
        image may lack a column added or dropped since). Each key then takes
        its last IntoTime's inserted row (upserted, ``_into_time`` that
        IntoTime) or, if it inserts none, is deleted. A key that breaks the
        rule is a :class:`SinkError` naming it, its IntoTime and the updates'
        positions; nothing is written (see :meth:`_refuse`).

        All of it is SQL over the temp table: a GROUP BY, an index probe of
        the table per key, a window over the keys' IntoTimes (when there are
        several), one upsert and one delete."""
        target = _ident(self.schema, self.table)
        staged = _ident(STAGE_TABLE)
        meta = _idents(META_NAMES)
        conn.execute(sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {} WHERE {} IS NOT NULL").format(
            _ident(self.schema, self.errors_table), meta, meta, staged, _ident(ERROR)))
        keys = list(self.key)
        # The consolidation hashes and sorts every staged row: in memory, not
        # in temp files (PostgreSQL's default work_mem is 4 MB).
        conn.execute(sql.SQL("SET LOCAL work_mem = {}").format(sql.Literal(STATE_WORK_MEM)))
        # json has no equality: its values are grouped (and then written) as jsonb
        json_cols = {c for c in user if stage.columns[c].type == "json"}
        grouped = [sql.SQL("{}::jsonb AS {}").format(_ident(c), _ident(c)) if c in json_cols
                   else _ident(c) for c in user]
        # (the computed columns' names are spelled out in the SQL: _reclock_*)
        names = {"net": _ident(NET_TABLE), "steps": _ident(STEPS_TABLE), "staged": staged,
                 "target": target, "into": _ident(INTO_TIME), "diff": _ident(DIFF),
                 "err": _ident(ERROR), "keys": _idents(keys)}
        conn.execute(sql.SQL(
            "CREATE TEMP TABLE {net} ON COMMIT DROP AS "
            "SELECT {grouped}, {into}, sum({diff})::bigint AS _reclock_n "
            "FROM {staged} WHERE {err} IS NULL "
            "GROUP BY {positions} HAVING sum({diff}) <> 0"
        ).format(grouped=sql.SQL(", ").join(grouped),
                 positions=sql.SQL(", ").join(sql.SQL(str(i)) for i in range(1, len(user) + 2)),
                 **names))

        span = conn.execute(sql.SQL("SELECT min({into}), max({into}) FROM {net}").format(
            **names)).fetchone()
        if span is None or span[0] is None:
            return  # every update cancelled out
        # Most commits hold one IntoTime: then a key's row before it is the
        # table's, and its last IntoTime that one, without sorting the keys.
        several = span[0] != span[1]

        def match(a: str, b: str) -> sql.Composable:
            return sql.SQL(" AND ").join(sql.SQL("{}.{} = {}.{}").format(
                sql.Identifier(a), _ident(k), sql.Identifier(b), _ident(k)) for k in keys)

        # Whether the table has the key: one index probe per key (the
        # commit's keys are few next to a big table's rows, which a join
        # would hash whole).
        held = sql.SQL("CASE WHEN EXISTS (SELECT FROM {target} t WHERE {ts}) THEN 1 ELSE 0 END"
                       ).format(ts=match("t", "s"), **names)
        conn.execute(sql.SQL(
            "CREATE TEMP TABLE {steps} ON COMMIT DROP AS "
            "SELECT {s_keys}, s.{into}, s._reclock_ins, s._reclock_del, s._reclock_lo, "
            "       s._reclock_hi, s._reclock_plus, {before} AS _reclock_before, "
            "       {last} AS _reclock_last "
            "FROM (SELECT {keys}, {into}, "
            "             count(*) FILTER (WHERE _reclock_n > 0) AS _reclock_ins, "
            "             count(*) FILTER (WHERE _reclock_n < 0) AS _reclock_del, "
            "             min(_reclock_n) AS _reclock_lo, max(_reclock_n) AS _reclock_hi, "
            "             coalesce(sum(_reclock_n) FILTER (WHERE _reclock_n > 0), 0)::bigint "
            "               AS _reclock_plus "
            "      FROM {net} GROUP BY {keys}, {into}) s{window}"
        ).format(
            s_keys=sql.SQL(", ").join(sql.SQL("s.{}").format(_ident(k)) for k in keys),
            before=sql.SQL("coalesce(lag(s._reclock_ins) OVER w, {})").format(held)
            if several else held,
            last=sql.SQL("lead(s.{}) OVER w IS NULL").format(names["into"])
            if several else sql.SQL("true"),
            window=sql.SQL(" WINDOW w AS (PARTITION BY {} ORDER BY s.{})").format(
                sql.SQL(", ").join(sql.SQL("s.{}").format(_ident(k)) for k in keys),
                names["into"]) if several else sql.SQL(""),
            **names))
        breach = sql.SQL("_reclock_lo < -1 OR _reclock_hi > 1 OR _reclock_ins > 1 "
                         "OR _reclock_del <> _reclock_before")
        bad = conn.execute(sql.SQL(
            "SELECT {keys}, {into}, _reclock_before, _reclock_del, _reclock_ins, _reclock_lo, "
            "       _reclock_hi, _reclock_plus, count(*) OVER () "
            "FROM {steps} WHERE {breach} ORDER BY {into}, {keys} LIMIT {limit}"
        ).format(breach=breach, limit=sql.Literal(NAMED_BREACHES), **names)).fetchall()
        if bad:
            self._refuse(conn, bad, breach)
        cols = [*user, INTO_TIME]
        picked = [sql.SQL("n.{}::json").format(_ident(c)) if c in json_cols
                  else sql.SQL("n.{}").format(_ident(c)) for c in cols]
        # (checked: a key's last IntoTime inserts one row at most)
        source = (sql.SQL("{net} n JOIN {steps} l ON {nl} AND n.{into} = l.{into} "
                          "WHERE l._reclock_last AND n._reclock_n > 0")
                  if several else sql.SQL("{net} n WHERE n._reclock_n > 0")
                  ).format(nl=match("n", "l"), **names)
        conn.execute(sql.SQL(
            "WITH gone AS ("
            "  DELETE FROM {target} t USING {steps} l "
            "  WHERE l._reclock_last AND l._reclock_ins = 0 AND {tl}"
            ") "
            "INSERT INTO {target} ({cols}) SELECT {picked} FROM {source} "
            "ON CONFLICT ({keys}) DO UPDATE SET {sets}"
        ).format(
            tl=match("t", "l"), cols=_idents(cols), picked=sql.SQL(", ").join(picked),
            source=source,
            sets=sql.SQL(", ").join(sql.SQL("{c} = EXCLUDED.{c}").format(c=_ident(c))
                                    for c in cols if c not in keys),
            **names,
        ))

    def _refuse(self, conn: Connection, bad: list[TupleRow], breach: sql.Composable) -> None:
        """Raise the :class:`SinkError` of a state-mode commit whose updates
        leave a key with more than one row or a negative count (``bad``: the
        first such keys and IntoTimes, from :meth:`_apply`). A definite error,
        not an error row: the table cannot hold what the updates say, an
        error row would leave the key with a row they do not say, and every
        later update of the key would then not fit either. So nothing is
        written and the output stalls, naming the key, the IntoTime and the
        positions of its updates, until the cause is fixed."""
        keys = list(self.key)
        nk = len(keys)
        positions = conn.execute(sql.SQL(
            "SELECT st.{diff}, st.{part}, st.{off}, st.{seq} FROM {staged} st JOIN "
            "(SELECT {keys}, {into} FROM {steps} WHERE {breach} ORDER BY {into}, {keys} "
            " LIMIT 1) b "
            "ON {match} AND st.{into} = b.{into} WHERE st.{err} IS NULL "
            "ORDER BY st.{part}, st.{off}, st.{seq}, st.{diff} LIMIT 8"
        ).format(diff=_ident(DIFF), part=_ident(SRC_PART), off=_ident(SRC_OFFSET),
                 seq=_ident(SRC_SEQ), staged=_ident(STAGE_TABLE), keys=_idents(keys),
                 into=_ident(INTO_TIME), steps=_ident(STEPS_TABLE), breach=breach,
                 match=sql.SQL(" AND ").join(sql.SQL("st.{k} = b.{k}").format(k=_ident(k))
                                             for k in keys),
                 err=_ident(ERROR))).fetchall()
        row = bad[0]
        value = ", ".join(f"{k}={v!r}" for k, v in zip(keys, row[:nk], strict=True))
        into, before, dels, ins, lo, hi, plus, total = row[nk:]
        if lo < -1 or dels > before:
            what = "a negative count: they retract a row the key does not have"
        else:
            what = f"{before - dels + plus} live rows"
        held = "a row" if before else "no row"
        rows = [f"retract {dels} and insert {ins} distinct row{'' if ins == 1 else 's'}"]
        if hi > 1:
            rows.append(f"one of them {hi} times")
        if lo < -1:
            rows.append(f"one retracted {-lo} times")
        at = ", ".join(f"{d:+d} at partition {p} offset {o} seq {q}"
                       for d, p, o, q in positions)
        more = "" if total == 1 else f" ({total - 1} more keys or IntoTimes do too)"
        raise SinkError(
            f"output {self.name!r}: the updates of IntoTime {into} leave key ({value}) of "
            f"{self.target} with {what} (it had {held}; they {', '.join(rows)}; updates: "
            f"{at}){more}; a state table holds one row per key, so nothing was written",
            hint="the updates do not keep one row per key: the upstream broke the key the "
                 "output relies on, or something else changed the table. Keep the update log "
                 "(mode: log), or key the table by the output's upstream key",
        )

    def _committed_anyway(self, commit_id: str, exc: psycopg.Error) -> bool:
        """After COMMIT failed: did it go through? (see the module docstring)."""
        try:
            conn = self._connect()
            row = conn.execute(
                sql.SQL("SELECT commit_id FROM {} WHERE target = %s").format(
                    _ident(self.schema, UPPERS_TABLE)),
                (self.table,),
            ).fetchone()
        except (psycopg.Error, ReclockError) as check:
            self._drop_connection()
            raise TransientError(
                f"output {self.name!r}: COMMIT to {self.target} on {self.server} failed "
                f"({scrub(str(exc).strip(), self._secrets)}) and its outcome cannot be read "
                f"back ({scrub(str(check).strip(), self._secrets)})",
                hint="retry: if it did commit, the retry is fenced and state() shows it",
            ) from None
        if row is not None and row[0] == commit_id:
            log.warning("output %r: COMMIT reported %s, but the commit went through",
                        self.name, scrub(str(exc).strip(), self._secrets))
            return True
        return False

    def _check_descriptor(self, d: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        name = check_descriptor(self.name, "Postgres", d, _STAGED, {"size": int, "rows": int})
        return os.path.join(self.staging_root, name), d

    def _open_staged(self, path: str, d: dict[str, Any]) -> pa.Table:
        check_staged_file(self.name, path, d["size"])
        try:
            with pa.memory_map(str(path)) as source:
                return pa.ipc.open_file(source).read_all()
        except (OSError, pa.ArrowInvalid) as exc:
            raise SinkError(f"output {self.name!r}: cannot read staged file {path}: {exc}",
                            hint="restage the batch") from exc

    # -- reading -------------------------------------------------------------------------------
    def read_updates(self, as_of: int | None = None) -> pa.Table:
        """Log mode: the committed rows with ``_into_time <= as_of`` (all if
        None), ordered by IntoTime and source position. State mode: the
        current state (see the module docstring; ``as_of`` only filters error
        rows). An output whose table does not exist reads as an empty table.
        One REPEATABLE READ snapshot."""
        conn = self._connect()
        try:
            with conn.transaction():
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                have = _describe_table(conn, self.schema, self.table)
                if have is None:
                    user = self._user if self._user is not None else pa.schema([])
                    return output_schema(user).empty_table()
                user = self._user if self._user is not None else self._catalog_user(have)
                if self.mode == "log":
                    where = (sql.SQL("") if as_of is None else
                             sql.SQL(" WHERE {} <= {}").format(_ident(INTO_TIME),
                                                             sql.Literal(as_of)))
                    return self._select(conn, have, output_schema(user), self.table, where,
                                        _idents(POSITION_ORDER))
                return self._read_state(conn, have, user, as_of)
        except psycopg.Error as exc:
            raise self._fail(exc, "read") from exc

    def _catalog_user(self, have: _Table) -> pa.Schema:
        skip = set(META_NAMES) if self.mode == "log" else {INTO_TIME}
        return pa.schema([pa.field(c.name, arrow_type(c.type))
                          for c in have.columns.values() if c.name not in skip])

    def _read_state(self, conn: Connection, have: _Table, user: pa.Schema,
                    as_of: int | None) -> pa.Table:
        schema = output_schema(user)
        fields = pa.schema([*user, schema.field(INTO_TIME)])
        current = self._select(conn, have, fields, self.table, sql.SQL(""), _idents(self.key))
        n = current.num_rows
        zeros32 = pa.array([0] * n, pa.int32())
        extra = {DIFF: pa.array([1] * n, pa.int64()), SRC_PART: zeros32,
                 SRC_OFFSET: pa.array([0] * n, pa.int64()), SRC_SEQ: zeros32}
        data = conform(self.name, pa.table(
            {**{c: current.column(c) for c in current.column_names}, **extra}), schema)
        errors_have = _describe_table(conn, self.schema, self.errors_table)
        if errors_have is None:
            return data
        where = (sql.SQL("") if as_of is None else
                 sql.SQL(" WHERE {} <= {}").format(_ident(INTO_TIME), sql.Literal(as_of)))
        errs = self._select(conn, errors_have, pa.schema(META_FIELDS), self.errors_table, where,
                            _idents(POSITION_ORDER))
        return pa.concat_tables([data, conform(self.name, errs, schema)])

    def _select(self, conn: Connection, have: _Table, schema: pa.Schema, table: str,
                where: sql.Composable, order: sql.Composable) -> pa.Table:
        """``schema``'s columns of ``table`` (absent ones read as null)."""
        present = [f for f in schema if f.name in have.columns]
        exprs = [
            sql.SQL("{}::text").format(_ident(f.name))
            if _read_as_text(f.type, have.columns[f.name].type) else _ident(f.name)
            for f in present
        ]
        query = sql.SQL("SELECT {} FROM {}{} ORDER BY {}").format(
            sql.SQL(", ").join(exprs) if exprs else sql.SQL("1"),
            _ident(self.schema, table), where, order)
        with conn.cursor(binary=True) as cur:
            rows = cur.execute(query).fetchall()
        values = list(zip(*rows, strict=True)) if rows and present else [() for _ in present]
        cols: dict[str, pa.Array] = {}
        for f, vals in zip(present, values, strict=True):
            try:
                if _read_as_text(f.type, have.columns[f.name].type) and not _is_string(f.type):
                    cols[f.name] = _from_json_texts(list(vals), f.type)
                else:
                    cols[f.name] = pa.array(list(vals), f.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError,
                    ValueError, TypeError, KeyError) as exc:
                raise SinkError(
                    f"output {self.name!r}: column {f.name!r} of {_qualified(self.schema, table)} "
                    f"({have.columns[f.name].type}) does not read as {f.type}: {exc}",
                    hint="was the table changed by hand?",
                ) from exc
        n = len(rows)
        arrays = [cols[f.name] if f.name in cols else pa.nulls(n, f.type) for f in schema]
        return pa.Table.from_arrays(arrays, schema=schema)

    # -- maintenance ---------------------------------------------------------------------------
    def vacuum_orphans(self, grace_seconds: float = ORPHAN_GRACE_SECONDS) -> list[str]:
        """Delete staged files older than ``grace_seconds`` (left by failed
        commits and abandoned jobs); return their names."""
        return vacuum_staged(self.name, self.staging_root, _STAGED, grace_seconds,
                             self._clock.now() / 1000.0)

    def maintain(self, now_ms: int) -> dict[str, int]:
        """Nothing to maintain: the table's upkeep is PostgreSQL's (autovacuum)."""
        return {}

    def close(self) -> None:
        """Close the connection (every commit is complete or rolled back)."""
        self._drop_connection()


def _temp_schema(conn: Connection) -> str:
    row = conn.execute("SELECT nspname FROM pg_catalog.pg_namespace "
                       "WHERE oid = pg_catalog.pg_my_temp_schema()").fetchone()
    assert row is not None
    return str(row[0])


# -- configuration ----------------------------------------------------------------


class PostgresSinkConfig(SinkConfigBase):
    """A PostgreSQL table, loaded with COPY; each commit is one transaction
    holding the rows and the output's upper (table ``reclock_uppers``)."""

    type: Literal["postgres"] = "postgres"
    """``postgres``."""
    dsn: Annotated[str, AfterValidator(checked_dsn), DSN_SECRET] = Field(min_length=1)
    """``postgresql://user:${PGPASSWORD}@host:port/db`` (a password holding
    reserved characters percent-encoded) or ``host=... dbname=...``; checked
    when the file is loaded; the password is never printed."""
    table: str = Field(min_length=1, max_length=63)
    """Target table (created with matching types when absent)."""
    schema_: str = Field(default="public", alias="schema", min_length=1, max_length=63)
    """Target schema."""
    mode: Literal["log", "state"] = "log"
    """``log``: every update with ``_into_time``, ``_diff`` and provenance.
    ``state``: the current rows, keyed by ``key`` (each commit applies the sum
    of every IntoTime's updates per key, in the same transaction)."""
    key: tuple[str, ...] = ()
    """With ``mode: state``: the primary key columns. They must contain the
    output's upstream key (:func:`~reclock.contracts.config.state_key_problem`):
    the envelope's key, or the key the source declares (a CDC table's
    primary key); other keys are refused when the configuration is loaded or
    the source describes the output."""

    TARGET: ClassVar[str] = "table"

    @classmethod
    def target_of(cls, raw: Mapping[str, Any]) -> tuple[str, ...] | None:
        if not isinstance(raw.get("table"), str):
            return None
        return ("postgres", str(raw.get("dsn")), str(raw.get("schema") or "public"),
                str(raw["table"]))

    @classmethod
    def state_key_of(cls, raw: Mapping[str, Any]) -> tuple[str, ...] | None:
        return state_key_of(raw)

    @classmethod
    def check_raw(cls, data: Mapping[str, Any]) -> list[InitErrorDetails]:
        return state_check_raw(data)

    def build(self, ctx: SinkContext) -> PostgresSink:
        return PostgresSink(ctx.name, dsn=self.dsn, table=self.table, schema=self.schema_,
                            mode=self.mode, key=tuple(self.key),
                            staging_dir=ctx.state_dir / "staging", owner=ctx.owner)


PLUGIN = SinkPlugin(name="postgres", config=PostgresSinkConfig)
