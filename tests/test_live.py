"""Live reads: long-poll and SSE, in one gateway and across two."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator

import aiohttp
import pytest

from gateway.http.context import GATEWAY
from gateway.live.channels import Watch
from gateway.protocol import offsets

from .conftest import serving, start_gateway

TEXT = {"Content-Type": "text/plain"}


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, str]]:
    """A response's SSE events as (event, data), and ("comment", text) for each comment line
    (heartbeats), as they arrive."""
    kind, data = "", []
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if line.startswith(":"):
            yield "comment", line[1:]
        elif line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:][1:] if line[5:].startswith(" ") else line[5:])
        elif line == "" and kind:
            yield kind, "\n".join(data)
            kind, data = "", []


async def read_sse(response: aiohttp.ClientResponse, until: str) -> list[tuple[str, str]]:
    """(event, data) pairs until a control event containing ``until``."""
    events = []
    async for kind, data in sse_events(response):
        if kind == "comment":
            continue
        events.append((kind, data))
        if kind == "control" and until in data:
            break
    return events


async def test_long_poll_wakes_on_append(http: aiohttp.ClientSession, url: str) -> None:
    await http.put(url, data=b"a", headers=TEXT)
    waiter = asyncio.create_task(http.get(url, params={"offset": offsets.encode(1), "live": "long-poll"}))
    await asyncio.sleep(0.3)
    assert not waiter.done()
    await http.post(url, data=b"b", headers=TEXT)
    r = await asyncio.wait_for(waiter, 2)
    assert r.status == 200 and await r.read() == b"b"
    assert r.headers["Stream-Cursor"].isdigit()


async def test_long_poll_times_out_with_204(http: aiohttp.ClientSession, url: str) -> None:
    await http.put(url, headers=TEXT)
    async with http.get(url, params={"offset": "now", "live": "long-poll"}) as r:
        assert r.status == 204
        assert r.headers["Stream-Up-To-Date"] == "true"
        assert r.headers["Stream-Next-Offset"] == offsets.encode(0)


async def test_long_poll_ends_at_once_on_closed_stream(http: aiohttp.ClientSession, url: str) -> None:
    await http.put(url, headers={**TEXT, "Stream-Closed": "true"})
    r = await asyncio.wait_for(http.get(url, params={"offset": "-1", "live": "long-poll"}), 1)
    assert r.status == 204 and r.headers["Stream-Closed"] == "true"


async def test_close_wakes_long_poll(http: aiohttp.ClientSession, url: str) -> None:
    await http.put(url, headers=TEXT)
    waiter = asyncio.create_task(http.get(url, params={"offset": "-1", "live": "long-poll"}))
    await asyncio.sleep(0.2)
    await http.post(url, headers={"Stream-Closed": "true"})
    r = await asyncio.wait_for(waiter, 1)
    assert r.status == 204 and r.headers["Stream-Closed"] == "true"


async def test_sse_streams_appends_then_closes(http: aiohttp.ClientSession, url: str) -> None:
    await http.put(url, json=[{"n": 0}])
    async with http.get(url, params={"offset": "-1", "live": "sse"}) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        first = await read_sse(r, "upToDate")
        assert first[0] == ("data", '[{"n":0}]')
        await http.post(url, json=[{"n": 1}, {"n": 2}])
        await http.post(url, json={"n": 3}, headers={"Stream-Closed": "true"})
        rest = await asyncio.wait_for(read_sse(r, "streamClosed"), 3)
    data = [json.loads(d) for kind, d in rest if kind == "data"]
    assert [m["n"] for batch in data for m in batch] == [1, 2, 3]
    final = json.loads(rest[-1][1])
    assert final["streamClosed"] is True and "streamCursor" not in final


async def test_sse_binary_is_base64(http: aiohttp.ClientSession, url: str) -> None:
    await http.put(url, data=b"\x00\xff", headers={"Content-Type": "application/octet-stream"})
    async with http.get(url, params={"offset": "-1", "live": "sse"}) as r:
        assert r.headers["Stream-SSE-Data-Encoding"] == "base64"
        events = await read_sse(r, "upToDate")
    assert events[0] == ("data", "AP8=")


@pytest.mark.parametrize(
    ("content_type", "body", "sse_data", "poll_body"),
    [
        ("text/plain", b"hi", "hi", b"hi"),
        ("application/json", b'[{"n":1},{"n":2}]', '[{"n":1},{"n":2}]', b'[{"n":1},{"n":2}]'),
        ("application/octet-stream", b"\x00\x01", "AAE=", b"\x00\x01"),
    ],
)
async def test_two_gateways_share_one_redis(
    http: aiohttp.ClientSession,
    redis_url: str,
    content_type: str,
    body: bytes,
    sse_data: str,
    poll_body: bytes,
) -> None:
    """Append through one gateway, read live through another: long-poll and SSE,
    byte and JSON streams, up to the closing EOF."""
    a, b = await start_gateway(redis_url), await start_gateway(redis_url)
    try:
        name = f"/v1/stream/shared-{content_type.replace('/', '-')}"
        url_a, url_b = str(a.make_url(name)), str(b.make_url(name))
        await http.delete(url_a)
        await http.put(url_a, headers={"Content-Type": content_type})
        poll = asyncio.create_task(http.get(url_b, params={"offset": "-1", "live": "long-poll"}))
        sse = await http.get(url_b, params={"offset": "-1", "live": "sse"})
        await read_sse(sse, "upToDate")
        await asyncio.sleep(0.2)
        await http.post(url_a, data=body, headers={"Content-Type": content_type})
        r = await asyncio.wait_for(poll, 2)
        assert await r.read() == poll_body
        closing_poll = asyncio.create_task(
            http.get(url_b, params={"offset": r.headers["Stream-Next-Offset"], "live": "long-poll"})
        )
        await asyncio.sleep(0.2)
        await http.post(url_a, headers={"Stream-Closed": "true"})
        events = await asyncio.wait_for(read_sse(sse, "streamClosed"), 2)
        assert [d for kind, d in events if kind == "data"] == [sse_data]
        eof = await asyncio.wait_for(closing_poll, 2)
        assert eof.status == 204 and eof.headers["Stream-Closed"] == "true"
        sse.close()
    finally:
        await a.close()
        await b.close()


async def evalsha_calls(redis) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def script_reads_while_fanning_out(
    http: aiohttp.ClientSession, url: str, redis, readers: int, appends: int
) -> int:
    """Script calls beyond the appends themselves, while ``readers`` SSE
    subscribers each receive every one of ``appends`` appends."""
    await http.put(url, headers=TEXT)
    responses = [await http.get(url, params={"offset": "-1", "live": "sse"}) for _ in range(readers)]
    for r in responses:
        await read_sse(r, "upToDate")
    await asyncio.sleep(0.2)
    before = await evalsha_calls(redis)
    for i in range(appends):
        await http.post(url, data=f"m{i};".encode(), headers=TEXT)
        for r in responses:  # every reader gets every message
            events = await asyncio.wait_for(read_sse(r, "streamNextOffset"), 2)
            assert ("data", f"m{i};") in events
    calls = await evalsha_calls(redis) - before
    for r in responses:
        r.close()
    return calls - appends


async def test_redis_reads_per_append_do_not_grow_with_readers(
    http: aiohttp.ClientSession, quiet_gateway
) -> None:
    """Small appends ride in the pub/sub notice: 50 woken readers need no read at all."""
    url, redis = quiet_gateway
    reads = await script_reads_while_fanning_out(http, url, redis, readers=50, appends=10)
    assert reads <= 1, f"{reads} script reads for 10 appends with 50 readers"


async def test_without_payload_notices_readers_share_one_read(
    http: aiohttp.ClientSession, quiet_redis
) -> None:
    """Appends too large to ride in the notice (here: all of them): the woken
    readers of one gateway share one Redis read per append."""
    redis_url, redis = quiet_redis
    gateway = await start_gateway(redis_url, notice_payload_bytes=0)
    url = str(gateway.make_url("/v1/stream/no-payload"))
    try:
        await http.delete(url)
        reads = await script_reads_while_fanning_out(http, url, redis, readers=20, appends=5)
        assert 1 <= reads <= 2 * 5
    finally:
        await gateway.close()


async def test_live_readers_survive_a_redis_restart(http: aiohttp.ClientSession, tmp_path) -> None:
    """SIGKILL Redis under waiting SSE and long-poll readers, restart it: each
    reader gets every byte once, in order, with no reconnect of its own."""
    from .conftest import own_redis_server

    with own_redis_server(tmp_path) as redis_server:
        gateway = await start_gateway(redis_server.url, long_poll_timeout=15.0)
        url = str(gateway.make_url("/v1/stream/restart"))
        try:
            await http.put(url, data=b"before;", headers=TEXT)
            sse = await http.get(url, params={"offset": "-1", "live": "sse"})
            assert ("data", "before;") in await read_sse(sse, "upToDate")
            poll = asyncio.create_task(
                http.get(url, params={"offset": offsets.encode(7), "live": "long-poll"})
            )
            await asyncio.sleep(0.3)

            redis_server.kill()
            await asyncio.sleep(1.0)
            redis_server.start()
            for _ in range(50):  # the writer retries until the gateway reaches Redis again
                async with http.post(url, data=b"after;", headers=TEXT) as r:
                    if r.status == 204:
                        break
                    assert r.status == 503
                await asyncio.sleep(0.1)
            r = await asyncio.wait_for(poll, 10)
            assert r.status == 200 and await r.read() == b"after;"
            await http.post(url, headers={"Stream-Closed": "true"})
            events = await asyncio.wait_for(read_sse(sse, "streamClosed"), 10)
            assert [d for kind, d in events if kind == "data"] == ["after;"]
            sse.close()
        finally:
            await gateway.close()


async def test_sse_order_holds_across_direct_and_read_paths(
    http: aiohttp.ClientSession, redis_url: str
) -> None:
    """Small appends are written by the fan-out itself, larger ones read by the
    reader's task: interleaved, every reader still sees every byte once, in order."""
    gateway = await start_gateway(redis_url, notice_payload_bytes=6)
    url = str(gateway.make_url("/v1/stream/mixed-paths"))
    try:
        await http.delete(url)
        await http.put(url, headers=TEXT)
        readers = [await http.get(url, params={"offset": "-1", "live": "sse"}) for _ in range(5)]
        for r in readers:
            await read_sse(r, "upToDate")
        sent = [b"a;", b"bbbbbbbbbb;", b"c;", b"d;", b"eeeeeeeeeeee;", b"f;"]
        for body in sent:
            await http.post(url, data=body, headers=TEXT)
        await http.post(url, headers={"Stream-Closed": "true"})
        for r in readers:
            events = await asyncio.wait_for(read_sse(r, "streamClosed"), 5)
            assert "".join(d for kind, d in events if kind == "data") == b"".join(sent).decode()
            r.close()
    finally:
        await gateway.close()


