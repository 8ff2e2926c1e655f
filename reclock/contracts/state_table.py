"""State tables: an output kept as one row per key (``mode: state``), not as
its update log. What the sinks that keep one share (the Postgres sink does
its consolidation in SQL; the Delta and Iceberg sinks here):

* the settings checks (:func:`check_state_settings`, :func:`state_key_of`,
  :func:`state_check_raw`);
* the rule that turns a commit's updates into each key's new row or its
  deletion (:func:`state_changes`).

The rule (the Postgres sink's, see ``sinks/postgres.py`` "State tables"):
the updates of one IntoTime are a multiset with no order in it, so a state
table applies their sum. Per IntoTime, equal rows are added up (zeros
dropped); a key's IntoTime is then applicable when every count is -1 or +1,
it retracts exactly the row the key has before it (if any: a retraction
removes the key's row whatever its other columns hold), and it leaves at
most one row. The key's last IntoTime in the commit decides: its inserted
row (with ``_into_time`` that IntoTime), or no row. Updates that break the
rule are a :class:`~reclock.contracts.sink.SinkError` naming the key, the
IntoTime and the updates' positions, and nothing of the commit is written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
from pydantic_core import InitErrorDetails

from reclock.contracts.config import problem
from reclock.contracts.consolidate import normalize_floats, row_keys
from reclock.contracts.rows import refuse_rows
from reclock.contracts.sink import SinkError
from reclock.core.columns import DIFF, ERROR, INTO_TIME, SRC_OFFSET, SRC_PART, SRC_SEQ

Mode = Literal["log", "state"]


def check_state_settings(output: str, mode: str, key: Sequence[str]) -> None:
    """A :class:`SinkError` unless ``mode`` and ``key`` go together: a state
    table needs key columns, each once; a log takes none."""
    if mode not in ("log", "state"):
        raise SinkError(f"output {output!r}: mode {mode!r} is not 'log' or 'state'")
    if mode == "state" and not key:
        raise SinkError(f"output {output!r}: a state table needs key columns",
                        hint="set key to the columns that identify a row")
    if mode == "log" and key:
        raise SinkError(f"output {output!r}: key only applies to mode 'state'",
                        hint="drop the key, or use mode: state")
    if len(set(key)) != len(key):
        raise SinkError(f"output {output!r}: key {list(key)} repeats a column")


def state_key_of(raw: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The key of a raw sink block with ``mode: state`` (None otherwise): what
    :meth:`~reclock.contracts.sink.SinkConfigBase.state_key_of` returns for a
    sink with a state mode."""
    key = raw.get("key")
    if raw.get("mode") != "state" or not isinstance(key, Sequence) or isinstance(key, str):
        return None
    return tuple(str(k) for k in key)


def state_check_raw(data: Mapping[str, Any]) -> list[InitErrorDetails]:
    """The problems of a raw sink block's ``mode``/``key`` pair."""
    if data.get("mode") == "state" and not data.get("key"):
        return [problem(("key",), "required with mode: state")]
    return []


def refuse_null_keys(table: pa.Table, key: Sequence[str]) -> pa.Table:
    """``table`` with the rows whose state key is null turned into error rows
    (a state table keeps one row per key, and a null key names none). A
    tombstone (an upsert intent, ``_diff`` 0) carries the envelope's key
    alone, so a state key containing it has other columns, null there: it
    stores nothing, and only a wholly null key is refused."""
    if not key:
        return table
    tomb = pc.equal(table.column(DIFF), 0)
    nulls = [pc.is_null(table.column(k)) for k in key]
    whole = nulls[0]
    for more in nulls[1:]:
        whole = pc.and_(whole, more)
    for k, null in zip(key, nulls, strict=True):
        table = refuse_rows(table, pc.if_else(tomb, whole, null),
                            f"key column {k!r} is null: a state table keeps one row per key, "
                            "and a null key names none")
    return table


def key_values(table: pa.Table, key: Sequence[str]) -> list[Any]:
    """One hashable value per row of ``table`` standing for its key: the
    integer itself for a single integer key column, else a canonical JSON
    text of the key's values (:func:`~reclock.contracts.consolidate.row_keys`:
    equal exactly when the values are)."""
    if len(key) == 1 and pa.types.is_integer(table.schema.field(key[0]).type):
        return list(table.column(key[0]).to_pylist())
    return row_keys(table, list(key))


@dataclass(frozen=True)
class StateChanges:
    """What a commit does to a state table: ``upserts`` (the user columns and
    ``_into_time``, one row per key that ends with a row) and ``deletes``
    (keys that end with none and had one), keys as :func:`key_values` gives
    them (``upsert_keys`` in the order of ``upserts``)."""

    upserts: pa.Table
    upsert_keys: list[Any]
    deletes: list[Any]


