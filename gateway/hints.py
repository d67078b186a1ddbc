"""Archive hints: which streams got appends, told to the archive workers.

An append marks its stream here; about once a second the marks go to Redis
in one ZADD NX (score: now), so the cost per append is a set insertion, not
a Redis call. A mark lost in a crash only delays archiving until a worker's
periodic reconciliation finds the stream.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.asyncio import Redis

from . import keys

log = logging.getLogger(__name__)


class Hints:
    def __init__(self, redis: Redis, interval: float = 1.0) -> None:
        self.redis = redis
        self.interval = interval
        self.enabled = True
        self._marked: set[str] = set()

    def mark(self, sid: str) -> None:
        if self.enabled:
            self._marked.add(sid)

    async def flush(self) -> None:
        if not self._marked:
            return
        marked, self._marked = self._marked, set()
        now = int(time.time() * 1000)
        try:
            await self.redis.zadd(keys.ARCHIVE_HINTS, dict.fromkeys(marked, now), nx=True)
        except Exception as exc:  # Redis away: keep the marks for the next round
            self._marked |= marked
            log.debug("archive hints not sent: %s", exc)

    async def run(self) -> None:
        """Flush every ``interval`` seconds until cancelled (then once more)."""
        try:
            while True:
                await asyncio.sleep(self.interval)
                await self.flush()
        finally:
            await asyncio.shield(self.flush())
