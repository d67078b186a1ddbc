"""Live-read wake-ups under pub/sub faults: first subscriptions racing the
connection, Redis restarts, a silent connection, idle channels being dropped.

Real redis-server processes only; every wait is bounded, none is timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable

import aiohttp
import redis.asyncio as aioredis

from gateway.http.app import GATEWAY
from gateway.live.channels import Watch
from gateway.live.fanout import Fanout
from gateway.redis_io import keys

from .conftest import own_redis_server, start_gateway
from .test_live import read_sse

TEXT = {"Content-Type": "text/plain"}
WAKE_SECONDS = 5.0  # how long a woken reader may take to answer


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


async def long_poll(http: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    """A long-poll from the tail, retried while Redis is unreachable (503)."""
    while True:
        r = await http.get(url, params={"offset": "now", "live": "long-poll"})
        if r.status != 503:
            return r
        r.release()
        await asyncio.sleep(0.05)


async def sse_up_to_date(http: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    """An SSE response from the tail that has said it is up to date: its reader
    has registered with the fan-out and read the stream."""
    while True:
        r = await http.get(url, params={"offset": "now", "live": "sse"})
        if r.status == 200:
            await read_sse(r, "upToDate")
            return r
        r.release()
        await asyncio.sleep(0.05)


async def poll_woke(poll: asyncio.Task[aiohttp.ClientResponse], body: bytes) -> bool:
    try:
        r = await asyncio.wait_for(poll, WAKE_SECONDS)
    except TimeoutError:
        return False
    async with r:
        return r.status == 200 and await r.read() == body


async def sse_woke(r: aiohttp.ClientResponse, body: bytes) -> bool:
    try:
        events = await asyncio.wait_for(read_sse(r, "streamNextOffset"), WAKE_SECONDS)
    except TimeoutError:
        return False
    finally:
        r.close()
    return ("data", body.decode()) in events


async def readers_wake(
    http: aiohttp.ClientSession, urls: list[str], ready_seconds: float, stagger: float = 0.0
) -> int:
    """A long-poll and an SSE reader on each stream, the streams' readers
    ``stagger`` seconds apart; once the SSE readers are up to date, one append
    each. Returns how many readers did not get their append."""

    async def later(i: int, reader: Awaitable[aiohttp.ClientResponse]) -> aiohttp.ClientResponse:
        await asyncio.sleep(i * stagger)
        return await reader

    polls = [asyncio.create_task(later(i, long_poll(http, url))) for i, url in enumerate(urls)]
    # Longer than the fan-out waits for a confirmation that never comes (5 s): a
    # reader whose subscription was lost reads after that wait, and then waits in vain.
    sses = await asyncio.wait_for(
        asyncio.gather(*(later(i, sse_up_to_date(http, url)) for i, url in enumerate(urls))), ready_seconds
    )
    await asyncio.sleep(0.3)  # the long-polls, started with them, are waiting too
    for i, url in enumerate(urls):
        async with http.post(url, data=b"m%d" % i, headers=TEXT) as r:
            assert r.status == 204
    woke = await asyncio.gather(
        *(poll_woke(poll, b"m%d" % i) for i, poll in enumerate(polls)),
        *(sse_woke(r, b"m%d" % i) for i, r in enumerate(sses)),
    )
    return woke.count(False)


async def create(http: aiohttp.ClientSession, urls: list[str]) -> None:
    for url in urls:
        async with http.put(url, headers=TEXT) as r:
            assert r.status == 201


async def test_first_readers_on_a_fresh_gateway_all_wake(redis_url: str) -> None:
    """40 streams' first readers (long-poll and SSE) reach a gateway that has
    just started, while its pub/sub connection opens: every one wakes."""
    tag = uuid.uuid4().hex[:8]
    names = [f"/v1/stream/fresh-{tag}-{i}" for i in range(40)]
    async with session() as http:
        setup = await start_gateway(redis_url)
        try:
            await create(http, [str(setup.make_url(name)) for name in names])
        finally:
            await setup.close()
        fresh = await start_gateway(redis_url, long_poll_timeout=20.0)
        try:
            missed = await readers_wake(http, [str(fresh.make_url(name)) for name in names], 10.0)
        finally:
            await fresh.close()
    assert missed == 0, f"{missed} of 80 first readers never woke"


async def test_readers_arriving_across_redis_restarts_all_wake(tmp_path) -> None:
    """Redis is killed and restarted (AOF on) again and again while readers
    keep arriving on new streams, before, during and after the gateway's
    pub/sub reconnect: after every restart, every reader wakes."""
    with own_redis_server(tmp_path) as server:
        gateway = await start_gateway(server.url, long_poll_timeout=30.0)
        try:
            async with session() as http:
                for restart in range(5):
                    urls = [str(gateway.make_url(f"/v1/stream/restart{restart}-{i}")) for i in range(24)]
                    await create(http, urls)
                    server.kill()
                    started = asyncio.create_task(asyncio.to_thread(server.start))
                    missed = await readers_wake(http, urls, 20.0, stagger=0.05)
                    await started
                    assert missed == 0, f"restart {restart}: {missed} of 48 readers never woke"
        finally:
            await gateway.close()


async def pubsub_clients(redis: aioredis.Redis) -> set[int]:
    return {client["id"] for client in await redis.client_list(_type="pubsub")}


async def append_reaches(redis: aioredis.Redis, sid: str, watch: Watch, position: int) -> bool:
    """Publish a one-byte append's notice: does the waiting reader learn of it?"""
    watch.reading()  # the reader read Redis (at its position): notices from now on apply
    await redis.publish(keys.notify_channel(sid), b"%d %d 0 1\nx" % (position, position + 1))
    if not await watch.wait(WAKE_SECONDS):
        return False
    delivery = watch.delivery(position)  # a (re)subscription would have cleared it
    return delivery is not None and delivery.entries == ((position, b"x"),)


