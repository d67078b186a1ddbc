"""What a process checks on Redis before it relies on it, and waiting for a
Redis that is not there yet.

The checks, in order: Redis answers; for gateways, that it keeps what it
acknowledges (``durability.py``: persistence, eviction); that its key layout is
the one this build uses (``layout.py``); then whatever the process prepares
(loading the scripts). A finding that forbids running (``durability.Refused``,
``layout.Mismatch``) is raised: the process must not start.

Redis may be unreachable when a process starts: it started first, a failover
is under way, a Service has no endpoint yet. Then the process starts anyway
(a gateway's /readyz answers 503, its stream requests 503 + Retry-After) and
``wait`` tries again with capped, jittered exponential backoff, one log line
per try and no traceback, until every check passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from ..concurrency import backoff
from ..concurrency.cancelling import raise_if_cancelled
from . import durability, layout
from .connections import Client, general
from .fleet import Membership

log = logging.getLogger(__name__)
REFUSALS = (durability.Refused, layout.Mismatch)


def reason(exc: BaseException) -> str:
    """An exception as the one line the log gets."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    kind = type(exc).__name__
    return f"{kind}: {text}" if text and not isinstance(exc, OSError | RedisError) else text or kind


class Preflight:
    """The start-up checks of one process on one client; ``ready`` once they passed."""

    def __init__(
        self,
        redis: Client,
        *,
        persistence: bool = False,
        require_durable: bool = False,
        prepare: Callable[[], Awaitable[None]] | None = None,
        durable: Callable[[bool], None] = lambda durable: None,
        member: Membership | None = None,
    ) -> None:
        self.redis = redis
        self.member = member  # joins the fleet registry once the layout is one it reads
        self.durable = durable  # told what the persistence check found (the metrics, in app.py)
        self.persistence = persistence  # gateways: they acknowledge writes
        self.require_durable = require_durable
        self.prepare = prepare
        self.ready = False
        self.refusal: str | None = None  # why the process must not run, once found
        self.problem = "not checked yet"  # why not ready, for the log

    async def attempt(self) -> bool:
        """One try of every check: True once all passed, False while Redis cannot be used
        (``problem`` says why). A refusal is raised (and kept in ``refusal``)."""
        try:
            await self.redis.ping()
            if self.persistence:
                self.durable(await durability.check(self.redis, require=self.require_durable))
                await durability.check_eviction(self.redis, require=self.require_durable)
            await layout.check(self.redis)
            if self.member is not None:
                await self.member.join()
            if self.prepare is not None:
                await self.prepare()
        except REFUSALS as exc:
            self.refusal = str(exc)
            raise
        except Exception as exc:  # unreachable, loading, a failover, ...: try again
            raise_if_cancelled()  # stopping, the CancelledError lost in a library
            self.problem = reason(exc)
            return False
        self.ready = True
        return True

    async def wait(
        self, stop: asyncio.Event | None = None, beat: Callable[[float], None] | None = None
    ) -> bool:
        """Try until every check passed (True) or ``stop`` is set (False). Each failed
        try is one WARNING line; ``beat(seconds)`` is told when the next try comes."""
        failures = 0
        while not await self.attempt():
            pause = backoff.delay(failures)
            failures += 1
            log.warning("redis not usable yet (%s); trying again in %.1f s", self.problem, pause)
            if beat is not None:
                beat(pause)
            if stop is None:
                await asyncio.sleep(pause)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), pause)
                if stop.is_set():
                    return False
        if failures:
            log.info("redis is usable after %d failed %s", failures, "try" if failures == 1 else "tries")
        return True


async def try_once(url: str, *, cluster: bool, require_durable: bool, timeout: float) -> bool:
    """The checks once, on a connection of their own (a gunicorn master, before it forks
    its workers): True if they passed, False if Redis could not be used (logged);
    refusals raised."""
    client = general(url, cluster=cluster, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        preflight = Preflight(client, persistence=True, require_durable=require_durable)
        if await preflight.attempt():
            return True
        log.warning(
            "redis not usable at start (%s): starting anyway; /readyz answers 503 until it is",
            preflight.problem,
        )
        return False
    finally:
        await client.aclose()
