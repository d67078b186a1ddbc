"""Stream storage on Redis: each operation is one script call on one stream.

The only operations that touch two streams are fork creation, fork deletion
and reads of a fork's inherited range. Each is a sequence of single-stream
steps, so everything runs unchanged on Redis Cluster; the comments at each
step say why an interruption between steps is harmless.
"""

from __future__ import annotations

import json
import logging
import re
import time
import zlib
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import redis.exceptions
from redis.asyncio import Redis

from . import keys, metrics, offsets
from .archive import ColdReader
from .batching import Batcher
from .errors import ProtocolError, bad_request
from .headers import (
    DEFAULT_CONTENT_TYPE,
    JSON_CONTENT_TYPE,
    PRODUCER_EPOCH,
    PRODUCER_EXPECTED_SEQ,
    PRODUCER_RECEIVED_SEQ,
    STREAM_CLOSED,
    STREAM_NEXT_OFFSET,
    Expiry,
    Producer,
    normalize_content_type,
    parse_expires_at,
)
from .hints import Hints
from .jsonmode import to_array
from .logs import RateLimited
from .redis_client import NotSent
from .scripts import Scripts
from .segments import Segment as ArchivedSegment
from .singleflight import SingleFlight

log = logging.getLogger(__name__)
limited = RateLimited(log)
# Redis' answers to a write it will not do now (full, a replica, failing disk, ...):
# nothing was stored, and a retry later may succeed.
_REFUSALS = re.compile(r"\b(OOM|READONLY|MISCONF|NOREPLICAS|MASTERDOWN|BUSY|LOADING)\b")
# Errors that mean "Redis is not reachable right now" (as opposed to a bad request).
UNAVAILABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
)
_UNLIMITED = 2**50
APPEND_LANES = 4  # concurrent append round trips per process
# Bounds on what one request makes Redis do (README, "Every request is bounded"):
# one script call copies at most this many log entries (~5 µs each in Lua) ...
MAX_SCRIPT_ENTRIES = 1000
# ... one read response (a plain XRANGE, for bulk reads) at most this many ...
MAX_READ_ENTRIES = 16384
# ... a batch of appends adds at most this many (one large append still goes alone) ...
MAX_BATCH_ENTRIES = 512
# ... a fork's sub-offset counts at most this many JSON messages, and a fork
# reads through at most this many ancestors (one round trip each).
MAX_FORK_SUB_MESSAGES = 65536
MAX_FORK_DEPTH = 64
Segment = tuple[str, int, int]  # (stream id, from position, to position), to exclusive


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _pairs(flat: list[Any]) -> list[tuple[int, bytes]]:
    return [(int(flat[i]), flat[i + 1]) for i in range(0, len(flat), 2)]


@dataclass(frozen=True)
class Meta:
    """What a stream's meta hash says, typed."""

    sid: str
    content_type: str
    media_type: str  # normalized, for comparisons
    base: int  # where the stream's own log starts (a fork's fork point, else 0)
    tail: int
    closed: bool
    created: str
    ttl: int | None
    expires_at: str | None
    source: str | None
    chain: tuple[Segment, ...]  # inherited ranges, oldest ancestor first
    arch: int  # where the Redis log starts: below it, data is in archived files
    floor: int  # where retained data starts (retention drops what is below)

    @classmethod
    def parse(cls, sid: str, flat: list[Any]) -> Meta:
        m = {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}
        return cls(
            sid=sid,
            content_type=m["ct"],
            media_type=m["ctn"],
            base=int(m["base"]),
            tail=int(m["tail"]),
            closed=m.get("closed") == "1",
            created=m["created"],
            ttl=int(m["ttl"]) if "ttl" in m else None,
            expires_at=m.get("expires"),
            source=m.get("src"),
            chain=tuple(tuple(s) for s in json.loads(m.get("chain") or "[]")),
            arch=int(m.get("arch") or m["base"]),
            floor=int(m.get("floor") or 0),
        )

    @property
    def is_json(self) -> bool:
        return self.media_type == JSON_CONTENT_TYPE


