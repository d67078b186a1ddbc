"""Whether the Redis we talk to keeps what it acknowledged: across a crash
(persistence) and when memory runs out (eviction)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from redis.exceptions import ResponseError

from ..telemetry.logs import OneLineError
from .connections import Client, every_node

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


async def node_config(redis: Client, pattern: str) -> list[tuple[str, dict[str, str]]]:
    """``CONFIG GET pattern`` of every node (primaries and replicas: a replica becomes the
    primary at a failover), as (node, settings); node '' on a single Redis."""
    found = []
    for target in await every_node(redis, replicas=True):
        node = target.get("target_nodes")
        config = await redis.config_get(pattern, **target)
        found.append((node.name if node else "", {_text(k): _text(v).lower() for k, v in config.items()}))
    return found


def _on(node: str) -> str:
    return f" on {node}" if node else ""


async def _judge(
    redis: Client, pattern: str, judge: Callable[[dict[str, str]], tuple[str, str | None]], unknown: str
) -> tuple[list[str], str | None]:
    """Each node's settings as ``judge`` describes them, and the first problem it finds
    (a node that forbids CONFIG, as managed Redis often does: ``unknown``)."""
    try:
        nodes = await node_config(redis, pattern)
    except ResponseError as exc:  # CONFIG refused; a node away or slow is raised: preflight tries again
        return ["unknown"], f"{unknown} ({exc})"
    described, problem = [], None
    for node, config in nodes:
        description, found = judge(config)
        described.append(description + _on(node))
        if found and problem is None:
            problem = found + _on(node)
    return described, problem


def _refuse_or_warn(problem: str | None, require: bool, warning: str) -> None:
    if problem is None:
        return
    if require:
        raise Refused(f"refusing to start (--require-durable): {problem}")
    log.warning(warning, problem)


async def check(redis: Client, *, require: bool) -> bool:
    """Log the persistence settings; with ``require``, refuse to run on risky ones.
    Whether every node is durable (a 2xx means on disk)."""

    def judge(config: dict[str, str]) -> tuple[str, str | None]:
        appendonly, appendfsync = config.get("appendonly", ""), config.get("appendfsync", "")
        return f"appendonly={appendonly} appendfsync={appendfsync}", assess(appendonly, appendfsync)

    described, problem = await _judge(redis, "append*", judge, "could not read persistence settings")
    log.info("redis persistence: %s", "; ".join(described))
    _refuse_or_warn(problem, require, "acknowledged writes are NOT fully durable: %s")
    return problem is None


async def check_eviction(redis: Client, *, require: bool) -> None:
    """Warn loudly unless Redis is set never to evict; with ``require``, refuse to run.
    A managed Redis that forbids CONFIG: said so, and (as for persistence) refused
    only under ``require``."""

    def judge(config: dict[str, str]) -> tuple[str, str | None]:
        policy = config.get("maxmemory-policy", "unknown")
        return f"maxmemory-policy={policy}", assess_eviction(policy)

    unknown = "could not read maxmemory-policy: make sure it is noeviction"
    described, problem = await _judge(redis, "maxmemory-policy", judge, unknown)
    log.info("redis eviction: %s", "; ".join(described))
    loud = "" if problem and problem.startswith("could not") else "ACKNOWLEDGED DATA CAN BE LOST: "
    _refuse_or_warn(problem, require, loud + "%s")
