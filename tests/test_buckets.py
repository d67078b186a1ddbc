"""Ursula's buckets (issue 18): names and the mapping without Redis; then against a real
gateway: the seed's quick start as written, the bucket lifecycle and its statuses,
``GET /{bucket}/streams`` paging, one stream under both addresses (live reads too),
access control by bucket, and a Redis Cluster listing."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.protocol import buckets as rules
from gateway.protocol import offsets
from gateway.protocol.errors import ProtocolError

from .cluster import Cluster
from .conftest import serving

OCTETS = {"Content-Type": "application/octet-stream"}

# -- rules ------------------------------------------------------------------------------------


def test_names() -> None:
    for good in ("demo", "a-b_c", "x" * 64, "_default", "0000"):
        assert rules.validate_bucket(good) == good
    for bad in ("abc", "x" * 65, "Demo", "de.mo", "de/mo", "démo", "", "healthz", "auth"):
        with pytest.raises(ProtocolError) as refused:
            rules.validate_bucket(bad)
        assert refused.value.status == 400 and refused.value.body["error"]["code"] == "invalid_bucket_id", bad
    for good in ("hello", "a.b", "x" * 117, "é"):
        assert rules.validate_stream_id("demo", good) == good
    for bad in ("", "a/b", "a\x00b", "a..b", "..", ".", "streams", "x" * 118, "é" * 59):
        with pytest.raises(ProtocolError) as refused:
            rules.validate_stream_id("demo", bad)
        assert refused.value.status == 400, bad


def test_the_v1_mapping_read_backwards() -> None:
    assert rules.stream_path("demo", "hello") == "demo/hello"  # = /v1/stream/demo/hello
    assert rules.stream_path("_default", "mystream") == "mystream"  # = /v1/stream/mystream
    assert rules.in_bucket("demo", "demo/hello") and not rules.in_bucket("demo", "demox/hello")
    assert rules.in_bucket("_default", "flat") and not rules.in_bucket("_default", "a/b")
    assert rules.stream_id_of("demo", "demo/hello") == "hello"
    assert rules.stream_id_of("_default", "flat") == "flat"


# -- against a gateway ------------------------------------------------------------------------


def _root(base: str) -> str:
    return base.split("/v1/stream")[0]


async def _call(
    http: aiohttp.ClientSession, method: str, url: str, **kwargs: Any
) -> tuple[int, Any, aiohttp.typedefs.LooseHeaders]:
    async with http.request(method, url, **kwargs) as r:
        body = await r.read()
        if r.headers.get("Content-Type", "").startswith("application/json") and body:
            return r.status, json.loads(body), r.headers
        return r.status, body, r.headers


def _bucket() -> str:
    return f"b-{uuid.uuid4().hex[:10]}"


async def test_the_seed_quick_start_works_as_written(redis_url: str, http: aiohttp.ClientSession) -> None:
    """Seed 002, "Quick Start": create a bucket and a stream, append twice, read it all,
    and follow it live over SSE."""
    name = _bucket()
    async with serving(redis_url) as base:
        root = _root(base)
        assert (await _call(http, "PUT", f"{root}/{name}"))[0] == 201
        assert (await _call(http, "PUT", f"{root}/{name}/hello"))[0] == 201
        for text in (b"first message", b"second message"):
            status, _, headers = await _call(http, "POST", f"{root}/{name}/hello", headers=OCTETS, data=text)
            assert status in (200, 204) and headers["Stream-Next-Offset"]
        status, body, _ = await _call(http, "GET", f"{root}/{name}/hello?offset=-1")
        assert (status, body) == (200, b"first messagesecond message")
        async with http.get(f"{root}/{name}/hello?offset=-1&live=sse") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            seen = b""
            async with asyncio.timeout(10):
                async for line in r.content:
                    seen += line
                    if b'"upToDate":true' in seen:
                        break
            assert b"event: data" in seen  # binary stream over SSE: base64 in data events


async def test_the_bucket_lifecycle(redis_url: str, http: aiohttp.ClientSession) -> None:
    name = _bucket()
    async with serving(redis_url) as base:
        root = _root(base)
        status, body, _ = await _call(http, "GET", f"{root}/{name}")
        assert (status, body["error"]["code"]) == (404, "bucket_not_found")
        assert (await _call(http, "PUT", f"{root}/{name}/s"))[0] == 404  # a stream needs its bucket
        assert (await _call(http, "DELETE", f"{root}/{name}"))[0] == 404
        assert (await _call(http, "PUT", f"{root}/{name}"))[:2] == (201, {"bucket_id": name})
        assert (await _call(http, "PUT", f"{root}/{name}"))[:2] == (200, {"bucket_id": name})  # idempotent
        assert (await _call(http, "GET", f"{root}/{name}"))[:2] == (200, {"bucket_id": name, "streams": 0})
        for stream in ("a", "b"):
            assert (await _call(http, "PUT", f"{root}/{name}/{stream}"))[0] == 201
        assert (await _call(http, "GET", f"{root}/{name}"))[:2] == (200, {"bucket_id": name, "streams": 2})
        status, body, _ = await _call(http, "DELETE", f"{root}/{name}")
        assert (status, body["error"]["code"]) == (409, "bucket_not_empty")
        for stream in ("a", "b"):
            assert (await _call(http, "DELETE", f"{root}/{name}/{stream}"))[0] == 204
        assert (await _call(http, "DELETE", f"{root}/{name}"))[0] == 204
        assert (await _call(http, "GET", f"{root}/{name}"))[0] == 404
        for bad in ("Upper", "abc", "de.mo"):
            status, body, _ = await _call(http, "PUT", f"{root}/{bad}")
            assert (status, body["error"]["code"]) == (400, "invalid_bucket_id"), bad
        status, body, _ = await _call(http, "PUT", f"{root}/{name}/..x")
        assert (status, body["error"]["code"]) == (400, "invalid_stream_id")
        status, body, _ = await _call(http, "DELETE", f"{root}/_default")
        assert (status, body["error"]["code"]) == (409, "default_bucket")
        assert (await _call(http, "GET", f"{root}/healthz"))[0] == 200  # the server's own routes first


async def test_one_stream_two_addresses(redis_url: str, http: aiohttp.ClientSession) -> None:
    """/{bucket}/{stream} is /v1/stream/{bucket}/{stream}; /_default/{stream} is
    /v1/stream/{stream}; a bucket used through /v1/stream/ only exists by its streams."""
    name, flat = _bucket(), f"flat-{uuid.uuid4().hex[:8]}"
    async with serving(redis_url) as base:
        root = _root(base)
        assert (await _call(http, "PUT", f"{base}/{name}/s", headers=OCTETS, data=b"v1,"))[0] == 201
        assert (await _call(http, "GET", f"{root}/{name}"))[:2] == (200, {"bucket_id": name, "streams": 1})
        await _call(http, "POST", f"{root}/{name}/s", headers=OCTETS, data=b"bucket")
        assert (await _call(http, "GET", f"{base}/{name}/s?offset=-1"))[1] == b"v1,bucket"
        assert (await _call(http, "PUT", f"{base}/{flat}", headers=OCTETS, data=b"flat"))[0] == 201
        assert (await _call(http, "GET", f"{root}/_default/{flat}?offset=-1"))[1] == b"flat"
        status, body, _ = await _call(http, "GET", f"{root}/_default/streams", params={"prefix": flat})
        assert status == 200 and [s["stream_id"] for s in body["streams"]] == [flat]
        status, _, headers = await _call(http, "HEAD", f"{root}/{name}/s")
        assert status == 200 and headers["Stream-Next-Offset"] == offsets.encode(9)
        # the PUT answer points at the address it was made by
        _, _, headers = await _call(http, "PUT", f"{root}/{name}/t")
        assert headers["Location"].endswith(f"/{name}/t") and "/v1/stream/" not in headers["Location"]


async def test_listing_a_bucket(redis_url: str, http: aiohttp.ClientSession) -> None:
    name, other = _bucket(), _bucket()
    async with serving(redis_url) as base:
        root = _root(base)
        for bucket in (name, other):
            await _call(http, "PUT", f"{root}/{bucket}")
        ids = [f"session-{n:02d}" for n in range(7)] + ["other-1"]
        for stream in ids:
            await _call(http, "PUT", f"{root}/{name}/{stream}", headers={"Content-Type": "application/json"})
        await _call(http, "PUT", f"{root}/{other}/session-99")
        await _call(
            http,
            "POST",
            f"{root}/{name}/session-00",
            headers={"Content-Type": "application/json"},
            data=b"{}",
        )
        status, body, _ = await _call(http, "GET", f"{root}/{name}/streams")
        assert status == 200 and body["bucket_id"] == name and body["prefix"] == ""
        assert [s["stream_id"] for s in body["streams"]] == sorted(ids) and body["stream_count"] == 8
        first = next(s for s in body["streams"] if s["stream_id"] == "session-00")
        assert first["status"] == "open" and first["content_type"] == "application/json"
        assert first["tail_offset"] == 2 and first["last_write_at_ms"] >= first["created_at_ms"]
        seen, after = [], None
        while True:
            params = {"prefix": "session-", "limit": "3", **({"after": after} if after else {})}
            status, body, _ = await _call(http, "GET", f"{root}/{name}/streams", params=params)
            assert status == 200 and body["stream_count"] == len(body["streams"]) <= 3
            seen += [s["stream_id"] for s in body["streams"]]
            if not body["has_more"]:
                break
            after = body["next_cursor"]
            assert after == seen[-1]  # on one Redis the cursor is the last stream id
        assert seen == ids[:7]
        for bad in ("0", "1001", "x"):
            assert (await _call(http, "GET", f"{root}/{name}/streams", params={"limit": bad}))[0] == 400
        assert (await _call(http, "GET", f"{root}/{_bucket()}/streams"))[0] == 404


async def test_buckets_under_access_control(
    redis_url: str, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    name, other = _bucket(), _bucket()
    tokens = [
        {"name": "admin", "token": "t-admin-0123456789abcdef", "grants": "admin:"},
        {"name": "tenant", "token": "t-tenant-0123456789abcdef", "grants": f"write:{name}/"},
    ]
    (tmp_path / "tokens.json").write_text(json.dumps({"tokens": tokens}))
    admin, tenant = ({"Authorization": f"Bearer {t['token']}"} for t in tokens)
    async with serving(redis_url, auth_tokens_file=str(tmp_path / "tokens.json")) as base:
        root = _root(base)
        assert (await _call(http, "PUT", f"{root}/{name}"))[0] == 401
        assert (await _call(http, "PUT", f"{root}/{name}", headers=tenant))[0] == 201
        assert (await _call(http, "PUT", f"{root}/{other}", headers=tenant))[0] == 403
        assert (await _call(http, "PUT", f"{root}/{other}", headers=admin))[0] == 201
        assert (await _call(http, "PUT", f"{root}/{name}/s", headers=tenant))[0] == 201
        assert (await _call(http, "PUT", f"{root}/{other}/s", headers=tenant))[0] == 403
        assert (await _call(http, "GET", f"{root}/{name}/streams", headers=tenant))[0] == 200
        status, body, _ = await _call(http, "GET", f"{root}/{other}/streams", headers=tenant)
        assert (status, body["streams"]) == (200, [])  # lists only what it may read
        assert (await _call(http, "DELETE", f"{root}/{name}/s", headers=tenant))[0] == 403  # admin scope
        assert (await _call(http, "DELETE", f"{root}/{name}", headers=tenant))[0] == 403


async def test_listing_a_bucket_on_a_cluster(redis_cluster: Cluster, http: aiohttp.ClientSession) -> None:
    name = _bucket()
    ids = [f"s{n:02d}" for n in range(25)]
    async with serving(redis_cluster.seed_url, redis_cluster=True) as base:
        root = _root(base)
        await _call(http, "PUT", f"{root}/{name}")
        await asyncio.gather(*(_call(http, "PUT", f"{root}/{name}/{s}") for s in ids))
        assert (await _call(http, "GET", f"{root}/{name}"))[1] == {"bucket_id": name, "streams": 25}
        seen, after = [], None
        for _ in range(100):
            params = {"limit": "4", **({"after": after} if after else {})}
            status, body, _ = await _call(http, "GET", f"{root}/{name}/streams", params=params)
            assert status == 200
            seen += [s["stream_id"] for s in body["streams"]]
            if not body["has_more"]:
                break
            after = body["next_cursor"]
        assert sorted(seen) == ids and len(seen) == len(ids)
        status, body, _ = await _call(http, "DELETE", f"{root}/{name}")
        assert (status, body["error"]["code"]) == (409, "bucket_not_empty")
