"""The Spark session the driver runs its data plane on.

``local[*]`` is the embedded default; any ``spark://host:port`` master works
unchanged. Python workers must run the same interpreter as the driver, so
``PYSPARK_PYTHON`` is set to it unless the user chose one. Sources share the
session; each runs its jobs in its own FAIR scheduler pool, so one heavy
source cannot starve a light one.

On a cluster (any master but ``local``) the driver ships its own copy of
reclock's packages to the executors (``addPyFile`` of a zip built from the
imported modules), so executors run exactly the driver's code; they still
need the third-party libraries (pyarrow, confluent-kafka, psycopg, ...)
installed, as in the project's Docker image. Nothing in the data plane reads
driver-local files: tasks get everything in the broadcast job context, and
sinks stage to the output's own location (which must therefore be shared
storage when executors run on other machines).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import tempfile
import threading
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

DEFAULTS: dict[str, str] = {
    "spark.scheduler.mode": "FAIR",
    "spark.ui.showConsoleProgress": "false",
    "spark.ui.enabled": "false",
    "spark.python.worker.reuse": "true",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    # Tasks are retried by the driver's own loop (exactly once through sink
    # fencing); a few task-level retries still absorb a lost executor.
    "spark.task.maxFailures": "4",
    # The driver JVM only schedules Python tasks: C1-compiled code is fast
    # enough, and C2 compilation cost ~0.3 of 2 cores during a run (and
    # start-up time). Setting spark.driver.extraJavaOptions replaces this.
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1",
}


def spark_session(
    master: str = "local[*]",
    app_name: str = "reclock",
    conf: Mapping[str, str] | None = None,
) -> Any:
    """Get or create the process's SparkSession with reclock's defaults; the
    driver JVM maps a class-data-sharing archive of Spark's classes, made
    in the background by the first driver that finds none
    (:mod:`reclock.runtime.cds`)."""
    from reclock.runtime import cds

    pending = cds.prepare()
    os.environ.setdefault("SPARK_CONF_DIR", str(Path(__file__).parent.parent / "conf"))
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName(app_name)
    merged = {**DEFAULTS, **(conf or {})}
    for k, v in merged.items():
        builder = builder.config(k, v)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel(merged.get("reclock.log_level", "ERROR"))
    if pending is not None:
        cds.make_in_background(pending)
    if not master.startswith("local"):
        # Executors in other processes (or on other machines) import this
        # very code: ship it, so that driver and executors never differ.
        session.sparkContext.addPyFile(str(package_zip()))
    return session


class EarlySession:
    """A session started in a background thread while the driver reads and
    checks its configuration, imports its plug-ins and opens its sources:
    the JVM's start (seconds) overlaps that work instead of following it.
    ``(master, app_name, conf)`` come from an unvalidated read of the file
    (:func:`reclock.config.loader.spark_view`); :meth:`take` hands the
    session over only if the validated configuration names the same.

    The thread is a daemon, and Spark's JVM exits when this process does
    (it watches its standard input), so a driver that stops before taking
    the session (a configuration error, an interrupt) leaves nothing behind.
    Started outside the main thread, PySpark installs no SIGINT handler."""

    def __init__(self, master: str, app_name: str, conf: Mapping[str, str]) -> None:
        self.args = (master, app_name, dict(conf))
        self._session: Any = None
        self._failed = False
        self._thread = threading.Thread(target=self._start, name="reclock-spark-start",
                                        daemon=True)
        self._thread.start()

    def _start(self) -> None:
        try:
            self._session = spark_session(*self.args)
        except BaseException:  # (the driver's own start reports what went wrong)
            self._failed = True

    def take(self, master: str, app_name: str, conf: Mapping[str, str]) -> Any | None:
        """The session, once started, if it was started as the validated
        configuration asks; otherwise None (a session started otherwise is
        stopped first, so that the caller's start makes a new one)."""
        self._thread.join()
        if self._failed or self._session is None:
            return None
        if (master, app_name, dict(conf)) == self.args:
            return self._session
        self._session.stop()
        self._session = None
        return None


#: the FAIR pool and job group of :func:`warm_workers`' job
WARM_POOL = "reclock-warmup"


class WarmWorkers:
    """Spark's Python workers started now, in a background job of one task
    per core that imports ``modules`` (the data plane, the pipeline's
    connectors and sinks), instead of in the first job of the first source:
    a cold worker (Python's start, PySpark's daemon, the imports) takes
    about a second, which would otherwise delay the first durable data by
    as much. Workers are reused (``spark.python.worker.reuse``), so the
    sources' tasks run in the warmed ones. The job runs while the sources
    open and wait for their first binding; it never fails the driver.
    ``RECLOCK_WARM_WORKERS=off``: no such job.

    A driver that stops calls :meth:`wait` first: a task of the job that
    ends after this process has gone leaves Spark's JVM unable to report
    it (an error on stderr)."""

    def __init__(self, session: Any, modules: Sequence[str]) -> None:
        self.sc = session.sparkContext
        self.names = tuple(modules)
        if os.environ.get("RECLOCK_WARM_WORKERS", "on").lower() in ("off", "0", "false", "no"):
            self.names = ()
        self._thread = threading.Thread(target=self._run, name="reclock-warm-workers",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if not self.names:
            return
        sc = self.sc
        try:
            sc.setLocalProperty("spark.scheduler.pool", WARM_POOL)
            sc.setJobGroup(WARM_POOL, "reclock: starting the Python workers")
            n = max(1, sc.defaultParallelism)
            sc.parallelize(range(n), n).foreach(_ImportAll(self.names))
        except Exception as exc:  # (a stopped session, a worker that cannot start)
            logging.getLogger(__name__).debug("warming Spark's Python workers: %s", exc)

    def wait(self, timeout_s: float = 30.0) -> None:
        """Until the job ended (cancelled after ``timeout_s``; then a little
        longer, for its tasks to report)."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self.sc.cancelJobGroup(WARM_POOL)
            self._thread.join(5.0)


def warm_workers(session: Any, modules: Sequence[str]) -> WarmWorkers:
    """Start :class:`WarmWorkers` (see there)."""
    return WarmWorkers(session, modules)


class _ImportAll:
    """A task's function: import the named modules (shipped by reference)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def __call__(self, _item: object) -> None:
        for name in self.names:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)


_ZIP: Path | None = None


def package_zip() -> Path:
    """A zip of the reclock package as imported by this process (built once)."""
    global _ZIP
    if _ZIP is not None and _ZIP.exists():
        return _ZIP
    root = Path(tempfile.mkdtemp(prefix="reclock-pyfiles-"))
    target = root / "reclock_packages.zip"
    import importlib

    pkg = Path(importlib.import_module("reclock").__file__ or "").parent
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as z:
        # (a checkout links reclock/sources, sinks and remap_store to the
        # top-level folders: followed, so that the zip holds them)
        for folder, dirs, files in os.walk(pkg, followlinks=True):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                f = Path(folder) / name
                # (C extensions cannot load from a zip: executors load their
                # installed build instead, see reclock.clients.native)
                if f.suffix not in (".pyc", ".so", ".pyd"):
                    z.write(f, str(Path("reclock") / f.relative_to(pkg)))
    _ZIP = target
    return target
