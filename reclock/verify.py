"""``reclock verify``: audit outputs against the bindings, at any time.

For every source and each of its outputs (read as they are durable now):

* **time** -- every row's ``_into_time`` is the IntoTime its source position
  maps to under the bindings (rows below the remap ``since`` can only be
  checked to lie at or below it: that history was compacted);
* **upper** -- no row beyond the output's upper is visible, and the
  output's upper is not beyond the remap upper. A row *at* the upper is
  legitimate only before the output's progress: a binding too large for one
  job is committed in several, each moving the progress while the upper
  stays at the binding's time until all of it is durable;
* **once** -- no source position appears twice with the same sign;
* **complete** -- for sources that can be re-read (generators, Kafka while
  retention keeps the data) every record the source holds below the output's
  progress appears in exactly one output (or its error collection), and
  nothing else does.

A breach of any of these is reported with a sample of offending positions;
the command exits non-zero.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from reclock.core.bindings import UNBOUND, Bindings, beyond
from reclock.core.columns import (
    DIFF,
    ERROR,
    INTO_TIME,
    META_NAMES,
    REPLAYED_KINDS,
    SRC_OFFSET,
    SRC_PART,
    SRC_SEQ,
    restated,
)
from reclock.core.errors import TransientError
from reclock.core.frontier import Antichain

KEYS = [SRC_PART, SRC_OFFSET, SRC_SEQ]
T = TypeVar("T")


def _retrying(fn: Callable[[], T], patience_s: float = 60.0, first_wait_s: float = 0.5) -> T:
    """``fn()``, tried again after a transient fault (a broker's timeout, a
    database restarting, a restarted broker whose leader epochs are not
    settled yet) for up to ``patience_s``: an audit waits out what a running
    pipeline would."""
    deadline = time.monotonic() + patience_s
    wait = first_wait_s
    while True:
        try:
            return fn()
        except TransientError:
            if time.monotonic() + wait > deadline:
                raise
            time.sleep(wait)
            wait = min(wait * 2, 5.0)
    raise AssertionError("unreachable")


@dataclass
class OutputReport:
    output: str
    rows: int = 0
    errors: int = 0
    checked: int = 0
    compacted: int = 0
    breaches: dict[str, int] = field(default_factory=dict)
    samples: dict[str, list[Any]] = field(default_factory=dict)

    def breach(self, kind: str, count: int, sample: list[Any]) -> None:
        if count:
            self.breaches[kind] = self.breaches.get(kind, 0) + count
            self.samples.setdefault(kind, []).extend(sample[:5])


@dataclass
class SourceReport:
    source: str
    outputs: list[OutputReport] = field(default_factory=list)
    complete_checked: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(o.breaches for o in self.outputs)


def _positions(t: pa.Table) -> list[tuple[int, int, int]]:
    return list(zip(*(t.column(k).to_pylist() for k in KEYS), strict=True))


def check_output(
    name: str, updates: pa.Table, bindings: Bindings[Any], upper: int | None,
    key: tuple[str, ...] | None = None, progress: Antichain[Any] | None = None,
) -> OutputReport:
    """The time, upper and once checks of one output. ``key``: an upsert
    output's key columns; one position (a truncate) may then retract many
    keys, but each key at most once. ``progress``: the output's committed
    FromTime progress (rows at the upper must lie before it; without it, no
    row at the upper is allowed)."""
    rep = OutputReport(name, rows=updates.num_rows)
    if updates.num_rows == 0:
        return rep
    rep.errors = updates.num_rows - int(pc.sum(pc.is_null(updates.column(ERROR))).as_py() or 0)
    into = updates.column(INTO_TIME).to_numpy()
    part = updates.column(SRC_PART).to_numpy().astype(np.int64)
    off = updates.column(SRC_OFFSET).to_numpy().astype(np.int64)
    # a correction (a re-snapshot by replay) stands for the record it restates
    corr = np.zeros(len(part), dtype=bool)
    if bindings.kind in REPLAYED_KINDS:
        part, corr = restated(part)
    # upper
    if upper is not None:
        past = into >= upper
        if progress is not None:
            past = (into > upper) | ((into == upper)
                                     & beyond(bindings.kind, progress, part, off))
        rep.breach("beyond-upper", int(past.sum()),
                   _positions(updates.filter(pa.array(past))))
    remap_upper = bindings.upper.as_option()
    if upper is not None and remap_upper is not None and upper > int(remap_upper):
        rep.breach("upper-beyond-bindings", 1, [(upper, int(remap_upper))])
    # time: a row at its record's IntoTime; a correction at or after it (at
    # the upper of the output when it was made)
    since = int(bindings.since)
    expected = bindings.reclock_positions(part, off)
    live = into >= since
    rep.compacted = int((~live).sum())
    rep.checked = int(live.sum())
    wrong = live & ~corr & (expected != into)
    wrong |= live & corr & ((expected == UNBOUND) | (expected > into))
    wrong |= (~live) & ((expected == UNBOUND) | (expected > since))
    rep.breach("wrong-time", int(wrong.sum()), [
        (*p, int(t), int(e)) for p, t, e in zip(
            _positions(updates.filter(pa.array(wrong))), into[wrong], expected[wrong], strict=True)
    ])
    # once
    sign = pc.sign(updates.column(DIFF))
    cols = {k: updates.column(k) for k in KEYS}
    if corr.any():  # a record is restated once per re-snapshot, each at its own time
        cols["at"] = pa.array(into, mask=~corr)
    if key:
        # a retraction also names its key: (position, key) is what must be unique
        ok = pc.is_null(updates.column(ERROR))
        for c in key:
            col = updates.column(c)
            cols[f"key:{c}"] = pc.if_else(pc.and_(pc.less(sign, 0), ok), col,
                                          pa.nulls(len(col), col.type))
    keyed = pa.table({**cols, "sign": sign})
    counts = keyed.group_by([*cols, "sign"]).aggregate([("sign", "count")])
    dup = counts.filter(pc.greater(counts.column("sign_count"), 1))
    rep.breach("duplicate-position", dup.num_rows, _positions(dup))
    return rep


def _keys(t: pa.Table) -> pa.Table:
    if t.num_rows == 0:
        return pa.table({k: pa.array([], pa.int64()) for k in KEYS})
    return pa.table({k: t.column(k).cast(pa.int64()) for k in KEYS})


def _held_positions(kind: str, t: pa.Table) -> pa.Table:
    """The record positions an output holds rows of. A correction (a
    re-snapshot by replay) holds the record it restates; a position whose
    rows a correction cancelled (every row there consolidates to nothing,
    as a row the output never should have held) holds nothing."""
    keys = _keys(t)
    if kind not in REPLAYED_KINDS or t.num_rows == 0:
        return keys
    orig, corr = restated(keys.column(SRC_PART).to_numpy())
    if not corr.any():
        return keys
    keys = keys.set_column(0, SRC_PART, pa.array(orig, pa.int64()))
    return _cancelled(t, keys, corr)


def _cancelled(t: pa.Table, keys: pa.Table, corr: Any) -> pa.Table:
    """``keys`` without the positions where a correction left no row."""
    from sinks.consolidate import _row_keys

    users = [c for c in t.column_names if c not in META_NAMES]
    content = _row_keys(t, users) if users else [""] * t.num_rows
    pos = list(zip(*(keys.column(k).to_pylist() for k in KEYS), strict=True))
    corrected = {pos[i] for i in np.flatnonzero(corr)}
    net: dict[tuple[Any, ...], dict[str, int]] = {}
    diffs = t.column(DIFF).to_pylist()
    for i, p in enumerate(pos):
        if p in corrected:
            per = net.setdefault(p, {})
            per[content[i]] = per.get(content[i], 0) + int(diffs[i])
    gone = {p for p, per in net.items() if not any(per.values())}
    keep = [p not in gone for p in pos]
    return keys.filter(pa.array(keep))


Reread = tuple[Antichain[Any], dict[int, list[pa.Table]], dict[int, list[pa.RecordBatch]]]


def _furthest(progresses: list[Antichain[Any]]) -> Antichain[Any]:
    furthest = progresses[0]
    for p in progresses[1:]:
        furthest = furthest.join(p)
    return furthest


def reread(source: Any, upto: Antichain[Any], max_records: int = 50_000_000,
           keep: frozenset[int] = frozenset()) -> Reread:
    """The source read again from its initial frontier up to ``upto``: the
    frontier reached, the positions per output, and the records of the
    outputs in ``keep`` (for :func:`check_keyed`)."""

    def once() -> Reread:
        lower = source.initial_frontier()
        tasks, reached = source.plan(lower, upto, 1_000_000, max_records)
        reader = source.reader()
        expected: dict[int, list[pa.Table]] = {}
        raw: dict[int, list[pa.RecordBatch]] = {}
        for task in tasks:
            for i, batch in reader.read(task):
                expected.setdefault(i, []).append(_keys(pa.Table.from_batches([batch])))
                if i in keep:
                    raw.setdefault(i, []).append(batch)
        return reached, expected, raw

    return _retrying(once)


def check_complete(
    report: SourceReport,
    per_output: list[pa.Table],
    progresses: list[Antichain[Any]],
    kind: str,
    furthest: Antichain[Any],
    again: Reread,
) -> dict[int, list[pa.RecordBatch]]:
    """Compare, per output, the positions the source holds before *its*
    progress (``again``: the source re-read up to ``furthest``, the furthest
    output's progress; :func:`reread`) with the positions it holds (with
    either sign). Returns the records re-read for the outputs :func:`reread`
    kept (for :func:`check_keyed`)."""
    reached, expected, raw = again
    if reached != furthest:
        report.notes.append(f"complete: checked only up to {reached.encode()} (too many records)")
    for i, rep in enumerate(report.outputs):
        exp = pa.concat_tables(expected[i]) if i in expected else _keys(pa.table({}))
        if exp.num_rows:
            # only what lies before this output's own progress is owed by it
            owed = ~beyond(kind, progresses[i], exp.column(SRC_PART).to_numpy(),
                               exp.column(SRC_OFFSET).to_numpy())
            exp = exp.filter(pa.array(owed))
        report.complete_checked += exp.num_rows
        # a position may carry a retraction, an insertion, or both (debezium)
        got = _held_positions(kind, per_output[i]).group_by(KEYS).aggregate([])
        exp_m = exp.append_column("e", pa.array(np.ones(exp.num_rows, dtype=np.int8)))
        got_m = got.append_column("g", pa.array(np.ones(got.num_rows, dtype=np.int8)))
        joined = exp_m.join(got_m, keys=KEYS, join_type="full outer")
        missing = joined.filter(pc.is_null(joined.column("g")))
        extra = joined.filter(pc.is_null(joined.column("e")))
        rep.breach("missing", missing.num_rows, _positions(missing))
        rep.breach("unexpected", extra.num_rows, _positions(extra))
    return raw


def check_keyed(rep: OutputReport, out: Any, updates: pa.Table, raw: list[pa.RecordBatch],
                progress: Antichain[Any], bindings: Bindings[Any], kind: str) -> None:
    """A keyed output (upsert, keyed debezium) against a replay: the source's
    records before the output's progress, decoded and put through the
    envelope from a fresh key state, must leave exactly the rows the output
    holds now, key by key. A key missing from the output (a row deleted
    behind reclock's back), a row that should have been retracted, or a
    value that differs is a ``keyed-state`` breach naming the key."""
    from reclock.envelopes.keystate import hashable
    from reclock.envelopes.upsert import UpsertState
    from reclock.runtime.dataplane import OutputPlan, build_output_rows, screen_intents
    from sinks.base import output_schema
    from sinks.consolidate import consolidate

    columns = [f.name for f in out.user_schema]
    schema = output_schema(out.user_schema)
    plan = OutputPlan(out.index, out.name, False, out.user_schema, out.key_decoder,
                      out.value_decoder, None, None, out.envelope,  # type: ignore[arg-type]
                      tuple(out.upsert_key), out.upstream)
    intents = []
    stager = out.sink.stager()
    for batch in raw:
        part = batch.column(SRC_PART).to_numpy(zero_copy_only=False).astype(np.int64)
        off = batch.column(SRC_OFFSET).to_numpy(zero_copy_only=False).astype(np.int64)
        owed = ~beyond(kind, progress, part, off)
        if not owed.any():
            continue
        batch, part, off = batch.filter(pa.array(owed)), part[owed], off[owed]
        into = bindings.reclock_positions(part, off)
        rows, _ = build_output_rows(plan, batch, into)
        intents.append(screen_intents(stager, rows))  # what the sink refuses, as the run did
    model = UpsertState(columns, tuple(out.upsert_key))
    if intents:
        _, pending = model.apply(pa.concat_tables(intents, promote_options="default"), schema)
        model.accept(pending)
    ok = updates.filter(pc.is_null(updates.column(ERROR)))
    held: dict[Any, list[tuple[Any, ...]]] = {}
    if ok.num_rows:
        for r in consolidate(ok, None, columns).to_pylist():
            row = tuple(r[c] for c in columns)
            held.setdefault(model._key_of(row), []).extend([row] * max(0, int(r["_count"])))
            if int(r["_count"]) < 0:
                held.setdefault(model._key_of(row), []).append(("<retracted more than held>",))
    bad: list[str] = []
    replayed = model.rows  # (read whole once: a property that reads every key)
    for k in sorted(set(replayed) | set(held), key=repr):
        want = replayed.get(k)
        got = held.get(k, [])
        if want is None and got:
            bad.append(f"key {k!r}: held {len(got)} rows, the replay retracted it")
        elif want is not None and not got:
            bad.append(f"key {k!r}: missing (the replay holds {want!r})")
        elif want is not None and (len(got) != 1 or hashable(got[0]) != hashable(want)):
            bad.append(f"key {k!r}: holds {got!r}, the replay {want!r}")
    rep.breach("keyed-state", len(bad), bad)


def verify_pipeline(cfg: Any) -> list[SourceReport]:
    """Verify every source of a pipeline configuration. Each output's state
    and rows are read first, then the bindings (a live pipeline mints a
    binding before any output commits up to it: read in this order, the
    bindings cover every row read). A source that can be re-read is read
    again in a thread meanwhile, while the rows are checked against the
    bindings (the reader waits on the broker or the database, the checks on
    numpy)."""
    from concurrent.futures import ThreadPoolExecutor

    from reclock.pipeline import Pipeline

    pipe = Pipeline(cfg)
    reports: list[SourceReport] = []
    pool = ThreadPoolExecutor(1, thread_name_prefix="verify-reread")
    try:
        shards = set(pipe.store.shards())
        for src in cfg.sources:
            built = pipe.build_source(src)
            kind = built.source.kind
            report = SourceReport(src.name)
            reports.append(report)
            if src.name not in shards:
                report.notes.append("no bindings yet: nothing ingested")
                continue
            states = []
            tables = []
            progresses: list[Antichain[Any]] = []
            for o in built.outputs:
                st = o.sink.state()
                states.append(st)
                if o.sink.holds_state:
                    # a current-state table keeps no history to audit
                    tables.append(pa.table({k: pa.array([], pa.int64()) for k in KEYS}))
                else:
                    tables.append(o.sink.read_updates())
                progresses.append(
                    _retrying(built.source.initial_frontier)  # owes nothing (yet)
                    if o.sink.holds_state or st.progress is None
                    else Antichain.decode_json(kind, st.progress))
            keyed = frozenset(o.index for o in built.outputs
                              if o.upsert_key is not None and not o.spec.typed
                              and not o.sink.holds_state)
            furthest = _furthest(progresses)
            again = (pool.submit(reread, built.source, furthest, keep=keyed)
                     if built.source.replayable else None)
            b = pipe.store.read(src.name)
            for o, st, updates in zip(built.outputs, states, tables, strict=True):
                if o.sink.holds_state:
                    report.notes.append(f"output {o.name}: current-state table, not audited")
                    report.outputs.append(OutputReport(o.name))
                    continue
                rep = check_output(o.name, updates, b, st.upper, o.upsert_key,
                                   st.held(kind))
                report.outputs.append(rep)
                if st.progress is None and updates.num_rows:
                    rep.breach("data-without-progress", updates.num_rows, [])
            if again is None:
                report.notes.append("complete: source cannot be re-read; skipped")
                continue
            raw = check_complete(report, tables, progresses, kind, furthest, again.result())
            for o in built.outputs:
                if o.index in keyed:
                    check_keyed(report.outputs[o.index], o, tables[o.index],
                                raw.get(o.index, []), progresses[o.index], b, kind)
            for o, rep in zip(built.outputs, report.outputs, strict=True):
                if o.upsert_key is not None and rep.breaches.pop("missing", 0):
                    # a tombstone for an absent key, or a value equal to the
                    # current one, legitimately leaves no row behind
                    rep.samples.pop("missing", None)
                    report.notes.append(f"output {o.name}: keyed; positions without "
                                        "updates are not counted as missing")
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        pipe.close()
    return reports