def state_changes(output: str, updates: pa.Table, key: Sequence[str], user: Sequence[str],
                  held: Callable[[list[Any]], set[Any]], where: str) -> StateChanges:
    """The changes ``updates`` (rows of the output schema, error rows
    excluded) make to a state table keyed by ``key``, whose user columns are
    ``user``. ``held(keys)`` says which of ``keys`` have a row in the table
    now. A :class:`SinkError` (naming the key, its IntoTime and positions,
    ``where`` the table) when they break the rule (module docstring)."""
    user = list(user)
    if ERROR in updates.column_names:
        updates = updates.filter(pc.is_null(updates.column(ERROR)))
    out_schema = pa.schema([*(updates.schema.field(c) for c in user),
                            pa.field(INTO_TIME, pa.int64(), nullable=False)])
    if updates.num_rows == 0:
        return StateChanges(out_schema.empty_table(), [], [])
    names = [f"_c{i}" for i in range(len(user))]
    work = pa.table([normalize_floats(updates.column(c)) for c in user]
                    + [updates.column(INTO_TIME), updates.column(DIFF),
                       pa.array(range(updates.num_rows), pa.int64())],
                    names=[*names, "_t", "_d", "_i"])
    try:
        grouped = work.group_by([*names, "_t"]).aggregate([("_d", "sum"), ("_i", "min")])
        counts = grouped.column("_d_sum").to_pylist()
        firsts = grouped.column("_i_min").to_pylist()
    except (pa.ArrowNotImplementedError, pa.ArrowTypeError):
        texts = row_keys(work, [*names, "_t"])
        sums: dict[str, list[int]] = {}
        for i, (text, d) in enumerate(zip(texts, work.column("_d").to_pylist(), strict=True)):
            acc = sums.setdefault(text, [0, i])
            acc[0] += d
        counts = [v[0] for v in sums.values()]
        firsts = [v[1] for v in sums.values()]
    live = [(n, i) for n, i in zip(counts, firsts, strict=True) if n != 0]
    if not live:
        return StateChanges(out_schema.empty_table(), [], [])
    rows = updates.take(pa.array([i for _, i in live], pa.int64()))
    keys = key_values(rows, key)
    times = rows.column(INTO_TIME).to_pylist()
    # per key: IntoTime -> [ins, dels, lo, hi, row of the insert]
    steps: dict[Any, dict[int, list[int]]] = {}
    for j, ((n, _), k, t) in enumerate(zip(live, keys, times, strict=True)):
        s = steps.setdefault(k, {}).setdefault(t, [0, 0, n, n, -1])
        if n > 0:
            s[0] += 1
            s[4] = j
        else:
            s[1] += 1
        s[2], s[3] = min(s[2], n), max(s[3], n)
    had = held(list(steps))
    upsert_rows: list[int] = []
    upsert_keys: list[Any] = []
    deletes: list[Any] = []
    for k, by_time in steps.items():
        before = 1 if k in had else 0
        for t in sorted(by_time):
            ins, dels, lo, hi, _ = by_time[t]
            if lo < -1 or hi > 1 or ins > 1 or dels != before:
                _refuse(output, updates, key, k, t, before, dels, ins, lo, hi, where)
            before = ins
        last = by_time[max(by_time)]
        if last[0]:
            upsert_rows.append(last[4])
            upsert_keys.append(k)
        elif k in had:
            deletes.append(k)
    picked = rows.take(pa.array(upsert_rows, pa.int64()))
    upserts = pa.table([picked.column(c) for c in user] + [picked.column(INTO_TIME)],
                       schema=out_schema)
    return StateChanges(upserts, upsert_keys, deletes)


def _refuse(output: str, updates: pa.Table, key: Sequence[str], k: Any, t: int, before: int,
            dels: int, ins: int, lo: int, hi: int, where: str) -> None:
    ks = key_values(updates, key)
    times = updates.column(INTO_TIME).to_pylist()
    at = [i for i, (kk, tt) in enumerate(zip(ks, times, strict=True)) if kk == k and tt == t]
    mine = updates.take(pa.array(at[:8], pa.int64()))
    value = ", ".join(f"{c}={mine.column(c)[0].as_py()!r}" for c in key)
    pos = ", ".join(
        f"{d:+d} at partition {p} offset {o} seq {q}" for d, p, o, q in zip(
            *(mine.column(c).to_pylist() for c in (DIFF, SRC_PART, SRC_OFFSET, SRC_SEQ)),
            strict=True))
    if lo < -1 or dels > before:
        what = "a negative count: they retract a row the key does not have"
    else:
        what = f"{before - dels + ins} live rows"
    raise SinkError(
        f"output {output!r}: the updates of IntoTime {t} leave key ({value}) of {where} with "
        f"{what} (it had {'a row' if before else 'no row'}; they retract {dels} and insert "
        f"{ins} distinct rows{'' if hi <= 1 else f', one of them {hi} times'}; updates: "
        f"{pos}); a state table holds one row per key, so nothing was written",
        hint="the updates do not keep one row per key: the upstream broke the key the output "
             "relies on, or something else changed the table. Keep the update log (mode: "
             "log), or key the table by the output's upstream key")