async def test_sse_heartbeats_and_reconnect_cycle(http: aiohttp.ClientSession, redis_url: str) -> None:
    """Idle SSE connections get comment lines; the response ends after the
    (jittered) cycle with a control event naming the offset to resume from."""
    gateway = await start_gateway(redis_url, sse_heartbeat_seconds=0.3, sse_cycle_seconds=1.5)
    url = str(gateway.make_url("/v1/stream/heartbeat"))
    try:
        await http.delete(url)
        await http.put(url, data=b"x", headers=TEXT)
        loop = asyncio.get_running_loop()
        began = loop.time()
        async with http.get(url, params={"offset": "-1", "live": "sse"}) as r:
            assert r.headers["X-Accel-Buffering"] == "no"
            raw = (await asyncio.wait_for(r.content.read(), 5)).decode()
        took = loop.time() - began
    finally:
        await gateway.close()
    assert 1.1 <= took <= 2.5  # 75-100% of the cycle, plus slack
    assert raw.count(": \n\n") >= 2
    last = raw.rstrip("\n").rsplit("\n\n", 1)[-1]
    assert last.startswith("event: control") and offsets.encode(1) in last


async def test_a_burst_of_readers_waits_for_redis_connections(redis_url: str) -> None:
    """More simultaneous readers than Redis connections: they queue for one, none fails."""
    gateway = await start_gateway(redis_url, redis_max_connections=4)
    url = str(gateway.make_url(f"/v1/stream/burst-{uuid.uuid4().hex[:8]}"))
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            async with http.put(url, headers=TEXT) as r:
                assert r.status == 201
            readers = await asyncio.gather(
                *(http.get(url, params={"offset": "now", "live": "sse"}) for _ in range(200))
            )
            assert {r.status for r in readers} == {200}
            for r in readers:
                await read_sse(r, "upToDate")
            async with http.post(url, data=b"to all", headers=TEXT) as r:
                assert r.status == 204
            for r in readers:
                events = await asyncio.wait_for(read_sse(r, "streamNextOffset"), 5)
                assert ("data", "to all") in events
                r.close()
    finally:
        await gateway.close()


