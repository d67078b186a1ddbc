"""Appends: each POST's script arguments, encoded up front, then batched with
the appends that arrive while a round trip runs (``concurrency/batching.py``)
into one append.lua call per batch (per hash slot of it, on Redis Cluster)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import redis.exceptions

from ..concurrency.batching import Batcher
from ..protocol.conditions import IfMatch
from ..protocol.errors import bad_request
from ..protocol.headers import Producer
from ..protocol.models import AppendResult, text
from ..telemetry import metrics
from . import keys
from .client import NotSent
from .hints import Hints
from .limits import APPEND_LANES, MAX_BATCH_ENTRIES
from .outcomes import UNAVAILABLE, append_error, outcome_unknown
from .scripts import Scripts


@dataclass(frozen=True)
class AppendRequest:
    """One POST on its way to append.lua."""

    media_type: str  # '' when there is no body
    close: bool
    stream_seq: str  # '' none
    producer: Producer | None
    entries: list[bytes]
    if_match: str = ""  # IfMatch.script_arg(), '' none
    expected_offset: str = ""  # the tail position Stream-Expected-Offset names, '' none

    def script_args(self) -> list[Any]:
        """This append's part of append.lua's ARGV."""
        p = self.producer
        head: list[Any] = [self.media_type, "1" if self.close else "0", self.stream_seq]
        head += [p.id, p.epoch, p.seq] if p else ["", "", ""]
        return [*head, self.if_match, self.expected_offset, len(self.entries), *self.entries]


def encoded(args: list[Any]) -> list[bytes]:
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


Queued = tuple[str, AppendRequest, list[bytes]]  # stream id, the append, its encoded arguments


class Appends:
    def __init__(self, scripts: Scripts, hints: Hints, notice_payload_bytes: int) -> None:
        self.scripts = scripts
        self.hints = hints
        self.notice_payload_bytes = notice_payload_bytes
        self._batcher: Batcher[Queued, Any] = Batcher(
            self._append_batch,
            max_items=MAX_BATCH_ENTRIES,
            size=lambda item: sum(map(len, item[1].entries)),
            count=lambda item: max(1, len(item[1].entries)),
        )

    async def append(
        self,
        sid: str,
        media_type: str,
        entries: list[bytes],
        *,
        close: bool,
        stream_seq: str | None,
        producer: Producer | None,
        if_match: IfMatch | None = None,
        expected_offset: int | None = None,
    ) -> AppendResult:
        """POST. Concurrent appends to one stream go to Redis together; each one's
        conditions (If-Match, Stream-Expected-Offset) are checked at its turn."""
        request = AppendRequest(
            media_type if entries else "",
            close,
            stream_seq or "",
            producer,
            entries,
            if_match.script_arg() if if_match else "",
            "" if expected_offset is None else str(expected_offset),
        )
        args = encoded(request.script_args())
        # Appends wait in one of a few lanes (a stream always in the same one): whatever
        # arrives while a lane's Redis round trip runs goes in its next one.
        lane = str(zlib.crc32(sid.encode()) % APPEND_LANES)
        try:
            result = await self._batcher.submit(lane, (sid, request, args))
            if isinstance(result, BaseException):  # its slot's call failed (see _append_batch)
                raise result
        except (NotSent, redis.exceptions.BusyLoadingError):
            raise  # nothing was applied: 503, retry
        except UNAVAILABLE as exc:  # sent, unanswered: applied or not, nobody knows
            raise outcome_unknown() from exc
        status = text(result[0])
        if status in ("ok", "dup"):
            return AppendResult(
                status=status,
                tail=int(result[1]),
                closed=text(result[2]) == "1",
                producer_epoch=producer.epoch if producer else None,
                producer_seq=int(result[4]) if status == "dup" else (producer.seq if producer else None),
                created=text(result[3]) if status == "ok" and len(result) > 3 else None,
            )
        raise append_error(status, result, sid)

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
        calls = [self._call(batch, part) for part in parts]
        if len(parts) == 1:  # one Redis: the call's failure is every append's (raised)
            replies = [await self.scripts.run("append", *calls[0][:2])]
        else:
            replies = await self.scripts.run_each("append", [call[:2] for call in calls])
        results: list[Any] = [None] * len(batch)
        appended, appended_bytes = 0, 0
        for (_, _, order), part_replies in zip(calls, replies, strict=True):
            by_index = dict(zip(order, _each(part_replies, len(order)), strict=True))
            for i, reply in by_index.items():
                results[i] = reply
                sid, item, _ = batch[i]
                if item.entries and not isinstance(reply, BaseException) and text(reply[0]) == "ok":
                    self.hints.mark(sid)
                    appended += 1
                    appended_bytes += sum(map(len, item.entries))
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
        args: list[Any] = [self.notice_payload_bytes, keys.SUBS_WAKE_CHANNEL]
        order: list[int] = []
        for sid, indexes in by_stream.items():
            script_keys += keys.stream_keys(sid)
            script_keys.append(keys.stream_subs(sid))
            args.append(len(indexes))
            for i in indexes:
                args += batch[i][2]
            order += indexes
        script_keys.append(keys.subs_outbox(batch[part[0]][0], self.scripts.cluster))
        return script_keys, args, order


def _each(replies: list[Any] | BaseException, count: int) -> list[Any]:
    """A call's results, or its failure once for each of its ``count`` appends."""
    return [replies] * count if isinstance(replies, BaseException) else replies
