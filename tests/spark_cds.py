"""The tests' Spark drivers map reclock's class-data-sharing archive of the
driver JVM's classes (:mod:`reclock.runtime.cds`), made ahead of the first
test instead of in the background: the tests' many driver starts (every
kill test restarts ``reclock run`` several times) start Spark in about half
the time.

Every Spark driver the tests start, in the test process or as a ``reclock
run`` process, maps it through the environment this sets (``reclock run``
then leaves the JVM's options as they are). ``python -m tests.spark_cds``
makes it ahead of time; ``RECLOCK_TEST_NO_CDS=1`` runs the tests without
it (and turns the product's default off too).
"""

from __future__ import annotations

import os
from pathlib import Path

from reclock.runtime import cds


def build() -> Path | None:
    """The archive, made first if missing; None when it cannot be made. The
    test run's two workers (tests/lanes.py) may both ask: one makes it while
    the other waits."""
    path = cds.archive_path()
    if path is None:
        return None
    return path if path.exists() else cds.make(path)


def use() -> None:
    """Every Spark driver started from now on, here or in a child process,
    maps the archive (made first if missing); ``RECLOCK_TEST_NO_CDS=1``: not."""
    if os.environ.get("RECLOCK_TEST_NO_CDS"):
        os.environ["RECLOCK_CDS"] = "off"
        return
    path = build()
    if path is not None:
        extra = cds.driver_env(path)
        opts = os.environ.get("SPARK_SUBMIT_OPTS", "")
        os.environ["SPARK_CONF_DIR"] = extra["SPARK_CONF_DIR"]
        os.environ["SPARK_SUBMIT_OPTS"] = f"{opts} {extra['SPARK_SUBMIT_OPTS']}".strip()


if __name__ == "__main__":
    print(build() or "the archive could not be made")
