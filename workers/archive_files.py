"""The archive's files, for the archive worker (``workers/archiver.py``): a stream's log
read into rows, written as a Parquet segment, staged and committed; files removed.

The order is what makes a crash harmless: a range is *staged* (archive_stage.lua)
before its file is written, so a retry writes the same file; the file is written
durably (fsync + rename, or an object put) before the *commit* (archive_commit.lua)
records it, moves the log's start and trims Redis; a file is deleted before it is
forgotten (archive_forget.lua), and only if ``archive_named.lua`` says no committed or
staged segment of a live incarnation names it. Every script is fenced by the stream's
lease (``archive_lease.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import cast

import pyarrow as pa
import pyarrow.compute as pc

from gateway.archive.files import Archive
from gateway.archive.schema import Row, to_table
from gateway.archive.segments import Segment
from gateway.protocol import offsets
from gateway.protocol.headers import JSON_CONTENT_TYPE, normalize_content_type
from gateway.protocol.models import text
from gateway.redis_io import keys
from gateway.redis_io.connections import Client
from gateway.redis_io.contracts import (
    ARCHIVE_COMMIT,
    ARCHIVE_FORGET,
    ARCHIVE_LEASE,
    ARCHIVE_NAMED,
    ARCHIVE_RETAIN,
    ARCHIVE_STAGE,
    ArchiveCommitted,
    ArchiveRetained,
    status_of,
)
from gateway.redis_io.scripts import Scripts
from gateway.telemetry import metrics

from .archive_lease import Lease, LeaseLost, Leases

PAGE = 1000  # log entries per XRANGE
FORGET_BATCH = 500  # members per archive_forget call (Lua's unpack has a limit)
RETAIN_READS = 100  # files a retention call reads for their sizes (a compacted stream's)

# redis-py types a reply as the union of every form its options allow; with this
# worker's options (no decode_responses) each reply used below is one of these.
Members = list[bytes]
ScoredMembers = list[tuple[bytes, float]]
LogPage = list[tuple[bytes, dict[bytes, bytes]]]


def log_start(meta: dict[str, str]) -> int:
    """Where the stream's Redis log starts: below it, everything is in files."""
    return int(meta.get("arch") or meta["base"])


def is_json(meta: dict[str, str]) -> bool:
    return normalize_content_type(meta.get("ct")) == JSON_CONTENT_TYPE


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


@dataclass
class Job:
    """A segment to write: its range and file name, and its rows."""

    segment: Segment
    rows: list[Row] | None  # None: read them again (redoing a staged file)


