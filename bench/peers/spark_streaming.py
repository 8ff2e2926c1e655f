"""The Spark Structured Streaming contender: Kafka -> ``from_json`` -> Delta, exactly once.

Spark's own Kafka source (``spark-sql-kafka-0-10``) reads the topic from the
earliest offsets; ``from_json`` parses each value with the same schema reclock
uses; Delta's streaming sink (``delta-spark``) writes each micro-batch as one
Delta commit carrying ``(queryId, batchId)`` as its app transaction, so a
batch replayed after a crash is skipped: exactly once, with the checkpoint
location holding the offsets of every planned batch. A micro-batch starts
every ``--trigger`` seconds (``processingTime``), reading at most
``--max-offsets`` records when that is set (``maxOffsetsPerTrigger``).

Runs under the peer's own virtualenv (PySpark with a Spark version for which
delta-spark is released); ``--resolve`` only resolves the connector jars into
the Ivy cache (``--ivy``) and exits, so that the measured runs start from the
jars (``--jars``) without resolving anything.
"""

from __future__ import annotations

import argparse
import os
import sys

SCHEMA = "id BIGINT, user STRING, amount DOUBLE, ts BIGINT, pad STRING"


def session(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from pyspark.sql import SparkSession

    b = (SparkSession.builder.master(args.master).appName("spark-streaming-peer")
         .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
         .config("spark.sql.catalog.spark_catalog",
                 "org.apache.spark.sql.delta.catalog.DeltaCatalog")
         .config("spark.ui.enabled", "false")
         .config("spark.sql.shuffle.partitions", "2")
         # Delta rebuilds its snapshot after every commit in a job of this
         # many tasks (default 50): on two cores that, not the data, set the
         # pace of small micro-batches.
         .config("spark.databricks.delta.snapshotPartitions", "2"))
    if args.jars:
        b = b.config("spark.jars", args.jars)
    else:
        b = b.config("spark.jars.packages", args.packages).config("spark.jars.ivy", args.ivy)
    return b.getOrCreate()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--out", required=True, help="the Delta table's directory")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--trigger", type=float, default=1.0, help="seconds between micro-batches")
    ap.add_argument("--max-offsets", type=int, default=0,
                    help="maxOffsetsPerTrigger (0: Spark's default, no limit)")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--packages", default="")
    ap.add_argument("--ivy", default="")
    ap.add_argument("--jars", default="")
    ap.add_argument("--resolve", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = session(args)
    if args.resolve:
        spark.stop()
        return 0
    spark.sparkContext.setLogLevel("WARN")
    from pyspark.sql.functions import col, from_json

    reader = (spark.readStream.format("kafka")
              .option("kafka.bootstrap.servers", args.bootstrap)
              .option("subscribe", args.topic)
              .option("startingOffsets", "earliest"))
    if args.max_offsets:
        reader = reader.option("maxOffsetsPerTrigger", str(args.max_offsets))
    rows = (reader.load()
            .select(from_json(col("value").cast("string"), SCHEMA).alias("v"),
                    col("partition"), col("offset"))
            .select("v.*", "partition", "offset"))
    query = (rows.writeStream.format("delta")
             .option("checkpointLocation", args.checkpoint)
             .trigger(processingTime=f"{args.trigger} seconds")
             .start(args.out))
    query.awaitTermination()
    return 0


if __name__ == "__main__":
    sys.exit(main())
