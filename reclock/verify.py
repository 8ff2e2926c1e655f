"""``reclock verify``: audit outputs against the bindings and the source, at any time.

For every source and each of its outputs (read as they are durable now):

* **time** -- every row's ``_into_time`` is the IntoTime its source position
  maps to under the bindings (rows below the remap ``since`` can only be
  checked to lie at or below it: that history was compacted);
* **upper** -- no row beyond the output's upper is visible, and the
  output's upper is not beyond the remap upper. A row *at* the upper is
  legitimate only before the output's progress: a binding too large for one
  job is committed in several, each moving the progress while the upper
  stays at the binding's time until all of it is durable;
* **once** -- no source position appears twice with the same sign.

Where the source can be re-read (generators, Kafka while retention keeps the
data, one-shot loads whose files are unchanged), it is read again from the
earliest record it still holds up to the furthest output's progress, and
each record before an output's progress is put through what the data plane
does with it (:func:`reclock.runtime.dataplane.build_output_rows`, then the
sink's ``screen``, as a re-snapshot does, :mod:`reclock.runtime.replay`)::

    source, re-read ----> rows (append) | intents -> upsert_model (keyed)
                               |                          |
                        per position:             the model's update log
                        sum(diff * digest)                |
                               |              per position, and per (row, IntoTime)
    output, as held ---------> compared <---------------- compared

* **complete** -- every record before the output's progress is in exactly
  one output (or its error collection), and nothing else is. A keyed output
  owes rows only where the model's update log has some (a tombstone of an
  absent key, or a value equal to the key's current one, leaves none): a
  position of the model's that the output lacks is ``missing``;
* **values** -- per position, the digest of the rows the output holds there
  (:mod:`reclock.digest`: the user columns, an error row by its raw key and
  value; summed with their diffs, so that a re-snapshot's correction rows,
  which restate positions, net out) equals the digest of the rows the record
  must produce. A difference is a ``wrong-value`` breach naming the position.
  The re-read keeps four numbers per row of an append output (position and
  digest), never the rows;
* **history** (keyed outputs) -- the model's update log (what the envelope
  makes of the intents from an empty key state: :func:`upsert_model`, a
  vectorized ``UpsertState.apply``, held equal to it by the tests) and the
  output's net to the same diff per (row, IntoTime), so that the output as
  of *every* IntoTime it covers (``reclock read --as-of``) is the model's,
  not only the last. A difference is a ``keyed-history`` breach naming the key and the
  first IntoTime at which the output is wrong (a key missing, a row the
  model does not hold, or another value). An append output's history is
  its rows' times and values, checked above;
* **identity** -- an upstream object replaced under the same name (a Kafka
  topic deleted and re-created and not accepted) is an ``identity`` breach
  with the source's own error, rather than a re-read of the new object's
  records as if they were the old one's.

What cannot be checked is said per output (``OutputReport.unchecked``), and
nothing of it is a breach: a current-state table (no history), a source
that cannot be re-read (a replication slot), rows of records retention
removed or of a topic's earlier incarnation (each excluding, for a keyed
output, the keys they touch from the history check), rows the run refused
by an injected fault (``RECLOCK_FAIL_AT=refuse``: the model refuses them
too), and the history of an output healed by a re-snapshot before its last
correction: a correction sets the output right as of its IntoTime (the
output's upper when it was made), not before, so a keyed output is compared
as of that time and from then on, and an append output's rows before it
are checked for time and value only.

Verify only reads: its sources are built for an audit (they record no
upstream identity and take up no accepted re-created topic), and sinks are
never ``ensure``-d; a sink that makes its stager only once a driver opened
it (Postgres, which learns its stored types then) is audited without its
screen, each error row the output holds taken as refused. The re-read
starts at the bindings' first frontier (what a fresh source's initial
frontier of ``latest`` is not) joined with what retention kept.

A breach is reported with a sample; the command exits 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
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
from reclock.core.errors import DefiniteError, IdentityChanged, TransientError
from reclock.core.frontier import Antichain, kafka_frontier
from reclock.core.time import is_partitioned, kafka_offsets
from reclock.digest import conform, row_digests, signed, update_digests
from reclock.runtime.reading import read_output

KEYS = [SRC_PART, SRC_OFFSET, SRC_SEQ]
T = TypeVar("T")
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
Bool = npt.NDArray[np.bool_]


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


#: The checks, in the order a report lists them.
CHECKS = ("time", "upper", "once", "complete", "values", "history", "identity")


@dataclass
class OutputReport:
    output: str
    rows: int = 0
    errors: int = 0
    checked: int = 0
    compacted: int = 0
    breaches: dict[str, int] = field(default_factory=dict)
    samples: dict[str, list[Any]] = field(default_factory=dict)
    #: what was checked: check -> what it covered
    checks: dict[str, str] = field(default_factory=dict)
    #: what was not checked (or only in part): check -> why
    unchecked: dict[str, str] = field(default_factory=dict)

    def breach(self, kind: str, count: int, sample: list[Any]) -> None:
        if count:
            self.breaches[kind] = self.breaches.get(kind, 0) + count
            self.samples.setdefault(kind, []).extend(sample[:5])

    def did(self, check: str, what: str) -> None:
        self.checks[check] = what

    def skip(self, check: str, why: str) -> None:
        had = self.unchecked.get(check)
        self.unchecked[check] = why if had is None or why in had else f"{had}; {why}"

    def ordered(self, which: dict[str, str]) -> list[tuple[str, str]]:
        return sorted(which.items(), key=lambda kv: CHECKS.index(kv[0])
                      if kv[0] in CHECKS else len(CHECKS))


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
    rep.did("upper", f"upper {upper}" if upper is not None else "closed")
    if updates.num_rows == 0:
        rep.did("time", "no rows")
        rep.did("once", "no rows")
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
    rep.did("time", f"{rep.checked} rows")
    if rep.compacted:
        rep.skip("time", f"{rep.compacted} rows below the bindings' since {since} (compacted "
                 "history): only checked to lie at or below it")
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
    rep.did("once", f"{rep.rows} rows")
    return rep


def _keys(t: pa.Table) -> pa.Table:
    if t.num_rows == 0:
        return pa.table({k: pa.array([], pa.int64()) for k in KEYS})
    return pa.table({k: t.column(k).cast(pa.int64()) for k in KEYS})


def _held_positions(kind: str, t: pa.Table) -> pa.Table:
    """The record positions an output holds rows of (each once). A
    correction (a re-snapshot by replay) holds the record it restates; a
    position whose rows a correction cancelled (every row there
    consolidates to nothing, as a row the output never should have held)
    holds nothing."""
    h = _held(kind, t)
    live = _live(h, np.ones(len(h.part), dtype=bool), lambda: _content(t))
    return pa.table(dict(zip(KEYS, _dense([live])[1], strict=True)))


def _content(t: pa.Table) -> U64:
    """A digest of each row's content, the columns as they are stored."""
    return update_digests(t, [c for c in t.column_names if c not in META_NAMES])


