"""State compaction over a stream's archived segments (docs/compaction.md), for
``compactor.py``: the archived messages a deep run folds, and a segment's file replaced
by one without the messages the fold dropped.

A replacement is crash-safe the way archiving is (``archive_files.py``): the new file is
recorded as garbage before it is written (lua/archive_replace.lua 'stage': a worker that
dies leaves a file the next lease holder deletes), then takes the range of the segments it
replaces in one step ('commit'); their files are deleted once nothing names them (a gateway
reading one then looks the segment up again: reads.py). Ranges only ever join (small
neighbours of one day go in one file: ``groups``), as the archiver's merges do, so offsets
and every reader's lookup of the segment holding a position stay right.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import cast

import pyarrow as pa
import pyarrow.compute as pc

from gateway.archive.segments import Segment, compacted_name, file_name
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
        self, lease: Lease, inc: str, group: list[Segment], dropped: set[int], fence: tuple[int, int]
    ) -> tuple[Segment, int, int] | None:
        """Write the consecutive segments ``group`` again as one file, without the messages at
        ``dropped``, and put it in their place: the new segment, the messages and bytes it
        dropped; None if the stream moved under the run (``fence``: the fold point and newest
        fork point it read; the run plans again). LeaseLost if the lease went."""
        tables = [await asyncio.to_thread(self.files.archive.read, s.file) for s in group]
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        gone = pc.is_in(table.column("position"), value_set=pa.array(sorted(dropped), pa.int64()))
        kept = table.filter(pc.invert(gone))
        size = sum(len(d) for d in table.filter(gone).column("data").to_pylist())
        count = table.num_rows - kept.num_rows
        start, end, first_ms = group[0].start, group[-1].end, group[0].first_ms
        name = compacted_name(file_name(keys.path_of(lease.sid), inc, start, end, first_ms))
        new = Segment(start, end, first_ms, max(s.last_ms for s in group), name)
        rest = (new.member, *fence, size, count, *(s.member for s in group))
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
        await self.files.remove(lease, inc, group)  # garbage now: deleted, then forgotten
        return new, count, size


Group = tuple[list[Segment], set[int]]  # consecutive segments, and their messages a run drops


def groups(segments: list[Segment], kept: list[int], drops: dict[int, set[int]], target: int) -> list[Group]:
    """The archived part as a deep run leaves it, in order: consecutive segments (``kept``:
    the bytes each keeps; ``drops``: by segment index, the messages it drops) of one UTC day
    whose kept bytes stay under ``target`` together go in one file, so a stream compacted
    down to little keeps few files for deep runs to read. A group of one segment with
    nothing to drop is left as it is (``rewritten``)."""
    out: list[Group] = []
    members: list[int] = []
    total = 0
    for i, segment in enumerate(segments):
        if members:
            previous = segments[members[-1]]
            if previous.date != segment.date or previous.end != segment.start or total + kept[i] > target:
                out.append(_group(segments, members, drops))
                members, total = [], 0
        members.append(i)
        total += kept[i]
    if members:
        out.append(_group(segments, members, drops))
    return out


def rewritten(group: Group) -> bool:
    return len(group[0]) > 1 or bool(group[1])


def _group(segments: list[Segment], members: list[int], drops: dict[int, set[int]]) -> Group:
    return [segments[i] for i in members], {p for i in members for p in drops.get(i, ())}
