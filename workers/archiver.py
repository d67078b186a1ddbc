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

``Archiver`` is the loop and the rule (``_plan``); the rest is in its parts, each in a
module of its own: the leases and fencing (``archive_lease.py``, ``Leases``), finding
work (``archive_scan.py``, ``Finder``: the hints, their backlog metrics, the
reconciliation) and the files (``archive_files.py``, ``SegmentFiles``: the log read,
the Parquet segment written, staged, committed; files removed).

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
import socket
import time
import uuid
from dataclasses import dataclass
from typing import cast

from gateway.archive.files import Archive
from gateway.archive.schema import Row
from gateway.archive.segments import GARBAGE, PENDING, Segment, file_name, utc_date
from gateway.concurrency import backoff
from gateway.concurrency.cancelling import raise_if_cancelled
from gateway.config import Settings
from gateway.protocol import offsets
from gateway.protocol.models import text
from gateway.redis_io import keys
from gateway.redis_io.connections import Client, general
from gateway.redis_io.fleet import Membership
from gateway.redis_io.preflight import Preflight, reason
from gateway.redis_io.scripts import Scripts, connect_scripts, replica_ack
from gateway.telemetry import metrics
from gateway.telemetry.logs import RateLimited

from . import health
from .archive_files import Job, LogPage, ScoredMembers, SegmentFiles, is_json, log_start
from .archive_lease import Lease, LeaseLost, Leases
from .archive_scan import Finder, unavailable
from .clock import now_ms
from .compactor import CompactionPolicy, Compactor
from .health import Heartbeat
from .meter import Meter

log = logging.getLogger("durable_streams.archive")
limited = RateLimited(log)
ALIVE_MS = 60_000  # how long one announcement keeps gateways sending hints


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


@dataclass
class _Take:
    """One hold of a stream's lease: the rounds it runs share this."""

    compacted: bool = False  # its compaction run happened (one a take, then archiving)


