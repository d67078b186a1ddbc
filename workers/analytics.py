"""A Spark job over the archive: per-stream traffic by hour, and a JSON field.

    spark-submit workers/analytics.py --archive ./data/archive [--json-field $.type]
    python -m workers.analytics --archive s3a://bucket/prefix --window 1h --out ./report

The archive is Hive-partitioned (``date=YYYY-MM-DD/bucket=NN/``), ``date`` being the
UTC day of every row of a file (a file never spans two days). Rows follow
gateway/archive/schema.SCHEMA; (stream, incarnation, position) is the key. For a
moment a file can be on disk twice (a small file being merged into a bigger one, a
crashed worker's file awaiting its retry), so the job keeps one row per key.

Which rows: ``--window 1h`` reads the last whole hour before now ([13:00, 14:00) at
14:17), ``--since``/``--until`` any range of append times (start included, end
excluded), ``--date`` one UTC day; by default the whole archive. Only the ``date=``
directories the range touches are listed and read; within them Parquet row groups
are skipped by their ``append_time`` statistics.

S3: ``s3a://`` URLs (``s3://`` is read as ``s3a://``) take the endpoint, region and
credentials from the same ``AWS_*`` variables as the archive workers, unless the
Spark conf sets them (``--conf spark.hadoop.fs.s3a.…``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

KEY = ["stream", "incarnation", "position"]
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_DURATION = re.compile(r"(?:\d+[smhdw])+")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DATE_DIR = re.compile(r"date=(\d{4}-\d{2}-\d{2})")
S3A = "spark.hadoop.fs.s3a."


# --- Which rows: time windows (pure) ---


def parse_duration(text: str) -> timedelta:
    """``90s``, ``15m``, ``2h``, ``1d``, ``1w`` or a sum such as ``1h30m``."""
    if not _DURATION.fullmatch(text):
        raise ValueError(f"not a duration such as 15m, 2h or 1d: {text!r}")
    seconds = sum(int(n) * _UNITS[unit] for n, unit in re.findall(r"(\d+)([smhdw])", text))
    if seconds <= 0:
        raise ValueError(f"a duration must be positive: {text!r}")
    return timedelta(seconds=seconds)


def parse_time(text: str, now: datetime) -> datetime:
    """An instant: an ISO 8601 date (its midnight, UTC) or date and time (UTC unless it
    names an offset), or a duration before ``now`` (``2h``: two hours ago)."""
    if _DURATION.fullmatch(text):
        return now - parse_duration(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"not an ISO date/time or a duration such as 2h: {text!r}") from None
    # Naive times are UTC, like the date partitions and the job's session time zone.
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def aligned_window(size: timedelta, now: datetime) -> tuple[datetime, datetime]:
    """The last whole window before ``now``: [end - size, end), end being ``now`` rounded
    down to a multiple of ``size`` since the Unix epoch (whole hours, whole UTC days). Runs
    of a schedule of the same period read adjacent windows, none twice, none skipped."""
    step = size // timedelta(microseconds=1)
    elapsed = (now - EPOCH) // timedelta(microseconds=1)  # integers: exact boundaries
    end = EPOCH + timedelta(microseconds=elapsed - elapsed % step)
    return end - size, end


def date_dirs(names: Iterable[str], since: datetime | None, until: datetime | None) -> list[str]:
    """The ``date=`` directory names (of those at the archive's root) whose day can hold rows
    appended in [since, until)."""
    first = since.date() if since else date.min
    last = (until - timedelta(microseconds=1)).date() if until else date.max  # until is excluded
    chosen = []
    for name in names:
        match = _DATE_DIR.fullmatch(name)
        if match and first <= date.fromisoformat(match.group(1)) <= last:
            chosen.append(name)
    return sorted(chosen)


# --- S3: the archive workers' AWS_* environment as s3a settings (pure) ---


def s3a_settings(env: Mapping[str, str], explicit: Mapping[str, str]) -> dict[str, str]:
    """``spark.hadoop.fs.s3a.*`` settings for what the archive workers (botocore) take from
    ``env``: s3a's endpoint, addressing style and region come from its own settings, which
    AWS_ENDPOINT_URL and AWS_DEFAULT_REGION do not touch.
    A group the Spark conf (``explicit``) already touches is left to it whole, so an
    endpoint set there never gets path-style or TLS settings meant for another."""
    out: dict[str, str] = {}
    # The S3-specific variable wins over the general one, as in botocore.
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")  # the AWS CLI's order
    if endpoint and S3A + "endpoint" not in explicit:
        out[S3A + "endpoint"] = endpoint
        # MinIO, Ceph, moto...: buckets in the path, not in a DNS name the server lacks.
        out[S3A + "path.style.access"] = "true"
        scheme = endpoint.split("://", 1)[0].lower() if "://" in endpoint else ""
        if scheme in ("http", "https"):
            out[S3A + "connection.ssl.enabled"] = str(scheme == "https").lower()
        # botocore signs for us-east-1 when no region is set; s3a would pick another.
        region = region or "us-east-1"
    if region and S3A + "endpoint.region" not in explicit:
        out[S3A + "endpoint.region"] = region
    credentials = ("access.key", "secret.key", "session.token", "aws.credentials.provider")
    key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if key and secret and not any(S3A + name in explicit for name in credentials):
        out[S3A + "access.key"] = key
        out[S3A + "secret.key"] = secret
        token = env.get("AWS_SESSION_TOKEN")
        if token:
            out[S3A + "session.token"] = token
        provider = "TemporaryAWSCredentialsProvider" if token else "SimpleAWSCredentialsProvider"
        out[S3A + "aws.credentials.provider"] = f"org.apache.hadoop.fs.s3a.{provider}"
    return out


def hadoop_url(archive: str) -> str:
    """The archive workers' ``s3://`` is Hadoop's ``s3a://`` (Hadoop has no ``s3`` scheme)."""
    return "s3a://" + archive[len("s3://") :] if archive.startswith("s3://") else archive


# --- Spark ---


def configure_s3a(spark: SparkSession, env: Mapping[str, str]) -> dict[str, str]:
    """Apply ``s3a_settings`` to the session's Hadoop configuration (what s3a reads when it
    first opens a bucket), leaving whatever the Spark conf sets (spark-defaults.conf,
    ``--conf``, PYSPARK_SUBMIT_ARGS) alone. Returns what it set."""
    explicit = dict(spark.sparkContext.getConf().getAll())
    settings = s3a_settings(env, explicit)
    hadoop = spark.sparkContext._jsc.hadoopConfiguration()
    for key, value in settings.items():
        hadoop.set(key.removeprefix("spark.hadoop."), value)
    return settings


def _listed_dirs(spark: SparkSession, archive: str) -> list[str]:
    """Names of the directories at the archive's root: one listing, not one per file."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None  # a classic (not Spark Connect) session has one
    root = jvm.org.apache.hadoop.fs.Path(archive)
    fs = root.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    return [status.getPath().getName() for status in fs.listStatus(root) if status.isDirectory()]


def _empty(spark: SparkSession) -> DataFrame:
    """No rows, with the columns a read of the archive has."""
    from pyspark.sql.pandas.types import from_arrow_schema
    from pyspark.sql.types import DateType, IntegerType, StructField

    from gateway.archive.schema import SCHEMA

    schema = from_arrow_schema(SCHEMA, prefer_timestamp_ntz=False)
    schema = schema.add(StructField("date", DateType())).add(StructField("bucket", IntegerType()))
    return spark.createDataFrame([], schema)


def load(
    spark: SparkSession, archive: str, since: datetime | None = None, until: datetime | None = None
) -> DataFrame:
    """Every archived entry appended in [since, until) (each bound optional), once."""
    reader = spark.read.option("basePath", archive)  # keeps date and bucket as columns
    if since is None and until is None:
        entries = reader.parquet(archive)
    else:
        # Only the days of the window are listed and read: a partition filter alone would
        # still list every file of the archive on every run.
        days = date_dirs(_listed_dirs(spark, archive), since, until)
        if not days:
            return _empty(spark)
        entries = reader.parquet(*(f"{archive.rstrip('/')}/{day}" for day in days))
        # Before dropDuplicates, so that the filter reaches the Parquet scan (row groups
        # skipped by their append_time min/max); duplicates share their append_time.
        if since is not None:
            entries = entries.where(F.col("append_time") >= F.lit(since))
        if until is not None:
            entries = entries.where(F.col("append_time") < F.lit(until))
    return entries.dropDuplicates(KEY)


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


def _arg(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse type that says what is wrong with a value, not just "invalid"."""

    def checked(text: str) -> object:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return checked


def _window(args: argparse.Namespace, now: datetime) -> tuple[datetime | None, datetime | None]:
    if args.window:
        return aligned_window(args.window, now)
    if args.date:
        day = datetime.combine(args.date, datetime.min.time(), UTC)
        return day, day + timedelta(days=1)
    since = parse_time(args.since, now) if args.since else None
    until = parse_time(args.until, now) if args.until else None
    if since and until and since >= until:
        raise ValueError(f"--since ({since.isoformat()}) must be before --until ({until.isoformat()})")
    return since, until


def main(argv: list[str] | None = None, now: datetime | None = None) -> int:
    """The job; ``now`` (UTC) is for tests: relative times and --window count from it."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--archive", required=True, help="the archive's root (a path or a Hadoop URL)")
    parser.add_argument("--json-field", default="$.type", help="JSON path to count values of")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--window",
        type=_arg(parse_duration),
        help="the last whole window of this size before now, e.g. 1h: the previous whole hour; "
        "for a schedule of the same period",
    )
    which.add_argument("--date", type=_arg(date.fromisoformat), help="only this UTC day (YYYY-MM-DD)")
    which.add_argument(
        "--since",
        help="from this append time on (included): 2026-11-21, 2026-11-21T12:00 (UTC unless an "
        "offset is given), or a duration before now such as 2h or 1d",
    )
    parser.add_argument("--until", help="before this append time (excluded); same forms as --since")
    parser.add_argument("--out", help="also write the reports here as JSON lines")
    args = parser.parse_args(argv)
    if args.until and (args.window or args.date):
        parser.error("--until goes with --since, not with --window or --date")
    now = now or datetime.now(UTC)
    try:
        since, until = _window(args, now)
    except ValueError as e:
        parser.error(str(e))

    spark = (
        SparkSession.builder.appName("durable-streams-archive")
        .config("spark.sql.session.timeZone", "UTC")  # hours are UTC hours, like the date partitions
        .getOrCreate()
    )
    configure_s3a(spark, os.environ)
    entries = load(spark, hadoop_url(args.archive), since, until)
    print(f"== window [{_iso(since)}, {_iso(until)})")
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


def _iso(moment: datetime | None) -> str:
    return moment.isoformat() if moment else "…"


if __name__ == "__main__":
    sys.exit(main())