@dataclass
class Chunk:
    """One read: data from ``start`` and the stream's state at that moment."""

    meta: Meta
    start: int
    entries: list[tuple[int, bytes]] = field(default_factory=list)
    # Encoded responses, shared by the readers a shared read or notice reaches.
    cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def end(self) -> int:
        if not self.entries:
            return self.start
        pos, data = self.entries[-1]
        return pos + len(data)

    @property
    def up_to_date(self) -> bool:
        return self.end >= self.meta.tail

    @property
    def eof(self) -> bool:
        return self.meta.closed and self.up_to_date

    def body(self) -> bytes:
        datas = [data for _, data in self.entries]
        return to_array(datas) if self.meta.is_json else b"".join(datas)


@dataclass(frozen=True)
class CreateSpec:
    """A validated PUT."""

    content_type: str | None  # None: not given (a fork inherits its source's)
    expiry: Expiry = Expiry()
    closed: bool = False
    entries: tuple[bytes, ...] = ()
    fork_from: str | None = None  # source stream id
    fork_offset: str | None = None  # as given
    fork_sub_offset: int = 0


@dataclass(frozen=True)
class _Append:
    """One POST on its way to append.lua."""

    media_type: str  # '' when there is no body
    close: bool
    stream_seq: str  # '' none
    producer: Producer | None
    entries: list[bytes]

    def script_args(self) -> list[Any]:
        """This append's part of append.lua's ARGV."""
        p = self.producer
        head = [self.media_type, "1" if self.close else "0", self.stream_seq]
        head += [p.id, p.epoch, p.seq] if p else ["", "", ""]
        return [*head, len(self.entries), *self.entries]


def _encoded(args: list[Any]) -> list[bytes]:
    """Script arguments as the bytes Redis gets, encoded before the append joins a
    batch: an argument that cannot be encoded fails its own request (400), never
    the batch it would have shared with other streams' appends."""
    out: list[bytes] = []
    for arg in args:
        if isinstance(arg, bytes):
            out.append(arg)
        elif isinstance(arg, int):
            out.append(b"%d" % arg)
        else:
            try:
                out.append(arg.encode())
            except UnicodeEncodeError:
                raise bad_request("a header value is not valid UTF-8") from None
    return out


def outcome_unknown() -> ProtocolError:
    """An append sent to Redis whose answer never came (timeout, connection lost):
    it may or may not be stored. Not 503 + Retry-After: a blind retry could store
    it twice. An idempotent producer's retry is safe (the duplicate is recognized)."""
    return ProtocolError(
        504,
        "outcome unknown: storage did not confirm this append, which may or may not be stored; "
        "retry only with idempotent producer headers (Producer-Id/Epoch/Seq), which make retries safe",
    )


@dataclass(frozen=True)
class AppendResult:
    status: str  # ok | dup
    tail: int
    closed: bool
    producer_epoch: int | None = None
    producer_seq: int | None = None


def _dropped() -> ProtocolError:
    return ProtocolError(410, "the data at this offset was dropped by the retention policy")


def _not_found(status: str) -> ProtocolError:
    if status == "gone":
        return ProtocolError(410, "stream was deleted")
    return ProtocolError(404, "stream not found")


