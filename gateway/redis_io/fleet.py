"""The fleet registry: which gateways and workers run, of which build, reading which key
layouts, each under a lease it keeps renewing.

A rolling layout change (``migration.py``) may switch what is written only once every live
process reads the new layout; a process of an older build that joined after that look, or a
paused one that wakes up after the switch, must not write the old format. So joining and
switching are each one script on the same slot (``fleet_join.lua``, ``layout_switch.lua``):

* a process joins at start (``Preflight``, before it serves) and every ``LEASE_SECONDS / 3``
  after; each time the script checks that the layouts in Redis are ones its build reads,
  records the layout it writes, and answers the layout Redis holds now, which is the one the
  process writes from then on (``Membership.writing``). Refused (the layout moved past its
  build while it was away), the process stops: a gateway as at a refused start.
* ``migrate --finish`` switches only if no live member's build stops short of the next
  layout, then waits until every live member says it writes the new one.

A member that stops leaves (its record deleted); one that dies drops out when its lease ends.
Records are small JSON objects in one hash (``keys.FLEET``): a fleet of hundreds is a
few KB, read whole only by ``migrate`` and ``durable-streams fleet``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from redis.asyncio import RedisCluster

from .. import __version__
from ..concurrency.cancelling import raise_if_cancelled
from ..protocol.models import text
from . import keys, layout
from .connections import Client, server_ms
from .contracts import FLEET_JOIN, LAYOUT_SWITCH, FleetJoinArgv, FleetJoined, LayoutBehind, LayoutSwitchArgv
from .lua import source

log = logging.getLogger(__name__)


@functools.cache
def build() -> str:
    """This build, as the registry shows it: the package version and a digest of its code (its
    Python and Lua files), so two builds of one version tell apart (``0.1.0+3fa2c1d9``)."""
    digest = hashlib.sha256()
    for package in ("gateway", "workers", "durable_streams_lua"):
        spec = importlib.util.find_spec(package)  # (found, not imported)
        folders = (spec.submodule_search_locations or []) if spec is not None else []
        for folder in folders:
            for path in sorted(Path(folder).rglob("*")):
                if path.suffix in (".py", ".lua") and "__pycache__" not in path.parts:
                    digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
    return f"{__version__}+{digest.hexdigest()[:8]}"


LEASE_SECONDS = 15.0  # a member not heard of for this long is gone; renewed every third of it
MARGIN_SECONDS = 1.0  # a member stops writing this long (a quarter of short leases) before its lease ends
JOIN_KEYS = (keys.LAYOUT, keys.LAYOUT_OLDEST, keys.FLEET, keys.RESTORING)
SWITCH_KEYS = (keys.LAYOUT, keys.LAYOUT_OLDEST, keys.FLEET, keys.LAYOUT_LOCK)


@dataclass(frozen=True)
class Member:
    """One live (or lately live) process, as the registry holds it."""

    id: str
    role: str  # 'gateway' | 'archive' | 'deliver' | ...
    build: str
    host: str
    pid: int
    reads: tuple[int, int]  # the layouts its build reads, oldest and newest
    writes: int  # the layout it writes (as of its last renewal)
    until_ms: int  # when its lease ends

    @classmethod
    def of(cls, member_id: str, raw: bytes | str) -> Member:
        record = orjson.loads(raw)
        low, high = record["reads"]
        return cls(
            member_id, record["role"], record["build"], record["host"], int(record["pid"]),
            (int(low), int(high)), int(record["writes"]), int(record["until"]),
        )  # fmt: skip

    def describe(self) -> str:
        low, high = self.reads
        return f"{self.role} {self.host}:{self.pid} (build {self.build}, reads v{low}-v{high})"


async def _run(redis: Client, name: str, names: tuple[str, ...], argv: tuple[str | int, ...]) -> list[Any]:
    # Rare calls (a member's renewal, a switch): EVAL, not a loaded script's EVALSHA.
    reply = redis.eval(source(name, isinstance(redis, RedisCluster)), len(names), *names, *argv)
    return list(await reply)


class Membership:
    """This process in the registry: ``join`` (raises ``layout.Mismatch`` when refused),
    ``keep`` (renews until cancelled), ``leave``; ``writing``, the layout to write now."""

    def __init__(
        self,
        redis: Client,
        role: str,
        *,
        lease_seconds: float = LEASE_SECONDS,
        reads: tuple[int, int] = (layout.OLDEST_READ, layout.CURRENT),
    ) -> None:
        self.redis = redis
        self.role = role
        self.lease_seconds = lease_seconds
        self.reads = reads
        self.id = f"{role}:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.joined = False  # by the start-up checks (Preflight); renewals only after that
        self._writing = 0
        self._valid_until = 0.0  # (monotonic) when the lease may have ended, by this side's count
        self._record = orjson.dumps(
            {"role": role, "build": build(), "host": socket.gethostname(), "pid": os.getpid(),
             "reads": list(reads), "since": int(time.time() * 1000)}
        ).decode()  # fmt: skip

    @property
    def writing(self) -> int | None:
        """The layout this process writes now; None once its lease may have ended (paused,
        cut off from Redis): ``migrate --finish`` may have switched without it, so a write
        whose format depends on the layout must wait (answer 503) until a renewal says."""
        if not self.joined or time.monotonic() >= self._valid_until:
            return None
        return self._writing

    async def join(self) -> int:
        """Take or renew the lease; the layout to write from now on."""
        sent = time.monotonic()
        argv = FleetJoinArgv(
            self.id, self._record, *self.reads, self._writing, int(self.lease_seconds * 1000)
        )
        reply = FleetJoined(*await _run(self.redis, FLEET_JOIN.name, JOIN_KEYS, tuple(argv)))
        status, found = text(reply.status), int(reply.layout)
        if status == "restoring":
            raise layout.Mismatch("`durable-streams restore` is writing into this Redis: start after it")
        if status != "ok" and found == 0:
            raise layout.Mismatch(f"{keys.LAYOUT} is gone (Redis emptied?): start again")
        if status != "ok":
            low, high = self.reads
            problem = layout.verdict(found, high, oldest=int(reply.oldest), oldest_read=low)
            raise layout.Mismatch(
                problem or f"Redis holds key layout v{found}, which this build does not read"
            )
        if self._writing and found < self._writing:
            log.warning(
                "key layout v%s is back (was v%s): a Redis failover lost the switch?", found, self._writing
            )
        elif self._writing and found != self._writing:
            log.info("key layout v%s is written from now on (was v%s)", found, self._writing)
        self._writing, self.joined = found, True
        self._valid_until = sent + self.lease_seconds - min(MARGIN_SECONDS, self.lease_seconds / 4)
        return found

    async def keep(self, on_refusal: Callable[[str], None]) -> None:
        """Renew every third of the lease until cancelled. A Redis away is tried again at the
        next turn (the lease may lapse meanwhile: the member just drops out of ``members``);
        a refusal is told to ``on_refusal`` once, and ends the renewals."""
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            if not self.joined:  # the start-up checks join first (a fresh Redis is stamped there)
                continue
            try:
                await self.join()
            except layout.Mismatch as exc:
                on_refusal(str(exc))
                return
            except Exception as exc:  # unreachable, a failover, ...: the next turn
                raise_if_cancelled()  # stopping, the CancelledError lost in a library
                log.debug("fleet lease not renewed: %s", exc)
            # redis-py may also answer with the cancellation lost (a stop while it waited on a
            # Redis just back from a pause): the loop would renew for ever, the stop wait on it.
            raise_if_cancelled()

    @contextlib.asynccontextmanager
    async def kept(self, stop: asyncio.Event) -> AsyncIterator[None]:
        """A worker's lease renewed while the body runs (a refusal logs and sets ``stop``),
        and left when it ends."""

        def refused(why: str) -> None:
            log.error("stopping: %s", why)
            stop.set()

        renewing = asyncio.create_task(self.keep(refused))
        try:
            yield
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing
            await asyncio.wait_for(self.leave(), 5.0)

    async def leave(self) -> None:
        """Out of the registry now (a stop), not at the lease's end. Best effort."""
        with contextlib.suppress(Exception):
            await self.redis.hdel(keys.FLEET, self.id)