async def _rest_of(response: aiohttp.ClientResponse, seconds: float = 5.0) -> bytes:
    """What an event stream sends until it ends (or ``seconds`` pass: it did not end)."""
    body = b""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            async for data in response.content.iter_any():
                body += data
    return body


@pytest.mark.parametrize("live", ["long-poll", "sse"])
@pytest.mark.parametrize("appends", [(b"ABCDE", b"FGHIJ"), (b"AB",)], ids=["longer", "shorter"])
async def test_a_reader_of_a_stream_deleted_and_created_anew_ends(
    redis_url: str, live: str, appends: tuple[bytes, ...]
) -> None:
    """A live reader at offset 5 of a stream that is deleted and created anew while it
    registers must not be handed the new stream's bytes as the old one's (appended "ABCDE",
    then "FGHIJ": from offset 5 on by chance), nor be told its offset is wrong (the new one
    shorter: 400): it ends as if it had seen the deletion alone (long-poll 404; the event
    stream ends without a data event)."""
    server = await start_gateway(redis_url, sse_cycle_seconds=30.0)
    gw = server.app[GATEWAY]
    url = str(server.make_url(f"/v1/stream/renewed-{uuid.uuid4().hex[:8]}"))
    async with aiohttp.ClientSession() as http:
        try:
            await (await http.put(url, headers=TEXT, data=b"hello")).release()
            register = gw.fanout.watch

            @contextlib.asynccontextmanager
            async def watch_after_a_new_stream(sid: str, read_at: float = 0.0) -> AsyncIterator[Watch]:
                async with register(sid, read_at) as watch:
                    await (await http.delete(url)).release()
                    await (await http.put(url, headers=TEXT)).release()
                    for data in appends:
                        await (await http.post(url, headers=TEXT, data=data)).release()
                    await asyncio.sleep(0.2)  # their notices reach the channel
                    yield watch

            gw.fanout.watch = watch_after_a_new_stream  # type: ignore[method-assign]
            params = {"offset": offsets.encode(5), "live": live}
            async with http.get(url, params=params, timeout=aiohttp.ClientTimeout(total=10)) as r:
                if live == "long-poll":
                    assert r.status == 404, (r.status, await r.read())
                else:
                    assert r.status == 200
                    body = await _rest_of(r)
                    assert b"event: data" not in body, body
                    assert r.content.at_eof(), "the event stream went on"
        finally:
            await server.close()


