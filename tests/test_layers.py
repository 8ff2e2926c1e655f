"""The layers hold: the import contracts of pyproject.toml ([tool.importlinter])
pass on the code, and they are not vacuous: a copy of the package with an
import running back up, a plug-in importing another, or a top-level
``sinks`` import breaks them, each named in the report."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "pyproject.toml"
LINT = ("import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())")


def lint(pythonpath: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the project's contracts, on the ``reclock``
    package found first on ``pythonpath``."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([sys.executable, "-c", LINT, "--no-cache", str(CONFIG)],
                          env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_layers_hold(tmp_path: Path) -> None:
    out = lint(REPO, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_an_import_running_back_up_breaks_them(tmp_path: Path) -> None:
    # the package as installed (the symlinked folders followed)
    copy = tmp_path / "site"
    shutil.copytree(REPO / "reclock", copy / "reclock", symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    breaches = {
        "core/mint.py": "from reclock.remap_store.sql import SqlRemapStore",
        "contracts/sink.py": "from reclock.runtime.health import Health",
        "sinks/console.py": "import reclock.sinks.kafka",
        "runtime/health.py": "import sinks",
    }
    for module, line in breaches.items():
        with (copy / "reclock" / module).open("a") as f:
            f.write(f"\n{line}  # noqa\n")
    out = lint(copy, tmp_path)
    report = out.stdout
    assert out.returncode != 0, report
    assert "reclock.core is not allowed to import reclock.remap_store" in report
    assert "reclock.core.mint -> reclock.remap_store.sql" in report
    assert "reclock.contracts is not allowed to import reclock.runtime" in report
    assert "reclock.sinks.console is not allowed to import reclock.sinks.kafka" in report
    assert "reclock.runtime.health -> sinks" in report
