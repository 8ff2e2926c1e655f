"""The command line as a user meets it first: version, help, and the commands
on a pipeline that never ran (no Spark involved)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PIPELINE = """
state_dir: {state}
sources:
  - name: counter
    generator: {{kind: counter}}
    outputs: [{{name: a, sink: file}}]
  - name: other
    generator: {{kind: counter}}
    outputs: [{{name: b, sink: file}}]
"""


def reclock(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reclock", *args], capture_output=True,
                          text=True, timeout=120)


def test_version_and_help_read_as_plain_text() -> None:
    out = reclock("--version")
    assert out.returncode == 0
    assert out.stdout.startswith("reclock 0.") and "PySpark 4." in out.stdout
    top = reclock("--help").stdout
    assert "``" not in top and "Exit codes:" in top
    for command in ("run", "status", "bindings", "read", "drop", "verify"):
        text = reclock(command, "--help").stdout
        # every argument and option explains itself
        assert "the pipeline's YAML file" in text, text
        for line in text.split("options:", 1)[1].splitlines():
            if line.strip().startswith("--") and "  " not in line.strip():
                raise AssertionError(f"{command}: option without help: {line!r}")


def test_commands_on_a_pipeline_that_never_ran(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(state=tmp_path / "state"))
    status = reclock("status", str(path))
    assert status.returncode == 3, status.stderr  # the driver is not running
    assert "output a: nothing committed yet" in status.stdout, status.stdout
    assert " ms" not in status.stdout  # no lag counted from the epoch
    verify = reclock("verify", str(path))
    assert verify.returncode == 0
    assert "source counter: nothing to audit yet" in verify.stdout, verify.stdout
    csv = reclock("read", str(path), "a", "b", "--csv")
    assert csv.returncode == 2 and csv.stdout == ""
    assert csv.stderr.startswith("reclock: --csv takes one output"), csv.stderr


def test_drop_and_undrop_without_a_driver(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(state=tmp_path / "state"))
    assert reclock("undrop", str(path), "counter").stderr == \
        "reclock: source 'counter' is not dropped\n"
    assert reclock("drop", str(path), "counter").returncode == 0
    assert "source counter [counter]: dropped" in reclock("status", str(path)).stdout
    undrop = reclock("undrop", str(path), "counter")
    assert undrop.returncode == 0, undrop.stderr
    assert undrop.stdout.startswith("source counter undropped: the next run resumes it")
    assert "source counter [counter]: not running" in reclock("status", str(path)).stdout


def test_status_of_a_source_whose_broker_is_unreachable(tmp_path: Path) -> None:
    """``status`` reports each source: one whose upstream cannot be reached
    says why, instead of failing the whole command."""
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(state=tmp_path / "state") + """
  - name: stuck
    kafka: {bootstrap_servers: "127.0.0.1:9", topic: nowhere, timeout: 1s}
    outputs: [{name: c, sink: file}]
""")
    status = reclock("status", str(path))
    assert status.returncode == 3, status.stderr
    assert "Traceback" not in status.stderr
    assert "source stuck [kafka]: not running" in status.stdout
    assert "  resume upper: unavailable: source 'stuck': metadata of topic 'nowhere'" in \
        status.stdout, status.stdout
    assert "source counter [counter]: not running" in status.stdout

