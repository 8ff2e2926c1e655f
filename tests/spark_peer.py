"""Spark reads Delta and Iceberg tables: the reader side of the interoperability tests.

Runs under its own Python (``$RECLOCK_CACHE/spark-peer``, a PySpark for which
both delta-spark and Iceberg's Spark runtime are released; tests/setup.sh
makes it) in a JVM of its own, as any Spark job reading reclock's outputs
would. Each argument is a Delta table's path, ``iceberg:`` followed by an
Iceberg table's metadata file location (Iceberg loads a table from it with
no catalog), or ``sql:`` followed by a Spark SQL query (Delta tables as
``delta.`path```, Iceberg tables through the catalogs ``--catalog`` names).
For each it prints, as one JSON document on stdout:

* ``types``: each column's Spark type (``simpleString``);
* ``rows``: every row, each value in a form that compares exactly with what
  the test computes from ``deltalake``: timestamps as microseconds since the
  epoch, dates as days, decimals as their text, binary as hex, nested values
  as JSON, floats as ``repr`` (NaN and infinities included);
* Delta only: ``version``, the table version Spark read; ``txns``, the
  application transactions (``appId -> version``) of that snapshot, as
  Delta's own ``DeltaLog`` sees them.

``--catalog NAME=JDBC_URL,WAREHOUSE`` makes an Iceberg JDBC catalog ``NAME``
over the database pyiceberg's SQL catalog keeps (SQLite or PostgreSQL: the
two share one table layout), as a Spark user of such a catalog would.
``--s3 ENDPOINT,REGION,KEY_ID,SECRET`` has those catalogs read an ``s3://``
warehouse through Iceberg's own S3FileIO (``iceberg-aws-bundle``), path-style,
at that endpoint (moto's server in the tests).
``--resolve`` only resolves the packages into the Ivy cache (``--ivy``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

#: delta-spark 4.3 and Iceberg 1.12's runtime are both built for Spark 4.1
DELTA = "io.delta:delta-spark_2.13:4.3.1"
ICEBERG = "org.apache.iceberg:iceberg-spark-runtime-4.1_2.13:1.12.0"
#: Iceberg's S3FileIO and the AWS SDK it needs (no Hadoop S3A: Iceberg reads S3 itself)
ICEBERG_AWS = "org.apache.iceberg:iceberg-aws-bundle:1.12.0"
#: the JDBC drivers of the catalogs an Iceberg JDBC catalog can live in
JDBC = "org.xerial:sqlite-jdbc:3.54.1.0,org.postgresql:postgresql:42.7.14"
PACKAGES = f"{DELTA},{ICEBERG},{ICEBERG_AWS},{JDBC}"


def session(ivy: str, catalogs: list[str], s3: str | None = None):  # type: ignore[no-untyped-def]
    from pyspark.sql import SparkSession

    jars = sorted(glob.glob(os.path.join(ivy, "jars", "*.jar")))
    b = (SparkSession.builder.master("local[1]").appName("interop-reader")
         .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension,"
                 "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions")
         .config("spark.sql.catalog.spark_catalog",
                 "org.apache.spark.sql.delta.catalog.DeltaCatalog")
         .config("spark.sql.session.timeZone", "UTC")
         .config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", "1")
         .config("spark.databricks.delta.snapshotPartitions", "1")
         .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1"))
    for spec in catalogs:
        name, rest = spec.split("=", 1)
        uri, warehouse = rest.rsplit(",", 1)
        prefix = f"spark.sql.catalog.{name}"
        b = (b.config(prefix, "org.apache.iceberg.spark.SparkCatalog")
             .config(f"{prefix}.type", "jdbc").config(f"{prefix}.uri", uri)
             .config(f"{prefix}.warehouse", warehouse))
        if s3:
            endpoint, region, key, secret = s3.split(",", 3)
            for k, v in (("io-impl", "org.apache.iceberg.aws.s3.S3FileIO"),
                         ("s3.endpoint", endpoint), ("s3.path-style-access", "true"),
                         ("s3.access-key-id", key), ("s3.secret-access-key", secret),
                         ("client.region", region)):
                b = b.config(f"{prefix}.{k}", v)
    wanted = ("delta-spark", "iceberg-spark", "iceberg-aws-bundle", "sqlite-jdbc")
    if all(any(name in j for j in jars) for name in wanted):
        b = b.config("spark.jars", ",".join(jars))
    else:
        b = b.config("spark.jars.packages", PACKAGES).config("spark.jars.ivy", ivy)
    return b.getOrCreate()


def plain(field):  # type: ignore[no-untyped-def]
    """A column as a value that survives JSON exactly."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    c, t = F.col(f"`{field.name}`"), field.dataType
    if isinstance(t, T.TimestampType):
        return F.unix_micros(c)
    if isinstance(t, T.TimestampNTZType):
        return F.unix_micros(c.cast("timestamp"))  # the session time zone is UTC
    if isinstance(t, T.DateType):
        return F.unix_date(c)
    if isinstance(t, T.DecimalType):
        return c.cast("string")
    if isinstance(t, T.BinaryType):
        return F.hex(c)
    if isinstance(t, T.ArrayType | T.StructType | T.MapType):
        return F.to_json(c)
    return c


def read(spark, path: str) -> dict:  # type: ignore[no-untyped-def]
    if path.startswith("sql:"):
        df = spark.sql(path[len("sql:"):])
        return {"types": {f.name: f.dataType.simpleString() for f in df.schema.fields},
                "rows": rows_of(df)}
    if path.startswith("iceberg:"):
        df = spark.read.format("iceberg").load(path[len("iceberg:"):])
        return {"types": {f.name: f.dataType.simpleString() for f in df.schema.fields},
                "rows": rows_of(df)}
    df = spark.read.format("delta").load(path)
    rows = rows_of(df)
    jvm = spark.sparkContext._jvm
    log = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, path)
    snap = log.unsafeVolatileSnapshot()
    txns = jvm.scala.jdk.javaapi.CollectionConverters.asJava(snap.transactions())
    return {
        "types": {f.name: f.dataType.simpleString() for f in df.schema.fields},
        "rows": rows,
        "version": int(snap.version()),
        "txns": {str(k): int(txns.get(k)) for k in txns.keySet()},
    }


def rows_of(df):  # type: ignore[no-untyped-def]
    rows = df.select([plain(f).alias(f.name) for f in df.schema.fields]).collect()
    return [[repr(v) if isinstance(v, float) else v for v in r] for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ivy", required=True)
    ap.add_argument("--resolve", action="store_true")
    ap.add_argument("--catalog", action="append", default=[])
    ap.add_argument("--s3")
    ap.add_argument("paths", nargs="*")
    args = ap.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = session(args.ivy, args.catalog, args.s3)
    try:
        if not args.resolve:
            spark.sparkContext.setLogLevel("ERROR")
            out = {p: read(spark, p) for p in args.paths}
            sys.stdout.write(json.dumps(out) + "\n")
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
