"""Concurrent identical calls share one execution.

Every reader a pub/sub notice wakes re-reads the stream from the same offset
at the same moment; sharing that read keeps Redis work per append constant,
however many readers wait in this process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._inflight: dict[Hashable, asyncio.Future[T]] = {}

    async def run(self, key: Hashable, call: Callable[[], Awaitable[T]]) -> T:
        future = self._inflight.get(key)
        if future is None:
            future = asyncio.ensure_future(call())
            self._inflight[key] = future
            future.add_done_callback(lambda _: self._inflight.pop(key, None))
        # One waiter giving up (client gone) must not cancel the others' read.
        return await asyncio.shield(future)
