"""Matching streams to subscriptions, for the delivery worker (``workers/delivery.py``):
the outboxes (``keys.subs_outbox``) and the pattern index.

append.lua and create.lua record, in the stream's slot and in the same script as the
append, each stream with subscribers whose tail moved, and (while a worker runs) each
new stream. ``Matcher.drain_outbox`` takes them (outbox_take.lua), links new streams to
the pattern subscriptions they match (the ``PatternIndex``, reloaded when
``keys.SUBS_INDEX_VERSION`` moves: the matching costs the path's depth plus the
patterns that match, not the number of patterns), tells each linked subscription the
stream's tail (sub_note.lua: what is above its acked offset is pending, an idle
subscription gets a wake), and lets the entry go (outbox_done.lua, unless the tail
moved meanwhile).
"""

from __future__ import annotations

import asyncio
import logging

from gateway.features.subscriptions import Subscriptions, flat_pairs
from gateway.protocol import offsets
from gateway.protocol.errors import ProtocolError
from gateway.protocol.models import text
from gateway.protocol.subscriptions import PatternIndex, new_wake_id, normalize_path
from gateway.redis_io import keys
from gateway.redis_io.contracts import (
    OUTBOX_DONE,
    OUTBOX_TAKE,
    STREAM_LINK,
    STREAM_SUBS,
    SUB_LINKS,
    SUB_NOTE,
    OutboxDoneArgv,
    OutboxTakeArgv,
    OutboxTaken,
    PathTail,
    StreamLink,
    StreamLinkArgv,
    StreamSubs,
    SubLinked,
    SubLinksArgv,
    SubNoteArgv,
    groups,
    status_of,
)
from gateway.redis_io.outcomes import UNAVAILABLE
from gateway.redis_io.scripts import Scripts
from gateway.telemetry import metrics
from gateway.telemetry.logs import RateLimited

from .clock import now_ms

log = logging.getLogger("durable_streams.deliver")
limited = RateLimited(log)
BATCH = 100  # outbox entries or due subscriptions taken at once
HOLD_MS = 30_000  # how long a taken outbox entry (or due subscription) stays with its worker


