"""What an idle SSE connection costs the gateway, and the waits that keep it small.

A gateway holds thousands of idle event streams (issue 28: 10,000 per process, at most
16 KiB of RSS each). Measured here on a gateway process of its own (uvloop, as served):
its RSS grows by less than that per connection over a thousand idle ones. The build
before the timer wheel and the leaner Watch and SSE handler measured ~20 KiB per
connection this way (so it fails here), this one ~13 KiB; RSS moves in pages and
allocator arenas, hence a thousand connections and a bound with room to spare.

The Watch's waits (``gateway/live/channels.py``) end on one shared timer wheel
(``gateway/live/timers.py``): checked directly below, as the heartbeat, the SSE cycle
and long-poll timeouts all rest on them.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from urllib.parse import urlsplit

from gateway.live.channels import Channel, Shutdown, Watch
from gateway.live.timers import TICK, Wheel
from loadtest import servers

CONNECTIONS = 1000
WARM = 200  # opened first and kept: first-use caches, the channel, the loop's own growth
LIMIT_KIB = 16.0


class _Idle(asyncio.Protocol):
    """An SSE client that only notes what arrives."""

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.received = bytearray()
        self.started = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.received += data
        if not self.started.done() and b"event: control" in self.received:
            self.started.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.started.done():
            self.started.set_exception(ConnectionError("closed before the first event"))


async def _open(port: int, path: str, count: int) -> list[_Idle]:
    """``count`` SSE connections, once each has its first event."""
    loop = asyncio.get_running_loop()
    request = (
        f"GET {path}?offset=now&live=sse HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Accept: text/event-stream\r\n\r\n"
    ).encode()
    clients: list[_Idle] = []
    try:
        for i in range(0, count, 100):
            opened = await asyncio.gather(
                *(
                    loop.create_connection(lambda: _Idle(request), "127.0.0.1", port)
                    for _ in range(min(100, count - i))
                )
            )
            clients += [protocol for _, protocol in opened]
        await asyncio.wait_for(asyncio.gather(*(c.started for c in clients)), 60)
    except BaseException:
        _close(clients)
        raise
    return clients


def _close(clients: list[_Idle]) -> None:
    for client in clients:
        if client.transport is not None:
            client.transport.close()


def _http(method: str, url: str, body: bytes = b"") -> int:
    request = urllib.request.Request(
        url, data=body or None, method=method, headers={"Content-Type": "text/plain"}
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.status


async def test_an_idle_sse_connection_costs_under_16_kib_of_rss(redis_url: str) -> None:
    options = ("--redis-url", redis_url, "--sse-cycle-seconds", "600", "--sse-heartbeat-seconds", "60")
    with servers.start("ours", *options) as server:
        url = f"{server.base_url}/memory-{time.time_ns()}"
        parts = urlsplit(url)
        assert parts.port is not None
        assert await asyncio.to_thread(_http, "PUT", url) == 201
        meter = servers.ProcessMeter(server.pid)
        clients = await _open(parts.port, parts.path, WARM)
        try:
            await asyncio.sleep(0.5)
            before = meter.rss_mb()
            clients += await _open(parts.port, parts.path, CONNECTIONS)
            await asyncio.sleep(1.0)  # every reader parked
            per_connection = (meter.rss_mb() - before) * 1024 / CONNECTIONS
            # Still live, every one of them: an append reaches each exactly once.
            assert await asyncio.to_thread(_http, "POST", url, b"hello-memory") == 204
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not all(b"hello-memory" in c.received for c in clients):
                await asyncio.sleep(0.05)
            assert all(c.received.count(b"hello-memory") == 1 for c in clients)
        finally:
            _close(clients)
    print(f"RSS per idle SSE connection: {per_connection:.1f} KiB")
    assert per_connection <= LIMIT_KIB, f"{per_connection:.1f} KiB of RSS per idle SSE connection"


# -- the waits ------------------------------------------------------------------------------


class _Item:
    def __init__(self) -> None:
        self.expired_at: float | None = None

    def expire(self) -> None:
        assert self.expired_at is None, "expired twice"
        self.expired_at = asyncio.get_running_loop().time()


async def test_the_wheel_ends_waits_in_time_never_early_on_one_timer() -> None:
    wheel = Wheel()
    loop = asyncio.get_running_loop()
    began = loop.time()
    items = {delay: _Item() for delay in (0.01, 0.12, 0.12, 0.3)}
    ticks = {delay: wheel.add(item, delay) for delay, item in items.items()}
    gone = _Item()
    wheel.discard(gone, wheel.add(gone, 0.05))  # a wait woken otherwise: never expires
    assert len(wheel) == len(items)
    await asyncio.sleep(0.3 + 3 * TICK)
    assert gone.expired_at is None and len(wheel) == 0 and wheel._handle is None
    for delay, item in items.items():
        assert item.expired_at is not None
        assert delay <= item.expired_at - began <= delay + TICK + 0.05, (delay, item.expired_at - began)
    assert ticks[0.01] <= ticks[0.12] <= ticks[0.3]
    wheel.close()


async def test_a_watch_wakes_when_set_times_out_and_stops_on_shutdown() -> None:
    loop = asyncio.get_running_loop()
    shutdown, wheel = Shutdown(), Wheel()
    channel = Channel(loop.create_future())
    watch = Watch(shutdown, channel, wheel)
    channel.waiters.add(watch)

    began = loop.time()
    assert not await watch.wait(0.1)  # timed out, not early
    assert loop.time() - began >= 0.1

    watch.set()  # while not waiting: the next wait returns at once
    assert watch.is_set() and await watch.wait(5.0) and not watch.is_set()

    waiting = asyncio.ensure_future(watch.wait(5.0))
    await asyncio.sleep(0.02)
    for waiter in channel.waiters:
        waiter.set()  # as a notice does
    assert await asyncio.wait_for(waiting, 1.0)
    assert len(wheel) == 0  # its timeout left the wheel with it

    class Sink:
        position, closed, key = 0, False, "k"

    parked = asyncio.ensure_future(watch.park(Sink(), 5.0))  # type: ignore[arg-type]
    await asyncio.sleep(0.02)
    assert watch in channel.parked
    parked.cancel()  # the client left: unparked all the same
    await asyncio.gather(parked, return_exceptions=True)
    assert watch not in channel.parked and len(wheel) == 0

    waiting = asyncio.ensure_future(watch.wait(5.0))
    await asyncio.sleep(0.02)
    shutdown.started = True
    watch.set()  # as Fanout.stop_waiters does
    assert not await asyncio.wait_for(waiting, 1.0)
    assert not await watch.wait(5.0)  # stopping: no more waiting
    wheel.close()
