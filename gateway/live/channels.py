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
import logging
import time
from collections.abc import Coroutine, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..protocol import notices
from ..telemetry import metrics
from ..telemetry.logs import RateLimited
from .timers import Wheel

limited = RateLimited(logging.getLogger(__name__), every=30.0)


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


@dataclass(eq=False)  # identity: the listener keeps the channels it has rounds to make for
class Channel:
    confirmed: asyncio.Future[None]
    waiters: set[Waiter] = field(default_factory=set)
    notified_at: float = 0.0  # time.monotonic() of the last notice or (re)subscription
    recent: notices.Recent = field(default_factory=notices.Recent)
    parked: dict[Waiter, Sink] = field(default_factory=dict)
    sent_ms: int | None = None  # Redis' clock when the newest notice was published (notices.py)
    # time.monotonic() when the channel last lost track (a None notice: a deletion; or a
    # (re)subscription): what a reader read from Redis before then may be of another
    # incarnation of the stream, and the notices since may chain on from its offset by chance
    reset_at: float = 0.0
    # The round over the waiters (``serve``): who it visits, how far it got, and whether
    # notices came that the waiters it already visited have not had.
    round: list[Waiter] | None = None
    round_at: int = 0
    due: bool = False

    def confirm(self) -> None:
        """Redis confirmed the subscription (a first one, or after a reconnect or a move to
        another cluster node): every reader re-reads, as anything published while we were
        not subscribed is unknown, and only now can nothing more slip by. None is written
        to (nor handed notices) before it has re-read: the stream may have been deleted
        and created anew meanwhile."""
        self.notified_at = self.reset_at = time.monotonic()
        if not self.confirmed.done():
            self.confirmed.set_result(None)
        self.abandon()

    def unconfirm(self) -> None:
        """The subscription is gone (connection lost, or the channel is moving to another
        cluster node): nothing reaches the channel until it is confirmed again."""
        self.recent.clear()
        if self.confirmed.done():
            self.confirmed = asyncio.get_running_loop().create_future()

    def notify(self, notice: notices.Notice | None) -> None:
        """A notice arrived: kept in ``recent``, it reaches the waiters as ``serve`` goes
        round them. None (the stream was deleted, or the notice could not be parsed) wakes
        every waiter at once, parked or not, to read for itself: nothing the channel hears
        after it is written to a reader that has not read Redis since (the stream may have
        been created anew, its offsets starting over)."""
        self.notified_at = time.monotonic()  # also while nobody waits: a reader may be registering
        # Nobody waiting (lingering after its last reader left, fanout.py): a history would
        # only hold memory (it held every lingering stream's last notices), and a reader
        # that comes re-reads Redis after registering anyway.
        if notice is None:
            self.reset_at = self.notified_at
        if notice is None or not self.waiters:
            self.abandon()
            return
        self.recent.roomy = True  # until its round is over: keep what the round must deliver
        self.recent.add(notice)
        if notice.sent_ms is not None:
            self.sent_ms = notice.sent_ms
        self.due = True

    def abandon(self) -> None:
        """End the round: every waiter is woken, no sink stays parked (each task unparks its
        own when it wakes), no notice is kept and nothing is due."""
        for event in self.waiters:
            event.set()
        self.parked.clear()
        self.round, self.due = None, False
        self.recent.clear()
        self.recent.roomy = False

    @property
    def serving(self) -> bool:
        """Whether ``serve`` has waiters left to visit."""
        return self.due or self.round is not None

    def serve(self, budget: int) -> int:
        """Visit up to ``budget`` waiters; returns how many it visited. A parked sink gets
        what the recent notices hold beyond its position, in one write; every other waiter
        (behind them, large appends, a slow client, not parked) is woken to read for itself.

        A round goes over the waiters there were when it began; notices arriving during it
        reach the waiters it has still to visit, and start another round after it (those
        with nothing new are passed over, though a waiter not parked is woken again). So the
        listener can serve thousands of readers a slice at a time, reading the notices that
        arrive in between: a reader hears of an append within about one round, and appends
        and new readers wait for a slice, not for a whole round. Under load a sink gets one
        write per round however many appends it covers.
        """
        if self.round is None:
            if not self.due:
                return 0
            self.round, self.round_at, self.due = list(self.waiters), 0, False
        waiters, parked, recent = self.round, self.parked, self.recent
        start = self.round_at
        stop = self.round_at = min(len(waiters), start + budget)  # on, whatever a reader raises
        if stop >= len(waiters):
            self.round = None
        wrote = False
        for event in waiters[start:stop]:
            if event not in self.waiters:
                continue  # left since the round began
            sink = parked.get(event)
            if sink is None:
                event.set()  # not parked: its task reads for itself
                continue
            if sink.closed:
                continue  # wrote the stream's end in an earlier round: its task finishes
            position = sink.position
            delivery = recent.delivery(position)
            if delivery is None or not sink.writable():
                event.set()  # behind, large appends, or a slow client: its task takes over
                continue
            if delivery.tail == position and not delivery.closed:
                continue  # nothing new for this one
            try:
                key = ("frame", sink.key)  # sinks alike get the same bytes for one delivery
                frame = delivery.cache.get(key)
                if frame is None:
                    frame = delivery.cache[key] = sink.frame(delivery)
                sink.write(frame)
            except (OSError, RuntimeError):  # the connection just went: its task cleans up
                event.set()
                continue
            except Exception as exc:  # a bug: this reader's task takes over, the others are served
                limited.log(logging.ERROR, "serve", "writing to a live reader failed", exc_info=exc)
                event.set()
                continue
            wrote = True
            sink.position = delivery.tail
            if delivery.closed:
                sink.closed = True
                event.set()
        if self.round is None and not self.due:
            self.recent.roomy = False  # the round is over: the usual bounds again
        if wrote:
            fanout_delay(self.sent_ms)
        return stop - start

    def deliver(self, batch: list[notices.Notice | None]) -> None:
        """``notify`` of each notice, then one whole round (tests; the listener serves a
        slice at a time)."""
        for notice in batch:
            self.notify(notice)
        while self.serving:
            self.serve(len(self.waiters) or 1)


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

    __slots__ = ("_shutdown", "_wheel", "_channel", "_confirmed_at", "_read_at", "_set", "_waiter")

    def __init__(self, shutdown: Shutdown, channel: Channel, wheel: Wheel, read_at: float = 0.0) -> None:
        self._shutdown = shutdown
        self._wheel = wheel
        self._channel = channel
        self._confirmed_at = time.monotonic()
        self._read_at = read_at  # see reading()
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

    def reading(self) -> float:
        """The reader reads Redis now: returns ``since`` for the read (read_shared), and
        remembers it, as the moment its offset was last known good (``delivery``)."""
        self._read_at = self.since
        return self._read_at

    def delivery(self, start: int) -> notices.Delivery | None:
        """What the latest notices say happened from ``start`` on, when they
        say all of it (small appends, nothing missed); else None: read Redis.
        None too once the stream was deleted since the reader last read Redis: the
        notices may be of the stream created anew, whose offsets start over (one
        that chains on from ``start`` would hand it another stream's data)."""
        if self._channel.reset_at > self._read_at:
            return None
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
                self._channel.parked.pop(self, None)  # gone already if the channel abandoned its round