class Archiver:
    """The worker's loop (announce, reconcile now and then, archive what is due) and one
    stream's rounds, around its parts: ``leases``, ``finder`` and ``files``."""

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
        compaction: CompactionPolicy | None = None,
    ) -> None:
        self.redis = redis
        self.archive = archive
        self.policy = policy
        self.scripts = scripts or Scripts(redis)  # on a cluster: connect_scripts' (routed)
        self.interval = interval
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.heartbeat = heartbeat or Heartbeat()
        self.leases = Leases(redis, self.scripts, self.name, lease_seconds, self.heartbeat)
        self.files = SegmentFiles(redis, archive, self.scripts, self.leases, policy.row_group_bytes)
        self.compactor = Compactor(
            redis, self.leases, compaction or CompactionPolicy(), self.files, policy.min_bytes
        )
        self.finder = Finder(
            redis,
            self.leases,
            self.files,
            name=self.name,
            hot_bytes=policy.hot_bytes,
            retention_ms=policy.retention_ms,
            reconcile_seconds=reconcile_seconds,
            heartbeat=self.heartbeat,
        )

    # The parts' settings and totals, as attributes of the worker (tests shorten a live
    # worker's lease; logs and benchmarks read the totals).

    @property
    def lease_seconds(self) -> float:
        return self.leases.seconds

    @lease_seconds.setter
    def lease_seconds(self, seconds: float) -> None:
        self.leases.seconds = seconds

    @property
    def archived_bytes(self) -> int:
        return self.files.archived_bytes

    @property
    def files_written(self) -> int:
        return self.files.files_written

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
                    next_reconcile = time.monotonic() + self.finder.reconcile_seconds
                    await self.reconcile()
                busy = await self.work_once()
                failures = 0
            except Exception as exc:
                raise_if_cancelled()  # stopping, the CancelledError lost in a library
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
        were taken."""
        taken = 0
        async with contextlib.aclosing(self.finder.take_due(limit)) as due:
            async for sid in due:
                taken += 1
                await self._take(sid)
        return taken

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

    async def hint(self, sid: str, when_ms: int) -> None:
        await self.finder.hint(sid, when_ms)

    async def reconcile(self, force: bool = False) -> bool:
        """Hint streams with unarchived data (hints can be lost) and remove the
        archives of streams that are gone. One worker per interval does it."""
        return await self.finder.reconcile(force)

    async def drain(self) -> None:
        """Work until no hint is due (tests, ``--once``)."""
        await self.scripts.load()
        await self.announce()
        await self.reconcile(force=True)
        while await self.work_once():
            pass

    # -- one stream ---------------------------------------------------------

    async def archive_stream(self, sid: str) -> None:
        """Archive what the policy allows of one stream, under its lease."""
        async with self.leases.held(sid) as lease:
            if lease is None:
                await self.hint(sid, now_ms() + 1000)  # someone else is on it; look again soon
                return
            try:
                take = _Take()
                for _ in range(10_000):  # each round moves the log's start, or ends
                    lease.check()
                    if not await self._round(lease, take):
                        return
                    self.heartbeat.beat()
            except LeaseLost:
                log.warning("lost the lease of %s during a round; stopped it", keys.path_of(sid))
                await self.hint(sid, now_ms() + 1000)

    async def _round(self, lease: Lease, take: _Take) -> bool:
        """One step of work on a stream; False when there is nothing more to do now.
        A compacted stream's compaction runs first, once a ``take`` of the stream (after a
        segment a lost worker left pending: that range is not Redis' to change then)."""
        sid = lease.sid
        meta = await self._meta(sid)
        if meta is None:
            return False
        lease.tenant = meta.get("tn", "")  # (what retention and compaction free goes back to it)
        inc = meta.get("inc") or uuid.uuid4().hex[:16]
        members = cast(
            ScoredMembers, await self.redis.zrange(keys.segments(sid, inc), 0, -1, withscores=True)
        )
        garbage = [Segment.parse(m) for m, score in members if score == GARBAGE]
        pending = [Segment.parse(m) for m, score in members if score == PENDING]
        committed = [Segment.parse(m) for m, score in members if score >= 0]
        if garbage:
            await self.files.remove(lease, inc, garbage)
        if pending:
            return await self.files.write_and_commit(lease, meta, inc, Job(pending[0], None))
        if self.policy.retention_ms and committed:
            await self.files.retain(
                lease, inc, now_ms() - self.policy.retention_ms, committed, bool(meta.get("cmp"))
            )
        if meta.get("cmp") and not take.compacted:  # compaction first: what is archived was folded
            take.compacted = True
            outcome = await self.compactor.run(lease, meta)
            if outcome.again_ms:
                await self.hint(sid, outcome.again_ms)
            if outcome.moved or outcome.dropped:
                meta = await self._meta(sid)  # archive from what Redis says now
                if meta is None:
                    return False
        job = await self._plan(lease, meta, inc, committed[-1] if committed else None)
        if job is None:
            return False
        status = await self.files.stage(lease, inc, job.segment)
        if status == "ok":
            return await self.files.write_and_commit(lease, meta, inc, job)
        return status in ("busy", "moved")  # plan again from what Redis says now

    async def _meta(self, sid: str) -> dict[str, str] | None:
        raw = await self.redis.hgetall(keys.stream_keys(sid)[0])
        return {text(k): text(v) for k, v in raw.items()} if raw else None

    async def _plan(self, lease: Lease, meta: dict[str, str], inc: str, last: Segment | None) -> Job | None:
        """The next range to archive, or None (nothing due; re-hinted for later).

        Entries are *movable* once past the hot window (older than ``hot_ms`` and
        more than ``hot_bytes`` behind the tail). A stream is due when its movable
        entries reach ``min_bytes``, when ``max_delay_ms`` has passed since its
        first entry became movable, or when it is closed or deleted; a due round
        takes every movable entry (up to a file and within one UTC day)."""
        sid, policy, now = lease.sid, self.policy, now_ms()
        start = log_start(meta)
        limit = int(meta["tail"]) - policy.hot_bytes
        if meta.get("cmp"):
            limit = min(limit, int(meta.get("cto") or 0))  # a compacted stream's: folded first
        if limit <= start:
            return None
        head = await self.files.first(lease, start, is_json(meta))
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
        async for row in self.files.rows(lease, start, is_json(meta)):
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
        return Job(Segment(first, end, first_ms, rows[-1].append_ms, name), rows)

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
        compaction=CompactionPolicy.of(settings),
    )
    try:
        member = Membership(client, "archive")
        archiver.compactor.writing = lambda: member.writing  # compaction waits for layout v4
        preflight = Preflight(client, prepare=archiver.scripts.load, member=member)
        if not await preflight.wait(stop, heartbeat.beat):
            return  # stopped while waiting
        log.info("archiving to %s as %s", settings.archive_location, archiver.name)
        # --tenants: the usage meter's closed hours go to the archive too (workers/meter.py).
        meter = asyncio.create_task(Meter(client, archiver.archive).run(stop)) if settings.tenants else None
        try:
            async with member.kept(stop):
                await archiver.run(stop)
        finally:
            if meter is not None:
                stop.set()  # (archiver.run set it too, unless it never started)
                await asyncio.wait_for(meter, 30)
    finally:
        await scripts.aclose()
        await client.aclose()
