"""Scripts on one Redis go through connections.run_script (redis_io/connections.py), not
redis-py's command layers, or through a connection an append lane holds (connections.Held):
the same answers, NOSCRIPT recovered, failures as before."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.redis_io import connections as redis_client

# Busy for half a second: longer than the client's 0.2 s timeout below.
SLOW = """local t = redis.call('TIME')
while true do
  local n = redis.call('TIME')
  if (n[1] - t[1]) * 1000000 + (n[2] - t[2]) > 500000 then return 1 end
end"""

Runner = Callable[[Any, list[str], list[Any]], Awaitable[Any]]


@pytest.fixture(params=["pooled", "held"])
def runner(request: pytest.FixtureRequest) -> Callable[[aioredis.Redis], Runner]:
    """How a script is run on a client: through its pool, or on a connection held."""
    if request.param == "pooled":
        return lambda client: lambda script, keys, args: redis_client.run_script(client, script, keys, args)
    return lambda client: redis_client.Held(client).run_script


async def test_a_script_redis_forgot_is_loaded_and_run_again(redis_url: str, runner) -> None:
    client = redis_client.connect(redis_url, max_connections=2)
    run = runner(client)
    try:
        script = client.register_script("return {KEYS[1], ARGV[1], #ARGV}")
        assert await run(script, ["k"], [b"v", 7]) == [b"k", b"v", 2]
        await client.script_flush()  # as after a restart: every script forgotten
        assert await run(script, ["k"], [b"w"]) == [b"k", b"w", 1]
        assert await client.script_exists(script.sha) == [True]
    finally:
        await client.aclose()


async def test_an_error_reply_is_raised_and_the_connection_goes_back(redis_url: str, runner) -> None:
    client = redis_client.connect(redis_url, max_connections=1)
    run = runner(client)
    try:
        failing = client.register_script("return redis.error_reply('NOPE not today')")
        with pytest.raises(ResponseError, match="not today"):
            await run(failing, [], [])
        answer = client.register_script("return 42")
        assert await run(answer, [], []) == 42  # the pool's one connection, or the one held
    finally:
        await client.aclose()


async def test_a_connection_that_timed_out_is_not_reused(redis_url: str, runner) -> None:
    client = redis_client.connect(redis_url, max_connections=1, timeout=0.2)
    run = runner(client)
    try:
        with pytest.raises(RedisTimeoutError):
            await run(client.register_script(SLOW), [], [])
        fresh = client.register_script("return 'fresh'")
        for _ in range(50):  # Redis is busy until the slow script ends
            try:
                # The slow script's late answer is not taken for this one's: a new connection.
                assert await run(fresh, [], []) == b"fresh"
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


def named(redis_url: str) -> tuple[str, str]:
    """The URL with a client name of this test's own (its connections told apart), and it."""
    name = f"held-{uuid.uuid4().hex[:8]}"
    return f"{redis_url}{'&' if '?' in redis_url else '?'}client_name={name}", name


async def evalsha_connections(client: aioredis.Redis, name: str) -> set[str]:
    """The ids of the connections named ``name`` whose last command was a script call."""
    return {c["id"] for c in await client.client_list() if c["name"] == name and c["cmd"] == "evalsha"}


@contextlib.asynccontextmanager
async def holding(url: str) -> AsyncIterator[tuple[aioredis.Redis, redis_client.Held, Any]]:
    """A client on ``url``, a connection held of it and an echo script; closed after."""
    client = redis_client.connect(url, max_connections=2, timeout=1.0)
    held = redis_client.Held(client)
    try:
        yield client, held, client.register_script("return ARGV[1]")
    finally:
        await held.aclose()
        await client.aclose()


async def test_a_held_connection_closed_by_redis_is_opened_again(redis_url: str) -> None:
    """An idle held connection that Redis closed (a restart, a CLIENT KILL, a timeout) is
    opened again before the next call, which runs (not failed as of unknown outcome)."""
    url, name = named(redis_url)
    async with holding(url) as (client, held, echo):
        assert await held.run_script(echo, [], ["a"]) == b"a"
        assert await held.run_script(echo, [], ["b"]) == b"b"
        (first,) = await evalsha_connections(client, name)  # one connection, kept
        await client.client_kill_filter(_id=first)
        await asyncio.sleep(0.2)  # its EOF reaches the held connection
        assert await held.run_script(echo, [], ["c"]) == b"c"
        (second,) = await evalsha_connections(client, name)
        assert second != first


async def test_a_held_connection_reset_by_redis_is_opened_again(redis_url: str) -> None:
    """A connection reset (RST, not a FIN: its reader holds an error, not an EOF) is opened
    again before the next call as well."""
    async with holding(redis_url) as (_, held, echo):
        assert await held.run_script(echo, [], ["a"]) == b"a"
        connection = held._connection
        assert connection is not None
        connection._reader.set_exception(ConnectionResetError("reset by peer"))  # type: ignore[attr-defined]
        assert await held.run_script(echo, [], ["b"]) == b"b"


async def test_a_held_connection_that_cannot_connect_sent_nothing() -> None:
    async with holding("redis://127.0.0.1:1") as (_, held, echo):
        with pytest.raises(redis_client.NotSent):
            await held.run_script(echo, [], ["x"])


async def test_calls_at_once_on_a_held_connection_all_run(redis_url: str) -> None:
    """A lane sends one call at a time; should several come at once, the others take the
    pool rather than a reply meant for the first. Closing the holder closes its connection."""
    url, name = named(redis_url)
    async with holding(url) as (client, held, echo):
        assert await held.run_script(echo, [], ["alone"]) == b"alone"
        (own,) = await evalsha_connections(client, name)
        replies = await asyncio.gather(*(held.run_script(echo, [], [str(i)]) for i in range(8)))
        assert replies == [str(i).encode() for i in range(8)]
        assert own in await evalsha_connections(client, name)
        assert len(await evalsha_connections(client, name)) >= 2, "every call went over the held connection"
        await held.aclose()
        await asyncio.sleep(0.1)
        assert own not in {c["id"] for c in await client.client_list()}, "the held connection is open"
