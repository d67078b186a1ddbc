"""The archive worker: moves each stream's older entries from Redis to Parquet.

Per stream, under a lease (one worker at a time; a crashed or paused
worker's lease expires and another takes over; see "Fencing" below):

1. if the stream is due (``_plan``: enough is past the hot window, or its oldest
   entry there has been there ``max_delay``), plan a range past the hot window,
   aligned to entries, within one UTC day, merged with the stream's last file
   while that is below ``min_bytes`` (so a byte is rewritten a bounded number of times);
2. *stage* it (archive_stage.lua): the range and file name are recorded
   before the file is written, so a retry after a crash writes the same file;
3. write the file (durably: fsync + rename, or an object put);
4. *commit* (archive_commit.lua): record the segment, move the log's start,
   trim the Redis Stream, all in one script;
5. delete a file the new one replaced, then forget it (archive_forget.lua).

A crash between any two steps leaves either a staged range (redone with the
same name: overwritten, not duplicated) or a garbage entry (deleted next
time): the archive plus Redis hold every byte once.

Fencing: the lease is a token in ``keys.lease(sid)``, renewed every third of
its length while a round runs. Every script that changes archive state checks
the token inside Redis, so a worker that lost its lease (paused past it: GC,
SIGSTOP, a slow PUT) changes nothing there; it notices, stops the round, and
deletes a file it wrote only if ``archive_named.lua`` says no committed or
staged segment of a live incarnation names it. Every file delete asks that.

Work is found through hints (``gateway/features/hints.py``) and a periodic
reconciliation (one worker at a time) that also removes the files of deleted
and expired streams, found through the index ``keys.ARCHIVE_SEGSETS``.

On Redis Cluster (``--redis-cluster``) the same, spread over the primaries: the
hints are in several keys (``HintKeys``), which a worker polls in turn, starting
at a different one each pass; a stream's lease is in its own slot; the
reconciliation SCANs every primary, each with its own cursor; and a pipeline
that reads several streams' keys is no transaction (redis-py sends each node its
part). The scripts go to the stream's node (``connect_scripts``).

Redis away: the worker starts anyway and waits for it (``gateway/redis_io/
preflight.py``); a pass that loses it is one log line, and the next pass comes
after a capped, jittered backoff. The loop keeps a heartbeat (``health.py``)
that ``/healthz`` on ``--metrics-port`` reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any, cast

import pyarrow as pa
from redis.asyncio import RedisCluster
from redis.exceptions import RedisClusterException

from gateway.archive.files import Archive
from gateway.archive.schema import Row, to_table
from gateway.archive.segments import GARBAGE, PENDING, Segment, file_name, utc_date
from gateway.concurrency import backoff
from gateway.config import Settings
from gateway.features.hints import HintKeys, add_hints
from gateway.protocol import offsets
from gateway.protocol.headers import JSON_CONTENT_TYPE, normalize_content_type
from gateway.redis_io import keys
from gateway.redis_io.connections import Client, general, scan_pages
from gateway.redis_io.contracts import (
    ARCHIVE_CHECK,
    ARCHIVE_COMMIT,
    ARCHIVE_FORGET,
    ARCHIVE_LEASE,
    ARCHIVE_NAMED,
    ARCHIVE_RETAIN,
    ARCHIVE_STAGE,
    SCRIPTS,
    ArchiveCommitted,
    ArchiveRetained,
    status_of,
)
from gateway.redis_io.outcomes import UNAVAILABLE
from gateway.redis_io.preflight import Preflight, reason
from gateway.redis_io.scripts import Scripts, connect_scripts, replica_ack
from gateway.telemetry import metrics
from gateway.telemetry.logs import RateLimited

from . import health
from .health import Heartbeat

log = logging.getLogger("durable_streams.archive")
limited = RateLimited(log)
PAGE = 1000  # log entries per XRANGE
ALIVE_MS = 60_000  # how long one announcement keeps gateways sending hints
FORGET_BATCH = 500  # members per archive_forget call (Lua's unpack has a limit)


# redis-py types a reply as the union of every form its options allow; with this
# worker's options (no decode_responses) each reply used below is one of these.
Members = list[bytes]
ScoredMembers = list[tuple[bytes, float]]
LogPage = list[tuple[bytes, dict[bytes, bytes]]]


def now_ms() -> int:
    return int(time.time() * 1000)


def unavailable(exc: BaseException) -> bool:
    """Redis could not be reached or answered too late (or a cluster is failing over):
    nothing to fix here but to wait. A cluster client that reaches no node at all says so
    with a RedisClusterException caused by the connection error."""
    if isinstance(exc, (*UNAVAILABLE, OSError)):  # UNAVAILABLE has a cluster's "not now" too
        return True
    cause = exc.__cause__
    return isinstance(exc, RedisClusterException) and cause is not None and unavailable(cause)


@dataclass(frozen=True)
class Policy:
    """What to archive when; the defaults are the command line's (gateway/config.py)."""

    hot_bytes: int = Settings.archive_hot_bytes
    hot_ms: int = int(Settings.archive_hot_seconds * 1000)
    min_bytes: int = Settings.archive_min_bytes
    max_delay_ms: int = int(Settings.archive_max_delay * 1000)
    file_bytes: int = Settings.archive_file_bytes
    retention_ms: int = int(Settings.retention_seconds * 1000)  # 0: keep everything
    row_group_bytes: int = 4 * 1024 * 1024  # the unit a cold read fetches


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _log_start(meta: dict[str, str]) -> int:
    """Where the stream's Redis log starts: below it, everything is in files."""
    return int(meta.get("arch") or meta["base"])


