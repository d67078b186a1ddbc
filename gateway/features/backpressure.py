"""Write backpressure: writes pause (503 + Retry-After) before Redis is full, or
while the archive is far behind; reads and deletes go on.

Why earlier than Redis' own ``maxmemory``: at the ceiling (``noeviction``) Redis
refuses every command that may add memory, the archive worker's too (a lease's
``SET NX``, staging), so the archive cannot drain a full Redis (docs/operations.md,
"What clients see when Redis is full"). A mark below it leaves the archive, deletes
and reads room to work, and tells writers when to come back.

Each gateway process polls on its own, every ``POLL_SECONDS``, in a task of its own:
a request only reads the last decision (``refusal``: no Redis call). What is polled:

- memory (``--write-pause-memory``): ``INFO memory`` (``used_memory``, ``maxmemory``)
  of the Redis, or of every primary of a Redis Cluster, each judged alone: a primary
  over its mark pauses the writes to the streams whose slots it serves (the slot map
  the scripts are routed by), not the cluster's.
- archive lag (``--write-pause-archive-lag``): the oldest score in the archive hint
  keys (one ``ZRANGE 0 0`` per key, pipelined), i.e. how long the stream that has
  waited longest has waited for a worker: the largest of the numbers workers report
  as ``ds_archive_lag_seconds`` (one per Redis primary). It pauses every write: the
  workers serve every stream. Measuring the bytes not yet archived instead would read every stream's meta.

Hysteresis: writes pause once a value passes its mark and resume once it is below
``RESUME`` of it, so writers do not flap at the mark. A poll that fails decides
nothing: what it would have measured is dropped (writes go on; while Redis is away
they get 503 anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from redis.asyncio import RedisCluster

from ..concurrency.cancelling import raise_if_cancelled
from ..config import memory_mark
from ..protocol.errors import ProtocolError
from ..redis_io import keys
from ..redis_io.connections import Client, every_node
from ..redis_io.outcomes import UNAVAILABLE
from ..telemetry import metrics
from ..telemetry.logs import RateLimited
from .hints import HintKeys

log = logging.getLogger(__name__)
limited = RateLimited(log, every=60.0)  # a poll failing every 0.5 s: one line a minute
POLL_SECONDS = 0.5  # how stale a decision may be; at 100 MB/s of appends, 50 MB of overshoot
RESUME = 0.95  # writes resume below this share of a mark
MAP_SECONDS = 10.0  # Redis Cluster: how often the list of primaries is read again
MEMORY, ARCHIVE_LAG = "memory", "archive_lag"
_MESSAGES = {
    MEMORY: "writes paused: storage memory is above its mark (backpressure), retry",
    ARCHIVE_LAG: "writes paused: the archive is behind (backpressure), retry",
}


def memory_limit(mark_bytes: int, share: float, maxmemory: int) -> int | None:
    """The used_memory at which writes pause: the mark's bytes, or its share of
    ``maxmemory``; None: no mark (off, or a share of a Redis without maxmemory)."""
    if mark_bytes:
        return mark_bytes
    if share and maxmemory:
        return int(maxmemory * share)
    return None


def over(paused: bool, value: float, mark: float | None) -> bool:
    """Whether writes are paused after measuring ``value``: once above ``mark``, and
    until below ``RESUME`` of it."""
    if mark is None:
        return False
    return value >= mark * RESUME if paused else value > mark


def _node_name(redis: Client) -> str:
    """A single Redis' address, for the metrics' node label and the log."""
    options = getattr(redis, "connection_pool", None)
    kwargs: dict[str, Any] = getattr(options, "connection_kwargs", {})
    if "path" in kwargs:
        return str(kwargs["path"])
    return f"{kwargs.get('host', 'redis')}:{kwargs.get('port', 6379)}"


def _failed(key: str, what: str, exc: BaseException) -> None:
    """A failed measure: DEBUG while Redis is away (requests and /readyz say so already),
    else a WARNING a minute (e.g. an ACL that forbids INFO: writes never pause)."""
    level = logging.DEBUG if isinstance(exc, (*UNAVAILABLE, OSError)) else logging.WARNING
    limited.log(level, key, "write backpressure: %s: %s", what, exc)


class WritePause:
    """Whether writes are paused now, and the task that decides it (``run``)."""

    def __init__(
        self,
        redis: Client,
        hint_keys: HintKeys,
        *,
        memory: str,
        archive_lag: float,
        retry_after: int,
        interval: float = POLL_SECONDS,
    ) -> None:
        self.redis = redis
        self.cluster = redis if isinstance(redis, RedisCluster) else None
        self.hint_keys = hint_keys
        mark = memory_mark(memory)
        self.memory_text, self.mark_bytes, self.mark_share = memory, mark.bytes, mark.share
        self.lag_seconds = archive_lag
        self.headers = {"Retry-After": str(retry_after)}
        self.interval = interval
        self.full: frozenset[str] = frozenset()  # nodes above their memory mark
        self.behind = False  # the archive lag is above its mark
        self.active = False  # either: the one attribute a request looks at when nothing is paused
        self._nodes: list[tuple[str, dict[str, Any]]] = []  # (name, target) of every primary
        self._nodes_read_at = -MAP_SECONDS
        self._unmarked: set[str] = set()  # nodes told to have no maxmemory (logged once)
        self._stop = asyncio.Event()

    @property
    def enabled(self) -> bool:
        return bool(self.mark_bytes or self.mark_share or self.lag_seconds)

    # -- requests ----------------------------------------------------------------

    def refusal(self, path: str) -> str | None:
        """Why a write to the stream at ``path`` is refused now (a reason), or None."""
        if self.behind:
            return ARCHIVE_LAG
        if not self.full:
            return None
        if self.cluster is None:
            return MEMORY
        try:  # the node the scripts would send the write to, by this process's slot map
            node = self.cluster.nodes_manager.get_node_from_slot(keys.stream_slot(keys.stream_id(path)))
        except Exception:  # no slot map yet, a slot not served: no decision
            return None
        return MEMORY if node.name in self.full else None

    def check(self, path: str) -> None:
        """503 + Retry-After if a write to ``path`` is refused now."""
        reason = self.refusal(path)
        if reason is not None:
            metrics.child(metrics.WRITE_REFUSALS, reason).inc()
            raise ProtocolError(503, _MESSAGES[reason], self.headers)

    # -- polling -----------------------------------------------------------------

    async def poll(self) -> None:
        """Measure once and decide; never raises (a failed measure decides nothing)."""
        if self.mark_bytes or self.mark_share:
            self.full = await self._poll_memory()
            metrics.child(metrics.WRITE_BACKPRESSURE, MEMORY).set(1 if self.full else 0)
        if self.lag_seconds:
            self.behind = await self._poll_lag()
            metrics.child(metrics.WRITE_BACKPRESSURE, ARCHIVE_LAG).set(1 if self.behind else 0)
        self.active = self.behind or bool(self.full)

    async def _primaries(self) -> list[tuple[str, dict[str, Any]]]:
        """(name, ``target_nodes`` argument) of every primary; a single Redis: one, no target."""
        if self.cluster is None:
            return [(_node_name(self.redis), {})]
        if not self._nodes or time.monotonic() - self._nodes_read_at > MAP_SECONDS:
            targets = await every_node(self.cluster)
            self._nodes = [(t["target_nodes"].name, t) for t in targets]
            self._nodes_read_at = time.monotonic()
        return self._nodes

    async def _poll_memory(self) -> frozenset[str]:
        try:
            nodes = await self._primaries()
        except Exception as exc:
            self._nodes = []
            _failed("nodes", "redis cluster nodes not read", exc)
            return frozenset()
        replies = await asyncio.gather(
            *(self.redis.info("memory", **target) for _, target in nodes), return_exceptions=True
        )
        full = set()
        for (name, _), reply in zip(nodes, replies, strict=True):
            if isinstance(reply, BaseException):
                self._nodes = []  # a failover, perhaps: read the primaries again next time
                _failed(name, f"{name} not measured", reply)
                continue
            used, maxmemory = int(reply["used_memory"]), int(reply.get("maxmemory", 0))
            metrics.child(metrics.REDIS_USED_MEMORY, name).set(used)
            metrics.child(metrics.REDIS_MAXMEMORY, name).set(maxmemory)
            limit = memory_limit(self.mark_bytes, self.mark_share, maxmemory)
            if limit is not None:
                metrics.child(metrics.WRITE_PAUSE_MARK, name).set(limit)
            if limit is None and name not in self._unmarked:
                self._unmarked.add(name)
                why = f"--write-pause-memory {self.memory_text}"
                log.info("redis %s has no maxmemory: writes never pause for its memory (%s)", name, why)
            paused = over(name in self.full, used, limit)
            if paused != (name in self.full):
                mark = f"--write-pause-memory {self.memory_text}: {limit or 0:,}"
                self._tell(paused, f"redis {name} uses {used:,} bytes", mark)
            if paused:
                full.add(name)
        return frozenset(full)

    async def _poll_lag(self) -> bool:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for key in self.hint_keys.all:
                    pipe.zrange(key, 0, 0, withscores=True)
                firsts = await pipe.execute()
        except Exception as exc:
            _failed("lag", "archive lag not measured", exc)
            return False
        oldest = min((first[0][1] for first in firsts if first), default=None)
        lag = max(0.0, time.time() - oldest / 1000) if oldest is not None else 0.0
        behind = over(self.behind, lag, self.lag_seconds)
        if behind != self.behind:
            mark = f"--write-pause-archive-lag {self.lag_seconds:g} s"
            self._tell(behind, f"the archive is {lag:.1f} s behind", mark)
        return behind

    @staticmethod
    def _tell(paused: bool, measured: str, mark: str) -> None:
        why = f"{measured} ({mark}; writes resume below {RESUME:.0%} of it)"
        if paused:
            log.warning("writes paused (503 + Retry-After): %s", why)
        else:
            log.info("writes resumed: %s", why)

    def stop(self) -> None:
        """Make ``run`` return (an Event, not a cancel: redis-py may swallow one)."""
        self._stop.set()

    async def run(self) -> None:
        """Poll every ``interval`` seconds until ``stop``; at once nothing to watch."""
        if not self.enabled:
            return
        while not self._stop.is_set():
            try:
                await self.poll()
            except Exception as exc:  # a bug, an odd reply: logged; the loop goes on
                raise_if_cancelled()  # stopping, the CancelledError lost in a library
                limited.log(logging.ERROR, "poll", "write backpressure: poll failed", exc_info=exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.interval)
