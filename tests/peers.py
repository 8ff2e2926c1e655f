"""Other engines reading reclock's outputs, as their users run them.

* :func:`spark_reads` runs ``tests/spark_peer.py`` under the second Spark
  that ``tests/setup.sh`` installs (with delta-spark and Iceberg's Spark
  runtime), in a JVM of its own: one JVM per call, so a test gathers
  everything it asks Spark into one call.
* :func:`duckdb` is a DuckDB connection with the ``delta`` extension loaded
  from its PyPI package (DuckDB's own download of extensions needs a
  network this suite does not assume).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.kafkabroker import cache_dir

READER = Path(__file__).resolve().parent / "spark_peer.py"


def spark_reads(items: list[str], catalogs: tuple[str, ...] = (),
                s3: dict[str, str] | None = None) -> dict[str, Any]:
    """What Spark reads for each item (a Delta path, ``iceberg:<metadata>``,
    ``sql:<query>``; see tests/spark_peer.py), by item. ``catalogs``:
    ``NAME=JDBC_URL,WAREHOUSE`` Iceberg JDBC catalogs the queries may name;
    ``s3``: the S3 endpoint's environment (``tests/s3server.py``'s ``env()``)
    their ``s3://`` warehouses are read at."""
    peer = cache_dir() / "spark-peer"
    py = peer / "bin" / "python"
    if not (peer / "ready").exists():
        pytest.fail(f"the Spark peer is not in {peer}: run `bash tests/setup.sh`")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPARK_HOME")}
    env.update(PYSPARK_PYTHON=str(py), PYSPARK_DRIVER_PYTHON=str(py))
    args = [str(py), str(READER), "--ivy", str(peer / "ivy")]
    for c in catalogs:
        args += ["--catalog", c]
    if s3 is not None:
        args += ["--s3", ",".join(s3[k] for k in ("AWS_ENDPOINT_URL", "AWS_REGION",
                                                  "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))]
    done = subprocess.run([*args, *items], capture_output=True, text=True, env=env,
                          timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def duckdb() -> Any:
    """A DuckDB connection that reads Delta tables (``delta_scan``)."""
    import duckdb as db
    import duckdb_extension_delta

    found = sorted(Path(duckdb_extension_delta.__file__).parent.glob(
        f"extensions/v{db.__version__}/delta.duckdb_extension"))
    assert found, f"duckdb-extension-delta has no build for DuckDB {db.__version__}"
    conn = db.connect()
    conn.execute(f"LOAD '{found[0]}'")
    return conn


def duckdb_s3(endpoint: str, key_id: str, secret: str, region: str) -> Any:
    """A :func:`duckdb` connection that also reads ``s3://`` tables of an S3
    endpoint over plain http (moto's), through the httpfs extension (a
    PyPI package too)."""
    import duckdb as db
    import duckdb_extension_httpfs

    found = sorted(Path(duckdb_extension_httpfs.__file__).parent.glob(
        f"extensions/v{db.__version__}/httpfs.duckdb_extension"))
    assert found, f"duckdb-extension-httpfs has no build for DuckDB {db.__version__}"
    conn = duckdb()
    conn.execute(f"LOAD '{found[0]}'")
    host = endpoint.removeprefix("http://")
    conn.execute(f"CREATE SECRET (TYPE s3, KEY_ID '{key_id}', SECRET '{secret}', "
                 f"REGION '{region}', ENDPOINT '{host}', URL_STYLE 'path', USE_SSL false)")
    return conn
