"""The key layout version (``ds:layout``): stamped by the first process on a Redis,
checked by every gateway and worker at start, raised only by ``durable-streams
migrate``, step by step under a lock."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gateway.cli.embedded import EmbeddedRedis
from gateway.protocol import offsets
from gateway.redis_io import keys, layout

from .conftest import free_port

NEWER = (
    f"Redis holds key layout v{layout.CURRENT + 1}; this build understands up to v{layout.CURRENT}: "
    "upgrade the gateways/workers"
)


@pytest.fixture
async def client(own_redis: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(own_redis.url)
    yield c
    await c.aclose()


def _command(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLE_STREAMS_") and k != "REDIS_URL"}
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args], capture_output=True, text=True, timeout=60, env=env
    )


async def test_an_empty_redis_is_stamped_with_the_current_layout(client: aioredis.Redis) -> None:
    assert await layout.check(client) == layout.CURRENT
    assert await client.get(keys.LAYOUT) == str(layout.CURRENT).encode()
    assert await layout.stamp(client, current=7) == layout.CURRENT  # set once: a later build reads it


async def test_a_redis_with_our_keys_but_no_version_is_layout_1(client: aioredis.Redis) -> None:
    """An install from before the marker: its data is layout 1, whatever the build."""
    await client.hset("ds:{chat/1}:meta", "tail", 0)
    assert await layout.stamp(client, current=2) == layout.PRE_VERSIONING == 1
    needs = r"holds key layout v1; this build needs v2: run `durable-streams migrate`"
    with pytest.raises(layout.Mismatch, match=needs):
        await layout.check(client, current=2)


async def test_an_empty_redis_gets_the_building_layout(client: aioredis.Redis) -> None:
    assert await layout.check(client, current=2) == 2


async def test_a_newer_or_unreadable_layout_refuses(client: aioredis.Redis) -> None:
    await client.set(keys.LAYOUT, layout.CURRENT + 1)
    with pytest.raises(layout.Mismatch) as refused:
        await layout.check(client)
    assert str(refused.value) == NEWER
    await client.set(keys.LAYOUT, "two")
    with pytest.raises(layout.Mismatch, match="not a key layout version"):
        await layout.check(client)


async def test_migrate_runs_each_step_under_the_lock(client: aioredis.Redis) -> None:
    await client.hset("ds:{chat/1}:meta", "tail", 0)  # a pre-versioning install: layout 1
    ran: list[int] = []

    async def split_meta(redis: aioredis.Redis) -> None:
        """Split each stream's meta hash (an example step)."""
        ran.append(int(await redis.get(keys.LAYOUT)))
        assert await redis.exists(keys.LAYOUT_LOCK)  # held while the step runs

    async def rename_hints(redis: aioredis.Redis) -> None:
        ran.append(int(await redis.get(keys.LAYOUT)))

    said: list[str] = []
    found = await layout.migrate(client, said.append, current=3, steps={1: split_meta, 2: rename_hints})
    assert found == 3 and ran == [1, 2]
    assert await client.get(keys.LAYOUT) == b"3"
    assert not await client.exists(keys.LAYOUT_LOCK)
    assert said == [
        "layout v1 -> v2: Split each stream's meta hash (an example step).",
        "layout v2 -> v3: rename_hints",
        "layout v3 is current",
    ]
    said.clear()
    await layout.migrate(client, said.append, current=3, steps={})
    assert said == ["layout v3 is current"]


async def test_migrate_refuses_a_newer_layout_a_missing_step_and_a_held_lock(client: aioredis.Redis) -> None:
    await client.set(keys.LAYOUT, 1)
    with pytest.raises(layout.Mismatch, match="no step from layout v1 to v2"):
        await layout.migrate(client, print, current=2, steps={})
    assert not await client.exists(keys.LAYOUT_LOCK)  # released after a failed migration
    await client.set(keys.LAYOUT_LOCK, "someone-else", px=60_000)
    with pytest.raises(layout.Mismatch, match="another migration is running"):
        await layout.migrate(client, print, current=2, steps={1: _noop})
    assert await client.get(keys.LAYOUT) == b"1"
    await client.set(keys.LAYOUT, 5)
    with pytest.raises(layout.Mismatch, match="holds key layout v5; this build understands up to v2"):
        await layout.migrate(client, print, current=2)


async def _noop(redis: aioredis.Redis) -> None:
    """Nothing."""


async def test_gateways_and_workers_refuse_a_newer_layout(
    client: aioredis.Redis, own_redis: EmbeddedRedis
) -> None:
    await client.set(keys.LAYOUT, layout.CURRENT + 1)
    for args in (
        ["serve", "--port", str(free_port())],
        ["serve", "--port", str(free_port()), "--workers", "2"],
        ["archive"],
    ):
        out = _command(*args, "--redis-url", own_redis.url)
        assert out.returncode == 1, out.stderr
        assert "Traceback" not in out.stderr
        assert out.stderr.strip().splitlines()[-1] == f"durable-streams: {NEWER}", out.stderr


async def test_the_migrate_command(client: aioredis.Redis, own_redis: EmbeddedRedis) -> None:
    out = _command("migrate", "--redis-url", own_redis.url)
    assert (out.returncode, out.stdout) == (0, f"layout v{layout.CURRENT} is current\n"), out.stderr
    assert await client.get(keys.LAYOUT) == str(layout.CURRENT).encode()  # an empty Redis is stamped
    await client.set(keys.LAYOUT, layout.CURRENT + 1)
    out = _command("migrate", "--redis-url", own_redis.url)
    assert out.returncode == 1 and out.stderr == f"durable-streams: {NEWER}\n", out.stderr
    out = _command("migrate", "--redis-url", f"redis://127.0.0.1:{free_port()}/0")
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("durable-streams: migrate: redis: ") and "Traceback" not in out.stderr


def test_the_command_line_and_the_migration_step_do_not_import_the_metrics() -> None:
    """`serve --workers N` runs the embedded Redis' migration before it sets
    PROMETHEUS_MULTIPROC_DIR, which prometheus-client reads once, at import: nothing on
    that path may import it (else /metrics loses the workers' counts)."""
    code = (
        "import sys, gateway.cli.main, gateway.cli.migrate, gateway.redis_io.layout as l; "
        "assert l.index_streams and 'prometheus_client' not in sys.modules, "
        "[m for m in sys.modules if m.startswith('gateway')]"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


async def test_step_to_v3_rewrites_the_offsets_subscriptions_keep(client: aioredis.Redis) -> None:
    links, pending = keys.sub_keys("orders", False)[1:3]
    await client.hset(
        links,
        mapping={
            "a": "e|0000000000000000_0000000000000042|1700",  # acked at position 42 (format 0)
            "b": "g|-1|1700",  # linked before its first byte
            "c": f"eg|{offsets.encode(7)}|1701",  # minted since
        },
    )
    await client.hset(pending, mapping={"a": "0000000000000000_0000000000000050"})
    fork = keys.stream_keys(keys.stream_id("forked"))[0]
    await client.hset(fork, mapping={"tail": "9", "fork_off": "0000000000000000_0000000000000003"})
    assert await layout.offsets_as_minted_now(client) == 3
    assert await client.hget(fork, "fork_off") == offsets.encode(3).encode()
    assert await client.hgetall(links) == {
        b"a": f"e|{offsets.encode(42)}|1700".encode(),
        b"b": b"g|-1|1700",
        b"c": f"eg|{offsets.encode(7)}|1701".encode(),
    }
    assert await client.hgetall(pending) == {b"a": offsets.encode(50).encode()}
    assert await layout.offsets_as_minted_now(client) == 0  # safe to run again
