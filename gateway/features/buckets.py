"""Buckets (Ursula's API, http/buckets.py): a record per bucket made with ``PUT /{bucket}``
(``keys.BUCKETS``: name -> created, ms), and what the stream index says of its streams.

A bucket is a namespace, not a container: a stream's keys do not name its bucket, and
creating a stream is not one script with the bucket's record (on Redis Cluster they
live in different slots). So a bucket exists when it has a record *or* a live stream
(one made through ``/v1/stream/{bucket}/...`` never needed the record), ``_default``
always; and a bucket's delete checks it is empty, then removes the record: a stream
made in that moment outlives its bucket's record (it still exists, and so does the
bucket, by its stream).
"""

from __future__ import annotations

import time

from ..protocol.buckets import DEFAULT_BUCKET, in_bucket, path_prefix
from ..protocol.listing import Position
from ..protocol.models import text
from ..redis_io import keys
from .listing import Listing, encoded, lex_range


class Buckets:
    def __init__(self, listing: Listing) -> None:
        self.listing = listing
        self.scripts = listing.scripts

    async def create(self, name: str) -> bool:
        """Whether it was made now (False: it had a record already)."""
        now = int(time.time() * 1000)
        return bool(await self.scripts.command(keys.BUCKETS, "HSETNX", keys.BUCKETS, name, now))

    async def created(self, name: str) -> int | None:
        """The record's creation time (ms); None without a record."""
        raw = await self.scripts.command(keys.BUCKETS, "HGET", keys.BUCKETS, name)
        return None if raw is None else int(text(raw))

    async def exists(self, name: str) -> bool:
        return name == DEFAULT_BUCKET or await self.created(name) is not None or not await self.empty(name)

    async def empty(self, name: str) -> bool:
        """No live stream in the bucket (the listing's walk: dead index entries pass)."""
        position: Position | None = Position(0)
        while position is not None:
            page = await self.listing.page(
                [path_prefix(name)], position, 1, lambda path: in_bucket(name, path)
            )
            if page.streams:
                return False
            position = page.next
        return True

    async def delete(self, name: str) -> bool:
        """Remove the record (the caller checked the bucket is empty); whether there was one."""
        return bool(await self.scripts.command(keys.BUCKETS, "HDEL", keys.BUCKETS, name))

    async def count(self, name: str) -> int:
        """About how many streams the bucket holds: its index entries (one ZLEXCOUNT per
        index part; entries of streams that expired since the last sweep count too).
        ``_default`` (no prefix range: paths without '/') counts its live streams."""
        if name == DEFAULT_BUCKET:
            return await self._count_default()
        bounds = lex_range(encoded(path_prefix(name)), None)
        assert bounds is not None
        indexes = [self.listing.index(part) for part in range(self.listing.parts)]
        replies = await self.scripts.command_each([(i, ["ZLEXCOUNT", i, *bounds]) for i in indexes])
        total = 0
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
            total += int(reply)
        return total

    async def _count_default(self) -> int:
        total, position = 0, Position(0)
        while True:
            page = await self.listing.page([""], position, 1000, lambda path: in_bucket(DEFAULT_BUCKET, path))
            total += len(page.streams)
            if page.next is None:
                return total
            position = page.next
