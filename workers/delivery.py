"""The subscription delivery worker (``durable-streams deliver``): wakes subscriptions
(protocol section 7) from what appends recorded, and delivers their wakes.

Run as many as you like: they share the work through Redis, each piece held by one
worker at a time, with an expiry, so a worker that dies (or pauses) leaves its work
to another and at-least-once holds; every change a worker makes is a script checked
against what it holds (fencing), so a worker that lost its hold changes nothing.

``Delivery`` is the loop; the work is in its parts, each in a module of its own:

1. **Outboxes** (``delivery_match.py``, ``Matcher``): append.lua and create.lua record
   each stream with subscribers whose tail moved, and each new stream; the worker links
   new streams to the pattern subscriptions they match and tells each linked
   subscription the stream's tail. It learns of new entries from the wake channel
   (PUBLISH of the outbox's name) and, on one Redis, polls its one outbox; on Redis
   Cluster a sweep visits all 16384 every ``--deliver-sweep-seconds``.
2. **Schedules** (``delivery_schedule.py``, ``Schedule``): a subscription with something
   due is taken, and sub_step.lua says what to do: deliver a wake (``delivery_send.py``,
   ``Sender``: the webhook POST, checked against the SSRF rules at every delivery, or
   pull-wake events), or link a new pattern's existing streams.
3. **Backfill** (``delivery_backfill.py``, ``Backfill``): a pattern subscription's existing
   streams are linked when it is made, and every worker that starts does it for all of
   them (a stream created while no worker ran was recorded nowhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid

from redis.asyncio import Redis

from gateway.archive.cold import ColdReader
from gateway.archive.files import Archive
from gateway.concurrency import backoff
from gateway.concurrency.cancelling import raise_if_cancelled
from gateway.config import Settings
from gateway.features.subscriptions import Subscriptions
from gateway.protocol.models import text
from gateway.protocol.webhooks import SigningKey
from gateway.redis_io import keys
from gateway.redis_io.fleet import Membership
from gateway.redis_io.outcomes import UNAVAILABLE
from gateway.redis_io.preflight import Preflight
from gateway.redis_io.scripts import Scripts, connect_scripts, replica_ack
from gateway.streams.store import Store
from gateway.telemetry import metrics
from gateway.telemetry.logs import RateLimited

from . import health
from .clock import now_ms
from .delivery_backfill import Backfill
from .delivery_match import BATCH, Matcher
from .delivery_schedule import Schedule
from .delivery_send import Sender
from .health import Heartbeat

log = logging.getLogger("durable_streams.deliver")
limited = RateLimited(log)
ALIVE_MS = 30_000  # keys.SUBS_WORKER_ALIVE's expiry; renewed every third of it


class Delivery:
    """The worker's loops (the pass over outboxes and schedules, the announcement, the
    wake channel, the cluster's sweep) around its parts: the matcher, the sender, the
    backfill and the schedule."""

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
        # Outboxes to look at: on one Redis its only one, always; on a cluster those
        # announced on the wake channel or found by the sweep.
        self.dirty: set[str] = set() if self.cluster else set(keys.outbox_keys(False))
        self.wake = asyncio.Event()
        self.matcher = Matcher(scripts, self.subs)
        self.sender = Sender(settings, self.subs, store)
        self.backfill = Backfill(scripts, self.subs, self.matcher, heartbeat)
        self.schedule = Schedule(settings, scripts, self.subs, self.sender, self.backfill, self.wake, limited)

    async def run(self, stop: asyncio.Event) -> None:
        self.sender.open()
        loops = [
            asyncio.create_task(self._announce(stop)),
            asyncio.create_task(self._listen(stop)),
            asyncio.create_task(self._sweep(stop)),
        ]
        self.backfill.start_catch_up()
        try:
            await self._work(stop)
        finally:
            for task in loops:
                task.cancel()
            parts = [*self.schedule.tasks, *self.backfill.tasks]
            for task in parts:
                task.cancel()
            self.backfill.stop()
            await asyncio.gather(*loops, *parts, return_exceptions=True)
            await self.sender.close()

    async def _work(self, stop: asyncio.Event) -> None:
        failures = 0
        while not stop.is_set():
            try:
                await self.work_once()
                failures = 0
                pause = self.settings.deliver_poll_seconds
            except Exception as exc:
                raise_if_cancelled()  # stopping, the CancelledError lost in a library
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
            await self.matcher.refresh_index()  # new streams are matched against the patterns as of now
            taken, again = await self.matcher.drain_outbox(key)
            if taken >= BATCH or again:
                self.wake.set()  # more there (or a tail moved while it was handled): come back at once
            elif self.cluster:
                self.dirty.discard(key)
        due = 0
        for key in keys.due_keys(self.cluster):
            due += await self.schedule.drain_due(key)
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
                    self.backfill.start_catch_up()
                first = False
            await asyncio.sleep(ALIVE_MS / 3000)

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
                raise_if_cancelled()  # stopping, the CancelledError lost in a library
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
                raise_if_cancelled()  # stopping, the CancelledError lost in a library
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
        member = Membership(scripts.redis, "deliver")
        if not await Preflight(scripts.redis, prepare=scripts.load, member=member).wait(stop, heartbeat.beat):
            return
        if settings.webhook_signing_key_file:
            with open(settings.webhook_signing_key_file, "rb") as f:
                key = SigningKey.from_pem(f.read())
            if await delivery.subs.signing.add(key, now_ms()):
                log.info("webhook signing key %s added from %s", key.kid, settings.webhook_signing_key_file)
        log.info("delivering subscription wakes as %s", delivery.name)
        async with member.kept(stop):
            await delivery.run(stop)
    finally:
        await scripts.aclose()
