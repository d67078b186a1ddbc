"""The tenants' bill: per tenant, per UTC day, the sum of every usage counter.

    spark-submit workers/usage_bill.py --archive <url> --out <dir> [--from YYYY-MM-DD --to YYYY-MM-DD]
    python -m workers.usage_bill --archive s3a://bucket/prefix --out ./bill --format both
    python -m workers.usage_bill --local --archive ./data/archive --out ./bill   (no Spark)

Reads the usage files the archive workers write (``<archive>/_usage/hour=<YYYY-MM-DDTHH>/
<part>.parquet``, workers/meter.py: rows hour, tenant, counter, value) and writes one row
per (tenant, day) that has usage: ``tenant``, ``day`` (a date), then one int64 column per
counter found in the files read, in name order (a counter this job has never heard of
gets its column too), 0 where the tenant counted none that day. Rows are in (tenant, day)
order. ``--from``/``--to``: UTC days, both included (default: everything); only their
``hour=`` directories are listed and read.

Output under ``--out``: ``parquet/`` and/or ``csv/`` (``--format parquet|csv|both``; CSV with
a header), replaced whole. Spark writes them as Spark does (a part file and ``_SUCCESS``),
``--local`` as ``parquet/bill.parquet`` and ``csv/bill.csv``.

The bill's rules are defined once: which rows (gateway/archive/usage.py's ``hour_window``: a
row counts on the UTC day its hour starts in, shared with the tenants API's history), what
is summed (``value`` over tenant, day and counter) and the bill's shape (``bill_of`` here:
the pivot, the zeros, the order). The engines only read the
files and sum: Spark (``spark_sums``) for archives of any size, pyarrow (``local_sums``)
for tests and operators without Spark. Both hand their sums (one per tenant, day and
counter: small) to ``bill_of``.

S3: Spark takes ``s3a://`` URLs (``s3://`` is read as ``s3a://``) with the archive workers'
``AWS_*`` variables (workers/analytics.py's ``configure_s3a``); ``--local`` takes fsspec
URLs (``s3://`` with s3fs).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from collections import defaultdict
from collections.abc import Iterable
from datetime import UTC, date, datetime
from typing import TYPE_CHECKING

import pyarrow as pa

from gateway.archive.files import Archive
from gateway.archive.usage import DAY_MS, USAGE_DIR, Sum, hour_dirs, hour_window, sums

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

KEY = ("tenant", "day")


# --- The rules ---


def bill_of(sums: Iterable[Sum]) -> pa.Table:
    """The bill from the sums of ``value`` per (tenant, day, counter): one row per
    (tenant, day), a column per counter present (name order), 0 where none."""
    rows: dict[tuple[str, date], dict[str, int]] = defaultdict(dict)
    counters: set[str] = set()
    for tenant, day, counter, total in sums:
        if counter in KEY:  # (a counter must not shadow the key)
            raise ValueError(f"a usage counter named {counter!r}: the bill's key has that column")
        row = rows[(tenant, day)]
        row[counter] = row.get(counter, 0) + int(total)
        counters.add(counter)
    keys = sorted(rows)
    columns: dict[str, pa.Array] = {
        "tenant": pa.array([k[0] for k in keys], pa.string()),
        "day": pa.array([k[1] for k in keys], pa.date32()),
    }
    for counter in sorted(counters):
        columns[counter] = pa.array([rows[k].get(counter, 0) for k in keys], pa.int64())
    return pa.table(columns)


# --- pyarrow: no Spark ---


def local_sums(archive: str, first: date | None = None, last: date | None = None) -> list[Sum]:
    """The sums of the usage files under ``archive`` (an fsspec URL) in [first, last]."""
    return sums(archive, first, last)


def local_bill(archive: str, first: date | None = None, last: date | None = None) -> pa.Table:
    """The bill, read with pyarrow (the same as the Spark job's)."""
    return bill_of(local_sums(archive, first, last))


def write_local(bill: pa.Table, out: str, formats: list[str]) -> None:
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    target = Archive(out)
    if "parquet" in formats:
        sink = io.BytesIO()
        pq.write_table(bill, sink)
        target.put("parquet/bill.parquet", sink.getvalue())
    if "csv" in formats:
        sink = io.BytesIO()
        pcsv.write_csv(bill, sink)
        target.put("csv/bill.csv", sink.getvalue())


# --- Spark ---


def _listed_hour_dirs(spark: SparkSession, usage: str) -> list[str] | None:
    """The directory names under ``usage`` (one listing); None when it does not exist."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None  # a classic (not Spark Connect) session has one
    root = jvm.org.apache.hadoop.fs.Path(usage)
    fs = root.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    if not fs.exists(root):
        return None
    return [status.getPath().getName() for status in fs.listStatus(root) if status.isDirectory()]


def spark_sums(
    spark: SparkSession, archive: str, first: date | None = None, last: date | None = None
) -> DataFrame:
    """The sums of the usage files under ``archive`` (a Hadoop URL) in [first, last], as
    rows (tenant, day, counter, value)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import DateType, LongType, StringType, StructField, StructType, TimestampType

    usage = f"{archive.rstrip('/')}/{USAGE_DIR}"
    names = _listed_hour_dirs(spark, usage)
    paths = [f"{usage}/{name}" for name in hour_dirs(names or [], first, last)]
    schema = StructType(
        [
            StructField("hour", TimestampType()),
            StructField("tenant", StringType()),
            StructField("counter", StringType()),
            StructField("value", LongType()),
        ]
    )
    sums = StructType([*schema.fields[1:3], StructField("day", DateType()), StructField("value", LongType())])
    if not paths:
        return spark.createDataFrame([], sums).select("tenant", "day", "counter", "value")
    # No partition discovery: ``hour=`` would be read as a string column over the file's own.
    rows = spark.read.schema(schema).option("recursiveFileLookup", "true").parquet(*paths)
    hour_ms = F.unix_millis("hour")
    start, end = hour_window(first, last)
    if start is not None:
        rows = rows.where(hour_ms >= F.lit(start))
    if end is not None:
        rows = rows.where(hour_ms < F.lit(end))
    day = F.date_from_unix_date(F.floor(hour_ms / F.lit(DAY_MS)).cast("int"))  # as day_of: no time zone
    return rows.groupBy("tenant", day.alias("day"), "counter").agg(F.sum("value").alias("value"))


def spark_bill(
    spark: SparkSession, archive: str, first: date | None = None, last: date | None = None
) -> pa.Table:
    """The bill, summed by Spark (the same as ``local_bill``'s)."""
    sums = spark_sums(spark, archive, first, last).collect()
    return bill_of((r["tenant"], r["day"], r["counter"], r["value"]) for r in sums)


def write_spark(spark: SparkSession, bill: pa.Table, out: str, formats: list[str]) -> None:
    frame = spark.createDataFrame(bill).coalesce(1)
    if "parquet" in formats:
        frame.write.mode("overwrite").parquet(f"{out.rstrip('/')}/parquet")
    if "csv" in formats:
        frame.write.mode("overwrite").option("header", "true").csv(f"{out.rstrip('/')}/csv")


# --- The command line ---


def _day(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a day (YYYY-MM-DD): {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--archive", required=True, help="the archive's root (a path or a URL)")
    parser.add_argument("--out", required=True, help="where the bill goes (parquet/ and/or csv/ in it)")
    parser.add_argument("--from", dest="first", type=_day, help="the first UTC day billed (YYYY-MM-DD)")
    parser.add_argument("--to", dest="last", type=_day, help="the last UTC day billed, included")
    parser.add_argument("--format", choices=("parquet", "csv", "both"), default="parquet")
    parser.add_argument("--local", action="store_true", help="no Spark: read and write with pyarrow")
    args = parser.parse_args(argv)
    if args.first and args.last and args.first > args.last:
        parser.error(f"--from ({args.first}) is after --to ({args.last})")
    formats = ["parquet", "csv"] if args.format == "both" else [args.format]
    started = datetime.now(UTC)
    if args.local:
        bill = local_bill(args.archive, args.first, args.last)
        write_local(bill, args.out, formats)
    else:
        from pyspark.sql import SparkSession

        from workers.analytics import configure_s3a, hadoop_url

        spark = SparkSession.builder.appName("durable-streams-usage-bill").getOrCreate()
        configure_s3a(spark, os.environ)
        bill = spark_bill(spark, hadoop_url(args.archive), args.first, args.last)
        write_spark(spark, bill, hadoop_url(args.out), formats)
    seconds = (datetime.now(UTC) - started).total_seconds()
    counters = ", ".join(bill.column_names[len(KEY) :]) or "none"
    print(f"bill: {bill.num_rows} rows (tenant, day), counters: {counters}; to {args.out} in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
