"""Listing streams from the stream index (``keys.STREAM_INDEX``), for
``GET {prefix}/__ds/streams`` (http/listing.py).

create.lua adds a stream to its slot's index and delete.lua takes it out, in the same
script as the change itself; a stream that expired (Redis dropped its keys, no script
ran) is taken out when a listing finds it gone (stream_info.lua). A page walks the
index parts in order (protocol/listing.py): the ids after its start position, a few
parts at a time (more while they come back empty), then each candidate's metadata,
in one pipeline per node. No SCAN: a page costs the entries it lists (plus the dead
or unreadable ones it passes, at most ``MAX_INSPECTED``) and, on Redis Cluster, one
ZRANGE per part it crosses (at most ``MAX_RANGES``).

``IndexSweep``: a stream that expired leaves an entry only a listing would meet; one
gateway at a time walks the index a little every half minute, so such entries do not
pile up where nobody lists.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.crc import REDIS_CLUSTER_HASH_SLOTS

from ..concurrency.cancelling import raise_if_cancelled
from ..protocol.errors import ProtocolError
from ..protocol.listing import Position, decode_cursor, encode_cursor
from ..protocol.models import Meta, text
from ..redis_io import keys
from ..redis_io.contracts import STREAM_INFO, StreamInfo, StreamInfoArgv, status_of
from ..redis_io.scripts import Scripts
from ..telemetry.logs import RateLimited

log = logging.getLogger(__name__)
limited = RateLimited(log)

# Index entries one page looks at before it answers with what it found (dead streams,
# or streams the credential may not read, pass without being listed).
MAX_INSPECTED = 10_000
# Index reads (ZRANGE of one part, one prefix) one page may send: on Redis Cluster a narrow
# prefix finds nothing in most of the 16,384 parts; past this, the page answers with
# what it found and a cursor at the next part.
MAX_RANGES = 4096
MAX_WIDTH = 1024  # index parts read in one round (Redis Cluster: slots)
MAX_PRODUCERS = 1000  # producers one stream's detail shows (its count says how many there are)


@dataclass(frozen=True)
class Producer:
    id: str
    epoch: int
    seq: int  # the last sequence number accepted


@dataclass(frozen=True)
class Listed:
    path: str
    meta: Meta
    expires_at_ms: int | None
    last_write_ms: int | None  # the newest entry still in Redis (None: none there)
    producer_count: int = 0  # asked for by ``one`` only
    producers: tuple[Producer, ...] = ()


@dataclass(frozen=True)
class Page:
    streams: list[Listed]
    next: Position | None  # where the next page starts; None: nothing after this one


class Listing:
    def __init__(self, scripts: Scripts) -> None:
        self.scripts = scripts
        self.parts = REDIS_CLUSTER_HASH_SLOTS if scripts.cluster else 1

    def index(self, part: int) -> str:
        """The index key of one part (one Redis: the only one; Redis Cluster: a slot's)."""
        return keys.index_of_slot(part) if self.scripts.cluster else keys.STREAM_INDEX

    async def page(
        self,
        prefixes: list[str],
        start: Position,
        limit: int,
        visible: Callable[[str], bool],
        budget: int = MAX_INSPECTED,
    ) -> Page:
        """Up to ``limit`` live streams whose paths start with one of ``prefixes`` (none
        inside another) and ``visible`` allows, from ``start`` on. A page ends early
        (``next`` says where to go on) after ``budget`` index entries or ``MAX_RANGES``
        index reads, whatever it found by then."""
        found: list[tuple[Position, Listed]] = []
        position, width, inspected, asked = start, 1, 0, 0
        # In the index's order (stream ids: '%', '{', '}' percent-encoded), not the paths'.
        wanted = sorted(encoded(p) for p in prefixes)
        while wanted and position.part < self.parts and inspected < budget and asked < MAX_RANGES:
            want = min(limit + 1 - len(found), budget - inspected)
            width = max(1, min(width, (MAX_RANGES - asked) // len(wanted)))
            parts = range(position.part, min(self.parts, position.part + width))
            asked += len(parts) * len(wanted)
            candidates = (await self._ids(parts, position, wanted, want))[:want]
            if len(candidates) < want:  # every part of this round read to its end
                width = min(width * 2, MAX_WIDTH)
                end = Position(parts.stop)
            infos = await self.scripts.run_each(
                STREAM_INFO.name,
                [
                    ([*keys.stream_keys(sid), self.index(part)], [*StreamInfoArgv(0)])
                    for part, sid in candidates
                ],
            )
            for (part, sid), info in zip(candidates, infos, strict=True):
                if isinstance(info, Exception):
                    raise info
                inspected += 1
                position = Position(part, keys.path_of(sid))
                if status_of(info) == "ok" and visible(position.after or ""):
                    found.append((position, _listed(sid, info)))
                    if len(found) > limit:
                        return Page([listed for _, listed in found[:limit]], found[limit - 1][0])
            if len(candidates) < want:
                position = end
        more = bool(wanted) and position.part < self.parts
        return Page([listed for _, listed in found], position if more else None)

    async def one(self, sid: str, producers: int = MAX_PRODUCERS) -> Listed | None:
        """One stream as the listing shows it, with up to ``producers`` of its idempotent
        producers' state; None when there is no live stream there."""
        index = keys.stream_index(sid, self.scripts.cluster)
        info = await self.scripts.run(
            STREAM_INFO.name, [*keys.stream_keys(sid), index], [*StreamInfoArgv(producers)]
        )
        return _listed(sid, info) if status_of(info) == "ok" else None

    async def _ids(
        self, parts: range, position: Position, prefixes: list[bytes], want: int
    ) -> list[tuple[int, str]]:
        """(part, stream id) of up to ``want`` index entries per part and prefix after
        ``position``, in listing order."""
        commands: list[tuple[str, list[object]]] = []
        owners: list[int] = []
        for part in parts:
            after = None
            if part == position.part and position.after is not None:
                after = encoded(position.after)
            index = self.index(part)
            for prefix in prefixes:
                bounds = lex_range(prefix, after)
                if bounds is not None:
                    commands.append((index, ["ZRANGE", index, *bounds, "BYLEX", "LIMIT", 0, want]))
                    owners.append(part)
        ids: list[tuple[int, str]] = []
        for part, reply in zip(owners, await self.scripts.command_each(commands), strict=True):
            if isinstance(reply, Exception):
                raise reply
            ids.extend((part, text(sid)) for sid in reply)
        return ids


def encoded(path: str) -> bytes:
    """A path as the index holds it: its stream id's bytes."""
    return keys.stream_id(path).encode("utf-8", "surrogatepass")


def lex_range(prefix: bytes, after: bytes | None) -> tuple[bytes, bytes] | None:
    """ZRANGE BYLEX bounds for the members that start with ``prefix`` and sort after
    ``after`` (None: all of them); None when there are none. Members are UTF-8, in
    which no byte is 0xFF: ``prefix + 0xFF`` sorts after every member with the prefix."""
    high = b"[" + prefix + b"\xff" if prefix else b"+"
    if after is None or after < prefix:
        return (b"[" + prefix if prefix else b"-"), high
    if not after.startswith(prefix):
        return None  # past every member with the prefix
    return b"(" + after, high


def _listed(sid: str, reply: list[Any]) -> Listed:
    """From stream_info.lua's {'ok', meta, last_ms, producer_count, producers}."""
    info = StreamInfo(*reply)
    flat = info.meta
    fields = {text(flat[i]): text(flat[i + 1]) for i in range(0, len(flat), 2)}
    last = text(info.last_ms) if info.last_ms else ""
    raw = info.producers
    producers = []
    for i in range(0, len(raw), 2):
        epoch, _, seq = text(raw[i + 1]).partition(":")
        producers.append(Producer(text(raw[i]), int(epoch), int(seq)))
    return Listed(
        path=keys.path_of(sid),
        meta=Meta.parse(sid, flat),
        expires_at_ms=int(fields["exp"]) if fields.get("exp") else None,
        last_write_ms=int(last) if last else None,
        producer_count=int(info.producer_count),
        producers=tuple(sorted(producers, key=lambda p: p.id)),
    )


SWEEP_SECONDS = 30.0  # how often one gateway walks a part of the index
SWEEP_ENTRIES = 2000  # index entries one sweep looks at (a million streams: a round in ~4 h)


class IndexSweep:
    """Takes the entries of expired streams out of the stream index where no listing
    passes: every ``SWEEP_SECONDS`` one gateway (whoever takes ``keys.INDEX_SWEEP``
    first) looks at the next ``SWEEP_ENTRIES`` entries with stream_info.lua, which drops
    those whose stream is gone, from where the last sweep stopped (``INDEX_SWEEP_AT``)
    round and round."""

    def __init__(self, listing: Listing) -> None:
        self.listing = listing

    async def run(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_SECONDS * random.uniform(0.8, 1.2))
            try:
                await self.once()
            except Exception as exc:  # Redis away: the next round tries again
                raise_if_cancelled()  # stopping, the CancelledError lost in a library
                limited.log(logging.WARNING, "sweep", "stream index sweep: %s", exc)

    async def once(self) -> bool:
        """One sweep, if no other gateway made one in this interval; whether it did."""
        redis = self.listing.scripts.redis
        if not await redis.set(keys.INDEX_SWEEP, uuid.uuid4().hex, nx=True, ex=int(SWEEP_SECONDS)):
            return False
        parts = self.listing.parts
        raw = await redis.get(keys.INDEX_SWEEP_AT)
        try:
            start = decode_cursor(text(raw), parts) if raw else Position(0)
        except ProtocolError:  # written by a deployment of another shape: start over
            start = Position(0)
        page = await self.listing.page([""], start, SWEEP_ENTRIES, lambda _: False, budget=SWEEP_ENTRIES)
        if page.next is None:
            await redis.delete(keys.INDEX_SWEEP_AT)  # the end: from the start next time
        else:
            await redis.set(keys.INDEX_SWEEP_AT, encode_cursor(page.next, parts))
        return True
