"""The commit path of one source: its outputs' commits, then resumption and
acknowledgement, as an explicit state machine.

The order of the steps is the promise (:mod:`reclock.contracts.sink`: stage,
commit, resumption frontier, acknowledge): nothing is acknowledged upstream
before it is durable in every output, and driver-side state derived from an
output (its key state) changes only after the commit that carries its
updates. A round of the path, for one job's results (or, at the end of a
tick, for outputs that only advance)::

    per output, in order:
      STAGED        the rows the driver makes for the output are staged: a
                    re-snapshot's correction, a keyed output's settled updates
                    (the job's own rows were staged by its tasks)
      COMMITTED     staged data and the new (upper, progress), one atomic
                    sink commit, fenced on the state last seen
      SAVED         the key state saved as that of the committed version
                    (keyed outputs; nothing to do for the others)
      ADVANCED      the driver holds the output at its new state: a
                    re-snapshot's request ends, counts, health
    then, per source:
      RECORDED      the ledger records the outputs' committed uppers (when due)
      RESUMED       the resumption frontier: the meet of the outputs' uppers,
                    through the bindings into FromTime; it never moves back
      ACKNOWLEDGED  only that frontier is acknowledged upstream

"Output" here is a slot: one sink of an output (an output with ``sinks:``
has one per sink, :class:`~reclock.runtime.site.OutputRuntime`), each taking
the output steps on its own. A slot whose steps fail while another slot of
the source goes on is parked (:meth:`Committer.park`): it leaves the round
where it was, the others complete it, and the resumption frontier (their
meet, the parked one's upper included) stays behind it until it is back.

:class:`CommitPath` checks each step at its entry: the step before it
completed for that output in the same round (of the same tick), and no
output is mid-way when the source's steps begin. A step entered out of order
raises :class:`OutOfOrder` at once, a bug caught where it happens instead of
a silent loss. A step that fails leaves its output where it was; the round
goes no further (the tick raises) and the next tick starts a new one.

The fault points of the path (:mod:`reclock.faults`) fire here: ``stage``
while staging driver rows, ``damage_keys`` before settling, ``commit`` just
before the sink commit, ``after_sink_commit`` between an output's commit and
its key state, ``after_upper_advance`` once every output advanced, and
``after_acknowledge``.
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pyarrow as pa

from reclock import faults
from reclock.contracts.sink import SinkState, Superseded
from reclock.core.bindings import Bindings
from reclock.core.errors import BindingError, LockTaken
from reclock.core.frontier import Antichain
from reclock.core.secrets import scrub
from reclock.runtime.dataplane import TaskResult
from reclock.runtime.health import RUNNING, STALLED, Health, described
from reclock.runtime.keyed import KeyedState, remove_spilled
from reclock.runtime.keystate import KeyedIntents
from reclock.runtime.ledger import CommitLedger
from reclock.runtime.resnapshot import Resnapshots
from reclock.runtime.shapes import Shapes
from reclock.runtime.site import OutputRuntime, Site, resume_into, upper_value
from reclock.runtime.upsert_state import UpsertState

log = logging.getLogger("reclock.driver")


class Step(enum.IntEnum):
    """The steps of a round of the commit path, in order (see the module)."""

    STAGED = 1
    COMMITTED = 2
    SAVED = 3
    ADVANCED = 4
    RECORDED = 5
    RESUMED = 6
    ACKNOWLEDGED = 7


#: The steps each output takes, in order; then the source's (:data:`SOURCE_STEPS`).
OUTPUT_STEPS = (Step.STAGED, Step.COMMITTED, Step.SAVED, Step.ADVANCED)
SOURCE_STEPS = (Step.RECORDED, Step.RESUMED, Step.ACKNOWLEDGED)


class OutOfOrder(AssertionError):
    """A step of the commit path was entered before the step before it
    completed (for that output, in that round): a bug in the driver."""


class CommitPath:
    """One round of the commit path of source ``source`` in tick ``tick``
    (its ``number``-th in the tick): the steps each output and the source
    took. Each step goes through :meth:`step`, which checks it at entry."""

    def __init__(self, source: str, tick: int, number: int = 1) -> None:
        self.source = source
        self.tick = tick
        self.number = number
        #: by output index: the last step entered, and whether it completed
        self._outputs: dict[int, tuple[Step, bool]] = {}
        self._source: tuple[Step, bool] | None = None

    def __repr__(self) -> str:
        return f"commit round {self.number} of tick {self.tick} of source {self.source!r}"

    @property
    def closed(self) -> bool:
        """Whether the round ended: the resumption frontier was acknowledged."""
        return self._source == (Step.ACKNOWLEDGED, True)

    def at(self, output: int | None = None) -> tuple[Step, bool] | None:
        """The last step ``output`` (None: the source) entered in this
        round, and whether it completed; None: none yet."""
        return self._source if output is None else self._outputs.get(output)

    def enter(self, step: Step, output: int | None = None) -> None:
        """Check that ``step`` may begin now for ``output`` (an output's
        index for :data:`OUTPUT_STEPS`, None for :data:`SOURCE_STEPS`) and
        note that it began; :class:`OutOfOrder` otherwise."""
        if (step in OUTPUT_STEPS) != (output is not None):
            raise OutOfOrder(f"{self}: step {step.name} is taken "
                             f"{'per output' if step in OUTPUT_STEPS else 'by the source'}")
        if output is not None:
            if self._source is not None:
                raise OutOfOrder(f"{self}: output {output} entered {step.name} after the "
                                 f"source's {self._source[0].name}")
            self._check(step, self._outputs.get(output), f"output {output}")
            self._outputs[output] = (step, False)
            return
        if step is SOURCE_STEPS[0]:
            midway = {i: at for i, at in self._outputs.items() if at != (Step.ADVANCED, True)}
            if midway:
                raise OutOfOrder(f"{self}: the source entered {step.name} while outputs "
                                 + ", ".join(f"{i} (at {s.name}, {'done' if ok else 'begun'})"
                                             for i, (s, ok) in sorted(midway.items()))
                                 + f" had not completed {Step.ADVANCED.name}")
        self._check(step, self._source, "the source")
        self._source = (step, False)

    def forget(self, output: int) -> None:
        """``output`` (a slot) failed mid-way and was parked: it takes no
        further step in this round, and does not hold the source's back."""
        self._outputs.pop(output, None)

    def completed(self, step: Step, output: int | None = None) -> None:
        """Note that ``step``, entered last for ``output``, completed."""
        at = self.at(output)
        if at != (step, False):
            raise OutOfOrder(f"{self}: {step.name} completed for "
                             f"{'the source' if output is None else f'output {output}'}, "
                             f"which is at {at}")
        if output is None:
            self._source = (step, True)
        else:
            self._outputs[output] = (step, True)

    @contextmanager
    def step(self, step: Step, output: int | None = None) -> Iterator[None]:
        """Take ``step``: checked at entry, noted complete when the block
        ends without an error (one that fails leaves it begun: the round
        goes no further for that output)."""
        self.enter(step, output)
        yield
        self.completed(step, output)

    def _check(self, step: Step, at: tuple[Step, bool] | None, who: str) -> None:
        first = step in (OUTPUT_STEPS[0], SOURCE_STEPS[0])
        if first and at is None:
            return
        if not first and at == (Step(step - 1), True):
            return
        was = "nothing yet" if at is None else f"{at[0].name} ({'done' if at[1] else 'begun'})"
        need = "nothing before it" if first else f"{Step(step - 1).name} done"
        raise OutOfOrder(f"{self}: {who} entered {step.name} at {was}; it needs {need}")


