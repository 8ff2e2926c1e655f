"""The commit path as a state machine (reclock/runtime/commit.py): each step
is checked at its entry, so a step taken out of order is a bug raised at
once (:class:`OutOfOrder`), never a commit, key state or acknowledgement
that silently runs ahead of what it rests on. And a running driver takes
every step, in order, for every output and round."""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path

import pytest

from reclock.config import load_config
from reclock.pipeline import run
from reclock.runtime.commit import (
    OUTPUT_STEPS,
    SOURCE_STEPS,
    CommitPath,
    OutOfOrder,
    Step,
)
from reclock.verify import verify_pipeline
from tests.running import counter_source


def _output(path: CommitPath, output: int, steps: tuple[Step, ...] = OUTPUT_STEPS) -> None:
    for step in steps:
        with path.step(step, output):
            pass


def _source(path: CommitPath, steps: tuple[Step, ...] = SOURCE_STEPS) -> None:
    for step in steps:
        with path.step(step):
            pass


def test_a_round_in_order_closes() -> None:
    path = CommitPath("s", tick=3)
    assert not path.closed
    _output(path, 0)
    _output(path, 2)  # outputs the round skips (nothing to commit) take no step
    assert path.at(0) == path.at(2) == (Step.ADVANCED, True) and path.at(1) is None
    _source(path)
    assert path.closed
    # a round of no commits (the end of a tick that read nothing new) too
    empty = CommitPath("s", tick=3, number=2)
    _source(empty)
    assert empty.closed


@pytest.mark.parametrize("skipped", range(1, len(OUTPUT_STEPS)))
def test_an_output_step_before_the_one_before_it_raises(skipped: int) -> None:
    """Skipping a step (committing without staging, saving the key state of
    a version not committed, advancing past a key state not saved) raises
    at the entry of the step after it, naming the round and the output."""
    path = CommitPath("s", tick=7)
    _output(path, 0, OUTPUT_STEPS[:skipped - 1])
    step = OUTPUT_STEPS[skipped]
    with pytest.raises(OutOfOrder, match=rf"tick 7 of source 's'.*output 0 entered {step.name}"):
        path.enter(step, 0)
    assert path.at(0) == (None if skipped == 1 else (OUTPUT_STEPS[skipped - 2], True))


def test_a_step_taken_twice_raises() -> None:
    path = CommitPath("s", tick=1)
    _output(path, 0, OUTPUT_STEPS[:2])
    with pytest.raises(OutOfOrder, match="COMMITTED"):  # a second sink commit of one round
        path.enter(Step.COMMITTED, 0)
    _output(path, 0, OUTPUT_STEPS[2:])
    _source(path)
    with pytest.raises(OutOfOrder, match="ACKNOWLEDGED"):
        path.enter(Step.ACKNOWLEDGED)


def test_a_failed_step_leaves_its_output_where_it_was() -> None:
    """A sink commit that fails: its output goes no further in the round,
    and the source neither records, resumes nor acknowledges over it."""
    path = CommitPath("s", tick=1)
    _output(path, 0)
    _output(path, 1, OUTPUT_STEPS[:1])
    with pytest.raises(RuntimeError), path.step(Step.COMMITTED, 1):
        raise RuntimeError("the sink went away")
    assert path.at(1) == (Step.COMMITTED, False)
    with pytest.raises(OutOfOrder, match="SAVED"):
        path.enter(Step.SAVED, 1)
    with pytest.raises(OutOfOrder, match=r"RECORDED while outputs 1 \(at COMMITTED, begun\)"):
        path.enter(Step.RECORDED)
    assert not path.closed


def test_the_source_steps_wait_for_every_output_and_for_each_other() -> None:
    path = CommitPath("s", tick=1)
    _output(path, 0)
    _output(path, 1, OUTPUT_STEPS[:2])  # committed; its key state not saved yet
    with pytest.raises(OutOfOrder, match=r"RECORDED while outputs 1 \(at COMMITTED, done\)"):
        path.enter(Step.RECORDED)
    _output(path, 1, OUTPUT_STEPS[2:])
    for later in SOURCE_STEPS[1:]:  # a resumption frontier the ledger did not record first, ...
        with pytest.raises(OutOfOrder, match=later.name):
            path.enter(later)
    _source(path, SOURCE_STEPS[:1])
    with pytest.raises(OutOfOrder, match="ACKNOWLEDGED"):  # acknowledged before it was computed
        path.enter(Step.ACKNOWLEDGED)
    _source(path, SOURCE_STEPS[1:2])
    with pytest.raises(OutOfOrder, match="output 2 entered STAGED after the source's RESUMED"):
        path.enter(Step.STAGED, 2)
    _source(path, SOURCE_STEPS[2:])
    assert path.closed


def test_a_step_is_taken_by_its_own_party() -> None:
    path = CommitPath("s", tick=1)
    with pytest.raises(OutOfOrder, match="per output"):
        path.enter(Step.STAGED)
    with pytest.raises(OutOfOrder, match="by the source"):
        path.enter(Step.RESUMED, 0)
    with pytest.raises(OutOfOrder, match="completed"):  # completing a step never entered
        path.completed(Step.STAGED, 0)


def test_out_of_order_is_a_bug() -> None:
    """Not a TransientError or DefiniteError: the run loop logs it as a bug."""
    from reclock.core.errors import classified

    assert issubclass(OutOfOrder, AssertionError)
    assert not classified(OutOfOrder("x"))


PIPELINE = """
timestamp_interval: 100ms
sources:
{counter}
  - name: shop
    generator: {{kind: orders, rate: 1500, max_records: 1500, seed: 5}}
    outputs:
      - {{name: customers, sink: file}}
      - {{name: orders, sink: file}}
"""


def test_a_running_driver_takes_every_step_in_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sources, one with keyed outputs (settled and saved key state), run
    to the end: every round of each source's path is its outputs' steps in
    order, then the source's, and nothing raised out of order."""
    from reclock.runtime import commit

    taken: dict[tuple[str, int, int], list[tuple[Step, int | None]]] = defaultdict(list)
    enter = commit.CommitPath.enter

    def noted(self: CommitPath, step: Step, output: int | None = None) -> None:
        enter(self, step, output)  # (raises out of order: the run shows it)
        taken[self.source, self.tick, self.number].append((step, output))

    monkeypatch.setattr(commit.CommitPath, "enter", noted)
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE.format(counter=counter_source(1500, 1500, 97)))
    cfg = load_config(path)
    runners = run(cfg, use_spark=False, out=None, install_signals=False, duration=120)
    assert [r.health.status for r in runners] == ["finished", "finished"], [
        r.status() for r in runners]
    errors = [e for r in runners for e in r.events.recent
              if e["kind"] == "health" and e.get("error")]
    assert not errors, errors
    assert all(rep.ok for rep in verify_pipeline(cfg))
    committed = defaultdict(int)
    for (source, _, _), steps in taken.items():
        *outputs, recorded, resumed, acknowledged = steps
        assert [recorded[0], resumed[0], acknowledged[0]] == list(SOURCE_STEPS), steps
        by_output = defaultdict(list)
        for step, output in outputs:
            assert output is not None, steps
            by_output[output].append(step)
        assert all(s == list(OUTPUT_STEPS) for s in by_output.values()), steps
        # each output once per round, one after the other
        order = [o for o, _ in itertools.groupby(o for _, o in outputs)]
        assert len(order) == len(set(order)), steps
        committed[source] += len(by_output)
    # both sources committed, the keyed outputs of shop too
    assert committed["counter"] > 0 and committed["shop"] > 1, dict(committed)
