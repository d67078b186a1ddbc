"""A tenant's live connections (SSE, long-poll) counted across the whole fleet, for its
``live_connections`` quota (docs/tenants.md).

Each live read takes a lease in the tenant's sorted set (``keys.tenant_live``: member
``<process>:<n>``, score the lease's end) through lua/tenant_live.lua, which drops ended
leases, counts and refuses past the quota in one step; the read gives it back when it
ends. Every ``LEASE_SECONDS / 3`` this process renews the leases it holds (one ZADD XX per
tenant), so the leases of a gateway killed with connections open end, and leave the
count, within ``LEASE_SECONDS``. The connection's time is metered when it ends
(``live_connection_ms``: a killed gateway's open connections are not).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

from ..concurrency.cancelling import raise_if_cancelled
from ..protocol import tenants
from ..protocol.models import text
from ..redis_io import keys
from ..redis_io.contracts import TENANT_LIVE, QuotaRefused, TenantLiveArgv, status_of
from ..redis_io.scripts import Scripts
from ..telemetry.logs import RateLimited

log = logging.getLogger(__name__)
limited = RateLimited(log)
LEASE_SECONDS = 15.0


class LiveLeases:
    def __init__(self, scripts: Scripts) -> None:
        self.scripts = scripts
        self.process = uuid.uuid4().hex[:12]
        self.count = 0
        self.held: dict[str, dict[str, float]] = {}  # tenant -> member -> when taken (monotonic)

    @contextlib.asynccontextmanager
    async def hold(self, tenant: str) -> AsyncIterator[None]:
        """A lease for one live read of ``tenant`` for the block; 429 past its quota."""
        self.count += 1
        member = f"{self.process}:{self.count}"
        lease_ms = int(LEASE_SECONDS * 1000)
        script_keys = [keys.tenant(tenant), keys.TENANT_DEFAULTS, keys.tenant_live(tenant)]
        reply = await self.scripts.run(TENANT_LIVE.name, script_keys, [*TenantLiveArgv(member, lease_ms)])
        if status_of(reply) == "quota":
            refusal = QuotaRefused(*reply)
            raise tenants.refused(
                text(refusal.quota), int(refusal.limit), int(refusal.usage), int(refusal.asked)
            )
        mine = self.held.setdefault(tenant, {})
        mine[member] = time.monotonic()
        try:
            yield
        finally:
            started = mine.pop(member)
            if not mine:
                del self.held[tenant]
            await asyncio.shield(self._give_back(tenant, member, time.monotonic() - started))

    async def _give_back(self, tenant: str, member: str, seconds: float) -> None:
        pipe = self.scripts.redis.pipeline(transaction=False)
        pipe.zrem(keys.tenant_live(tenant), member)
        pipe.hincrby(
            keys.meter(keys.meter_hour(time.time())), f"{tenant} live_connection_ms", int(seconds * 1000)
        )
        try:
            await pipe.execute()
        except Exception as exc:  # Redis away: the lease ends by itself, the time goes uncounted
            limited.log(logging.WARNING, "live-lease", "a tenant's live lease not given back: %s", exc)

    async def renew_once(self) -> None:
        """Every lease this process holds, moved LEASE_SECONDS on."""
        if not self.held:
            return
        until = int((time.time() + LEASE_SECONDS) * 1000)
        pipe = self.scripts.redis.pipeline(transaction=False)
        for tenant, members in list(self.held.items()):
            pipe.zadd(keys.tenant_live(tenant), dict.fromkeys(members, until), xx=True)
            pipe.pexpire(keys.tenant_live(tenant), int(LEASE_SECONDS * 2000))
        await pipe.execute()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(LEASE_SECONDS / 3)
            try:
                await self.renew_once()
            except Exception as exc:  # Redis away: the next round tries again
                raise_if_cancelled()
                limited.log(logging.WARNING, "live-renew", "tenant live leases not renewed: %s", exc)

    async def usage(self, tenant: str) -> int:
        """The tenant's live connections on every gateway now."""
        return int(await self.scripts.redis.zcount(keys.tenant_live(tenant), int(time.time() * 1000), "+inf"))
