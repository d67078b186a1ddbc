"""Forks: pinning a source, planning what a fork inherits, and releasing a
source when a fork is gone.

Creating a fork touches two streams in steps of one stream each (pin the
source with fork_ref.lua, then create the fork with create.lua, by the Store);
deleting one releases its sources up the chain (release_fork.lua), one call
per ancestor. The comments at each step say why an interruption between steps
is harmless.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from ..protocol import offsets
from ..protocol.errors import ProtocolError, bad_request
from ..protocol.headers import Expiry, normalize_content_type, parse_expires_at
from ..protocol.models import CreateSpec, InheritedRange, Meta, text
from . import keys
from .limits import MAX_FORK_DEPTH, MAX_FORK_SUB_MESSAGES, MAX_SCRIPT_ENTRIES
from .reads import Reads
from .scripts import Scripts


@dataclass(frozen=True)
class ForkPlan:
    """What create.lua records for a fork."""

    source: Meta
    given_offset: str  # Stream-Fork-Offset as the client gave it, encoded ('' none)
    fork_offset: str  # the offset the fork starts from in its source
    base: int  # the fork point: where the fork's own log starts
    chain: list[InheritedRange]
    expiry: Expiry


class Forks:
    def __init__(self, redis: Redis, scripts: Scripts, reads: Reads, max_chunk_bytes: int) -> None:
        self.redis = redis
        self.scripts = scripts
        self.reads = reads
        self.max_chunk_bytes = max_chunk_bytes

    async def pin(self, sid: str, src: str) -> Meta:
        """Step 1: record ``sid`` as a fork of ``src``; the source's meta. The fork
        is recorded in a set, so a retry counts once; if we stop before the fork
        is created the extra reference only delays the source's collection (see
        ``release_unless_forked``)."""
        result = await self.scripts.on_stream("fork_ref", src, sid)
        status = text(result[0])
        if status == "missing":
            raise ProtocolError(404, "fork source stream not found")
        if status == "gone":
            raise ProtocolError(409, "fork source stream was deleted")
        return Meta.parse(src, result[1])

    async def plan(self, spec: CreateSpec, source: Meta) -> ForkPlan:
        """Step 2: check the request against the pinned source and work out what the fork inherits."""
        if spec.content_type is not None and normalize_content_type(spec.content_type) != source.media_type:
            raise ProtocolError(409, "fork content type differs from its source's")
        anchor = source.tail if spec.fork_offset is None else offsets.decode(spec.fork_offset)
        if anchor > source.tail:
            raise bad_request("Stream-Fork-Offset is beyond the source stream's tail")
        point = anchor
        if spec.fork_sub_offset:
            point = await self._resolve_sub_offset(source, anchor, spec.fork_sub_offset)
        # The fork reads [0, point) from its ancestors: the source's own chain
        # cut at the fork point, then the source's own log up to it.
        own: InheritedRange = (source.sid, source.base, point)
        chain = [(s, lo, min(hi, point)) for s, lo, hi in (*source.chain, own) if lo < min(hi, point)]
        if len(chain) > MAX_FORK_DEPTH:  # a read walks the chain one round trip per ancestor
            raise bad_request(f"a fork may read through at most {MAX_FORK_DEPTH} ancestors")
        expiry = spec.expiry
        if expiry == Expiry():  # nothing asked: inherit the source's lifetime
            expiry = Expiry(
                ttl_seconds=source.ttl,
                expires_at=source.expires_at,
                expires_at_ms=None if source.expires_at is None else parse_expires_at(source.expires_at),
            )
        return ForkPlan(
            source=source,
            given_offset="" if spec.fork_offset is None else offsets.encode(anchor),
            fork_offset=offsets.encode(anchor),
            base=point,
            chain=chain,
            expiry=expiry,
        )

    async def _resolve_sub_offset(self, source: Meta, anchor: int, sub: int) -> int:
        """The fork point ``sub`` bytes (or JSON messages) past ``anchor``.

        Bytes may not run past the end of the append that holds the anchor;
        JSON messages may not run past the source's tail.
        """
        segments = (*source.chain, (source.sid, source.base, source.tail))
        if source.is_json:  # counted a page of bounded reads at a time, up to a bound
            if sub > MAX_FORK_SUB_MESSAGES:
                raise bad_request(f"Stream-Fork-Sub-Offset counts at most {MAX_FORK_SUB_MESSAGES} messages")
            pos, left = anchor, sub
            while left:
                page = await self.reads.read_segments(
                    segments, pos, self.max_chunk_bytes, True, min(left, MAX_SCRIPT_ENTRIES)
                )
                if not page or page[0][0] != pos:
                    raise bad_request("Stream-Fork-Sub-Offset overshoots the source's messages")
                pos, left = page[-1][0] + len(page[-1][1]), left - len(page)
            return pos
        # One entry, the append holding the anchor, read no further than ``sub`` bytes.
        entries = await self.reads.read_segments(segments, anchor, sub, False, 1)
        if not entries or len(entries[0][1]) < sub:
            raise bad_request("Stream-Fork-Sub-Offset overshoots the data at the fork offset")
        return anchor + sub

    async def release_unless_forked(self, sid: str, src: str) -> None:
        """Drop a reference taken for a fork that did not come to be."""
        owner = await self.redis.hget(keys.stream_keys(sid)[0], "src")
        if owner is None or text(owner) != src:
            await self.release(sid, src)

    async def release(self, child: str, src: str) -> None:
        """Release ``child``'s hold on ``src``, collecting up the chain."""
        while src:
            result = await self.scripts.on_stream("release_fork", src, child)
            if text(result[0]) != "collected":
                return
            child, src = src, text(result[1])