async def members(redis: Client) -> list[Member]:
    """The live members, oldest lease first; records of ended leases are left for joins and
    the next switch to drop."""
    found = await redis.hgetall(keys.FLEET)
    now_ms = await server_ms(redis)
    live = [Member.of(text(k), v) for k, v in found.items()]
    return sorted((m for m in live if m.until_ms >= now_ms), key=lambda m: m.until_ms)


async def switch(redis: Client, expected: int, to: int, token: str) -> None:
    """Write layout ``to`` from now on, if the migration lock is still ``token``'s, Redis holds
    ``expected`` and every live member reads ``to``; else ``layout.Mismatch`` saying why.
    ``to == expected``: the contract is done, no older layout is left (``keys.LAYOUT_OLDEST``
    dropped), under the same conditions."""
    reply = await _run(redis, LAYOUT_SWITCH.name, SWITCH_KEYS, tuple(LayoutSwitchArgv(expected, to, token)))
    status = text(reply[0])
    if status == "moved" and int(reply[1]) == -1:
        raise layout.Mismatch("the migration lock expired or changed hands: run the migration again")
    if status == "moved":
        raise layout.Mismatch(f"Redis holds key layout v{reply[1]}, not v{expected}: run the migration again")
    if status == "behind":  # (never for to == expected: the contract's end)
        behind = [Member.of("", raw) for raw in LayoutBehind.of(reply).records]
        raise layout.Mismatch(
            f"{len(behind)} live process(es) do not read key layout v{to}: "
            + "; ".join(m.describe() for m in behind)
            + ": upgrade them first (or wait for their leases to end if they are gone)"
        )
