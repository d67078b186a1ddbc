"""Whether the Redis we talk to keeps what it acknowledged: across a crash
(persistence) and when memory runs out (eviction)."""

from __future__ import annotations

import logging

from redis.asyncio import Redis

from ..telemetry.logs import OneLineError

log = logging.getLogger(__name__)
EVICTION_FIX = "CONFIG SET maxmemory-policy noeviction (and maxmemory-policy noeviction in redis.conf)"


class Refused(OneLineError):
    """--require-durable, and this Redis could lose acknowledged writes: do not start."""


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def assess(appendonly: str, appendfsync: str) -> str | None:
    """None when every acknowledged write is on disk; else what could be lost."""
    if appendonly != "yes":
        return "appendonly is off: a Redis crash or restart loses writes since the last snapshot"
    if appendfsync != "always":
        return f"appendfsync is {appendfsync!r}: a crash can lose up to ~1s of acknowledged writes"
    return None


def assess_eviction(policy: str) -> str | None:
    """None when Redis never deletes keys to make room; else what that means for us."""
    if policy == "noeviction":
        return None
    return (
        f"maxmemory-policy is {policy!r}: at maxmemory Redis deletes keys to make room, "
        f"acknowledged streams included; fix: {EVICTION_FIX}"
    )


async def _config(redis: Redis, pattern: str) -> dict[str, str]:
    return {_text(k): _text(v).lower() for k, v in (await redis.config_get(pattern)).items()}


async def check(redis: Redis, *, require: bool) -> None:
    """Log the persistence settings; with ``require``, refuse to run on risky ones."""
    problem: str | None
    try:
        config = await _config(redis, "append*")
        appendonly = config.get("appendonly", "")
        appendfsync = config.get("appendfsync", "")
    except Exception as exc:  # managed Redis often forbids CONFIG
        problem = f"could not read persistence settings ({exc})"
        appendonly = appendfsync = "unknown"
    else:
        problem = assess(appendonly, appendfsync)
    log.info("redis persistence: appendonly=%s appendfsync=%s", appendonly, appendfsync)
    if problem is None:
        return
    if require:
        raise Refused(f"refusing to start (--require-durable): {problem}")
    log.warning("acknowledged writes are NOT fully durable: %s", problem)


async def check_eviction(redis: Redis, *, require: bool) -> None:
    """Warn loudly unless Redis is set never to evict; with ``require``, refuse to run.
    A managed Redis that forbids CONFIG: said so, and (as for persistence) refused
    only under ``require``."""
    problem: str | None
    try:
        policy = (await _config(redis, "maxmemory-policy")).get("maxmemory-policy", "unknown")
    except Exception as exc:
        policy = "unknown"
        problem = f"could not read maxmemory-policy ({exc}): make sure it is noeviction"
    else:
        problem = assess_eviction(policy)
    log.info("redis eviction: maxmemory-policy=%s", policy)
    if problem is None:
        return
    if require:
        raise Refused(f"refusing to start (--require-durable): {problem}")
    log.warning("%s%s", "" if policy == "unknown" else "ACKNOWLEDGED DATA CAN BE LOST: ", problem)
