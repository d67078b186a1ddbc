"""What a client is told when Redis fails: never "retry" for a write that may have happened.

- Redis not reachable (nothing sent): 503 with Retry-After, nothing stored.
- Redis stalls past --redis-timeout after the append was sent: 504 "outcome unknown"
  without Retry-After; the append may be applied later (here: once Redis resumes).
  An idempotent producer's retry is then recognized as a duplicate.
"""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import redis.asyncio as aioredis

from gateway.cli.embedded import EmbeddedRedis
from gateway.telemetry import metrics

from .conftest import start_gateway

TEXT = {"Content-Type": "text/plain"}


async def test_stalled_redis_means_outcome_unknown(
    own_redis: EmbeddedRedis, http: aiohttp.ClientSession
) -> None:
    gateway = await start_gateway(own_redis.url, redis_timeout=1.0)
    url = str(gateway.make_url("/v1/stream/stalled"))
    producer = {"Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "0"}
    assert own_redis.process is not None
    try:
        async with http.put(url, headers=TEXT) as r:
            assert r.status == 201
        # An append elsewhere first: appends go over their lane's own connection, opened by
        # the first (on a Redis stalled already, opening it fails: nothing sent, 503).
        warm = str(gateway.make_url("/v1/stream/stalled-warm"))
        async with http.put(warm, headers=TEXT) as r:
            assert r.status == 201
        async with http.post(warm, data=b"w", headers=TEXT) as r:
            assert r.status == 204
        os.kill(own_redis.process.pid, signal.SIGSTOP)
        try:
            async with http.post(url, data=b"producer;", headers={**TEXT, **producer}) as r:
                assert r.status == 504, r.status  # sent, never answered
                assert "Retry-After" not in r.headers
                assert "outcome unknown" in await r.text()
            # That connection is gone; a new one cannot even be set up: nothing is sent.
            async with http.post(url, data=b"plain;", headers=TEXT) as r:
                assert r.status == 503, r.status
                assert r.headers["Retry-After"] == "1"
        finally:
            os.kill(own_redis.process.pid, signal.SIGCONT)
        # The producer retries the same (epoch, seq): a duplicate, since Redis applied it on waking.
        for _ in range(50):
            async with http.post(url, data=b"producer;", headers={**TEXT, **producer}) as r:
                if r.status in (200, 204):
                    assert r.status == 204  # recognized: not stored again
                    break
            await asyncio.sleep(0.1)
        async with http.get(url, params={"offset": "-1"}) as r:
            body = await r.read()
        assert body == b"producer;", body  # the 504'd append once, the 503'd one not at all
    finally:
        await gateway.close()


async def test_unreachable_redis_means_retry(own_redis: EmbeddedRedis, http: aiohttp.ClientSession) -> None:
    gateway = await start_gateway(own_redis.url, redis_timeout=1.0)
    url = str(gateway.make_url("/v1/stream/unreachable"))
    try:
        async with http.put(url, headers=TEXT) as r:
            assert r.status == 201
        own_redis.kill()
        async with http.post(url, data=b"lost;", headers=TEXT) as r:
            assert r.status == 503
            assert r.headers["Retry-After"] == "1"
        own_redis.start()
        for _ in range(50):
            async with http.post(url, data=b"kept;", headers=TEXT) as r:
                if r.status == 204:
                    break
            await asyncio.sleep(0.1)
        async with http.get(url, params={"offset": "-1"}) as r:
            assert await r.read() == b"kept;"
    finally:
        await gateway.close()


async def test_a_full_redis_refuses_appends_with_retry(
    own_redis: EmbeddedRedis, http: aiohttp.ClientSession
) -> None:
    """OOM (maxmemory reached, noeviction) comes at an append's first write: nothing is
    stored, so the answer is 503 with Retry-After, not 500. Counted in
    ds_redis_errors_total as a create refused for memory is (append.lua catches it, so it
    is that append's result rather than an exception of the call)."""
    refused = metrics.REDIS_ERRORS.labels("append", "OutOfMemoryError")
    before = refused._value.get()
    gateway = await start_gateway(own_redis.url)
    url = str(gateway.make_url("/v1/stream/full"))
    admin = aioredis.Redis.from_url(own_redis.url)
    try:
        async with http.put(url, headers=TEXT) as r:
            assert r.status == 201
        await admin.config_set("maxmemory-policy", "noeviction")
        await admin.config_set("maxmemory", 1)
        async with http.post(url, data=b"refused;", headers=TEXT) as r:
            assert r.status == 503, (r.status, await r.text())
            assert r.headers["Retry-After"] == "5"
            assert "OOM" in await r.text()
        assert refused._value.get() == before + 1
        await admin.config_set("maxmemory", 0)
        async with http.post(url, data=b"kept;", headers=TEXT) as r:
            assert r.status == 204
        async with http.get(url, params={"offset": "-1"}) as r:
            assert await r.read() == b"kept;"
    finally:
        await admin.aclose()
        await gateway.close()