def _row(entry_id: bytes, fields: dict[bytes, bytes], json: bool) -> Row:
    """A log entry; a JSON stream's may hold several messages joined by newlines, which
    take no positions (protocol/entries.py)."""
    producer = None
    if b"p" in fields:
        epoch, seq, pid = fields[b"p"].decode().split(" ", 2)
        producer = (pid, int(epoch), int(seq))
    data = fields[b"d"]
    size = len(data) - data.count(b"\n") if json else -1
    return Row(int(entry_id.split(b"-")[0]), data, int(fields[b"t"]), producer, size)


def _is_json(meta: dict[str, str]) -> bool:
    return normalize_content_type(meta.get("ct")) == JSON_CONTENT_TYPE


@dataclass
class _Job:
    segment: Segment
    rows: list[Row] | None  # None: read them again (redoing a staged file)


class LeaseLost(Exception):
    """The stream's lease expired or another worker holds it: stop, change nothing."""


@dataclass
class Lease:
    """A stream's archive lease as this worker holds it."""

    sid: str
    token: str
    seconds: float
    valid_until: float  # time.monotonic(): the latest moment it surely still holds
    lost: bool = False

    def check(self) -> None:
        """Raise LeaseLost once the lease may have run out (a pause outlasted it)."""
        if self.lost or time.monotonic() >= self.valid_until:
            self.lost = True
            raise LeaseLost(keys.path_of(self.sid))


