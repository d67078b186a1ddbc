"""The Lua scripts, loaded once and called by SHA.

They ship as the package ``durable_streams_lua``: the repository's ``lua/``
directory, mapped to that name in pyproject.toml, read with importlib.resources
(from the source tree in an editable install, from the wheel otherwise). Each
script gets ``_prelude.lua`` put in front of it, so shared helpers are written
once. redis-py's Script object runs EVALSHA and loads the script again by
itself if the server has forgotten it (a restart, a failover).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from importlib import resources
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from ..telemetry import metrics
from . import keys

PACKAGE = "durable_streams_lua"
NAMES = (
    "create",
    "append",
    "read",
    "read_range",
    "delete",
    "fork_ref",
    "release_fork",
    # the archive worker's (KEYS: the stream's five and its lease; fenced by the lease)
    "archive_lease",
    "archive_named",
    "archive_stage",
    "archive_commit",
    "archive_forget",
    "archive_check",
    "archive_retain",
    # KEYS: one token bucket (keys.rate_bucket), no stream's; see storage/ratelimit.py
    "rate_limit",
)


def source(name: str) -> str:
    """A script's text as Redis gets it: the prelude, then the script."""
    folder = resources.files(PACKAGE)
    return (folder / "_prelude.lua").read_text() + "\n" + (folder / f"{name}.lua").read_text()


async def timed(name: str, call: Awaitable[Any]) -> Any:
    """A Redis round trip, in the metrics by ``name`` (its script's, or e.g. 'read_bulk')."""
    started = time.perf_counter()
    try:
        return await call
    except Exception as exc:
        metrics.REDIS_ERRORS.labels(name, type(exc).__name__).inc()
        raise
    finally:
        metrics.child(metrics.REDIS_SECONDS, name).observe(time.perf_counter() - started)


class Scripts:
    """Every script, registered on one client."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._scripts: dict[str, AsyncScript] = {n: redis.register_script(source(n)) for n in NAMES}

    @property
    def redis(self) -> Redis:
        """The client the scripts run on."""
        return self._redis

    async def load(self) -> None:
        """Load every script now, so the first request does not pay for it."""
        for script in self._scripts.values():
            script.sha = await self._redis.script_load(script.script)

    def shas(self) -> list[str]:
        return [script.sha for script in self._scripts.values()]

    async def call(self, name: str, keys: list[str], args: list[Any], client: Any = None) -> Any:
        """Run a script (or, with a pipeline as ``client``, queue it there)."""
        return await self._scripts[name](keys=keys, args=args, client=client)

    async def run(self, name: str, script_keys: list[str], args: list[Any]) -> Any:
        """Run a script, timed and counted in the metrics."""
        return await timed(name, self.call(name, script_keys, args))

    async def on_stream(self, name: str, sid: str, *args: Any) -> Any:
        """Run a script on one stream's keys (``keys.stream_keys``), timed."""
        return await self.run(name, keys.stream_keys(sid), list(args))
