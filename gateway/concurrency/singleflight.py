"""Concurrent identical calls share one execution, when sharing is safe.

Every reader a pub/sub notice wakes re-reads the stream from the same offset
at the same moment; sharing that read keeps Redis work per append constant,
however many readers wait in this process.

Sharing must not travel back in time: a read started before some append was
acknowledged may not be handed to a caller who could know of that append
(a client that saw the ack and then asked, a reader woken by its notice).
So each caller says ``since`` when its need arose, and joins only a call that
started at or after that moment; otherwise it starts its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._inflight: dict[Hashable, tuple[asyncio.Future[T], float]] = {}

    async def run(self, key: Hashable, call: Callable[[], Awaitable[T]], since: float = float("inf")) -> T:
        """``call()``, or the result of an identical call that started at or after ``since``
        (a ``time.monotonic()`` reading; the default never joins)."""
        flight = self._inflight.get(key)
        if flight is None or flight[1] < since:
            started = (asyncio.ensure_future(call()), time.monotonic())
            self._inflight[key] = flight = started
            started[0].add_done_callback(lambda _: self._forget(key, started))
        # One waiter giving up (client gone) must not cancel the others' read.
        return await asyncio.shield(flight[0])

    def _forget(self, key: Hashable, flight: tuple[asyncio.Future[T], float]) -> None:
        if self._inflight.get(key) is flight:  # a newer call may have taken the key meanwhile
            del self._inflight[key]
        future = flight[0]
        if not future.cancelled():
            # Retrieved here: when every waiter has gone (clients left while it failed, e.g.
            # the stream deleted), asyncio would log "exception was never retrieved".
            future.exception()
