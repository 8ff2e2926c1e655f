"""What `pip install .` puts into site-packages: one package, ``reclock``.

The repository keeps its top-level folders (``sources/``, ``sinks/``,
``remap_store/``); they install as ``reclock.sources``, ``reclock.sinks`` and
``reclock.remap_store``, so nothing generic lands next to other projects.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(ROOT)], check=True)
    (found,) = out.glob("reclock-*.whl")
    return found


def test_the_wheel_holds_one_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"reclock"}, sorted(tops)
    for module in ("reclock/sinks/delta.py", "reclock/sources/kafka.py",
                   "reclock/sources/postgres/source.py", "reclock/remap_store/sql.py",
                   "reclock/static/index.html", "reclock/sources/py.typed"):
        assert module in names, module


def test_installed_it_imports_as_reclock_only(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--target", str(site), str(wheel)], check=True)
    # only the installed copy and the third-party libraries: no checkout, no
    # editable install's finder (-S skips site's hooks; -P the current folder)
    import sysconfig

    probe = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"
             "import reclock.sinks.delta as d, reclock.sources.kafka\n"
             "assert d.__file__.startswith(sys.argv[1]), d.__file__\n"
             "import importlib.util as u\n"
             "print([m for m in ('sources', 'sinks', 'remap_store') if u.find_spec(m)])\n")
    out = subprocess.run([sys.executable, "-S", "-P", "-c", probe, str(site),
                          sysconfig.get_paths()["purelib"]],
                         capture_output=True, text=True, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
