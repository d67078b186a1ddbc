"""State compaction (docs/compaction.md): what a late joiner downloads before and after, and
what a compaction run costs the appends beside it.

    .venv/bin/python -m loadtest.compaction [--keys 1000] [--versions 1000] [--writers 16]

Our server (one process, embedded Redis, fsync always) gets a stream created with
``Stream-Compaction: state`` and ``--keys`` rows written ``--versions`` times each (State
Protocol upserts of whole rows, ``--keys`` events a POST). Measured:

* a late joiner reading it from ``offset=-1`` to the tail (bytes and seconds; median of 3),
  before and after an archive worker (``durable-streams archive``, compaction lag 0, archiving
  nothing) compacted it, and that both end with the same rows;
* Redis memory (``used_memory``) and the stream's log (``MEMORY USAGE``) before and after;
* the run: events folded per second (the worker's time from its hint to the fold point at the
  tail);
* its cost to appends: ``--writers`` concurrent writers appending small JSON messages to 100
  other streams, appends/s and p99, for as long as the run takes, side by side with the same
  load with no run (one run each, the no-run window right after the run's, so both see the
  same machine).

Printed, and written to ``loadtest/results/compaction.{json,md}``.

    .venv/bin/python -m loadtest.compaction --archived [--keys 1000] [--rounds 20]

measures compaction of the archive instead (a deep run: docs/compaction.md): ``--rounds``
rounds of five versions of every row, each compacted in Redis and archived (everything:
hot window 0) by an archive worker whose deep runs are held back (``--compaction-archive-ratio``
1e9), so the archive keeps each round's newest versions; then one worker with deep runs on.
Measured: a late joiner (cold reads) before and after, the archive's bytes on disk, the deep
run's time. Written to ``loadtest/results/compaction-archive.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import redis.asyncio as aioredis

from gateway.cli.embedded import redis_url_or_running
from gateway.redis_io import keys

from .report import publish
from .servers import start, use_uvloop, worker

MIB = 1024 * 1024
JSON = {"Content-Type": "application/json"}


def _event(key: int, version: int) -> dict[str, Any]:
    return {
        "type": "row",
        "key": f"row-{key}",
        "value": {"name": f"row {key}", "version": version, "score": version * 7 % 1000, "ok": True},
        "headers": {"operation": "upsert" if version else "insert"},
    }


async def _replay(http: aiohttp.ClientSession, url: str) -> tuple[float, int, dict[str, Any]]:
    """A late joiner: seconds, bytes, and the rows it ends with."""
    started, size, offset, rows = time.perf_counter(), 0, "-1", {}
    while True:
        async with http.get(url, params={"offset": offset}) as r:
            assert r.status == 200, r.status
            body = await r.read()
            size += len(body)
            for event in orjson.loads(body):
                rows[event["key"]] = event["value"]
            offset = r.headers["Stream-Next-Offset"]
            if r.headers.get("Stream-Up-To-Date") == "true":
                return time.perf_counter() - started, size, rows


async def _appends(
    http: aiohttp.ClientSession, base: str, writers: int, until: asyncio.Event
) -> dict[str, float]:
    """Small appends by ``writers`` concurrent writers to 100 streams until ``until``."""
    latencies: list[float] = []
    started = time.perf_counter()

    async def one(n: int) -> None:
        i = 0
        while not until.is_set():
            body = orjson.dumps([{"writer": n, "i": i}])
            t = time.perf_counter()
            async with http.post(f"{base}/load-{(n * 7 + i) % 100}", data=body, headers=JSON) as r:
                assert r.status in (200, 204), r.status
            latencies.append(time.perf_counter() - t)
            i += 1

    await asyncio.gather(*(one(n) for n in range(writers)))
    seconds = time.perf_counter() - started
    latencies.sort()
    return {
        "appends_per_second": round(len(latencies) / seconds),
        "p50_ms": round(latencies[len(latencies) // 2] * 1000, 2),
        "p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 2),
        "seconds": round(seconds, 1),
    }


async def _memory(redis: aioredis.Redis, sid: str) -> tuple[int, int]:
    info = await redis.info("memory")
    log = await redis.memory_usage(keys.stream_keys(sid)[1], samples=0) or 0
    return int(info["used_memory"]), int(log)


async def run(n_keys: int, versions: int, writers: int) -> dict[str, Any]:
    with start("ours") as server:
        base = server.base_url
        redis = aioredis.Redis.from_url(redis_url_or_running(None, server.data_dir))
        url, sid = f"{base}/bench/state", keys.stream_id("bench/state")
        timeout = aiohttp.ClientTimeout(total=3600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            async with http.put(url, headers={**JSON, "Stream-Compaction": "state"}) as r:
                assert r.status == 201, await r.text()
            for n in range(100):
                async with http.put(f"{base}/load-{n}", headers=JSON) as r:
                    assert r.status == 201
            started = time.perf_counter()
            for version in range(versions):
                body = orjson.dumps([_event(k, version) for k in range(n_keys)])
                async with http.post(url, data=body, headers=JSON) as r:
                    assert r.status in (200, 204), await r.text()
            written_seconds = time.perf_counter() - started
            before = [await _replay(http, url) for _ in range(3)]
            memory_before = await _memory(redis, sid)

            # The run, with appends beside it; then the same appends with no run.
            done = asyncio.Event()
            load = asyncio.create_task(_appends(http, base, writers, done))
            await asyncio.sleep(2)  # the load settles first
            options = ("--compaction-lag-seconds", "0", "--compaction-lag-bytes", "0",
                       "--archive-hot-bytes", str(1 << 40), "--archive-interval", "0.05")  # fmt: skip
            with worker(server, "archive", *options):
                run_started = time.perf_counter()
                await redis.zadd(keys.ARCHIVE_HINTS, {sid: 0})
                tail = int(await redis.hget(keys.stream_keys(sid)[0], "tail"))
                while int(await redis.hget(keys.stream_keys(sid)[0], "cto") or 0) < tail:
                    await asyncio.sleep(0.05)
                run_seconds = time.perf_counter() - run_started
                done.set()
                during = await load
            quiet = asyncio.Event()
            load = asyncio.create_task(_appends(http, base, writers, quiet))
            await asyncio.sleep(max(2.0, run_seconds))
            quiet.set()
            without = await load

            after = [await _replay(http, url) for _ in range(3)]
            memory_after = await _memory(redis, sid)
        await redis.aclose()
    assert before[0][2] == after[0][2], "a late joiner's rows differ after compaction"
    events = n_keys * versions
    return {
        "keys": n_keys,
        "versions": versions,
        "events": events,
        "write_seconds": round(written_seconds, 1),
        "replay_before": {
            "bytes": before[0][1],
            "seconds": round(statistics.median(t for t, _, _ in before), 3),
        },
        "replay_after": {
            "bytes": after[0][1],
            "seconds": round(statistics.median(t for t, _, _ in after), 4),
        },
        "redis_used_memory": {"before": memory_before[0], "after": memory_after[0]},
        "stream_log_memory": {"before": memory_before[1], "after": memory_after[1]},
        "run_seconds": round(run_seconds, 2),
        "events_folded_per_second": round(events / run_seconds),
        "appends_during_run": during,
        "appends_without_run": without,
    }


def _replayed(replays: list[tuple[float, int, dict[str, Any]]]) -> dict[str, Any]:
    """A late joiner's bytes and median seconds, of three."""
    return {"bytes": replays[0][1], "seconds": round(statistics.median(t for t, _, _ in replays), 4)}


