"""Tenants and the archive workers (docs/tenants.md): retention and State compaction give a
tenant's stored bytes back in the same script that drops them, exactly: after any mix of
appends, archiving, compaction (in Redis and of archived segments) and retention, a tenant's
`stored_bytes` is what its streams hold, counted from Redis' log and the archive's files."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import uuid

import aiohttp
import orjson
import pyarrow.compute as pc
import pytest
import redis.asyncio as aioredis

from gateway.archive.files import Archive
from gateway.archive.segments import Segment
from gateway.redis_io import keys
from workers.archiver import Archiver, Policy
from workers.compactor import CompactionPolicy

from .conftest import serving
from .test_compaction_rules import make_history

TEXT = {"Content-Type": "text/plain"}
JSON = {"Content-Type": "application/json"}
FILES = Policy(hot_bytes=0, hot_ms=0, min_bytes=1, max_delay_ms=0, file_bytes=1500, row_group_bytes=64)
NOW = CompactionPolicy(lag_ms=0, lag_bytes=0, tombstone_ms=0, min_interval_ms=0, dirty_ratio=0)


@pytest.fixture
async def tenant(redis_url: str):
    """A gateway with tenants on, streams under <name>/ being tenant <name>'s: (base, name)."""
    name = f"t{uuid.uuid4().hex[:10]}"
    async with serving(redis_url, tenants=True, tenant_paths=f"{name}/={name}") as base:
        yield base, name


async def stored(http: aiohttp.ClientSession, base: str, name: str) -> int:
    async with http.get(f"{base}/__ds/tenants/{name}") as r:
        assert r.status == 200, await r.text()
        return (await r.json())["usage"]["stored_bytes"]


async def held(redis: aioredis.Redis, archive: Archive, sid: str) -> int:
    """The bytes a stream holds, as offsets count them: its Redis log's entries from where
    the archive ends, and its archived files' (a file's row is an entry: as appended)."""
    meta = await redis.hgetall(keys.stream_keys(sid)[0])
    arch = int(meta.get(b"arch", b"0"))
    hot = 0
    for entry_id, fields in await redis.xrange(keys.stream_keys(sid)[1]):
        if int(entry_id.split(b"-")[0]) >= arch:
            data = fields[b"d"]  # (a JSON entry's messages: the '\n's between them not counted)
            hot += len(data) - (
                data.count(b"\n") if meta.get(b"ct", b"").startswith(b"application/json") else 0
            )
    inc = meta.get(b"inc", b"").decode()  # (none until the stream's first archiving)
    cold = 0
    for member, score in await redis.zrange(keys.segments(sid, inc), 0, -1, withscores=True) if inc else ():
        if score >= 0:
            table = archive.read(Segment.parse(member).file, ["data"])
            cold += pc.sum(pc.binary_length(table.column("data"))).as_py() or 0
    return hot + cold


async def test_retention_gives_a_tenants_bytes_back(tenant, http, redis, archive_dir) -> None:
    """Retention drops a byte stream's and a JSON stream's old segments: their bytes go back
    (a JSON stream's as offsets count them), what is kept stays counted."""
    base, name = tenant
    text, js = f"{base}/{name}/text", f"{base}/{name}/json"
    async with http.put(text, data=b"old data ", headers=TEXT) as r:
        assert r.status == 201
    async with http.put(js, data=b'[{"a":1},{"b":22}]', headers=JSON) as r:
        assert r.status == 201
    assert await stored(http, base, name) == 9 + 7 + 8  # (the JSON messages without "[", ",", "]")
    archive = Archive(archive_dir)
    keep = Archiver(redis, archive, dataclasses.replace(FILES, retention_ms=1500))
    for url in (text, js):
        await keep.archive_stream(_sid(url))
    await asyncio.sleep(1.7)
    async with http.post(text, data=b"new", headers=TEXT) as r:
        assert r.status == 204
    async with http.post(js, data=b'{"c":333}', headers=JSON) as r:
        assert r.status == 204
    for url in (text, js):
        await keep.archive_stream(_sid(url))  # the old segments dropped, the new ones kept
    assert await stored(http, base, name) == 3 + 9
    assert [await held(redis, archive, _sid(u)) for u in (text, js)] == [3, 9]
    owned = await redis.hgetall(keys.tenant_streams(name))
    assert {k.decode(): int(v) for k, v in owned.items()} == {_sid(text): 3, _sid(js): 9}


