"""Live-read wake-ups: one pub/sub connection per process, one subscription
per stream shared by all of this process's waiting readers.

append.lua (appends, closes) and delete.lua PUBLISH on the stream's channel
(``protocol/notices.py``). A reader registers (``watch``) *before* it re-reads
the stream, and ``watch`` returns once Redis has confirmed the channel's
subscription on the current connection (or after 5 s without Redis), so an
append can never fall between the reader's last look and its wait. Every
confirmation wakes the channel's readers to re-read.

One task, the listener, owns the connection: it alone sends SUBSCRIBE,
UNSUBSCRIBE and PING, so nothing races it. ``watch`` only registers a new
channel and nudges the listener, which subscribes every registered channel
not yet asked for on this connection (a batch at a time) before it reads on.
After a (re)connect every registered channel is asked for again; confirmations
then wake every reader to re-read whatever was published meanwhile. The
listener PINGs after ``health_seconds`` of silence and gives the connection up
if another ``health_seconds`` pass without a word from Redis (connecting is
bounded the same way): a stopped Redis or a dead network path looks like
that, not like an error.

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
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from redis.asyncio import Redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..protocol import notices
from ..telemetry import metrics
from ..telemetry.logs import RateLimited
from . import keys
from .channels import Channel, Watch

if TYPE_CHECKING:
    from redis.asyncio.connection import AbstractConnection

log = logging.getLogger(__name__)
limited = RateLimited(log, every=30.0)
_CONFIRM_WAIT_SECONDS = 5.0
_MAX_BATCH = 512
_SUBSCRIBE_BATCH = 1000  # channels per SUBSCRIBE / UNSUBSCRIBE command
_BUSY_SECONDS = 0.02  # a dispatch longer than this makes the listener pace itself


async def _buffered(connection: AbstractConnection) -> bool:
    """Whether a pub/sub reply is already waiting (redis-py 8 renamed the check)."""
    check = getattr(connection, "can_read", None) or connection.can_read_destructive
    return await check()


def _push(reply: Any) -> tuple[str, str, Any] | None:
    """(kind, channel, payload) of a pub/sub push; None for anything else (PONG)."""
    if not isinstance(reply, list) or len(reply) != 3:
        return None
    kind, name, payload = reply
    kind = kind.decode() if isinstance(kind, bytes) else kind
    name = name.decode() if isinstance(name, bytes) else name
    return kind, name, payload


class Fanout:
    def __init__(self, redis: Redis, linger_seconds: float = 30.0, health_seconds: float = 5.0) -> None:
        self._redis = redis
        self._linger = linger_seconds
        self._health = health_seconds
        self._channels: dict[str, Channel] = {}
        self._idle: dict[str, float] = {}  # channels without readers -> since when, oldest first
        self._unsent: set[str] = set()  # registered, not yet asked for on this connection
        self._reading: asyncio.Timeout | None = None  # set while the listener waits for Redis
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
            channel = Channel(asyncio.get_running_loop().create_future())
            self._channels[name] = channel
            metrics.SUBSCRIPTIONS.set(len(self._channels))
            self._unsent.add(name)
            self._nudge()
        self._idle.pop(name, None)
        event = asyncio.Event()
        channel.waiters.add(event)
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                # Without Redis we cannot be woken; the reader's own timeout still ends its wait.
                await asyncio.wait_for(asyncio.shield(channel.confirmed), _CONFIRM_WAIT_SECONDS)
            yield Watch(self, channel, event)
        finally:
            channel.waiters.discard(event)
            if not channel.waiters:
                if not self._idle:
                    self._nudge()  # the listener's wait may outlast this channel's linger
                self._idle[name] = asyncio.get_running_loop().time()

    def _nudge(self) -> None:
        """Cut the listener's wait for Redis short: it has (un)subscribing to do."""
        reading = self._reading
        if reading is not None and not reading.expired():
            reading.reschedule(asyncio.get_running_loop().time())

    def _dispatch(self, messages: list[tuple[str, str, Any]]) -> None:
        """Handle pub/sub messages in arrival order, notices grouped per channel."""
        batches: dict[str, list[notices.Notice | None]] = {}
        for kind, name, payload in messages:
            if kind == "message":
                if name in self._channels:
                    batches.setdefault(name, []).append(notices.parse(payload))
                continue
            if kind != "subscribe":
                continue
            # A channel dropped before its first confirmation and registered again may
            # take the old SUBSCRIBE's answer for its own: harmless, as its own answer
            # wakes its readers again, after the gap the UNSUBSCRIBE left.
            channel = self._channels.get(name)
            if channel is None:
                continue
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

    def _expired(self, now: float) -> list[str]:
        """Forget channels idle for longer than the linger; return their names."""
        expired = []
        for name, since in self._idle.items():  # oldest first
            if now - since < self._linger:
                break
            expired.append(name)
        for name in expired:
            del self._idle[name]
            del self._channels[name]
        if expired:
            metrics.SUBSCRIPTIONS.set(len(self._channels))
        return expired

    async def _send(self, connection: AbstractConnection, *args: str) -> None:
        if not connection.is_connected:
            # redis-py would reconnect on its own, to a connection without our subscriptions.
            raise ConnectionError("pub/sub connection closed")
        async with asyncio.timeout(self._health):
            await connection.send_command(*args, check_health=False)

    async def _read(self, connection: AbstractConnection, wait: float) -> Any:
        """The next reply, or None after ``wait`` seconds or when nudged."""
        reading = asyncio.timeout(None)
        try:
            async with reading:
                self._reading = reading
                return await connection.read_response(
                    timeout=wait, disconnect_on_error=False, push_request=True
                )
        except TimeoutError:
            if reading.expired():
                return None
            raise
        finally:
            self._reading = None

    async def _listen(self, connection: AbstractConnection) -> None:
        """Serve one connection until it fails."""
        loop = asyncio.get_running_loop()
        heard = pinged = loop.time()  # the last reply from Redis; the last PING sent
        while True:
            now = loop.time()
            expired = self._expired(now)
            dropped = [name for name in expired if name not in self._unsent]  # asked for on this connection
            self._unsent.difference_update(expired)
            for i in range(0, len(dropped), _SUBSCRIBE_BATCH):
                await self._send(connection, "UNSUBSCRIBE", *dropped[i : i + _SUBSCRIBE_BATCH])
            if self._unsent:
                names = [self._unsent.pop() for _ in range(min(len(self._unsent), _SUBSCRIBE_BATCH))]
                await self._send(connection, "SUBSCRIBE", *names)
            if pinged > heard:  # a PING is out
                if now - pinged >= self._health:
                    raise ConnectionError(f"no answer to PING in {now - pinged:.1f}s")
            elif now - heard >= self._health:
                await self._send(connection, "PING")
                pinged = now
            if self._unsent:
                wait = 0.0  # more to subscribe: only take what has arrived meanwhile
            else:
                deadline = (pinged if pinged > heard else heard) + self._health
                if self._idle:
                    deadline = min(deadline, next(iter(self._idle.values())) + self._linger)
                wait = max(deadline - now, 0.0)
            reply = await self._read(connection, wait)
            batch = []
            while reply is not None:  # take what queued up while we were busy
                heard = loop.time()
                message = _push(reply)
                if message is not None:
                    batch.append(message)
                if len(batch) >= _MAX_BATCH or not await _buffered(connection):
                    break
                reply = await connection.read_response(
                    timeout=self._health, disconnect_on_error=False, push_request=True
                )
            if batch:
                began = loop.time()
                self._dispatch(batch)
                busy = loop.time() - began
                if busy > _BUSY_SECONDS:
                    # Under heavy fan-out, rest as long as we worked: appends, new
                    # readers and heartbeats keep half the loop, and the notices
                    # that queue up meanwhile go out together in the next batch.
                    await asyncio.sleep(busy)

    def _connection(self) -> AbstractConnection:
        """A connection of our own, unconnected. Our timeouts bound every wait,
        and this loop does the retrying: redis-py's retries would reconnect
        without our subscriptions, and its socket timeout makes sends use
        ``wait_for``, which on Python 3.11 can swallow the cancel that stops us."""
        pool = self._redis.connection_pool
        options = {**pool.connection_kwargs, "socket_timeout": None, "retry": Retry(NoBackoff(), 0)}
        return pool.connection_class(**options)

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            # A new connection holds no subscriptions: every channel must be confirmed
            # again, and readers wake on that confirmation.
            self._unsent = set(self._channels)
            connection = self._connection()
            try:
                async with asyncio.timeout(self._health):
                    await connection.connect()
                backoff = 0.1
                await self._listen(connection)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await connection.disconnect(nowait=True)
                raise
            except Exception as exc:  # rate-limited: Redis away for long is not a line a second
                message = "pub/sub connection lost (%r); reconnecting in %.1fs"
                limited.log(logging.WARNING, "lost", message, exc, backoff)
            with contextlib.suppress(Exception):
                await connection.disconnect(nowait=True)
            loop = asyncio.get_running_loop()
            for channel in self._channels.values():
                channel.recent.clear()
                if channel.confirmed.done():
                    channel.confirmed = loop.create_future()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