async def run_archived(n_keys: int, rounds: int) -> dict[str, Any]:
    with start("ours") as server:
        redis = aioredis.Redis.from_url(redis_url_or_running(None, server.data_dir))
        url, sid = f"{server.base_url}/bench/archived", keys.stream_id("bench/archived")
        meta = keys.stream_keys(sid)[0]
        archive = Path(server.data_dir, "archive")
        common = ("--compaction-lag-seconds", "0", "--compaction-lag-bytes", "0", "--archive-hot-bytes", "0",
                  "--archive-hot-seconds", "0", "--archive-min-bytes", "0", "--archive-max-delay", "0",
                  "--archive-interval", "0.05", "--compaction-interval-seconds", "0")  # fmt: skip

        async def until(field: str, value: int) -> None:
            await redis.zadd(keys.ARCHIVE_HINTS, {sid: 0})
            while int(await redis.hget(meta, field) or 0) < value:
                await asyncio.sleep(0.05)

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
            async with http.put(url, headers={**JSON, "Stream-Compaction": "state"}) as r:
                assert r.status == 201, await r.text()
            with worker(server, "archive", *common, "--compaction-archive-ratio", "1e9"):
                for n in range(rounds):
                    for version in range(n * 5, n * 5 + 5):
                        body = orjson.dumps([_event(k, version) for k in range(n_keys)])
                        async with http.post(url, data=body, headers=JSON) as r:
                            assert r.status in (200, 204), await r.text()
                    await until("arch", int(await redis.hget(meta, "tail")))
            before = [await _replay(http, url) for _ in range(3)]
            disk_before = sum(f.stat().st_size for f in archive.rglob("*.parquet"))
            with worker(server, "archive", *common, "--compaction-archive-ratio", "0"):
                started = time.perf_counter()
                await redis.hset(meta, "cak", 0)  # (what the held-back runs kept: due now)
                await until("cac", int(await redis.hget(meta, "tail")))
                deep_seconds = time.perf_counter() - started
            after = [await _replay(http, url) for _ in range(3)]
            disk_after = sum(f.stat().st_size for f in archive.rglob("*.parquet"))
        await redis.aclose()
    assert before[0][2] == after[0][2], "a late joiner's rows differ after the deep run"
    return {
        "keys": n_keys,
        "rounds": rounds,
        "events_written": n_keys * rounds * 5,
        "replay_before": _replayed(before),
        "replay_after": _replayed(after),
        "archive_bytes": {"before": disk_before, "after": disk_after},
        "deep_run_seconds": round(deep_seconds, 2),
    }


