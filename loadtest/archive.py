"""Archive benchmark: Redis → Parquet throughput, cold vs hot catch-up reads,
and Redis memory before and after archiving one large stream.

    python -m loadtest.archive [--megabytes 256] [--piece-kib 64]

Starts our gateway (embedded Redis, AOF fsync always) in a fresh data dir,
fills one byte stream, reads it from the start (hot: all in Redis), archives
it with the real worker code (hot window 0), reads it again twice (cold:
files fetched and decoded; then warm: the gateway's file cache hit), and
prints one table plus JSON (loadtest/results/archive.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis

from gateway.archive.files import Archive
from gateway.cli.embedded import EmbeddedRedis
from gateway.redis_io import keys
from workers.archiver import Archiver, Policy

from .appends import catch_up, fill
from .servers import start, use_uvloop


async def used_memory_mb(client: aioredis.Redis) -> float:
    return round((await client.info("memory"))["used_memory"] / 2**20, 1)


async def bench(megabytes: int, piece_kib: int) -> dict:
    with start("ours") as server:
        redis_url = EmbeddedRedis(server.data_dir, binary="redis-server").url
        client = aioredis.Redis.from_url(redis_url)
        name = f"archive-{uuid.uuid4().hex[:8]}"
        url = f"{server.base_url}/{name}"
        async with aiohttp.ClientSession() as http:
            started = time.monotonic()
            await fill(http, url, megabytes, piece_kib << 10)
            fill_seconds = time.monotonic() - started
            memory_before = await used_memory_mb(client)

            hot = await asyncio.to_thread(catch_up, url)

            archive = Archive(str(Path(server.data_dir) / "archive"))
            policy = Policy(hot_bytes=0, hot_ms=0, min_bytes=0, max_delay_ms=0, file_bytes=128 << 20)
            archiver = Archiver(client, archive, policy)
            await archiver.scripts.load()
            started = time.monotonic()
            await archiver.archive_stream(keys.stream_id(name))
            archive_seconds = time.monotonic() - started
            memory_after = await used_memory_mb(client)
            files = archive.files()
            file_mb = sum(archive.fs.size(archive.path(f)) for f in files) / 2**20

            cold = await asyncio.to_thread(catch_up, url)
            warm = await asyncio.to_thread(catch_up, url)
        await client.aclose()
    total = megabytes << 20
    assert hot[0] == cold[0] == warm[0] == total, (hot[0], cold[0], warm[0], total)

    def rate(seconds: float) -> float:
        return round(total / seconds / 1e6, 1)

    return {
        "stream_mib": megabytes,
        "append_kib": piece_kib,
        "fill_mb_per_second": rate(fill_seconds),
        "archive_mb_per_second": rate(archive_seconds),
        "archive_seconds": round(archive_seconds, 2),
        "archive_files": len(files),
        "archive_file_mib": round(file_mb, 1),
        "hot_read_mb_per_second": rate(hot[2]),
        "cold_read_mb_per_second": rate(cold[2]),
        "warm_read_mb_per_second": rate(warm[2]),
        "redis_used_memory_mib_before": memory_before,
        "redis_used_memory_mib_after": memory_after,
    }


def main() -> None:
    use_uvloop()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--megabytes", type=int, default=256, help="size of the stream (MiB)")
    parser.add_argument("--piece-kib", type=int, default=64, help="size of each append (KiB)")
    parser.add_argument("--out", default="loadtest/results/archive.json")
    args = parser.parse_args()
    result = asyncio.run(bench(args.megabytes, args.piece_kib))
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
