"""Spark over the same data two ways: the archive's Parquet files read by Spark directly,
and the live data source (workers/spark_source.py) reading through the gateway.

    python -m loadtest.spark_source [--json-mib 64] [--bytes-mib 64] [--streams 8]

Starts our gateway (embedded Redis, AOF fsync always) in a fresh data dir, fills
``--streams`` JSON streams (messages of about 200 bytes, appended 1,000 at a time) and as
many byte streams (64 KiB appends of random data), then runs one aggregate per read
(``count(*)``, ``sum(length(data))``: every row and byte is materialised) with Spark in
local mode (``--cores``, 2 by default), each the best of ``--repeat`` runs:

* live source, no streams: a prefix with nothing under it, the fixed cost of a read
  (Spark plans a Python data source in a Python process of its own; the listing);
* live source, hot: everything still in Redis;
* live source, archived: after the archive worker moved everything to Parquet (hot
  window 0), the gateway serving the reads from the files (first run cold, then its
  row-group cache warm);
* Parquet, direct: ``spark.read.parquet`` on the archive (the same files), and
  ``workers.analytics.load`` (which also drops the rows a merge can leave twice).

Rows differ for byte streams: the archive holds one row per append, the live source one
row per read chunk (up to 4 MiB). Prints a table; writes loadtest/results/spark_source.json
and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from gateway.archive.files import Archive
from gateway.cli.embedded import EmbeddedRedis
from gateway.redis_io import keys
from workers.archiver import Archiver, Policy

from .servers import start

RESULTS = Path(__file__).resolve().parent / "results"


async def fill(base: str, prefix: str, streams: int, json_mib: int, bytes_mib: int) -> dict[str, str]:
    """The streams and their content types; JSON in batches of 1,000 messages."""
    kinds: dict[str, str] = {}
    async with aiohttp.ClientSession() as http:
        for i in range(streams):
            for kind, content_type in (("j", "application/json"), ("b", "application/octet-stream")):
                path = f"{prefix}{kind}{i:02d}"
                async with http.put(f"{base}/{path}", headers={"Content-Type": content_type}) as r:
                    assert r.status == 201, r.status
                kinds[path] = content_type
        per_stream = (json_mib << 20) // streams
        for i in range(streams):
            written, n = 0, 0
            while written < per_stream:
                batch = [
                    {"n": n + k, "type": ("click", "view", "buy")[k % 3], "user": f"u{(n + k) % 9973}",
                     "payload": os.urandom(60).hex()}
                    for k in range(1000)
                ]  # fmt: skip
                body = json.dumps(batch).encode()
                async with http.post(f"{base}/{prefix}j{i:02d}", data=body,
                                     headers={"Content-Type": "application/json"}) as r:  # fmt: skip
                    assert r.status in (200, 204), r.status
                written += len(body)
                n += 1000
        piece = 64 << 10
        for i in range(streams):
            for _ in range((bytes_mib << 20) // streams // piece):
                async with http.post(f"{base}/{prefix}b{i:02d}", data=os.urandom(piece),
                                     headers={"Content-Type": "application/octet-stream"}) as r:  # fmt: skip
                    assert r.status in (200, 204), r.status
    return kinds


async def archive_all(redis_url: str, archive_dir: str, paths: list[str]) -> float:
    client = aioredis.Redis.from_url(redis_url)
    policy = Policy(hot_bytes=0, hot_ms=0, min_bytes=0, max_delay_ms=0, file_bytes=128 << 20)
    archiver = Archiver(client, Archive(archive_dir), policy)
    started = time.monotonic()
    for path in paths:
        await archiver.archive_stream(keys.stream_id(path))
    seconds = time.monotonic() - started
    await client.aclose()
    return seconds


def measure(frame: Any, repeat: int) -> dict[str, float]:
    """The best of ``repeat`` runs of count(*) and sum(length(data)) over ``frame``."""
    from pyspark.sql import functions as F

    best: dict[str, float] = {}
    for _ in range(repeat):
        started = time.monotonic()
        row = frame.agg(F.count("*").alias("rows"), F.sum(F.length("data")).alias("bytes")).collect()[0]
        seconds = time.monotonic() - started
        if not best or seconds < best["seconds"]:
            best = {"rows": row["rows"], "bytes": row["bytes"] or 0, "seconds": seconds}
    best["rows_per_second"] = best["rows"] / best["seconds"]
    best["mb_per_second"] = best["bytes"] / best["seconds"] / 1e6
    return best


def run_spark(base: str, prefix: str, archive_dir: str, cores: int, repeat: int, archived: bool) -> dict:
    from pyspark.sql import SparkSession

    from workers import analytics
    from workers.spark_source import DurableStreamsDataSource

    spark = (
        SparkSession.builder.master(f"local[{cores}]")
        .appName("durable-streams-spark-source-bench")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(DurableStreamsDataSource)

    def live(kind: str) -> Any:
        return (
            spark.read.format("durable-streams")
            .option("url", base)
            .option("prefix", f"{prefix}{kind}")
            .load()
        )

    out: dict[str, dict] = {}
    measure(live("j").limit(10), 1)  # Python workers started, modules imported
    if not archived:
        # What any read of the source pays before its first byte: Spark plans it in a Python
        # process of its own, which lists the streams.
        nothing = {k: measure(live(f"{k}-none"), repeat) for k in ("j", "b")}
        out["live source, no streams (the fixed cost: planning)"] = nothing
        out["live source, hot (Redis)"] = {k: measure(live(k), repeat) for k in ("j", "b")}
        return out
    out["live source, archived: first read (cold)"] = {k: measure(live(k), 1) for k in ("j", "b")}
    out["live source, archived: again (warm)"] = {k: measure(live(k), repeat) for k in ("j", "b")}
    files = spark.read.option("basePath", archive_dir).parquet(archive_dir)
    out["Parquet direct (spark.read.parquet)"] = {
        k: measure(files.where(files.stream.startswith(f"{prefix}{k}")), repeat) for k in ("j", "b")
    }
    loaded = analytics.load(spark, archive_dir)
    out["Parquet via analytics.load (deduplicated)"] = {
        k: measure(loaded.where(loaded.stream.startswith(f"{prefix}{k}")), repeat) for k in ("j", "b")
    }
    return out


async def bench(streams: int, json_mib: int, bytes_mib: int, cores: int, repeat: int) -> dict:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # Spark's workers import the source
    load_before = os.getloadavg()[0]
    with start("ours") as server:
        redis_url = EmbeddedRedis(server.data_dir, binary="redis-server").url
        archive_dir = str(Path(server.data_dir) / "archive")
        prefix = f"bench-{uuid.uuid4().hex[:6]}/"
        started = time.monotonic()
        kinds = await fill(server.base_url, prefix, streams, json_mib, bytes_mib)
        fill_seconds = time.monotonic() - started
        hot = await asyncio.to_thread(run_spark, server.base_url, prefix, archive_dir, cores, repeat, False)
        archive_seconds = await archive_all(redis_url, archive_dir, sorted(kinds))
        cold = await asyncio.to_thread(run_spark, server.base_url, prefix, archive_dir, cores, repeat, True)
    return {
        "setup": {
            "streams": f"{streams} JSON + {streams} bytes",
            "json_mib": json_mib,
            "bytes_mib": bytes_mib,
            "spark": f"local[{cores}]",
            "fill_seconds": round(fill_seconds, 1),
            "archive_seconds": round(archive_seconds, 1),
            "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
            "load_average_before": round(load_before, 1),  # other work on the machine meanwhile
            "load_average_after": round(os.getloadavg()[0], 1),
        },
        "reads": hot | cold,
    }


def table(result: dict) -> str:
    lines = [
        "| read | JSON rows | JSON s | JSON rows/s | JSON MB/s | byte rows | byte s | byte MB/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, kinds in result["reads"].items():
        j, b = kinds["j"], kinds["b"]
        lines.append(
            f"| {name} | {j['rows']:,} | {j['seconds']:.2f} | {j['rows_per_second']:,.0f} "
            f"| {j['mb_per_second']:.1f} | {b['rows']:,} | {b['seconds']:.2f} | {b['mb_per_second']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=8, help="JSON streams, and as many byte streams")
    parser.add_argument("--json-mib", type=int, default=64, help="JSON data in all (MiB)")
    parser.add_argument("--bytes-mib", type=int, default=64, help="byte-stream data in all (MiB)")
    parser.add_argument("--cores", type=int, default=2, help="Spark local[N]")
    parser.add_argument("--repeat", type=int, default=2, help="runs per read; the best counts")
    parser.add_argument("--out", default=str(RESULTS / "spark_source.json"))
    args = parser.parse_args()
    result = asyncio.run(bench(args.streams, args.json_mib, args.bytes_mib, args.cores, args.repeat))
    text = table(result)
    print(json.dumps(result["setup"]))
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))


def markdown(result: dict) -> str:
    setup = ", ".join(f"{k}: {v}" for k, v in result["setup"].items())
    return (
        "# Spark: the live source vs the archive's Parquet (`python -m loadtest.spark_source`)\n\n"
        f"{setup}\n\n"
        "Each read: `count(*)` and `sum(length(data))` over the JSON streams, then over the byte\n"
        "streams, best of the runs (the cold read: one run). MB are of `data`. The archive holds a row\n"
        "per append for byte streams, the live source a row per read chunk (up to 4 MiB). The gateway,\n"
        "Spark's JVM and its two Python workers share the machine's 2 cores, with other work\n"
        "running (load average above): figures move by 2x between runs.\n\n"
        f"{table(result)}\n"
    )


if __name__ == "__main__":
    main()
