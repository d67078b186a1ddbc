"""Live-read wake-ups: one pub/sub connection per process, one subscription
per stream shared by all of this process's waiting readers.

Append and close scripts PUBLISH on the stream's channel. A reader registers
(``watch``) *before* it re-reads the stream, and the subscription is confirmed
by Redis before ``watch`` returns, so an append can never fall between the
reader's last look and its wait. When the connection drops, redis-py (or our
loop) reconnects and resubscribes; every subscribe confirmation wakes that
channel's readers to re-read, covering whatever was published meanwhile.
Subscriptions linger a while after their last reader leaves, so a long-poll
client that comes straight back finds its stream still subscribed.

A reader that is caught up can *park* a Sink while it waits: for a notice
that carries its data and starts at the sink's position, the listener writes
to the sink itself (one frame built per notice, one socket write per reader)
and the reader's task is not woken at all. Anything else (a gap, a large
append, a slow client, a closed stream) wakes the task, which then reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field
from typing import Protocol

from redis.asyncio import Redis

from . import keys, metrics, notices

log = logging.getLogger(__name__)
_CONFIRM_WAIT_SECONDS = 5.0
_MAX_BATCH = 512
_BUSY_SECONDS = 0.02  # a dispatch longer than this makes the listener pace itself


async def _buffered(connection) -> bool:
    """Whether a pub/sub reply is already waiting (redis-py 8 renamed the check)."""
    check = getattr(connection, "can_read", None) or connection.can_read_destructive
    return await check()


class Sink(Protocol):
    """A parked reader the listener may write to directly."""

    position: int  # where the reader is; advanced by the listener as it writes
    closed: bool  # set by the listener when it wrote the stream's end
    key: Hashable  # sinks with equal keys get identical frames for a notice

    def frame(self, delivery: notices.Delivery) -> bytes: ...
    def writable(self) -> bool: ...
    def write(self, frame: bytes) -> None: ...


@dataclass
class _Channel:
    confirmed: asyncio.Future[None]
    waiters: set[asyncio.Event] = field(default_factory=set)
    idle_since: float | None = None
    notified_at: float = 0.0  # time.monotonic() of the last notice or (re)subscription
    recent: notices.Recent = field(default_factory=notices.Recent)
    parked: dict[asyncio.Event, Sink] = field(default_factory=dict)

    def deliver(self, batch: list[notices.Notice | None]) -> None:
        """Serve parked sinks from consecutive notices; wake every other waiter.

        Under load the listener hands over every notice that queued up while
        it was busy, so a sink gets one write however many appends it covers:
        writes per second stay bounded and latency degrades gracefully.
        """
        self.notified_at = time.monotonic()
        for notice in batch:
            self.recent.add(notice)
        deliveries: dict[int, notices.Delivery | None] = {}  # sinks mostly share a position
        frames: dict[tuple[Hashable, int], bytes] = {}
        parked = self.parked
        for event in self.waiters:
            sink = parked.get(event)
            if sink is None:
                event.set()  # not parked: its task reads for itself
                continue
            position = sink.position
            if position in deliveries:
                delivery = deliveries[position]
            else:
                delivery = deliveries[position] = notices.stitch(batch, position)
            if delivery is None or not sink.writable():
                event.set()  # behind, large appends, or a slow client: its task takes over
                continue
            if delivery.tail == position and not delivery.closed:
                continue  # nothing new for this one
            key = (sink.key, position)
            frame = frames.get(key)
            if frame is None:
                frame = frames[key] = sink.frame(delivery)
            try:
                sink.write(frame)
            except (OSError, RuntimeError):  # the connection just went: its task cleans up
                event.set()
                continue
            sink.position = delivery.tail
            if delivery.closed:
                sink.closed = True
                event.set()


class Watch:
    """A reader's registration: ``wait`` returns True when the stream moved."""

    def __init__(self, fanout: Fanout, channel: _Channel, event: asyncio.Event) -> None:
        self._fanout = fanout
        self._channel = channel
        self._event = event
        self._confirmed_at = time.monotonic()

    @property
    def since(self) -> float:
        """Reads that started before this may miss what the reader was told of:
        the subscription's confirmation, or the channel's latest notice."""
        return max(self._confirmed_at, self._channel.notified_at)

    def delivery(self, start: int) -> notices.Delivery | None:
        """What the latest notices say happened from ``start`` on, when they
        say all of it (small appends, nothing missed); else None: read Redis."""
        return self._channel.recent.delivery(start)

    async def park(self, sink: Sink, timeout: float) -> bool:
        """``wait``, letting the listener write small appends to ``sink`` meanwhile."""
        self._channel.parked[self._event] = sink
        try:
            return await self.wait(timeout)
        finally:
            del self._channel.parked[self._event]

    @property
    def stopping(self) -> bool:
        return self._fanout.stopping

    async def wait(self, timeout: float) -> bool:
        if self._fanout.stopping:
            return False
        if not self._event.is_set():
            try:
                async with asyncio.timeout(timeout):  # no extra task per wait, unlike wait_for
                    await self._event.wait()
            except TimeoutError:
                return False
        self._event.clear()
        return not self._fanout.stopping


