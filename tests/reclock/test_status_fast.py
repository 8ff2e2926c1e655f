"""``reclock status`` of a running driver reads the file without validating
it when the driver runs this very document (its status carries the file's
fingerprint): the same answer, without building every configuration model."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import reclock.cli as cli
import reclock.pipeline as pipeline
from reclock.config import load_config, loader
from reclock.config.loader import quick_view

REPO = Path(__file__).resolve().parents[2]

PIPELINE = """state_dir: ${{STATE:-{state}}}
timestamp_interval: 200ms
x-sink: &sink file
sources:
  - name: a
    generator: {{kind: counter, rate: 500}}
    outputs: [{{name: value, sink: *sink}}]
  - name: b
    generator: {{kind: orders, rate: 100}}
    outputs:
      - {{name: customers, sink: *sink}}
      - {{name: orders, sink: *sink}}
"""


@pytest.mark.unit
@pytest.mark.parametrize("name", ["quickstart.yaml", "compose/pipeline.yaml"])
def test_a_quick_view_has_the_validated_fingerprint_and_state_dir(name: str) -> None:
    env = {"POSTGRES_PASSWORD": "x", "RECLOCK_STATE_DIR": "/var/lib/reclock"}
    cfg = load_config(REPO / "examples" / name, env=env)
    view = quick_view(REPO / "examples" / name, env=env)
    assert view is not None
    assert view.fingerprint == cfg.fingerprint
    assert view.state_dir == cfg.state_dir
    assert view.sources == tuple(s.name for s in cfg.sources)


@pytest.mark.unit
def test_the_fingerprint_follows_what_validation_sees(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(state=tmp_path / "s"))
    base = quick_view(path, env={})
    assert base is not None and base.state_dir == tmp_path / "s"
    assert base.fingerprint == load_config(path, env={}).fingerprint
    # a variable's value is part of it; comments and x- keys are not
    other = quick_view(path, env={"STATE": str(tmp_path / "t")})
    assert other is not None and other.state_dir == tmp_path / "t"
    assert other.fingerprint != base.fingerprint
    path.write_text("# a comment\n" + PIPELINE.format(state=tmp_path / "s")
                    .replace("x-sink: &sink file", "x-sink: &sink file\nx-note: hello"))
    again = quick_view(path, env={})
    assert again is not None and again.fingerprint == base.fingerprint
    path.write_text("sources: [")  # broken YAML: validate (and report) instead
    assert quick_view(path, env={}) is None


def test_status_of_a_running_driver_skips_validation_and_agrees(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(state=tmp_path / "state"))
    monkeypatch.delenv("STATE", raising=False)
    cfg = load_config(path)
    ready = threading.Event()
    stop = threading.Event()
    frozen: dict[str, Any] = {}
    real_write = pipeline.write_status

    def write_once(p: Path, *args: Any, **kw: Any) -> dict[str, Any]:
        """status.json written until both runners opened, then left as it is,
        so that both answers read the same document."""
        if frozen:
            return dict(frozen)
        doc = real_write(p, *args, **kw)
        if len(doc["sources"]) == 2 and all(cli._whole(s) for s in doc["sources"]):
            frozen.update(doc)
            ready.set()
        return doc

    monkeypatch.setattr(pipeline, "write_status", write_once)
    th = threading.Thread(target=pipeline.run, args=(cfg,), kwargs=dict(
        use_spark=False, out=None, install_signals=False, stop=stop, duration=60), daemon=True)
    th.start()
    try:
        assert ready.wait(30), "the runners did not open"
        with monkeypatch.context() as m:
            m.setattr(cli, "_load", lambda f: pytest.fail("validated"))  # must not be called
            fast = cli.collect_status(str(path), history=3)
        with monkeypatch.context() as m:  # the frozen status.json stays as it is
            m.setattr(loader, "quick_view", lambda f: None)
            slow = cli.collect_status(str(path), history=3)
        # (the progress log goes on growing while the driver runs: its tail,
        # the history, may differ between the two reads)
        def without_history(doc: dict[str, Any]) -> dict[str, Any]:
            return {**doc, "sources": [{k: v for k, v in s.items() if k != "history"}
                                       for s in doc["sources"]]}

        assert without_history(fast) == without_history(slow)
        assert all(len(s["history"]) == 3 for s in fast["sources"] + slow["sources"])
        assert fast["driver_running"] and [s["source"] for s in fast["sources"]] == ["a", "b"]
        assert [o["name"] for o in fast["sources"][1]["outputs"]] == ["customers", "orders"]
        # another document than the driver's: validated as before
        path.write_text(path.read_text().replace("200ms", "300ms"))
        loaded: list[str] = []
        real_load = cli._load
        with monkeypatch.context() as m:
            m.setattr(cli, "_load", lambda f: (loaded.append(f), real_load(f))[1])
            cli.collect_status(str(path))
        assert loaded == [str(path)]
    finally:
        stop.set()
        th.join(60)


def test_status_history_holds_each_sources_own_events(tmp_path: Path) -> None:
    """``reclock status --history N``: per source, its last N events from the
    progress log, running or stopped (and only that source's)."""
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(state=tmp_path / "state"))
    pipeline.run(load_config(path, env={}), use_spark=False, out=None, install_signals=False,
                 duration=2.0)
    doc = cli.collect_status(str(path), history=4)
    assert not doc["driver_running"]
    for entry in doc["sources"]:
        hist = entry["history"]
        assert len(hist) == 4, (entry["source"], hist)
        assert {e["source"] for e in hist} == {entry["source"]}
