"""Plug-ins are found, not imported: the registry of entry points.

A third-party sink, a distribution of its own built and installed here (one
module, one entry point, written against reclock.contracts only), takes a
generator's records through ``reclock run`` without a line of reclock
changed; what it committed is compared with the records the generator is
known to make. The registry refuses two plug-ins answering to one name,
naming both distributions, and a reclock whose own plug-ins are not
registered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reclock.registry import OWN, Declaration, PluginError, build, installed, registry

REPO = Path(__file__).resolve().parents[1]

#: The sink: committed updates appended to a JSON-lines file, the upper and
#: progress beside it in a state file that also says how many bytes of the
#: data file are committed (a crash between the two leaves a tail that the
#: next commit cuts off: data and state move together).
JSONL_SINK = '''
"""A JSON-lines sink for reclock: one module, one entry point."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa

from reclock.contracts.encoding import from_json, py_rows, to_json
from reclock.contracts.rows import conform, output_schema
from reclock.contracts.sink import (
    SinkConfigBase,
    SinkContext,
    SinkFenced,
    SinkPlugin,
    SinkState,
)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class JsonlStager:
    """Executor side: each staged part one JSON-lines file, replaced when
    staged again."""

    def __init__(self, staging: str) -> None:
        self.staging = staging

    def screen(self, table: pa.Table) -> pa.Table:
        return table  # every row is JSON-able

    def stage(self, batch_id: str, part: int, table: pa.Table) -> list[dict[str, Any]]:
        os.makedirs(self.staging, exist_ok=True)
        name = f"{batch_id}-{part}.jsonl"
        types = {f.name: f.type for f in table.schema}
        lines = [json.dumps({k: to_json(v, types[k]) for k, v in row.items()}) + "\\n"
                 for row in py_rows(table)]
        data = "".join(lines).encode()
        _write_atomically(Path(self.staging) / name, data)
        errors = table.num_rows - table.column("_error").null_count
        return [{"path": name, "size": len(data), "rows": table.num_rows, "errors": errors}]


class JsonlSink:
    """Driver side: ``data.jsonl`` and ``state.json`` in ``path``."""

    holds_state = False

    def __init__(self, name: str, path: Path, staging: Path) -> None:
        self.name = name
        self.path = path
        self.staging = staging
        self.schema: pa.Schema | None = None

    def _state(self) -> dict[str, Any]:
        try:
            return json.loads((self.path / "state.json").read_text())
        except FileNotFoundError:
            return {"upper": 0, "progress": None, "bytes": 0}

    def ensure(self, user_schema: pa.Schema) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.schema = output_schema(user_schema)

    def state(self) -> SinkState:
        doc = self._state()
        return SinkState(doc["upper"], doc["progress"])

    def stager(self) -> JsonlStager:
        return JsonlStager(str(self.staging))

    def commit(self, staged: list[dict[str, Any]], expected: SinkState,
               new: SinkState) -> None:
        doc = self._state()
        if SinkState(doc["upper"], doc["progress"]) != expected:
            raise SinkFenced(f"output {self.name!r}: state is not {expected}")
        data = b"".join((self.staging / d["path"]).read_bytes() for d in staged)
        with open(self.path / "data.jsonl", "ab") as f:
            f.truncate(doc["bytes"])  # an uncommitted tail goes
            f.seek(doc["bytes"])
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        state = {"upper": new.upper, "progress": new.progress, "bytes": doc["bytes"] + len(data)}
        _write_atomically(self.path / "state.json", json.dumps(state).encode())
        for d in staged:
            (self.staging / d["path"]).unlink(missing_ok=True)

    def read_updates(self, as_of: int | None = None) -> pa.Table:
        assert self.schema is not None, "ensure() first"
        committed = self._state()["bytes"]
        try:
            with open(self.path / "data.jsonl", "rb") as f:
                text = f.read(committed).decode()
        except FileNotFoundError:
            text = ""
        types = {f.name: f.type for f in self.schema}
        rows = [{k: from_json(v, types[k]) for k, v in json.loads(line).items()}
                for line in text.splitlines()]
        rows = [r for r in rows if as_of is None or r["_into_time"] <= as_of]
        return conform(self.name, pa.Table.from_pylist(rows), self.schema)

    def vacuum_orphans(self, grace_seconds: float) -> list[str]:
        gone = []
        if self.staging.exists():
            for f in self.staging.iterdir():
                if time.time() - f.stat().st_mtime > grace_seconds:
                    f.unlink(missing_ok=True)
                    gone.append(f.name)
        return gone

    def maintain(self, now_ms: int) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


class JsonlSinkConfig(SinkConfigBase):
    """``sink: {type: jsonl, path: ...}``"""

    type: Literal["jsonl"] = "jsonl"
    path: str

    TARGET = "path"

    @classmethod
    def target_of(cls, raw: Any) -> tuple[str, ...] | None:
        path = raw.get("path")
        return ("jsonl", os.path.normpath(path)) if isinstance(path, str) else None

    def build(self, ctx: SinkContext) -> JsonlSink:
        staging = Path(ctx.state_dir) / "jsonl-staging" / ctx.source / ctx.output
        return JsonlSink(ctx.name, Path(self.path), staging)


