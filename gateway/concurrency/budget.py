"""A byte budget shared by a process's streamed answers: what they may hold at once.

A streamed catch-up answer takes a page from the budget before it reads the page and
gives it back once the page is sent; past the budget a read waits its turn (first come,
first served) instead of being refused: a reader that waits is slowed, never failed,
and the process's memory stays bounded however many answers are under way.
"""

from __future__ import annotations

import asyncio
from collections import deque


class ByteBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def take(self, size: int) -> int:
        """Hold ``size`` bytes (at most the whole budget), waiting while they are not
        free; returns what is held, for ``give``."""
        size = min(size, self.limit)
        if not self._waiters and self.held + size <= self.limit:
            self.held += size
            return size
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((size, waiter))
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():  # granted as it was cancelled: hand it on
                self.give(size)
            else:
                self._waiters = deque(w for w in self._waiters if w[1] is not waiter)
                self._grant()
            raise
        return size

    def give(self, size: int) -> None:
        """Free what ``take`` returned."""
        self.held -= size
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.held + self._waiters[0][0] <= self.limit:
            size, waiter = self._waiters.popleft()
            if not waiter.done():
                self.held += size
                waiter.set_result(None)
