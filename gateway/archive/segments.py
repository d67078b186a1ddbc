"""Archive segments as plain values: their Redis record, their file name, and
how a read takes entries from one. No Redis, no files: see ``files.py`` and
``cold.py``.

A segment is one Parquet file holding a stream's entries for positions
``[start, end)``, all appended on one UTC day. Redis keeps each incarnation's
segments in a sorted set (``lua/_prelude.lua``): score = start position,
member = ``"<start> <end> <first ms> <last ms> <file>"``. Score -1 marks a file
being written, -2 a replaced or dropped file still to delete.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
import zlib
from dataclasses import dataclass

from ..protocol.models import Entry

BUCKETS = 16  # hash buckets per date partition; part of the layout, so fixed
PENDING, GARBAGE = -1, -2


@dataclass(frozen=True)
class Segment:
    start: int
    end: int
    first_ms: int
    last_ms: int
    file: str  # relative to the archive root

    @classmethod
    def parse(cls, member: bytes | str) -> Segment:
        text = member.decode() if isinstance(member, bytes) else member
        start, end, first_ms, last_ms, file = text.split(" ", 4)
        return cls(int(start), int(end), int(first_ms), int(last_ms), file)

    @property
    def member(self) -> str:
        return f"{self.start} {self.end} {self.first_ms} {self.last_ms} {self.file}"

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def date(self) -> str:
        return utc_date(self.first_ms)


def utc_date(ms: int) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(ms / 1000))


def bucket_of(stream: str) -> int:
    """The bucket a stream's files go to (CRC-32 of its path): Spark can prune on it."""
    return zlib.crc32(stream.encode()) % BUCKETS


def file_name(stream: str, incarnation: str, start: int, end: int, first_ms: int) -> str:
    """Where a segment's file lives: Hive-style partitions, then a name that is
    the same for the same stream, incarnation and range (so a retry overwrites
    it). The path of a stream can be long and hold any character, so the name
    carries a digest of it; the rows carry the path itself."""
    digest = hashlib.sha256(stream.encode()).hexdigest()[:16]
    return (
        f"date={utc_date(first_ms)}/bucket={bucket_of(stream):02d}/"
        f"{digest}-{incarnation}-{start:016d}-{end:016d}.parquet"
    )


def compacted_name(file: str) -> str:
    """The name of a file replacing ``file`` (the same range, State compaction's kept rows):
    a new one each time (a reader may still hold the old), in the same partition."""
    stem = re.sub(r"-c[0-9a-f]{12}$", "", file.removesuffix(".parquet"))  # (a replacement's)
    return f"{stem}-c{uuid.uuid4().hex[:12]}.parquet"


def take(
    window: list[Entry], start: int, hi: int | None, budget: int, whole: bool, max_entries: int
) -> list[Entry]:
    """The entries a read from ``start`` gets, out of ``window`` (consecutive
    entries, the first one holding ``start`` or following it).

    The same rules as ``collect`` in ``lua/_prelude.lua``, so cold and hot
    reads answer alike: at most ``budget`` bytes and ``max_entries`` pieces,
    nothing at or past ``hi``; byte entries are cut to fit (an offset may fall
    inside one); JSON messages (``whole``) are never cut: one starting before
    ``start`` is skipped and the last may overrun the budget.
    """
    out: list[Entry] = []
    total = 0
    if budget <= 0 or (hi is not None and start >= hi):
        return out
    for pos, data in window:
        if pos < start:
            if pos + len(data) <= start or whole:
                continue
            data, pos = data[start - pos :], start
        if hi is not None:
            if pos >= hi:
                break
            data = data[: hi - pos]
        if not whole and total + len(data) > budget:
            data = data[: budget - total]
        out.append((pos, data))
        total += len(data)
        if total >= budget or len(out) >= max_entries:
            break
    return out
