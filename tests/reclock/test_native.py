"""The C extensions load on executors whose reclock packages come from the
driver's zip (``reclock.runtime.spark.package_zip``): Python cannot import an
extension from a zip, so ``reclock.clients.native`` loads the installed build."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import reclock
import reclock.sources
from reclock.runtime.spark import package_zip

PROBE = """
import json, reclock.sources as sources, reclock.contracts.decode as d, reclock.sources.kafka as k
try:
    import reclock.sources._kafka_native
    plain = True
except ImportError:
    plain = False
print(json.dumps({"sources": sources.__file__, "plain": plain,
                  "kafka": k.native_reader() is not None, "json": d.json_native is not None}))
"""


def test_extensions_load_when_a_zip_shadows_the_packages(tmp_path: Path) -> None:
    zipped = package_zip()
    names = zipfile.ZipFile(zipped).namelist()
    assert "reclock/sources/kafka.py" in names and not [n for n in names if n.endswith(".so")]
    # An executor's installed copy, as a regular (not editable) install lays it
    # out: the packages in a site directory, with their built extensions.
    site = tmp_path / "site"
    for pkg in (reclock, reclock.sources):
        src = Path(pkg.__file__ or "").parent
        dst = site / pkg.__name__.replace(".", "/")
        dst.mkdir(parents=True)
        for so in src.glob("_*_native*.so"):
            shutil.copy(so, dst / so.name)
    assert len(list(site.rglob("*.so"))) == 2, "the C extensions were not built"
    # -S: no site-packages hooks (an editable install's finder would find the
    # real tree); the zip first, as Spark puts it.
    path = [str(zipped), str(site), sysconfig.get_paths()["purelib"]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    out = subprocess.run([sys.executable, "-S", "-c", PROBE], env=env, capture_output=True,
                         text=True, check=True, cwd="/")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert str(zipped) in got["sources"]  # the zip's copy of the package was imported,
    assert not got["plain"]  # where a plain import of the extension fails,
    assert got["kafka"] and got["json"], out.stderr  # yet the extensions load
