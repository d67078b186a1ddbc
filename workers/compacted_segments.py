"""State compaction over a stream's archived segments (docs/compaction.md), for
``compactor.py``: the archived messages a deep run folds, and a segment's file replaced
by one without the messages the fold dropped.

A replacement is crash-safe the way archiving is (``archive_files.py``): the new file is
recorded as garbage before it is written (lua/archive_replace.lua 'stage': a worker that
dies leaves a file the next lease holder deletes), then takes the segment's range in one
step ('commit'); the old file is deleted once nothing names it (a gateway reading it then
looks the segment up again: reads.py). The range never changes, so offsets, the segment
list's order and every other worker's view of it stay as they were.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import cast

import pyarrow as pa
import pyarrow.compute as pc

from gateway.archive.segments import Segment, compacted_name
from gateway.protocol.compaction import Message
from gateway.redis_io import keys
from gateway.redis_io.contracts import ARCHIVE_REPLACE, status_of

from .archive_files import ScoredMembers, SegmentFiles
from .archive_lease import Lease, LeaseLost


class ArchivedPart:
    """The archived segments of one stream a deep run folds and rewrites, under its lease.
    A deep run reads the whole archived part, so it is paced as Kafka's log cleaner is by
    min.cleanable.dirty.ratio (``CompactionPolicy.dirty_ratio``, --compaction-archive-ratio):
    once what was folded since the last one reaches that share of what that one kept."""

    def __init__(self, files: SegmentFiles) -> None:
        self.files = files

    async def segments(self, lease: Lease, inc: str, start: int, arch: int) -> list[Segment]:
        """The committed segments holding positions in [start, arch), in order."""
        members = cast(
            ScoredMembers,
            await self.files.redis.zrange(keys.segments(lease.sid, inc), 0, -1, withscores=True),
        )
        found = [Segment.parse(member) for member, score in members if score >= 0]
        return sorted((s for s in found if s.end > start and s.start < arch), key=lambda s: s.start)

    async def messages(
        self, lease: Lease, segments: list[Segment], start: int
    ) -> AsyncIterator[list[Message]]:
        """Each segment's messages from ``start`` on (a file holds one a row, in order)."""
        for segment in segments:
            table = await asyncio.to_thread(self.files.archive.read, segment.file, ["position", "data"])
            lease.check()  # a long read: stop early once the lease is gone
            positions = table.column("position").to_pylist()
            data = table.column("data").to_pylist()
            yield [(p, d) for p, d in zip(positions, data, strict=True) if p >= start]

    async def replace(
        self, lease: Lease, inc: str, segment: Segment, dropped: set[int], fence: tuple[int, int]
    ) -> tuple[Segment, int, int] | None:
        """Write ``segment`` again without the messages at ``dropped`` and put it in the old
        one's place: the new segment, the messages and bytes it dropped; None if the stream moved under the
        run (``fence``: the fold point and newest fork point it read; the run plans again).
        LeaseLost if the lease went."""
        table = await asyncio.to_thread(self.files.archive.read, segment.file)
        gone = pc.is_in(table.column("position"), value_set=pa.array(sorted(dropped), pa.int64()))
        kept = table.filter(pc.invert(gone))
        size = sum(len(d) for d in table.filter(gone).column("data").to_pylist())
        count = table.num_rows - kept.num_rows
        new = dataclasses.replace(segment, file=compacted_name(segment.file))
        rest = (segment.member, new.member, *fence, size, count)
        staged = await self.files.leases.fenced(ARCHIVE_REPLACE.name, lease, inc, "stage", *rest)
        if status_of(staged) != "ok":
            return None
        lease.check()  # a pause may have outlasted the lease: then the new holder deletes the file
        await asyncio.to_thread(self.files.archive.write, new.file, kept, self.files.row_group_bytes)
        result = await self.files.leases.call(ARCHIVE_REPLACE.name, lease, inc, "commit", *rest)
        status = status_of(result)
        if status == "lost":
            lease.lost = True
            await self.files.delete_unnamed(lease, inc, [new])
            raise LeaseLost(keys.path_of(lease.sid))
        if status != "ok":
            await self.files.remove(lease, inc, [new])
            return None
        await self.files.remove(lease, inc, [segment])  # garbage now: deleted, then forgotten
        return new, count, size
