"""Tenants in Redis (docs/tenants.md): their quotas (defaults and overrides, changed at run
time, read by the writes' scripts), their usage as the scripts keep it, and the sweep that
gives back what streams that ended without a script of theirs held (expired by Redis).

The rules (names, what a quota update may say, how usage reads) are protocol/tenants.py's;
the check and the count are lua/_tenants.lua's, in the write's own script.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import defaultdict
from datetime import date
from typing import Any

from ..archive import usage
from ..archive.files import Archive
from ..concurrency.cancelling import raise_if_cancelled
from ..protocol import tenants
from ..protocol.models import text
from ..redis_io import keys
from ..redis_io.contracts import TENANT_SWEEP, TenantSwept
from ..redis_io.scripts import Scripts
from ..telemetry.logs import RateLimited

log = logging.getLogger(__name__)
limited = RateLimited(log)

SWEEP_SECONDS = 30.0  # how often one gateway (whoever takes keys.TENANT_SWEEP) sweeps every tenant
SWEEP_PAGE = 200  # streams one tenant_sweep.lua call looks at (an HSCAN page)
UNMOVED_HOURS = 48  # a history looks for counts not yet in the usage files this far back
DEFAULTS = "_defaults"  # the defaults' name in the API (no tenant's: names start with a letter or digit)


def _fields(raw: dict[Any, Any]) -> dict[str, str]:
    return {text(k): text(v) for k, v in raw.items()}


class Tenants:
    def __init__(self, scripts: Scripts, archive: Archive | None = None) -> None:
        self.redis = scripts.redis
        self.scripts = scripts
        self.archive = archive  # where the meter's usage files are (gateway/archive/usage.py)

    async def defaults(self) -> dict[str, int]:
        """The quotas every tenant starts from (those set)."""
        return tenants.quotas_of(_fields(await self.redis.hgetall(keys.TENANT_DEFAULTS)))

    async def known(self, name: str) -> bool:
        """Whether the tenant stored something or has quotas of its own."""
        return bool(await self.redis.sismember(keys.TENANT_INDEX, name)) or bool(
            await self.redis.exists(keys.tenant(name))
        )

    async def describe(self, name: str) -> dict[str, Any]:
        """A tenant's quotas (in force, its own, the defaults) and its usage now."""
        return (await self._described([name]))[0]

    async def _described(self, names: list[str]) -> list[dict[str, Any]]:
        now_ms = int(time.time() * 1000)
        defaults = await self.defaults()
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(keys.tenant(name))
            pipe.zcount(keys.tenant_live(name), now_ms, "+inf")
        replies = await pipe.execute()
        found = []
        for i, name in enumerate(names):
            own, live = _fields(replies[2 * i]), int(replies[2 * i + 1])
            overrides = tenants.quotas_of(own)
            quotas = tenants.effective(overrides, defaults)
            period = quotas["written_period_seconds"] or tenants.DEFAULT_PERIOD_SECONDS
            usage = {**tenants.usage_of(own, now_ms, period), "live_connections": live}
            found.append({"tenant": name, "quotas": quotas, "overrides": overrides, "usage": usage})
        return found

    async def every(self, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` tenants, those storing the most first (the console's top tenants)."""
        names = sorted(text(n) for n in await self.redis.smembers(keys.TENANT_INDEX))
        found = await self._described(names)
        found.sort(key=lambda t: (-t["usage"]["stored_bytes"], t["tenant"]))
        return found[:limit]

    async def set_quotas(self, name: str, update: dict[str, int | None]) -> None:
        """A validated update (``tenants.parse_quotas``) to a tenant's own quotas, or to the
        defaults (``DEFAULTS``); one MULTI, so a write sees all of it or none."""
        key = keys.TENANT_DEFAULTS if name == DEFAULTS else keys.tenant(name)
        pipe = self.redis.pipeline(transaction=True)
        gone = [f"q.{q}" for q, v in update.items() if v is None]
        kept: dict[Any, Any] = {f"q.{q}": v for q, v in update.items() if v is not None}
        if gone:
            pipe.hdel(key, *gone)
        if kept:
            pipe.hset(key, mapping=kept)
        if name != DEFAULTS:
            pipe.sadd(keys.TENANT_INDEX, name)
        await pipe.execute()

    async def sweep(self, name: str) -> int:
        """Give back what the tenant's ended streams held (expired by Redis, soft-deleted):
        its streams walked a page at a time; its stored bytes metered (byte-seconds) up to
        now. Returns how many were given back."""
        released, cursor = 0, 0
        while True:
            cursor, page = await self.redis.hscan(keys.tenant_streams(name), cursor, count=SWEEP_PAGE)
            sids = [text(sid) for sid in page]
            if sids:
                script_keys = [*keys.tenant_keys(name, time.time()), *(keys.stream_keys(s)[0] for s in sids)]
                reply = await self.scripts.run(
                    TENANT_SWEEP.name, script_keys, [*TENANT_SWEEP.args(name, *sids)]
                )
                released += int(TenantSwept(*reply).released)
            if not cursor:
                return released

    async def sweep_all(self) -> int:
        """``sweep`` of every tenant."""
        names = sorted(text(n) for n in await self.redis.smembers(keys.TENANT_INDEX))
        return sum([await self.sweep(name) for name in names])

    async def history(self, name: str, first: date, last: date) -> dict[date, dict[str, int]]:
        """The tenant's usage per UTC day in [first, last], counter by counter: the archive's
        usage files (read in a thread) and what Redis holds not yet moved there (the last
        UNMOVED_HOURS, parts being moved). Exact between moves; a move that runs meanwhile
        may show its counts twice or not yet (read again)."""
        days: dict[date, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        if self.archive is not None:
            for _, day, counter, value in await asyncio.to_thread(
                usage.sums, self.archive.url, first, last, name
            ):
                days[day][counter] += value
        # Redis: the hours of the last UNMOVED_HOURS (the meter moves an hour two minutes
        # after it ends), and the parts being moved, by name: no SCAN of the keyspace.
        start, end = usage.hour_window(first, last)
        now = int(time.time()) // 3600 * 3600
        hours = range(now - UNMOVED_HOURS * 3600, now + 3600, 3600)
        pending = [keys.meter(h) for h in hours]
        pending += [text(k) for k in (await self.redis.hgetall(keys.METER_FLUSHING)).values()]
        for key in pending:
            hour_ms = int(key.split(":")[2]) * 1000  # ds:meter:<hour>, ds:meter-part:<hour>:<part>
            if (start is not None and hour_ms < start) or (end is not None and hour_ms >= end):
                continue
            async for field, value in self.redis.hscan_iter(key, match=f"{name} *", count=1000):
                days[usage.day_of(hour_ms)][text(field).partition(" ")[2]] += int(value)
        return {day: dict(counters) for day, counters in sorted(days.items())}

    async def run(self) -> None:
        """Every SWEEP_SECONDS, one gateway of the fleet sweeps every tenant."""
        while True:
            await asyncio.sleep(SWEEP_SECONDS * random.uniform(0.8, 1.2))
            try:
                if await self.redis.set(keys.TENANT_SWEEP, uuid.uuid4().hex, nx=True, ex=int(SWEEP_SECONDS)):
                    await self.sweep_all()
            except Exception as exc:  # Redis away: the next round tries again
                raise_if_cancelled()  # stopping, the CancelledError lost in a library
                limited.log(logging.WARNING, "tenant-sweep", "tenant sweep: %s", exc)
            raise_if_cancelled()  # (redis-py may answer with the cancellation lost: fleet.py's keep)


RATES_SECONDS = 5.0  # a tenant's rate quotas are read again this often: a change applies within it


class TenantRates:
    """Each tenant's rate quotas (``writes_per_second``, ``reads_per_second``), read from
    Redis and kept for RATES_SECONDS: the buckets themselves are exact (rate_limit.lua), only
    a changed rate takes up to that long to apply. Kept for the tenants seen recently."""

    def __init__(self, scripts: Scripts) -> None:
        self.redis = scripts.redis
        self.kept: dict[str, tuple[float, dict[str, int | None]]] = {}

    def unlimited(self, tenant: str, scope: str) -> bool:
        """Whether the tenant's rates are kept (fresh) and it has no quota for ``scope``:
        then a request needs no rate check at all (no coroutine, no round trip)."""
        found = self.kept.get(tenant)
        return (
            found is not None and time.monotonic() - found[0] < RATES_SECONDS and found[1].get(scope) is None
        )

    async def rates(self, tenant: str) -> dict[str, int | None]:
        """The tenant's rate quotas by scope ('write', 'read'), None where unlimited."""
        now = time.monotonic()
        found = self.kept.get(tenant)
        if found is not None and now - found[0] < RATES_SECONDS:
            return found[1]
        fields = [f"q.{q}" for q in tenants.RATE_QUOTAS.values()]
        pipe = self.redis.pipeline(transaction=False)
        pipe.hmget(keys.tenant(tenant), fields)
        pipe.hmget(keys.TENANT_DEFAULTS, fields)
        own, defaults = await pipe.execute()
        rates = {
            scope: (int(mine) if mine is not None else int(default) if default is not None else None)
            for scope, mine, default in zip(tenants.RATE_QUOTAS, own, defaults, strict=True)
        }
        if len(self.kept) >= 10_000:
            self.kept.clear()
        self.kept[tenant] = (now, rates)
        return rates