class SegmentFiles:
    """Reads a stream's log and moves ranges of it to Parquet files, under its lease;
    removes files nothing names. Counts what it wrote (``archived_bytes``,
    ``files_written``: for logs and benchmarks)."""

    def __init__(
        self, redis: Client, archive: Archive, scripts: Scripts, leases: Leases, row_group_bytes: int
    ) -> None:
        self.redis = redis
        self.archive = archive
        self.scripts = scripts
        self.leases = leases
        self.row_group_bytes = row_group_bytes  # the unit a cold read fetches
        self.archived_bytes = 0
        self.files_written = 0

    async def first(self, lease: Lease, start: int, json: bool) -> Row | None:
        """The log's first entry (the one at ``start``), or None if the log is empty."""
        stream = keys.stream_keys(lease.sid)[1]
        page = cast(LogPage, await self.redis.xrange(stream, min=offsets.entry_id(start), max="+", count=1))
        return _row(*page[0], json) if page else None

    async def rows(self, lease: Lease, start: int, json: bool, end: int | None = None) -> AsyncIterator[Row]:
        """The log's entries from ``start`` (to ``end``, exclusive), read a page at a time."""
        cursor, last = offsets.entry_id(start), "+" if end is None else "(" + offsets.entry_id(end)
        stream = keys.stream_keys(lease.sid)[1]
        while page := cast(LogPage, await self.redis.xrange(stream, min=cursor, max=last, count=PAGE)):
            lease.check()  # a long read: stop early once the lease is gone
            for entry_id, fields in page:
                yield _row(entry_id, fields, json)
            cursor = "(" + text(page[-1][0])

    async def stage(self, lease: Lease, inc: str, segment: Segment) -> str:
        """Record the range and file name before the file is written (archive_stage.lua):
        "ok", or why not ("busy", "moved": plan again from what Redis says now)."""
        # Indexed before the set is first written, so reconciliation finds it once the stream is gone.
        await self.redis.sadd(keys.ARCHIVE_SEGSETS, keys.segments(lease.sid, inc))
        staged = await self.leases.fenced(
            ARCHIVE_STAGE.name,
            lease,
            inc,
            segment.start,
            segment.end,
            segment.first_ms,
            segment.last_ms,
            segment.file,
        )
        return status_of(staged)

    async def write_and_commit(self, lease: Lease, meta: dict[str, str], inc: str, job: Job) -> bool:
        sid, segment = lease.sid, job.segment
        start = log_start(meta)
        rows = job.rows
        if rows is None:
            rows = [row async for row in self.rows(lease, start, is_json(meta), segment.end)]
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
        await asyncio.to_thread(self.archive.write, segment.file, table, self.row_group_bytes)
        result = await self.leases.call(ARCHIVE_COMMIT.name, lease, inc, segment.member)
        status = status_of(result)
        if status == "lost":  # the file may be the new holder's (same name) or already merged away
            lease.lost = True
            await self.delete_unnamed(lease, inc, [segment])
            raise LeaseLost(keys.path_of(sid))
        if status == "committed":  # a retried call whose first reply was lost: done
            return True
        if status != "ok":  # the stream went away meanwhile
            await self.remove(lease, inc, [segment])
            return False
        archived = sum(r.end - r.position for r in rows)
        self.archived_bytes += archived
        self.files_written += 1
        metrics.ARCHIVED_BYTES.inc(archived)
        metrics.ARCHIVE_FILES.inc()
        committed = ArchiveCommitted(*result)
        if text(committed.replaced):
            await self.remove(lease, inc, [Segment.parse(committed.replaced)])
        return True

    async def retain(
        self, lease: Lease, inc: str, cutoff: int, committed: list[Segment], compacted: bool
    ) -> None:
        """Retention: the committed segments archive_retain.lua drops (older than
        ``cutoff``), their files removed. A segment's bytes go back to the stream's tenant:
        its range, or, in a compacted stream of a tenant (whose messages compaction dropped
        are in the range, given back then), what its file holds: those files are read, at
        most RETAIN_READS a call (the rest on the next round)."""
        sizes: list[str] = []
        if compacted and lease.tenant and not self.scripts.cluster:
            due = [s for s in committed if s.last_ms < cutoff]
            if len(due) > RETAIN_READS:  # (the script drops what ends before the cutoff)
                cutoff = min(cutoff, due[RETAIN_READS].last_ms)
            for segment in due[:RETAIN_READS]:
                held = await self._held(segment)
                lease.check()  # (a long read: stop once the lease is gone)
                if held is not None:  # (a missing file: its range, clamped by the script)
                    sizes.append(f"{segment.start} {held}")
        result = await self.leases.fenced(ARCHIVE_RETAIN.name, lease, inc, cutoff, *sizes)
        retained = ArchiveRetained(*result)
        if retained.dropped:
            await self.remove(lease, inc, [Segment.parse(m) for m in retained.dropped])

    async def _held(self, segment: Segment) -> int | None:
        """The bytes a segment's file holds (its messages'), None if it is missing."""
        try:
            table = await asyncio.to_thread(self.archive.read, segment.file, ["data"])
        except FileNotFoundError:
            return None
        return pc.sum(pc.binary_length(table.column("data"))).as_py() or 0

    async def remove(self, lease: Lease, inc: str, segments: list[Segment]) -> None:
        """Delete files, then forget them (in that order: a crash leaves a record, not a stray file)."""
        if not segments:
            return
        await self.delete_unnamed(lease, inc, segments)
        members = [s.member for s in segments]
        for i in range(0, len(members), FORGET_BATCH):
            await self.leases.fenced(ARCHIVE_FORGET.name, lease, inc, *members[i : i + FORGET_BATCH])

    async def delete_unnamed(self, lease: Lease, inc: str, segments: Iterable[Segment]) -> None:
        """Delete the segments' files, but none that a committed or staged segment of a
        live incarnation names: a read (or the lease holder's commit) needs those."""
        files = sorted({s.file for s in segments})
        keep: set[str] = set()
        for i in range(0, len(files), FORGET_BATCH):
            named = await self.leases.call(ARCHIVE_NAMED.name, lease, inc, *files[i : i + FORGET_BATCH])
            keep.update(text(f) for f in named)
        if self.scripts.replica_ack is not None and set(files) - keep:
            # --min-replicas-ack: what freed these files (a commit, retention, a delete) must be
            # on the replicas before the files go, or a failover brings back a record naming
            # them. Replication is in order: a write that waits for the replicas (the lease's
            # renewal) confirms everything before it. NotReplicated: keep them, for now.
            await self.leases.call(ARCHIVE_LEASE.name, lease, int(lease.seconds * 1000))
        for file in files:
            if file not in keep:
                await asyncio.to_thread(self.archive.delete, file)
