"""A class-data-sharing archive of the Spark driver JVM's classes, so that
the tests' many driver starts (every kill test restarts ``reclock run``
several times) start Spark in about half the time (5.0 -> 2.6 s on this
2-core machine, measured with a session and one job).

Made once per machine in the tests' cache (``RECLOCK_CACHE``): a JVM started
like a driver, with ``-XX:ArchiveClassesAtExit``, starts a session, runs a
job and stops; the archive holds the classes it loaded (about 110 MB). Every
Spark driver the tests start, in the test process or as a ``reclock run``
process, then maps it through ``SPARK_SUBMIT_OPTS`` (which the driver JVM of
local and client mode takes; ``java`` with another class path, the Kafka
brokers', never sees it). A JVM that finds the archive unusable (another
JDK, other jars) starts as it would without it. Nothing of the product
depends on it.

``python -m tests.spark_cds`` makes it ahead of time; ``RECLOCK_TEST_NO_CDS=1``
runs the tests without it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from tests.kafkabroker import cache_dir

#: cds log lines off: a dynamic archive warns about each class it skips
QUIET = "-Xlog:cds=off,cds+dynamic=off"

# Through reclock's own session builder: its SPARK_CONF_DIR heads the class
# path, which a JVM using the archive must share.
_WORKLOAD = """
from reclock.runtime.spark import spark_session
s = spark_session("local[2]", "reclock-cds")
s.sparkContext.parallelize(range(8), 2).map(lambda x: x * 2).collect()
s.range(10).selectExpr("id * 2 as x").collect()
s.stop()
"""


def archive() -> Path:
    """The archive's path: per PySpark and JDK, so that either changing
    makes a new one."""
    import pyspark

    java = subprocess.run(["java", "-version"], capture_output=True, text=True).stderr
    tag = hashlib.sha256(f"{pyspark.__version__}|{java}".encode()).hexdigest()[:12]
    return cache_dir() / f"spark-driver-{tag}.jsa"


def _env() -> dict[str, str]:
    """What a driver JVM that makes or maps the archive runs with. CDS takes
    no non-empty directory on the class path, and Spark puts SPARK_CONF_DIR
    there (reclock's own: its log4j2.properties): an empty one instead, and
    the same logging configuration named by a system property."""
    import reclock

    empty = cache_dir() / "spark-conf-empty"
    empty.mkdir(parents=True, exist_ok=True)
    log4j = Path(reclock.__file__).parent / "conf" / "log4j2.properties"
    return {"SPARK_CONF_DIR": str(empty),
            "SPARK_SUBMIT_OPTS": f"-Dlog4j2.configurationFile=file:{log4j} {QUIET}"}


def build() -> Path | None:
    """The archive, made first if missing; None when it cannot be made. The
    test run's two workers (tests/lanes.py) may both ask: one makes it while
    the other waits."""
    path = archive()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return path if path.exists() else _make(path)


def _make(path: Path) -> Path | None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    extra = _env()
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, **extra,
           "SPARK_SUBMIT_OPTS": f"{extra['SPARK_SUBMIT_OPTS']} -XX:ArchiveClassesAtExit={tmp} "
                                "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"}
    try:
        # (through pipes: the JVM writes the archive as it exits, after the
        # Python process; the pipes close only when it is done)
        subprocess.run([sys.executable, "-c", _WORKLOAD], env=env, timeout=300,
                       capture_output=True, check=True)
    except (subprocess.SubprocessError, OSError):
        tmp.unlink(missing_ok=True)
        return None
    if not tmp.exists() or tmp.stat().st_size == 0:
        return None
    tmp.replace(path)  # whole or not at all: another run may be reading it
    return path


def use() -> None:
    """Every Spark driver started from now on, here or in a child process,
    maps the archive (made first if missing); ``RECLOCK_TEST_NO_CDS=1``: not."""
    if os.environ.get("RECLOCK_TEST_NO_CDS"):
        return
    path = build()
    if path is not None:
        extra = _env()
        opts = os.environ.get("SPARK_SUBMIT_OPTS", "")
        os.environ["SPARK_CONF_DIR"] = extra["SPARK_CONF_DIR"]
        os.environ["SPARK_SUBMIT_OPTS"] = (
            f"{opts} {extra['SPARK_SUBMIT_OPTS']} -XX:SharedArchiveFile={path}").strip()


if __name__ == "__main__":
    print(build() or "the archive could not be made")
