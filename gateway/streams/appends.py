"""Appends: each POST's script arguments, encoded up front, then batched with
the appends that arrive while a round trip runs (``concurrency/batching.py``)
into one append.lua call per batch (per hash slot of it, on Redis Cluster).

An append larger than ``STEP_BYTES`` goes alone, in steps: append.lua checks it and
marks it under way, its parts of at most that much follow (on one Redis as plain
commands, redis_io/parts.py; on a cluster as append_part.lua steps), and a last
append_part.lua step commits the whole of it at once (see PEND_MS in lua/_prelude.lua):
each step stays short however large the body.
Appends to a stream meanwhile are answered 'busy' and sent again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import redis.exceptions

from ..concurrency.batching import Batcher
from ..features.hints import Hints
from ..protocol.conditions import IfMatch
from ..protocol.entries import LogEntry, flatten, one_each, positions, stored_bytes
from ..protocol.errors import ProtocolError, bad_request
from ..protocol.headers import Producer
from ..protocol.models import AppendResult, text
from ..redis_io import keys, parts
from ..redis_io.connections import NotSent, PlainRefused
from ..redis_io.contracts import (
    APPEND,
    APPEND_PART,
    AppendArgv,
    AppendDone,
    AppendDup,
    AppendHead,
    AppendItem,
    AppendPartArgv,
    AppendPending,
    AppendStream,
    status_of,
)
from ..redis_io.limits import (
    APPEND_LANES,
    BUSY_WAIT_SECONDS,
    CLUSTER_APPEND_LANES,
    MAX_BATCH_ENTRIES,
    STEP_BYTES,
)
from ..redis_io.outcomes import UNAVAILABLE, append_error, outcome_unknown
from ..redis_io.scripts import Scripts
from ..telemetry import metrics


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~1.3 µs more an append
class AppendRequest:
    """One POST on its way to append.lua."""

    media_type: str  # '' when there is no body
    close: bool
    stream_seq: str  # '' none
    producer: Producer | None
    entries: list[LogEntry]
    if_match: str = ""  # IfMatch.script_arg(), '' none
    expected_offset: str = ""  # the tail position Stream-Expected-Offset names, '' none
    token: str = ""  # a large append's, written in steps ('' none)
    total: int = 0  # the positions the whole of a large append takes ...
    total_bytes: int = 0  # ... and the bytes it stores
    tenant: str = ""  # whose quotas it counts against ('' none): not an argument of its own

    def _total(self) -> str:
        return f"{self.total} {self.total_bytes}" if self.token else ""

    def script_args(self) -> list[Any]:
        """This append's part of append.lua's ARGV (its group, then its entries), its head
        given in full (``_call`` leaves out one that repeats the append's before it)."""
        p = self.producer
        head = AppendHead(
            self.media_type,
            "1" if self.close else "0",
            self.stream_seq,
            self.if_match,
            self.expected_offset,
            self.token,
            self._total(),
        )
        item = AppendItem(head.joined(), f"{p.epoch} {p.seq} {p.id}" if p else "", len(self.entries))
        return [*item, *flatten(self.entries)]

    def encoded_args(self) -> list[bytes]:
        """``encoded(self.script_args())`` (the AppendItem contract), made directly: the
        generic one tests each argument for its type; here each is known
        (tests/test_append_args.py: byte for byte the same). An entry's data, a memoryview
        slice of a large body, passes as it is, as there."""
        p = self.producer
        out: list[Any] = [
            _utf8(
                f"{self.media_type}\n{'1' if self.close else '0'}\n{self.stream_seq}\n{self.if_match}\n"
                f"{self.expected_offset}\n{self.token}\n{self._total()}"
            ),
            _utf8(f"{p.epoch} {p.seq} {p.id}") if p else b"",
            b"%d" % len(self.entries),
        ]
        for size, data in self.entries:
            out += (b"%d" % size, data)
        return out


def _utf8(value: str) -> bytes:
    """A text argument as ``encoded`` makes it (a header value that is not UTF-8: 400)."""
    try:
        return value.encode()
    except UnicodeEncodeError:
        raise bad_request("a header value is not valid UTF-8") from None


def encoded(args: list[Any]) -> list[bytes]:
    """Script arguments as the bytes Redis gets, encoded before the append joins a
    batch: an argument that cannot be encoded fails its own request (400), never
    the batch it would have shared with other streams' appends."""
    out: list[bytes] = []
    for arg in args:
        if isinstance(arg, bytes):
            out.append(arg)
        elif isinstance(arg, memoryview):  # a slice of a large body: sent as it is
            out.append(arg)  # type: ignore[arg-type]
        elif isinstance(arg, int):
            out.append(b"%d" % arg)
        else:
            try:
                out.append(arg.encode())
            except UnicodeEncodeError:
                raise bad_request("a header value is not valid UTF-8") from None
    return out


log = logging.getLogger(__name__)
PLAIN_PART = "append_part_plain"  # a part written by plain commands, in the Redis call metrics
_MORE = [b"more"]  # append_part.lua's reply to a part that is not the last
Queued = tuple[str, AppendRequest, list[bytes]]  # stream id, the append, its encoded arguments
_KEYS_KEPT = 4096  # streams whose append.lua keys are remembered (then forgotten all at once)


class Appends:
    def __init__(self, scripts: Scripts, hints: Hints, notice_payload_bytes: int) -> None:
        self.scripts = scripts
        self.hints = hints
        self.notice_payload_bytes = notice_payload_bytes
        self._lanes = CLUSTER_APPEND_LANES if scripts.cluster else APPEND_LANES
        # A lane has one call in flight at a time (the batcher's rule): on one Redis it keeps a
        # connection of its own, without the pool's cost per call (connections.Held).
        self._held = {str(lane): scripts.hold() for lane in range(self._lanes)}
        self._plain_parts = not scripts.cluster  # a large append's parts as plain commands
        # A stream's keys for append.lua, made once rather than six f-strings per append.
        self._keys: dict[str, list[str]] = {}
        self._tenants: dict[str, tuple[int, list[str]]] = {}  # tenant -> (hour, its keys then)
        self._batcher: Batcher[Queued, Any] = Batcher(
            self._append_batch,
            max_items=MAX_BATCH_ENTRIES,
            max_bytes=STEP_BYTES,  # a batch's script is as short as a step's
            size=lambda item: stored_bytes(item[1].entries),
            count=lambda item: max(1, len(item[1].entries)),
        )

    async def append(
        self,
        sid: str,
        media_type: str,
        entries: list[LogEntry],
        *,
        close: bool,
        stream_seq: str | None,
        producer: Producer | None,
        if_match: IfMatch | None = None,
        expected_offset: int | None = None,
        tenant: str = "",
    ) -> AppendResult:
        """POST. Concurrent appends to one stream go to Redis together; each one's
        conditions (If-Match, Stream-Expected-Offset) are checked at its turn, and its
        ``tenant``'s quotas (docs/tenants.md; '' none)."""
        request = AppendRequest(
            media_type if entries else "",
            close,
            stream_seq or "",
            producer,
            entries,
            if_match.script_arg() if if_match else "",
            "" if expected_offset is None else str(expected_offset),
            tenant=tenant,
        )
        if stored_bytes(entries) > STEP_BYTES:
            result = await self._append_in_steps(sid, request)
        else:
            args = request.encoded_args()
            # Appends wait in one of a few lanes (a stream always in the same one): whatever
            # arrives while a lane's Redis round trip runs goes in its next one.
            lane = str(zlib.crc32(sid.encode()) % self._lanes) if self._lanes > 1 else "0"
            queued = (sid, request, args)
            with _TOLD:  # the first try without the busy loop's coroutine (~1 µs an append)
                result = await self._batcher.submit(lane, queued)
                if isinstance(result, BaseException):  # its slot's call failed (see _append_batch)
                    raise result
            if status_of(result) == "busy":
                result = await _waiting_out_busy(lambda: self._batcher.submit(lane, queued))
        status = status_of(result)
        if status == "ok":
            done = AppendDone(*result)
            tail, closed, created = done.tail, done.closed, done.created
            seq = producer.seq if producer else None
        elif status == "dup":  # a producer's retry, applied before: the seq it was applied as
            dup = AppendDup(*result)
            tail, closed, created, seq = dup.tail, dup.closed, None, int(dup.seq)
        else:
            raise append_error(status, result, sid)
        return AppendResult(
            status=status,
            tail=int(tail),
            closed=text(closed) == "1",
            producer_epoch=producer.epoch if producer else None,
            producer_seq=seq,
            created=None if created is None else text(created),
        )

    async def _append_in_steps(self, sid: str, request: AppendRequest) -> Any:
        """A large append, alone, in steps of at most STEP_BYTES: append.lua checks it and
        marks it under way, its parts follow (``_write_part``), append_part.lua's last step
        commits them. A step that fails before the last leaves nothing committed (its
        leftovers are dropped, now or by the next append once PEND_MS passed): 503, nothing
        stored."""
        token = uuid.uuid4().hex
        first = replace(
            request,
            entries=[],
            token=token,
            total=positions(request.entries),
            total_bytes=stored_bytes(request.entries),
        )
        args = encoded(first.script_args())
        call = self._call([(sid, first, args)], [0])
        result = await _waiting_out_busy(lambda: self._run_alone(call))
        if status_of(result) != "pending":
            return result  # refused by its checks, a producer's duplicate, ...
        entries = request.entries
        if text(AppendPending(*result).one_each) == "1":  # a compacted stream: a message an entry
            entries = one_each(entries)
        p = request.producer
        head = AppendPartArgv(
            token,
            "part",
            "1" if request.close else "0",
            request.stream_seq,
            p.id if p else "",
            p.epoch if p else "",
            p.seq if p else "",
            keys.SUBS_WAKE_CHANNEL,
            request.tenant,
        )
        script_keys = [
            *keys.stream_keys(sid),
            keys.stream_subs(sid),
            *(keys.tenant_keys(request.tenant, time.time()) if request.tenant else ()),
            keys.subs_outbox(sid, self.scripts.cluster),
        ]
        producer = f"{p.epoch} {p.seq} {p.id}".encode() if p else b""  # as add_entries stores it
        for part in _steps(entries, STEP_BYTES, MAX_BATCH_ENTRIES):
            try:
                result = await self._write_part(script_keys, head, producer, part)
            except UNAVAILABLE as exc:
                await self._abort(script_keys, head)
                raise NotSent("storage was lost while a large append was written: not stored") from exc
            if status_of(result) != "more":
                break
        if status_of(result) == "more":
            try:
                last = encoded([*head._replace(step="last")])
                result = await self.scripts.run(APPEND_PART.name, script_keys, last)
            except UNAVAILABLE as exc:
                raise outcome_unknown() from exc
        if status_of(result) == "lost":  # paused past PEND_MS: rolled back
            raise NotSent("a large append was not finished in time: not stored")
        if status_of(result) == "ok":
            self.hints.mark(sid)
            metrics.APPENDS.inc()
            metrics.APPENDED_BYTES.inc(first.total)
        return result

    async def _write_part(
        self, script_keys: list[str], head: AppendPartArgv, producer: bytes, part: list[LogEntry]
    ) -> Any:
        """One part, beyond the tail: on one Redis as plain commands (redis_io/parts.py: its
        data never passes through Lua), else, or when those leave it to the script (the
        append's time is up, ...), as an append_part.lua step. Its reply, as the script's."""
        if self._plain_parts:
            meta, log_key = script_keys[:2]  # a rollback changes one or the other: both watched

            def commands(values: list[Any], now: int) -> list[tuple[Any, ...]] | None:
                return parts.commands(meta, log_key, head.token, part, producer, values, now)

            try:
                written = await self.scripts.write_watched(
                    [meta, log_key], parts.FIELDS, commands, PLAIN_PART
                )
            except PlainRefused as exc:  # a proxy or an ACL without WATCH/TIME: scripts from now on
                log.warning("large appends' parts go through append_part.lua: %s", exc)
                self._plain_parts = False
                written = None
            except redis.exceptions.ResponseError as exc:  # refused, or half written: undone
                with contextlib.suppress(redis.exceptions.RedisError):  # (else PEND_MS undoes it)
                    await self._abort(script_keys, head)
                raise redis.exceptions.ResponseError(_reason(exc)) from None  # (not the part's bytes)
            if written is not None:
                return _MORE
        return await self.scripts.run(APPEND_PART.name, script_keys, encoded([*head, *flatten(part)]))

    async def _run_alone(self, call: tuple[list[str], list[Any], list[int]]) -> Any:
        """append.lua for one append (its failures as _waiting_out_busy tells them)."""
        (reply,) = await self.scripts.run(APPEND.name, *call[:2])  # one append: one result
        return reply

    async def _abort(self, script_keys: list[str], head: AppendPartArgv) -> None:
        """Drop a large append's parts at once, if Redis answers (else PEND_MS does it)."""
        try:
            await self.scripts.run(APPEND_PART.name, script_keys, encoded([*head._replace(step="abort")]))
        except UNAVAILABLE:
            pass

    async def _append_batch(self, lane: str, batch: list[Queued]) -> list[Any]:
        """The batch's appends, one append.lua call per hash slot (one call on a single
        Redis; on a cluster the calls to one node share a pipeline, see
        ``Scripts.run_each``). Returns each append's result, in batch order; an append
        whose call failed gets that call's exception as its result (raised for it alone
        by ``append``): other slots' appends are not its fate.

        One call rather than a pipeline of one call per stream: a pipeline costs the
        gateway ~60 µs more CPU per append (measured at 64 writers on 1,000 streams), and
        the one script either runs whole or, refused before its first write (OOM), not
        at all: no batch is half applied."""
        parts = self.scripts.by_slot(list(range(len(batch))), lambda i: keys.stream_keys(batch[i][0])[0])
        if any(item[1].tenant for item in batch):  # a call counts against one tenant's quotas
            parts = [same for part in parts for same in _by_tenant(batch, part)]
        calls = [self._call(batch, part) for part in parts]
        if len(parts) == 1:  # one Redis: the call's failure is every append's (raised)
            replies = [await self.scripts.run(APPEND.name, *calls[0][:2], self._held[lane])]
        else:
            replies = await self.scripts.run_each(APPEND.name, [call[:2] for call in calls])
        results: list[Any] = [None] * len(batch)
        appended, appended_bytes = 0, 0
        for (_, _, order), part_replies in zip(calls, replies, strict=True):
            by_index = dict(zip(order, _each(part_replies, order, batch), strict=True))
            for i, reply in by_index.items():
                results[i] = reply
                sid, item, _ = batch[i]
                if item.entries and not isinstance(reply, BaseException) and status_of(reply) == "ok":
                    self.hints.mark(sid)
                    appended += 1
                    appended_bytes += positions(item.entries)
        if appended:  # counted once per batch: the metrics take a lock per call
            metrics.APPENDS.inc(appended)
            metrics.APPENDED_BYTES.inc(appended_bytes)
        return results

    def _call(self, batch: list[Queued], part: list[int]) -> tuple[list[str], list[Any], list[int]]:
        """append.lua's keys and arguments for the appends ``part`` indexes (streams of one
        slot): each stream's keys in turn, its appends in arrival order; and the batch
        index of each result the call will return, in order."""
        by_stream: dict[str, list[int]] = {}
        for index in part:
            by_stream.setdefault(batch[index][0], []).append(index)
        script_keys: list[str] = []
        tenant = batch[part[0]][1].tenant
        args: list[Any] = [*AppendArgv(self.notice_payload_bytes, keys.SUBS_WAKE_CHANNEL, tenant)]
        order: list[int] = []
        head = None
        for sid, indexes in by_stream.items():
            script_keys += self._stream_keys(sid)
            args += AppendStream(len(indexes))
            for i in indexes:
                item = batch[i][2]
                if item[0] == head:  # the same head as the append before: '' (AppendItem)
                    args.append(b"")
                    args += item[1:]
                else:
                    head = item[0]
                    args += item
            order += indexes
        if tenant:
            script_keys += self._tenant_keys(tenant)
        script_keys.append(keys.subs_outbox(batch[part[0]][0], self.scripts.cluster))
        return script_keys, args, order

    def _tenant_keys(self, tenant: str) -> list[str]:
        """A tenant's five keys this hour (keys.tenant_keys), made once an hour."""
        hour = keys.meter_hour(time.time())
        found = self._tenants.get(tenant)
        if found is None or found[0] != hour:
            if len(self._tenants) >= _KEYS_KEPT:
                self._tenants.clear()
            found = self._tenants[tenant] = (hour, keys.tenant_keys(tenant, hour))
        return found[1]

    def _stream_keys(self, sid: str) -> list[str]:
        """A stream's part of append.lua's KEYS: its five keys, then its subscription links."""
        found = self._keys.get(sid)
        if found is None:
            if len(self._keys) >= _KEYS_KEPT:
                self._keys.clear()
            found = self._keys[sid] = [*keys.stream_keys(sid), keys.stream_subs(sid)]
        return found


def _by_tenant(batch: list[Queued], part: list[int]) -> list[list[int]]:
    """``part``'s appends split by tenant, each tenant's in arrival order."""
    split: dict[str, list[int]] = {}
    for index in part:
        split.setdefault(batch[index][1].tenant, []).append(index)
    return list(split.values())


def _reason(exc: redis.exceptions.ResponseError) -> str:
    """Redis's own words of a refusal, without the command redis-py may quote with them."""
    return str(exc).rsplit(" caused error: ", 1)[-1][:200]


def _steps(entries: list[LogEntry], limit: int, most: int) -> list[list[LogEntry]]:
    """Entries in consecutive runs of at most ``limit`` stored bytes (one larger entry alone)
    and ``most`` entries."""
    parts: list[list[LogEntry]] = [[]]
    size = 0
    for entry in entries:
        if parts[-1] and (size + len(entry[1]) > limit or len(parts[-1]) >= most):
            parts.append([])
            size = 0
        parts[-1].append(entry)
        size += len(entry[1])
    return parts


class _Told:
    """Around an append's call: what its failure tells the client. One that says nothing
    was applied (NotSent, loading) stays itself (503, retry), as do the others (a
    ProtocolError, a bug); a call sent but unanswered is 504: applied or not, nobody knows.
    A context manager rather than a coroutine around the call: no frame per append."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> Literal[False]:
        if isinstance(exc, UNAVAILABLE) and not isinstance(exc, (NotSent, redis.exceptions.BusyLoadingError)):
            raise outcome_unknown() from exc
        return False


_TOLD = _Told()


async def _waiting_out_busy(send: Callable[[], Awaitable[Any]]) -> Any:
    """An append's result, sent again while a large append to its stream is under way
    ('busy'); past BUSY_WAIT_SECONDS, 503. A failure that says nothing was applied
    (NotSent, loading) stays itself (503, retry); a call sent but unanswered is 504."""
    deadline, pause = time.monotonic() + BUSY_WAIT_SECONDS, 0.002
    while True:
        with _TOLD:
            result = await send()
            if isinstance(result, BaseException):  # its slot's call failed (see _append_batch)
                raise result
        if status_of(result) != "busy":
            return result
        if time.monotonic() >= deadline:
            raise ProtocolError(
                503, "a large append to this stream is still being written", {"Retry-After": "1"}
            )
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.05)


def _each(replies: list[Any] | BaseException, order: list[int], batch: list[Queued]) -> list[Any]:
    """A call's results, one for each of the appends ``order`` indexes in ``batch`` (its
    failure once for each, or its runs expanded)."""
    if isinstance(replies, BaseException):
        return [replies] * len(order)
    if len(replies) == len(order):  # no run (over many streams, the common case)
        return replies
    return expand_runs(replies, [positions(batch[i][1].entries) for i in order])


def run_length(reply: Sequence[Any]) -> int:
    """The appends one of append.lua's results answers: a run's (its fifth field), else 1."""
    return int(reply[4]) if len(reply) == 5 and reply[0] == b"ok" else 1


def expand_runs(replies: Sequence[Any], sizes: Sequence[int]) -> list[Any]:
    """append.lua's results, one per append: a run (one ``{'ok', tail, closed, created,
    answers}`` for that many plain appends to a stream one after another) becomes one
    result each, the last taking the run's tail and each one before it the tail after it
    less the positions of the append after it (``sizes``: each append's positions, in ARGV
    order). Redis builds, sends and the gateway parses one result for the run, not one
    for each of its appends."""
    out: list[Any] = []
    for reply in replies:
        count = run_length(reply)
        if count == 1:
            out.append(reply)
            continue
        first, tail, closed, created = len(out), int(reply[1]), reply[2], reply[3]
        members: list[Any] = [None] * count
        for k in range(count - 1, -1, -1):
            members[k] = [b"ok", tail, closed, created]
            tail -= sizes[first + k]
        out += members
    return out