class Store:
    def __init__(
        self,
        redis: Redis,
        cold: ColdReader,
        max_chunk_bytes: int,
        notice_payload_bytes: int = 8192,
        read_inline_bytes: int = 64 * 1024,
    ) -> None:
        self.redis = redis
        # Bulk reads (see _bulk) take XRANGE replies as Redis sends them, not parsed
        # into a dict per entry (40,000 small entries: 56 ms instead of 91).
        self._raw = Redis(connection_pool=redis.connection_pool)
        for command in ("XRANGE", "XREVRANGE"):
            self._raw.set_response_callback(command, lambda response, **options: response)
        self.read_inline_bytes = read_inline_bytes
        self.cold = cold
        self.hints = Hints(redis)
        self._appends: Batcher[tuple[str, _Append, list[bytes]], Any] = Batcher(
            self._append_batch,
            max_items=MAX_BATCH_ENTRIES,
            size=lambda item: sum(map(len, item[1].entries)),
            count=lambda item: max(1, len(item[1].entries)),
        )
        self.scripts = Scripts(redis)
        self.max_chunk_bytes = max_chunk_bytes
        self.notice_payload_bytes = notice_payload_bytes
        self._shared_reads: SingleFlight[Chunk] = SingleFlight()

    async def _call(self, name: str, sid: str, *args: Any) -> Any:
        """A script on one stream's keys."""
        return await self._script(name, keys.stream_keys(sid), list(args))

    async def _script(self, name: str, script_keys: list[str], args: list[Any]) -> Any:
        return await self._timed(name, self.scripts.call(name, script_keys, args))

    async def _timed(self, name: str, call: Awaitable[Any]) -> Any:
        """A Redis round trip, in the metrics by ``name`` (its script's, or 'read_bulk')."""
        started = time.perf_counter()
        try:
            return await call
        except Exception as exc:
            metrics.REDIS_ERRORS.labels(name, type(exc).__name__).inc()
            raise
        finally:
            metrics.child(metrics.REDIS_SECONDS, name).observe(time.perf_counter() - started)

    # -- create -------------------------------------------------------------

    async def create(self, sid: str, spec: CreateSpec) -> tuple[bool, Meta]:
        """PUT: (created, meta). 409 for an existing stream configured otherwise."""
        if spec.fork_from is not None:
            return await self._create_fork(sid, spec)
        content_type = spec.content_type or DEFAULT_CONTENT_TYPE
        return await self._create(
            sid, spec, content_type, normalize_content_type(content_type), spec.expiry, fork=None
        )

    async def _create(
        self,
        sid: str,
        spec: CreateSpec,
        content_type: str,
        media_type: str,
        expiry: Expiry,
        fork: tuple[str, str, str, int, list[Segment]] | None,
    ) -> tuple[bool, Meta]:
        src, given_offset, fork_offset, base, chain = fork or ("", "", "", 0, [])
        result = await self._call(
            "create",
            sid,
            content_type,
            media_type,
            "" if expiry.ttl_seconds is None else expiry.ttl_seconds,
            "" if expiry.expires_at_ms is None else expiry.expires_at_ms,
            expiry.expires_at or "",
            "1" if spec.closed else "0",
            src,
            given_offset,
            fork_offset,
            spec.fork_sub_offset,
            base,
            json.dumps(chain),
            *spec.entries,
        )
        status = _text(result[0])
        if status == "conflict":
            raise ProtocolError(409, "stream exists with a different configuration")
        if status == "created" and spec.entries:
            self.hints.mark(sid)
        return status == "created", Meta.parse(sid, result[1])

    async def _create_fork(self, sid: str, spec: CreateSpec) -> tuple[bool, Meta]:
        src = spec.fork_from
        assert src is not None
        # Step 1: pin the source. The fork is recorded in a set, so a retry
        # counts once; if we stop before step 2 the extra reference only
        # delays the source's collection (see release_unless_forked).
        result = await self._call("fork_ref", src, sid)
        status = _text(result[0])
        if status == "missing":
            raise ProtocolError(404, "fork source stream not found")
        if status == "gone":
            raise ProtocolError(409, "fork source stream was deleted")
        source = Meta.parse(src, result[1])
        try:
            return await self._create_fork_of(sid, spec, source)
        except ProtocolError:
            await self._release_unless_forked(sid, src)
            raise

    async def _create_fork_of(self, sid: str, spec: CreateSpec, source: Meta) -> tuple[bool, Meta]:
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
        own: Segment = (source.sid, source.base, point)
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
        fork = (
            source.sid,
            "" if spec.fork_offset is None else offsets.encode(anchor),
            offsets.encode(anchor),
            point,
            chain,
        )
        created, meta = await self._create(sid, spec, source.content_type, source.media_type, expiry, fork)
        return created, meta

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
                page = await self._read_segments(
                    segments, pos, self.max_chunk_bytes, True, min(left, MAX_SCRIPT_ENTRIES)
                )
                if not page or page[0][0] != pos:
                    raise bad_request("Stream-Fork-Sub-Offset overshoots the source's messages")
                pos, left = page[-1][0] + len(page[-1][1]), left - len(page)
            return pos
        # One entry, the append holding the anchor, read no further than ``sub`` bytes.
        entries = await self._read_segments(segments, anchor, sub, False, 1)
        if not entries or len(entries[0][1]) < sub:
            raise bad_request("Stream-Fork-Sub-Offset overshoots the data at the fork offset")
        return anchor + sub

    async def _release_unless_forked(self, sid: str, src: str) -> None:
        """Drop a reference taken for a fork that did not come to be."""
        owner = await self.redis.hget(keys.stream_keys(sid)[0], "src")
        if owner is None or _text(owner) != src:
            await self._release(sid, src)

    async def _release(self, child: str, src: str) -> None:
        """Release ``child``'s hold on ``src``, collecting up the chain."""
        while src:
            result = await self._call("release_fork", src, child)
            if _text(result[0]) != "collected":
                return
            child, src = src, _text(result[1])

    # -- append, delete -----------------------------------------------------

    async def append(
        self,
        sid: str,
        media_type: str,
        entries: list[bytes],
        *,
        close: bool,
        stream_seq: str | None,
        producer: Producer | None,
    ) -> AppendResult:
        """POST. Concurrent appends to one stream go to Redis together (see batching.py)."""
        request = _Append(media_type if entries else "", close, stream_seq or "", producer, entries)
        args = _encoded(request.script_args())
        # Appends wait in one of a few lanes (a stream always in the same one): whatever
        # arrives while a lane's Redis round trip runs goes in its next one.
        lane = str(zlib.crc32(sid.encode()) % APPEND_LANES)
        try:
            result = await self._appends.submit(lane, (sid, request, args))
        except (NotSent, redis.exceptions.BusyLoadingError):
            raise  # nothing was applied: 503, retry
        except UNAVAILABLE as exc:  # sent, unanswered: applied or not, nobody knows
            raise outcome_unknown() from exc
        status = _text(result[0])
        if status in ("ok", "dup"):
            return AppendResult(
                status=status,
                tail=int(result[1]),
                closed=_text(result[2]) == "1",
                producer_epoch=producer.epoch if producer else None,
                producer_seq=int(result[4]) if status == "dup" else (producer.seq if producer else None),
            )
        raise _append_error(status, result)

    async def _append_batch(self, lane: str, batch: list[tuple[str, _Append, list[bytes]]]) -> list[Any]:
        """One append.lua call for a whole batch: each stream's keys in turn, its appends
        in arrival order. Returns each append's result, in batch order.

        One call rather than a pipeline of one call per stream: a pipeline costs the
        gateway ~60 µs more CPU per append (measured at 64 writers on 1,000 streams), and
        the one script either runs whole or, refused before its first write (OOM), not
        at all: no batch is half applied."""
        by_stream: dict[str, list[int]] = {}
        for index, (sid, _, _) in enumerate(batch):
            by_stream.setdefault(sid, []).append(index)
        script_keys: list[str] = []
        args: list[Any] = [self.notice_payload_bytes]
        order: list[int] = []  # batch index of each result append.lua returns
        for sid, indexes in by_stream.items():
            script_keys += keys.stream_keys(sid)
            args.append(len(indexes))
            for i in indexes:
                args += batch[i][2]
            order += indexes
        replies = await self._script("append", script_keys, args)
        results: list[Any] = [None] * len(batch)
        appended, appended_bytes = 0, 0
        for i, reply in zip(order, replies, strict=True):
            results[i] = reply
            sid, item, _ = batch[i]
            if item.entries and _text(reply[0]) == "ok":
                self.hints.mark(sid)
                appended += 1
                appended_bytes += sum(map(len, item.entries))
        if appended:  # counted once per batch: the metrics take a lock per call
            metrics.APPENDS.inc(appended)
            metrics.APPENDED_BYTES.inc(appended_bytes)
        return results

    async def delete(self, sid: str) -> None:
        result = await self._call("delete", sid)
        status = _text(result[0])
        if status in ("missing", "gone"):
            raise _not_found(status)
        if status == "deleted":
            await self.hints.forget(sid)
            await self._release(sid, _text(result[1]))

    # -- reads --------------------------------------------------------------

    async def head(self, sid: str) -> Meta:
        return (await self._read(sid, -1, refresh=False))[0]

    async def read(self, sid: str, start: int | None) -> Chunk:
        """Data from ``start`` (None: the tail; offsets.BEGINNING: the oldest
        retained data), up to the chunk size.

        Reads refresh a sliding TTL. Archived data is read from its files and a
        fork's inherited range from its ancestors; data below the tail never
        changes, so the extra calls cannot tear what the first one saw.
        """
        budget = self.max_chunk_bytes
        at = -1 if start is None else max(start, 0)
        meta, found = await self._read(sid, at, refresh=True, budget=budget)
        if start is None:
            return Chunk(meta, meta.tail)
        if start == offsets.BEGINNING:
            start = meta.floor
            if start:
                found = None
        if start > meta.tail:
            raise bad_request("offset is beyond the stream's tail")
        if start < meta.floor:
            raise _dropped()
        entries: list[tuple[int, bytes]] = []
        if start < meta.base:
            entries = await self._read_segments(meta.chain, start, budget, meta.is_json, MAX_READ_ENTRIES)
            reached = entries[-1][0] + len(entries[-1][1]) if entries else start
            budget -= sum(len(d) for _, d in entries)
            if reached < meta.base or budget <= 0:
                return Chunk(meta, start, entries)
            found = None
        own = max(start, meta.base)
        entries += await self._range(
            sid, own, meta.tail, budget, meta.is_json, MAX_READ_ENTRIES - len(entries), found,
            created=meta.created,
        )
        return Chunk(meta, start, entries)

    async def read_shared(self, sid: str, start: int | None, since: float) -> Chunk:
        """``read``, shared with concurrent readers of the same stream and offset that
        started at or after ``since`` (see singleflight.py): live reads."""
        return await self._shared_reads.run((sid, start), lambda: self.read(sid, start), since)

    async def _read(self, sid: str, start: int, *, refresh: bool, budget: int = 0) -> tuple[Meta, Any]:
        """The stream's meta and what read.lua found at ``start`` (see ``_range``)."""
        result = await self._call(
            "read", sid, start, budget, "1" if refresh else "0", self.read_inline_bytes, MAX_SCRIPT_ENTRIES
        )
        status = _text(result[0])
        if status != "ok":
            raise _not_found(status)
        return Meta.parse(sid, result[1]), result[2:]

    async def _range(
        self,
        sid: str,
        pos: int,
        hi: int,
        budget: int,
        whole: bool,
        max_entries: int,
        found: Any = None,
        created: str | None = None,
    ) -> list[tuple[int, bytes]]:
        """A stream's own entries in [pos, hi), hot (Redis) or cold (files).

        Each script call answers with the log's entries, with the archived
        segment holding ``pos`` (read from its file; the read goes on from its
        end), or with 'bulk' (see ``_bulk``). ``found`` is a first answer the
        caller already has; ``created`` the stream's, when the caller knows it.
        """
        out: list[tuple[int, bytes]] = []
        retries = 0
        inline = self.read_inline_bytes
        while pos < hi and budget > 0 and max_entries > 0:
            if found is None:
                found = await self._call(
                    "read_range", sid, pos, hi, budget, "1" if whole else "0",
                    min(max_entries, MAX_SCRIPT_ENTRIES), inline,
                )  # fmt: skip
            hot, member, bulk = _pairs(found[0]), _text(found[1]), len(found) > 2
            found = None
            if bulk:
                got = await self._bulk(sid, pos, min(hi, pos + budget), created, max_entries)
                if got is None:  # the log changed since the script looked: ask it again, inline
                    inline = _UNLIMITED
                    continue
                return out + got
            if member:
                segment = ArchivedSegment.parse(member)
                try:
                    got = await self.cold.take(segment, pos, hi, budget, whole, max_entries)
                except FileNotFoundError:
                    # Replaced by a merged file, or the stream is going: ask again.
                    retries += 1
                    if retries > 3:
                        raise ProtocolError(503, "archive file missing", {"Retry-After": "1"}) from None
                    continue
            else:
                got = hot
            if not got:
                if whole:
                    break  # a JSON read from inside a message: nothing starts here
                raise _dropped()  # nothing where data must be: dropped by retention
            out += got
            budget -= sum(len(d) for _, d in got)
            max_entries -= len(got)
            pos = got[-1][0] + len(got[-1][1])
            if not member:
                break  # the log answered all it could up to the budget
        return out

    async def _bulk(
        self, sid: str, pos: int, end: int, created: str | None, max_entries: int = MAX_READ_ENTRIES
    ) -> list[tuple[int, bytes]] | None:
        """[pos, end) of a byte stream's log, at most ``max_entries`` (and
        MAX_READ_ENTRIES) entries of it, fetched with plain XRANGE (read_from's 'bulk'
        answer); or None when the log no longer holds it (archived or deleted since
        the script looked) or the stream is not the one it saw.

        Data below the tail never changes, so what the script decided still holds
        if the entries are there; one MULTI reads them with the stream's identity.
        """
        meta_key, log_key = keys.stream_keys(sid)[:2]
        count = min(max_entries, MAX_READ_ENTRIES)
        async with self._raw.pipeline(transaction=True) as pipe:
            pipe.xrevrange(log_key, offsets.entry_id(pos), "-", count=1)  # the entry holding pos
            if count > 1:
                pipe.xrange(log_key, "(" + offsets.entry_id(pos), offsets.entry_id(end - 1), count=count - 1)
            pipe.hget(meta_key, "created")
            replies = await self._timed("read_bulk", pipe.execute())
        first, now_created = replies[0], replies[-1]
        rest = replies[1] if count > 1 else []
        if created is not None and (now_created is None or _text(now_created) != created):
            return None
        out: list[tuple[int, bytes]] = []
        at = pos  # where the next entry must start
        for entry_id, fields in first + rest:
            start, data = int(entry_id.split(b"-", 1)[0]), fields[1]  # fields: d <data> t <ms> ...
            in_place = start == at if out else start <= pos < start + len(data)
            if not in_place:
                return None  # a gap: trimmed or replaced meanwhile
            out.append((at, data[at - start : end - start]))
            at = start + len(data)
        capped = len(out) == count  # stopped by the entry bound: a shorter read, not a gap
        return out if out and (at >= end or capped) else None

    async def _read_segments(
        self, segments: Any, start: int, budget: int, whole: bool, max_entries: int
    ) -> list[tuple[int, bytes]]:
        """Entries from ``start`` across ancestor segments, contiguous only."""
        out: list[tuple[int, bytes]] = []
        pos = start
        for sid, lo, hi in segments:
            if hi <= pos:
                continue
            if pos < lo or budget <= 0 or max_entries - len(out) <= 0:
                break
            got = await self._range(sid, pos, hi, budget, whole, max_entries - len(out))
            out += got
            budget -= sum(len(d) for _, d in got)
            pos = got[-1][0] + len(got[-1][1]) if got else pos
            if pos < hi:  # stopped inside this segment: budget or entry count
                break
        return out