# -- the re-read ---------------------------------------------------------------------------------


def _frontier_parts(kind: str, frontier: Antichain[Any]) -> set[int]:
    """The partition ids a partitioned frontier names a point of."""
    return set(kafka_offsets(frontier)[0]) if is_partitioned(kind) else set()


def _without(kind: str, upto: Antichain[Any], lower: Antichain[Any], parts: set[int]
             ) -> Antichain[Any]:
    """``upto`` with nothing to read of ``parts`` (their offsets as in ``lower``)."""
    if not parts or not is_partitioned(kind):
        return upto
    hi, above = kafka_offsets(upto)
    lo, lo_above = kafka_offsets(lower)
    for p in parts & set(hi):
        hi[p] = lo.get(p, 0 if lo_above is not None and p >= lo_above else hi[p])
    clipped: Antichain[Any] = kafka_frontier(
        hi, partitions=above if above is not None else max([*hi, -1]) + 1)
    return clipped


@dataclass
class Owed:
    """What the re-read records of one output before its progress must
    produce: their positions, and (where its columns are known) per row of
    an append output its position and signed digest, or the screened
    intents of a keyed one (the key state needs them all, in order)."""

    out: Any  # reclock.runtime.driver.OutputRuntime
    #: the output's progress (None: it holds nothing, and owes nothing yet)
    progress: Antichain[Any] | None
    bindings: Bindings[Any]
    kind: str
    keyed: bool
    #: the sink's stager (its ``screen``); None where the sink makes one
    #: only once a driver opened it (:meth:`PersistSink.ensure`)
    stager: Any = None
    #: positions where the output holds a row refused by an injected fault
    #: (or, without a stager, any error row): the model refuses them too
    refused: frozenset[tuple[int, int, int]] = frozenset()
    positions: list[pa.Table] = field(default_factory=list)
    sums: list[pa.Table] = field(default_factory=list)
    intents: list[pa.Table] = field(default_factory=list)
    plan: Any = None

    def __post_init__(self) -> None:
        self.refused_offsets = np.array(sorted({o for _p, o, _s in self.refused}), np.int64)

    @property
    def values(self) -> bool:
        """Whether the rows can be built (the output's columns are known)."""
        return self.out.user_schema is not None

    def _plan(self) -> Any:
        from reclock.runtime.dataplane import OutputPlan

        if self.plan is None:
            o = self.out
            self.plan = OutputPlan(
                index=o.index, name=o.name, typed=o.spec.typed, user_schema=o.user_schema,
                key_decoder=o.key_decoder, value_decoder=o.value_decoder, progress=None,
                stager=self.stager, envelope=o.envelope, key=o.upsert_key or (),
                upstream=o.upstream)
        return self.plan

    def take(self, batch: pa.RecordBatch) -> None:
        from reclock.contracts.rows import refuse_rows
        from reclock.runtime.dataplane import (
            INJECTED_REFUSAL,
            build_output_rows,
            screen_intents,
        )

        if self.progress is None:
            return
        part = batch.column(SRC_PART).to_numpy(zero_copy_only=False).astype(np.int64)
        off = batch.column(SRC_OFFSET).to_numpy(zero_copy_only=False).astype(np.int64)
        owed = ~beyond(self.kind, self.progress, part, off)
        if not owed.any():
            return
        if not owed.all():
            batch, part, off = batch.filter(pa.array(owed)), part[owed], off[owed]
        self.positions.append(_keys(pa.Table.from_batches([batch])))
        if not self.values:
            return
        plan = self._plan()
        rows, _ = build_output_rows(plan, batch, self.bindings.reclock_positions(part, off))
        if self.refused:  # refused as the run did (the fault is not the data's)
            r_part, r_off, r_seq = _pos(rows)
            mask = np.isin(r_off, self.refused_offsets)
            for i in np.flatnonzero(mask):
                mask[i] = (int(r_part[i]), int(r_off[i]), int(r_seq[i])) in self.refused
            if mask.any():
                rows = refuse_rows(rows, mask, INJECTED_REFUSAL)
        if self.keyed:
            self.intents.append(rows if self.stager is None
                                else screen_intents(self.stager, rows))
            return
        if self.stager is not None:
            rows = self.stager.screen(rows)
        columns = list(self.out.user_schema.names)
        digests = signed(rows, update_digests(rows, columns))
        self.sums.append(pa.table({
            SRC_PART: rows.column(SRC_PART).cast(pa.int64()),
            SRC_OFFSET: rows.column(SRC_OFFSET).cast(pa.int64()),
            SRC_SEQ: rows.column(SRC_SEQ).cast(pa.int64()),
            "d": pa.array(digests, pa.uint64())}))

    def owed_positions(self) -> pa.Table:
        return (pa.concat_tables(self.positions) if self.positions
                else _keys(pa.table({})))


