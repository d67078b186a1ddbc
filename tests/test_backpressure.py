"""Write backpressure: above a Redis memory mark (or an archive lag) writes get 503 with
Retry-After, reads, live reads and deletes go on, and writes resume once an archive
worker has moved the data out.

The rules alone first (the mark's spellings, its limit, the hysteresis, which requests
are writes), then a small Redis of the test's own (``CONFIG SET maxmemory``) filled to
the mark, the archive lag of a worker that is announced but does not work, and a Redis
Cluster primary over its mark while the other primaries' streams take writes.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import make_mocked_request
from prometheus_client import REGISTRY

from gateway.archive.files import Archive
from gateway.cli.embedded import EmbeddedRedis
from gateway.config import MemoryMark, memory_mark
from gateway.features.backpressure import RESUME, WritePause, memory_limit, over
from gateway.features.hints import HintKeys
from gateway.http.guard import stores_data
from gateway.redis_io import keys
from workers.archiver import Archiver, Policy

from .cluster import Cluster
from .conftest import free_port, read_all, serving

MB = 1 << 20
OCTETS = {"Content-Type": "application/octet-stream"}
# Everything archived at once, one file per round.
ALL_NOW = Policy(hot_bytes=0, hot_ms=0, min_bytes=0, max_delay_ms=0, file_bytes=256 * MB)


# -- the rules ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw,mark",
    [
        ("512mb", MemoryMark(bytes=512 * MB)),
        ("2GB", MemoryMark(bytes=2 << 30)),
        ("2g", MemoryMark(bytes=2 * 10**9)),  # redis.conf: g is 10^9, gb 2^30
        ("1024 KiB", MemoryMark(bytes=MB)),
        ("1_048_576", MemoryMark(bytes=MB)),
        (" 85% ", MemoryMark(share=0.85)),
        ("100%", MemoryMark(share=1.0)),
        ("0", MemoryMark()),
        ("Off", MemoryMark()),
    ],
)
def test_memory_marks_are_sizes_or_shares_of_maxmemory(raw: str, mark: MemoryMark) -> None:
    assert memory_mark(raw) == mark


BAD_MARKS = ["lots", "0%", "101%", "nan%", "%", "-5mb", "1.5gb", "5tb", "90 %%", "", "90", "64kb"]


@pytest.mark.parametrize("raw", BAD_MARKS)  # "90": 90 bytes would pause every write
def test_bad_memory_marks_are_refused(raw: str) -> None:
    with pytest.raises(ValueError):
        memory_mark(raw)


def test_the_mark_in_bytes_and_its_hysteresis() -> None:
    assert memory_limit(0, 0.9, 1000) == 900
    assert memory_limit(0, 0.9, 0) is None  # a share of a Redis without maxmemory: no mark
    assert memory_limit(500, 0.0, 0) == 500 and memory_limit(500, 0.0, 10_000) == 500
    assert memory_limit(0, 0.0, 1000) is None
    assert RESUME == 0.95
    paused, seen = False, []
    for used in (800, 900, 901, 890, 855, 854, 899, 901):  # pause above 900, resume below 855
        paused = over(paused, used, 900)
        seen.append(paused)
    assert seen == [False, False, True, True, True, False, False, True]
    assert not over(True, 10**12, None)  # no mark: never paused


@pytest.mark.parametrize(
    "method,headers,writes",
    [
        ("PUT", {}, True),
        ("POST", {"Content-Length": "5"}, True),
        ("POST", {"Content-Length": "5", "Stream-Closed": "true"}, True),  # data, then the close
        ("POST", {"Transfer-Encoding": "chunked", "Stream-Closed": "true"}, True),  # a body may come
        ("POST", {"Content-Length": "0", "Stream-Closed": "true"}, False),  # a close alone
        ("POST", {"Content-Length": "0"}, True),  # a 400 in the handler
        ("GET", {}, False),
        ("HEAD", {}, False),
        ("DELETE", {}, False),  # frees memory
        ("OPTIONS", {}, False),
    ],
)
def test_which_requests_are_writes(method: str, headers: dict[str, str], writes: bool) -> None:
    assert stores_data(make_mocked_request(method, "/v1/stream/s", headers=headers)) is writes


async def test_a_redis_away_decides_nothing() -> None:
    """Paused, then Redis cannot be reached: no pause (stream requests get 503 anyway)."""
    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=1)
    pause = WritePause(client, HintKeys(cluster=False), memory="1mb", archive_lag=1.0, retry_after=1)
    pause.full, pause.behind, pause.active = frozenset({"127.0.0.1:1"}), True, True
    await pause.poll()
    assert not pause.active and pause.refusal("s") is None
    await client.aclose()


# -- one Redis ------------------------------------------------------------------------------


@pytest.fixture
async def small_redis(own_redis: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    """The test's own Redis with a 64 MiB ceiling (noeviction, as the embedded one has)."""
    client = aioredis.Redis.from_url(own_redis.url)
    await client.config_set("maxmemory", 64 * MB)
    assert (await client.info("memory"))["maxmemory_policy"] == "noeviction"
    yield client
    await client.aclose()


