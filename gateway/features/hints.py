"""Archive hints: which streams got appends, told to the archive workers.

An append marks its stream here; about once a second the marks go to Redis
in one ZADD NX (score: now), so the cost per append is a set insertion, not
a Redis call. A mark lost in a crash only delays archiving until a worker's
periodic reconciliation finds the stream.

Marks are sent only while an archive worker is alive (workers refresh
``keys.ARCHIVE_WORKER_ALIVE``): with none running, hints would pile up in
Redis forever. A worker that starts reconciles first, which finds every
stream with data to archive, hinted or not.

Where: one sorted set on one Redis (``keys.ARCHIVE_HINTS``); on Redis Cluster
``keys.ARCHIVE_HINT_SHARDS`` of them in slots spread over the primaries, a
stream's hint in the one its slot picks (``HintKeys``), so that neither the
gateways' writes nor the workers' polls all go to one node. A flush sends one
ZADD per key, pipelined: one round trip per node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping

from redis.asyncio import RedisCluster

from ..concurrency.cancelling import raise_if_cancelled
from ..redis_io import keys
from ..redis_io.connections import Client

log = logging.getLogger(__name__)


class HintKeys:
    """The archive hint keys of one Redis (one key) or Redis Cluster (several), and
    which one holds a stream's hint: always the same for a stream."""

    def __init__(self, cluster: bool) -> None:
        self.all: tuple[str, ...] = tuple(keys.archive_hint_keys(cluster))

    @classmethod
    def of_client(cls, redis: Client) -> HintKeys:
        return cls(isinstance(redis, RedisCluster))

    def of(self, sid: str) -> str:
        """The key holding the stream's hint."""
        if len(self.all) == 1:
            return self.all[0]
        return self.all[keys.archive_hint_shard(sid, len(self.all))]

    def split(self, scores: Mapping[str, int]) -> dict[str, dict[str, int]]:
        """``{sid: score}`` split by the key each stream's hint goes to."""
        parts: dict[str, dict[str, int]] = {}
        for sid, score in scores.items():
            parts.setdefault(self.of(sid), {})[sid] = score
        return parts


async def add_hints(
    redis: Client, hint_keys: HintKeys, scores: Mapping[str, int], *, nx: bool = False, lt: bool = False
) -> None:
    """ZADD each stream's hint to its key (``nx``/``lt`` as ZADD's). Several keys: one
    pipeline (not a transaction: they are in different slots), so one round trip per
    node. A failure raises; some keys may have been written (NX and LT make a retry harmless)."""
    parts = hint_keys.split(scores)
    if not parts:
        return
    if len(parts) == 1:
        ((key, members),) = parts.items()
        await redis.zadd(key, members, nx=nx, lt=lt)
        return
    async with redis.pipeline(transaction=False) as pipe:
        for key, members in parts.items():
            pipe.zadd(key, members, nx=nx, lt=lt)
        await pipe.execute()


class Hints:
    def __init__(self, redis: Client, interval: float = 1.0, *, enabled: bool = True) -> None:
        self.redis = redis
        self.hint_keys = HintKeys.of_client(redis)
        self.interval = interval
        self.enabled = enabled  # --archive-hints; off where no archive worker reads them
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
                await self.redis.zrem(self.hint_keys.of(sid), sid)
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
            await add_hints(self.redis, self.hint_keys, dict.fromkeys(marked, now), nx=True)
        except Exception as exc:  # Redis away: keep the marks for the next round
            raise_if_cancelled()  # stopping, the CancelledError lost in a library
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
