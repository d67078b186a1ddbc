"""The subscription delivery worker (``durable-streams deliver``): wakes subscriptions
(protocol section 7) from what appends recorded, and delivers their wakes.

Run as many as you like: they share the work through Redis, each piece held by one
worker at a time, with an expiry, so a worker that dies (or pauses) leaves its work
to another and at-least-once holds; every change a worker makes is a script checked
against what it holds (fencing), so a worker that lost its hold changes nothing.

1. **Outboxes** (``keys.subs_outbox``): append.lua and create.lua record, in the
   stream's slot and in the same script as the append, each stream with subscribers
   whose tail moved, and (while a worker runs) each new stream. A worker takes them
   (outbox_take.lua), links new streams to the pattern subscriptions they match (the
   ``PatternIndex``, reloaded when ``keys.SUBS_INDEX_VERSION`` moves: the matching
   costs the path's depth plus the patterns that match, not the number of patterns),
   tells each linked subscription the stream's tail (sub_note.lua: what is above its
   acked offset is pending, an idle subscription gets a wake), and lets the entry go
   (outbox_done.lua, unless the tail moved meanwhile). It learns of new entries from
   the wake channel (PUBLISH of the outbox's name) and, on one Redis, polls its one
   outbox; on Redis Cluster a sweep visits all 16384 every ``--deliver-sweep-seconds``.
2. **Schedules** (``keys.due_keys``): a subscription with something due (a wake to
   deliver, a retry, a lease running out, a backfill) is taken (due_take.lua), and
   sub_step.lua says what to do: POST the webhook (signed, spec 7.1) and report
   (sub_result.lua: done auto-acks the snapshot, 2xx waits for the callback, anything
   else is retried after 1 s doubling to 60 s, 20% jitter); write pull-wake events to
   the wake stream (an ordinary append); or link a new pattern's existing streams.
3. **Backfill**: a pattern subscription's existing streams are linked when it is made,
   and every worker that starts does it for all of them (a stream created while no
   worker ran was recorded nowhere). A stream created after the subscription is linked
   before its first byte (-1), one created before at its tail (spec 6.2).

Webhook targets are checked against the SSRF rules (protocol/ssrf.py) again at every
delivery, by the resolver the HTTP client connects through: what is checked is what is
connected to (no window for DNS rebinding), redirects are not followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Coroutine
from datetime import datetime
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from aiohttp.abc import AbstractResolver, ResolveResult
from redis.asyncio import Redis

from gateway import __version__
from gateway.archive.cold import ColdReader
from gateway.archive.files import Archive
from gateway.concurrency import backoff
from gateway.config import Settings
from gateway.features.subscriptions import (
    ALIVE_REFRESH_SECONDS,
    TOKEN_TTL_MS,
    Subscriptions,
    flat_pairs,
    wake_streams,
)
from gateway.protocol import offsets, ssrf
from gateway.protocol.entries import pack_bytes, pack_messages
from gateway.protocol.errors import ProtocolError
from gateway.protocol.models import text
from gateway.protocol.subscriptions import (
    PatternIndex,
    SubscriptionConfig,
    issue_token,
    new_wake_id,
    normalize_path,
    retry_delay_ms,
)
from gateway.protocol.webhooks import SigningKey, signature_header
from gateway.redis_io import keys
from gateway.redis_io.connections import scan_pages
from gateway.redis_io.contracts import (
    DUE_TAKE,
    OUTBOX_DONE,
    OUTBOX_TAKE,
    STREAM_LINK,
    STREAM_SUBS,
    SUB_LINKS,
    SUB_NOTE,
    SUB_RESULT,
    SUB_STEP,
    DueTakeArgv,
    OutboxDoneArgv,
    OutboxTakeArgv,
    OutboxTaken,
    PathTail,
    StreamLink,
    StreamLinkArgv,
    StreamSubs,
    SubBackfill,
    SubDeliver,
    SubEmit,
    SubLinked,
    SubLinksArgv,
    SubNoteArgv,
    SubResultArgv,
    SubStepArgv,
    SubWoke,
    groups,
    status_of,
)
from gateway.redis_io.outcomes import UNAVAILABLE
from gateway.redis_io.preflight import Preflight
from gateway.redis_io.scripts import Scripts, connect_scripts, replica_ack
from gateway.streams.store import Store
from gateway.telemetry import metrics
from gateway.telemetry.logs import RateLimited

from . import health
from .health import Heartbeat

log = logging.getLogger("durable_streams.deliver")
limited = RateLimited(log)
BATCH = 100  # outbox entries or due subscriptions taken at once
HOLD_MS = 30_000  # how long a taken outbox entry stays with its worker
BACKFILL_HOLD_MS = 600_000  # and a backfill (a pass over every key; passes are shared)
ALIVE_MS = 30_000  # keys.SUBS_WORKER_ALIVE's expiry; renewed every third of it
MAX_RESPONSE_BYTES = 64 * 1024  # of a webhook's answer: only {"done": true} matters
SCAN_BATCH = 500


def now_ms() -> int:
    return int(time.time() * 1000)


class TargetRejected(OSError):
    """A webhook host resolved to an address the SSRF rules refuse (at delivery)."""


class CheckedResolver(AbstractResolver):
    """aiohttp's resolver, answering only addresses the SSRF rules allow: the HTTP client
    connects to what was checked. An answer with any refused address is refused whole."""

    def __init__(self, policy: ssrf.TargetPolicy) -> None:
        self.policy = policy
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        try:
            allowed = {
                ipaddress.ip_address(a)
                for a in ssrf.check_addresses(host, [r["host"] for r in found], self.policy)
            }
        except ProtocolError as exc:
            raise TargetRejected(exc.message) from None
        return [r for r in found if ipaddress.ip_address(r["host"]) in allowed]

    async def close(self) -> None:
        await self._inner.close()


def _rejected(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, TargetRejected) or isinstance(getattr(seen, "os_error", None), TargetRejected):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _ms_of(iso: str) -> int:
    return int(datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() * 1000)


class Delivery:
    def __init__(
        self, settings: Settings, scripts: Scripts, store: Store, heartbeat: Heartbeat, redis_url: str
    ) -> None:
        self.settings = settings
        self.redis_url = redis_url  # --redis-url, or the embedded Redis found in --data-dir
        self.scripts = scripts
        self.store = store
        self.subs = Subscriptions(scripts)
        self.cluster = scripts.cluster
        self.heartbeat = heartbeat
        self.name = f"{socket.gethostname()}:{uuid.uuid4().hex[:8]}"
        self.policy = ssrf.parse_allow_list(settings.webhook_allow)
        self.index = PatternIndex()
        self._patterns: dict[str, str] = {}
        self._index_version: bytes | str | None = None
        self._index_at = -float("inf")
        # Outboxes to look at: on one Redis its only one, always; on a cluster those
        # announced on the wake channel or found by the sweep.
        self.dirty: set[str] = set() if self.cluster else set(keys.outbox_keys(False))
        self.wake = asyncio.Event()
        self.slots = asyncio.Semaphore(settings.webhook_concurrency)
        self.tasks: set[asyncio.Task[Any]] = set()
        self.backfills: set[asyncio.Task[Any]] = set()
        # Backfills waiting for the next pass over the keyspace: id -> (pattern, created ms,
        # done). One pass at a time serves every subscription that asked before it began.
        self._waiting: dict[str, tuple[str, int, asyncio.Future[None]]] = {}
        self._pass: asyncio.Task[None] | None = None
        self.session: aiohttp.ClientSession | None = None

    # -- plumbing -----------------------------------------------------------------

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _guarded(self, what: str, work: Awaitable[Any]) -> None:
        """One piece of work: a failure is logged and left to its hold's expiry (retried)."""
        try:
            await work
        except Exception as exc:
            if isinstance(exc, UNAVAILABLE):
                limited.log(logging.WARNING, "unavailable", "redis unavailable (%s): will retry", exc)
            else:
                limited.log(logging.ERROR, what, "%s failed; will retry", what, exc_info=exc)
        finally:
            self.slots.release()

    # -- the loops ----------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        # No DNS cache: every delivery resolves (and checks) its host anew.
        connector = aiohttp.TCPConnector(resolver=CheckedResolver(self.policy), limit=0, use_dns_cache=False)
        self.session = aiohttp.ClientSession(
            connector=connector,
            headers={"User-Agent": f"durable-streams-redis/{__version__} (webhooks)"},
            timeout=aiohttp.ClientTimeout(total=self.settings.webhook_timeout),
        )
        loops = [
            asyncio.create_task(self._announce(stop)),
            asyncio.create_task(self._listen(stop)),
            asyncio.create_task(self._sweep(stop)),
        ]
        self._spawn_free(self._catch_up())
        try:
            await self._work(stop)
        finally:
            for task in loops:
                task.cancel()
            for task in [*self.tasks, *self.backfills]:
                task.cancel()
            if self._pass is not None:
                self._pass.cancel()
            await asyncio.gather(*loops, *self.tasks, *self.backfills, return_exceptions=True)
            await self.session.close()

    async def _work(self, stop: asyncio.Event) -> None:
        failures = 0
        while not stop.is_set():
            try:
                await self.work_once()
                failures = 0
                pause = self.settings.deliver_poll_seconds
            except Exception as exc:
                if not isinstance(exc, UNAVAILABLE):
                    log.exception("delivery pass failed")
                else:
                    limited.log(logging.WARNING, "unavailable", "redis unavailable (%s): will retry", exc)
                pause = backoff.delay(failures)
                failures += 1
            self.heartbeat.beat(pause)
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._either(stop), pause)

    async def _either(self, stop: asyncio.Event) -> None:
        waits = [asyncio.create_task(stop.wait()), asyncio.create_task(self.wake.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()

    async def work_once(self) -> None:
        """One pass: the outboxes known to have entries, then every schedule."""
        for key in list(self.dirty):
            await self.refresh_index()  # new streams are matched against the patterns as of now
            taken, again = await self.drain_outbox(key)
            if taken >= BATCH or again:
                self.wake.set()  # more there (or a tail moved while it was handled): come back at once
            elif self.cluster:
                self.dirty.discard(key)
        due = 0
        for key in keys.due_keys(self.cluster):
            due += await self.drain_due(key)
        metrics.SUBSCRIPTIONS_DUE.set(due)

    async def _announce(self, stop: asyncio.Event) -> None:
        """Keep ``keys.SUBS_WORKER_ALIVE`` set: gateways record new streams while it is. Found
        lapsed (every worker away from Redis that long), the streams made meanwhile are in no
        outbox: the catch-up runs again."""
        first = True
        while not stop.is_set():
            with contextlib.suppress(Exception):
                before = await self.scripts.redis.set(
                    keys.SUBS_WORKER_ALIVE, self.name, px=ALIVE_MS, get=True
                )
                if before is None and not first:
                    self._spawn_free(self._catch_up())
                first = False
            await asyncio.sleep(ALIVE_MS / 3000)

    def _spawn_free(self, work: Coroutine[Any, Any, None]) -> None:
        """Work beside the deliveries (backfills, catch-ups): not in a delivery slot."""
        task = asyncio.create_task(work)
        self.backfills.add(task)
        task.add_done_callback(self.backfills.discard)

    async def _listen(self, stop: asyncio.Event) -> None:
        """The wake channel: outbox names, as appends record their first entry. On Redis
        Cluster a PUBLISH reaches every node's subscribers, so one node will do."""
        failures = 0
        while not stop.is_set():
            client = Redis.from_url(self.redis_url, socket_connect_timeout=5)  # connects when used
            try:
                async with client.pubsub() as pubsub:
                    await pubsub.subscribe(keys.SUBS_WAKE_CHANNEL)
                    failures = 0
                    while not stop.is_set():
                        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                        if message is not None:
                            self.dirty.add(text(message["data"]))
                            self.wake.set()
            except Exception as exc:
                limited.log(logging.WARNING, "listen", "wake channel lost (%s); polling meanwhile", exc)
                await asyncio.sleep(backoff.delay(failures))
                failures += 1
            finally:
                await client.aclose()

    async def _sweep(self, stop: asyncio.Event) -> None:
        """Redis Cluster: every outbox with an entry due, however it was missed (a lost
        wake message, a worker that died holding entries)."""
        if not self.cluster:
            return
        while not stop.is_set():
            await asyncio.sleep(self.settings.deliver_sweep_seconds)
            try:
                await self.sweep_once()
            except Exception as exc:
                limited.log(logging.WARNING, "sweep", "outbox sweep failed (%s); will retry", exc)

    async def sweep_once(self) -> None:
        names = keys.outbox_keys(self.cluster)
        redis = self.scripts.redis
        now = now_ms()
        for start in range(0, len(names), 2048):
            part = names[start : start + 2048]
            async with redis.pipeline(transaction=False) as pipe:
                for name in part:
                    pipe.zrangebyscore(name, "-inf", now, start=0, num=1)
                found = await pipe.execute()
            for name, entries in zip(part, found, strict=True):
                if entries:
                    self.dirty.add(name)
                    self.wake.set()
        self.heartbeat.beat()

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
        self.index, self._patterns, self._index_version = index, patterns, version

    # -- outboxes -------------------------------------------------------------------

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
            added = await self._link(path, new, tail, inc)
            if added or links:  # (no link at all: no key to keep, stream_link would drop it again)
                await self.scripts.run(
                    STREAM_LINK.name, [links_key], [*StreamLinkArgv(inc), *_pairs(added, "1")]
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
        await self.scripts.run(STREAM_LINK.name, [links_key], [*StreamLinkArgv(""), *_pairs(gone, "")])
        back = []
        for sub in gone:
            result = await self.subs.call(
                SUB_NOTE.name, sub, *SubNoteArgv(new_wake_id()), *PathTail(path, tail, inc)
            )
            if status_of(result) == "ok" and SubLinked.of(result).types[0] != "":
                back.append(sub)
        if back:
            await self.scripts.run(STREAM_LINK.name, [links_key], [*StreamLinkArgv(""), *_pairs(back, "1")])

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
            await self.scripts.run(STREAM_LINK.name, [links_key], [*StreamLinkArgv(""), *_pairs(gone, "")])

    async def _link(self, path: str, subs: list[str], tail: str, inc: str) -> list[str]:
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
            elif sub in self._patterns and await self.subs.get(sub) is None:
                await self.subs.set_pattern(sub, None)
        return added

    # -- schedules -------------------------------------------------------------------

    async def drain_due(self, key: str) -> int:
        free = self.settings.webhook_concurrency - len(self.tasks)
        if free <= 0:
            return 0
        taken = await self.scripts.run(DUE_TAKE.name, [key], [*DueTakeArgv(min(BATCH, free), HOLD_MS)])
        for sub in taken:
            await self.slots.acquire()
            self._spawn(self._guarded("a subscription step", self.step(text(sub))))
        return len(taken)

    async def step(self, sub: str) -> None:
        token = uuid.uuid4().hex
        hold_ms = int(self.settings.webhook_timeout * 1000) + 5000
        argv = SubStepArgv(sub, new_wake_id(), token, hold_ms, BACKFILL_HOLD_MS)
        result = await self.subs.call(SUB_STEP.name, sub, *argv)
        action = status_of(result)
        if action == "deliver":
            step = SubDeliver(*result)
            config = SubscriptionConfig.from_json(step.config.encode())
            outcome = await self.deliver(
                sub, int(step.generation), step.wake_id, config, wake_streams(step.streams), step.base_url
            )
            delay = retry_delay_ms(int(step.attempts) + 1) if outcome == "failed" else 0
            told = SubResultArgv(outcome, token, step.generation, step.wake_id, delay, new_wake_id())
            result = await self.subs.call(SUB_RESULT.name, sub, *told)
            if status_of(result) == "ok" and SubWoke(*result).new_wake == "1":
                self.wake.set()
        elif action == "emit":
            emit = SubEmit(*result)
            config = SubscriptionConfig.from_json(emit.config.encode())
            ok = await self.emit(sub, int(emit.generation), config, wake_streams(emit.streams))
            delay = 0 if ok else retry_delay_ms(int(emit.attempts or 0) + 1)
            outcome = "emitted" if ok else "failed"
            told = SubResultArgv(outcome, token, emit.generation, emit.wake_id, delay, new_wake_id())
            await self.subs.call(SUB_RESULT.name, sub, *told)
        elif action == "backfill":  # waits for a pass over the keyspace: not in a delivery slot
            config = SubscriptionConfig.from_json(SubBackfill(*result).config.encode())
            self._spawn_free(self._guarded_backfill(sub, token, config))
            self.wake.set()  # its wake, if any, is looked at in the next step

    async def _guarded_backfill(self, sub: str, token: str, config: SubscriptionConfig) -> None:
        try:
            created = await self.backfill(sub, config)
            told = SubResultArgv("backfilled", token, created, "", 0, new_wake_id())
            result = await self.subs.call(SUB_RESULT.name, sub, *told)
            if status_of(result) == "fenced" and await self.subs.get(sub) is None:  # deleted meanwhile
                await self.subs.set_pattern(sub, None)
        except Exception as exc:  # left to the hold's expiry: another pass
            limited.log(logging.ERROR, "backfill", "linking a pattern's streams failed", exc_info=exc)

    async def deliver(
        self,
        sub: str,
        gen: int,
        wake: str,
        config: SubscriptionConfig,
        streams: list[dict[str, Any]],
        base: str,
    ) -> str:
        """POST one wake (spec 7.1); the outcome for sub_result.lua."""
        assert self.session is not None and config.webhook_url is not None
        callback = f"{base}/__ds/subscriptions/{quote(sub, safe='')}/callback"
        token = issue_token(await self.subs.secret(), sub, gen, wake, "callback", TOKEN_TTL_MS, now_ms())
        body = orjson.dumps(
            {
                "subscription_id": sub,
                "wake_id": wake,
                "generation": gen,
                "streams": streams,
                "callback_url": callback,
                "callback_token": token,
            }
        )
        key: SigningKey = await self.subs.signing.signer()
        headers = {
            "Content-Type": "application/json",
            "Webhook-Signature": signature_header(key, body, int(time.time())),
        }
        started = time.perf_counter()
        outcome = "failed"
        try:
            ssrf.check_url(config.webhook_url, self.policy)
            async with self.session.post(
                config.webhook_url, data=body, headers=headers, allow_redirects=False
            ) as resp:
                answer = await resp.content.read(MAX_RESPONSE_BYTES)
                if 200 <= resp.status < 300:
                    outcome = "done" if _says_done(answer) else "accepted"
                else:
                    limited.log(
                        logging.INFO, "status", "webhook of %r answered %d: retrying", sub, resp.status
                    )
        except ProtocolError as exc:
            outcome = "rejected"
            limited.log(
                logging.WARNING, "rejected", "webhook of %r refused at delivery: %s", sub, exc.message
            )
        except Exception as exc:
            outcome = "rejected" if _rejected(exc) else "failed"
            limited.log(
                logging.INFO,
                "unreachable",
                "webhook of %r failed (%s): retrying",
                sub,
                exc or type(exc).__name__,
            )
        metrics.WEBHOOK_SECONDS.observe(time.perf_counter() - started)
        metrics.WEBHOOK_DELIVERIES.labels(outcome).inc()
        if outcome in ("done", "accepted"):
            metrics.WAKES.labels("webhook").inc()
        return "failed" if outcome == "rejected" else outcome

    async def emit(
        self, sub: str, gen: int, config: SubscriptionConfig, streams: list[dict[str, Any]]
    ) -> bool:
        """Pull-wake (spec 7.2): one wake event per pending stream on the wake stream, an
        ordinary append (the application made the stream; until it does, retried)."""
        assert config.wake_stream is not None
        sid = keys.stream_id(config.wake_stream)
        try:
            meta = await self.store.head(sid)
        except ProtocolError:
            limited.log(
                logging.WARNING, "wake-stream", "wake stream %r of %r is missing", config.wake_stream, sub
            )
            return False
        now = now_ms()
        events = [
            orjson.dumps(
                {"type": "wake", "subscription_id": sub, "stream": s["path"], "generation": gen, "ts": now}
            )
            for s in streams
        ] or [
            orjson.dumps(
                {"type": "wake", "subscription_id": sub, "stream": None, "generation": gen, "ts": now}
            )
        ]
        json = meta.media_type == "application/json"
        entries = pack_messages(events) if json else pack_bytes(b"".join(e + b"\n" for e in events))
        try:
            await self.store.append(
                sid, meta.media_type, entries, close=False, stream_seq=None, producer=None
            )
        except ProtocolError as exc:  # closed, or its content type changed
            limited.log(
                logging.WARNING, "wake-stream", "wake stream of %r refused the event: %s", sub, exc.message
            )
            return False
        metrics.WAKES.labels("pull-wake").inc()
        return True

    # -- backfill --------------------------------------------------------------------

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
            await self.refresh_index(force=True)
            wanted = {}
            for sub, pattern in self._patterns.items():
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
        added = await self._link(path, subs, offsets.encode(int(text(found.tail))), text(found.incarnation))
        if not added:
            return
        await self.scripts.run(STREAM_LINK.name, [links_key], [*StreamLinkArgv(""), *_pairs(added, "1")])
        found = StreamSubs(*await self.scripts.run(STREAM_SUBS.name, [meta, links_key], []))
        if text(found.state) == "ok":
            tail = offsets.encode(int(text(found.tail)))
            for sub in added:
                note = PathTail(path, tail, text(found.incarnation))
                await self.subs.call(SUB_NOTE.name, sub, *SubNoteArgv(new_wake_id()), *note)


def linkable(path: str) -> bool:
    """Whether a stream path is one subscriptions can name (acks normalize paths: a
    stream called ``a/`` or ``a//b`` would be acked as another, or not at all)."""
    try:
        return normalize_path(path) == path
    except ProtocolError:
        return False


def _pairs(subs: list[str], value: str) -> list[str]:
    """stream_link.lua's groups: each subscription with ``value`` (its link types, '' unlink)."""
    out: list[str] = []
    for sub in subs:
        out += StreamLink(sub, value)
    return out


def _says_done(answer: bytes) -> bool:
    try:
        parsed = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return False
    return isinstance(parsed, dict) and parsed.get("done") is True


async def run_worker(settings: Settings, redis_url: str, stop: asyncio.Event) -> None:
    """``durable-streams deliver``: work until ``stop`` is set (Redis away at start:
    wait for it)."""
    heartbeat = Heartbeat(max(60.0, settings.webhook_timeout * 3))
    metrics.publish_build_info()
    if settings.metrics_port:
        health.serve(settings.host, settings.metrics_port, heartbeat)
    scripts = connect_scripts(
        redis_url,
        cluster=settings.redis_cluster,
        max_connections=max(16, min(settings.webhook_concurrency, 128)),
        timeout=settings.redis_timeout,
        replica_ack=replica_ack(settings.min_replicas_ack, settings.min_replicas_ack_timeout),
    )
    cold = ColdReader(Archive(settings.archive_location), 16 * 1024 * 1024)
    # The wake stream's archive hints are the gateways' and the reconciliation's.
    store = Store(scripts, cold, settings.max_chunk_bytes, settings.notice_payload_bytes, archive_hints=False)
    delivery = Delivery(settings, scripts, store, heartbeat, redis_url)
    try:
        if not await Preflight(scripts.redis, prepare=scripts.load).wait(stop, heartbeat.beat):
            return
        if settings.webhook_signing_key_file:
            with open(settings.webhook_signing_key_file, "rb") as f:
                key = SigningKey.from_pem(f.read())
            if await delivery.subs.signing.add(key, now_ms()):
                log.info("webhook signing key %s added from %s", key.kid, settings.webhook_signing_key_file)
        log.info("delivering subscription wakes as %s", delivery.name)
        await delivery.run(stop)
    finally:
        await scripts.aclose()
