"""Console sink: print committed updates, for trying a pipeline out.

Nothing is written at staging time: the executors ship the rows themselves
back to the driver (at most ``max_rows`` per stage call, plus a count), and
``commit`` prints them, one line per update::

    [orders.main] into_time=1700000000000 diff=1 {"id": 7, "amount": 12.5}
    [orders.main] into_time=1700000000000 diff=1 error='bad json: ...' {"id": null}
    ... and 1234 more

and then persists the new :class:`~reclock.contracts.sink.SinkState` to ``state_path``
(JSON, temp file + fsync + ``os.replace``).

Guarantees. The *state* is exact and fenced like the Delta sink's: ``commit``
checks, under an ``flock``, that the state file holds ``expected`` before it
prints or writes anything. The *terminal* is at-least-once: printing is not
transactional, so a crash between printing and persisting the state prints
the same updates again on retry. ``read_updates`` returns an empty table
because the console keeps no copy of what it printed: it is not a store, and
``reclock read`` on a console output shows nothing (use a file output).
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO

import pyarrow as pa
from pydantic import Field

from reclock.contracts.encoding import py_rows
from reclock.contracts.rows import output_schema
from reclock.contracts.sink import (
    SinkConfigBase,
    SinkContext,
    SinkError,
    SinkFenced,
    SinkPlugin,
    SinkState,
)
from reclock.core.columns import DIFF, ERROR, INTO_TIME, META_FIELDS, META_NAMES
from reclock.sinks._fs import atomic_write, exclusive_lock, sink_os_error


def jsonable(value: Any) -> Any:
    """``value`` (from ``to_pylist``) as plain JSON data, for shipping and printing."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return "base64:" + base64.b64encode(value).decode("ascii")
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta | decimal.Decimal):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):  # lists; maps come as lists of (key, value) tuples
        return [jsonable(v) for v in value]
    return str(value)


@dataclass(frozen=True)
class ConsoleStager:
    """Ships at most ``max_rows`` rows per stage call to the driver (picklable)."""

    max_rows: int = 20

    def screen(self, table: pa.Table) -> pa.Table:
        """Every row can be printed."""
        return table

    def stage(self, batch_id: str, part: int, table: pa.Table) -> list[dict[str, Any]]:
        if table.num_rows == 0:
            return []
        head = py_rows(table.slice(0, self.max_rows))
        rows = [{k: jsonable(v) for k, v in row.items()} for row in head]
        return [{"batch": batch_id, "part": part, "count": table.num_rows, "rows": rows}]


class ConsoleSink:
    """A :class:`~reclock.contracts.sink.PersistSink` that prints to ``out`` (see module doc)."""

    holds_state = False  # an update log

    def __init__(
        self,
        name: str,
        state_path: str | Path,
        out: TextIO | None = None,
        max_rows: int = 20,
    ) -> None:
        self.name = name
        self.state_path = Path(state_path).absolute()
        # Resolved at print time, so that a replaced sys.stdout (pytest's
        # capture, a redirect) is honoured when no stream was given.
        self._out = out
        self.max_rows = max_rows
        self._schema: pa.Schema | None = None

    def __repr__(self) -> str:
        return f"ConsoleSink({self.name!r}, {str(self.state_path)!r})"

    def ensure(self, user_schema: pa.Schema) -> None:
        """Check the schema (no clash with reclock's columns) and that the
        state file's directory can be created."""
        self._schema = output_schema(user_schema)
        try:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise sink_os_error(self.name, self.state_path.parent, exc, "create") from exc

    def state(self) -> SinkState:
        try:
            text = self.state_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return SinkState()
        except OSError as exc:
            raise sink_os_error(self.name, self.state_path, exc, "read") from exc
        try:
            doc = json.loads(text)
            upper, progress = doc["upper"], doc["progress"]
            if not (upper is None or isinstance(upper, int)) or not (
                progress is None or isinstance(progress, str)
            ):
                raise TypeError("upper must be an integer or null, progress a string or null")
        except (ValueError, KeyError, TypeError) as exc:
            raise SinkError(
                f"output {self.name!r}: state file {self.state_path} is corrupt: {exc}",
                hint="restore it, or delete it to print everything again",
            ) from exc
        return SinkState(upper, progress)

    def stager(self) -> ConsoleStager:
        return ConsoleStager(self.max_rows)

    def commit(self, staged: list[dict[str, Any]], expected: SinkState, new: SinkState) -> None:
        """1. fence: the state file holds ``expected`` (else SinkFenced, nothing
        printed); 2. print the staged rows; 3. persist ``new`` atomically."""
        if not expected.less_equal(new):
            raise ValueError(f"output {self.name!r}: upper would go backwards {expected} -> {new}")
        try:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise sink_os_error(self.name, self.state_path.parent, exc, "create") from exc
        lock = self.state_path.with_name(self.state_path.name + ".lock")
        with exclusive_lock(lock, output=self.name):
            actual = self.state()
            if actual != expected:
                raise SinkFenced(
                    f"output {self.name!r}: state in {self.state_path} is {actual}, "
                    f"expected {expected}; nothing was printed",
                    hint="another pipeline committed this output; re-read its state",
                )
            self._print(staged)
            doc = json.dumps({"upper": new.upper, "progress": new.progress}).encode()
            try:
                atomic_write(self.state_path, doc)
            except OSError as exc:
                raise sink_os_error(self.name, self.state_path, exc) from exc

    def _print(self, staged: list[dict[str, Any]]) -> None:
        out = self._out if self._out is not None else sys.stdout
        total = sum(int(d["count"]) for d in staged)
        shown = 0
        for d in staged:
            for row in d["rows"]:
                if shown >= self.max_rows:
                    break
                out.write(self.format_row(row) + "\n")
                shown += 1
        if total > shown:
            out.write(f"[{self.name}] ... and {total - shown} more\n")
        out.flush()

    def format_row(self, row: dict[str, Any]) -> str:
        """``[output] into_time=T diff=D [error=...] {user columns}``."""
        user = {k: v for k, v in row.items() if k not in META_NAMES}
        err = row.get(ERROR)
        middle = "" if err is None else f" error={err!r}"
        return (
            f"[{self.name}] into_time={row.get(INTO_TIME)} diff={row.get(DIFF)}{middle} "
            + json.dumps(user, ensure_ascii=False)
        )

    def read_updates(self, as_of: int | None = None) -> pa.Table:
        """Always empty: the console keeps no copy of what it printed."""
        schema = self._schema if self._schema is not None else pa.schema(META_FIELDS)
        return schema.empty_table()

    def vacuum_orphans(self, grace_seconds: float = 0.0) -> list[str]:
        """Stages nothing that could be orphaned."""
        return []

    def maintain(self, now_ms: int) -> dict[str, int]:
        """Nothing to maintain."""
        return {}

    def close(self) -> None:
        out = self._out if self._out is not None else sys.stdout
        out.flush()


# -- configuration ----------------------------------------------------------------


class ConsoleSinkConfig(SinkConfigBase):
    """Prints committed updates, for trying a pipeline out (the output's upper
    is kept; the rows are not)."""

    type: Literal["console"] = "console"
    """``console``."""
    max_rows: int = Field(default=20, gt=0)
    """Rows printed per batch at most (the rest are counted)."""

    def build(self, ctx: SinkContext) -> ConsoleSink:
        return ConsoleSink(ctx.name, ctx.state_dir / "console" / f"{ctx.name}.json",
                           max_rows=self.max_rows)


PLUGIN = SinkPlugin(name="console", config=ConsoleSinkConfig)
