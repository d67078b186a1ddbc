"""Large reads skip Lua's copy (read_from's 'bulk' answer, Reads.bulk): same bytes,
same headers, and a safe fallback when the log changes between the two calls."""

from __future__ import annotations

import os
import uuid

import aiohttp
import redis.asyncio as aioredis

from gateway.archive.cold import ColdReader
from gateway.archive.files import Archive
from gateway.http.app import GATEWAY
from gateway.redis_io import keys
from gateway.redis_io.scripts import Scripts
from gateway.streams.reads import Reads

from .conftest import start_gateway


async def transcript(http: aiohttp.ClientSession, url: str) -> list[tuple[str, str, bytes]]:
    """Every read from every offset a client can be given, chunk by chunk."""
    out, offset, seen = [], "-1", set()
    while offset not in seen:
        seen.add(offset)
        async with http.get(url, params={"offset": offset}) as r:
            assert r.status == 200, await r.text()
            body = await r.read()
            out.append((offset, r.headers["Stream-Next-Offset"], body))
            if r.headers.get("Stream-Up-To-Date") == "true":
                break
            offset = r.headers["Stream-Next-Offset"]
    return out


async def test_bulk_reads_answer_exactly_what_inline_reads_do(redis_url: str, http) -> None:
    inline = await start_gateway(redis_url, max_chunk_bytes=50, read_inline_bytes=10**9)
    bulk = await start_gateway(redis_url, max_chunk_bytes=50, read_inline_bytes=0)
    try:
        name = f"bulk-{uuid.uuid4().hex[:8]}"
        urls = [str(s.make_url(f"/v1/stream/{name}")) for s in (inline, bulk)]
        kind = {"Content-Type": "application/octet-stream"}
        async with http.put(urls[0], headers=kind) as r:
            assert r.status == 201
        for size in (1, 7, 49, 50, 51, 3, 120, 2, 64, 1):  # entries smaller and larger than a chunk
            async with http.post(urls[0], data=os.urandom(size), headers=kind) as r:
                assert r.status == 204
        fork = f"{name}-fork"
        fork_urls = [str(s.make_url(f"/v1/stream/{fork}")) for s in (inline, bulk)]
        async with http.put(
            fork_urls[0],
            headers={
                **kind,
                "Stream-Forked-From": name,
                "Stream-Fork-Offset": "0000000000000000_0000000000000100",
            },
        ) as r:
            assert r.status == 201, await r.text()
        async with http.post(fork_urls[0], data=os.urandom(80), headers=kind) as r:
            assert r.status == 204
        for a, b in (urls, fork_urls):
            expected = await transcript(http, a)
            assert await transcript(http, b) == expected
            assert sum(len(body) for _, _, body in expected) >= 180  # 348 bytes; the fork 100 + 80
            # and from every byte position, not just chunk boundaries
            for position in range(0, 348, 13):
                offset = f"{0:016d}_{position:016d}"
                async with (
                    http.get(a, params={"offset": offset}) as r1,
                    http.get(b, params={"offset": offset}) as r2,
                ):
                    assert (r1.status, r1.headers.get("Stream-Next-Offset"), await r1.read()) == (
                        r2.status,
                        r2.headers.get("Stream-Next-Offset"),
                        await r2.read(),
                    ), position
    finally:
        await inline.close()
        await bulk.close()


async def test_bulk_read_declines_when_the_log_changed(
    redis_url: str, http, redis: aioredis.Redis, tmp_path
) -> None:
    """Between the script and the XRANGE the log may be trimmed (archived) or the stream
    deleted and created again: bulk then answers None and the caller asks the script."""
    server = await start_gateway(redis_url, max_chunk_bytes=1000, read_inline_bytes=0)
    try:
        store = server.app[GATEWAY].store
        scripts = Scripts(redis)  # the bulk read is a step of the Store's reads, not a verb
        reads = Reads(scripts, ColdReader(Archive(str(tmp_path)), 1 << 20), 1000, 0)
        name = f"bulk-{uuid.uuid4().hex[:8]}"
        url = str(server.make_url(f"/v1/stream/{name}"))
        kind = {"Content-Type": "text/plain"}
        await http.put(url, headers=kind)
        for piece in (b"abc", b"defg", b"hij"):
            await http.post(url, data=piece, headers=kind)
        sid = keys.stream_id(name)
        meta = await store.head(sid)
        assert await reads.bulk(sid, 1, 10, meta.created) == [(1, b"bc"), (3, b"defg"), (7, b"hij")]
        assert await reads.bulk(sid, 4, 6, meta.created) == [(4, b"ef")]
        assert await reads.bulk(sid, 0, 10, "another incarnation") is None
        assert await reads.bulk(sid, 0, 11, meta.created) is None  # past the log's end
        # What an archive commit does to the log:
        await redis.xtrim(keys.stream_keys(sid)[1], minid="3-1", approximate=False)
        assert await reads.bulk(sid, 0, 10, meta.created) is None
        assert await reads.bulk(sid, 3, 10, meta.created) == [(3, b"defg"), (7, b"hij")]
    finally:
        await server.close()
