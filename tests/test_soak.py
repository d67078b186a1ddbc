"""Memory that stays flat while live readers come and go (the short version of loadtest/soak.py).

A gateway process (``python -m gateway serve`` on the session's Redis) takes the traffic
that leaked: JSON appends of many small messages on 120 streams while SSE readers come,
read for 0.2-2 s and leave, with long-polls (half abandoned) and create/fork/delete
cycles beside them. Its RSS (/proc) after the warm-up must stay within +15%: every
subscribed stream used to keep its last 32 notices whatever they held (~30 KB each as
the parsed messages of such an append), readers or not, so RSS climbed by megabytes a
second. Once the clients are gone, its /metrics gauges (live connections, pub/sub
subscriptions) must be back at their idle values.

Beside it, a gateway in this process takes lighter traffic of the same kinds, so the
counts /metrics does not show can be read directly: asyncio tasks, channels, waiters,
parked sinks, shared reads in flight, the listener's pending (un)subscriptions, live
slots; each must be back at its idle value too. Both settle together (subscriptions
linger 30 s after their last reader).
"""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.http.context import GATEWAY, Gateway
from gateway.live.channels import Channel
from gateway.protocol import notices
from loadtest import servers
from loadtest.soak import JSON, TEXT, Traffic, run_traffic, soak

from .conftest import start_gateway

SECONDS = 45.0  # of traffic
WARMUP = 20.0  # the RSS of transient work (reads, parsing) reaches its level within ~20 s
GROWTH = 0.15


def open_counts(gw: Gateway) -> dict[str, int]:
    """What a gateway in this process holds open for live readers (and tasks overall)."""
    fanout = gw.fanout
    channels = fanout._channels.values()
    subscriber: Any = fanout._subscriber  # one Redis: a Listener
    return {
        # A keep-alive connection's own task (aiohttp's RequestHandler.start) is left out: idle
        # connections of earlier tests' clients to other gateways in this process close on
        # their own timers meanwhile. A request's handler (a live read's) is a task of its own.
        "tasks": sum(t.get_coro().__qualname__ != "RequestHandler.start" for t in asyncio.all_tasks()),
        "channels": len(fanout._channels),
        "idle channels": len(fanout._idle),
        "waiters": sum(len(c.waiters) for c in channels),
        "parked sinks": sum(len(c.parked) for c in channels),
        "notices kept": sum(len(c.recent) for c in channels),
        "listener channels": len(subscriber.channels),
        "unsent subscriptions": len(subscriber._unsent),
        "pending unsubscriptions": len(subscriber._leaving),
        "channels being served": len(subscriber._serving),
        "readers in a round": sum(len(c.round or ()) for c in channels),
        "shared reads": len(gw.store._reads._shared._inflight),
        "live slots": gw.guard.live.total,
        "body bytes": gw.bodies.held,
    }


async def settled(gw: Gateway, idle: dict[str, int], seconds: float) -> dict[str, int]:
    """The counts once they are back at ``idle`` (or after ``seconds``, as they are then)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    now = open_counts(gw)
    while now != idle and loop.time() < deadline:
        await asyncio.sleep(0.5)
        now = open_counts(gw)
    return now


async def test_rss_stays_flat_and_open_counts_return_to_idle(redis_url: str) -> None:
    # Shorter than the defaults: a departed reader is noticed at its next heartbeat or notice,
    # so the idle counts come back within the 30 s subscriptions linger anyway.
    options = ("--redis-url", redis_url, "--long-poll-timeout", "5", "--sse-heartbeat-seconds", "5")
    heavy = Traffic(
        SECONDS, streams=120, append_rate=40, sse=40, long_polls=10, lifecycles=2,
        content_types=(JSON,), json_messages=300, resume_share=0.2,
    )  # fmt: skip
    light = Traffic(
        SECONDS, streams=30, append_rate=15, sse=15, long_polls=6, lifecycles=1,
        content_types=(JSON, TEXT), json_messages=50,
    )  # fmt: skip
    with servers.start("ours", *options) as process:
        server = await start_gateway(redis_url, long_poll_timeout=2.0, sse_heartbeat_seconds=1.0)
        try:
            gw = server.app[GATEWAY]
            base = str(server.make_url("/v1/stream"))
            await asyncio.sleep(0.5)  # the in-process gateway's start-up tasks are done
            idle = open_counts(gw)
            report, _ = await asyncio.gather(
                soak(process.base_url, process.pid, heavy, WARMUP, sample_seconds=2.0, settle_seconds=40.0),
                run_traffic(base, light),
            )
            after = await settled(gw, idle, 30.0)  # mostly at once: the soak waited out the linger
        finally:
            await server.close()
    print(report.summary())
    print(f"in-process open counts: idle {idle}, after the clients {after}")
    first, peak, percent = report.growth()
    assert report.counts.appends > SECONDS * 20 and report.counts.sse_sessions > 300, report.counts
    assert peak <= first * (1 + GROWTH), (
        f"RSS grew {percent:+.1f}% after the warm-up ({first:.0f} -> {peak:.0f} MB)"
    )
    assert report.idle_after == report.idle_before, "the gateway process holds live reads or subscriptions"
    assert after == idle, f"open counts not back to idle: {after} (idle: {idle})"


def test_a_streams_notice_history_is_bounded_in_bytes() -> None:
    """A few large-ish notices (a JSON batch of 300 messages holds ~40 KB parsed) fill the
    budget before the count: older ones go, and a reader they covered reads Redis instead."""
    recent = notices.Recent(size=32, budget=64 * 1024)
    position = 0
    for _ in range(10):
        messages = [b'{"i":%d}' % i for i in range(300)]
        took = sum(len(m) for m in messages)
        data = b"\n".join(messages)
        notice = notices.parse(b"%d %d 0 %d:%d\n%b" % (position, position + took, len(data), took, data))
        assert notice is not None
        recent.add(notice)
        position += took
    assert 0 < recent.held <= 64 * 1024 and len(recent) < 10
    assert recent.delivery(0) is None  # evicted: read Redis
    newest = recent.delivery(position - took)
    assert newest is not None and newest.tail == position and len(newest.entries) == 300
    recent.add(notices.parse(b"%d %d 0 1\nx" % (position, position + 1)))
    assert len(recent) >= 2 and recent.held <= 64 * 1024


async def test_a_channel_nobody_waits_on_keeps_no_notices() -> None:
    """A channel lingers subscribed after its last reader left: it keeps no history (a
    reader that comes re-reads Redis), though its notices still move ``notified_at``."""
    channel = Channel(asyncio.get_running_loop().create_future())
    event = asyncio.Event()
    channel.waiters.add(event)
    channel.deliver([notices.parse(b"0 2 0 2\nab")])
    assert len(channel.recent) == 1 and event.is_set()
    channel.waiters.discard(event)
    before = channel.notified_at
    channel.deliver([notices.parse(b"2 4 0 2\ncd")])
    assert len(channel.recent) == 0 and channel.notified_at >= before
