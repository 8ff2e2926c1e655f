"""A class-data-sharing archive of the Spark driver JVM's classes.

Most of a driver's start-up is the JVM loading and verifying Spark's classes
(about 2.5 s of the 5 s a session takes to start on a 2-core machine). A
dynamic CDS archive (JDK 13 and later) holds those classes as the JVM left
them, and a JVM that maps it starts in about half the time.

The driver uses one by default:

* it lives in the user's cache (``$XDG_CACHE_HOME/reclock/cds``, else
  ``~/.cache/reclock/cds``; ``RECLOCK_CACHE`` overrides the base), one file
  per combination of PySpark (its version and jars) and JDK (the ``java``
  binary and its modification time): a new Spark or JDK makes a new one;
* the first driver that finds none starts without it and makes it in the
  background, in a separate low-priority process that starts a small session
  like a driver's, with ``-XX:ArchiveClassesAtExit`` (written to a temporary
  file, renamed once whole: a killed build leaves nothing half-made);
* later drivers map it through ``SPARK_SUBMIT_OPTS``, which the driver JVM of
  ``local`` and client mode takes.

CDS refuses a non-empty directory on the class path, and Spark puts
``SPARK_CONF_DIR`` there: a driver that maps an archive gets an empty conf
directory and reclock's logging configuration by system property instead.
A JVM that finds the archive unusable (other jars, another JDK) starts as it
would without it, silently. ``RECLOCK_CDS=off``, or a ``SPARK_SUBMIT_OPTS``
or ``SPARK_CONF_DIR`` the user set, leaves the JVM as configured. Nothing
the driver does depends on the archive: it only starts faster.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

#: cds log lines off: a dynamic archive warns about each class it skips
QUIET = "-Xlog:cds=off,cds+dynamic=off"

#: What the archive's maker runs: a session through reclock's own builder (the
#: same class path as a driver's), one Python job and one SQL job, then stop.
_WORKLOAD = """
from reclock.runtime.spark import spark_session
s = spark_session("local[2]", "reclock-cds")
s.sparkContext.parallelize(range(8), 2).map(lambda x: x * 2).collect()
s.range(10).selectExpr("id * 2 as x").collect()
s.stop()
"""


def cache_base() -> Path:
    """reclock's cache directory in the user's home (``RECLOCK_CACHE``, else
    ``$XDG_CACHE_HOME/reclock``, else ``~/.cache/reclock``)."""
    if os.environ.get("RECLOCK_CACHE"):
        return Path(os.environ["RECLOCK_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "reclock"


def _java() -> Path | None:
    """The ``java`` binary Spark's launcher runs (JAVA_HOME's, else PATH's)."""
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    return Path(found).resolve() if found and Path(found).exists() else None


def archive_path() -> Path | None:
    """The archive for this PySpark and JDK (None: no ``java`` found). The
    name changes with either, so an upgrade makes a new archive instead of
    mapping a stale one; computed from file names and times only (no JVM
    is started to ask its version)."""
    java = _java()
    if java is None:
        return None
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    listing = sorted(p.name for p in jars.glob("*.jar")) if jars.is_dir() else []
    ident = "|".join([pyspark.__version__, str(java), str(java.stat().st_mtime_ns), *listing])
    tag = hashlib.sha256(ident.encode()).hexdigest()[:12]
    return cache_base() / "cds" / f"spark-driver-{tag}.jsa"


def _log4j() -> Path:
    return Path(__file__).resolve().parent.parent / "conf" / "log4j2.properties"


def _empty_conf() -> Path:
    empty = cache_base() / "cds" / "spark-conf-empty"
    empty.mkdir(parents=True, exist_ok=True)
    return empty


def driver_env(archive: Path) -> dict[str, str]:
    """The environment a driver JVM maps ``archive`` with (see the module)."""
    return {"SPARK_CONF_DIR": str(_empty_conf()),
            "SPARK_SUBMIT_OPTS": f"-Dlog4j2.configurationFile=file:{_log4j()} {QUIET} "
                                 f"-XX:SharedArchiveFile={archive}"}


def enabled(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether the driver may use an archive: not turned off, and the user
    set neither the JVM's options nor Spark's conf directory."""
    return (environ.get("RECLOCK_CDS", "on").lower() not in ("off", "0", "false", "no")
            and "SPARK_SUBMIT_OPTS" not in environ and "SPARK_CONF_DIR" not in environ)


def prepare() -> Path | None:
    """Before the driver's JVM starts: map the archive if there is one
    (setting this process's environment, which the JVM inherits). Returns
    the archive to make after the session started (None: mapped, or none
    can be made here)."""
    if not enabled():
        return None
    path = archive_path()
    if path is None:
        return None
    if path.exists():
        os.environ.update(driver_env(path))
        return None
    return path


def make_in_background(path: Path) -> subprocess.Popen[bytes] | None:
    """Start making ``path`` in a separate, low-priority process (None: one
    is already being made, or it cannot start). It outlives nothing: it runs
    one small session and exits."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_suffix(".lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None  # another driver is making it
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    log.info("making a class-data-sharing archive of the Spark driver's classes at %s "
             "(in the background: later starts are about 2 s faster)", path)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "reclock.runtime.cds", "make", str(path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, env={k: v for k, v in os.environ.items()
                                         if k not in ("SPARK_CONF_DIR", "SPARK_SUBMIT_OPTS")})
    except OSError:
        return None


def make(path: Path, timeout_s: float = 300) -> Path | None:
    """Make ``path`` now, in this process's child JVM (None: it could not be
    made). Under a file lock: two makers never race, and one that finds it
    made returns it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        env = {k: v for k, v in os.environ.items()
               if k not in ("SPARK_CONF_DIR", "SPARK_SUBMIT_OPTS")}
        env.update({"PYSPARK_PYTHON": sys.executable, "SPARK_CONF_DIR": str(_empty_conf()),
                    "SPARK_SUBMIT_OPTS": f"-Dlog4j2.configurationFile=file:{_log4j()} {QUIET} "
                                         f"-XX:ArchiveClassesAtExit={tmp} "
                                         "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"})
        try:
            # (through pipes: the JVM writes the archive as it exits, after
            # the Python process; the pipes close only when it is done)
            subprocess.run([sys.executable, "-c", _WORKLOAD], env=env, timeout=timeout_s,
                           capture_output=True, check=True)
        except (subprocess.SubprocessError, OSError) as exc:
            log.info("the class-data-sharing archive could not be made: %s", exc)
            tmp.unlink(missing_ok=True)
            return None
        if not tmp.exists() or tmp.stat().st_size == 0:
            tmp.unlink(missing_ok=True)
            return None
        tmp.replace(path)  # whole or not at all: a driver may be mapping it
        return path


def _main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "make":
        with contextlib.suppress(OSError):
            os.nice(19)
        return 0 if make(Path(argv[1])) is not None else 1
    sys.stderr.write("usage: python -m reclock.runtime.cds make PATH\n")
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
