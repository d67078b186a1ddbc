"""Backfill, for the delivery worker (``workers/delivery.py``): linking a pattern
subscription's existing streams.

A pattern subscription's existing streams are linked when it is made, and every worker
that starts does it for all of them (a stream created while no worker ran was recorded
nowhere). A stream created after the subscription is linked before its first byte
(-1), one created before at its tail (spec 6.2). Either is a pass (SCAN) over every
stream's key: the subscriptions that ask while a pass waits share the next one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from gateway.features.subscriptions import ALIVE_REFRESH_SECONDS, Subscriptions
from gateway.protocol import offsets
from gateway.protocol.models import text
from gateway.protocol.subscriptions import PatternIndex, SubscriptionConfig, new_wake_id
from gateway.redis_io import keys
from gateway.redis_io.connections import scan_pages
from gateway.redis_io.contracts import (
    STREAM_LINK,
    STREAM_SUBS,
    SUB_NOTE,
    SUB_RESULT,
    PathTail,
    StreamLinkArgv,
    StreamSubs,
    SubNoteArgv,
    SubResultArgv,
    status_of,
)
from gateway.redis_io.scripts import Scripts
from gateway.telemetry.logs import RateLimited

from .delivery_match import Matcher, linkable, pairs
from .health import Heartbeat

log = logging.getLogger("durable_streams.deliver")
limited = RateLimited(log)
SCAN_BATCH = 500


class Backfill:
    """Links pattern subscriptions to the streams that exist: one subscription's when a
    schedule says so (``start``), every one's when the worker starts or finds
    ``keys.SUBS_WORKER_ALIVE`` lapsed (``start_catch_up``). Its tasks run beside the deliveries,
    not in a delivery slot: they wait for a pass over the keyspace."""

    def __init__(self, scripts: Scripts, subs: Subscriptions, matcher: Matcher, heartbeat: Heartbeat) -> None:
        self.scripts = scripts
        self.subs = subs
        self.cluster = scripts.cluster
        self.matcher = matcher  # its index for the catch-up, its links for every stream found
        self.heartbeat = heartbeat
        self.tasks: set[asyncio.Task[Any]] = set()
        # Backfills waiting for the next pass over the keyspace: id -> (pattern, created ms,
        # done). One pass at a time serves every subscription that asked before it began.
        self._waiting: dict[str, tuple[str, int, asyncio.Future[None]]] = {}
        self._pass: asyncio.Task[None] | None = None

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def start_catch_up(self) -> None:
        self._spawn(self._catch_up())

    def start(self, sub: str, token: str, config: SubscriptionConfig) -> None:
        """A schedule's backfill step (sub_step.lua said so, under ``token``), reported
        to sub_result.lua when done."""
        self._spawn(self._guarded(sub, token, config))

    def stop(self) -> None:
        """Cancel the pass under way (the tasks waiting on it are the caller's to cancel)."""
        if self._pass is not None:
            self._pass.cancel()

    async def _guarded(self, sub: str, token: str, config: SubscriptionConfig) -> None:
        try:
            created = await self.backfill(sub, config)
            told = SubResultArgv("backfilled", token, created, "", 0, new_wake_id())
            result = await self.subs.call(SUB_RESULT.name, sub, *told)
            if status_of(result) == "fenced" and await self.subs.get(sub) is None:  # deleted meanwhile
                await self.subs.set_pattern(sub, None)
        except Exception as exc:  # left to the hold's expiry: another pass
            limited.log(logging.ERROR, "backfill", "linking a pattern's streams failed", exc_info=exc)

    async def backfill(self, sub: str, config: SubscriptionConfig) -> str:
        """A pattern subscription's existing streams (spec 6.2), after re-asserting its
        index entry and its explicit links' streams' side (a PUT cut short by a crash)."""
        if config.pattern is None:
            return ""
        await self.subs.set_pattern(sub, config.pattern)
        await self.subs.relink_explicit(sub, config.streams)
        state = await self.scripts.redis.hget(keys.sub_keys(sub, self.cluster)[0], "created_ms")
        if state is None:
            return ""
        waiting = self._waiting.get(sub)
        done = waiting[2] if waiting else asyncio.get_running_loop().create_future()
        self._waiting[sub] = (config.pattern, int(text(state)), done)
        if self._pass is None or self._pass.done():
            self._pass = asyncio.create_task(self._passes())
        await done
        return text(state)

    async def _passes(self) -> None:
        """Passes over the keyspace while backfills wait: 10,000 new pattern subscriptions
        cost a few passes, not 10,000."""
        while self._waiting:
            # Gateways learn within ALIVE_REFRESH_SECONDS that new streams are to be recorded;
            # a stream made before they did is in no outbox, so the pass starts after that.
            await asyncio.sleep(ALIVE_REFRESH_SECONDS + 0.5)
            batch, self._waiting = self._waiting, {}
            try:
                await self._backfill({sub: (pattern, made) for sub, (pattern, made, _) in batch.items()})
            except Exception as exc:
                for *_, done in batch.values():
                    if not done.done():
                        done.set_exception(exc)
            else:
                for *_, done in batch.values():
                    if not done.done():
                        done.set_result(None)

    async def _catch_up(self) -> None:
        """At start: every pattern subscription's streams (a stream created while no
        worker ran is in no outbox)."""
        try:
            await asyncio.sleep(ALIVE_REFRESH_SECONDS + 0.5)  # see _passes
            await self.matcher.refresh_index(force=True)
            wanted = {}
            for sub, pattern in self.matcher.patterns.items():
                created = await self.scripts.redis.hget(keys.sub_keys(sub, self.cluster)[0], "created_ms")
                if created is not None:
                    wanted[sub] = (pattern, int(text(created)))
            if wanted:
                await self._backfill(wanted)
        except Exception as exc:
            limited.log(logging.ERROR, "catch-up", "linking streams at start failed", exc_info=exc)

    async def _backfill(self, wanted: dict[str, tuple[str, int]]) -> None:
        """Link every stream matching one of ``wanted`` (id -> (pattern, created ms)):
        made after the subscription at -1, else at its tail; then tell it the tail."""
        redis = self.scripts.redis
        index = PatternIndex()
        for sub, (pattern, _) in wanted.items():
            index.add(sub, pattern)
        async for found in scan_pages(redis, keys.META_PATTERN, SCAN_BATCH):
            for key in found:
                sid = keys.key_stream_id(text(key))
                path = keys.path_of(sid)
                subs = index.match(path) if linkable(path) else []
                if subs:
                    await self._backfill_stream(sid, path, subs)
            self.heartbeat.beat()

    async def _backfill_stream(self, sid: str, path: str, subs: list[str]) -> None:
        """Link one stream to ``subs`` (idempotent: an existing link keeps its cursor; the
        stream's side may name a deleted subscription of the same id), then tell them its
        tail read after the link exists (an append between is then recorded or seen)."""
        meta, links_key = keys.stream_keys(sid)[0], keys.stream_subs(sid)
        found = StreamSubs(*await self.scripts.run(STREAM_SUBS.name, [meta, links_key], []))
        if text(found.state) != "ok":
            return
        tail = offsets.encode(int(text(found.tail)))
        added = await self.matcher.link(path, subs, tail, text(found.incarnation))
        if not added:
            return
        await self.scripts.run(STREAM_LINK.name, [links_key], [*StreamLinkArgv(""), *pairs(added, "1")])
        found = StreamSubs(*await self.scripts.run(STREAM_SUBS.name, [meta, links_key], []))
        if text(found.state) == "ok":
            tail = offsets.encode(int(text(found.tail)))
            for sub in added:
                note = PathTail(path, tail, text(found.incarnation))
                await self.subs.call(SUB_NOTE.name, sub, *SubNoteArgv(new_wake_id()), *note)
