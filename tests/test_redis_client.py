"""The gateway's Redis client: hiredis packing, same bytes, same answers."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection, UnixDomainSocketConnection

from gateway.redis_io import connections as redis_client


@pytest.mark.parametrize(
    "args",
    [
        ("EVALSHA", "a" * 40, 2, "k1", "k2", 8192, 1, "text/plain", "0", "", "", "", "", 1, b"x" * 100),
        ("ZADD", "ds:archive:hints", "NX", 1763736000.25, "stream"),
        ("SET", "k", b"\x00\xff\r\n", 7),
        ("SCRIPT LOAD", "return 1"),  # redis-py splits multi-word command names
        ("SET", "ünïcode", "välue"),
        ("SET", "big", b"y" * 100_000, "PX", 10**12),
    ],
)
def test_packs_byte_for_byte_like_redis_py(args: tuple) -> None:
    python = b"".join(Connection().pack_command(*args))
    packed = redis_client._hiredis_packing(Connection)().pack_command(*args)
    assert b"".join(packed) == python


async def test_client_round_trips_through_redis(redis_url: str, tmp_path) -> None:
    client = redis_client.connect(redis_url, max_connections=4)
    try:
        pool = client.connection_pool
        assert pool.connection_class.__name__.startswith("HiredisPacking")
        assert pool.max_connections == 4
        if redis_url.startswith("unix://"):
            assert issubclass(pool.connection_class, UnixDomainSocketConnection)
        client_id = await client.client_id()
        value = bytes(range(256)) * 300
        await client.set("redis-client-test", value)
        assert await client.get("redis-client-test") == value
        assert await client.eval("return {ARGV[1], #ARGV[2]}", 0, "ü", value) == ["ü".encode(), len(value)]
        async with client.pipeline(transaction=True) as pipe:
            replies = await pipe.incr("redis-client-n").incr("redis-client-n").execute()
        assert replies[1] == replies[0] + 1
    finally:
        await client.delete("redis-client-test", "redis-client-n")
        await client.aclose()
    # Closing the client closed the pool's connections (a gateway's shutdown leaves none open).
    checker = aioredis.Redis.from_url(redis_url)
    try:
        for _ in range(50):
            if not await checker.execute_command("CLIENT", "LIST", "ID", client_id):
                break
            await asyncio.sleep(0.02)
        assert not await checker.execute_command("CLIENT", "LIST", "ID", client_id)
    finally:
        await checker.aclose()
