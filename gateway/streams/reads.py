"""Reads: a stream's state and data from an offset, up to the chunk size.

Data comes from wherever it is: the Redis log (hot, through read.lua and
read_range.lua, or by plain XRANGE for large byte reads: "bulk"), the archive's
files below the log's start (cold, ``archive/cold.py``), and a fork's
ancestors' logs below its fork point. Data below a stream's tail never
changes, so the extra calls cannot tear what the first one saw.

An ancestor's range is read only from the incarnation the fork was made from
(its chain entry names it, see forks.py): once a weak fork's source is gone,
or another stream holds its path, the inherited range answers 410.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from ..archive.cold import ColdReader
from ..archive.segments import Segment as ArchivedSegment
from ..concurrency.singleflight import SingleFlight
from ..protocol import offsets
from ..protocol.entries import end_of, messages, messages_between
from ..protocol.errors import ProtocolError, bad_request
from ..protocol.models import LEGACY_INCARNATION, Chunk, Entry, InheritedRange, Meta, text
from ..redis_io import keys
from ..redis_io.contracts import READ, READ_RANGE, RangeReply, ReadArgv, ReadDone, ReadRangeArgv, status_of
from ..redis_io.limits import MAX_READ_ENTRIES, MAX_SCRIPT_ENTRIES
from ..redis_io.outcomes import dropped, inherited_gone, not_found
from ..redis_io.routing import ClusterRoute, DirectRoute, Route
from ..redis_io.scripts import Scripts, timed

_UNLIMITED = 2**50
FILE_RETRIES = 8  # archive files found replaced in a row (one range) before a read answers 503


def _as_sent(response: Any, **options: Any) -> Any:
    return response


def _pairs(flat: list[Any]) -> list[Entry]:
    return [(int(flat[i]), flat[i + 1]) for i in range(0, len(flat), 2)]


def _before(entries: list[Entry], end: int) -> list[Entry]:
    """The pieces of a read (one message or byte run each) that start below ``end``,
    a byte run cut there (``end`` is a message boundary in a JSON stream)."""
    out = [(pos, data) for pos, data in entries if pos < end]
    if out and out[-1][0] + len(out[-1][1]) > end:
        pos, data = out[-1]
        out[-1] = (pos, data[: end - pos])
    return out


class _Lost(Exception):
    """An ancestor's range whose incarnation is gone (read_range.lua's 'lost')."""


class Reads:
    def __init__(
        self,
        scripts: Scripts,
        cold: ColdReader,
        max_chunk_bytes: int,
        read_inline_bytes: int,
        page_bytes: int = 1024 * 1024,
    ) -> None:
        self.scripts = scripts
        # Bulk reads (see bulk) take XRANGE replies as Redis sends them, not parsed
        # into a dict per entry (40,000 small entries: 56 ms instead of 91).
        raw = {command: _as_sent for command in ("XRANGE", "XREVRANGE")}
        self._bulk: Route
        if isinstance(scripts.route, ClusterRoute):  # no script reads XRANGE replies: share the pools
            for command, callback in raw.items():
                scripts.route.set_response_callback(command, callback)
            self._bulk = scripts.route
        else:
            client = Redis(connection_pool=cast(Redis, scripts.redis).connection_pool)
            for command, callback in raw.items():
                client.set_response_callback(command, callback)
            self._bulk = DirectRoute(client)
        self.cold = cold
        self.max_chunk_bytes = max_chunk_bytes
        self.page_bytes = min(page_bytes, max_chunk_bytes)
        self.read_inline_bytes = read_inline_bytes
        self._shared: SingleFlight[Chunk] = SingleFlight()

    async def head(self, sid: str) -> Meta:
        return (await self._read(sid, -1, refresh=False))[0]

    async def read(self, sid: str, start: int | None, *, below_floor: bool = False) -> Chunk:
        """Data from ``start`` (None: the tail; offsets.BEGINNING: the oldest
        retained data), up to a page (live reads, snapshots' bootstraps, webhooks).
        ``below_floor``: serve what is still stored below the floor rather than 410 (a
        bootstrap under way when a newer snapshot raised it: http/snapshots.py).

        Reads refresh a sliding TTL. Archived data is read from its files and a
        fork's inherited range from its ancestors; data below the tail never
        changes, so the extra calls cannot tear what the first one saw.
        """
        budget = self.page_bytes
        at = -1 if start is None else max(start, 0)
        meta, first = await self._read(sid, at, refresh=True, budget=budget)
        found: RangeReply | None = first
        if start is None:
            return Chunk(meta, meta.tail)
        if start == offsets.BEGINNING:
            start = meta.floor
            if start:
                found = None
        if start > meta.tail:
            raise bad_request("offset is beyond the stream's tail")
        if start < meta.floor and not below_floor:
            raise dropped(meta.floor)
        return Chunk(meta, start, await self._span(meta, start, meta.tail, budget, found=found))

    async def catch_up(self, sid: str, start: int | None) -> Chunk:
        """A catch-up read's answer: everything from ``start`` to the tail as it is now,
        up to the chunk size (a JSON answer ends at the first message starting past it).
        Its first page is read; when there is more, ``until`` says where the answer ends
        and ``page`` reads the rest while it is sent (never held whole)."""
        chunk = await self.read(sid, start)
        if start is None:
            return chunk
        meta = chunk.meta
        # A compacted stream's answer holds a chunk from its first kept message on: from
        # inside a dropped part, one "from start" might hold none (and never move on).
        begin = chunk.entries[0][0] if meta.gapped and chunk.entries else chunk.start
        end = await self._answer_end(meta, begin)
        # The answer is [start, end) wherever its first page stopped (a hot and a cold
        # page from inside a message may hold more or fewer messages): exactly, always.
        entries = _before(chunk.entries, end) if chunk.page_end > end else chunk.entries
        return Chunk(meta, chunk.start, entries, until=end if end > chunk.page_end else None)

    async def page(self, meta: Meta, pos: int, until: int) -> list[Entry]:
        """The next page of a streamed answer, from ``pos`` (where the previous one ended)
        towards ``until``. JSON pieces may hold several messages of one stored entry
        (entries.end_of). Data that went away meanwhile (retention) raises 410: sent
        from the middle of an answer, that breaks the answer (http/catchup.py). Empty for
        a compacted stream that kept nothing from ``pos`` to ``until``."""
        got: list[Entry] | None = None
        if pos >= meta.arch:  # in its own log when the answer began: no script needed unless it moved
            end = min(until, pos + self.page_bytes)
            got = await self.bulk(meta.sid, pos, end, meta.created, MAX_READ_ENTRIES, "", meta.is_json)
        if got is None:
            got = await self._span(meta, pos, until, self.page_bytes, grouped=True)
        if not got and not meta.gapped:  # (a compacted stream's: no message kept up to until)
            raise dropped(meta.floor)
        return got

    async def _answer_end(self, meta: Meta, start: int) -> int:
        """Where a catch-up answer from ``start`` ends: the tail, or the chunk size past
        ``start`` (bytes), or where the first JSON message at or past that starts."""
        cap = start + self.max_chunk_bytes
        if cap >= meta.tail:
            return meta.tail
        if not meta.is_json:
            return cap
        # One message read from inside the one holding ``cap``: the next one.
        for sid, lo, hi, incarnation in meta.chain:
            if hi > cap:
                try:
                    inherited = incarnation or LEGACY_INCARNATION
                    got = await self._range(sid, max(cap, lo), hi, 1, True, 1, incarnation=inherited)
                except _Lost:
                    raise inherited_gone(meta.base) from None
                if got:
                    return got[0][0]
        got = await self._range(meta.sid, max(cap, meta.base), meta.tail, 1, True, 1, created=meta.created)
        return got[0][0] if got else meta.tail

    async def _span(
        self,
        meta: Meta,
        start: int,
        hi: int,
        budget: int,
        *,
        grouped: bool = False,
        found: RangeReply | None = None,
    ) -> list[Entry]:
        """[start, hi) of a stream, up to ``budget``: its ancestors' part (a fork's), then
        its own. ``found``: what read.lua already found at ``start``."""
        entries: list[Entry] = []
        whole = meta.is_json
        if start < meta.base:
            entries = await self.read_segments(
                meta.chain,
                start,
                budget,
                whole,
                MAX_READ_ENTRIES,
                fork_point=meta.base,
                hi=hi,
                grouped=grouped,
            )
            reached = end_of(*entries[-1], whole) if entries else start
            budget -= sum(len(d) for _, d in entries)
            if reached < meta.base or reached >= hi or budget <= 0:
                return entries
            found = None
        own = max(start, meta.base)
        entries += await self._range(
            meta.sid, own, hi, budget, whole, MAX_READ_ENTRIES - len(entries), found,
            created=meta.created, grouped=grouped,
        )  # fmt: skip
        return entries

    async def read_shared(self, sid: str, start: int | None, since: float) -> Chunk:
        """``read``, shared with concurrent readers of the same stream and offset that
        started at or after ``since`` (see concurrency/singleflight.py): live reads."""
        return await self._shared.run((sid, start), lambda: self.read(sid, start), since)

    async def _read(self, sid: str, start: int, *, refresh: bool, budget: int = 0) -> tuple[Meta, RangeReply]:
        """The stream's meta and what read.lua found at ``start`` (see ``_range``)."""
        argv = ReadArgv(start, budget, "1" if refresh else "0", self.read_inline_bytes, MAX_SCRIPT_ENTRIES)
        result = await self.scripts.on_stream(READ.name, sid, *argv)
        status = status_of(result)
        if status != "ok":
            raise not_found(status)
        done = ReadDone(*result)
        return Meta.parse(sid, done.meta), done.found()

    async def _range(
        self,
        sid: str,
        pos: int,
        hi: int,
        budget: int,
        whole: bool,
        max_entries: int,
        found: RangeReply | None = None,
        created: str | None = None,
        incarnation: str = "",
        grouped: bool = False,
    ) -> list[Entry]:
        """A stream's own entries in [pos, hi), hot (Redis) or cold (files).

        Each script call answers with the log's entries, with the archived
        segment holding ``pos`` (read from its file; the read goes on from its
        end), or with 'bulk' (see ``bulk``). ``found`` is a first answer the
        caller already has; ``created`` the stream's, when the caller knows it.
        ``incarnation``: reading an ancestor's range, the incarnation it must
        be (a chain entry's); _Lost when it is not. ``grouped``: a JSON read read in
        bulk may answer pieces of several messages (entries.end_of); else one a message.
        """
        out: list[Entry] = []
        retries = 0
        inline = self.read_inline_bytes
        while pos < hi and budget > 0 and max_entries > 0:
            asked = MAX_SCRIPT_ENTRIES  # what read.lua was asked for, when it gave ``found``
            if found is None:
                asked = min(max_entries, MAX_SCRIPT_ENTRIES)
                argv = ReadRangeArgv(pos, hi, budget, "1" if whole else "0", asked, inline, incarnation)
                found = RangeReply(*await self.scripts.on_stream(READ_RANGE.name, sid, *argv))
            hot, flag = _pairs(found.entries), text(found.flag)
            member = await self._segment(sid, text(found.incarnation), pos) if flag == "archived" else ""
            found = None
            if flag == "lost":
                raise _Lost
            if flag == "bulk":
                got = await self.bulk(
                    sid, pos, min(hi, pos + budget), created, max_entries, incarnation, whole
                )
                if got is None:  # the log changed since the script looked: ask it again, inline
                    inline = _UNLIMITED
                    continue
                if whole and not grouped:  # one a message, as many as asked
                    got = [message for piece in got for message in messages(*piece)][:max_entries]
                return out + got
            if member:
                segment = ArchivedSegment.parse(member)
                try:
                    got = await self.cold.take(segment, pos, hi, budget, whole, max_entries)
                except FileNotFoundError:
                    # Replaced by a merged file (committed before the old one is deleted: the
                    # script names the new one now), or the stream is going: ask again. An
                    # archive worker merging often may replace the new one too before it is
                    # read: a few more tries, a little apart (a 503 only after ~2 s of that).
                    retries += 1
                    if retries > FILE_RETRIES:
                        raise ProtocolError(503, "archive file missing", {"Retry-After": "1"}) from None
                    if retries > 1:
                        await asyncio.sleep(min(0.4, 0.025 * 2**retries))
                    continue
                retries = 0  # (in a row: a long read over many files may meet several merges)
            else:
                got = hot
            if not got:
                if whole and member and segment.end > pos:
                    pos = segment.end  # from inside a file's last message: the next starts after it
                    continue
                if whole:
                    break  # a JSON read from inside a message: nothing starts here
                raise dropped()  # nothing where data must be: dropped by retention
            out += got
            budget -= sum(len(d) for _, d in got)
            max_entries -= len(got)
            pos = got[-1][0] + len(got[-1][1])  # (one message a piece: not a bulk read)
            if not member and len(got) < asked:
                break  # the log answered all it could up to the budget
            # else go on: a response holds up to the chunk size, read in bounded scripts (a
            # JSON read stops at 1,000 messages a script; clients reading with live=false
            # take one response as the whole stream)
        return out

    async def _segment(self, sid: str, incarnation: str, pos: int) -> str:
        """The committed segment of ``incarnation`` whose range starts at or below ``pos``
        ('' if none: dropped by retention). Looked up after the script, which only says
        where: the set's name holds the incarnation, which the caller learns from the
        script, and every key a script touches must be in its KEYS (Redis Cluster).
        Committed segments only ever grow by merging, so one found later still holds
        ``pos`` unless retention dropped it (then none is found: 410)."""
        if not incarnation:
            return ""
        segments = keys.segments(sid, incarnation)
        lookup = self.scripts.command(segments, "ZREVRANGEBYSCORE", segments, pos, 0, "LIMIT", 0, 1)
        found = await timed("read_segment", lookup)
        return text(found[0]) if found else ""

    async def bulk(
        self,
        sid: str,
        pos: int,
        end: int,
        created: str | None,
        max_entries: int = MAX_READ_ENTRIES,
        incarnation: str = "",
        whole: bool = False,
    ) -> list[Entry] | None:
        """[pos, end) of a stream's log, at most ``max_entries`` (and MAX_READ_ENTRIES)
        entries of it, fetched with plain XRANGE (read_from's 'bulk' answer); or None
        when the log no longer holds it (archived or deleted since the script looked) or
        the stream is not the one it saw (``created``, or the ``incarnation`` of an
        ancestor's range, as in ``_range``). ``whole``: a JSON stream's, whose entries
        are never cut inside a message: its pieces are the messages of one stored entry
        that start in [pos, end), joined (entries.end_of); the last may run past ``end``.

        Data below the tail never changes, so what the script decided still holds
        if the entries are there; one MULTI reads them with the stream's identity. A
        compacted stream's log has gaps where compaction dropped messages (whichever of
        its versions this reads, readers end alike: docs/compaction.md): there a gap is
        data, and only the log's start moving past ``pos`` (archived since) sends the
        read back to the script.
        """
        meta_key, log_key = keys.stream_keys(sid)[:2]
        count = min(max_entries, MAX_READ_ENTRIES)

        def queue(pipe: Pipeline) -> None:
            pipe.xrevrange(log_key, offsets.entry_id(pos), "-", count=1)  # the entry holding pos
            if count > 1:
                pipe.xrange(log_key, "(" + offsets.entry_id(pos), offsets.entry_id(end - 1), count=count - 1)
            pipe.hmget(meta_key, "created", "uid", "cmp", "arch")

        replies = await timed("read_bulk", self._bulk.pipeline(meta_key, queue, transaction=True))
        first, (now_created, now_uid, compacted, arch) = replies[0], replies[-1]
        rest = replies[1] if count > 1 else []
        if created is not None and (now_created is None or text(now_created) != created):
            return None
        if incarnation and (
            now_created is None
            or (incarnation != LEGACY_INCARNATION and (now_uid is None or text(now_uid) != incarnation))
        ):
            return None  # another incarnation, or none: asked again, read_range.lua says 'lost'
        gaps = compacted is not None
        if gaps and arch is not None and int(arch) > pos:
            return None  # archived since the script looked
        out: list[Entry] = []
        at = pos  # where the next entry must start
        taken = 0
        for entry_id, fields in first + rest:
            start, data = int(entry_id.split(b"-", 1)[0]), fields[1]  # fields: d <data> t <ms> ...
            stop = end_of(start, data, whole)
            if gaps:
                if stop <= pos or start >= end:  # the entry before pos, or (one a message) past end
                    continue
                at = max(at, start)
            in_place = start == at if taken or gaps else start <= pos < stop
            if not in_place:
                return None  # a gap: trimmed or replaced meanwhile
            taken += 1
            if not whole:
                out.append((at, data[at - start : end - start]))
            elif start >= pos and stop <= end:
                out.append((start, data))
            elif (piece := messages_between(start, data, pos, end)) is not None:
                out.append(piece)
            at = stop
        capped = taken == count  # stopped by the entry bound: a shorter read, not a gap
        if gaps:  # gaps up to end are dropped messages; none found: the script looks further
            return out or None
        return out if out and (at >= end or capped) else None

    async def read_segments(
        self,
        segments: tuple[InheritedRange, ...],
        start: int,
        budget: int,
        whole: bool,
        max_entries: int,
        fork_point: int | None = None,
        hi: int | None = None,
        grouped: bool = False,
    ) -> list[Entry]:
        """Entries from ``start`` across ancestors' ranges (a fork's chain), contiguous
        only, below ``hi`` if given (``grouped`` as in ``_range``).

        A range whose ancestor incarnation is gone ends the read there: what came
        before it is answered, and a read starting in it is 410 (``inherited_gone``,
        naming ``fork_point``, where the fork's own data starts, if given).
        """
        out: list[Entry] = []
        pos = start
        for sid, lo, top, incarnation in segments:
            if hi is not None:
                top = min(top, hi)
            if top <= pos:
                continue
            if pos < lo or budget <= 0 or max_entries - len(out) <= 0:
                break
            try:
                got = await self._range(
                    sid,
                    pos,
                    top,
                    budget,
                    whole,
                    max_entries - len(out),
                    incarnation=incarnation or LEGACY_INCARNATION,
                    grouped=grouped,
                )
            except _Lost:
                if out:
                    break
                raise inherited_gone(fork_point) from None
            out += got
            budget -= sum(len(d) for _, d in got)
            pos = end_of(*got[-1], whole) if got else pos
            if pos < top:  # stopped inside this segment: budget or entry count
                break
        return out
