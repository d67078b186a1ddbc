"""Finding work, for the archive worker (``workers/archiver.py``): which streams to
archive, and which archives to remove.

Work is found through hints (``gateway/features/hints.py``: a sorted set of stream
ids by when they are due) and a periodic reconciliation (one worker at a time) that
hints streams whose hint was lost and removes the files of deleted and expired streams,
found through the index ``keys.ARCHIVE_SEGSETS``. The hints' backlog is the metrics
``ds_archive_due_streams`` and ``ds_archive_lag_seconds`` (per Redis primary).

On Redis Cluster the hints are in several keys (``HintKeys``), which a worker polls in
turn, starting at a different one each pass; the reconciliation SCANs every primary,
each with its own cursor.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

from redis.asyncio import RedisCluster
from redis.exceptions import RedisClusterException

from gateway.archive.segments import Segment
from gateway.features.hints import HintKeys, add_hints
from gateway.protocol.models import text
from gateway.redis_io import keys
from gateway.redis_io.connections import Client, scan_pages
from gateway.redis_io.contracts import ARCHIVE_CHECK, status_of
from gateway.redis_io.outcomes import UNAVAILABLE
from gateway.telemetry import metrics

from .archive_files import Members, ScoredMembers, SegmentFiles
from .archive_lease import Leases
from .clock import now_ms
from .health import Heartbeat

log = logging.getLogger("durable_streams.archive")


def unavailable(exc: BaseException) -> bool:
    """Redis could not be reached or answered too late (or a cluster is failing over):
    nothing to fix here but to wait. A cluster client that reaches no node at all says so
    with a RedisClusterException caused by the connection error."""
    if isinstance(exc, FileNotFoundError):  # an archive file of one stream's: not Redis
        return False
    if isinstance(exc, (*UNAVAILABLE, OSError)):  # UNAVAILABLE has a cluster's "not now" too
        return True
    cause = exc.__cause__
    return isinstance(exc, RedisClusterException) and cause is not None and unavailable(cause)


class Finder:
    """The streams due (their hints, taken one at a time so that workers share them),
    the backlog metrics, and the reconciliation."""

    def __init__(
        self,
        redis: Client,
        leases: Leases,
        files: SegmentFiles,
        *,
        name: str,
        hot_bytes: int,
        retention_ms: int,
        reconcile_seconds: float,
        heartbeat: Heartbeat,
    ) -> None:
        self.redis = redis
        self.leases = leases  # the reconciliation removes a dead stream's files under its lease
        self.files = files
        self.name = name
        self.hot_bytes = hot_bytes
        self.retention_ms = retention_ms
        self.reconcile_seconds = reconcile_seconds
        self.heartbeat = heartbeat
        self.hint_keys = HintKeys.of_client(redis)
        # Where the next pass starts polling hint keys: workers start at random ones and move
        # on by one each pass, so that they neither contend for one key nor starve another.
        self._next_hint_key = random.randrange(len(self.hint_keys.all))
        self._lag_nodes: set[str] = set()  # the node labels of ds_archive_lag_seconds set here
        self._legacy_indexed = False

    # -- hints ---------------------------------------------------------------

    async def take_due(self, limit: int) -> AsyncGenerator[str, None]:
        """The streams whose hints are due (at most ``limit``), each hint taken (removed)
        just before its stream is yielded. The hint keys with due hints are polled in turn
        (one on one Redis). A generator: close it (``contextlib.aclosing``) if left early."""
        now = now_ms()
        due_in = await self.report_backlog(now)
        taken = 0
        for key in self.polling_order():
            if taken >= limit:
                break
            if not due_in.get(key):
                continue
            due = cast(Members, await self.redis.zrangebyscore(key, "-inf", now, start=0, num=limit - taken))
            for raw in due:
                if await self.redis.zrem(key, raw) != 1:
                    continue  # another worker took it
                taken += 1
                yield text(raw)

    def polling_order(self) -> list[str]:
        """The hint keys, from this pass's first (the next pass starts one further)."""
        every = self.hint_keys.all
        first = self._next_hint_key % len(every)
        self._next_hint_key = first + 1
        return [*every[first:], *every[:first]]

    async def report_backlog(self, now: int) -> dict[str, int]:
        """The backlog metrics, over every hint key (one pipeline: a round trip per node;
        not a transaction, as on a cluster the keys are in different slots). Returns how
        many hints are due in each key."""
        every = self.hint_keys.all
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in every:
                pipe.zrange(key, 0, 0, withscores=True)
                pipe.zcount(key, "-inf", now)
            replies = await pipe.execute()
        firsts = cast(list[ScoredMembers], replies[0::2])
        due = {key: int(count) for key, count in zip(every, replies[1::2], strict=True)}
        lag: dict[str, float] = {}  # the longest wait in the hint keys of each primary
        for key, first in zip(every, firsts, strict=True):
            waited = max(0.0, (now - first[0][1]) / 1000) if first else 0.0
            node = self._node_of(key)
            lag[node] = max(lag.get(node, 0.0), waited)
        for gone in self._lag_nodes - lag.keys():  # a primary renamed (failover), or removed
            with contextlib.suppress(KeyError):
                metrics.ARCHIVE_LAG.remove(gone)
        for node, seconds in lag.items():
            metrics.ARCHIVE_LAG.labels(node).set(seconds)
        self._lag_nodes = set(lag)
        metrics.ARCHIVE_DUE.set(sum(due.values()))
        return due

    def _node_of(self, key: str) -> str:
        """The ``node`` label of a hint key's lag, named as ``ds_redis_used_memory_bytes``
        names nodes: on Redis Cluster the primary serving its slot (this client's slot map),
        on one Redis its address (one series)."""
        if isinstance(self.redis, RedisCluster):
            try:
                node = self.redis.get_node_from_key(key)
            except RedisClusterException:  # the slot map is being read again
                node = None
            return node.name if node is not None else "unknown"
        pool = getattr(self.redis, "connection_pool", None)
        options: dict[str, Any] = getattr(pool, "connection_kwargs", {})
        if "path" in options:
            return str(options["path"])
        return f"{options.get('host', 'redis')}:{options.get('port', 6379)}"

    async def hint(self, sid: str, when_ms: int) -> None:
        await self.redis.zadd(self.hint_keys.of(sid), {sid: when_ms}, lt=True)

    # -- reconciliation -----------------------------------------------------

    async def reconcile(self, force: bool = False) -> bool:
        """Hint streams with unarchived data (hints can be lost) and remove the
        archives of streams that are gone. One worker per interval does it."""
        ttl = max(int(self.reconcile_seconds * 1000) - 500, 1)
        if not force and not await self.redis.set(keys.ARCHIVE_RECONCILE, self.name, nx=True, px=ttl):
            return False
        now = now_ms()
        if not self._legacy_indexed:
            await self._index_legacy_segsets()
        async for batch in _batches(self._scan(keys.META_PATTERN)):
            await self._hint_unarchived(batch, now)
        async for batch in _batches(self.redis.sscan_iter(keys.ARCHIVE_SEGSETS, count=1000)):
            for key in await self._maybe_dead(batch):
                try:
                    await self._remove_if_dead(key)
                except Exception as exc:  # one bad entry must not stop the pass
                    if unavailable(exc):
                        raise
                    log.exception("removing the archive %r failed; will retry", key)
                self.heartbeat.beat()  # each removal (files deleted) is progress
            self.heartbeat.beat()
        return True

    async def _scan(self, match: str, type_: str | None = None) -> AsyncIterator[bytes | str]:
        """SCAN's keys (``scan_pages``: every primary of a cluster), with a heartbeat per page
        visited, matching or not: on a Redis shared with many keys of others a pass may read
        thousands of pages that match nothing, and that is progress, not a stall
        (--archive-stall-seconds)."""
        async for found in scan_pages(self.redis, match, type_=type_):
            self.heartbeat.beat()
            for key in found:
                yield key

    async def _index_legacy_segsets(self) -> None:
        """Once per process: index segment sets that no index names, e.g. those of
        streams deleted before workers kept the index (an upgrade). Only sorted sets
        whose names parse as segment-set names: user-chosen paths cannot match."""
        legacy = self._scan(f"{keys.PREFIX}:*:segs:*", "zset")
        async for batch in _batches(legacy):
            found = []
            for key in batch:
                with contextlib.suppress(ValueError):
                    keys.split_segments_key(key)
                    found.append(key)
            if found:
                await self.redis.sadd(keys.ARCHIVE_SEGSETS, *found)
        self._legacy_indexed = True

    async def _hint_unarchived(self, meta_keys: list[str], now: int) -> None:
        """Hint streams past their hot window; index their segment sets (a repair:
        an index entry may be missing, e.g. for sets written before the index)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in meta_keys:
                pipe.hmget(key, "tail", "arch", "base", "inc")
            states = await pipe.execute(raise_on_error=False)
        due: dict[str, int] = {}
        indexed: list[str] = []
        for key, state in zip(meta_keys, states, strict=True):
            try:  # per key: one odd key (a wrong type, a bad value) must not stop the pass
                if isinstance(state, Exception):
                    raise state
                tail, arch, base, inc = state
                if tail is None:
                    continue
                sid = keys.key_stream_id(key)
                past_window = int(tail) - self.hot_bytes > int(arch or base or 0)
                if past_window or (self.retention_ms and inc):
                    due[sid] = now
                if inc:
                    indexed.append(keys.segments(sid, text(inc)))
            except Exception as error:
                log.warning("skipped %r while looking for unarchived data: %s", key, error)
        if due:
            await add_hints(self.redis, self.hint_keys, due, nx=True)
        if indexed:
            await self.redis.sadd(keys.ARCHIVE_SEGSETS, *indexed)

    async def _maybe_dead(self, segment_keys: list[str]) -> list[str]:
        """The index entries whose stream no longer has that incarnation at first sight
        (one pipelined read; the verdict is checked again under the stream's lease)."""
        parsed: list[tuple[str, str, str]] = []
        out: list[str] = []
        for key in segment_keys:
            try:
                sid, inc = keys.split_segments_key(key)
            except ValueError:  # not a segment set's name: nothing of ours to remove
                log.warning("dropped %r from %s: not a segment set", key, keys.ARCHIVE_SEGSETS)
                await self.redis.srem(keys.ARCHIVE_SEGSETS, key)
                continue
            parsed.append((key, sid, inc))
        async with self.redis.pipeline(transaction=False) as pipe:
            for _, sid, _ in parsed:
                pipe.hget(keys.stream_keys(sid)[0], "inc")
            incs = await pipe.execute(raise_on_error=False)
        for (key, _, inc), current in zip(parsed, incs, strict=True):
            if isinstance(current, Exception) or current is None or text(current) != inc:
                out.append(key)
        return out

    async def _remove_if_dead(self, key: str) -> None:
        """Remove a dead incarnation's files, its segment set, then its index entry;
        under the stream's lease (busy: next pass), so no round races it."""
        sid, inc = keys.split_segments_key(key)
        async with self.leases.held(sid) as lease:
            if lease is None:
                return
            if status_of(await self.leases.fenced(ARCHIVE_CHECK.name, lease, inc)) != "dead":
                return
            members = cast(Members, await self.redis.zrange(key, 0, -1))
            await self.files.remove(lease, inc, [Segment.parse(m) for m in members])
            if members:
                log.info("removed the archive of %s (%d files)", keys.path_of(sid), len(members))
            if not await self.redis.exists(key):  # dead: nothing writes it again
                await self.redis.srem(keys.ARCHIVE_SEGSETS, key)


async def _batches(items: AsyncIterator[Any], size: int = 500) -> AsyncIterator[list[str]]:
    """Key names from a SCAN-style iterator, as text, ``size`` at a time."""
    batch: list[str] = []
    async for item in items:
        batch.append(text(item))
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
