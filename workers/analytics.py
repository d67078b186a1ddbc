"""A Spark job over the archive: per-stream traffic by hour, and a JSON field.

    spark-submit workers/analytics.py --archive ./data/archive [--json-field $.type]
    python -m workers.analytics --archive s3a://bucket/prefix --out ./report

The archive is Hive-partitioned (``date=YYYY-MM-DD/bucket=NN/``), so a filter
on ``date`` (or on ``bucket``, see gateway/archive/segments.bucket_of) skips whole
directories. Rows follow gateway/archive/schema.SCHEMA; (stream, incarnation,
position) is the key. For a moment a file can be on disk twice (a small file
being merged into a bigger one, a crashed worker's file awaiting its retry),
so the job keeps one row per key.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

KEY = ["stream", "incarnation", "position"]


def load(spark: SparkSession, archive: str) -> DataFrame:
    """Every archived entry, once."""
    return spark.read.option("basePath", archive).parquet(archive).dropDuplicates(KEY)


def hourly(entries: DataFrame) -> DataFrame:
    """Messages (JSON streams) or appends-pieces (others) and bytes per stream per hour."""
    return (
        entries.groupBy("stream", F.date_trunc("hour", "append_time").alias("hour"))
        .agg(F.count("*").alias("messages"), F.sum(F.length("data")).alias("bytes"))
        .orderBy("stream", "hour")
    )


def json_field(entries: DataFrame, path: str) -> DataFrame:
    """How often each value of a JSON field occurs, per stream (JSON streams only)."""
    return (
        entries.where(F.col("content_type").startswith("application/json"))
        .select("stream", F.get_json_object("text", path).alias("value"))
        .where(F.col("value").isNotNull())
        .groupBy("stream", "value")
        .count()
        .orderBy("stream", F.desc("count"), "value")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--archive", required=True, help="the archive's root (a path or a Hadoop URL)")
    parser.add_argument("--json-field", default="$.type", help="JSON path to count values of")
    parser.add_argument("--date", help="only this day (YYYY-MM-DD): the partition filter")
    parser.add_argument("--out", help="also write the reports here as JSON lines")
    args = parser.parse_args(argv)

    spark = (
        SparkSession.builder.appName("durable-streams-archive")
        .config("spark.sql.session.timeZone", "UTC")  # hours are UTC hours, like the date partitions
        .getOrCreate()
    )
    entries = load(spark, args.archive)
    if args.date:
        entries = entries.where(F.col("date") == F.lit(args.date))
    reports = {"hourly": hourly(entries), "json_field": json_field(entries, args.json_field)}
    for name, frame in reports.items():
        print(f"== {name}")
        frame.show(50, truncate=False)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            rows = [row.asDict() for row in frame.collect()]
            with open(Path(args.out) / f"{name}.jsonl", "w") as out:
                for row in rows:
                    out.write(json.dumps(row, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
