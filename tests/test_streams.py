"""The protocol over HTTP against a real gateway and Redis (limits: 64-byte
chunks, 4 KiB bodies; see conftest)."""

from __future__ import annotations

import asyncio

import aiohttp
import redis.asyncio as aioredis

from gateway.protocol import offsets
from gateway.redis_io import keys

TEXT = {"Content-Type": "text/plain"}
JSON = {"Content-Type": "application/json"}
NO_TYPE = {"skip_auto_headers": ["Content-Type"]}  # aiohttp would send application/octet-stream


def off(pos: int) -> str:
    return offsets.encode(pos)


async def tail_of(http: aiohttp.ClientSession, url: str) -> str | None:
    async with http.head(url) as r:
        return r.headers.get("Stream-Next-Offset")


async def test_create_append_read(http: aiohttp.ClientSession, url: str) -> None:
    async with http.put(url, data=b"hello ", headers=TEXT) as r:
        assert r.status == 201
        assert r.headers["Location"] == url
        assert r.headers["Stream-Next-Offset"] == off(6)
    async with http.post(url, data=b"world", headers=TEXT) as r:
        assert r.status == 204
        assert r.headers["Stream-Next-Offset"] == off(11)
    async with http.get(url) as r:
        assert r.status == 200
        assert await r.read() == b"hello world"
        assert r.headers["Stream-Up-To-Date"] == "true"
        assert "Stream-Closed" not in r.headers
    async with http.get(url, params={"offset": off(6)}) as r:
        assert await r.read() == b"world"


async def test_idempotent_create_and_conflicts(http: aiohttp.ClientSession, url: str) -> None:
    async with http.put(url, headers=TEXT) as r:
        assert r.status == 201
    async with http.put(url, headers=TEXT) as r:
        assert r.status == 200
    async with http.put(url, headers=JSON) as r:
        assert r.status == 409
    async with http.put(url, headers={**TEXT, "Stream-Closed": "true"}) as r:
        assert r.status == 409  # closure status differs
    async with http.post(url, headers={"Stream-Closed": "true"}) as r:
        assert r.status == 204 and r.headers["Stream-Closed"] == "true"
    async with http.put(url, headers=TEXT) as r:
        assert r.status == 409  # now closed, request is not
    async with http.put(url, headers={**TEXT, "Stream-Closed": "true"}) as r:
        assert r.status == 200


async def test_bad_appends_change_nothing(http: aiohttp.ClientSession, url: str) -> None:
    async with http.put(url, data=b"abc", headers=TEXT) as r:
        assert r.status == 201
    bad = [
        ({"Content-Type": "application/json"}, b"{}", 409),  # type mismatch
        ({}, b"", 400),  # empty body, no close
        ({"Content-Type": "text/plain", "Producer-Id": "p"}, b"x", 400),  # partial producer headers
        (
            {"Content-Type": "text/plain", "Producer-Id": "p", "Producer-Epoch": "x", "Producer-Seq": "0"},
            b"x",
            400,
        ),
        ({"Content-Type": "bogus"}, b"x", 400),
        ({"Content-Type": "text/plain"}, b"x" * 5000, 413),  # over the 4 KiB limit
    ]
    for headers, body, status in bad:
        async with http.post(url, data=body, headers=headers) as r:
            assert r.status == status, (headers, await r.text())
    async with http.get(url) as r:
        assert await r.read() == b"abc"
        assert r.headers["Stream-Next-Offset"] == off(3)


async def test_bad_reads_are_400_never_500(http: aiohttp.ClientSession, url: str) -> None:
    async with http.put(url, data=b"abc", headers=TEXT) as r:
        assert r.status == 201
    for query in (
        "offset=abc",
        "offset=0,1",
        "offset=-1&offset=now",
        "live=forever&offset=-1",
        f"offset={off(99)}",
        "offset=-1&live=long-poll&cursor=abc",
        "offset=0000000000000007_0000000000000000",
    ):
        async with http.get(f"{url}?{query}") as r:
            assert r.status == 400, query
    async with http.get(url.rsplit("/", 1)[0] + "/bad%01path") as r:
        assert r.status == 400
    async with http.put(url + "x", headers={"Stream-TTL": "1.5"}) as r:
        assert r.status == 400
    async with http.head(url + "x") as r:
        assert r.status == 404  # the rejected PUT created nothing


