"""The timeouts of every waiting live reader on one event-loop timer.

A reader waits at most until its next heartbeat, the end of its SSE cycle or
its long-poll timeout; with an ``asyncio.timeout`` per wait each of thousands
of idle connections kept a Timeout, a TimerHandle and the loop's own timer
object alive. Here a wait's deadline is rounded *up* to the next ``TICK`` and
the wait joins that tick's set: one loop timer, armed for the earliest tick
that has members, ends them all. A wait thus ends at most ``TICK`` seconds
late and never early; a wait that ends otherwise (woken) leaves its set at
once, and a tick left empty is skipped when its turn comes.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from typing import Protocol

TICK = 0.05  # seconds


class Expiring(Protocol):
    def expire(self) -> None:
        """Its wait's time is up (called once per ``Wheel.add``, unless discarded first)."""


class Wheel:
    __slots__ = ("_members", "_ticks", "_handle", "_armed", "_loop")

    def __init__(self) -> None:
        self._members: dict[int, set[Expiring]] = {}  # tick -> the waits due then
        self._ticks: list[int] = []  # heap of ticks with members (some may have left since)
        self._handle: asyncio.TimerHandle | None = None
        self._armed = 0  # the tick the loop timer is set for (while _handle is set)
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, item: Expiring, timeout: float) -> int:
        """``item.expire()`` in ``timeout`` seconds (up to ``TICK`` later); returns the tick
        to ``discard`` it from."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        tick = math.ceil((loop.time() + timeout) / TICK)
        members = self._members.get(tick)
        if members is None:
            members = self._members[tick] = set()
            heapq.heappush(self._ticks, tick)
            if self._handle is None or tick < self._armed:
                self._arm(loop, tick)
        members.add(item)
        return tick

    def discard(self, item: Expiring, tick: int) -> None:
        members = self._members.get(tick)
        if members is not None:
            members.discard(item)
            if not members:
                del self._members[tick]  # its heap entry is dropped when reached

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def __len__(self) -> int:
        return sum(len(members) for members in self._members.values())

    def _arm(self, loop: asyncio.AbstractEventLoop, tick: int) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed = tick
        self._handle = loop.call_at(tick * TICK, self._fire)

    def _fire(self) -> None:
        self._handle = None
        loop = self._loop
        assert loop is not None
        now = loop.time()
        ticks, due = self._ticks, []
        while ticks and ticks[0] * TICK <= now:
            members = self._members.pop(heapq.heappop(ticks), None)
            if members:
                due.append(members)
        while ticks and ticks[0] not in self._members:
            heapq.heappop(ticks)  # emptied before its turn
        if ticks:
            self._arm(loop, ticks[0])  # (a timer that fired a hair early is simply set again)
        for members in due:
            for item in members:
                item.expire()
