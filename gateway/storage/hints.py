"""Archive hints: which streams got appends, told to the archive workers.

An append marks its stream here; about once a second the marks go to Redis
in one ZADD NX (score: now), so the cost per append is a set insertion, not
a Redis call. A mark lost in a crash only delays archiving until a worker's
periodic reconciliation finds the stream.

Marks are sent only while an archive worker is alive (workers refresh
``keys.ARCHIVE_WORKER_ALIVE``): with none running, hints would pile up in
Redis forever. A worker that starts reconciles first, which finds every
stream with data to archive, hinted or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from . import keys
from .client import Client

log = logging.getLogger(__name__)


class Hints:
    def __init__(self, redis: Client, interval: float = 1.0) -> None:
        self.redis = redis
        self.interval = interval
        self.enabled = True
        self._marked: set[str] = set()
        self._stop = asyncio.Event()

    def mark(self, sid: str) -> None:
        if self.enabled:
            self._marked.add(sid)

    async def forget(self, sid: str) -> None:
        """A deleted stream needs no archiving: drop its mark and its hint. Best effort:
        the delete is done; a hint left behind costs a worker one look."""
        self._marked.discard(sid)
        if self.enabled:
            try:
                await self.redis.zrem(keys.ARCHIVE_HINTS, sid)
            except Exception as exc:
                log.debug("archive hint of a deleted stream not removed: %s", exc)

    async def flush(self) -> None:
        if not self._marked:
            return
        marked, self._marked = self._marked, set()
        now = int(time.time() * 1000)
        try:
            if not await self.redis.exists(keys.ARCHIVE_WORKER_ALIVE):
                return  # no worker to read them; the first to start reconciles
            await self.redis.zadd(keys.ARCHIVE_HINTS, dict.fromkeys(marked, now), nx=True)
        except Exception as exc:  # Redis away: keep the marks for the next round
            self._marked |= marked
            log.debug("archive hints not sent: %s", exc)

    def stop(self) -> None:
        """Make ``run`` flush once more and return. An Event, not a cancel: redis-py
        may swallow a cancel that lands inside a command, and the loop would go on."""
        self._stop.set()

    async def run(self) -> None:
        """Flush every ``interval`` seconds until ``stop`` (then once more)."""
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.interval)
            await self.flush()
