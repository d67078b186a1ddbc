"""One pub/sub channel's waiting readers, and what a batch of notices does for them.

Readers register through ``Fanout.watch`` (``fanout.py``) and wait on their
``Watch``, which sees the fan-out only through the ``Shutdown`` flag they share
(and the timer ``Wheel`` that ends their waits: ``timers.py``). The Watch is
itself what the channel wakes: thousands of idle readers each hold only it,
no Event, Timeout or timer of their own.
A channel is *confirmed* while Redis holds its subscription (on one connection
of the process: ``listener.py``); a reader that registers before the
confirmation, or while the channel moves, re-reads when it comes.

A reader that is caught up can *park* a Sink while it waits: for a notice
that carries its data and starts at the sink's position, the listener writes
to the sink itself (one frame built per notice, one socket write per reader)
and the reader's task is not woken at all. Anything else (a gap, a
large append, a deleted stream, a slow client, a closed stream) wakes the
task, which then reads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..protocol import notices
from ..telemetry import metrics
from .timers import Wheel


@dataclass
class Shutdown:
    """Set once, when the process stops: every reader then finishes its response."""

    started: bool = False


class Sink(Protocol):
    """A parked reader the listener may write to directly."""

    position: int  # where the reader is; advanced by the listener as it writes
    closed: bool  # set by the listener when it wrote the stream's end

    @property
    def key(self) -> Hashable:
        """Sinks with equal keys get identical frames for a notice."""
        ...

    def frame(self, delivery: notices.Delivery) -> bytes: ...
    def writable(self) -> bool: ...
    def write(self, frame: bytes) -> None: ...


class Waiter(Protocol):
    """A registered reader as the channel sees it (a ``Watch``; an asyncio.Event will do)."""

    def set(self) -> None:
        """Wake it: the stream moved, or it must look again."""


@dataclass
class Channel:
    confirmed: asyncio.Future[None]
    waiters: set[Waiter] = field(default_factory=set)
    notified_at: float = 0.0  # time.monotonic() of the last notice or (re)subscription
    recent: notices.Recent = field(default_factory=notices.Recent)
    parked: dict[Waiter, Sink] = field(default_factory=dict)
    sent_ms: int | None = None  # Redis' clock when the newest notice was published (notices.py)

    def confirm(self) -> None:
        """Redis confirmed the subscription (a first one, or after a reconnect or a move to
        another cluster node): every reader re-reads, as anything published while we were
        not subscribed is unknown, and only now can nothing more slip by."""
        self.recent.clear()
        self.notified_at = time.monotonic()
        if not self.confirmed.done():
            self.confirmed.set_result(None)
        for event in self.waiters:
            event.set()

    def unconfirm(self) -> None:
        """The subscription is gone (connection lost, or the channel is moving to another
        cluster node): nothing reaches the channel until it is confirmed again."""
        self.recent.clear()
        if self.confirmed.done():
            self.confirmed = asyncio.get_running_loop().create_future()

    def deliver(self, batch: list[notices.Notice | None]) -> None:
        """Serve parked sinks from consecutive notices; wake every other waiter.

        Under load the listener hands over every notice that queued up while
        it was busy, so a sink gets one write however many appends it covers:
        writes per second stay bounded and latency degrades gracefully.
        """
        self.notified_at = time.monotonic()  # also while nobody waits: a reader may be registering
        if not self.waiters:
            # Lingering after its last reader left (fanout.py): a history would only hold
            # memory (it held every lingering stream's last notices), and a reader that
            # comes re-reads Redis after registering anyway.
            self.recent.clear()
            return
        for notice in batch:
            self.recent.add(notice)
            if notice is not None and notice.sent_ms is not None:
                self.sent_ms = notice.sent_ms
        wrote = False
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
            wrote = True
            sink.position = delivery.tail
            if delivery.closed:
                sink.closed = True
                event.set()
        if wrote:
            fanout_delay(self.sent_ms)


def fanout_delay(sent_ms: int | None) -> None:
    """One sample of ds_fanout_delay_seconds: from the notice's publication to now (wall
    clocks of Redis and of this host: skew between them shows here; clamped at 0)."""
    if sent_ms is not None:
        metrics.FANOUT_DELAY.observe(max(0.0, time.time() - sent_ms / 1000))


class Watch:
    """A reader's registration: ``wait`` returns True when the stream moved.

    It is also the channel's waiter (``set``, as on an asyncio.Event), and its waits
    end on the fan-out's timer wheel: an idle reader keeps this object and, while it
    waits, one future; nothing else of its own."""

    __slots__ = ("_shutdown", "_wheel", "_channel", "_confirmed_at", "_set", "_waiter")

    def __init__(self, shutdown: Shutdown, channel: Channel, wheel: Wheel) -> None:
        self._shutdown = shutdown
        self._wheel = wheel
        self._channel = channel
        self._confirmed_at = time.monotonic()
        self._set = False  # woken since the last wait returned
        self._waiter: asyncio.Future[None] | None = None  # while waiting

    def set(self) -> None:
        """Wake the reader (the channel, a confirmation, shutdown)."""
        self._set = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def is_set(self) -> bool:
        return self._set

    def expire(self) -> None:
        """The wheel: the wait's time is up."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def since(self) -> float:
        """Reads that started before this may miss what the reader was told of:
        the subscription's confirmation, or the channel's latest notice."""
        return max(self._confirmed_at, self._channel.notified_at)

    def moved_since(self, moment: float) -> bool:
        """Whether a read begun at ``moment`` (time.monotonic()) may have missed
        something: a notice or (re)subscription since, or no subscription yet."""
        return self._channel.notified_at >= moment or not self._channel.confirmed.done()

    def delivery(self, start: int) -> notices.Delivery | None:
        """What the latest notices say happened from ``start`` on, when they
        say all of it (small appends, nothing missed); else None: read Redis."""
        return self._channel.recent.delivery(start)

    def park(self, sink: Sink, timeout: float) -> Coroutine[Any, Any, bool]:
        """``wait``, letting the listener write small appends to ``sink`` meanwhile.
        (Not a coroutine of its own, one frame less per idle reader: await it at once,
        the wait unparks the sink however it ends.)"""
        self._channel.parked[self] = sink
        return self._wait(timeout, parked=True)

    def delivered(self) -> None:
        """This reader, woken, wrote what it read: a sample of the fan-out delay."""
        fanout_delay(self._channel.sent_ms)

    @property
    def stopping(self) -> bool:
        return self._shutdown.started

    def wait(self, timeout: float) -> Coroutine[Any, Any, bool]:
        return self._wait(timeout, parked=False)

    async def _wait(self, timeout: float, parked: bool) -> bool:
        try:
            if self._shutdown.started:
                return False
            if not self._set:
                if timeout <= 0:
                    return False
                waiter = self._waiter = asyncio.get_running_loop().create_future()
                tick = self._wheel.add(self, timeout)
                try:
                    await waiter
                finally:
                    self._waiter = None
                    self._wheel.discard(self, tick)
                if not self._set:
                    return False  # timed out
            self._set = False
            return not self._shutdown.started
        finally:
            if parked:
                del self._channel.parked[self]