def report_archived(r: dict[str, Any]) -> list[str]:
    b, a, d = r["replay_before"], r["replay_after"], r["archive_bytes"]
    return [
        f"A State stream of {r['keys']:,} rows, {r['rounds']} rounds of 5 versions each "
        f"({r['events_written']:,} events), every round compacted in Redis and archived; then one "
        "deep run (docs/compaction.md):",
        "",
        "| | before the deep run | after | |",
        "|---|---:|---:|---:|",
        f"| a late joiner reads (from -1, cold) | {b['bytes'] / 1024:,.1f} KiB in "
        f"{b['seconds'] * 1000:.0f} ms | {a['bytes'] / 1024:,.1f} KiB in {a['seconds'] * 1000:.0f} ms | "
        f"{b['bytes'] / max(1, a['bytes']):,.1f}x fewer bytes |",
        f"| the archive on disk (Parquet, zstd) | {d['before'] / 1024:,.1f} KiB | "
        f"{d['after'] / 1024:,.1f} KiB | |",
        "",
        f"The deep run (hint to done, one worker process starting included): {r['deep_run_seconds']:.1f} s.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--versions", type=int, default=1000)
    parser.add_argument("--writers", type=int, default=16)
    parser.add_argument("--archived", action="store_true", help="measure a deep run instead")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    use_uvloop()
    if args.archived:
        result = asyncio.run(run_archived(args.keys, args.rounds))
        publish(args.out or "loadtest/results/compaction-archive", result, report_archived(result))
        return
    r = asyncio.run(run(args.keys, args.versions, args.writers))
    b, a = r["replay_before"], r["replay_after"]
    mb, ma = r["redis_used_memory"], r["stream_log_memory"]
    d, w = r["appends_during_run"], r["appends_without_run"]
    lines = [
        f"A State stream of {r['keys']:,} rows x {r['versions']:,} versions ({r['events']:,} events), "
        "compacted by one archive worker (lag 0):",
        "",
        "| | before | after | |",
        "|---|---:|---:|---:|",
        f"| a late joiner reads (from -1) | {b['bytes'] / MIB:,.1f} MiB in {b['seconds']:.2f} s | "
        f"{a['bytes'] / 1024:,.1f} KiB in {a['seconds'] * 1000:.1f} ms | "
        f"{b['bytes'] / max(1, a['bytes']):,.0f}x fewer bytes |",
        f"| Redis used_memory | {mb['before'] / MIB:,.1f} MiB | {mb['after'] / MIB:,.1f} MiB | |",
        f"| the stream's log (MEMORY USAGE) | {ma['before'] / MIB:,.1f} MiB | "
        f"{ma['after'] / 1024:,.1f} KiB | |",
        "",
        f"The run: {r['run_seconds']:.1f} s, {r['events_folded_per_second']:,} events folded per second.",
        "",
        "| small appends to 100 other streams | appends/s | p50 | p99 |",
        "|---|---:|---:|---:|",
        f"| during the run | {d['appends_per_second']:,} | {d['p50_ms']} ms | {d['p99_ms']} ms |",
        f"| with no run | {w['appends_per_second']:,} | {w['p50_ms']} ms | {w['p99_ms']} ms |",
    ]
    publish(args.out or "loadtest/results/compaction", r, lines)


if __name__ == "__main__":
    main()
