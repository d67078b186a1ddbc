"""Leases, for the archive worker (``workers/archiver.py``): one worker at a time on a
stream, and fencing.

The lease is a token in ``keys.lease(sid)``, renewed every third of its length while
a round runs. Every script that changes archive state checks the token inside Redis
(``Leases.call``), so a worker that lost its lease (paused past it: GC, SIGSTOP, a slow
PUT) changes nothing there; it notices (``LeaseLost``) and stops the round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from gateway.concurrency.cancelling import raise_if_cancelled
from gateway.protocol.models import text
from gateway.redis_io import keys
from gateway.redis_io.connections import Client
from gateway.redis_io.contracts import ARCHIVE_LEASE, COMPACT, SCRIPTS, status_of
from gateway.redis_io.scripts import Scripts

from .health import Heartbeat

log = logging.getLogger("durable_streams.archive")


class LeaseLost(Exception):
    """The stream's lease expired or another worker holds it: stop, change nothing."""


@dataclass
class Lease:
    """A stream's archive lease as this worker holds it."""

    sid: str
    token: str
    seconds: float
    valid_until: float  # time.monotonic(): the latest moment it surely still holds
    lost: bool = False
    tenant: str = ""  # the stream's (meta 'tn') as last read: the scripts that free bytes give them back

    def check(self) -> None:
        """Raise LeaseLost once the lease may have run out (a pause outlasted it)."""
        if self.lost or time.monotonic() >= self.valid_until:
            self.lost = True
            raise LeaseLost(keys.path_of(self.sid))


class Leases:
    """Takes, renews and releases streams' leases, and runs the archive scripts fenced
    by them. ``seconds`` is read at each take (tests shorten it on a live worker)."""

    def __init__(
        self, redis: Client, scripts: Scripts, name: str, seconds: float, heartbeat: Heartbeat
    ) -> None:
        self.redis = redis
        self.scripts = scripts
        self.name = name  # this worker's, the first part of its tokens
        self.seconds = seconds
        self.heartbeat = heartbeat

    async def call(self, script: str, lease: Lease, *args: Any) -> Any:
        """Run an archive script for the lease's stream, fenced by its token: ``args`` are
        its ARGV after the token, in the order of its description (contracts.py, which
        checks their count), but for its ``tenant``: the lease's, put in here. Every script
        but archive_lease takes the incarnation first, and its segment set as KEYS[7];
        compact its fold record (keys.fold). A script that frees bytes gets the tenant's keys
        after those; if the stream's tenant is another now (a stream adopted since: it
        answers 'tenant'), it is called again with that one."""
        contract = SCRIPTS[script]
        fields: tuple[str, ...] = contract.argv._fields if contract.argv is not None else ()  # type: ignore[attr-defined]
        at = fields.index("tenant") - 1 if "tenant" in fields else None  # (after the token)
        script_keys = [*keys.stream_keys(lease.sid), keys.lease(lease.sid)]
        if script == COMPACT.name:
            script_keys.append(keys.fold(lease.sid))
        elif script != ARCHIVE_LEASE.name:
            script_keys.append(keys.segments(lease.sid, str(args[0])))
        if at is None:
            return await self.scripts.run(script, script_keys, contract.args(lease.token, *args))
        for _ in range(3):  # (a stream is adopted once: the second call has its tenant)
            tenant = "-" if self.scripts.cluster else lease.tenant  # (no tenants on a Cluster)
            tenant_keys = keys.tenant_keys(tenant, time.time()) if tenant not in ("", "-") else []
            argv = contract.args(lease.token, *args[:at], tenant, *args[at:])
            result = await self.scripts.run(script, [*script_keys, *tenant_keys], argv)
            if status_of(result) != "tenant":
                return result
            lease.tenant = text(result[1])
        raise RuntimeError(f"{script}: the tenant of {keys.path_of(lease.sid)} keeps changing")

    async def fenced(self, script: str, lease: Lease, *args: Any) -> list[Any]:
        """Run a fenced script; LeaseLost if Redis says the lease is not ours."""
        result = await self.call(script, lease, *args)
        if status_of(result) == "lost":
            lease.lost = True
            raise LeaseLost(keys.path_of(lease.sid))
        return list(result)

    @contextlib.asynccontextmanager
    async def held(self, sid: str) -> AsyncIterator[Lease | None]:
        """The stream's lease (None: another worker holds it), renewed in the
        background while the body runs, released after."""
        token = f"{self.name}:{uuid.uuid4().hex}"
        started = time.monotonic()
        if not await self.redis.set(keys.lease(sid), token, nx=True, px=int(self.seconds * 1000)):
            yield None
            return
        lease = Lease(sid, token, self.seconds, started + self.seconds)
        renewal = asyncio.create_task(self._renew(lease))
        try:
            yield lease
        finally:
            renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewal
            with contextlib.suppress(Exception):  # fenced: frees it only if still ours; else it expires
                await self.call(ARCHIVE_LEASE.name, lease, 0)

    async def _renew(self, lease: Lease) -> None:
        """Extend the lease every third of its length; mark it lost when Redis says
        it is no longer ours, or when it could not be renewed in time."""
        while not lease.lost:
            await asyncio.sleep(lease.seconds / 3)
            sent = time.monotonic()
            if sent >= lease.valid_until:
                lease.lost = True
                return
            try:
                result = await self.call(ARCHIVE_LEASE.name, lease, int(lease.seconds * 1000))
            except Exception as error:  # Redis unreachable: try again until the lease runs out
                raise_if_cancelled()  # stopping, the CancelledError lost in a library
                log.warning("renewing the lease of %s failed: %s", keys.path_of(lease.sid), error)
                continue
            # redis-py may also answer with the cancellation lost (a round ending while the
            # renewal waited on Redis): the loop would renew for ever, the round wait on it.
            raise_if_cancelled()
            if status_of(result) != "ok":
                lease.lost = True
                return
            lease.valid_until = sent + lease.seconds
            self.heartbeat.beat()  # a long round (a large file) still shows progress