async def test_stream_seq_must_increase(http: aiohttp.ClientSession, url: str) -> None:
    await http.put(url, headers=TEXT)
    async with http.post(url, data=b"a", headers={**TEXT, "Stream-Seq": "b"}) as r:
        assert r.status == 204
    for seq in ("b", "a", "ab"):  # equal, lower, and lower by byte order ("ab" < "b")
        async with http.post(url, data=b"x", headers={**TEXT, "Stream-Seq": seq}) as r:
            assert r.status == 409
    async with http.post(url, data=b"c", headers={**TEXT, "Stream-Seq": "c"}) as r:
        assert r.status == 204
    async with http.get(url) as r:
        assert await r.read() == b"ac"


async def test_append_and_close_is_atomic_and_final(http: aiohttp.ClientSession, url: str) -> None:
    await http.put(url, headers=TEXT)
    async with http.post(url, data=b"last", headers={**TEXT, "Stream-Closed": "true"}) as r:
        assert r.status == 204 and r.headers["Stream-Closed"] == "true"
    async with http.post(url, data=b"more", headers=TEXT) as r:
        assert r.status == 409
        assert r.headers["Stream-Closed"] == "true"
        assert r.headers["Stream-Next-Offset"] == off(4)
    async with http.get(url) as r:
        assert await r.read() == b"last"
        assert r.headers["Stream-Closed"] == "true"


async def test_idempotent_producer(http: aiohttp.ClientSession, url: str) -> None:
    await http.put(url, headers=TEXT)

    def prod(epoch: int, seq: int) -> dict[str, str]:
        return {**TEXT, "Producer-Id": "p1", "Producer-Epoch": str(epoch), "Producer-Seq": str(seq)}

    async with http.post(url, data=b"a", headers=prod(0, 0)) as r:
        assert r.status == 200 and r.headers["Producer-Seq"] == "0"
    async with http.post(url, data=b"a", headers=prod(0, 0)) as r:
        assert r.status == 204  # a retry: deduplicated
    async with http.post(url, data=b"c", headers=prod(0, 2)) as r:
        assert r.status == 409
        assert (r.headers["Producer-Expected-Seq"], r.headers["Producer-Received-Seq"]) == ("1", "2")
    async with http.post(url, data=b"b", headers=prod(1, 1)) as r:
        assert r.status == 400  # a new epoch starts at 0
    async with http.post(url, data=b"b", headers=prod(1, 0)) as r:
        assert r.status == 200
    async with http.post(url, data=b"z", headers=prod(0, 1)) as r:
        assert r.status == 403 and r.headers["Producer-Epoch"] == "1"
    async with http.get(url) as r:
        assert await r.read() == b"ab"


