"""One pub/sub connection: the channels subscribed on it, and the task that
owns it (``Listener.run``).

The task alone sends (UN)SUBSCRIBE and PING on the connection, so nothing
races it. ``add`` and ``forget`` only note what is wanted and nudge the task,
which unsubscribes what was forgotten, then subscribes what is new (a batch at
a time) before it reads on. After a (re)connect every channel is asked for
again; the confirmations then wake every reader to re-read whatever was
published meanwhile (``Channel.confirm``). The task PINGs after
``health_seconds`` of silence and gives the connection up if another
``health_seconds`` pass without a word from Redis (connecting is bounded the
same way): a stopped Redis or a dead network path looks like that, not like
an error.

After a failure the task tries again soon while Redis is out of reach
(refused, reset, silent): after 25-50 ms, the pauses growing to 250-500 ms,
and at once when ``reachable`` says another connection of the process got an
answer. So once appends are acknowledged again, readers are woken within a
fraction of a second, not after a backoff grown through earlier outages. Only
a Redis that answers with an error (an ACL denial, CLUSTERDOWN) is left alone
for longer, up to 5 s: it would most likely say the same again.

A single Redis has one listener serving every channel of the process
(``fanout.py``); a Redis Cluster has one per shard primary (``shards.py``
routes the channels; ``shard_listener.py`` adds sharded pub/sub and the
node's own unsubscriptions and redirects).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis.exceptions import AuthenticationError, AuthorizationError, ResponseError

from ..concurrency import backoff
from ..concurrency.cancelling import cancel_requested
from ..protocol import notices
from ..telemetry import metrics
from ..telemetry.logs import RateLimited
from .channels import Channel

if TYPE_CHECKING:
    from redis.asyncio.connection import AbstractConnection

log = logging.getLogger(__name__)
limited = RateLimited(log, every=30.0)
_MAX_BATCH = 512
SUBSCRIBE_BATCH = 1000  # channels per SUBSCRIBE / UNSUBSCRIBE command
# Readers served per slice (Channel.serve): ~10 µs each, mostly the socket write, so the
# event loop is held a few ms at a time however many readers a stream has.
_SLICE = 500
# Reconnect pauses (backoff.delay's first step and cap): short while Redis is out of reach
# (a restart takes well under a second: be there when it answers), long while it refuses.
UNREACHABLE = (0.05, 0.5)
_REFUSED = (0.2, 5.0)
_REFUSALS = (ResponseError, AuthenticationError, AuthorizationError)  # Redis answered: "no"
_SERVED_SECONDS = 1.0  # a connection that held this long was fine: the backoff starts over

Command = tuple[str, ...]


@dataclass(frozen=True)
class Dialect:
    """The commands and push kinds of one flavour of pub/sub."""

    subscribe: str
    unsubscribe: str
    message: str
    confirm: str  # the push that confirms a subscription
    dropped: str  # the push that ends one (our UNSUBSCRIBE's answer, or the server's own)


CLASSIC = Dialect("SUBSCRIBE", "UNSUBSCRIBE", "message", "subscribe", "unsubscribe")
SHARDED = Dialect("SSUBSCRIBE", "SUNSUBSCRIBE", "smessage", "ssubscribe", "sunsubscribe")


async def _buffered(connection: AbstractConnection) -> bool:
    """Whether a pub/sub reply is already waiting (redis-py 8 renamed the check)."""
    check = getattr(connection, "can_read", None) or connection.can_read_destructive
    return await check()


def _push(reply: Any) -> tuple[str, str, Any] | None:
    """(kind, channel, payload) of a pub/sub push; None for anything else (PONG, an error)."""
    if not isinstance(reply, list) or len(reply) != 3:
        return None
    kind, name, payload = reply
    kind = kind.decode() if isinstance(kind, bytes) else kind
    name = name.decode() if isinstance(name, bytes) else name
    return kind, name, payload


# Listeners of this process between connections (ds_pubsub_connected is 1 while none is).
_DOWN: set[Listener] = set()


def _report() -> None:
    metrics.PUBSUB_CONNECTED.set(0 if _DOWN else 1)


class Listener:
    """The channels subscribed on one connection, and the task that owns it.

    ``channels`` may be the fan-out's own dict (one Redis: this listener serves
    every channel, and the fan-out adds and removes them), or one of the
    listener's own (a cluster node: only the channels of its slots).
    ``connection`` makes a connection of our own, unconnected: our timeouts
    bound every wait and ``run`` does the retrying (redis-py's retries would
    reconnect without our subscriptions).
    """

    def __init__(
        self,
        channels: dict[str, Channel],
        connection: Callable[[], AbstractConnection],
        health_seconds: float,
        label: str = "pub/sub",
    ) -> None:
        self.channels = channels
        self._connection = connection  # a new connection of our own, unconnected
        self._health = health_seconds
        self._label = label  # names the connection in logs
        self._dialect = CLASSIC
        self._unsent: set[str] = set()  # to subscribe: not yet asked for on this connection
        self._leaving: list[str] = []  # to unsubscribe: forgotten after being asked for here
        self._reading: asyncio.Timeout | None = None  # set while the task waits for Redis
        self._reachable = asyncio.Event()  # another connection reached Redis since this attempt began
        self._serving: dict[Channel, None] = {}  # notified channels with readers to serve, in order

    # -- what is wanted (called by the fan-out, never awaiting) ---------------------------

    def add(self, name: str, channel: Channel) -> None:
        """Subscribe ``channel`` here; its readers wake on the confirmation."""
        self.channels[name] = channel
        self._unsent.add(name)
        self._nudge()

    def forget(self, name: str) -> None:
        """Unsubscribe a channel nobody reads any more (already gone from the fan-out's dict:
        a reader arriving now registers it afresh, and its SUBSCRIBE follows the UNSUBSCRIBE)."""
        self.channels.pop(name, None)
        if name in self._unsent:
            self._unsent.discard(name)  # never asked for on this connection
        else:
            self._leaving.append(name)
            self._nudge()

    def reachable(self, node: str | None = None) -> None:
        """Another connection of this process just got an answer from this Redis (``node``
        names it on a cluster; ``Shards`` picks the listener): if the task is waiting to
        reconnect after failing to reach it, it tries again now."""
        self._reachable.set()

    def _nudge(self) -> None:
        """Cut the task's wait for Redis short: it has (un)subscribing to do."""
        reading = self._reading
        if reading is not None and not reading.expired():
            reading.reschedule(asyncio.get_running_loop().time())

    # -- hooks for sharded pub/sub (shard_listener.py) ------------------------------------

    async def _handshake(self, connection: AbstractConnection) -> Dialect:
        """The pub/sub flavour to use on a new connection."""
        return CLASSIC

    def _subscribing(self, names: list[str]) -> list[Command]:
        return [(self._dialect.subscribe, *names)]  # at most SUBSCRIBE_BATCH names

    def _unsubscribing(self, names: list[str]) -> list[Command]:
        command = self._dialect.unsubscribe
        return [(command, *names[i : i + SUBSCRIBE_BATCH]) for i in range(0, len(names), SUBSCRIBE_BATCH)]

    def _unsubscribed(self, name: str) -> None:
        """An unsubscription push. With one Redis it only ever answers our UNSUBSCRIBE."""

    def _refused(self, error: ResponseError) -> None:
        """An error reply. With one Redis none is expected: give the connection up."""
        raise error

    def _lost(self) -> None:
        """The connection is gone, with every subscription on it. Readers a round had still
        to reach are woken now, not after the reconnection's confirmations."""
        for channel in self._serving:
            channel.abandon()
        self._serving.clear()
        for channel in self.channels.values():
            channel.unconfirm()

    # -- the task -------------------------------------------------------------------------

    def _dispatch(self, messages: list[tuple[str, str, Any]]) -> None:
        """Handle pub/sub messages in arrival order; the channels notified are served
        afterwards (``_serve``), a slice at a time."""
        channels, serving = self.channels, self._serving
        message, confirm, dropped = self._dialect.message, self._dialect.confirm, self._dialect.dropped
        for kind, name, payload in messages:
            if kind == message:
                channel = channels.get(name)
                if channel is not None:
                    channel.notify(notices.parse(payload))
                    serving[channel] = None
            elif kind == confirm:
                # A channel dropped before its first confirmation and registered again may
                # take the old SUBSCRIBE's answer for its own: harmless, as its own answer
                # wakes its readers again, after the gap the UNSUBSCRIBE left.
                channel = channels.get(name)
                if channel is not None:
                    channel.confirm()  # wakes every reader: they read what came before
            elif kind == dropped:
                self._unsubscribed(name)

    def _serve(self) -> None:
        """One slice of the rounds the notified channels make over their readers (at most
        ``_SLICE`` readers): between slices the listener reads on and the event loop serves
        everything else, however many readers a stream has."""
        budget, serving = _SLICE, self._serving
        while serving and budget > 0:
            channel = next(iter(serving))
            budget -= channel.serve(budget)
            del serving[channel]
            if channel.serving:  # to the back: a stream always busy must not hold up the others
                serving[channel] = None

    async def _send(self, connection: AbstractConnection, commands: Sequence[Command]) -> None:
        if not connection.is_connected:
            # redis-py would reconnect on its own, to a connection without our subscriptions.
            raise ConnectionError("pub/sub connection closed")
        async with asyncio.timeout(self._health):
            if len(commands) == 1:
                await connection.send_command(*commands[0], check_health=False)
            else:
                await connection.send_packed_command(connection.pack_commands(commands), check_health=False)

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
            if self._leaving:
                leaving, self._leaving = self._leaving, []
                await self._send(connection, self._unsubscribing(leaving))
            if self._unsent:
                names = [self._unsent.pop() for _ in range(min(len(self._unsent), SUBSCRIBE_BATCH))]
                await self._send(connection, self._subscribing(names))
            if pinged > heard:  # a PING is out
                if now - pinged >= self._health:
                    raise ConnectionError(f"no answer to PING in {now - pinged:.1f}s")
            elif now - heard >= self._health:
                await self._send(connection, [("PING",)])
                pinged = now
            if self._unsent or self._serving:
                wait = 0.0  # more to subscribe, or readers to serve: only take what has arrived
            else:
                wait = max((pinged if pinged > heard else heard) + self._health - now, 0.0)
            try:
                reply = await self._read(connection, wait)
            except ResponseError as error:
                self._refused(error)
                reply = error  # an answer all the same: Redis is there
            batch = []
            while reply is not None:  # take what queued up while we were busy
                heard = loop.time()
                message = _push(reply)
                if message is not None:
                    batch.append(message)
                if len(batch) >= _MAX_BATCH or not await _buffered(connection):
                    break
                try:
                    reply = await connection.read_response(
                        timeout=self._health, disconnect_on_error=False, push_request=True
                    )
                except ResponseError as error:
                    if batch:  # what came before the error first
                        self._dispatch(batch)
                        batch = []
                    self._refused(error)
                    reply = error
            if batch:
                self._dispatch(batch)
            if self._serving:
                self._serve()

    def _begin(self) -> None:
        """A new connection holds no subscriptions: every channel must be confirmed
        again, and readers wake on that confirmation."""
        self._unsent = set(self.channels)
        self._leaving = []

    async def _stopped(self, connection: AbstractConnection | None) -> None:
        """Cancelled: nothing is subscribed any more, and no reader may think otherwise."""
        self._lost()
        _DOWN.discard(self)  # gone (shut down, or its node left the cluster): not down
        _report()
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.disconnect(nowait=True)

    async def run(self) -> None:
        """Connect, serve, and after a failure reconnect, until cancelled."""
        loop = asyncio.get_running_loop()
        failures = 0  # attempts in a row that did not end in a connection that served
        # ``reachable`` cuts one pause per outage short: should Redis answer the process's
        # other connections and still not ours, the schedule paces us, not their traffic.
        nudgeable = True
        while True:
            self._begin()
            self._reachable.clear()  # news from before this attempt is no reason for another
            connection = None
            connected: float | None = None  # loop time the connection was ready
            error: Exception = ConnectionError("pub/sub connection ended")
            try:
                connection = self._connection()
                async with asyncio.timeout(self._health):
                    await connection.connect()
                    self._dialect = await self._handshake(connection)
                connected = loop.time()
                _DOWN.discard(self)
                _report()
                await self._listen(connection)
            except asyncio.CancelledError:
                await self._stopped(connection)
                raise
            except Exception as exc:
                if cancel_requested():  # the cancellation, turned into an error inside redis-py
                    await self._stopped(connection)
                    raise asyncio.CancelledError from exc
                error = exc
            if connection is not None:
                with contextlib.suppress(Exception):
                    await connection.disconnect(nowait=True)
            self._lost()
            _DOWN.add(self)
            _report()
            if connected is not None:
                self._reachable.clear()  # heard while ours was up: no news that Redis is back
            if connected is not None and loop.time() - connected >= _SERVED_SECONDS:
                # It served: whatever ended it, Redis was fine until then. (Not a connection lost
                # at once, again and again: each would resubscribe every channel.)
                failures, nudgeable = 0, True
            refused = isinstance(error, _REFUSALS)
            first, cap = _REFUSED if refused else UNREACHABLE
            seconds = backoff.delay(failures, first=first, cap=cap)
            failures += 1
            # Rate-limited: Redis away for long is not a line a second.
            message = "%s connection lost (%r); reconnecting in %.2fs"
            limited.log(logging.WARNING, f"lost {self._label}", message, self._label, error, seconds)
            if refused or not nudgeable:
                await asyncio.sleep(seconds)
            elif await backoff.pause(seconds, self._reachable):
                nudgeable = False