async def test_a_silent_pubsub_connection_is_replaced(tmp_path) -> None:
    """Redis stops answering (SIGSTOP) for longer than the health check allows:
    the listener gives the connection up, and once Redis answers again it
    subscribes on a new one, which wakes the waiting reader; appends reach it."""
    with own_redis_server(tmp_path) as server:
        redis = aioredis.Redis.from_url(server.url)
        fanout = Fanout(aioredis.Redis.from_url(server.url), health_seconds=0.2)
        await fanout.start()
        assert server.process is not None
        try:
            async with fanout.watch("silent") as watch:
                await watch.wait(0)  # the subscription's confirmation
                before = await pubsub_clients(redis)
                assert len(before) == 1
                os.kill(server.process.pid, signal.SIGSTOP)
                try:
                    await asyncio.sleep(1.5)  # PING after 0.2 s of silence, unanswered 0.2 s later
                finally:
                    os.kill(server.process.pid, signal.SIGCONT)
                assert await watch.wait(WAKE_SECONDS), "not woken by a new subscription"
                after = await pubsub_clients(redis)
                assert len(after) == 1 and after != before
                assert await append_reaches(redis, "silent", watch, 0)
        finally:
            await fanout.close()
            await redis.aclose()


async def test_a_reader_arriving_as_its_channel_is_dropped_still_wakes(redis_url: str) -> None:
    """With no linger, a stream's subscription is dropped as soon as its last
    reader leaves; a reader arriving just then (before, during or after the
    UNSUBSCRIBE) must end up subscribed and learn of the next append."""
    redis = aioredis.Redis.from_url(redis_url)
    fanout = Fanout(aioredis.Redis.from_url(redis_url), linger_seconds=0.0)
    await fanout.start()
    sid = f"dropped-{uuid.uuid4().hex[:8]}"
    rng = random.Random(11)
    try:
        for attempt in range(200):
            async with fanout.watch(sid):
                pass
            for _ in range(rng.randrange(6)):  # let the listener get somewhere with the drop
                await asyncio.sleep(0)
            if rng.random() < 0.3:
                await asyncio.sleep(rng.uniform(0, 0.003))
            async with fanout.watch(sid) as watch:
                await watch.wait(0)  # the subscription's confirmation, if it was (re)subscribed
                assert await append_reaches(redis, sid, watch, attempt), f"attempt {attempt}: append missed"
    finally:
        await fanout.close()
        await redis.aclose()


async def test_a_deleted_notice_wakes_parked_readers() -> None:
    """``deleted`` (and any unparsable notice) carries no data: a parked reader's task
    wakes and reads for itself. (It once reached ``notices.stitch`` as None, raised in
    the listener, and cost every reader of the process a pub/sub reconnect.)"""
    from gateway.live.channels import Channel
    from gateway.protocol import notices

    class Sink:
        position, closed, key = 5, False, "k"

        def frame(self, delivery: notices.Delivery) -> bytes:
            return b"frame"

        def writable(self) -> bool:
            return True

        def write(self, frame: bytes) -> None:
            raise AssertionError("nothing to write for a deleted stream")

    channel = Channel(asyncio.get_running_loop().create_future())
    parked, plain = asyncio.Event(), asyncio.Event()
    channel.waiters |= {parked, plain}
    channel.parked[parked] = Sink()
    channel.deliver([notices.parse(b"deleted")])
    assert parked.is_set() and plain.is_set()
    small = notices.parse(b"5 7 0 2\nab")
    assert notices.stitch([small, None], 5) is None and notices.stitch([small], 5) is not None


async def test_an_append_between_an_sse_readers_first_read_and_its_registration(redis_url: str) -> None:
    """SSE reads first, then registers with the fan-out. On a channel other readers keep
    subscribed, an append (and its notice) in between reaches only them: the new reader
    must look again rather than sleep until its cycle ends (found by the chaos run)."""
    server = await start_gateway(redis_url, sse_heartbeat_seconds=1.0, sse_cycle_seconds=30.0)
    gw = server.app[GATEWAY]
    name = f"between-{uuid.uuid4().hex[:8]}"
    url = str(server.make_url(f"/v1/stream/{name}"))
    text = {"Content-Type": "text/plain"}
    async with aiohttp.ClientSession() as http:
        try:
            async with http.put(url, headers=text) as r:
                tail = r.headers["Stream-Next-Offset"]
            first = await http.get(
                url, params={"offset": tail, "live": "sse"}
            )  # keeps the channel subscribed
            await read_sse(first, "upToDate")
            register = gw.fanout.watch

            @contextlib.asynccontextmanager
            async def watch_after_an_append(sid: str, read_at: float = 0.0) -> AsyncIterator[Watch]:
                await gw.store.append(
                    sid, "text/plain", [(7, b"between")], close=False, stream_seq=None, producer=None
                )
                await asyncio.sleep(0.2)  # its notice reaches the readers registered now
                async with register(sid, read_at) as watch:
                    yield watch

            gw.fanout.watch = watch_after_an_append  # type: ignore[method-assign]
            second = await http.get(url, params={"offset": tail, "live": "sse"})
            gw.fanout.watch = register  # type: ignore[method-assign]
            events = await asyncio.wait_for(read_sse(second, 'upToDate":true'), 0.5)
            while not any(kind == "data" for kind, _ in events):
                events += await asyncio.wait_for(read_sse(second, "upToDate"), 3.0)
            assert [data for kind, data in events if kind == "data"] == ["between"]
            first.close()
            second.close()
        finally:
            await server.close()
