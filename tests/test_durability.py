"""Acknowledged means durable: kill Redis hard, restart it, every acked byte is there."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gateway.embedded import EmbeddedRedis, find_redis_server

from .conftest import own_redis_server, start_gateway


@pytest.fixture
def own_redis(tmp_path):
    try:
        find_redis_server()
    except RuntimeError:
        pytest.skip("needs a redis-server binary to kill and restart")
    with own_redis_server(tmp_path / "redis") as server:
        yield server


async def test_acknowledged_appends_survive_kill_9(
    own_redis: EmbeddedRedis, http: aiohttp.ClientSession
) -> None:
    gateway = await start_gateway(own_redis.url)
    url = str(gateway.make_url("/v1/stream/durable"))
    acked: list[bytes] = []
    try:
        async with http.put(url, headers={"Content-Type": "text/plain"}) as r:
            assert r.status == 201

        async def writer(n: int) -> None:
            for i in range(10_000):
                item = f"[{n}:{i}]".encode()
                try:
                    async with http.post(url, data=item, headers={"Content-Type": "text/plain"}) as r:
                        if r.status == 204:
                            acked.append(item)
                        else:
                            return
                except aiohttp.ClientError:
                    return

        writers = [asyncio.create_task(writer(n)) for n in range(8)]
        await asyncio.sleep(1.0)
        own_redis.kill()  # SIGKILL: no shutdown, no final flush
        await asyncio.wait_for(asyncio.gather(*writers), 30)
        assert len(acked) > 50

        own_redis.start()
        stored = b""
        for _ in range(50):  # the gateway reconnects by itself
            async with http.get(url) as r:
                if r.status == 200:
                    stored = await r.read()
                    break
            await asyncio.sleep(0.1)
    finally:
        await gateway.close()
    missing = [item for item in acked if item not in stored]
    assert missing == []
    for n in range(8):  # each writer's items are in its own order, once
        mine = [item for item in acked if item.startswith(f"[{n}:".encode())]
        positions = [stored.index(item) for item in mine]
        assert positions == sorted(positions)
        assert all(stored.count(item) == 1 for item in mine)
