"""Group commit: concurrent calls with one key share one execution.

The first item for a key goes at once. Items for the same key that arrive
while it runs wait for it, then go together in the next call, and so on: an
idle key pays no delay, and a busy one pays one round trip (and one fsync) per
batch instead of per item. Storage keys appends by lane (a few per process; a
stream always in the same one: streams/appends.py), so one batch may hold
appends to several streams, in arrival order; append.lua checks and applies
each exactly as if it came alone, so a batch changes nothing a client can see
but the time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class Batcher(Generic[Item, Result]):
    def __init__(
        self,
        call: Callable[[str, list[Item]], Awaitable[list[Result]]],
        max_items: int = 256,
        max_bytes: int = 8 << 20,
        size: Callable[[Item], int] = lambda item: 0,
        count: Callable[[Item], int] = lambda item: 1,
    ) -> None:
        self._call = call
        self._max_items = max_items  # counted by ``count`` (appends: their entries)
        self._max_bytes = max_bytes
        self._size = size
        self._count = count
        self._waiting: dict[str, list[tuple[Item, asyncio.Future[Result]]]] = {}
        self._flushers: set[asyncio.Task[None]] = set()  # referenced until done

    async def submit(self, key: str, item: Item) -> Result:
        waiting = self._waiting.get(key)
        if waiting is not None:  # a call for this key is running: join the next one
            future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
            waiting.append((item, future))
            return await future
        self._waiting[key] = []
        try:
            (result,) = await self._call(key, [item])
        finally:
            self._next(key)
        return result

    def _next(self, key: str) -> None:
        """After a call: run what waited meanwhile, or mark the key idle."""
        if self._waiting.get(key):
            task = asyncio.ensure_future(self._flush(key))
            self._flushers.add(task)
            task.add_done_callback(self._flushers.discard)
        else:
            self._waiting.pop(key, None)

    async def _flush(self, key: str) -> None:
        """Run the waiting items in batches until none are left."""
        try:
            while batch := self._take(key):
                try:
                    results = await self._call(key, [item for item, _ in batch])
                except Exception as exc:  # every waiter learns of it (Redis away, ...)
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                except BaseException:  # cancelled (shutdown): so are the waiters of this batch
                    for _, future in batch:
                        future.cancel()
                    raise
                for (_, future), result in zip(batch, results, strict=True):
                    if not future.done():  # its client may have gone; the append still counts
                        future.set_result(result)
        finally:
            self._next(key)

    def _take(self, key: str) -> list[tuple[Item, asyncio.Future[Result]]]:
        waiting = self._waiting.get(key, [])
        taken, size, count = 0, 0, 0
        while taken < len(waiting):
            size += self._size(waiting[taken][0])
            count += self._count(waiting[taken][0])
            if taken and (size > self._max_bytes or count > self._max_items):
                break  # the first item always goes, however large
            taken += 1
        batch, self._waiting[key] = waiting[:taken], waiting[taken:]
        return batch
