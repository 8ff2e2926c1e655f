"""Spark Structured Streaming ``foreachBatch`` + ``MERGE`` into a Delta or an
Iceberg table: the peer side of ``bench/state_table_bench.py`` and
``bench/iceberg_state_bench.py``.

Runs under the peer Spark's own Python (``$RECLOCK_CACHE/spark-peer``:
PySpark 4.1.4 with delta-spark 4.3.1 and iceberg-spark-runtime 1.12.0 from
its Ivy cache). ``load`` writes the table's first version (``--keys`` rows,
files of a million rows); ``merge`` streams the change files of
``--changes`` (one Parquet file per batch: ``k, v, n, op`` with ``op``
``u``/``d``/``i``, one change per key) with ``maxFilesPerTrigger: 1`` and an
``availableNow`` trigger, and MERGEs each batch into the table in
``foreachBatch``. Prints one JSON document: each batch's wall time (s) and
its row count, the query's wall time from its start to its end, and the
table's row count after it.

``--format delta`` (``--table``: the table's directory). Settings, from
Delta's documentation for MERGEs of small batches into a big table:
deletion vectors on (``delta.enableDeletionVectors``: a MERGE marks the
replaced rows instead of rewriting their files), optimized writes off
(``spark.databricks.delta.optimizeWrite.enabled``: no extra shuffle for a
batch this small), no repartition before the write
(``spark.databricks.delta.merge.repartitionBeforeWrite.enabled``), two
shuffle partitions (two cores), adaptive query execution on (the default).

``--format iceberg`` (``--table``: the warehouse directory of a Hadoop
catalog ``bench`` on local disk; the table is ``bench.db.state``). Settings,
from Iceberg's documentation of row-level operations and write distribution
(and AWS's guide to Iceberg write performance, which says the same for
streaming): format version 2 with ``write.merge.mode``, ``write.update.mode``
and ``write.delete.mode`` ``merge-on-read`` (a MERGE writes position-delete
files and new rows instead of rewriting the files it touches: the shape of
reclock's Iceberg state commits), ``write.delete.granularity`` ``file`` (one
delete file per data file it names), ``write.distribution-mode`` and
``write.merge.distribution-mode`` ``none`` (no shuffle before the write,
the mode those documents advise for streaming writes), two shuffle
partitions, adaptive query execution on, no compaction during the run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

DELTA = "io.delta:delta-spark_2.13:4.3.1"
ICEBERG = "org.apache.iceberg:iceberg-spark-runtime-4.1_2.13:1.12.0"
#: the Iceberg table (a Hadoop catalog over the warehouse ``--table``)
ICEBERG_TABLE = "bench.db.state"
#: Iceberg's settings for MERGEs of small batches (see the module docstring)
ICEBERG_PROPERTIES = {
    "format-version": "2",
    "write.merge.mode": "merge-on-read",
    "write.update.mode": "merge-on-read",
    "write.delete.mode": "merge-on-read",
    "write.delete.granularity": "file",
    "write.distribution-mode": "none",
    "write.merge.distribution-mode": "none",
    "write.update.distribution-mode": "none",
    "write.delete.distribution-mode": "none",
}


def session(ivy: str, fmt: str, warehouse: str):  # type: ignore[no-untyped-def]
    from pyspark.sql import SparkSession

    jars = sorted(glob.glob(os.path.join(ivy, "jars", "*.jar")))
    b = SparkSession.builder.master("local[2]").appName("merge-bench")
    if fmt == "delta":
        b = (b.config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
             .config("spark.sql.catalog.spark_catalog",
                     "org.apache.spark.sql.delta.catalog.DeltaCatalog"))
        package, wanted = DELTA, "delta-spark"
    else:
        b = (b.config("spark.sql.extensions",
                      "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions")
             .config("spark.sql.catalog.bench", "org.apache.iceberg.spark.SparkCatalog")
             .config("spark.sql.catalog.bench.type", "hadoop")
             .config("spark.sql.catalog.bench.warehouse", warehouse))
        package, wanted = ICEBERG, "iceberg-spark"
    b = (b.config("spark.driver.memory", "6g")
         .config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", "2")
         .config("spark.databricks.delta.optimizeWrite.enabled", "false")
         .config("spark.databricks.delta.merge.repartitionBeforeWrite.enabled", "false")
         .config("spark.databricks.delta.properties.defaults.enableDeletionVectors", "true"))
    if any(wanted in j for j in jars):
        b = b.config("spark.jars", ",".join(jars))
    else:
        b = b.config("spark.jars.packages", package).config("spark.jars.ivy", ivy)
    return b.getOrCreate()


def target(fmt: str, table: str) -> str:
    """The table as MERGE names it."""
    return f"delta.`{table}`" if fmt == "delta" else ICEBERG_TABLE


def load(spark, fmt: str, table: str, keys: int) -> float:  # type: ignore[no-untyped-def]
    from pyspark.sql import functions as F

    t0 = time.monotonic()
    df = (spark.range(keys).withColumnRenamed("id", "k")
          .withColumn("v", F.concat(F.lit("v0-"), F.col("k").cast("string")))
          .withColumn("n", F.col("k").cast("double") / 3)
          .withColumn("_into_time", F.lit(0).cast("long")))
    df = df.repartition(max(1, keys // 1_000_000))
    if fmt == "delta":
        df.write.format("delta").option("delta.enableDeletionVectors", "true").save(table)
        spark.sql(f"ALTER TABLE delta.`{table}` SET TBLPROPERTIES "
                  "('delta.enableDeletionVectors' = 'true')")
    else:
        spark.sql("CREATE NAMESPACE IF NOT EXISTS bench.db")
        w = df.writeTo(ICEBERG_TABLE).using("iceberg")
        for k, v in ICEBERG_PROPERTIES.items():
            w = w.tableProperty(k, v)
        w.create()
    return time.monotonic() - t0


def merge(spark, fmt: str, table: str, changes: str,  # type: ignore[no-untyped-def]
          checkpoint: str) -> tuple[list[tuple[float, int]], float]:
    from pyspark.sql import functions as F

    times: list[tuple[float, int]] = []
    into = target(fmt, table)

    def apply(batch, batch_id: int) -> None:  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        src = batch.withColumn("_into_time", F.lit(batch_id).cast("long"))
        n = src.count()
        src.createOrReplaceTempView("changes")
        src.sparkSession.sql(
            f"MERGE INTO {into} t USING changes s ON t.k = s.k "
            "WHEN MATCHED AND s.op = 'd' THEN DELETE "
            "WHEN MATCHED THEN UPDATE SET v = s.v, n = s.n, _into_time = s._into_time "
            "WHEN NOT MATCHED AND s.op != 'd' THEN INSERT (k, v, n, _into_time) "
            "VALUES (s.k, s.v, s.n, s._into_time)")
        times.append((time.monotonic() - t0, n))
        print(f"batch {batch_id}: {n} rows in {times[-1][0]:.2f} s", file=sys.stderr,
              flush=True)

    schema = "k long, v string, n double, op string"
    t0 = time.monotonic()
    q = (spark.readStream.format("parquet").schema(schema).option("maxFilesPerTrigger", 1)
         .load(changes).writeStream.foreachBatch(apply)
         .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())
    q.awaitTermination()
    return times, time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ivy", required=True)
    ap.add_argument("--table", required=True)
    ap.add_argument("--format", choices=["delta", "iceberg"], default="delta")
    ap.add_argument("what", choices=["load", "merge"])
    ap.add_argument("--keys", type=int, default=0)
    ap.add_argument("--changes", default="")
    ap.add_argument("--checkpoint", default="")
    args = ap.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = session(args.ivy, args.format, args.table)
    spark.sparkContext.setLogLevel("ERROR")
    try:
        if args.what == "load":
            out: dict[str, object] = {"load_s": load(spark, args.format, args.table, args.keys)}
        else:
            batches, wall = merge(spark, args.format, args.table, args.changes, args.checkpoint)
            out = {"batches": batches, "wall_s": wall}
            if args.format == "delta":
                out["rows"] = spark.read.format("delta").load(args.table).count()
            else:
                out["rows"] = spark.table(ICEBERG_TABLE).count()
        sys.stdout.write(json.dumps(out) + "\n")
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