async def test_concurrent_producer_retries_store_once(http: aiohttp.ClientSession, url: str) -> None:
    await http.put(url, headers=TEXT)
    headers = {**TEXT, "Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "0"}
    statuses = await asyncio.gather(*(http.post(url, data=b"once", headers=headers) for _ in range(20)))
    assert sorted(r.status for r in statuses).count(200) == 1
    async with http.get(url) as r:
        assert await r.read() == b"once"


async def test_json_mode(http: aiohttp.ClientSession, url: str) -> None:
    async with http.put(url, data=b"[]", headers=JSON) as r:
        assert r.status == 201
    async with http.post(url, data=b"[]", headers=JSON) as r:
        assert r.status == 400
    async with http.post(url, data=b"{bad", headers=JSON) as r:
        assert r.status == 400
    async with http.post(url, data=b'[{"a":1},[2,3]]', headers=JSON) as r:
        assert r.status == 204
    async with http.post(url, data=b'"x"', headers=JSON) as r:
        assert r.status == 204
    async with http.get(url) as r:
        assert await r.json() == [{"a": 1}, [2, 3], "x"]
    async with http.get(url, params={"offset": "now"}) as r:
        assert await r.read() == b"[]"
        assert r.headers["Cache-Control"] == "no-store"


async def test_chunked_reads_cover_everything_exactly(http: aiohttp.ClientSession, url: str) -> None:
    data = bytes(range(256)) * 3  # one 768-byte entry, served in 64-byte chunks
    await http.put(url, data=data, headers={"Content-Type": "application/octet-stream"})
    got, offset, reads = b"", "-1", 0
    while True:
        async with http.get(url, params={"offset": offset}) as r:
            chunk = await r.read()
            got += chunk
            offset = r.headers["Stream-Next-Offset"]
            reads += 1
            if r.headers.get("Stream-Up-To-Date") == "true":
                break
            assert len(chunk) == 64
    assert got == data and reads == 12


async def test_json_chunks_never_split_a_message(http: aiohttp.ClientSession, url: str) -> None:
    messages = [{"i": i, "pad": "x" * 20} for i in range(20)]
    await http.put(url, json=messages)
    seen, offset = [], "-1"
    while True:
        async with http.get(url, params={"offset": offset}) as r:
            seen += await r.json()
            offset = r.headers["Stream-Next-Offset"]
            if r.headers.get("Stream-Up-To-Date") == "true":
                break
    assert seen == messages


async def test_etag_and_304(http: aiohttp.ClientSession, url: str) -> None:
    await http.put(url, data=b"abc", headers=TEXT)
    async with http.get(url) as r:
        etag = r.headers["ETag"]
    async with http.get(url, headers={"If-None-Match": etag}) as r:
        assert r.status == 304
    await http.post(url, headers={"Stream-Closed": "true"})
    async with http.get(url, headers={"If-None-Match": etag}) as r:
        assert r.status == 200  # closure changes the ETag
        assert r.headers["Stream-Closed"] == "true"


async def test_head_and_security_headers(http: aiohttp.ClientSession, url: str) -> None:
    await http.put(url, headers={**TEXT, "Stream-TTL": "3600"})
    async with http.head(url) as r:
        assert r.status == 200
        assert r.headers["Cache-Control"] == "no-store"
        assert r.headers["Stream-TTL"] == "3600"
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        assert "Stream-Next-Offset" in r.headers["Access-Control-Expose-Headers"]
    async with http.options(
        url, headers={"Origin": "https://x", "Access-Control-Request-Method": "PUT"}
    ) as r:
        assert r.status == 204
        assert "PUT" in r.headers["Access-Control-Allow-Methods"]


async def test_every_answer_has_security_headers(http: aiohttp.ClientSession, url: str, gateway: str) -> None:
    """Browsers need CORS on errors too: 4xx from the protocol, from aiohttp (413), from
    routing (404/405), and on event streams, whose headers go out before the handler ends.
    With access control off, pages served from this machine are the allowed origins. Errors
    are never cacheable."""
    await http.put(url, headers=TEXT)
    root = gateway.split("/v1/stream")[0]
    local = {"Origin": "http://localhost:5173"}
    answers = [
        (http.post(url, data=b"x" * 5000, headers={**TEXT, **local}), 413),
        (http.post(url, data=b"[1]", headers={"Content-Type": "application/json", **local}), 409),
        (http.get(url + "?offset=abc", headers=local), 400),
        (http.get(url + "-missing", headers=local), 404),
        (http.get(root + "/nowhere", headers=local), 404),
        (http.patch(url, headers=local), 405),
        (http.post(root + "/healthz", headers=local), 405),
        (http.head(root + "/healthz", headers=local), 200),
        (http.get(url + "?offset=-1&live=sse", headers=local), 200),
    ]
    for request, status in answers:
        async with request as r:
            assert r.status == status, (r.method, r.url)
            assert r.headers["X-Content-Type-Options"] == "nosniff", (r.method, r.url)
            assert r.headers["Content-Security-Policy"].startswith("sandbox"), (r.method, r.url)
            assert r.headers["Access-Control-Allow-Origin"] == "http://localhost:5173", (r.method, r.url)
            assert "Origin" in r.headers["Vary"]
            if status == 405:
                assert "GET" in r.headers["Allow"]
            if status >= 400:  # no CDN may keep an error: a 404 outlives the stream's creation
                assert r.headers["Cache-Control"] == "no-store", (r.method, r.url)


async def test_delete_frees_redis(http: aiohttp.ClientSession, url: str, redis: aioredis.Redis) -> None:
    await http.put(url, data=b"abc", headers=TEXT)
    sid = keys.stream_id(url.rsplit("/", 1)[1])
    assert await redis.exists(*keys.stream_keys(sid)[:4]) == 2  # meta and log
    async with http.delete(url) as r:
        assert r.status == 204
    assert await redis.exists(*keys.stream_keys(sid)[:4]) == 0
    async with http.get(url) as r:
        assert r.status == 404
    async with http.delete(url) as r:
        assert r.status == 404


async def test_ttl_slides_and_expiry_frees_redis(
    http: aiohttp.ClientSession, url: str, redis: aioredis.Redis
) -> None:
    await http.put(url, data=b"abc", headers={**TEXT, "Stream-TTL": "1"})
    sid = keys.stream_id(url.rsplit("/", 1)[1])
    for _ in range(3):  # reads keep it alive past its 1 s TTL
        await asyncio.sleep(0.6)
        async with http.get(url) as r:
            assert r.status == 200
    await asyncio.sleep(1.3)
    assert await redis.exists(*keys.stream_keys(sid)[:4]) == 0  # Redis expired it by itself
    async with http.get(url) as r:
        assert r.status == 404
    async with http.put(url, headers=TEXT) as r:
        assert r.status == 201  # the path is free again


async def test_expires_at_in_the_past_is_gone(http: aiohttp.ClientSession, url: str) -> None:
    async with http.put(url, headers={**TEXT, "Stream-Expires-At": "2001-01-01T00:00:00Z"}) as r:
        assert r.status == 201
    async with http.head(url) as r:
        assert r.status == 404


async def test_fork_reads_and_lifecycle(http: aiohttp.ClientSession, url: str, redis: aioredis.Redis) -> None:
    source, fork, grandchild = url, url + "-fork", url + "-fork2"
    path = source.split("/v1/stream", 1)[1]
    await http.put(source, data=b"hello", headers=TEXT)
    await http.post(source, data=b" world", headers=TEXT)
    fork_headers = {
        "Stream-Forked-From": "/v1/stream" + path,
        "Stream-Fork-Offset": off(5),
        "Stream-Fork-Sub-Offset": "3",
    }
    async with http.put(fork, headers=fork_headers, **NO_TYPE) as r:
        assert r.status == 201
        assert r.headers["Content-Type"] == "text/plain"  # inherited
        assert r.headers["Stream-Next-Offset"] == off(8)
    async with http.put(fork, headers=fork_headers, **NO_TYPE) as r:
        assert r.status == 200
    await http.post(fork, data=b"!", headers=TEXT)
    await http.post(source, data=b" again", headers=TEXT)
    async with http.get(fork) as r:
        assert await r.read() == b"hello wo!"
    async with http.get(fork, params={"offset": off(6)}) as r:
        assert await r.read() == b"wo!"  # across the fork point
    async with http.put(fork, headers={**fork_headers, "Stream-Fork-Sub-Offset": "4"}, **NO_TYPE) as r:
        assert r.status == 409  # exists with another sub-offset
    async with http.put(fork, headers={**fork_headers, "Stream-Fork-Sub-Offset": "7"}, **NO_TYPE) as r:
        assert r.status == 400  # invalid, and must not drop the existing fork's hold on the source
    async with http.put(fork + "x", headers={**fork_headers, "Stream-Fork-Sub-Offset": "7"}, **NO_TYPE) as r:
        assert r.status == 400  # past the end of the " world" append

    # a fork of the fork, then delete the middle and the source: reads still work
    await http.put(grandchild, headers={"Stream-Forked-From": "/v1/stream" + path + "-fork"}, **NO_TYPE)
    async with http.delete(source) as r:
        assert r.status == 204
    async with http.get(source) as r:
        assert r.status == 410
    async with http.put(source, headers=TEXT) as r:
        assert r.status == 409
    async with http.delete(fork) as r:
        assert r.status == 204
    async with http.get(grandchild) as r:
        assert await r.read() == b"hello wo!"
    # deleting the last fork collects the whole chain from Redis
    async with http.delete(grandchild) as r:
        assert r.status == 204
    for name in (source, fork):
        sid = keys.stream_id(name.rsplit("/", 1)[1])
        assert await redis.exists(*keys.stream_keys(sid)[:4]) == 0


async def test_json_fork_sub_offset(http: aiohttp.ClientSession, url: str) -> None:
    path = url.split("/v1/stream", 1)[1]
    await http.put(url, json=[1, 2, 3])
    headers = {
        "Stream-Forked-From": "/v1/stream" + path,
        "Stream-Fork-Offset": off(0),
        "Stream-Fork-Sub-Offset": "2",
    }
    async with http.put(url + "-f", headers=headers, **NO_TYPE) as r:
        assert r.status == 201
    async with http.get(url + "-f") as r:
        assert await r.json() == [1, 2]
    async with http.put(url + "-g", headers={**headers, "Stream-Fork-Sub-Offset": "4"}, **NO_TYPE) as r:
        assert r.status == 400


async def test_health_endpoints(http: aiohttp.ClientSession, gateway: str) -> None:
    root = gateway.rsplit("/v1/stream", 1)[0]
    async with http.get(root + "/healthz") as r:
        assert r.status == 200
    async with http.get(root + "/readyz") as r:
        assert r.status == 200
