"""Live-read wake-ups: one subscription per stream shared by all of this
process's waiting readers.

append.lua (appends, closes) and delete.lua publish on the stream's channel
(``protocol/notices.py``). A reader registers (``watch``) *before* it re-reads
the stream, and ``watch`` returns once Redis has confirmed the channel's
subscription (or after 5 s without Redis), so an append can never fall between
the reader's last look and its wait. Every confirmation wakes the channel's
readers to re-read (``Channel.confirm``).

The subscriptions themselves are made by listeners (``listener.py``), each the
sole owner of one pub/sub connection: with a single Redis one listener for
every channel; with a Redis Cluster (``shards.py``) one per shard primary, each
channel on the connection of the primary serving its hash slot, moved with
the slot. Either way the channels live in one dict here, so readers do not see
the difference.

Subscriptions linger a while after their last reader leaves, so a long-poll
client that comes straight back finds its stream still subscribed. A channel
is forgotten before its UNSUBSCRIBE is sent, so a reader arriving meanwhile
registers it afresh and its SUBSCRIBE follows the UNSUBSCRIBE on the wire.

What a notice does for a channel's readers (wake them, or write to parked
sinks) is in ``channels.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from redis.asyncio import Redis, RedisCluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..redis_io import keys
from ..telemetry import metrics
from .channels import Channel, Shutdown, Watch
from .listener import Listener
from .shards import Shards
from .timers import Wheel

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from redis.asyncio.connection import AbstractConnection

_CONFIRM_WAIT_SECONDS = 5.0


class _Subscriber(Protocol):
    """Where channels get subscribed: one listener, or the shards of a cluster."""

    def add(self, name: str, channel: Channel) -> None: ...
    def forget(self, name: str) -> None: ...
    def reachable(self, node: str | None = None) -> None: ...
    async def run(self) -> None: ...


class Fanout:
    def __init__(
        self, redis: Redis | RedisCluster, linger_seconds: float = 30.0, health_seconds: float = 5.0
    ) -> None:
        self._redis = redis
        self._linger = linger_seconds
        self._channels: dict[str, Channel] = {}
        self._idle: dict[str, float] = {}  # channels without readers -> since when, oldest first
        self._expiry: asyncio.TimerHandle | None = None  # when the oldest idle channel is due
        self._subscriber: _Subscriber
        if isinstance(redis, RedisCluster):
            self._subscriber = Shards(redis, self._channels, health_seconds)
        else:
            # The listener shares our dict: with one connection, every channel is its own.
            self._subscriber = Listener(self._channels, self._connection, health_seconds)
        self._task: asyncio.Task[None] | None = None
        self._shutdown = Shutdown()
        self._wheel = Wheel()  # every reader's wait ends on it (timers.py)

    @property
    def stopping(self) -> bool:
        return self._shutdown.started

    async def start(self) -> None:
        self._task = asyncio.create_task(self._subscriber.run(), name="fanout")

    def stop_waiters(self) -> None:
        """Graceful shutdown: every live reader wakes and finishes its response (one still
        waiting for its subscription's confirmation included)."""
        self._shutdown.started = True
        for channel in self._channels.values():
            if not channel.confirmed.done():
                channel.confirmed.set_result(None)
            for event in channel.waiters:
                event.set()

    async def close(self) -> None:
        """Stop the listeners and close the pub/sub client (the fan-out owns it)."""
        self.stop_waiters()
        self._wheel.close()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:  # it should never have ended by itself: say so, and close anyway
                log.exception("the pub/sub listener had failed")
        await self._redis.aclose()

    def readers(self, sid: str) -> int:
        """Live readers of stream ``sid`` waiting in this process now (the console's stats)."""
        channel = self._channels.get(keys.notify_channel(sid))
        return len(channel.waiters) if channel is not None else 0

    def redis_answered(self, node: str | None = None) -> None:
        """A command of this process just got an answer from Redis (on a cluster from
        ``node``, its "host:port"; None: any node). Cheap, for every successful call: a
        pub/sub connection waiting to reconnect to it tries now, so that readers are woken
        as soon as appends are acknowledged again."""
        self._subscriber.reachable(node)

    def watch(self, sid: str, read_at: float = 0.0) -> _Registration:
        """``async with fanout.watch(sid) as watch``: a live reader of stream ``sid``,
        registered on entry (which returns once Redis confirmed the channel's
        subscription, or after 5 s without Redis) and until exit. ``read_at``: when
        (time.monotonic()) the read began whose offset it goes on from (Watch.reading)."""
        return _Registration(self, sid, read_at)

    def _register(self, reader: Watch, sid: str) -> Channel:
        name = keys.notify_channel(sid)
        channel = self._channels.get(name)
        if channel is None:
            channel = Channel(asyncio.get_running_loop().create_future())
            self._channels[name] = channel
            metrics.SUBSCRIPTIONS.set(len(self._channels))
            self._subscriber.add(name, channel)
        self._idle.pop(name, None)
        channel.waiters.add(reader)
        return channel

    def _unregister(self, reader: Watch, channel: Channel, sid: str) -> None:
        channel.waiters.discard(reader)
        if not channel.waiters:
            loop = asyncio.get_running_loop()
            self._idle[keys.notify_channel(sid)] = loop.time()
            if self._expiry is None:
                self._expiry = loop.call_at(loop.time() + self._linger, self._expire)

    def _expire(self) -> None:
        """Forget channels idle for longer than the linger, then wait for the next one."""
        self._expiry = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        expired = []
        for name, since in self._idle.items():  # oldest first
            if now - since < self._linger:
                break
            expired.append(name)
        for name in expired:
            del self._idle[name]
            del self._channels[name]
            self._subscriber.forget(name)
        if expired:
            metrics.SUBSCRIPTIONS.set(len(self._channels))
        if self._idle:
            oldest = next(iter(self._idle.values()))
            self._expiry = loop.call_at(oldest + self._linger, self._expire)

    def _connection(self) -> AbstractConnection:
        """A connection of our own to the single Redis, unconnected. Our timeouts bound
        every wait, and the listener does the retrying: redis-py's retries would reconnect
        without our subscriptions, and its socket timeout makes sends use ``wait_for``,
        which on Python 3.11 can swallow the cancel that stops us."""
        assert isinstance(self._redis, Redis)
        pool = self._redis.connection_pool
        options = {**pool.connection_kwargs, "socket_timeout": None, "retry": Retry(NoBackoff(), 0)}
        return pool.connection_class(**options)


class _Registration(Watch):
    """``Fanout.watch``'s answer: the reader's Watch as its own async context manager (no
    generator, context-manager object or Event of its own per idle reader)."""

    __slots__ = ("_fanout", "_sid")

    def __init__(self, fanout: Fanout, sid: str, read_at: float) -> None:
        self._fanout = fanout
        self._sid = sid
        self._read_at = read_at
        # The channel is looked up (and subscribed) on entry, as before.
        self._shutdown = fanout._shutdown
        self._wheel = fanout._wheel
        self._set = False
        self._waiter = None

    async def __aenter__(self) -> Watch:
        fanout = self._fanout
        channel = self._channel = fanout._register(self, self._sid)
        try:
            confirmed = channel.confirmed
            if not confirmed.done():
                with contextlib.suppress(asyncio.TimeoutError):
                    # Without Redis we cannot be woken; the reader's own timeout still ends its wait.
                    await asyncio.wait_for(asyncio.shield(confirmed), _CONFIRM_WAIT_SECONDS)
        except BaseException:  # cancelled while waiting: registered no more
            fanout._unregister(self, channel, self._sid)
            raise
        self._confirmed_at = time.monotonic()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._fanout._unregister(self, self._channel, self._sid)
