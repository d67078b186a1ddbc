"""``durable-streams migrate``: bring the key layout in Redis up to this build's.

Gateways and workers refuse to start on a layout older than theirs (and on a
newer one); this runs the steps between, one at a time under a lock
(gateway/redis_io/layout.py) and reports each, then that the layout is current (it
stamps a Redis that has no version yet).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from typing import Any

from .. import config
from ..redis_io import layout
from ..redis_io.connections import general
from ..redis_io.preflight import reason
from ..telemetry import logs
from .embedded import redis_url_or_running


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser(
        "migrate",
        help="upgrade the key layout in Redis to this build's",
        description="Run the steps from the key layout Redis holds to the one this build uses, under a "
        "lock, and report each; `layout vN is current` when there is nothing to do. Without "
        "--redis-url it uses the embedded Redis of a `durable-streams serve` on the same --data-dir.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--reindex",
        action="store_true",
        help="then list in the stream index every stream missing there (idempotent): run it once "
        "gateways of a build from before layout v2 are all gone (streams they made are unlisted)",
    )
    config.add_arguments(parser, config.taken_by("migrate"))
    parser.set_defaults(main=main)


def main(ns: argparse.Namespace) -> int:
    settings = config.from_namespace(ns)
    logs.configure(settings.log_level, settings.log_format)
    try:
        redis_url = redis_url_or_running(settings.redis_url, settings.data_dir)
        asyncio.run(_migrate(redis_url, settings.redis_cluster, settings.redis_timeout, ns.reindex))
    except RuntimeError as exc:  # a refusal, said in one line
        print(f"durable-streams: {exc}", file=sys.stderr)
        return 1
    return 0


def migrate_own(url: str, say: Callable[[str], None]) -> None:
    """The embedded Redis of ``durable-streams serve`` (its own: no other build's gateways
    share it) brought up to this build's layout at start, instead of refusing."""
    asyncio.run(_migrate(url, False, 10.0, False, say))


def _print(line: str) -> None:
    print(line, flush=True)


async def _migrate(
    url: str, cluster: bool, timeout: float, reindex: bool, say: Callable[[str], None] = _print
) -> None:
    client = general(url, cluster=cluster, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        await layout.migrate(client, say)
        if reindex:
            say(f"reindexed: {await layout.index_streams(client)} stream(s) added to the index")
    except layout.Mismatch:
        raise
    except Exception as exc:  # unreachable, refused, ...: one line, exit code 1
        raise RuntimeError(f"migrate: redis: {reason(exc)}") from None
    finally:
        await client.aclose()
