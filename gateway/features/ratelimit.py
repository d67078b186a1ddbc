"""Rate limits shared by every gateway: token buckets in Redis (``lua/rate_limit.lua``).

One bucket per client and rule (``keys.rate_bucket``), on Redis' clock:
gateways share the buckets and need no clock of their own in step. The rules
and which one a request falls under are ``protocol/quotas.py``.

Takes are group-committed like appends (``concurrency/batching.py``): the
first goes at once, those that arrive while it runs go together in the next
call, which takes for each in arrival order. Under load a process pays one
round trip (and one AOF write) per batch, not per request.

A failing Redis is not a pass: ``take`` raises what redis-py raised (counted
in the metrics as the ``rate_limit`` call), and the caller answers as for any
other Redis failure (503 when unreachable, see ``outcomes.UNAVAILABLE``).
Letting requests through unlimited would gain nothing: each of them needs the
same Redis for the stream itself.
"""

from __future__ import annotations

import functools

from ..concurrency.batching import Batcher
from ..protocol.quotas import RateRule
from ..redis_io import keys
from ..redis_io.contracts import RATE_LIMIT, RateTake
from ..redis_io.limits import MAX_BATCH_ENTRIES
from ..redis_io.scripts import Scripts

_Take = tuple[str, float, float, int]  # bucket key, rate, burst, cost
_Wait = float | BaseException  # seconds to wait, or why the take failed
_bucket = functools.lru_cache(maxsize=65536)(keys.rate_bucket)  # two SHA-256 per name: once per client


class RateLimiter:
    def __init__(self, scripts: Scripts) -> None:
        self.scripts = scripts
        self.redis = scripts.redis  # where the buckets live
        self._batcher: Batcher[_Take, float | BaseException] = Batcher(
            self._take_batch, max_items=MAX_BATCH_ENTRIES
        )

    async def take(self, identity: str, rule: RateRule, cost: int = 1) -> float:
        """Take ``cost`` tokens from ``identity``'s bucket under ``rule``: 0.0 when
        taken, else the seconds until they will be there (Retry-After; nothing taken).
        A cost above the rule's burst takes a full bucket."""
        if cost < 0:
            raise ValueError(f"a rate limit cost cannot be negative: {cost}")
        take = (_bucket(identity, rule.key), rule.per_second, rule.burst, cost)
        wait = await self._batcher.submit("", take)
        if isinstance(wait, BaseException):  # its slot's call failed (see _take_batch)
            raise wait
        return wait

    async def _take_batch(self, _: str, takes: list[_Take]) -> list[_Wait]:
        """One rate_limit.lua call per hash slot of the batch's buckets (one on a single
        Redis; on Redis Cluster a call's keys must share a slot: ``Scripts.run_each``). A
        call that fails fails its own takes only: other shards' clients are served."""
        parts = self.scripts.by_slot(list(range(len(takes))), lambda i: takes[i][0])
        calls = [self._call(takes, part) for part in parts]
        if len(parts) == 1:
            return [int(ms) / 1000 for ms in await self.scripts.run(RATE_LIMIT.name, *calls[0])]
        waits: list[_Wait] = [0.0] * len(takes)
        for part, replies in zip(parts, await self.scripts.run_each(RATE_LIMIT.name, calls), strict=True):
            for n, i in enumerate(part):
                waits[i] = replies if isinstance(replies, BaseException) else int(replies[n]) / 1000
        return waits

    @staticmethod
    def _call(takes: list[_Take], part: list[int]) -> tuple[list[str], list[float]]:
        """rate_limit.lua's keys and ARGV (no fixed part: a group per key)."""
        args: list[float] = []
        for i in part:
            _key, rate, burst, cost = takes[i]
            args += RateTake(rate, burst, cost)
        return [takes[i][0] for i in part], args
