"""Whether the Redis we talk to keeps acknowledged writes across a crash."""

from __future__ import annotations

import logging

from redis.asyncio import Redis

log = logging.getLogger(__name__)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def assess(appendonly: str, appendfsync: str) -> str | None:
    """None when every acknowledged write is on disk; else what could be lost."""
    if appendonly != "yes":
        return "appendonly is off: a Redis crash or restart loses writes since the last snapshot"
    if appendfsync != "always":
        return f"appendfsync is {appendfsync!r}: a crash can lose up to ~1s of acknowledged writes"
    return None


async def check(redis: Redis, *, require: bool) -> None:
    """Log the persistence settings; with ``require``, refuse to run on risky ones."""
    problem: str | None
    try:
        config = {_text(k): _text(v) for k, v in (await redis.config_get("append*")).items()}
        appendonly = config.get("appendonly", "").lower()
        appendfsync = config.get("appendfsync", "").lower()
    except Exception as exc:  # managed Redis often forbids CONFIG
        problem = f"could not read persistence settings ({exc})"
        appendonly = appendfsync = "unknown"
    else:
        problem = assess(appendonly, appendfsync)
    log.info("redis persistence: appendonly=%s appendfsync=%s", appendonly, appendfsync)
    if problem is None:
        return
    if require:
        raise RuntimeError(f"refusing to start (--require-durable): {problem}")
    log.warning("acknowledged writes are NOT fully durable: %s", problem)