@pytest.mark.parametrize("seed", range(3))
async def test_compaction_and_retention_give_back_exactly(tenant, http, redis, archive_dir, seed) -> None:
    """A compacted stream written in rounds, archived as it goes, compacted in Redis and in
    its archived segments (deep runs), then its oldest segments retained away: the tenant's
    stored bytes are, after each step, what the stream holds."""
    base, name = tenant
    rnd = random.Random(seed)
    url = f"{base}/{name}/state-{seed}"
    async with http.put(url, headers={**JSON, "Stream-Compaction": "state"}) as r:
        assert r.status == 201
    sid, archive = _sid(url), Archive(archive_dir)
    history = make_history(rnd, rnd.randint(80, 160), keys=rnd.randint(1, 6), resets=True, others=True)
    worker = Archiver(
        redis, archive, FILES, compaction=dataclasses.replace(NOW, step_positions=rnd.choice((3, 50)))
    )
    at, checked = 0, 0
    while at < len(history):
        n = rnd.randint(1, 15)
        async with http.post(url, data=orjson.dumps(history[at : at + n]), headers=JSON) as r:
            assert r.status in (200, 204), await r.text()
        at += n
        if rnd.random() < 0.5:
            await worker.archive_stream(sid)
            assert await stored(http, base, name) == await held(redis, archive, sid)
            checked += 1
    await worker.archive_stream(sid)
    meta = await redis.hgetall(keys.stream_keys(sid)[0])
    assert int(meta.get(b"cdrop", b"0")) > 0, "nothing was compacted"
    assert (
        await stored(http, base, name)
        == await held(redis, archive, sid)
        < sum(len(orjson.dumps(m)) for m in history)
    )
    # retention: segments whose newest entry is older than now go (the last one is kept hot)
    await asyncio.sleep(0.05)
    async with http.post(url, data=orjson.dumps(history[-1:]), headers=JSON) as r:
        assert r.status in (200, 204)
    retaining = Archiver(redis, archive, dataclasses.replace(FILES, retention_ms=30), compaction=NOW)
    await retaining.archive_stream(sid)
    assert int((await redis.hgetall(keys.stream_keys(sid)[0])).get(b"floor", b"0")) > 0, "nothing retained"
    assert await stored(http, base, name) == await held(redis, archive, sid), checked


async def test_a_worker_that_read_the_meta_before_an_adoption_calls_again(
    redis_url, tenant, http, redis, archive_dir
) -> None:
    """A worker read a stream's meta while it was no tenant's (made with tenants off); a
    tenant's write adopts it; the worker's retention call, made with no tenant, is answered
    'tenant' (nothing changed) and made again with the adopter's. What the adopter is given
    back is at most what it counts for the stream (docs/tenants.md: its count may run below
    what the stream holds by what it held before the adoption, never below zero)."""
    base, name = tenant
    path = f"{name}/adopted"
    async with serving(redis_url) as plain:  # (tenants off)
        async with http.put(f"{plain}/{path}", data=b"before ", headers=TEXT) as r:
            assert r.status == 201
    archive = Archive(archive_dir)
    keep = Archiver(redis, archive, FILES)
    await keep.archive_stream(_sid(path))
    async with keep.leases.held(_sid(path)) as lease:
        assert lease is not None
        meta = await redis.hgetall(keys.stream_keys(_sid(path))[0])
        assert b"tn" not in meta and lease.tenant == ""  # (as the worker read it)
        async with http.post(f"{base}/{path}", data=b"adopted", headers=TEXT) as r:
            assert r.status == 204  # the tenant's now, its bytes from here on counted
        assert await stored(http, base, name) == 7
        inc = meta[b"inc"].decode()
        committed = [Segment.parse(m) for m in await redis.zrange(keys.segments(_sid(path), inc), 0, -1)]
        await keep.files.retain(lease, inc, int(time.time() * 1000) + 1, committed, False)
        assert lease.tenant == name
    assert await held(redis, archive, _sid(path)) == 7  # "before " dropped, "adopted" kept
    assert await stored(http, base, name) == 0  # given back: 7 of "before ", clamped at the 7 counted


async def test_a_compaction_run_with_a_stale_tenant_calls_again(tenant, http, redis, archive_dir) -> None:
    """The same for compaction: a run made with no tenant for a tenant's compacted stream is
    answered 'tenant' and made again with the stream's; its bytes go back to it."""
    base, name = tenant
    url = f"{base}/{name}/stale-state"
    async with http.put(url, headers={**JSON, "Stream-Compaction": "state"}) as r:
        assert r.status == 201
    history = make_history(random.Random(4), 120, keys=2, resets=False, others=False)
    async with http.post(url, data=orjson.dumps(history), headers=JSON) as r:
        assert r.status in (200, 204), await r.text()
    archive = Archive(archive_dir)
    worker = Archiver(redis, archive, dataclasses.replace(FILES, hot_bytes=1 << 40), compaction=NOW)
    async with worker.leases.held(_sid(url)) as lease:
        assert lease is not None
        raw = await redis.hgetall(keys.stream_keys(_sid(url))[0])
        await worker.compactor.run(lease, {k.decode(): v.decode() for k, v in raw.items()})
        assert lease.tenant == name
    assert int((await redis.hgetall(keys.stream_keys(_sid(url))[0])).get(b"cdrop", b"0")) > 0
    assert await stored(http, base, name) == await held(redis, archive, _sid(url))


def _sid(url: str) -> str:
    return keys.stream_id(url.split("/v1/stream/", 1)[-1])
