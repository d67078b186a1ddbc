"""The due schedules, for the delivery worker (``workers/delivery.py``): what each
subscription has to do next.

A subscription with something due (``keys.due_keys``: a wake to deliver, a retry, a
lease running out, a backfill) is taken (due_take.lua), and sub_step.lua says what to
do: POST the webhook (signed, spec 7.1) and report (sub_result.lua: done auto-acks the
snapshot, 2xx waits for the callback, anything else is retried after 1 s doubling to
60 s, 20% jitter); write pull-wake events to the wake stream (an ordinary append); or
link a new pattern's existing streams. Each step holds one of
``--webhook-concurrency`` delivery slots.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Coroutine
from typing import Any

from gateway.config import Settings
from gateway.features.subscriptions import Subscriptions, wake_streams
from gateway.protocol.models import text
from gateway.protocol.subscriptions import SubscriptionConfig, new_wake_id, retry_delay_ms
from gateway.redis_io.contracts import (
    DUE_TAKE,
    SUB_RESULT,
    SUB_STEP,
    DueTakeArgv,
    SubBackfill,
    SubDeliver,
    SubEmit,
    SubResultArgv,
    SubStepArgv,
    SubWoke,
    status_of,
)
from gateway.redis_io.outcomes import UNAVAILABLE
from gateway.redis_io.scripts import Scripts
from gateway.telemetry.logs import RateLimited

from .delivery_backfill import Backfill
from .delivery_match import BATCH, HOLD_MS
from .delivery_send import Sender

BACKFILL_HOLD_MS = 600_000  # how long a backfill stays with its worker (a pass over every key; shared)


class Schedule:
    """Takes the due subscriptions of a schedule and runs each one's step in a delivery
    slot; ``wake`` is set when a step leaves more to do at once."""

    def __init__(
        self,
        settings: Settings,
        scripts: Scripts,
        subs: Subscriptions,
        sender: Sender,
        backfill: Backfill,
        wake: asyncio.Event,
        limited: RateLimited,
    ) -> None:
        self.settings = settings
        self.scripts = scripts
        self.subs = subs
        self.sender = sender
        self.backfill = backfill
        self.wake = wake
        # The worker's limiter: "redis unavailable" is one warning a while, whichever part sees it.
        self.limited = limited
        self.slots = asyncio.Semaphore(settings.webhook_concurrency)
        self.tasks: set[asyncio.Task[Any]] = set()

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
                self.limited.log(logging.WARNING, "unavailable", "redis unavailable (%s): will retry", exc)
            else:
                self.limited.log(logging.ERROR, what, "%s failed; will retry", what, exc_info=exc)
        finally:
            self.slots.release()

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
            outcome = await self.sender.deliver(
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
            ok = await self.sender.emit(sub, int(emit.generation), config, wake_streams(emit.streams))
            delay = 0 if ok else retry_delay_ms(int(emit.attempts or 0) + 1)
            outcome = "emitted" if ok else "failed"
            told = SubResultArgv(outcome, token, emit.generation, emit.wake_id, delay, new_wake_id())
            await self.subs.call(SUB_RESULT.name, sub, *told)
        elif action == "backfill":  # waits for a pass over the keyspace: not in a delivery slot
            config = SubscriptionConfig.from_json(SubBackfill(*result).config.encode())
            self.backfill.start(sub, token, config)
            self.wake.set()  # its wake, if any, is looked at in the next step