class Fanout:
    def __init__(self, redis: Redis, linger_seconds: float = 30.0) -> None:
        self._redis = redis
        self._linger = linger_seconds
        self._channels: dict[str, _Channel] = {}
        self._pubsub = None
        self._wake_loop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.stopping = False

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="fanout")

    def stop_waiters(self) -> None:
        """Graceful shutdown: every live reader wakes and finishes its response."""
        self.stopping = True
        for channel in self._channels.values():
            for event in channel.waiters:
                event.set()

    async def close(self) -> None:
        """Stop the listener and close the pub/sub client (the fan-out owns it)."""
        self.stop_waiters()
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._redis.aclose()

    @contextlib.asynccontextmanager
    async def watch(self, sid: str) -> AsyncIterator[Watch]:
        name = keys.notify_channel(sid)
        channel = self._channels.get(name)
        if channel is None:
            channel = _Channel(asyncio.get_running_loop().create_future())
            self._channels[name] = channel
            metrics.SUBSCRIPTIONS.set(len(self._channels))
            await self._subscribe(name)
        event = asyncio.Event()
        channel.waiters.add(event)
        channel.idle_since = None
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                # Without Redis we cannot be woken; the reader's own timeout still ends its wait.
                await asyncio.wait_for(asyncio.shield(channel.confirmed), _CONFIRM_WAIT_SECONDS)
            yield Watch(self, channel, event)
        finally:
            channel.waiters.discard(event)
            if not channel.waiters:
                channel.idle_since = asyncio.get_running_loop().time()

    async def _subscribe(self, name: str) -> None:
        if self._pubsub is None:
            return  # the loop subscribes every channel when it (re)connects
        try:
            await self._pubsub.subscribe(name)
        except Exception as exc:  # the loop notices the broken connection too
            log.warning("subscribe %s failed: %s", name, exc)
        finally:
            self._wake_loop.set()  # after the channel is registered: the loop may be idle

    def _dispatch(self, messages: list[dict]) -> None:
        """Handle pub/sub messages in arrival order, notices grouped per channel."""
        batches: dict[str, list[notices.Notice | None]] = {}
        for message in messages:
            name = message["channel"]
            name = name.decode() if isinstance(name, bytes) else name
            channel = self._channels.get(name)
            if channel is None:
                continue
            if message["type"] == "message":
                batches.setdefault(name, []).append(notices.parse(message["data"]))
            elif message["type"] == "subscribe":
                if name in batches:  # keep the order: earlier notices first
                    channel.deliver(batches.pop(name))
                channel.recent.clear()  # what was published while we were away is unknown
                channel.notified_at = time.monotonic()
                if not channel.confirmed.done():
                    channel.confirmed.set_result(None)
                for event in channel.waiters:
                    event.set()
        for name, batch in batches.items():
            self._channels[name].deliver(batch)

    async def _drop_idle(self, pubsub) -> None:
        now = asyncio.get_running_loop().time()
        idle = [
            name
            for name, ch in self._channels.items()
            if not ch.waiters and ch.idle_since is not None and now - ch.idle_since >= self._linger
        ]
        for name in idle:
            del self._channels[name]
            metrics.SUBSCRIPTIONS.set(len(self._channels))
        if idle:
            await pubsub.unsubscribe(*idle)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = 0.1
        while True:
            pubsub = self._redis.pubsub()
            try:
                if self._channels:
                    await pubsub.subscribe(*self._channels)
                self._pubsub = pubsub
                backoff = 0.1
                while True:
                    await self._drop_idle(pubsub)
                    if not pubsub.subscribed:
                        self._wake_loop.clear()  # clear, then look again: no lost wake-up
                        if not pubsub.subscribed:
                            with contextlib.suppress(asyncio.TimeoutError):
                                await asyncio.wait_for(self._wake_loop.wait(), 1.0)
                        continue
                    message = await pubsub.get_message(timeout=1.0)
                    batch = []
                    while message is not None:  # take what queued up while we were busy
                        batch.append(message)
                        if len(batch) >= _MAX_BATCH or not await _buffered(pubsub.connection):
                            break
                        message = await pubsub.get_message(timeout=1.0)
                    if batch:
                        began = loop.time()
                        self._dispatch(batch)
                        busy = loop.time() - began
                        if busy > _BUSY_SECONDS:
                            # Under heavy fan-out, rest as long as we worked: appends, new
                            # readers and heartbeats keep half the loop, and the notices
                            # that queue up meanwhile go out together in the next batch.
                            await asyncio.sleep(busy)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                raise
            except Exception as exc:
                log.warning("pub/sub connection lost (%s); reconnecting in %.1fs", exc, backoff)
                self._pubsub = None
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                # Every channel must be confirmed again; readers wake on that confirmation.
                for channel in self._channels.values():
                    channel.recent.clear()
                    if channel.confirmed.done():
                        channel.confirmed = asyncio.get_running_loop().create_future()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
