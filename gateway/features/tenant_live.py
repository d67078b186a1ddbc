"""A tenant's live connections (SSE, long-poll) counted across the whole fleet, for its
``live_connections`` quota (docs/tenants.md).

Each live read takes a lease in the tenant's sorted set (``keys.tenant_live``: member
``<process>:<n>``, score the lease's end) through lua/tenant_live.lua, which drops ended
leases, counts and refuses past the quota in one step; the read gives it back when it
ends. Every ``LEASE_SECONDS / 3`` this process renews the leases it holds
(lua/tenant_renew.lua: on Redis' clock, lapsed ones added back), so the leases of a
gateway killed with connections open end, and leave the count, within ``LEASE_SECONDS``.
The connection's time is metered when it ends (``live_connection_ms``: a killed
gateway's open connections are not).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

from ..concurrency.cancelling import raise_if_cancelled
from ..redis_io import keys
from ..redis_io.contracts import TENANT_LIVE, TENANT_RENEW, TenantLiveArgv, status_of
from ..redis_io.outcomes import tenant_refusal
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
        # Held (so renewed, and given back) from before the take: a request cancelled while
        # the take is on its way leaves no lease counting until it lapses.
        self.held.setdefault(tenant, {})[member] = started = time.monotonic()
        taken = False
        try:
            reply = await self.scripts.run(TENANT_LIVE.name, script_keys, [*TenantLiveArgv(member, lease_ms)])
            if status_of(reply) == "quota":
                raise tenant_refusal("quota", reply)
            taken = True
            yield
        finally:
            mine = self.held[tenant]
            del mine[member]
            if not mine:
                del self.held[tenant]
            seconds = time.monotonic() - started if taken else 0.0
            await asyncio.shield(self._give_back(tenant, member, seconds))

    async def _give_back(self, tenant: str, member: str, seconds: float) -> None:
        pipe = self.scripts.redis.pipeline(transaction=False)
        pipe.zrem(keys.tenant_live(tenant), member)
        if seconds:
            meter = keys.meter(keys.meter_hour(time.time()))
            pipe.hincrby(meter, f"{tenant} live_connection_ms", int(seconds * 1000))
        try:
            await pipe.execute()
        except Exception as exc:  # Redis away: the lease ends by itself, the time goes uncounted
            limited.log(logging.WARNING, "live-lease", "a tenant's live lease not given back: %s", exc)

    async def renew_once(self) -> None:
        """Every lease this process holds, moved LEASE_SECONDS on (on Redis' clock: a
        gateway's own clock, ahead or behind, changes nothing), lapsed ones added back."""
        lease_ms = int(LEASE_SECONDS * 1000)
        for tenant, members in list(self.held.items()):
            if members:
                argv = TENANT_RENEW.args(lease_ms, *members)
                await self.scripts.run(TENANT_RENEW.name, [keys.tenant_live(tenant)], argv)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(LEASE_SECONDS / 3)
            try:
                await self.renew_once()
            except Exception as exc:  # Redis away: the next round tries again
                raise_if_cancelled()
                limited.log(logging.WARNING, "live-renew", "tenant live leases not renewed: %s", exc)
            raise_if_cancelled()  # (redis-py may answer with the cancellation lost: fleet.py's keep)

    async def usage(self, tenant: str) -> int:
        """The tenant's live connections on every gateway now."""
        return int(await self.scripts.redis.zcount(keys.tenant_live(tenant), int(time.time() * 1000), "+inf"))