class Committer:
    """The commit path of one source (see the module): its outputs'
    commits, the resumption frontier and what was acknowledged upstream."""

    def __init__(self, site: Site, keyed: KeyedState, resnapshots: Resnapshots,
                 shapes: Shapes, ledger: CommitLedger, dropped: Callable[[], bool]) -> None:
        self.site = site
        #: whether the source is dropped (asked before each output's commit:
        #: a job that finishes after a drop request commits nothing more)
        self.dropped = dropped
        self.keyed = keyed
        self.resnapshots = resnapshots
        self.shapes = shapes
        self.ledger = ledger
        #: the resumption frontier (FromTime) as last computed (None: not open yet)
        self.resume: Antichain[Any] | None = None
        #: the frontier last acknowledged upstream
        self.acknowledged: Antichain[Any] | None = None
        #: outputs whose upstream is gone (output_errors), and their errors
        self._gone: dict[int, str] = {}
        #: the round under way (None: none since the last acknowledgement)
        self._path: CommitPath | None = None
        self._rounds = (0, 0)  # (tick, rounds begun in it)

    def open(self, bindings: Bindings[Any] | None = None) -> dict[str, str]:
        """At the source's open: each output's durable state, which its next
        commit is fenced on (checked against the ledger, unless a
        re-snapshot rebuilds the output), and a keyed output's key state for
        it. Per keyed output, what became of its key state (``reset``,
        ``reused`` or ``rebuilt``). ``bindings``: the source's, as just read
        (a slot that cannot be read is parked at a state derived from them).

        A sink that cannot be opened while others can is parked (see
        :meth:`park`) at a state never ahead of its durable one: the state
        this driver last knew it at, or, for one not read yet in this run,
        the upper the ledger recorded for it (:meth:`_provisional`). A slot
        the ledger knows nothing of may hold nothing or anything: the source
        stalls until it can be read, as it always has."""
        self.ledger.read()
        taken = self.resnapshots.taken
        keys: dict[str, str] = {}
        for out in self.site.outputs:
            known = out.state
            try:
                out.sink.ensure(out.user_schema)
                out.state = out.sink.state()
                if out.index not in taken:  # a re-snapshot rebuilds a lost output
                    self.ledger.check(out.key, out.sink, out.state)
                out.upsert = None
                if out.upsert_key is not None:
                    keys[out.key] = self.keyed.open(out, resnapshot=out.index in taken)
                out.parked_until = None  # (opened: back in the jobs)
            except Exception as exc:
                read, out.upsert = out.state, None
                parked = known if known.progress is not None else self._provisional(
                    out, bindings)
                if parked is None:
                    raise
                out.state = parked
                if not self.park(out, exc):
                    out.state = read  # (as a source that stalls has always left it)
                    raise
        return keys

    def _provisional(self, out: OutputRuntime, bindings: Bindings[Any] | None
                     ) -> SinkState | None:
        """The state to park slot ``out`` at when it cannot be read at the
        source's first open in this run: the upper the ledger recorded for
        it, which is at most its durable one (the ledger is written after
        the commit). None: the source must wait for it.

        That state only holds the resumption frontier back (the meet of the
        slots' uppers), so the source never acknowledges past what the slot
        holds. A replayable source reads any range again, so a slot the
        ledger does not know is parked at 0 (read from the start once it is
        back). For a source that is not replayable, the slot's state also
        tells the source what the output holds (whether it needs a
        snapshot): it is parked only when the ledger knows its upper, with
        the progress the bindings give at that upper (at most the progress
        the slot committed with it, so it claims no more than it holds); an
        upstream position released before that (the ledger lags the
        acknowledgements) is behind every slot's durable state, so the
        source resumes from what upstream still retains."""
        known = self.ledger.known
        if self.site.source.replayable:
            return SinkState(known.get(out.key, 0))
        if out.key not in known or bindings is None or not len(bindings):
            return None
        upper = known[out.key]
        try:
            held = bindings.source_upper_at(upper if upper is not None
                                            else Antichain.empty())
        except BindingError:
            return None
        return SinkState(upper, held.encode_json())

    def close(self) -> None:
        """The source stops: the ledger records the outputs' uppers as they stand."""
        try:
            self.ledger.record(((o.key, o.state) for o in self.site.outputs), force=True)
        except Exception as exc:  # the store may be away; the next open compares anyway
            log.warning("source %s: recording the outputs' uppers failed: %s",
                        self.site.name, exc)

    def begin(self, tick: int) -> CommitPath:
        """A new round of the path in tick ``tick``; a round of the same
        tick still under way (committed, not resumed) is a bug."""
        if self._path is not None and self._path.tick == tick:
            raise OutOfOrder(f"{self._path}: a new round began before it resumed")
        n = self._rounds[1] + 1 if self._rounds[0] == tick else 1
        self._rounds = (tick, n)
        self._path = CommitPath(self.site.name, tick, n)
        return self._path

    def commit(self, tick: int, b: Bindings[Any], results: list[TaskResult],
               reached: Antichain[Any], only_if_moves: bool = False,
               snapshots: frozenset[int] = frozenset()) -> None:
        """Per output: staged data + (upper, progress) in one atomic, fenced
        step. ``snapshots``: outputs whose snapshot chunks ``results`` hold;
        one being re-snapshotted retracts what it held in the same step
        (:meth:`~reclock.runtime.resnapshot.Resnapshots.correction`). Stops
        (between outputs) when the source is dropped; the round goes on with
        :meth:`resume_and_acknowledge`."""
        path = self.begin(tick)
        kind = self.site.source.kind
        new_upper = upper_value(b.reclock_frontier(reached))
        progress = reached.encode_json()
        for out in self.site.outputs:
            new = SinkState(new_upper, progress)
            cur = out.state
            if out.parked_until is not None or (only_if_moves and cur == new):
                continue
            past = cur.held(kind)
            if past is not None and cur.progress != progress and reached.less_equal(past):
                # This output is already past `reached` (it committed further
                # before a crash); it dropped every record of this job.
                if any(r.staged.get(out.slot) for r in results):
                    raise AssertionError(f"{out.label}: staged data behind its progress")
                continue
            if not cur.less_equal(new):
                raise AssertionError(
                    f"{out.label}: upper would move backwards {cur.upper} -> {new_upper}"
                )
            staged = [s for r in results for s in r.staged.get(out.slot, [])]
            if self.dropped():
                return
            # Key state derived from the output changes only once the commit
            # that carries its updates succeeded: settling writes its changes
            # in the key store's open transaction, committed after the sink
            # commit, so a failed stage or commit leaves it as it was.
            intents = [r.intents[out.slot] for r in results if out.slot in r.intents]
            replacing = self.resnapshots.replacing(out, snapshots, cur)
            keys = out.upsert
            try:
                try:
                    staged += self._stage(path, b, out, cur, keys, intents, replacing)
                    self._commit(path, out, staged, cur, new)
                except BaseException as exc:
                    if keys is not None:
                        self.keyed.failed(out, keys, exc)
                    raise
                finally:
                    remove_spilled(intents)
                # (a crash here leaves a key store behind its output: rebuilt on open)
                faults.crash_point("after_sink_commit")
                self._save(path, out, keys, new)
            except Exception as exc:
                if not self.park(out, exc):
                    raise
                path.forget(out.slot)  # it stays where it was; the others go on
                continue
            self._advance(path, out, new, reached, results, replacing)
        faults.crash_point("after_upper_advance")

    def park(self, out: OutputRuntime, exc: Exception) -> bool:
        """Park the slot ``out``, whose sink failed with ``exc``, when
        another slot of the source goes on: its health says the error
        (naming output and sink), it leaves the jobs and commits (its upper
        and progress stay, and so does the resumption frontier, which is
        their meet), and it is brought back by a re-open after a backoff
        (:meth:`due`): the records it missed are read again for it alone.
        Returns False, parking nothing, when the error stops the whole
        source: another driver owns the pipeline, a bug, or no other slot
        left running (then the source stalls and retries, as it always has)."""
        if isinstance(exc, Superseded | LockTaken | AssertionError):
            return False
        site = self.site
        if not any(o is not out and o.parked_until is None for o in site.outputs):
            return False
        msg, hint, definite = described(exc)
        out.failures += 1
        delay = min(0.5 * 2 ** min(out.failures - 1, 16),
                    site.settings.max_retry_backoff_ms / 1000.0)
        out.parked_until = time.monotonic() + delay
        out.upsert = None  # (its key state is re-opened with the sink)
        error = f"source {site.name!r} {out.label}: {type(exc).__name__}: {msg}"
        if out.health.status != STALLED or out.health.error != scrub(error):
            log.error("%s (%s); the source's other sinks go on, this one is retried in "
                      "%.1f s", error, hint, delay)
            site.events.log(site.name, "sink_stalled", output=out.name, sink=out.sink_name,
                            error=error, hint=hint, definite=definite)
        out.health = Health(STALLED, error, hint, site.clock.now(), definite)
        return True

    def due(self) -> bool:
        """Whether a parked slot's retry is due: it is un-parked (the source
        re-opens now, reading its durable state again)."""
        now = time.monotonic()
        back = [o for o in self.site.outputs
                if o.parked_until is not None and o.parked_until <= now]
        for o in back:
            o.parked_until = None
        return bool(back)

    def _stage(self, path: CommitPath, b: Bindings[Any], out: OutputRuntime, cur: SinkState,
               keys: UpsertState | None, intents: list[KeyedIntents], replacing: bool
               ) -> list[dict[str, Any]]:
        """STAGED: stage the rows the driver makes for ``out``: a replacing
        commit's correction, then a keyed output's settled updates."""
        staged: list[dict[str, Any]] = []
        with path.step(Step.STAGED, out.slot):
            if replacing:
                extra = self.resnapshots.correction(b, out, cur, keys)
                staged += self._stage_rows(out, "resnap", extra)
            if intents and keys is not None:
                if faults.take("damage_keys"):
                    keys.store.damage()
                for updates in self.keyed.settle(out, keys, KeyedIntents.merged(intents)):
                    staged += self._stage_rows(out, "upsert", updates)
        return staged

    def _commit(self, path: CommitPath, out: OutputRuntime, staged: list[dict[str, Any]],
                cur: SinkState, new: SinkState) -> None:
        """COMMITTED: the staged data and ``new``, one atomic sink commit
        fenced on ``cur``, under the driver lock."""
        with path.step(Step.COMMITTED, out.slot):
            faults.fail_point("commit")
            if self.site.lock is not None:
                self.site.lock.require()  # no sink commits without the driver lock
            out.sink.commit(staged, cur, new)

    def _save(self, path: CommitPath, out: OutputRuntime, keys: UpsertState | None,
              new: SinkState) -> None:
        """SAVED: a keyed output's key state is that of ``new`` now."""
        with path.step(Step.SAVED, out.slot):
            if keys is not None:
                self.keyed.save(out, keys, new)

    def _advance(self, path: CommitPath, out: OutputRuntime, new: SinkState,
                 reached: Antichain[Any], results: list[TaskResult], replacing: bool) -> None:
        """ADVANCED: the driver holds ``out`` at ``new``."""
        site = self.site
        with path.step(Step.ADVANCED, out.slot):
            out.state = new
            if replacing:
                self.ledger.replace(out.key, new)
                self.resnapshots.done(out)
            rows = sum(r.rows.get(out.slot, 0) for r in results)
            errors = sum(r.errors.get(out.slot, 0) for r in results)
            out.rows += rows
            out.errors += errors
            self.shapes.count_dropped(out, results)
            out.failures = 0
            if out.index not in self._gone:
                out.health = Health(RUNNING, since_ms=site.clock.now())
            site.events.log(site.name, "sink_upper", output=out.name,
                            **({"sink": out.sink_name} if out.several else {}), upper=new.upper,
                            progress=reached.encode(), rows=rows, errors=errors)

    def _stage_rows(self, out: OutputRuntime, what: str, table: pa.Table
                    ) -> list[dict[str, Any]]:
        """Stage rows the driver made for ``out`` (``what``: upsert updates, a
        re-snapshot's correction), at the ``stage`` failure point; nothing for
        no rows."""
        if not table.num_rows:
            return []
        faults.fail_point("stage")
        return out.sink.stager().stage(
            f"{self.site.clock.now()}-{what}-{uuid.uuid4().hex[:10]}", 0, table)

    def resume_and_acknowledge(self, tick: int, b: Bindings[Any]) -> None:
        """End the round: RECORDED, RESUMED, ACKNOWLEDGED (see the module).
        Without a round under way in this tick (nothing committed since the
        last acknowledgement), one of no commits."""
        site = self.site
        path = self._path
        if path is None or path.tick != tick:
            path = self.begin(tick)
        with path.step(Step.RECORDED):
            self.ledger.record((o.key, o.state) for o in site.outputs)
        with path.step(Step.RESUMED):
            resume = b.source_upper_at(resume_into(site.outputs))
            if self.resume is not None and not self.resume.less_equal(resume):
                raise AssertionError(
                    f"resumption frontier moved backwards: {self.resume} -> {resume}")
        with path.step(Step.ACKNOWLEDGED):
            if resume != self.acknowledged and site.source.acknowledge(resume) is not False:
                self.acknowledged = resume
                site.events.log(site.name, "resume", frontier=resume.encode())
                faults.crash_point("after_acknowledge")
        self.resume = resume
        self._path = None

    def upstream_gone(self) -> None:
        """Outputs whose upstream the source says is gone for good stall with
        its definite error (with an event, once per change of the error: a
        deleted topic re-created meanwhile needs another recovery); the
        others go on (a commit makes an output running again unless its
        upstream is gone)."""
        site = self.site
        gone = site.source.output_errors()
        errors = {i: str(exc.args[0] if exc.args else exc) for i, exc in gone.items()}
        for out in site.outputs:
            exc = gone.get(out.index)
            if exc is None:
                continue
            if self._gone.get(out.index) != errors[out.index]:
                log.error("source %s: output %s: %s", site.name, out.name, exc)
                site.events.log(site.name, "output_error", output=out.name, error=str(exc),
                                hint=exc.hint)
                out.health = Health(STALLED, errors[out.index], exc.hint, site.clock.now(), True)
        self._gone = errors
