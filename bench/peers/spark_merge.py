"""Spark Structured Streaming ``foreachBatch`` + Delta ``MERGE``: the peer
side of ``bench/state_table_bench.py``.

Runs under the peer Spark's own Python (``$RECLOCK_CACHE/spark-peer``:
PySpark 4.1.4 with delta-spark 4.3.1 from its Ivy cache). ``load`` writes the
table's first version (``--keys`` rows, files of a million rows, deletion
vectors on); ``merge`` streams the change files of ``--changes`` (one
Parquet file per batch: ``k, v, n, op`` with ``op`` ``u``/``d``/``i``, one
change per key) with ``maxFilesPerTrigger: 1`` and an ``availableNow``
trigger, and MERGEs each batch into the table in ``foreachBatch``. Prints
one JSON document: each batch's wall time (s) and its row count.

Settings, from Delta's documentation for MERGEs of small batches into a big
table: deletion vectors on (``delta.enableDeletionVectors``: a MERGE marks
the replaced rows instead of rewriting their files), optimized writes off
(``spark.databricks.delta.optimizeWrite.enabled``: no extra shuffle for a
batch this small), no repartition before the write
(``spark.databricks.delta.merge.repartitionBeforeWrite.enabled``), two
shuffle partitions (two cores), adaptive query execution on (the default).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

DELTA = "io.delta:delta-spark_2.13:4.3.1"


def session(ivy: str):  # type: ignore[no-untyped-def]
    from pyspark.sql import SparkSession

    jars = sorted(glob.glob(os.path.join(ivy, "jars", "*.jar")))
    b = (SparkSession.builder.master("local[2]").appName("merge-bench")
         .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
         .config("spark.sql.catalog.spark_catalog",
                 "org.apache.spark.sql.delta.catalog.DeltaCatalog")
         .config("spark.driver.memory", "6g")
         .config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", "2")
         .config("spark.databricks.delta.optimizeWrite.enabled", "false")
         .config("spark.databricks.delta.merge.repartitionBeforeWrite.enabled", "false")
         .config("spark.databricks.delta.properties.defaults.enableDeletionVectors", "true"))
    if any("delta-spark" in j for j in jars):
        b = b.config("spark.jars", ",".join(jars))
    else:
        b = b.config("spark.jars.packages", DELTA).config("spark.jars.ivy", ivy)
    return b.getOrCreate()


def load(spark, table: str, keys: int) -> float:  # type: ignore[no-untyped-def]
    from pyspark.sql import functions as F

    t0 = time.monotonic()
    df = (spark.range(keys).withColumnRenamed("id", "k")
          .withColumn("v", F.concat(F.lit("v0-"), F.col("k").cast("string")))
          .withColumn("n", F.col("k").cast("double") / 3)
          .withColumn("_into_time", F.lit(0).cast("long")))
    (df.repartition(max(1, keys // 1_000_000)).write.format("delta")
     .option("delta.enableDeletionVectors", "true").save(table))
    spark.sql(f"ALTER TABLE delta.`{table}` SET TBLPROPERTIES "
              "('delta.enableDeletionVectors' = 'true')")
    return time.monotonic() - t0


def merge(spark, table: str, changes: str, checkpoint: str) -> list[tuple[float, int]]:  # type: ignore[no-untyped-def]
    from pyspark.sql import functions as F

    times: list[tuple[float, int]] = []

    def apply(batch, batch_id: int) -> None:  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        src = batch.withColumn("_into_time", F.lit(batch_id).cast("long"))
        n = src.count()
        src.createOrReplaceTempView("changes")
        src.sparkSession.sql(
            f"MERGE INTO delta.`{table}` t USING changes s ON t.k = s.k "
            "WHEN MATCHED AND s.op = 'd' THEN DELETE "
            "WHEN MATCHED THEN UPDATE SET v = s.v, n = s.n, _into_time = s._into_time "
            "WHEN NOT MATCHED AND s.op != 'd' THEN INSERT (k, v, n, _into_time) "
            "VALUES (s.k, s.v, s.n, s._into_time)")
        times.append((time.monotonic() - t0, n))
        print(f"batch {batch_id}: {n} rows in {times[-1][0]:.2f} s", file=sys.stderr,
              flush=True)

    schema = "k long, v string, n double, op string"
    q = (spark.readStream.format("parquet").schema(schema).option("maxFilesPerTrigger", 1)
         .load(changes).writeStream.foreachBatch(apply)
         .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())
    q.awaitTermination()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ivy", required=True)
    ap.add_argument("--table", required=True)
    ap.add_argument("what", choices=["load", "merge"])
    ap.add_argument("--keys", type=int, default=0)
    ap.add_argument("--changes", default="")
    ap.add_argument("--checkpoint", default="")
    args = ap.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = session(args.ivy)
    spark.sparkContext.setLogLevel("ERROR")
    try:
        if args.what == "load":
            out: dict[str, object] = {"load_s": load(spark, args.table, args.keys)}
        else:
            out = {"batches": merge(spark, args.table, args.changes, args.checkpoint)}
            out["rows"] = spark.read.format("delta").load(args.table).count()
        sys.stdout.write(json.dumps(out) + "\n")
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