class Matcher:
    """The outboxes' entries told to the subscriptions linked to their streams, new
    streams linked to the patterns they match first; and the pattern index."""

    def __init__(self, scripts: Scripts, subs: Subscriptions) -> None:
        self.scripts = scripts
        self.subs = subs
        self.index = PatternIndex()
        self.patterns: dict[str, str] = {}  # pattern subscription id -> its pattern
        self._index_version: bytes | str | None = None

    async def refresh_index(self, force: bool = False) -> None:
        """The pattern subscriptions, reloaded when their version moved (checked at most
        every poll: a GET)."""
        redis = self.scripts.redis
        version = await redis.get(keys.SUBS_INDEX_VERSION)
        if version == self._index_version and not force:
            return
        patterns = {text(k): text(v) for k, v in (await redis.hgetall(keys.SUBS_INDEX)).items()}
        index = PatternIndex()
        for sub, pattern in patterns.items():
            index.add(sub, pattern)
        self.index, self.patterns, self._index_version = index, patterns, version

    async def drain_outbox(self, key: str) -> tuple[int, bool]:
        """(entries taken, whether one is due again at once: its tail moved meanwhile)."""
        taken = await self.scripts.run(OUTBOX_TAKE.name, [key], [*OutboxTakeArgv(BATCH, HOLD_MS)])
        entries = [(text(t.stream_id), int(float(t.recorded_ms))) for t in groups(OutboxTaken, taken)]
        done = await asyncio.gather(*(self._stream(key, sid, recorded) for sid, recorded in entries))
        return len(entries), not all(done)

    async def _stream(self, outbox: str, sid: str, recorded: int) -> bool:
        """Tell a stream's subscriptions its tail (linking it to the patterns it matches
        first, if it is new), then let its outbox entry go; False if it stays (moved)."""
        meta, links_key = keys.stream_keys(sid)[0], keys.stream_subs(sid)
        try:
            subs = StreamSubs(*await self.scripts.run(STREAM_SUBS.name, [meta, links_key], []))
            state, tail, inc = text(subs.state), text(subs.tail), text(subs.incarnation)
            if state == "ok":
                await self._tell(sid, links_key, tail, inc, flat_pairs(subs.links))
            else:
                await self._forget(sid, links_key, flat_pairs(subs.links))
            done = OutboxDoneArgv(sid, tail if state == "ok" else "")
            left = await self.scripts.run(OUTBOX_DONE.name, [outbox, meta], [*done])
            metrics.WAKE_LAG.observe(max(0.0, (now_ms() - recorded) / 1000))
            return bool(left)
        except Exception as exc:  # left to the hold's expiry: taken again
            if isinstance(exc, UNAVAILABLE):
                raise
            limited.log(logging.ERROR, "outbox", "telling the subscriptions of a stream failed", exc_info=exc)
            return True

    async def _tell(self, sid: str, links_key: str, position: str, inc: str, links: dict[str, str]) -> None:
        path, tail = keys.path_of(sid), offsets.encode(int(position))
        matched = links.pop("_inc", "")
        if matched != inc and linkable(path):  # a stream new to the patterns
            new = [s for s in self.index.match(path) if s not in links]
            added = await self.link(path, new, tail, inc)
            if added or links:  # (no link at all: no key to keep, stream_link would drop it again)
                await self.scripts.run(
                    STREAM_LINK.name, [links_key], [*StreamLinkArgv(inc), *pairs(added, "1")]
                )
            links.update(dict.fromkeys(added, "1"))
        gone = []
        for sub in links:
            result = await self.subs.call(
                SUB_NOTE.name, sub, *SubNoteArgv(new_wake_id()), *PathTail(path, tail, inc)
            )
            if status_of(result) == "gone" or SubLinked.of(result).types[0] == "":
                gone.append(sub)
        if gone:  # deleted subscriptions, removed links: appends stop recording for them
            await self._unlink(links_key, gone, path, tail, inc)

    async def _unlink(self, links_key: str, gone: list[str], path: str, tail: str, inc: str) -> None:
        """The streams' side of links the subscriptions no longer have; then each is asked
        again (a subscription made anew, or the stream added back, between the two steps
        wrote its side first): linked after all, the stream's side is restored."""
        await self.scripts.run(STREAM_LINK.name, [links_key], [*StreamLinkArgv(""), *pairs(gone, "")])
        back = []
        for sub in gone:
            result = await self.subs.call(
                SUB_NOTE.name, sub, *SubNoteArgv(new_wake_id()), *PathTail(path, tail, inc)
            )
            if status_of(result) == "ok" and SubLinked.of(result).types[0] != "":
                back.append(sub)
        if back:
            await self.scripts.run(STREAM_LINK.name, [links_key], [*StreamLinkArgv(""), *pairs(back, "1")])

    async def _forget(self, sid: str, links_key: str, links: dict[str, str]) -> None:
        """A deleted stream leaves the patterns' links (explicit ones stay: a stream made
        anew at the path starts over, sub_note.lua)."""
        links.pop("_inc", None)
        path = keys.path_of(sid)
        gone = []
        for sub in links:
            result = await self.subs.call(SUB_LINKS.name, sub, *SubLinksArgv("remove", "g"), path)
            if status_of(result) == "missing" or SubLinked.of(result).types[0] == "":
                gone.append(sub)
        if gone:
            await self.scripts.run(STREAM_LINK.name, [links_key], [*StreamLinkArgv(""), *pairs(gone, "")])

    async def link(self, path: str, subs: list[str], tail: str, inc: str) -> list[str]:
        """Glob links on the subscriptions' side (before the first byte if the stream was
        made after the subscription, else at ``tail``: sub_links.lua); those that exist.
        A subscription that does not is dropped from the index (deleted meanwhile)."""
        added = []
        for sub in subs:
            result = await self.subs.call(
                SUB_LINKS.name, sub, *SubLinksArgv("add", "g"), *PathTail(path, tail, inc)
            )
            if status_of(result) == "ok":
                added.append(sub)
            elif sub in self.patterns and await self.subs.get(sub) is None:
                await self.subs.set_pattern(sub, None)
        return added


def linkable(path: str) -> bool:
    """Whether a stream path is one subscriptions can name (acks normalize paths: a
    stream called ``a/`` or ``a//b`` would be acked as another, or not at all)."""
    try:
        return normalize_path(path) == path
    except ProtocolError:
        return False


def pairs(subs: list[str], value: str) -> list[str]:
    """stream_link.lua's groups: each subscription with ``value`` (its link types, '' unlink)."""
    out: list[str] = []
    for sub in subs:
        out += StreamLink(sub, value)
    return out