def _append_error(status: str, result: list[Any]) -> ProtocolError:
    if status == "error":  # append.lua caught a failure of this append alone
        written, message = _text(result[1]), _text(result[2])
        refusal = _REFUSALS.search(message)
        if written == "none" and refusal:
            limited.log(logging.WARNING, "refused", "redis refused an append: %s", message)
            text = f"storage refused the append ({refusal[0]}): not stored"
            return ProtocolError(503, text, {"Retry-After": "5"})
        limited.log(logging.ERROR, "append", "append failed in Redis (%s written): %s", written, message)
        if written == "none":
            return ProtocolError(500, "internal error: the append was not stored")
        return ProtocolError(500, "internal error: the append may be partly stored")
    if status == "closed":
        return ProtocolError(
            409,
            "stream is closed",
            {STREAM_CLOSED: "true", STREAM_NEXT_OFFSET: offsets.encode(int(result[1]))},
        )
    if status == "ct_mismatch":
        return ProtocolError(409, "content type does not match the stream's")
    if status == "seq_regress":
        return ProtocolError(409, "Stream-Seq must increase")
    if status == "bad_epoch_seq":
        return bad_request("a new producer epoch must start at Producer-Seq 0")
    if status == "stale_epoch":
        return ProtocolError(403, "stale producer epoch", {PRODUCER_EPOCH: _text(result[1])})
    if status == "seq_gap":
        return ProtocolError(
            409,
            "producer sequence gap",
            {PRODUCER_EXPECTED_SEQ: _text(result[1]), PRODUCER_RECEIVED_SEQ: _text(result[2])},
        )
    return _not_found(status)