async def _used(redis: aioredis.Redis) -> int:
    return int((await redis.info("memory"))["used_memory"])


async def _metric(http: aiohttp.ClientSession, base: str, line_start: str) -> float:
    async with http.get(base.removesuffix("/v1/stream") + "/metrics") as r:
        text = await r.text()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)]
    return values[0] if values else -1.0


async def _paused_after_a_poll(redis: aioredis.Redis, mark: str) -> float | None:
    """ds_write_backpressure{reason="memory"} just after a poll of ``redis``, read before
    any other gateway of this process (the session's) polls and sets it again."""
    pause = WritePause(redis, HintKeys(cluster=False), memory=mark, archive_lag=0.0, retry_after=1)
    await pause.poll()
    return REGISTRY.get_sample_value("ds_write_backpressure", {"reason": "memory"})


async def _long_poll(http: aiohttp.ClientSession, url: str, offset: str) -> tuple[int, bytes]:
    async with http.get(url, params={"offset": offset, "live": "long-poll"}) as r:
        return r.status, await r.read()


async def _first_accepted(http: aiohttp.ClientSession, url: str, body: bytes, seconds: float) -> float:
    """Append ``body`` until a try is stored (503s meanwhile); how long that took."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        async with http.post(url, data=body, headers=OCTETS) as r:
            if r.status == 204:
                return time.monotonic() - started
            assert r.status == 503 and r.headers["Retry-After"] == "1", (r.status, await r.text())
        await asyncio.sleep(0.1)
    raise AssertionError(f"writes did not resume within {seconds} s")


async def test_a_full_redis_pauses_writes_serves_reads_and_resumes_once_archived(
    small_redis: aioredis.Redis, own_redis: EmbeddedRedis, http: aiohttp.ClientSession, tmp_path
) -> None:
    archive = str(tmp_path / "archive")
    # The mark: 40% of 64 MiB = 25.6 MiB; writes resume below 95% of it, 24.3 MiB.
    async with serving(
        own_redis.url, write_pause_memory="40%", archive_url=archive, long_poll_timeout=60.0
    ) as base:
        big, small, done = f"{base}/big", f"{base}/small", f"{base}/done"
        for url in (big, small, done):
            async with http.put(url, headers=OCTETS) as r:
                assert r.status == 201
        body, stored = os.urandom(128 * 1024), 0
        for _ in range(400):  # 50 MiB at most: the mark comes after ~25 MiB of used_memory
            async with http.post(big, data=body, headers=OCTETS) as r:
                if r.status == 503:
                    refusal = await r.text()
                    assert r.headers["Retry-After"] == "1" and r.headers["Cache-Control"] == "no-store"
                    break
                assert r.status == 204, (r.status, await r.text())
                stored += 1
            await asyncio.sleep(0.01)  # the gateway polls every 0.5 s: overshoot ~3 MiB, far below 64 MiB
        else:
            raise AssertionError(f"writes never paused; used_memory {await _used(small_redis):,}")
        assert "writes paused" in refusal and "memory" in refusal and "backpressure" in refusal
        assert 0.4 * 64 * MB < await _used(small_redis) < 0.6 * 64 * MB  # ours, not Redis' OOM

        # Every write is refused: appends to any stream, creates (plain and forks).
        async with http.post(small, data=b"x", headers=OCTETS) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
        async with http.put(f"{base}/new-{uuid.uuid4().hex[:8]}", headers=OCTETS) as r:
            assert r.status == 503
        async with http.put(f"{base}/fork", headers={**OCTETS, "Stream-Forked-From": "big"}) as r:
            assert r.status == 503
        # Reads are served: catch-up (every byte), HEAD, and a long-poll waits for data.
        assert await read_all(http, big) == body * stored
        async with http.head(big) as r:
            assert r.status == 200
            tail = r.headers["Stream-Next-Offset"]
        waiting = asyncio.create_task(_long_poll(http, big, tail))
        # A close alone stores no data and is let through; DELETE frees memory.
        async with http.post(done, headers={**OCTETS, "Stream-Closed": "true"}) as r:
            assert r.status == 204
        async with http.delete(small) as r:
            assert r.status == 204
        node = f'{{node="127.0.0.1:{own_redis.port}"}}'
        assert await _metric(http, base, "ds_redis_used_memory_bytes" + node) > 0.4 * 64 * MB
        assert await _metric(http, base, "ds_redis_maxmemory_bytes" + node) == 64 * MB
        assert await _metric(http, base, 'ds_write_backpressure_refusals_total{reason="memory"}') >= 4
        assert await _paused_after_a_poll(small_redis, "40%") == 1

        # An archive worker moves the data to Parquet and trims Redis: writes resume.
        archiver = Archiver(small_redis, Archive(archive), ALL_NOW)
        await archiver.drain()
        assert archiver.archived_bytes == len(body) * stored
        assert await _used(small_redis) < 0.4 * 64 * MB * RESUME
        assert await _first_accepted(http, big, b"again", seconds=10) < 5
        assert await _paused_after_a_poll(small_redis, "40%") == 0
        assert await asyncio.wait_for(waiting, 10) == (200, b"again")  # the live read got the append
        assert await read_all(http, big) == body * stored + b"again"  # now from the archive


async def test_an_archive_that_lags_pauses_writes_until_it_catches_up(
    own_redis: EmbeddedRedis, http: aiohttp.ClientSession, tmp_path
) -> None:
    redis = aioredis.Redis.from_url(own_redis.url)
    archive = str(tmp_path / "archive")
    archiver = Archiver(redis, Archive(archive), ALL_NOW)
    try:
        async with serving(own_redis.url, write_pause_archive_lag=1.0, archive_url=archive) as base:
            await archiver.announce()  # a worker is alive (so gateways send hints), but it does not work
            url = f"{base}/lagging"
            async with http.put(url, headers=OCTETS) as r:
                assert r.status == 201
            started, stored = time.monotonic(), 0
            while True:  # the hint, sent within 1 s, waits: after 1 s more, writes pause
                async with http.post(url, data=b"x" * 100, headers=OCTETS) as r:
                    if r.status == 503:
                        assert r.headers["Retry-After"] == "1"
                        assert "archive is behind" in await r.text()
                        break
                    assert r.status == 204
                    stored += 1
                assert time.monotonic() - started < 10, "writes never paused"
                await asyncio.sleep(0.1)
            waited = time.monotonic() - started
            assert 1.0 < waited < 5, waited
            assert await read_all(http, url) == b"x" * 100 * stored
            await archiver.drain()  # takes the hint: nothing waits any more
            assert await _first_accepted(http, url, b"y", seconds=5) < 2
    finally:
        await redis.aclose()


# -- Redis Cluster --------------------------------------------------------------------------


async def test_a_cluster_primary_over_its_mark_pauses_only_its_streams(
    redis_cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """One primary gets a maxmemory its data is above 50% of: its streams' writes are
    refused, the other primaries' (no maxmemory, so no mark) are stored."""
    names = [f"bp-{uuid.uuid4().hex[:8]}-{i}" for i in range(40)]
    by_node: dict[int, list[str]] = {}
    for name in names:
        owner = redis_cluster.slot_owner(keys.stream_slot(keys.stream_id(name)))
        by_node.setdefault(owner.port, []).append(name)
    full = redis_cluster.primaries[0]
    assert by_node.get(full.port) and len(by_node) > 1, by_node
    with redis_cluster.connect(full) as node:
        used = int(node.info("memory")["used_memory"])
        node.config_set("maxmemory", used * 3 // 2)  # used is 67% of it
        try:
            async with serving(redis_cluster.seed_url, redis_cluster=True, write_pause_memory="50%") as base:
                polled = f'ds_redis_maxmemory_bytes{{node="127.0.0.1:{full.port}"}}'
                for _ in range(50):  # until the gateway's first poll
                    if await _metric(http, base, polled) == used * 3 // 2:
                        break
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError(f"no {polled} in /metrics")
                for name in names:
                    async with http.put(f"{base}/{name}", headers=OCTETS) as r:
                        paused = name in by_node[full.port]
                        assert r.status == (503 if paused else 201), (name, r.status)
                node.config_set("maxmemory", 0)  # no mark any more: writes resume
                paused_name = by_node[full.port][0]
                started = time.monotonic()
                while True:
                    async with http.put(f"{base}/{paused_name}", headers=OCTETS) as r:
                        if r.status == 201:
                            break
                        assert r.status == 503 and time.monotonic() - started < 5
                    await asyncio.sleep(0.1)
                for name in names:  # the cluster is shared by the session's tests: leave it clean
                    async with http.delete(f"{base}/{name}") as r:
                        assert r.status in (204, 404)
        finally:
            node.config_set("maxmemory", 0)
