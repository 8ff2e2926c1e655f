"""The driver's class-data-sharing archive (reclock.runtime.cds): the first
driver on a machine starts without one and makes it in the background; the
next driver's JVM maps it; an upgrade (another archive name) or a user's own
JVM options leave the JVM as configured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from reclock.runtime import cds
from tests.running import wait_for

#: starts a driver's session, prints what its JVM was started with and
#: which files it maps, and stops
_DRIVER = """
import json, os
from reclock.runtime.spark import spark_session
s = spark_session("local[1]", "cds-test")
jvm = s._jvm
pid = jvm.java.lang.ProcessHandle.current().pid()
maps = open(f"/proc/{pid}/maps").read()
print(json.dumps({"opts": os.environ.get("SPARK_SUBMIT_OPTS", ""),
                  "mapped": sorted({l.split()[-1] for l in maps.splitlines()
                                    if l.rstrip().endswith(".jsa")})}))
s.stop()
"""


def _driver(env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _DRIVER], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    doc: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return doc


def test_the_first_driver_makes_the_archive_and_the_next_one_maps_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPARK_SUBMIT_OPTS", "SPARK_CONF_DIR", "RECLOCK_CDS")}
    env.update({"RECLOCK_CACHE": str(tmp_path / "cache"), "PYSPARK_PYTHON": sys.executable})
    old = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env)
        path = cds.archive_path()
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert path is not None and path.is_relative_to(tmp_path / "cache")
    first = _driver(env)
    mine = [str(path)]  # (the JDK's own base archive is mapped besides)
    assert "SharedArchiveFile" not in str(first["opts"])
    assert not set(mine) & set(first["mapped"])
    wait_for(path.exists, 300, "the archive made in the background")
    assert not list(path.parent.glob("*.tmp"))  # (whole, or not at all)
    second = _driver(env)
    assert f"-XX:SharedArchiveFile={path}" in str(second["opts"])
    assert set(mine) <= set(second["mapped"]), second
    # the user's own JVM options (or RECLOCK_CDS=off) leave the JVM as configured
    third = _driver({**env, "RECLOCK_CDS": "off"})
    assert not set(mine) & set(third["mapped"]) and third["opts"] == ""