PLUGIN = SinkPlugin(name="jsonl", config=JsonlSinkConfig)
'''


def distribution(root: Path, name: str, module: str, code: str, group: str, entry: str) -> Path:
    """A distribution of one module whose entry point ``entry`` (in ``group``)
    names the module's ``PLUGIN``."""
    root.mkdir(parents=True)
    (root / f"{module}.py").write_text(code)
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{name}"
        version = "0.1"

        [project.entry-points."{group}"]
        {entry} = "{module}:PLUGIN"

        [tool.setuptools]
        py-modules = ["{module}"]
        """))
    return root


def install(dist: Path, site: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(dist)],
                   check=True, capture_output=True, text=True, timeout=300)


def env_with(site: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}


@pytest.mark.integration
def test_a_third_party_sink_takes_a_pipeline_without_changing_reclock(tmp_path: Path) -> None:
    site = tmp_path / "site"
    install(distribution(tmp_path / "dist", "reclock-jsonl-sink", "reclock_jsonl", JSONL_SINK,
                         "reclock.sinks", "jsonl"), site)
    out = tmp_path / "out"
    records = 3000
    (tmp_path / "pipeline.yaml").write_text(textwrap.dedent(f"""
        timestamp_interval: 200ms
        spark: {{master: "local[2]"}}
        sources:
          - name: counter
            generator: {{kind: counter, rate: 3000, max_records: {records}}}
            outputs:
              - name: value
                format: {{type: json, schema: {{n: int64, even: bool}}}}
                sink: {{type: jsonl, path: {json.dumps(str(out))}}}
        """))
    run = subprocess.run([sys.executable, "-m", "reclock", "run", "pipeline.yaml"],
                         cwd=tmp_path, env=env_with(site), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    state = json.loads((out / "state.json").read_text())
    assert state["upper"] is None  # the generator finished: the output is closed
    lines = (out / "data.jsonl").read_bytes()[:state["bytes"]].decode().splitlines()
    rows = [json.loads(line) for line in lines]
    # the generator's records: n = 0 .. records - 1, once each, even = n is even
    assert sorted(r["n"] for r in rows) == list(range(records))
    assert all(r["even"] == (r["n"] % 2 == 0) for r in rows)
    assert all(r["_diff"] == 1 and r["_error"] is None for r in rows)
    assert len({r["_into_time"] for r in rows}) > 1  # committed over several bindings
    # and the distribution is not reclock's: the registry says whose it is
    probe = subprocess.run(
        [sys.executable, "-c", "from reclock.registry import registry; "
         "print(registry().sinks.dist_of('jsonl'))"],
        env=env_with(site), capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "reclock-jsonl-sink"


@pytest.mark.unit
def test_two_plugins_answering_to_one_name_are_refused_naming_both(tmp_path: Path) -> None:
    # a distribution whose sink calls itself "file": the Delta sink's alias
    clash = JSONL_SINK.replace('Literal["jsonl"] = "jsonl"', 'Literal["file"] = "file"').replace(
        'SinkPlugin(name="jsonl"', 'SinkPlugin(name="file"')
    site = tmp_path / "site"
    install(distribution(tmp_path / "dist", "clashing-sink", "clashing_sink", clash,
                         "reclock.sinks", "file"), site)
    (tmp_path / "pipeline.yaml").write_text(
        "sources: [{name: s, generator: {kind: counter}, outputs: [{name: o, sink: console}]}]\n")
    out = subprocess.run([sys.executable, "-m", "reclock", "run", "pipeline.yaml"],
                         cwd=tmp_path, env=env_with(site), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert ("two plug-ins of reclock.sinks answer to 'file': 'delta' of distribution "
            "'reclock' and 'file' of distribution 'clashing-sink'") in out.stderr, out.stderr


@pytest.mark.unit
def test_reclock_own_plugins_missing_is_a_definite_error() -> None:
    others = [d for d in installed() if d.dist != OWN]
    with pytest.raises(PluginError, match=r"pip install -e \.") as info:
        build(others)
    assert "reclock's own plug-ins are not registered" in str(info.value)


@pytest.mark.unit
def test_a_declaration_must_name_its_plugin() -> None:
    own = installed()
    wrong = [Declaration(d.group, "csv" if d.name == "json" else d.name, d.target, d.dist)
             for d in own if not (d.group == "reclock.formats" and d.name == "csv")]
    with pytest.raises(PluginError, match="the entry point is named 'csv', its plug-in 'json'"):
        build(wrong)
    broken = [*own, Declaration("reclock.sinks", "gone", "no_such_module:PLUGIN", "elsewhere")]
    with pytest.raises(PluginError) as info:
        build(broken)
    assert "plug-in 'gone' of reclock.sinks (distribution 'elsewhere'): cannot load" in str(
        info.value)


@pytest.mark.unit
def test_every_builtin_plugin_is_found_by_entry_point() -> None:
    found = registry()
    assert found.sources.names() == ("generator", "kafka", "postgres", "mysql", "oneshot")
    assert sorted(found.sinks.names()) == ["console", "delta", "iceberg", "kafka", "postgres"]
    assert found.sinks.get("file") is found.sinks.get("delta")
    assert sorted(found.formats.names()) == ["avro", "bytes", "csv", "json", "json_schema",
                                             "protobuf", "text"]
    assert sorted(found.envelopes.names()) == ["debezium", "none", "upsert"]
    assert found.remap_stores.names() == ("sql",)
    points = (found.sources, found.sinks, found.formats, found.envelopes, found.remap_stores)
    assert {f.dist for point in points for f in point.found} == {OWN}
