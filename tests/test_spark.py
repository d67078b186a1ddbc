"""Spark (local mode) reads an archive the real gateway and worker produced."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid

import pytest
import redis.asyncio as aioredis

from gateway.archive.files import Archive
from gateway.storage import keys
from workers.archiver import Archiver, Policy

pyspark = pytest.importorskip("pyspark", reason="pyspark is in the [test] extra")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("Spark needs Java (17+)", allow_module_level=True)


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[1]")
        .appName("durable-streams-test")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    yield session
    session.stop()


async def test_spark_rows_are_the_appends(http, gateway, redis: aioredis.Redis, tmp_path, spark, capsys):
    from workers import analytics

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
            assert row["position"] == position and row["offset"] == f"{0:016d}_{position:016d}"
            position += len(piece)
            assert row["next_offset"] == f"{0:016d}_{position:016d}"
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