@dataclass
class Reread:
    """A source read again (:func:`reread`)."""

    lower: Antichain[Any]
    upto: Antichain[Any]
    reached: Antichain[Any]
    #: partition ids whose records cannot be read again: why
    lost: dict[int, str]
    #: per output index, a definite error of its upstream (a listed topic
    #: deleted, or re-created and not accepted)
    errors: dict[int, DefiniteError]


def reread_lower(source: Any, bindings: Bindings[Any]) -> Antichain[Any]:
    """Where a re-read starts: the source's start (the bindings' first
    frontier, which a fresh source's ``initial_frontier`` of ``latest`` is
    not), and no earlier than what retention kept."""
    start: Antichain[Any] = source.initial_frontier()
    first = bindings.first
    if first is not None:
        start = start.meet(first.frontier)
    return start.join(source.retained())


def reread(source: Any, bindings: Bindings[Any], upto: Antichain[Any], owed: dict[int, Owed],
           held_parts: set[int], max_records: int = 50_000_000) -> Reread:
    """The source read again from :func:`reread_lower` up to ``upto`` (but
    none of the partitions it cannot read again), each output's records
    handed to its :class:`Owed`."""

    def once() -> Reread:
        for o in owed.values():
            o.positions, o.sums, o.intents = [], [], []
        lower = reread_lower(source, bindings)
        parts = held_parts | _frontier_parts(source.kind, upto)
        lost = source.unreadable(sorted(parts))
        upto_ = _without(source.kind, upto, lower, set(lost))
        tasks, reached = source.plan(lower, upto_, 1_000_000, max_records)
        reader = source.reader()
        for task in tasks:
            for i, batch in reader.read(task):
                if batch.num_rows:
                    for o in owed.values():  # (each sink of the output has its own)
                        if o.out.index == i:
                            o.take(batch)
        source.confirm(tasks)  # a topic replaced while it was read: read again
        return Reread(lower, upto_, reached, lost, source.output_errors())

    return _retrying(once)


# -- comparisons ---------------------------------------------------------------------------------


@dataclass
class Held:
    """One output's update log as the comparisons read it."""

    table: pa.Table
    part: I64  # the record's partition (a correction's restated)
    off: I64
    seq: I64
    into: I64
    corr: Bool
    #: rows of positions that cannot be re-read (retention, lost partitions,
    #: past the re-read): excluded from the comparisons
    unreadable: Bool

    @property
    def last_correction(self) -> int | None:
        return int(self.into[self.corr].max()) if self.corr.any() else None


def _held(kind: str, t: pa.Table) -> Held:
    part = t.column(SRC_PART).to_numpy().astype(np.int64)
    corr = np.zeros(len(part), dtype=bool)
    if kind in REPLAYED_KINDS and len(part):
        part, corr = restated(part)
    return Held(t, part, t.column(SRC_OFFSET).to_numpy().astype(np.int64),
                t.column(SRC_SEQ).to_numpy().astype(np.int64),
                t.column(INTO_TIME).to_numpy().astype(np.int64), corr,
                np.zeros(len(part), dtype=bool))


