"""``reclock resnapshot`` of a source that can re-read its records (Kafka, generators):
heal an output by replaying what retention still holds.

A Kafka topic has no "table as it is now" to snapshot; what an output must
hold is what its records say: the records before the output's progress,
through its envelope. A re-snapshot re-reads them (from the earliest offset
retention kept, up to the output's progress), builds the rows the output
must hold from a fresh key state, and commits the *difference* to what the
output holds as one correction at one IntoTime (the output's upper, the
first time it does not hold yet), in the same commit as the next records:

- rows the output lacks (or holds too few times) are inserted, at the
  position of the record they restate;
- rows it holds and must not (or holds too often) are retracted, at the
  position they were held at.

Each correction row keeps its record's offset and sequence number and codes
its partition in ``_src_part`` (:func:`reclock.core.columns.correction_part`),
so ``verify`` still ties every row to a record (see its correction rules),
ordered by position retractions apply before insertions, and an output
that is not damaged gets no correction at all. What retention removed is
left as it is: a row held at a position below the earliest retained offset
stays (of a keyed output, unless a retained record of its key supersedes it).

The replay runs on the driver, as the upsert key state does: it holds the
output's rows and the re-read records' rows once each.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from reclock.contracts.consolidate import normalize_floats, row_keys
from reclock.contracts.rows import output_schema
from reclock.core.bindings import Bindings
from reclock.core.columns import (
    DIFF,
    ERROR,
    INTO_TIME,
    SRC_OFFSET,
    SRC_PART,
    SRC_SEQ,
    correction_part,
    restated,
)
from reclock.core.frontier import Antichain
from reclock.core.time import is_partitioned, kafka_offsets
from reclock.runtime.dataplane import OutputPlan, build_output_rows, screen_intents
from reclock.runtime.upsert_state import UpsertState

log = logging.getLogger(__name__)

#: Records per read task of a replay (the driver reads them one after another).
REPLAY_TASK = 1_000_000


def _plan(out: Any) -> OutputPlan:
    return OutputPlan(
        index=out.index, name=out.name, typed=out.spec.typed, user_schema=out.user_schema,
        key_decoder=out.key_decoder, value_decoder=out.value_decoder, progress=None,
        stager=out.sink.stager(), envelope=out.envelope, key=out.upsert_key or (),
        upstream=out.upstream)


def replayed(source: Any, out: Any, bindings: Bindings[Any], lower: Antichain[Any],
             upper: Antichain[Any]) -> Iterator[pa.Table]:
    """The rows (a keyed output: the screened intents) that the records of
    ``out`` in ``[lower, upper)`` make, stamped as the bindings say."""
    plan = _plan(out)
    tasks, reached = source.plan(lower, upper, REPLAY_TASK, 2**62)
    if reached != upper:
        raise AssertionError(f"a replay plan stopped at {reached}, short of {upper}")
    reader = source.reader()
    for task in tasks:
        for i, batch in reader.read(task):
            if i != out.index or batch.num_rows == 0:
                continue
            part = batch.column(SRC_PART).to_numpy(zero_copy_only=False).astype(np.int64)
            off = batch.column(SRC_OFFSET).to_numpy(zero_copy_only=False).astype(np.int64)
            rows, _ = build_output_rows(plan, batch, bindings.reclock_positions(part, off))
            yield (screen_intents(plan.stager, rows) if plan.keyed
                   else plan.stager.screen(rows))
    source.confirm(tasks)  # (before the caller commits a correction built on it)


def _positions(t: pa.Table) -> tuple[Any, Any, Any]:
    part, _ = restated(t.column(SRC_PART).to_numpy().astype(np.int64))
    return part, t.column(SRC_OFFSET).to_numpy(), t.column(SRC_SEQ).to_numpy()


def _tally(t: pa.Table, columns: list[str], keyed: bool
           ) -> dict[Any, tuple[int, int, tuple[int, int, int]]]:
    """Non-error rows of an update log, net: per row (a keyed output: per
    row content; otherwise per content and record position) its count, a
    row index to copy it from and the position it stands at (a keyed row:
    the latest record that inserted it)."""
    if t.num_rows == 0:
        return {}
    norm = pa.table([normalize_floats(t.column(c)) for c in columns], names=columns)
    content = row_keys(norm, columns)
    part, off, seq = _positions(t)
    diffs = t.column(DIFF).to_numpy()
    net: dict[Any, tuple[int, int, tuple[int, int, int]]] = {}
    for i, ck in enumerate(content):
        pos = (int(part[i]), int(off[i]), int(seq[i]))
        d = int(diffs[i])
        k = ck if keyed else (ck, pos)
        had = net.get(k)
        if had is None:
            net[k] = (d, i, pos)
        else:
            n, j, at = had
            if d > 0 and pos >= at:
                j, at = i, pos
            net[k] = (n + d, j, at)
    return net


def _restate(t: pa.Table, rows: list[int], diffs: list[int], retract: bool, into: int
             ) -> pa.Table:
    """Rows ``rows`` of ``t`` as correction rows (see the module)."""
    taken = t.take(pa.array(rows, pa.int64()))
    part = _positions(taken)[0]
    codes = [correction_part(int(p), retract) for p in part]
    n = taken.num_rows
    cols = {
        INTO_TIME: pa.array(np.full(n, into, np.int64)),
        DIFF: pa.array(diffs, pa.int64()),
        SRC_PART: pa.array(codes, pa.int32()),
    }
    return pa.table({f: cols.get(f, taken.column(f)) for f in taken.column_names})


def correction(held: pa.Table, model: pa.Table, out: Any, into: int,
               retained: dict[int, int], touched: set[Any] | None) -> pa.Table:
    """What turns ``held`` (the output's update log) into ``model`` (the
    replay's), at IntoTime ``into``. ``retained``: per partition the first
    offset the replay read; held rows below it stay unless (``touched``: the
    keys the replay saw, of a keyed output) a replayed record of their key
    supersedes them."""
    schema = output_schema(out.user_schema)
    columns = list(out.user_schema.names)
    keyed = out.upsert_key is not None
    held = held.select(schema.names).cast(schema)
    model = model.select(schema.names).cast(schema)
    ok_held = held.filter(pc.is_null(held.column(ERROR)))
    ok_model = model.filter(pc.is_null(model.column(ERROR)))
    have = _tally(ok_held, columns, keyed)
    want = _tally(ok_model, columns, keyed)
    key_at = [columns.index(c) for c in out.upsert_key or ()]
    row_of = ok_held.select(columns).to_pylist() if keyed and retained else None

    def kept(k: Any, pos: tuple[int, int, int], i: int) -> bool:
        """Held below retention, and no retained record of its key."""
        if pos[1] >= retained.get(pos[0], 0):
            return False
        if row_of is None or touched is None:
            return True
        r = row_of[i]
        return tuple(r[columns[j]] for j in key_at) not in touched

    ins: list[int] = []
    ins_d: list[int] = []
    ret: list[int] = []
    ret_d: list[int] = []
    for k in have.keys() | want.keys():
        n_have, i_have, at = have.get(k, (0, -1, (0, 0, 0)))
        n_want, i_want, _ = want.get(k, (0, -1, (0, 0, 0)))
        if n_have == n_want or (i_have >= 0 and n_want == 0 and kept(k, at, i_have)):
            continue
        if n_want > n_have and i_want >= 0:
            ins.append(i_want)
            ins_d.append(n_want - n_have)
        elif n_have != n_want:
            if i_have < 0:
                continue
            ret.append(i_have)
            ret_d.append(n_want - n_have)
    parts = []
    if ret:
        parts.append(_restate(ok_held, ret, ret_d, True, into))
    if ins:
        parts.append(_restate(ok_model, ins, ins_d, False, into))
    # error rows the output lost (its error collection is never retracted)
    err_model = model.filter(pc.is_valid(model.column(ERROR)))
    if err_model.num_rows:
        err_held = held.filter(pc.is_valid(held.column(ERROR)))
        seen = set(zip(*(_positions(err_held)), strict=True))
        mp = zip(*(_positions(err_model)), strict=True)
        lost = [i for i, (p, o, s) in enumerate(mp) if (int(p), int(o), int(s)) not in seen]
        if lost:
            parts.append(_restate(err_model, lost, [1] * len(lost), False, into))
    if not parts:
        return schema.empty_table()
    return pa.concat_tables(parts).cast(schema)


def _first_offsets(kind: str, lower: Antichain[Any]) -> dict[int, int]:
    """Per partition (totally ordered times: partition 0) the first offset of ``lower``."""
    if is_partitioned(kind):
        return kafka_offsets(lower)[0]
    first = lower.as_option()
    return {} if first is None else {0: int(first)}


def heal(source: Any, out: Any, bindings: Bindings[Any], into: int
         ) -> tuple[pa.Table, UpsertState | None]:
    """The correction of ``out`` at ``into`` (see the module), and for a
    keyed output the key state it leaves (the replay's)."""
    kind = source.kind
    progress = out.state.held(kind)
    columns = list(out.user_schema.names)
    keyed = out.upsert_key is not None
    state = UpsertState(columns, out.upsert_key) if keyed else None
    schema = output_schema(out.user_schema)
    if progress is None:
        return schema.empty_table(), state
    lower = source.initial_frontier().join(source.retained())
    retained = _first_offsets(kind, lower)
    tables = list(replayed(source, out, bindings, lower, progress))
    touched: set[Any] | None = None
    if state is not None:
        intents = (pa.concat_tables(tables, promote_options="default") if tables
                   else schema.empty_table())
        model, pending = state.apply(intents, schema)
        state.accept(pending)
        ok = intents.filter(pc.is_null(intents.column(ERROR)))
        touched = set(zip(*(ok.column(c).to_pylist() for c in out.upsert_key), strict=True))
    else:
        model = (pa.concat_tables([t.select(schema.names).cast(schema) for t in tables])
                 if tables else schema.empty_table())
    fixed = correction(out.sink.read_updates(), model, out, into, retained, touched)
    log.info("output %s: a replay of %d rows corrects %d", out.name, model.num_rows,
             fixed.num_rows)
    return fixed, state
