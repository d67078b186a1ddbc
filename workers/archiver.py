"""The archive worker: moves each stream's older entries from Redis to Parquet.

Per stream, under a lease (a redis-py Lock, so one worker at a time; a
crashed worker's lease expires and another takes over):

1. plan a range past the hot window, aligned to entries, within one UTC day,
   merged with the stream's last file while that is small;
2. *stage* it (archive_stage.lua): the range and file name are recorded
   before the file is written, so a retry after a crash writes the same file;
3. write the file (durably: fsync + rename, or an object put);
4. *commit* (archive_commit.lua): record the segment, move the log's start,
   trim the Redis Stream, all in one script;
5. delete a file the new one replaced, then forget it (archive_forget.lua).

A crash between any two steps leaves either a staged range (redone with the
same name: overwritten, not duplicated) or a garbage entry (deleted next
time): the archive plus Redis hold every byte once.

Work is found through hints (``gateway/hints.py``) and a periodic
reconciliation (one worker at a time) that also removes the files of deleted
and expired streams.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from redis.asyncio import Redis

from gateway import keys, metrics, offsets
from gateway.archive import Archive, Row, to_table
from gateway.config import Settings
from gateway.scripts import Scripts
from gateway.segments import GARBAGE, PENDING, Segment, file_name, utc_date

log = logging.getLogger("durable_streams.archive")
PAGE = 1000  # log entries per XRANGE


def now_ms() -> int:
    return int(time.time() * 1000)


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


def _row(entry_id: bytes, fields: dict[bytes, bytes]) -> Row:
    producer = None
    if b"p" in fields:
        epoch, seq, pid = fields[b"p"].decode().split(" ", 2)
        producer = (pid, int(epoch), int(seq))
    return Row(int(entry_id.split(b"-")[0]), fields[b"d"], int(fields[b"t"]), producer)


@dataclass
class _Job:
    segment: Segment
    rows: list[Row] | None  # None: read them again (redoing a staged file)


class Archiver:
    def __init__(
        self,
        redis: Redis,
        archive: Archive,
        policy: Policy,
        *,
        interval: float = 1.0,
        reconcile_seconds: float = 60.0,
        lease_seconds: float = 30.0,
        name: str | None = None,
    ) -> None:
        self.redis = redis
        self.archive = archive
        self.policy = policy
        self.scripts = Scripts(redis)
        self.interval = interval
        self.reconcile_seconds = reconcile_seconds
        self.lease_seconds = lease_seconds
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.archived_bytes = 0  # totals, for logs and benchmarks
        self.files_written = 0

    async def _call(self, script: str, sid: str, *args: Any) -> Any:
        return await self.scripts.call(script, keys.stream_keys(sid), list(args))

    # -- the loop -----------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        await self.scripts.load()
        next_reconcile = 0.0
        while not stop.is_set():
            try:
                if time.monotonic() >= next_reconcile:
                    next_reconcile = time.monotonic() + self.reconcile_seconds
                    await self.reconcile()
                busy = await self.work_once()
            except Exception:
                log.exception("archive pass failed; retrying")
                busy = 0
            if not busy:
                try:
                    await asyncio.wait_for(stop.wait(), self.interval)
                except TimeoutError:
                    pass

    async def work_once(self, limit: int = 64) -> int:
        """Archive the streams whose hints are due; returns how many were taken."""
        now = now_ms()
        due = await self.redis.zrangebyscore(keys.ARCHIVE_HINTS, "-inf", now, start=0, num=limit)
        await self._report_backlog(now)
        taken = 0
        for raw in due:
            if await self.redis.zrem(keys.ARCHIVE_HINTS, raw) != 1:
                continue  # another worker took it
            taken += 1
            sid = _text(raw)
            try:
                await self.archive_stream(sid)
            except Exception:
                log.exception("archiving %s failed; will retry", keys.path_of(sid))
                await self.hint(sid, now_ms() + 5000)
        return taken

    async def _report_backlog(self, now: int) -> None:
        oldest = await self.redis.zrange(keys.ARCHIVE_HINTS, 0, 0, withscores=True)
        waited = max(0.0, (now - oldest[0][1]) / 1000) if oldest else 0.0
        metrics.ARCHIVE_LAG.labels(self.name).set(waited)
        metrics.ARCHIVE_DUE.labels(self.name).set(await self.redis.zcount(keys.ARCHIVE_HINTS, "-inf", now))

    async def hint(self, sid: str, when_ms: int) -> None:
        await self.redis.zadd(keys.ARCHIVE_HINTS, {sid: when_ms}, lt=True)

    # -- one stream ---------------------------------------------------------

    async def archive_stream(self, sid: str) -> None:
        """Archive what the policy allows of one stream, under its lease."""
        lease = self.redis.lock(keys.lease(sid), timeout=self.lease_seconds, blocking=False)
        if not await lease.acquire():
            await self.hint(sid, now_ms() + 1000)  # someone else is on it; look again soon
            return
        try:
            for _ in range(10_000):  # each round moves the log's start, or ends
                if not await self._round(sid):
                    return
                await lease.reacquire()
        finally:
            try:
                await lease.release()
            except Exception:  # expired meanwhile: nothing to release
                pass

    async def _round(self, sid: str) -> bool:
        """One step of work on a stream; False when there is nothing more to do now."""
        raw = await self.redis.hgetall(keys.stream_keys(sid)[0])
        if not raw:
            return False
        meta = {_text(k): _text(v) for k, v in raw.items()}
        inc = meta.get("inc") or uuid.uuid4().hex[:16]
        members = await self.redis.zrange(keys.segments(sid, inc), 0, -1, withscores=True)
        garbage = [Segment.parse(m) for m, score in members if score == GARBAGE]
        pending = [Segment.parse(m) for m, score in members if score == PENDING]
        committed = [Segment.parse(m) for m, score in members if score >= 0]
        if garbage:
            await self._remove(sid, inc, garbage)
        if pending:
            return await self._write_and_commit(sid, meta, inc, _Job(pending[0], None))
        if self.policy.retention_ms and committed:
            dropped = await self._call("archive_retain", sid, inc, now_ms() - self.policy.retention_ms)
            if dropped:
                await self._remove(sid, inc, [Segment.parse(m) for m in dropped])
        job = await self._plan(sid, meta, inc, committed[-1] if committed else None)
        if job is None:
            return False
        staged = await self._call(
            "archive_stage",
            sid,
            inc,
            job.segment.start,
            job.segment.end,
            job.segment.first_ms,
            job.segment.last_ms,
            job.segment.file,
        )
        status = _text(staged[0])
        if status == "ok":
            return await self._write_and_commit(sid, meta, inc, job)
        return status in ("busy", "moved")  # plan again from what Redis says now

    async def _plan(self, sid: str, meta: dict[str, str], inc: str, last: Segment | None) -> _Job | None:
        """The next range to archive, or None (nothing due; re-hinted for later)."""
        policy, now = self.policy, now_ms()
        start = _log_start(meta)
        limit = int(meta["tail"]) - policy.hot_bytes
        if limit <= start:
            return None
        young = now - policy.hot_ms
        merge = last if last is not None and last.end == start and last.size < policy.file_bytes else None
        rows: list[Row] = []
        size = 0
        day = ""
        async for row in self._log(sid, start):
            if row.position + len(row.data) > limit:
                break
            if row.append_ms > young:  # past the byte window, not yet old enough: look again then
                await self.hint(sid, row.append_ms + policy.hot_ms + 1)
                break
            if not rows:
                day = utc_date(row.append_ms)
                if merge is not None and merge.date != day:
                    merge = None
            room = policy.file_bytes - (merge.size if merge else 0)
            if utc_date(row.append_ms) != day or (rows and size + len(row.data) > room):
                break
            rows.append(row)
            size += len(row.data)
        if not rows:
            return None
        closed = meta.get("closed") == "1" or meta.get("deleted") == "1"
        if size < policy.min_bytes and rows[0].append_ms > now - policy.max_delay_ms and not closed:
            await self.hint(sid, min(rows[0].append_ms + policy.max_delay_ms, now + 60_000))
            return None
        first = merge.start if merge else start
        first_ms = merge.first_ms if merge else rows[0].append_ms
        end = rows[-1].position + len(rows[-1].data)
        name = file_name(keys.path_of(sid), inc, first, end, first_ms)
        return _Job(Segment(first, end, first_ms, rows[-1].append_ms, name), rows)

    async def _write_and_commit(self, sid: str, meta: dict[str, str], inc: str, job: _Job) -> bool:
        segment = job.segment
        start = _log_start(meta)
        rows = job.rows if job.rows is not None else [row async for row in self._log(sid, start, segment.end)]
        parts: list[pa.Table] = []
        if segment.start < start:  # merging: the last file's rows come first
            replaced = await self.redis.zrangebyscore(
                keys.segments(sid, inc), segment.start, segment.start, start=0, num=1
            )
            old = Segment.parse(replaced[0])
            parts.append(await asyncio.to_thread(self.archive.read, old.file))
        parts.append(to_table(keys.path_of(sid), inc, meta["ct"], rows))
        table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
        await asyncio.to_thread(self.archive.write, segment.file, table, self.policy.row_group_bytes)
        result = await self._call("archive_commit", sid, inc, segment.member)
        if _text(result[0]) != "ok":  # the stream went away meanwhile
            await asyncio.to_thread(self.archive.delete, segment.file)
            await self._call("archive_forget", sid, inc, segment.member)
            return False
        archived = sum(len(r.data) for r in rows)
        self.archived_bytes += archived
        self.files_written += 1
        metrics.ARCHIVED_BYTES.labels(self.name).inc(archived)
        metrics.ARCHIVE_FILES.labels(self.name).inc()
        if _text(result[1]):
            await self._remove(sid, inc, [Segment.parse(result[1])])
        return True

    async def _log(self, sid: str, start: int, end: int | None = None) -> AsyncIterator[Row]:
        """The log's entries from ``start`` (to ``end``, exclusive), read a page at a time."""
        cursor, last = offsets.entry_id(start), "+" if end is None else "(" + offsets.entry_id(end)
        while page := await self.redis.xrange(keys.stream_keys(sid)[1], min=cursor, max=last, count=PAGE):
            for entry_id, fields in page:
                yield _row(entry_id, fields)
            cursor = "(" + _text(page[-1][0])

    async def _remove(self, sid: str, inc: str, segments: list[Segment]) -> None:
        """Delete files, then forget them (in that order: a crash leaves a record, not a stray file)."""
        if not segments:
            return
        for segment in segments:
            await asyncio.to_thread(self.archive.delete, segment.file)
        await self._call("archive_forget", sid, inc, *[s.member for s in segments])

    # -- reconciliation -----------------------------------------------------

    async def reconcile(self, force: bool = False) -> bool:
        """Hint streams with unarchived data (hints can be lost) and remove the
        archives of streams that are gone. One worker per interval does it."""
        ttl = max(int(self.reconcile_seconds * 1000) - 500, 1)
        if not force and not await self.redis.set(keys.ARCHIVE_RECONCILE, self.name, nx=True, px=ttl):
            return False
        now = now_ms()
        batch: list[str] = []
        async for key in self.redis.scan_iter(match=keys.META_PATTERN, count=1000):
            batch.append(_text(key))
            if len(batch) >= 500:
                await self._hint_unarchived(batch, now)
                batch = []
        if batch:
            await self._hint_unarchived(batch, now)
        async for key in self.redis.scan_iter(match=keys.SEGMENTS_PATTERN, count=1000):
            sid, inc = keys.split_segments_key(_text(key))
            if _text((await self._call("archive_check", sid, inc))[0]) == "dead":
                members = await self.redis.zrange(_text(key), 0, -1)
                await self._remove(sid, inc, [Segment.parse(m) for m in members])
                log.info("removed the archive of %s (%d files)", keys.path_of(sid), len(members))
        return True

    async def _hint_unarchived(self, meta_keys: list[str], now: int) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in meta_keys:
                pipe.hmget(key, "tail", "arch", "base", "inc")
            states = await pipe.execute()
        due = {}
        for key, (tail, arch, base, inc) in zip(meta_keys, states, strict=True):
            if tail is None:
                continue
            past_window = int(tail) - self.policy.hot_bytes > int(arch or base or 0)
            if past_window or (self.policy.retention_ms and inc):
                due[keys.key_stream_id(key)] = now
        if due:
            await self.redis.zadd(keys.ARCHIVE_HINTS, due, nx=True)

    async def drain(self) -> None:
        """Work until no hint is due (tests, ``--once``)."""
        await self.scripts.load()
        await self.reconcile(force=True)
        while await self.work_once():
            pass


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
    """``durable-streams archive``: work until ``stop`` is set."""
    client = Redis.from_url(redis_url, decode_responses=False, health_check_interval=30)
    archiver = Archiver(
        client,
        Archive(settings.archive_location),
        policy_of(settings),
        interval=settings.archive_interval,
        reconcile_seconds=settings.archive_reconcile_seconds,
        lease_seconds=settings.archive_lease_seconds,
    )
    log.info("archiving to %s as %s", settings.archive_location, archiver.name)
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port, addr=settings.host)
    try:
        await archiver.run(stop)
    finally:
        await client.aclose()