def _mark_unreadable(rep: OutputReport, h: Held, kind: str, again: Reread) -> None:
    """Mark (and report as not checked) the rows of positions the re-read
    could not read: below its start (retention removed them), of lost
    partitions, or past where it stopped."""
    if not len(h.part):
        return
    below = ~beyond(kind, again.lower, h.part, h.off)
    lost = np.isin(h.part, np.fromiter(again.lost, np.int64, len(again.lost)))
    past = beyond(kind, again.reached, h.part, h.off) & ~lost if again.reached != again.upto \
        else np.zeros(len(h.part), dtype=bool)
    below &= ~lost
    for mask, why in (
        (below, "rows of records retention removed (below the earliest record the source "
                "still holds) cannot be compared with them"),
        (past, f"rows past where the re-read stopped ({again.reached.encode()})"),
    ):
        n = int(mask.sum())
        if n:
            for c in ("complete", "values"):
                rep.skip(c, f"{n} {why}")
    for p, why in sorted(again.lost.items()):
        n = int((h.part == p).sum())
        if n:
            for c in ("complete", "values"):
                rep.skip(c, f"{n} rows of partition id {p}: {why}")
    h.unreadable = below | lost | past


Pos = tuple[I64, I64, I64]  # (partition, offset, sequence) of each row


def _pos(t: pa.Table) -> Pos:
    return (t.column(SRC_PART).to_numpy().astype(np.int64),
            t.column(SRC_OFFSET).to_numpy().astype(np.int64),
            t.column(SRC_SEQ).to_numpy().astype(np.int64))


def _take(p: Pos, mask: Bool) -> Pos:
    return (p[0][mask], p[1][mask], p[2][mask])


