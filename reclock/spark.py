"""The Spark session the driver runs its data plane on.

``local[*]`` is the embedded default; any ``spark://host:port`` master works
unchanged. Python workers must run the same interpreter as the driver, so
``PYSPARK_PYTHON`` is set to it unless the user chose one. Sources share the
session; each runs its jobs in its own FAIR scheduler pool, so one heavy
source cannot starve a light one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
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
}


def spark_session(
    master: str = "local[*]",
    app_name: str = "reclock",
    conf: Mapping[str, str] | None = None,
) -> Any:
    """Get or create the process's SparkSession with reclock's defaults."""
    os.environ.setdefault("SPARK_CONF_DIR", str(Path(__file__).parent / "conf"))
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName(app_name)
    merged = {**DEFAULTS, **(conf or {})}
    for k, v in merged.items():
        builder = builder.config(k, v)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel(merged.get("reclock.log_level", "ERROR"))
    return session
