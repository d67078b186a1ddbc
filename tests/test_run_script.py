"""Scripts on one Redis go through client.run_script (storage/client.py), not redis-py's
command layers: the same answers, NOSCRIPT recovered, failures as before."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.redis_io import connections as redis_client

# Busy for half a second: longer than the client's 0.2 s timeout below.
SLOW = """local t = redis.call('TIME')
while true do
  local n = redis.call('TIME')
  if (n[1] - t[1]) * 1000000 + (n[2] - t[2]) > 500000 then return 1 end
end"""


async def test_a_script_redis_forgot_is_loaded_and_run_again(redis_url: str) -> None:
    client = redis_client.connect(redis_url, max_connections=2)
    try:
        script = client.register_script("return {KEYS[1], ARGV[1], #ARGV}")
        assert await redis_client.run_script(client, script, ["k"], [b"v", 7]) == [b"k", b"v", 2]
        await client.script_flush()  # as after a restart: every script forgotten
        assert await redis_client.run_script(client, script, ["k"], [b"w"]) == [b"k", b"w", 1]
        assert await client.script_exists(script.sha) == [True]
    finally:
        await client.aclose()


async def test_an_error_reply_is_raised_and_the_connection_goes_back(redis_url: str) -> None:
    client = redis_client.connect(redis_url, max_connections=1)
    try:
        failing = client.register_script("return redis.error_reply('NOPE not today')")
        with pytest.raises(ResponseError, match="not today"):
            await redis_client.run_script(client, failing, [], [])
        answer = client.register_script("return 42")
        assert await redis_client.run_script(client, answer, [], []) == 42  # the pool's one connection
    finally:
        await client.aclose()


async def test_a_connection_that_timed_out_is_not_reused(redis_url: str) -> None:
    client = redis_client.connect(redis_url, max_connections=1, timeout=0.2)
    try:
        with pytest.raises(RedisTimeoutError):
            await redis_client.run_script(client, client.register_script(SLOW), [], [])
        fresh = client.register_script("return 'fresh'")
        for _ in range(50):  # Redis is busy until the slow script ends
            try:
                # The slow script's late answer is not taken for this one's: a new connection.
                assert await redis_client.run_script(client, fresh, [], []) == b"fresh"
                break
            except ResponseError as exc:
                assert str(exc).startswith("BUSY"), exc
                await asyncio.sleep(0.1)
            except redis_client.NotSent:  # the new connection's handshake timed out meanwhile
                await asyncio.sleep(0.1)
        else:
            pytest.fail("Redis stayed busy")
    finally:
        await client.aclose()