async def test_a_parked_reader_of_a_stream_that_expired_and_was_created_anew_ends(redis_url: str) -> None:
    """An expiry announces nothing (Redis drops the keys): a parked SSE reader of a stream
    whose TTL ran out must still not be written the bytes of the stream created anew under
    its name ("ABCDE", then "FGHIJ": from its offset 5 on). create.lua's 'created' notice
    wakes it to read Redis, and it ends."""
    async with serving(redis_url, sse_cycle_seconds=30.0) as base:
        url = f"{base}/expiring-{uuid.uuid4().hex[:8]}"
        async with aiohttp.ClientSession() as http:
            headers = {**TEXT, "Stream-TTL": "1"}
            await (await http.put(url, headers=headers, data=b"hello")).release()
            params = {"offset": offsets.encode(5), "live": "sse"}
            async with http.get(url, params=params, timeout=aiohttp.ClientTimeout(total=15)) as r:
                assert r.status == 200
                await asyncio.sleep(2.0)  # parked (heartbeats only) while the stream expires
                async with http.head(url) as gone:
                    assert gone.status == 404
                await (await http.put(url, headers=TEXT)).release()
                for data in (b"ABCDE", b"FGHIJ"):
                    await (await http.post(url, headers=TEXT, data=data)).release()
                body = await _rest_of(r)
                assert b"event: data" not in body, body
                assert r.content.at_eof(), "the event stream went on"
