"""Spark (local mode) reads an archive the real gateway and worker produced; the job's
time windows and its s3a settings. The pure parts run without Java."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import redis.asyncio as aioredis

from gateway.archive.files import Archive
from gateway.archive.schema import Row, to_table
from gateway.archive.segments import file_name
from gateway.protocol import offsets
from gateway.redis_io import keys
from workers.archiver import Archiver, Policy

pyspark = pytest.importorskip("pyspark", reason="pyspark is in the [test] extra")
from workers import analytics  # noqa: E402  (imports pyspark)

JAVA = shutil.which("java") is not None or bool(os.environ.get("JAVA_HOME"))


@pytest.fixture(scope="module")
def spark():
    if not JAVA:
        pytest.skip("Spark needs Java (17+)")
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[1]")
        .appName("durable-streams-test")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        # Set by "the user": the job's s3a settings must leave it alone.
        .config("spark.hadoop.fs.s3a.endpoint.region", "explicit-1")
        .getOrCreate()
    )
    yield session
    session.stop()


async def test_spark_rows_are_the_appends(http, gateway, redis: aioredis.Redis, tmp_path, spark, capsys):
    archive_dir = str(tmp_path / "archive")
    name = f"spark-{uuid.uuid4().hex[:8]}"
    appended: dict[str, list[bytes]] = {f"{name}/events": [], f"{name}/raw": []}
    async with http.put(f"{gateway}/{name}/events", headers={"Content-Type": "application/json"}) as r:
        assert r.status == 201
    async with http.put(f"{gateway}/{name}/raw", headers={"Content-Type": "application/octet-stream"}) as r:
        assert r.status == 201
    for n in range(30):
        event = {"type": ["click", "view", "buy"][n % 3], "n": n, "big": 2**70 + n}
        headers = {"Content-Type": "application/json", "Producer-Id": "spark-test", "Producer-Epoch": "0",
                   "Producer-Seq": str(n)}  # fmt: skip
        async with http.post(f"{gateway}/{name}/events", data=json.dumps(event), headers=headers) as r:
            assert r.status == 200
        appended[f"{name}/events"].append(json.dumps(event, separators=(",", ":")).encode())
        raw = bytes([n]) * (n + 1) + b"\x00\xff"
        async with http.post(
            f"{gateway}/{name}/raw", data=raw, headers={"Content-Type": "application/octet-stream"}
        ) as r:
            assert r.status == 204
        appended[f"{name}/raw"].append(raw)

    policy = Policy(hot_bytes=0, hot_ms=0, min_bytes=0, max_delay_ms=0, file_bytes=300)
    archiver = Archiver(redis, Archive(archive_dir), policy)
    for stream in appended:
        await archiver.archive_stream(keys.stream_id(stream))
    assert archiver.files_written > 2  # several files, one of them replaced by merging

    rows = analytics.load(spark, archive_dir).orderBy("stream", "position").collect()
    for stream, pieces in appended.items():
        mine = [row for row in rows if row["stream"] == stream]
        assert [bytes(row["data"]) for row in mine] == pieces
        position = 0
        for row, piece in zip(mine, pieces, strict=True):
            assert row["position"] == position and row["offset"] == offsets.encode(position)
            position += len(piece)
            assert row["next_offset"] == offsets.encode(position)
            assert row["date"].isoformat() == time.strftime("%Y-%m-%d", time.gmtime())
    events = [row for row in rows if row["stream"].endswith("events")]
    assert [row["producer_seq"] for row in events] == list(range(30))
    assert all(json.loads(row["text"])["big"] == 2**70 + i for i, row in enumerate(events))
    assert all(row["text"] is None for row in rows if row["stream"].endswith("raw"))

    # The job itself, as `python -m workers.analytics` runs it.
    out = tmp_path / "report"
    assert analytics.main(["--archive", archive_dir, "--out", str(out)]) == 0
    hourly = [json.loads(line) for line in (out / "hourly.jsonl").read_text().splitlines()]
    assert sum(h["messages"] for h in hourly if h["stream"].endswith("events")) == 30
    assert sum(h["bytes"] for h in hourly if h["stream"].endswith("raw")) == sum(
        map(len, appended[f"{name}/raw"])
    )
    types = {
        r["value"]: r["count"] for r in map(json.loads, (out / "json_field.jsonl").read_text().splitlines())
    }
    assert types == {"click": 10, "view": 10, "buy": 10}
    assert "== hourly" in capsys.readouterr().out


# --- Time windows ---


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def test_durations_and_times() -> None:
    now = utc("2026-11-21T13:17:05.250")
    assert analytics.parse_duration("90s") == timedelta(seconds=90)
    assert analytics.parse_duration("1h30m") == timedelta(minutes=90)
    assert analytics.parse_duration("1d") == timedelta(days=1)
    assert analytics.parse_duration("1w") == timedelta(days=7)
    for bad in ("", "h", "1", "1x", "0h", "-1h", "1.5h", "1 h"):
        with pytest.raises(ValueError):
            analytics.parse_duration(bad)
    assert analytics.parse_time("2026-11-21", now) == utc("2026-11-21T00:00")
    assert analytics.parse_time("2026-11-21T12:30", now) == utc("2026-11-21T12:30")  # naive: UTC
    assert analytics.parse_time("2026-11-21T12:30Z", now) == utc("2026-11-21T12:30")
    assert analytics.parse_time("2026-11-21T14:30+02:00", now) == utc("2026-11-21T12:30")
    assert analytics.parse_time("2026-11-21T12:30:00.001", now) == utc("2026-11-21T12:30:00.001")
    assert analytics.parse_time("2h", now) == now - timedelta(hours=2)  # not aligned
    assert analytics.parse_time("1d", now) == now - timedelta(days=1)
    with pytest.raises(ValueError):
        analytics.parse_time("yesterday", now)


def test_windows_are_aligned_and_adjacent() -> None:
    hour = timedelta(hours=1)
    window = analytics.aligned_window
    assert window(hour, utc("2026-11-21T13:17:05.250")) == (utc("2026-11-21T12:00"), utc("2026-11-21T13:00"))
    # On the boundary itself the window is the one just ended, not the one starting.
    assert window(hour, utc("2026-11-21T13:00")) == (utc("2026-11-21T12:00"), utc("2026-11-21T13:00"))
    assert window(hour, utc("2026-11-21T12:59:59.999999")) == (
        utc("2026-11-21T11:00"),
        utc("2026-11-21T12:00"),
    )
    assert window(timedelta(days=1), utc("2026-11-21T00:30")) == (utc("2026-11-20"), utc("2026-11-21"))
    assert window(timedelta(minutes=15), utc("2026-11-21T13:44:59")) == (
        utc("2026-11-21T13:15"),
        utc("2026-11-21T13:30"),
    )
    # An hourly schedule (with jitter in the start time) covers every instant exactly once.
    runs = [utc("2026-11-21T00:17") + n * hour + timedelta(seconds=n * 7) for n in range(30)]
    windows = [window(hour, run) for run in runs]
    assert all(a[1] == b[0] for a, b in zip(windows, windows[1:], strict=False))
    assert all(end - start == hour for start, end in windows)


def test_date_dirs_touched_by_a_window() -> None:
    names = ["date=2026-11-20", "date=2026-11-21", "date=2026-11-22", "_temporary", "date=bad", "x"]
    pick = analytics.date_dirs
    assert pick(names, utc("2026-11-21T12:00"), utc("2026-11-21T13:00")) == ["date=2026-11-21"]
    # The end is excluded: a window ending at midnight does not touch the next day.
    assert pick(names, utc("2026-11-20T23:00"), utc("2026-11-21T00:00")) == ["date=2026-11-20"]
    assert pick(names, utc("2026-11-20T23:00"), utc("2026-11-21T00:00:00.001")) == [
        "date=2026-11-20",
        "date=2026-11-21",
    ]
    assert pick(names, utc("2026-11-21T00:00"), None) == ["date=2026-11-21", "date=2026-11-22"]
    assert pick(names, None, utc("2026-11-21T00:00")) == ["date=2026-11-20"]
    assert pick(names, utc("2030-01-01"), None) == []


def _write(archive: Archive, stream: str, times: list[str]) -> dict[int, datetime]:
    """Entries of a JSON stream appended at these times, one file per UTC day as the worker
    writes them; returns position -> append time."""
    rows, position = [], 0
    for n, when in enumerate(times):
        data = json.dumps({"type": "t", "n": n}).encode()
        rows.append(Row(position, data, int(utc(when).timestamp() * 1000)))
        position += len(data)
    by_day: dict[str, list[Row]] = {}
    for row in rows:
        by_day.setdefault(time.strftime("%Y-%m-%d", time.gmtime(row.append_ms / 1000)), []).append(row)
    for day_rows in by_day.values():
        start, end = day_rows[0].position, day_rows[-1].position + len(day_rows[-1].data)
        table = to_table(stream, "i1", "application/json", day_rows)
        archive.write(file_name(stream, "i1", start, end, day_rows[0].append_ms), table)
    return {row.position: datetime.fromtimestamp(row.append_ms / 1000, UTC) for row in rows}


TIMES = [
    "2026-11-20T12:00:00.000",
    "2026-11-21T11:59:59.999",  # just before the 12:00 window
    "2026-11-21T12:00:00.000",  # its first instant
    "2026-11-21T12:30:00.000",
    "2026-11-21T12:59:59.999",  # its last millisecond
    "2026-11-21T13:00:00.000",  # the next window's first instant
    "2026-11-21T23:30:00.000",
    "2026-11-22T00:00:00.000",
    "2026-11-22T00:30:00.000",
]


def test_windows_read_exactly_their_rows(spark, tmp_path, capsys) -> None:
    root = tmp_path / "archive"
    archive = Archive(str(root))
    appended = _write(archive, "w/events", TIMES)
    # A range on disk twice (a merge in progress): still one row per key.
    first = archive.files()[1]
    archive.write(first.replace(".parquet", "-copy.parquet"), archive.read(first))
    # A day outside every window below that no reader could read: the job must not touch it.
    (root / "date=2026-11-19" / "bucket=00").mkdir(parents=True)
    (root / "date=2026-11-19" / "bucket=00" / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(Exception, match="(?i)parquet"):
        analytics.load(spark, str(root)).count()  # the whole archive: reads it, fails

    def positions(since: str | None, until: str | None) -> set[int]:
        frame = analytics.load(spark, str(root), since and utc(since), until and utc(until))
        return {row["position"] for row in frame.select("position").collect()}

    def expected(since: str | None, until: str | None) -> set[int]:
        return {
            p for p, t in appended.items()
            if (since is None or t >= utc(since)) and (until is None or t < utc(until))
        }  # fmt: skip

    for since, until in [
        ("2026-11-21T12:00", "2026-11-21T13:00"),
        ("2026-11-21T11:59:59.999", "2026-11-21T12:00"),
        ("2026-11-21T12:59:59.999", "2026-11-21T13:00:00.001"),
        ("2026-11-21T23:00", "2026-11-22T01:00"),  # across midnight: two date directories
        ("2026-11-21", "2026-11-22"),
        ("2026-11-20", None),
        ("2030-01-01", None),  # no directory at all
    ]:
        assert positions(since, until) == expected(since, until), (since, until)
    assert len(expected("2026-11-21T12:00", "2026-11-21T13:00")) == 3
    assert len(expected("2026-11-21T23:00", "2026-11-22T01:00")) == 3

    # The job as the hourly CronJob runs it: at 13:17 it reads [12:00, 13:00).
    out = tmp_path / "report"
    now = utc("2026-11-21T13:17:05.250")
    assert analytics.main(["--archive", str(root), "--window", "1h", "--out", str(out)], now=now) == 0
    hourly = [json.loads(line) for line in (out / "hourly.jsonl").read_text().splitlines()]
    size = sum(len(json.dumps({"type": "t", "n": n})) for n in (2, 3, 4))  # TIMES[2:5]
    assert hourly == [{"stream": "w/events", "hour": "2026-11-21 12:00:00", "messages": 3, "bytes": size}]
    printed = capsys.readouterr().out
    assert "== window [2026-11-21T12:00:00+00:00, 2026-11-21T13:00:00+00:00)" in printed
    # --since/--until, relative to now, across midnight.
    now = utc("2026-11-22T02:00")
    argv = ["--archive", str(root), "--since", "3h", "--until", "1h", "--out", str(out)]
    assert analytics.main(argv, now=now) == 0
    hourly = [json.loads(line) for line in (out / "hourly.jsonl").read_text().splitlines()]
    assert [(h["hour"], h["messages"]) for h in hourly] == [
        ("2026-11-21 23:00:00", 1),
        ("2026-11-22 00:00:00", 2),
    ]
    # A window with nothing archived: empty reports, not an error.
    assert analytics.main(["--archive", str(root), "--date", "2030-01-01", "--out", str(out)]) == 0
    assert (out / "hourly.jsonl").read_text() == "" and (out / "json_field.jsonl").read_text() == ""


def test_window_arguments_are_checked(capsys) -> None:
    for argv in (
        ["--window", "1h", "--since", "2h"],
        ["--window", "1h", "--until", "2h"],
        ["--date", "2026-11-21", "--until", "2h"],
        ["--since", "1h", "--until", "2h"],  # since after until
        ["--since", "tomorrow"],
        ["--window", "0h"],
    ):
        with pytest.raises(SystemExit) as exit_:
            analytics.main(["--archive", "/nonexistent", *argv])
        assert exit_.value.code == 2, argv
    assert "--since" in capsys.readouterr().err


# --- s3a ---

MINIO = {"AWS_ENDPOINT_URL": "http://minio:9000", "AWS_ACCESS_KEY_ID": "ak", "AWS_SECRET_ACCESS_KEY": "sk"}
S3A = "spark.hadoop.fs.s3a."


def test_s3a_settings_from_the_archive_workers_environment() -> None:
    settings = analytics.s3a_settings
    assert settings({}, {}) == {}
    assert settings(MINIO, {}) == {
        S3A + "endpoint": "http://minio:9000",
        S3A + "path.style.access": "true",
        S3A + "connection.ssl.enabled": "false",
        S3A + "endpoint.region": "us-east-1",  # what botocore signs with when none is set
        S3A + "access.key": "ak",
        S3A + "secret.key": "sk",
        S3A + "aws.credentials.provider": "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider",
    }
    env = {"AWS_ENDPOINT_URL": "https://s3.example:443", "AWS_ENDPOINT_URL_S3": "https://objects.example",
           "AWS_DEFAULT_REGION": "eu-west-1", "AWS_REGION": "eu-west-3"}  # fmt: skip
    assert settings(env, {}) == {
        S3A + "endpoint": "https://objects.example",  # the S3-specific variable wins
        S3A + "path.style.access": "true",
        S3A + "connection.ssl.enabled": "true",
        S3A + "endpoint.region": "eu-west-3",  # AWS_REGION before AWS_DEFAULT_REGION
    }
    # AWS itself: no endpoint, so neither path-style nor a made-up region.
    assert settings({"AWS_DEFAULT_REGION": "eu-west-1"}, {}) == {S3A + "endpoint.region": "eu-west-1"}
    assert settings({"AWS_ACCESS_KEY_ID": "ak"}, {}) == {}  # half a key pair is none
    temporary = settings(
        {"AWS_ACCESS_KEY_ID": "ak", "AWS_SECRET_ACCESS_KEY": "sk", "AWS_SESSION_TOKEN": "t"}, {}
    )
    assert temporary == {
        S3A + "access.key": "ak",
        S3A + "secret.key": "sk",
        S3A + "session.token": "t",
        S3A + "aws.credentials.provider": "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider",
    }


def test_s3a_settings_leave_explicit_spark_conf_alone() -> None:
    settings = analytics.s3a_settings
    # An endpoint in the Spark conf: nothing of the environment's endpoint is mixed in.
    assert settings(MINIO, {S3A + "endpoint": "https://other"}) == {
        S3A + "access.key": "ak",
        S3A + "secret.key": "sk",
        S3A + "aws.credentials.provider": "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider",
    }
    # Any credentials setting in the conf (e.g. a provider for IAM roles): no keys from the env.
    explicit = {
        S3A + "aws.credentials.provider": "software.amazon.awssdk.auth.credentials.DefaultCredentialsProvider"
    }
    assert not any("key" in k or "provider" in k for k in settings(MINIO, explicit))
    assert S3A + "endpoint.region" not in settings(
        {**MINIO, "AWS_REGION": "x"}, {S3A + "endpoint.region": "y"}
    )
    assert analytics.hadoop_url("s3://bucket/streams") == "s3a://bucket/streams"
    assert analytics.hadoop_url("s3a://bucket/streams") == "s3a://bucket/streams"
    assert analytics.hadoop_url("/data/archive") == "/data/archive"


def test_configure_s3a_sets_the_sessions_hadoop_configuration(spark) -> None:
    hadoop = spark.sparkContext._jsc.hadoopConfiguration()
    env = {**MINIO, "AWS_REGION": "eu-west-3"}
    try:
        applied = analytics.configure_s3a(spark, env)
        assert hadoop.get("fs.s3a.endpoint") == "http://minio:9000"
        assert hadoop.get("fs.s3a.path.style.access") == "true"
        assert hadoop.get("fs.s3a.connection.ssl.enabled") == "false"
        assert hadoop.get("fs.s3a.access.key") == "ak"
        # The session's builder set the region: the environment's does not replace it.
        assert S3A + "endpoint.region" not in applied
        assert hadoop.get("fs.s3a.endpoint.region") == "explicit-1"
    finally:
        for key in analytics.s3a_settings(env, {}):
            if key != S3A + "endpoint.region":
                hadoop.unset(key.removeprefix("spark.hadoop."))
