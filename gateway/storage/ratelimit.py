"""Rate limits shared by every gateway: token buckets in Redis (``lua/rate_limit.lua``).

One bucket per client and rule (``keys.rate_bucket``), taken from in one
script call, on Redis' clock: gateways share the buckets and need no clock
of their own in step. The rules and which one a request falls under are
``protocol/quotas.py``.

A failing Redis is not a pass: ``take`` raises what redis-py raised (counted
in the metrics as the ``rate_limit`` call), and the caller answers as for any
other Redis failure (503 when unreachable, see ``outcomes.UNAVAILABLE``).
Letting requests through unlimited would gain nothing: each of them needs the
same Redis for the stream itself.
"""

from __future__ import annotations

from redis.asyncio import Redis

from ..protocol.quotas import RateRule
from . import keys
from .scripts import Scripts, timed


class RateLimiter:
    def __init__(self, redis: Redis, scripts: Scripts) -> None:
        self.redis = redis
        self.scripts = scripts

    async def take(self, identity: str, rule: RateRule, cost: int = 1) -> float:
        """Take ``cost`` tokens from ``identity``'s bucket under ``rule``: 0.0 when
        taken, else the seconds until they will be there (Retry-After; nothing taken).
        One round trip. A cost above the rule's burst takes a full bucket."""
        if cost < 0:
            raise ValueError(f"a rate limit cost cannot be negative: {cost}")
        taken, retry_ms = await timed(
            "rate_limit",
            self.scripts.call(
                "rate_limit",
                [keys.rate_bucket(identity, rule.key)],
                [rule.per_second, rule.burst, cost],
                client=self.redis,
            ),
        )
        return 0.0 if taken else int(retry_ms) / 1000