class Archiver:
    def __init__(
        self,
        redis: Client,
        archive: Archive,
        policy: Policy,
        *,
        scripts: Scripts | None = None,
        interval: float = 1.0,
        reconcile_seconds: float = 60.0,
        lease_seconds: float = 30.0,
        name: str | None = None,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        self.redis = redis
        self.archive = archive
        self.policy = policy
        self.scripts = scripts or Scripts(redis)  # on a cluster: connect_scripts' (routed)
        self.interval = interval
        self.reconcile_seconds = reconcile_seconds
        self.lease_seconds = lease_seconds
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.heartbeat = heartbeat or Heartbeat()
        self.hint_keys = HintKeys.of_client(redis)
        # Where the next pass starts polling hint keys: workers start at random ones and move
        # on by one each pass, so that they neither contend for one key nor starve another.
        self._next_hint_key = random.randrange(len(self.hint_keys.all))
        self._lag_nodes: set[str] = set()  # the node labels of ds_archive_lag_seconds set here
        self._legacy_indexed = False
        self.archived_bytes = 0  # totals, for logs and benchmarks
        self.files_written = 0

    async def _call(self, script: str, lease: Lease, *args: Any) -> Any:
        """Run an archive script for the lease's stream, fenced by its token: ``args`` are
        its ARGV after the token, in the order of its description (contracts.py, which
        checks their count). Every script but archive_lease takes the incarnation first,
        and its segment set as KEYS[7]."""
        argv = SCRIPTS[script].args(lease.token, *args)
        script_keys = [*keys.stream_keys(lease.sid), keys.lease(lease.sid)]
        if script != ARCHIVE_LEASE.name:
            script_keys.append(keys.segments(lease.sid, str(args[0])))
        return await self.scripts.run(script, script_keys, argv)

    async def _fenced(self, script: str, lease: Lease, *args: Any) -> list[Any]:
        """Run a fenced script; LeaseLost if Redis says the lease is not ours."""
        result = await self._call(script, lease, *args)
        if status_of(result) == "lost":
            lease.lost = True
            raise LeaseLost(keys.path_of(lease.sid))
        return list(result)

    # -- the loop -----------------------------------------------------------

    async def announce(self) -> None:
        """Tell gateways a worker is alive, so they send hints (gateway/features/hints.py). Done
        before a worker's first pass, which reconciles: that finds whatever was
        written while no worker (so no hint) was around."""
        await self.redis.set(keys.ARCHIVE_WORKER_ALIVE, self.name, px=ALIVE_MS)

    async def _keep_announcing(self, stop: asyncio.Event) -> None:
        """Renew the announcement beside the work: a long pass must not let it lapse."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), ALIVE_MS / 3000)
            with contextlib.suppress(Exception):  # Redis away: the next renewal tries again
                await self.announce()

    async def run(self, stop: asyncio.Event) -> None:
        """Work until ``stop`` is set; the scripts were loaded (``run_worker``'s preflight)."""
        try:
            await self.announce()
        except Exception as exc:  # the first pass will say so too; the renewals try again
            log.warning("announcing this worker failed: %s", reason(exc))
        announcing = asyncio.create_task(self._keep_announcing(stop))
        try:
            await self._work(stop)
        finally:
            stop.set()
            await asyncio.wait_for(announcing, 5)

    async def _work(self, stop: asyncio.Event) -> None:
        next_reconcile = 0.0
        failures = 0  # passes failed in a row: the next waits longer (backoff)
        while not stop.is_set():
            pause = self.interval
            try:
                if time.monotonic() >= next_reconcile:
                    next_reconcile = time.monotonic() + self.reconcile_seconds
                    await self.reconcile()
                busy = await self.work_once()
                failures = 0
            except Exception as exc:
                busy = 0
                pause = max(pause, backoff.delay(failures))
                failures += 1
                if unavailable(exc):  # one line, not a traceback a second
                    limited.log(
                        logging.WARNING, "unavailable", "archive pass failed: redis unavailable (%s); "
                        "next pass in %.1f s", reason(exc), pause,
                    )  # fmt: skip
                else:
                    log.exception("archive pass failed; next pass in %.1f s", pause)
            self.heartbeat.beat(0.0 if busy else pause)
            if not busy:
                try:
                    await asyncio.wait_for(stop.wait(), pause)
                except TimeoutError:
                    pass

    async def work_once(self, limit: int = 64) -> int:
        """Archive the streams whose hints are due (at most ``limit``); returns how many
        were taken. The hint keys with due hints are polled in turn (one on one Redis)."""
        now = now_ms()
        due_in = await self._report_backlog(now)
        taken = 0
        for key in self._polling_order():
            if taken >= limit:
                break
            if not due_in.get(key):
                continue
            due = cast(Members, await self.redis.zrangebyscore(key, "-inf", now, start=0, num=limit - taken))
            for raw in due:
                if await self.redis.zrem(key, raw) != 1:
                    continue  # another worker took it
                taken += 1
                await self._take(_text(raw))
        return taken

    def _polling_order(self) -> list[str]:
        """The hint keys, from this pass's first (the next pass starts one further)."""
        every = self.hint_keys.all
        first = self._next_hint_key % len(every)
        self._next_hint_key = first + 1
        return [*every[first:], *every[:first]]

    async def _take(self, sid: str) -> None:
        """Archive a stream whose hint this worker took; hint it again on failure."""
        try:
            await self.archive_stream(sid)
        except Exception as exc:
            if unavailable(exc):  # the pass ends (one line); reconciliation finds a lost hint
                with contextlib.suppress(Exception):
                    await self.hint(sid, now_ms() + 5000)
                raise
            log.exception("archiving %s failed; will retry", keys.path_of(sid))
            await self.hint(sid, now_ms() + 5000)
        self.heartbeat.beat()

    async def _report_backlog(self, now: int) -> dict[str, int]:
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

    # -- one stream ---------------------------------------------------------

    async def archive_stream(self, sid: str) -> None:
        """Archive what the policy allows of one stream, under its lease."""
        async with self._leased(sid) as lease:
            if lease is None:
                await self.hint(sid, now_ms() + 1000)  # someone else is on it; look again soon
                return
            try:
                for _ in range(10_000):  # each round moves the log's start, or ends
                    lease.check()
                    if not await self._round(lease):
                        return
                    self.heartbeat.beat()
            except LeaseLost:
                log.warning("lost the lease of %s during a round; stopped it", keys.path_of(sid))
                await self.hint(sid, now_ms() + 1000)

    # -- the lease ----------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _leased(self, sid: str) -> AsyncIterator[Lease | None]:
        """The stream's lease (None: another worker holds it), renewed in the
        background while the body runs, released after."""
        token = f"{self.name}:{uuid.uuid4().hex}"
        started = time.monotonic()
        if not await self.redis.set(keys.lease(sid), token, nx=True, px=int(self.lease_seconds * 1000)):
            yield None
            return
        lease = Lease(sid, token, self.lease_seconds, started + self.lease_seconds)
        renewal = asyncio.create_task(self._renew(lease))
        try:
            yield lease
        finally:
            renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewal
            with contextlib.suppress(Exception):  # fenced: frees it only if still ours; else it expires
                await self._call(ARCHIVE_LEASE.name, lease, 0)

    async def _renew(self, lease: Lease) -> None:
        """Extend the lease every third of its length; mark it lost when Redis says
        it is no longer ours, or when it could not be renewed in time."""
        while not lease.lost:
            await asyncio.sleep(lease.seconds / 3)
            sent = time.monotonic()
            if sent >= lease.valid_until:
                lease.lost = True
                return
            try:
                result = await self._call(ARCHIVE_LEASE.name, lease, int(lease.seconds * 1000))
            except Exception as error:  # Redis unreachable: try again until the lease runs out
                log.warning("renewing the lease of %s failed: %s", keys.path_of(lease.sid), error)
                continue
            if status_of(result) != "ok":
                lease.lost = True
                return
            lease.valid_until = sent + lease.seconds
            self.heartbeat.beat()  # a long round (a large file) still shows progress

    # -- one round ----------------------------------------------------------

    async def _round(self, lease: Lease) -> bool:
        """One step of work on a stream; False when there is nothing more to do now."""
        sid = lease.sid
        raw = await self.redis.hgetall(keys.stream_keys(sid)[0])
        if not raw:
            return False
        meta = {_text(k): _text(v) for k, v in raw.items()}
        inc = meta.get("inc") or uuid.uuid4().hex[:16]
        members = cast(
            ScoredMembers, await self.redis.zrange(keys.segments(sid, inc), 0, -1, withscores=True)
        )
        garbage = [Segment.parse(m) for m, score in members if score == GARBAGE]
        pending = [Segment.parse(m) for m, score in members if score == PENDING]
        committed = [Segment.parse(m) for m, score in members if score >= 0]
        if garbage:
            await self._remove(lease, inc, garbage)
        if pending:
            return await self._write_and_commit(lease, meta, inc, _Job(pending[0], None))
        if self.policy.retention_ms and committed:
            cutoff = now_ms() - self.policy.retention_ms
            retained = ArchiveRetained(*await self._fenced(ARCHIVE_RETAIN.name, lease, inc, cutoff))
            if retained.dropped:
                await self._remove(lease, inc, [Segment.parse(m) for m in retained.dropped])
        job = await self._plan(lease, meta, inc, committed[-1] if committed else None)
        if job is None:
            return False
        # Indexed before the set is first written, so reconciliation finds it once the stream is gone.
        await self.redis.sadd(keys.ARCHIVE_SEGSETS, keys.segments(sid, inc))
        staged = await self._fenced(
            ARCHIVE_STAGE.name,
            lease,
            inc,
            job.segment.start,
            job.segment.end,
            job.segment.first_ms,
            job.segment.last_ms,
            job.segment.file,
        )
        status = status_of(staged)
        if status == "ok":
            return await self._write_and_commit(lease, meta, inc, job)
        return status in ("busy", "moved")  # plan again from what Redis says now

    async def _plan(self, lease: Lease, meta: dict[str, str], inc: str, last: Segment | None) -> _Job | None:
        """The next range to archive, or None (nothing due; re-hinted for later).

        Entries are *movable* once past the hot window (older than ``hot_ms`` and
        more than ``hot_bytes`` behind the tail). A stream is due when its movable
        entries reach ``min_bytes``, when ``max_delay_ms`` has passed since its
        first entry became movable, or when it is closed or deleted; a due round
        takes every movable entry (up to a file and within one UTC day)."""
        sid, policy, now = lease.sid, self.policy, now_ms()
        start = _log_start(meta)
        limit = int(meta["tail"]) - policy.hot_bytes
        if limit <= start:
            return None
        head = await self._first(lease, start, _is_json(meta))
        if head is None or head.end > limit:
            return None  # the log's first entry is still inside the byte window
        eligible = await self._movable_since(lease, head)
        later = min(eligible + policy.max_delay_ms, now + 60_000)
        closed = meta.get("closed") == "1" or meta.get("deleted") == "1"
        overdue = closed or now - eligible >= policy.max_delay_ms
        if not overdue and limit - start < policy.min_bytes:
            await self.hint(sid, later)  # even all that is past the byte window is too little: no read
            return None
        young = now - policy.hot_ms
        # Only a file below min_bytes grows by being rewritten with the next round: one that has
        # reached the size a round is due at stays as it is, so a byte is rewritten a bounded
        # number of times (about min_bytes / (2 x round size)), however large files may get.
        merge = last if last is not None and last.end == start and last.size < policy.min_bytes else None
        rows: list[Row] = []
        size = 0
        day = ""
        room = policy.file_bytes
        async for row in self._log(lease, start, _is_json(meta)):
            if row.end > limit:
                break
            if row.append_ms > young:  # past the byte window, not yet old enough: look again then
                await self.hint(sid, row.append_ms + policy.hot_ms + 1)
                break
            if not rows:
                day = utc_date(row.append_ms)
                if merge is not None and (merge.date != day or merge.size + row.end - row.position > room):
                    merge = None  # another day, or the merged file would pass file_bytes: a new file
                room = policy.file_bytes - (merge.size if merge else 0)
            if utc_date(row.append_ms) != day or (rows and size + row.end - row.position > room):
                break
            rows.append(row)
            size += row.end - row.position
        if not rows:
            return None
        if size < policy.min_bytes and not overdue:
            await self.hint(sid, later)
            return None
        first = merge.start if merge else start
        first_ms = merge.first_ms if merge else rows[0].append_ms
        end = rows[-1].end
        name = file_name(keys.path_of(sid), inc, first, end, first_ms)
        return _Job(Segment(first, end, first_ms, rows[-1].append_ms, name), rows)

    async def _first(self, lease: Lease, start: int, json: bool) -> Row | None:
        """The log's first entry (the one at ``start``), or None if the log is empty."""
        stream = keys.stream_keys(lease.sid)[1]
        page = cast(LogPage, await self.redis.xrange(stream, min=offsets.entry_id(start), max="+", count=1))
        return _row(*page[0], json) if page else None

    async def _movable_since(self, lease: Lease, row: Row) -> int:
        """When ``row`` left the hot window (ms): once it was ``hot_ms`` old, and once the
        entry holding the byte ``hot_bytes`` past its end was appended. The due time counts
        from here, not from the row's append: a slow stream's rows leave the byte window
        long after they were appended, and would all be overdue at once."""
        pushed = row.append_ms  # hot_bytes 0: movable as soon as appended
        if self.policy.hot_bytes:
            edge = row.end + self.policy.hot_bytes - 1
            stream = keys.stream_keys(lease.sid)[1]
            holder = cast(  # positions are entry ids: the entry starting at or before ``edge``
                LogPage, await self.redis.xrevrange(stream, offsets.entry_id(edge), "-", count=1)
            )
            if holder:
                pushed = int(holder[0][1][b"t"])
        return max(row.append_ms + self.policy.hot_ms, pushed)

    async def _write_and_commit(self, lease: Lease, meta: dict[str, str], inc: str, job: _Job) -> bool:
        sid, segment = lease.sid, job.segment
        start = _log_start(meta)
        rows = job.rows
        if rows is None:
            rows = [row async for row in self._log(lease, start, _is_json(meta), segment.end)]
        parts: list[pa.Table] = []
        if segment.start < start:  # merging: the last file's rows come first
            at = segment.start
            replaced = cast(
                Members, await self.redis.zrangebyscore(keys.segments(sid, inc), at, at, start=0, num=1)
            )
            old = Segment.parse(replaced[0])
            parts.append(await asyncio.to_thread(self.archive.read, old.file))
        parts.append(to_table(keys.path_of(sid), inc, meta["ct"], rows))
        table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
        lease.check()  # a pause may have outlasted the lease: then another worker redoes this file
        await asyncio.to_thread(self.archive.write, segment.file, table, self.policy.row_group_bytes)
        result = await self._call(ARCHIVE_COMMIT.name, lease, inc, segment.member)
        status = status_of(result)
        if status == "lost":  # the file may be the new holder's (same name) or already merged away
            lease.lost = True
            await self._delete_unnamed(lease, inc, [segment])
            raise LeaseLost(keys.path_of(sid))
        if status == "committed":  # a retried call whose first reply was lost: done
            return True
        if status != "ok":  # the stream went away meanwhile
            await self._remove(lease, inc, [segment])
            return False
        archived = sum(r.end - r.position for r in rows)
        self.archived_bytes += archived
        self.files_written += 1
        metrics.ARCHIVED_BYTES.inc(archived)
        metrics.ARCHIVE_FILES.inc()
        committed = ArchiveCommitted(*result)
        if _text(committed.replaced):
            await self._remove(lease, inc, [Segment.parse(committed.replaced)])
        return True

    async def _log(self, lease: Lease, start: int, json: bool, end: int | None = None) -> AsyncIterator[Row]:
        """The log's entries from ``start`` (to ``end``, exclusive), read a page at a time."""
        cursor, last = offsets.entry_id(start), "+" if end is None else "(" + offsets.entry_id(end)
        stream = keys.stream_keys(lease.sid)[1]
        while page := cast(LogPage, await self.redis.xrange(stream, min=cursor, max=last, count=PAGE)):
            lease.check()  # a long read: stop early once the lease is gone
            for entry_id, fields in page:
                yield _row(entry_id, fields, json)
            cursor = "(" + _text(page[-1][0])

    async def _remove(self, lease: Lease, inc: str, segments: list[Segment]) -> None:
        """Delete files, then forget them (in that order: a crash leaves a record, not a stray file)."""
        if not segments:
            return
        await self._delete_unnamed(lease, inc, segments)
        members = [s.member for s in segments]
        for i in range(0, len(members), FORGET_BATCH):
            await self._fenced(ARCHIVE_FORGET.name, lease, inc, *members[i : i + FORGET_BATCH])

    async def _delete_unnamed(self, lease: Lease, inc: str, segments: Iterable[Segment]) -> None:
        """Delete the segments' files, but none that a committed or staged segment of a
        live incarnation names: a read (or the lease holder's commit) needs those."""
        files = sorted({s.file for s in segments})
        keep: set[str] = set()
        for i in range(0, len(files), FORGET_BATCH):
            named = await self._call(ARCHIVE_NAMED.name, lease, inc, *files[i : i + FORGET_BATCH])
            keep.update(_text(f) for f in named)
        if self.scripts.replica_ack is not None and set(files) - keep:
            # --min-replicas-ack: what freed these files (a commit, retention, a delete) must be
            # on the replicas before the files go, or a failover brings back a record naming
            # them. Replication is in order: a write that waits for the replicas (the lease's
            # renewal) confirms everything before it. NotReplicated: keep them, for now.
            await self._call(ARCHIVE_LEASE.name, lease, int(lease.seconds * 1000))
        for file in files:
            if file not in keep:
                await asyncio.to_thread(self.archive.delete, file)

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
                past_window = int(tail) - self.policy.hot_bytes > int(arch or base or 0)
                if past_window or (self.policy.retention_ms and inc):
                    due[sid] = now
                if inc:
                    indexed.append(keys.segments(sid, _text(inc)))
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
            if isinstance(current, Exception) or current is None or _text(current) != inc:
                out.append(key)
        return out

    async def _remove_if_dead(self, key: str) -> None:
        """Remove a dead incarnation's files, its segment set, then its index entry;
        under the stream's lease (busy: next pass), so no round races it."""
        sid, inc = keys.split_segments_key(key)
        async with self._leased(sid) as lease:
            if lease is None:
                return
            if status_of(await self._fenced(ARCHIVE_CHECK.name, lease, inc)) != "dead":
                return
            members = cast(Members, await self.redis.zrange(key, 0, -1))
            await self._remove(lease, inc, [Segment.parse(m) for m in members])
            if members:
                log.info("removed the archive of %s (%d files)", keys.path_of(sid), len(members))
            if not await self.redis.exists(key):  # dead: nothing writes it again
                await self.redis.srem(keys.ARCHIVE_SEGSETS, key)

    async def drain(self) -> None:
        """Work until no hint is due (tests, ``--once``)."""
        await self.scripts.load()
        await self.announce()
        await self.reconcile(force=True)
        while await self.work_once():
            pass


async def _batches(items: AsyncIterator[Any], size: int = 500) -> AsyncIterator[list[str]]:
    """Key names from a SCAN-style iterator, as text, ``size`` at a time."""
    batch: list[str] = []
    async for item in items:
        batch.append(_text(item))
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def policy_of(settings: Settings) -> Policy:
    return Policy(
        hot_bytes=settings.archive_hot_bytes,
        hot_ms=int(settings.archive_hot_seconds * 1000),
        min_bytes=settings.archive_min_bytes,
        max_delay_ms=int(settings.archive_max_delay * 1000),
        file_bytes=settings.archive_file_bytes,
        retention_ms=int(settings.retention_seconds * 1000),
    )


async def run_worker(settings: Settings, redis_url: str, stop: asyncio.Event) -> None:
    """``durable-streams archive``: work until ``stop`` is set. Redis unreachable at
    start: wait for it (with backoff, one line per try); its key layout not this
    build's: refuse (a ``layout.Mismatch``, one line)."""
    heartbeat = Heartbeat(settings.archive_stall_seconds)
    metrics.publish_build_info()
    if settings.metrics_port:  # first: /healthz answers while Redis is awaited
        health.serve(settings.host, settings.metrics_port, heartbeat)
    # No socket timeout (a command may take long on a large stream), but a bounded connect;
    # a Redis that stops answering stalls the loop, which /healthz then reports.
    client = general(
        redis_url, cluster=settings.redis_cluster, health_check_interval=30, socket_connect_timeout=10
    )
    scripts = connect_scripts(
        redis_url,
        cluster=settings.redis_cluster,
        max_connections=8,  # one stream at a time: a few calls in flight at most
        timeout=60.0,  # an XTRIM of a long log may take a while; a lost Redis shows in /healthz
        replica_ack=replica_ack(settings.min_replicas_ack, settings.min_replicas_ack_timeout),
    )
    archiver = Archiver(
        client,
        Archive(settings.archive_location),
        policy_of(settings),
        interval=settings.archive_interval,
        scripts=scripts,
        reconcile_seconds=settings.archive_reconcile_seconds,
        lease_seconds=settings.archive_lease_seconds,
        heartbeat=heartbeat,
    )
    try:
        if not await Preflight(client, prepare=archiver.scripts.load).wait(stop, heartbeat.beat):
            return  # stopped while waiting
        log.info("archiving to %s as %s", settings.archive_location, archiver.name)
        await archiver.run(stop)
    finally:
        await scripts.aclose()
        await client.aclose()
