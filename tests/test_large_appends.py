"""Large appends, written in bounded steps (streams/appends.py, lua/append_part.lua):
atomic to readers and to other writers, idempotent for producers, and gone without a
trace when their writer is."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator

import orjson
import pytest
import redis as sync_redis
import redis.asyncio as aioredis

from gateway.protocol import offsets
from gateway.protocol.entries import pack_bytes
from gateway.redis_io import keys, parts
from gateway.redis_io.contracts import AppendArgv, AppendStream
from gateway.redis_io.limits import STEP_BYTES
from gateway.redis_io.scripts import Scripts
from gateway.streams.appends import AppendRequest

from .conftest import read_all, start_gateway

BYTES = {"Content-Type": "application/octet-stream"}
JSON = {"Content-Type": "application/json"}


@contextlib.asynccontextmanager
async def _stream(redis_url: str, http, headers: dict[str, str], data: bytes = b"") -> AsyncIterator[tuple]:
    """A gateway with default settings and a new stream on it: (server, url, stream id)."""
    server = await start_gateway(redis_url)
    try:
        name = f"large-{uuid.uuid4().hex[:8]}"
        url = str(server.make_url(f"/v1/stream/{name}"))
        async with http.put(url, data=data, headers=headers) as r:
            assert r.status == 201
        yield server, url, keys.stream_id(name)
    finally:
        await server.close()


async def _begin(scripts: Scripts, sid: str, data: bytes, total: int, token: str = "t0") -> list:
    """The first step of a large append, as a writer that then goes silent leaves it."""
    entries = pack_bytes(data)
    first = AppendRequest("application/octet-stream", False, "", None, entries, token=token, total=total,
                          total_bytes=total)  # fmt: skip
    args = [*AppendArgv(8192, keys.SUBS_WAKE_CHANNEL, ""), *AppendStream(1), *first.script_args()]
    script_keys = [*keys.stream_keys(sid), keys.stream_subs(sid), keys.subs_outbox(sid, False)]
    return await scripts.run("append", script_keys, args)


async def test_a_large_append_is_one_write(redis_url, http) -> None:
    async with _stream(redis_url, http, BYTES) as (_, url, _):
        big = os.urandom(5 * STEP_BYTES + 123)
        # Small appends racing a large one land wholly before or after it, never inside.
        small = [b"<%d>" % n for n in range(40)]

        async def post(data: bytes) -> int:
            async with http.post(url, data=data, headers=BYTES) as r:
                return r.status

        statuses = await asyncio.gather(post(big), *(post(s) for s in small))
        assert statuses == [204] * 41
        data = await read_all(http, url)
        at = data.index(big[:64])
        assert data[at : at + len(big)] == big
        rest = data[:at] + data[at + len(big) :]
        assert sorted(rest.replace(b">", b">\n").split()) == sorted(small)
        async with http.head(url) as r:
            assert r.headers["Stream-Next-Offset"] == offsets.encode(len(big) + sum(map(len, small)))


async def test_a_large_producer_append_is_stored_once(redis_url, http) -> None:
    async with _stream(redis_url, http, JSON) as (_, url, _):
        batch = orjson.dumps([{"i": n, "pad": "x" * 40} for n in range(60_000)])  # ~3 MiB: in steps
        producer = {**JSON, "Producer-Id": "p", "Producer-Epoch": "0"}
        for seq, expected in ((0, 200), (0, 204), (1, 200)):
            async with http.post(url, data=batch, headers={**producer, "Producer-Seq": str(seq)}) as r:
                assert r.status == expected, await r.text()
        messages = orjson.loads(await read_all(http, url))
        assert [m["i"] for m in messages] == list(range(60_000)) * 2


async def test_live_readers_get_a_large_json_append_once(redis_url, http) -> None:
    count = 300_000  # 300,000 small messages in one request: several steps, many entries
    async with _stream(redis_url, http, JSON) as (_, url, _):

        async def tail(mode: str) -> list[int]:
            got: list[int] = []
            offset = offsets.encode(0)
            while len(got) < count:
                params = {"offset": offset, "live": mode} if mode == "long-poll" else {"offset": offset}
                async with http.get(url, params=params) as r:
                    assert r.status in (200, 204), r.status
                    if r.status == 200:
                        got += [m["i"] for m in orjson.loads(await r.read())]
                    offset = r.headers["Stream-Next-Offset"]
            return got

        readers = [asyncio.create_task(tail("long-poll")), asyncio.create_task(tail("catch-up"))]
        await asyncio.sleep(0.3)
        async with http.post(url, data=orjson.dumps([{"i": n} for n in range(count)]), headers=JSON) as r:
            assert r.status == 204, await r.text()
        for got in await asyncio.wait_for(asyncio.gather(*readers), 60):
            assert got == list(range(count))


async def test_a_writer_gone_mid_append_leaves_no_trace(redis_url, http, redis) -> None:
    async with _stream(redis_url, http, BYTES, b"before") as (server, url, sid):
        scripts = Scripts(redis)
        assert (await _begin(scripts, sid, b"x" * 1000, 5000))[0][0] == b"pending"
        # Readers see nothing of it; a writer waits behind it until its writer is gone
        # (PEND_MS of silence), then its leftovers are dropped and the write goes on.
        assert await read_all(http, url) == b"before"
        started = time.monotonic()
        async with http.post(url, data=b"-after", headers=BYTES) as r:
            assert r.status == 204, await r.text()
            assert r.headers["Stream-Next-Offset"] == offsets.encode(12)
        assert 3 < time.monotonic() - started < 9
        assert await read_all(http, url) == b"before-after"
        log = keys.stream_keys(sid)[1]
        assert [e[0] for e in await redis.xrange(log)] == [b"0-1", b"6-1"]
        meta = await redis.hgetall(keys.stream_keys(sid)[0])
        assert b"pend" not in meta and meta[b"tail"] == b"12"


async def test_a_step_after_its_deadline_is_refused(redis_url, http, redis) -> None:
    async with _stream(redis_url, http, BYTES) as (server, url, sid):
        scripts = Scripts(redis)
        await _begin(scripts, sid, b"x" * 1000, 2000, token="slow")
        script_keys = [*keys.stream_keys(sid), keys.stream_subs(sid), keys.subs_outbox(sid, False)]
        tail = ["slow", "last", "0", "", "", "", "", keys.SUBS_WAKE_CHANNEL, "", 1000, b"y" * 1000]
        await asyncio.sleep(5.2)  # a writer paused past PEND_MS (a GC pause, a stopped VM)
        assert await scripts.run("append_part", script_keys, tail) == [b"lost"]
        assert await read_all(http, url) == b""
        async with http.post(url, data=b"ok", headers=BYTES) as r:
            assert r.status == 204 and r.headers["Stream-Next-Offset"] == offsets.encode(2)
        # A token that is not the one under way changes nothing.
        await _begin(scripts, sid, b"z" * 10, 20, token="mine")
        assert await scripts.run("append_part", script_keys, ["other", *tail[1:]]) == [b"lost"]
        last = ["mine", *tail[1:-2], 10, b"w" * 10]
        assert (await scripts.run("append_part", script_keys, last))[0] == b"ok"
        assert await read_all(http, url) == b"ok" + b"z" * 10 + b"w" * 10


def test_the_plain_parts_keep_the_scripts_deadline() -> None:
    from importlib import resources

    prelude = (resources.files("durable_streams_lua") / "_prelude.lua").read_text()
    assert f"local PEND_MS = {parts.PEND_MS} " in prelude


async def test_plain_parts_are_the_scripts_parts(redis_url, http, redis) -> None:
    """On one Redis a large append's parts are plain XADDs (redis_io/parts.py): stored as
    append_part.lua stores them, entry for entry, for an idempotent producer too."""
    async with _stream(redis_url, http, BYTES) as (server, url, sid):
        before = _plain_parts()
        big = os.urandom(3 * STEP_BYTES + 5)
        headers = {**BYTES, "Producer-Id": "big", "Producer-Epoch": "2", "Producer-Seq": "0"}
        async with http.post(url, data=big, headers=headers) as r:
            assert r.status == 200, await r.text()
        assert _plain_parts() - before == 4  # 3 MiB and 5 bytes: four parts, none through Lua
        assert await read_all(http, url) == big
        plain = await redis.xrange(keys.stream_keys(sid)[1])
        # The same parts as the script writes them, on a stream of their own.
        other = keys.stream_id("script-parts")
        scripts = Scripts(redis)
        await redis.hset(keys.stream_keys(other)[0], mapping={"tail": 0, "ctn": "application/octet-stream",
                                                                   "created": 1, "inc": 1})  # fmt: skip
        assert (await _begin(scripts, other, b"", len(big), token="t"))[0][0] == b"pending"
        script_keys = [*keys.stream_keys(other), keys.stream_subs(other), keys.subs_outbox(other, False)]
        for at in range(0, len(big), STEP_BYTES):
            part = big[at : at + STEP_BYTES]
            step = ["t", "part", "0", "", "big", "2", "0", keys.SUBS_WAKE_CHANNEL, "", len(part), part]
            assert await scripts.run("append_part", script_keys, step) == [b"more"]
        scripted = await redis.xrange(keys.stream_keys(other)[1])
        assert [(i, {k: v for k, v in f.items() if k != b"t"}) for i, f in plain] == [
            (i, {k: v for k, v in f.items() if k != b"t"}) for i, f in scripted
        ]
        assert all(f[b"p"] == b"2 0 big" and f[b"t"].isdigit() for _, f in plain)
        await redis.delete(*keys.stream_keys(other)[:4])


async def test_a_plain_part_is_fenced(redis_url, http, redis) -> None:
    """A plain part is written only while its append is its writer's and on time, and only
    if neither the meta hash nor the log changed between the read and the write (WATCH)."""
    async with _stream(redis_url, http, BYTES) as (server, url, sid):
        scripts = Scripts(redis)
        await _begin(scripts, sid, b"", 100, token="mine")
        meta, log = keys.stream_keys(sid)[:2]
        entries = [(10, b"p" * 10)]

        def write(token: str, meddle: tuple | None = None):
            def commands(values: list, now: int):
                if meddle:  # another client, between this one's read and its write
                    with sync_redis.Redis.from_url(redis_url) as other:
                        other.execute_command(*meddle)
                return parts.commands(meta, log, token, entries, b"", values, now)

            return scripts.write_watched([meta, log], parts.FIELDS, commands, "test")

        assert await write("other") is None  # not this writer's append
        assert await write("mine", ("HSET", meta, "probe", "1")) is None  # the hash changed: nothing written
        assert await redis.xlen(log) == 0
        assert await write("mine") is not None
        assert [e[0] for e in await redis.xrange(log)] == [b"0-1"]
        assert await redis.hget(meta, "pend_at") == b"10"
        # Another append rolling this one back deletes from the log first (roll_back in
        # _prelude.lua), the meta hash last: the log changed, nothing written.
        assert await write("mine", ("XDEL", log, "0-1")) is None
        assert await redis.xlen(log) == 0 and await redis.hget(meta, "pend_at") == b"10"
        await redis.hset(meta, "pend_until", 1)  # its time is up: left to the script (rollback)
        assert await write("mine") is None
        assert await redis.xlen(log) == 0


async def test_a_plain_part_whose_answer_is_lost_is_not_taken_for_a_change(redis_url, http) -> None:
    """Redis answering too late (or the connection lost) while a part is written: the part's
    outcome is unknown, which the writer must hear as such (it then drops the append: 503),
    not as "the meta hash changed", after which it would write the part a second time."""
    async with _stream(redis_url, http, BYTES) as (server, url, sid):
        impatient = aioredis.Redis.from_url(redis_url, socket_timeout=0.3)
        scripts = Scripts(impatient)
        await _begin(scripts, sid, b"", 100, token="mine")
        meta, log = keys.stream_keys(sid)[:2]

        def commands(values: list, now: int):
            with sync_redis.Redis.from_url(redis_url) as other:
                other.execute_command("CLIENT", "PAUSE", "600", "WRITE")  # the write waits
            return parts.commands(meta, log, "mine", [(10, b"p" * 10)], b"", values, now)

        with pytest.raises(sync_redis.exceptions.TimeoutError):
            await scripts.write_watched([meta, log], parts.FIELDS, commands, "test")
        await asyncio.sleep(0.5)
        await impatient.aclose()


async def test_the_last_step_refuses_a_part_missing(redis_url, http, redis) -> None:
    async with _stream(redis_url, http, BYTES, b"ok") as (server, url, sid):
        scripts = Scripts(redis)
        await _begin(scripts, sid, b"x" * 10, 30, token="t")  # 30 announced, 10 written
        script_keys = [*keys.stream_keys(sid), keys.stream_subs(sid), keys.subs_outbox(sid, False)]
        last = ["t", "last", "0", "", "", "", "", keys.SUBS_WAKE_CHANNEL, ""]
        assert await scripts.run("append_part", script_keys, last) == [b"lost"]
        assert await read_all(http, url) == b"ok"
        async with http.post(url, data=b"!", headers=BYTES) as r:  # nothing waits behind it
            assert r.status == 204 and r.headers["Stream-Next-Offset"] == offsets.encode(3)


def _plain_parts() -> float:
    """Parts written by plain commands so far (the Redis call metrics count them)."""
    from gateway.streams.appends import PLAIN_PART
    from gateway.telemetry import metrics

    counts = (s for m in metrics.REDIS_SECONDS.collect() for s in m.samples if s.name.endswith("_count"))
    return sum(s.value for s in counts if s.labels.get("script") == PLAIN_PART)