def _dense(groups: list[Pos]) -> tuple[list[I64], Pos]:
    """Dense ids of the positions of ``groups``, one per distinct position
    across them all, numbered in position order; and each id's position.
    (numpy: one sort of positions that arrive mostly sorted, where Arrow's
    hash grouping of three columns took seconds for a million rows.)"""
    sizes = [len(g[0]) for g in groups]
    part, off, seq = (np.concatenate([g[i] for g in groups]) if groups
                      else np.zeros(0, np.int64) for i in range(3))
    if not len(part):
        return [np.zeros(0, np.int64) for _ in groups], (part, off, seq)
    order = np.lexsort((seq, off, part))
    sp, so, ss = part[order], off[order], seq[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = (sp[1:] != sp[:-1]) | (so[1:] != so[:-1]) | (ss[1:] != ss[:-1])
    ids = np.empty(len(order), np.int64)
    ids[order] = np.cumsum(new) - 1
    first = np.flatnonzero(new)
    return np.split(ids, np.cumsum(sizes)[:-1]), (sp[first], so[first], ss[first])


def _live(h: Held, keep: Bool, content: Callable[[], U64]) -> Pos:
    """The positions the ``keep`` rows of ``h`` hold: a correction holds the
    record it restates; a position with a correction where every row
    (``content``: its digest) nets to nothing holds nothing."""
    pos = (h.part[keep], h.off[keep], h.seq[keep])
    corr = h.corr[keep]
    if not corr.any():
        return pos
    (ids,), (up, uo, us) = _dense([pos])
    has_corr = np.zeros(len(up), dtype=bool)
    has_corr[ids[corr]] = True
    rows = content()[keep]
    diff = h.table.column(DIFF).to_numpy().astype(np.int64)[keep]
    order = np.lexsort((rows, ids))
    sid, sr = ids[order], rows[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = (sid[1:] != sid[:-1]) | (sr[1:] != sr[:-1])
    starts = np.flatnonzero(new)
    nets = np.add.reduceat(diff[order], starts)
    held = np.zeros(len(up), dtype=bool)
    held[sid[starts][nets != 0]] = True
    live = ~has_corr | held
    return (up[live], uo[live], us[live])


def _equal(a: Pos, b: Pos) -> bool:
    return a is b or all(x is y or np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _sample(p: Pos, mask: Bool) -> list[tuple[int, int, int]]:
    at = np.flatnonzero(mask)[:5]
    return list(zip(p[0][at].tolist(), p[1][at].tolist(), p[2][at].tolist(), strict=True))


def _compare(rep: OutputReport, must: Pos, may: Pos, held: Pos,
             values: tuple[Pos, U64, Pos, U64] | None) -> int:
    """Positions: ``missing`` where one of ``must`` is not ``held``,
    ``unexpected`` where one held is in neither ``must`` nor ``may``; and
    ``values`` (rows owed and rows held, each with its signed digest):
    ``wrong-value`` where the sums differ at a position of ``must`` that is
    held. Returns how many positions were compared for values."""
    groups = [must, may, held] + ([values[0], values[2]] if values is not None else [])
    # (the same positions are often given twice: sorted once)
    same = [next((j for j in range(i) if _equal(groups[j], g)), i)
            for i, g in enumerate(groups)]
    distinct, at = _dense([g for i, g in enumerate(groups) if same[i] == i])
    index = [i for i in range(len(groups)) if same[i] == i]
    ids = [distinct[index.index(same[i])] for i in range(len(groups))]
    n = len(at[0])
    flags = []
    for i in range(3):
        f = np.zeros(n, dtype=bool)
        f[ids[i]] = True
        flags.append(f)
    in_must, in_may, in_held = flags
    missing = in_must & ~in_held
    unexpected = in_held & ~in_may & ~in_must
    rep.breach("missing", int(missing.sum()), _sample(at, missing))
    rep.breach("unexpected", int(unexpected.sum()), _sample(at, unexpected))
    if values is None:
        return 0
    want = np.zeros(n, np.uint64)
    np.add.at(want, ids[3], values[1])
    got = np.zeros(n, np.uint64)
    np.add.at(got, ids[4], values[3])
    compared = in_must & in_held
    wrong = compared & (want != got)
    rep.breach("wrong-value", int(wrong.sum()), _sample(at, wrong))
    return int(compared.sum())


def check_append(rep: OutputReport, kind: str, owed: Owed, h: Held) -> None:
    """Complete and values of an append output: every record before the
    output's progress held, nothing else, and the rows at each position
    those its record must produce."""
    exp = _pos(owed.owed_positions())
    rep.did("complete", f"{len(exp[0])} records")
    keep = ~h.unreadable
    if not owed.values:
        _compare(rep, exp, exp, _live(h, keep, lambda: _content(h.table)), None)
        rep.skip("values", "the output's columns are known only to a running source")
        return
    columns = list(owed.out.user_schema.names)
    held = conform(h.table, _output_schema(owed.out.user_schema))
    digests = update_digests(held, columns)
    sums = (pa.concat_tables(owed.sums) if owed.sums else
            pa.table({**{k: pa.array([], pa.int64()) for k in KEYS},
                      "d": pa.array([], pa.uint64())}))
    n = _compare(rep, exp, exp, _live(h, keep, lambda: digests),
                 (_pos(sums), sums.column("d").to_numpy(),
                  (h.part[keep], h.off[keep], h.seq[keep]), signed(held, digests)[keep]))
    rep.did("values", f"{n} positions")
    _refused_note(rep, owed)
    last = h.last_correction
    if last is not None:
        rep.skip("history", f"rows restated by the re-snapshot correction at {last} lay "
                 "elsewhere before it: the output as of earlier times is not checked")


def _output_schema(user_schema: pa.Schema) -> pa.Schema:
    from reclock.contracts.rows import output_schema

    return output_schema(user_schema)


def _refused_note(rep: OutputReport, owed: Owed) -> None:
    if owed.progress is None:
        return
    if owed.stager is None:
        rep.skip("values", "the sink's rules for values it cannot store are known once a "
                 f"driver opened it: the {len(owed.refused)} error rows the output holds are "
                 "taken as refused")
    elif owed.refused:
        rep.skip("values", f"{len(owed.refused)} rows the run refused by an injected fault "
                 "(RECLOCK_FAIL_AT=refuse) are taken as refused")


def check_keyed(rep: OutputReport, kind: str, owed: Owed, h: Held) -> None:
    """Complete, values and history of a keyed output (upsert, keyed
    debezium): the re-read intents put through the envelope from a fresh
    key state (the model) against the output's update log (see the module)."""
    out = owed.out
    rep.did("complete", f"{sum(t.num_rows for t in owed.positions)} records")
    if not owed.values:
        exp = _pos(owed.owed_positions())
        _compare(rep, exp, exp, _live(h, ~h.unreadable, lambda: _content(h.table)), None)
        rep.skip("complete", "a keyed output whose columns are known only to a running "
                 "source: records that leave no update are not told apart")
        rep.skip("values", "the output's columns are known only to a running source")
        rep.skip("history", "the output's columns are known only to a running source")
        return
    schema = _output_schema(out.user_schema)
    columns = list(out.user_schema.names)
    key = tuple(out.upsert_key)
    intents = (pa.concat_tables(owed.intents, promote_options="default") if owed.intents
               else schema.empty_table())
    model = upsert_model(intents, schema, columns, key)
    held = conform(h.table, schema)

    # digests: of each row, and of its key (error rows have none)
    m_ok = model.column(ERROR).is_null().to_numpy(zero_copy_only=False)
    h_ok = held.column(ERROR).is_null().to_numpy(zero_copy_only=False)
    m_row, h_row = update_digests(model, columns), update_digests(held, columns)
    m_key, h_key = row_digests(model, key), row_digests(held, key)

    # keys touched by rows that cannot be compared: their history neither
    out_of_reach = np.unique(h_key[h.unreadable & h_ok])
    m_keep = ~(m_ok & np.isin(m_key, out_of_reach))
    h_keep = ~h.unreadable & ~(h_ok & np.isin(h_key, out_of_reach))
    if len(out_of_reach):
        rep.skip("history", f"{len(out_of_reach)} keys with rows of records that cannot be "
                 "read again (see complete)")
    last = h.last_correction

    # complete and values: the model's positions after the last correction
    # must be held, with the same rows; one before it may be
    m_pos = _pos(model)
    m_into = model.column(INTO_TIME).to_numpy().astype(np.int64)
    after = m_keep & (m_into > last) if last is not None else m_keep
    h_after = h_keep & ~h.corr
    if last is not None:
        h_after &= h.into > last
    n = _compare(rep, _take(m_pos, after), _take(m_pos, m_keep), _live(h, h_keep, lambda: h_row),
                 (_take(m_pos, after), signed(model, m_row)[after],
                  (h.part[h_after], h.off[h_after], h.seq[h_after]),
                  signed(held, h_row)[h_after]))
    rep.did("values", f"{n} positions")
    _refused_note(rep, owed)
    if last is not None:
        for c in ("complete", "values"):
            rep.skip(c, f"positions of records before the re-snapshot correction at {last}: "
                     "the updates it replaced are not owed")

    # history: per (row, IntoTime), net diffs equal
    _check_history(rep, model, held, m_row[m_keep & m_ok], h_row[h_keep & h_ok],
                   m_key, h_key, m_keep & m_ok, h_keep & h_ok, m_into, h.into, last, columns,
                   key)


def upsert_model(intents: pa.Table, schema: pa.Schema, columns: list[str],
                 key: tuple[str, ...]) -> pa.Table:
    """The update log the upsert envelope makes of ``intents`` (rows of
    ``schema``, ``_diff`` 1 a value, 0 a tombstone) from an empty key state:
    per key, in (IntoTime, position) order, a value retracts the key's
    previous one (at its own position and time) and inserts itself, unless
    it equals it; a tombstone retracts it; error rows pass through.

    This is :meth:`reclock.runtime.upsert_state.UpsertState.apply` vectorized
    (one sort; a million intents in a second, where ``apply`` takes a
    Python step per intent): the auditor's own model, which the tests hold
    equal to ``apply``'s. Intents it does not model (a truncate, columns
    left unchanged upstream: CDC's, whose sources cannot be re-read) go
    through ``apply`` itself."""
    from reclock.runtime.upsert_state import UpsertState

    if _unmodelled(intents):
        model, _ = UpsertState(columns, key).apply(intents, schema)
        return model
    intents = intents.select(schema.names).cast(schema)
    err = intents.column(ERROR).is_valid().to_numpy(zero_copy_only=False)
    errors = intents.filter(pa.array(err))
    ok = intents.filter(pa.array(~err))
    if ok.num_rows == 0:
        return errors
    k = row_digests(ok, key)
    r = row_digests(ok, columns)
    p_part, p_off, p_seq = _pos(ok)
    into = ok.column(INTO_TIME).to_numpy().astype(np.int64)
    order = np.lexsort((p_seq, p_off, p_part, into, k))
    k, r = k[order], r[order]
    value = ok.column(DIFF).to_numpy()[order] != 0
    same = np.zeros(len(order), dtype=bool)
    same[1:] = k[1:] == k[:-1]
    had = np.zeros(len(order), dtype=bool)  # the key holds the previous intent's value
    had[1:] = same[1:] & value[:-1]
    equal = np.zeros(len(order), dtype=bool)
    equal[1:] = r[1:] == r[:-1]
    change = ~((had & value & equal) | (~had & ~value))
    retract = np.flatnonzero(had & change)
    insert = np.flatnonzero(value & change)
    meta = [n for n in schema.names if n not in columns]
    at = order[retract]
    gone = pa.table([*(ok.column(c).take(pa.array(order[retract - 1])) for c in columns),
                     *(ok.column(n).take(pa.array(at)) for n in meta)], schema=schema)
    d = schema.get_field_index(DIFF)
    gone = gone.set_column(d, schema.field(DIFF), pa.array(np.full(len(at), -1, np.int64)))
    new = ok.take(pa.array(order[insert]))
    new = new.set_column(d, schema.field(DIFF), pa.array(np.ones(len(insert), np.int64)))
    return pa.concat_tables([errors, gone, new])


def _unmodelled(intents: pa.Table) -> bool:
    """Whether ``intents`` hold a truncate or columns left unchanged upstream."""
    from reclock.core.columns import SRC_UNCHANGED, TRUNCATED

    if not intents.num_rows:
        return False
    if SRC_UNCHANGED in intents.column_names:
        lens = pc.fill_null(pc.list_value_length(intents.column(SRC_UNCHANGED)), 0)
        if pc.any(pc.greater(lens, 0)).as_py():
            return True
    return bool(pc.any(pc.equal(intents.column(DIFF), TRUNCATED)).as_py())


def _check_history(rep: OutputReport, model: pa.Table, held: pa.Table, m_row: U64, h_row: U64,
                   m_key: U64, h_key: U64, m_sel: Bool, h_sel: Bool, m_into: I64, h_into: I64,
                   last: int | None, columns: list[str], key: tuple[str, ...]) -> None:
    """The model's and the output's data rows net to the same diff per (row,
    IntoTime); a time at or before the last correction counts as that
    time. Each differing key is a breach, named with the first IntoTime at
    which the output's state of it differs."""
    m_t = m_into[m_sel] if last is None else np.maximum(m_into[m_sel], last)
    h_t = h_into[h_sel] if last is None else np.maximum(h_into[h_sel], last)
    m_d = model.column(DIFF).to_numpy()[m_sel].astype(np.int64)
    h_d = held.column(DIFF).to_numpy()[h_sel].astype(np.int64)
    t = pa.table({"r": pa.array(np.concatenate([m_row, h_row]), pa.uint64()),
                  "t": np.concatenate([m_t, h_t]),
                  "d": np.concatenate([m_d, -h_d])})
    net = t.group_by(["r", "t"]).aggregate([("d", "sum")])
    diff = net.filter(pc.not_equal(net.column("d_sum"), 0))
    times = len(np.unique(np.concatenate([m_t, h_t])))
    rep.did("history", f"as of {times} IntoTime{'s' if times != 1 else ''}" + (
        f" (from the re-snapshot correction at {last} on)" if last is not None else ""))
    if last is not None:
        rep.skip("history", f"the output before the re-snapshot correction at {last}: the "
                 "correction set it right as of that time, not before")
    if diff.num_rows == 0:
        return
    # which keys, and the first time each is wrong
    bad_rows = diff.column("r").to_numpy()
    bad_t = diff.column("t").to_numpy()
    key_of: dict[int, int] = {}
    for rows, keys in ((m_row, m_key[m_sel]), (h_row, h_key[h_sel])):
        hit = np.isin(rows, bad_rows)
        key_of.update(zip(rows[hit].tolist(), keys[hit].tolist(), strict=True))
    first: dict[int, int] = {}
    pairs: set[tuple[int, int]] = set()
    for r, tm in zip(bad_rows.tolist(), bad_t.tolist(), strict=True):
        k = key_of[r]
        pairs.add((k, tm))
        first[k] = min(first.get(k, tm), tm)
    sample = [_describe(k, tm, model, held, m_key, h_key, m_sel, h_sel, m_t, h_t,
                        columns, key, last)
              for k, tm in sorted(first.items(), key=lambda kt: (kt[1], kt[0]))[:5]]
    rep.breach("keyed-history", len(pairs), sample)


def _describe(k: int, at: int, model: pa.Table, held: pa.Table, m_key: U64, h_key: U64,
              m_sel: Bool, h_sel: Bool, m_t: I64, h_t: I64, columns: list[str],
              key: tuple[str, ...], last: int | None) -> str:
    """What the output and the model hold of key digest ``k`` as of ``at``."""
    from reclock.contracts.consolidate import consolidate

    def state(t: pa.Table, keys: U64, sel: Bool, times: I64) -> list[dict[str, Any]]:
        rows = t.filter(pa.array(sel))
        mine = (keys[sel] == k) & (times <= at)
        rows = rows.filter(pa.array(mine))
        out = []
        for r in consolidate(rows, None, columns).to_pylist():
            n = int(r.pop("_count"))
            out.extend([r] * n if n > 0 else [{**r, "_count": n}])
        return out

    want = state(model, m_key, m_sel, m_t)
    got = state(held, h_key, h_sel, h_t)
    some = (want or got)[0]
    name = {c: some[c] for c in key}
    when = f"as of {at}" + (" (the re-snapshot correction)" if last is not None and at == last
                            else "")
    if not got:
        return f"key {name}: missing {when} (the replay holds {want[0]})"
    if not want:
        return f"key {name}: {when} holds {got}, the replay holds none"
    return f"key {name}: {when} holds {got}, the replay {want}"


# -- the pipeline --------------------------------------------------------------------------------


def _furthest(progresses: list[Antichain[Any]]) -> Antichain[Any]:
    furthest = progresses[0]
    for p in progresses[1:]:
        furthest = furthest.join(p)
    return furthest


def _refused(updates: pa.Table, every: bool) -> frozenset[tuple[int, int, int]]:
    """Positions of the rows the run refused by an injected fault (``every``:
    of every error row)."""
    from reclock.runtime.dataplane import INJECTED_REFUSAL

    if updates.num_rows == 0 or ERROR not in updates.column_names:
        return frozenset()
    err = updates.column(ERROR)
    hit = updates.filter(pc.is_valid(err) if every
                         else pc.fill_null(pc.equal(err, INJECTED_REFUSAL), False))
    return frozenset(_positions(hit))


def _stager(out: Any) -> Any:
    """The output's stager, or None where its sink makes one only once a
    driver opened it (a Postgres table's stored types); making it changes
    nothing (verify never calls ``ensure``)."""
    from reclock.contracts.sink import SinkError

    if out.user_schema is None:
        return None
    try:
        return out.sink.stager()
    except SinkError:
        return None


def _identity_breach(rep: OutputReport, exc: DefiniteError) -> None:
    rep.breach("identity", 1, [str(exc)])
    rep.did("identity", "changed")
    for c in ("complete", "values", "history"):
        rep.skip(c, "the upstream was replaced (see identity): its records cannot be told "
                 "from the old one's")


def verify_pipeline(cfg: Any, sink: str | None = None) -> list[SourceReport]:
    """Verify every source of a pipeline configuration: every sink of every
    output, each by its own upper (an output with several sinks reports one
    entry per sink, ``<output>.<sink>``); ``sink``: only the sinks of that
    name (an output with one sink is named by its type). Each output's state
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
        found = sink is None
        for src in cfg.sources:
            built = pipe.build_source(src, audit=True)
            if sink is not None:
                built.outputs = [o for o in built.outputs if o.sink_name == sink]
                for slot, o in enumerate(built.outputs):  # (an audit's own copy)
                    o.slot = slot
                found = found or bool(built.outputs)
                if not built.outputs:
                    built.source.close()
                    continue
            try:
                reports.append(_verify_source(pipe, pool, src, built, src.name in shards))
            finally:
                built.source.close()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        pipe.close()
    if not found:
        raise DefiniteError(f"no output has a sink named {sink!r}",
                            hint="a sink of sinks: [...] is named by its name (default: its "
                                 "type); the one sink of sink: by its type")
    return reports


def _verify_source(pipe: Any, pool: Any, src: Any, built: Any, bound: bool) -> SourceReport:
    source = built.source
    kind = source.kind
    report = SourceReport(src.name)
    if not bound:
        report.notes.append("no bindings yet: nothing ingested")
        return report
    states = []
    tables = []
    progresses: list[Antichain[Any] | None] = []
    for o in built.outputs:
        st = o.sink.state()
        states.append(st)
        if o.sink.holds_state:
            # a current-state table keeps no history to audit
            tables.append(pa.table({k: pa.array([], pa.int64()) for k in KEYS}))
        else:
            tables.append(read_output(o))
        progresses.append(None if o.sink.holds_state or st.progress is None
                          else Antichain.decode_json(kind, st.progress))
    b = pipe.store.read(src.name)
    keyed = {o.slot for o in built.outputs if o.upsert_key is not None
             and not o.sink.holds_state}
    audited = [o for o in built.outputs if not o.sink.holds_state]
    owed: dict[int, Owed] = {}
    again = None
    if source.replayable and audited and b.first is not None:
        for o in audited:
            stager = _stager(o) if progresses[o.slot] is not None else None
            owed[o.slot] = Owed(o, progresses[o.slot], b, kind, o.slot in keyed, stager,
                                 _refused(tables[o.slot], stager is None))
        furthest = _furthest([p for p in progresses if p is not None] or [b.first.frontier])
        held_parts: set[int] = set()
        if is_partitioned(kind):
            for i in owed:
                if tables[i].num_rows:
                    held_parts |= set(restated(np.unique(tables[i].column(SRC_PART).to_numpy()
                                                         .astype(np.int64)))[0].tolist())
        again = pool.submit(reread, source, b, furthest, owed, held_parts)
    for o, st, updates in zip(built.outputs, states, tables, strict=True):
        if o.sink.holds_state:
            report.notes.append(f"output {o.key}: current-state table, not audited")
            rep = OutputReport(o.key)
            for c in ("time", "upper", "once", "complete", "values", "history"):
                rep.skip(c, "a current-state table keeps no history to audit")
            report.outputs.append(rep)
            continue
        rep = check_output(o.key, updates, b, st.upper, o.upsert_key, st.held(kind))
        report.outputs.append(rep)
        if st.progress is None and updates.num_rows:
            rep.breach("data-without-progress", updates.num_rows, [])
    if again is None:
        report.notes.append("complete: source cannot be re-read; skipped")
        for o, rep in zip(built.outputs, report.outputs, strict=True):
            if not o.sink.holds_state:
                for c in ("complete", "values", "history"):
                    rep.skip(c, f"the source cannot be re-read ({_why_not()})")
        return report
    try:
        got: Reread = again.result()
    except IdentityChanged as exc:
        for o in audited:
            _identity_breach(report.outputs[o.slot], exc)
        return report
    except DefiniteError as exc:
        report.notes.append(f"the source could not be re-read: {exc}")
        for o in audited:
            for c in ("complete", "values", "history"):
                report.outputs[o.slot].skip(c, f"the source could not be re-read: {exc}")
        return report
    if got.reached != got.upto:
        report.notes.append(f"complete: checked only up to {got.reached.encode()} "
                            "(too many records)")
    if got.lost:
        report.notes.append("not re-read: " + "; ".join(
            f"partition id {p}: {why}" for p, why in sorted(got.lost.items())))
    for o in audited:
        rep = report.outputs[o.slot]
        err = got.errors.get(o.index)
        if isinstance(err, IdentityChanged):  # (its partitions are among the lost)
            rep.breach("identity", 1, [str(err)])
            rep.did("identity", "changed")
        else:
            rep.did("identity", "unchanged" if err is None else "its upstream is gone")
            if err is not None:
                rep.skip("complete", str(err))
        h = _held(kind, tables[o.slot])
        _mark_unreadable(rep, h, kind, got)
        ow = owed[o.slot]
        report.complete_checked += sum(t.num_rows for t in ow.positions)
        if o.slot in keyed:
            check_keyed(rep, kind, ow, h)
        else:
            check_append(rep, kind, ow, h)
            if o.upsert_key is None:
                rep.did("history", "the rows' times and values")
    return report


def _why_not() -> str:
    return ("it keeps no copy of what it delivered: a replication slot or binlog releases "
            "what was acknowledged, a one-shot load's files changed since they were loaded")
