"""The Lua scripts under ``lua/``, loaded once and called by SHA.

Each script file gets ``lua/_prelude.lua`` put in front of it, so shared
helpers are written once. redis-py's Script object runs EVALSHA and loads the
script again by itself if the server has forgotten it (a restart, a failover).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

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
)


def lua_dir() -> Path:
    """``gateway/lua``: a link to the repo's ``lua/``, a real folder inside the wheel."""
    return Path(__file__).parent / "lua"


def source(name: str) -> str:
    folder = lua_dir()
    return (folder / "_prelude.lua").read_text() + "\n" + (folder / f"{name}.lua").read_text()


class Scripts:
    """One attribute per script, each awaitable as ``script(keys=..., args=...)``."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._scripts: dict[str, AsyncScript] = {n: redis.register_script(source(n)) for n in NAMES}

    async def load(self) -> None:
        """Load every script now, so the first request does not pay for it."""
        for script in self._scripts.values():
            script.sha = await self._redis.script_load(script.script)

    def shas(self) -> list[str]:
        return [script.sha for script in self._scripts.values()]

    async def call(self, name: str, keys: list[str], args: list[Any], client: Any = None) -> Any:
        """Run a script (or, with a pipeline as ``client``, queue it there)."""
        return await self._scripts[name](keys=keys, args=args, client=client)
