"""Spark reads Iceberg tables: the reader side of the Iceberg interoperability test.

Runs under the Spark peer's own Python (``$RECLOCK_CACHE/spark-peer``, made by
tests/setup.sh) in a JVM of its own, as any Spark job reading reclock's
Iceberg outputs would, with ``iceberg-spark-runtime`` and the SQLite and
PostgreSQL JDBC drivers from the same Ivy cache. The catalog is Iceberg's
JDBC catalog on the database pyiceberg's SQL catalog writes (``--uri``, a
``jdbc:sqlite:`` or ``jdbc:postgresql:`` URL; ``--name``: the catalog's name,
which the SQL catalog keeps with each table). For each table
(``namespace.name``) it prints, as one JSON document on stdout:

* ``types``: each column's Spark type (``simpleString``);
* ``rows``: every row of ``SELECT *`` (``--where`` filters it), each value
  in a form that compares exactly (as tests/spark_delta_reader.py prints
  them);
* ``upper``: ``summary['reclock.upper']`` of the table's current snapshot,
  read from its ``snapshots`` metadata table.

``--resolve`` only resolves the packages into the Ivy cache (``--ivy``); a
cache that lacks one of them (tests/setup.sh resolves the peer's own) has
them resolved on first use.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

PACKAGES = ["org.apache.iceberg:iceberg-spark-runtime-4.1_2.13:1.12.0",
            "org.xerial:sqlite-jdbc:3.54.1.0", "org.postgresql:postgresql:42.7.14"]


def session(ivy: str, name: str, uri: str, warehouse: str):  # type: ignore[no-untyped-def]
    from pyspark.sql import SparkSession

    jars = sorted(glob.glob(os.path.join(ivy, "jars", "*.jar")))
    cat = f"spark.sql.catalog.{name}"
    b = (SparkSession.builder.master("local[1]").appName("iceberg-interop-reader")
         .config("spark.sql.extensions",
                 "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions")
         .config(cat, "org.apache.iceberg.spark.SparkCatalog")
         .config(f"{cat}.type", "jdbc")
         .config(f"{cat}.uri", uri)
         .config(f"{cat}.warehouse", warehouse)
         .config(f"{cat}.jdbc.schema-version", "V1")
         .config("spark.sql.session.timeZone", "UTC")
         .config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", "1")
         .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1"))
    if all(any(p.split(":")[1] in j for j in jars) for p in PACKAGES):
        b = b.config("spark.jars", ",".join(jars))
    else:
        b = b.config("spark.jars.packages", ",".join(PACKAGES)).config("spark.jars.ivy", ivy)
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


def read(spark, name: str, table: str, where: str | None) -> dict:  # type: ignore[no-untyped-def]
    df = spark.sql(f"SELECT * FROM {name}.{table}" + (f" WHERE {where}" if where else ""))
    rows = df.select([plain(f).alias(f.name) for f in df.schema.fields]).collect()
    upper = spark.sql(f"SELECT summary['reclock.upper'] AS u FROM {name}.{table}.snapshots "
                      "ORDER BY committed_at DESC LIMIT 1").collect()
    return {
        "types": {f.name: f.dataType.simpleString() for f in df.schema.fields},
        "rows": [[repr(v) if isinstance(v, float) else v for v in r] for r in rows],
        "upper": upper[0]["u"] if upper else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ivy", required=True)
    ap.add_argument("--resolve", action="store_true")
    ap.add_argument("--name", default="reclock")
    ap.add_argument("--uri", default="jdbc:sqlite::memory:")
    ap.add_argument("--warehouse", default="file:///tmp")
    ap.add_argument("--where")
    ap.add_argument("tables", nargs="*")
    args = ap.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = session(args.ivy, args.name, args.uri, args.warehouse)
    try:
        if not args.resolve:
            spark.sparkContext.setLogLevel("ERROR")
            out = {t: read(spark, args.name, t, args.where) for t in args.tables}
            sys.stdout.write(json.dumps(out) + "\n")
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
