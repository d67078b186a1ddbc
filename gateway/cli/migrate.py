"""``durable-streams migrate``: bring the key layout in Redis up to this build's.

Gateways and workers refuse to start on a layout older than theirs (and on a
newer one); this runs the steps between, one at a time under a lock
(gateway/storage/layout.py). Today there are none: it reports that layout v1
is current (and stamps a Redis that has no version yet).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from .. import config
from ..storage import layout
from ..storage.client import general
from ..storage.preflight import reason
from .embedded import redis_url_or_running

SETTINGS = ("redis_url", "redis_cluster", "data_dir", "redis_timeout", "log_level", "log_format")


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser(
        "migrate",
        help="upgrade the key layout in Redis to this build's",
        description="Run the steps from the key layout Redis holds to the one this build uses, under a "
        "lock, and report each; `layout vN is current` when there is nothing to do. Without "
        "--redis-url it uses the embedded Redis of a `durable-streams serve` on the same --data-dir.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    config.add_arguments(parser, SETTINGS)
    parser.set_defaults(run=run)


def run(settings: config.Settings) -> None:
    redis_url = redis_url_or_running(settings.redis_url, settings.data_dir)
    asyncio.run(_migrate(redis_url, settings.redis_cluster, settings.redis_timeout))


async def _migrate(url: str, cluster: bool, timeout: float) -> None:
    client = general(url, cluster=cluster, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        await layout.migrate(client, lambda line: print(line, flush=True))
    except layout.Mismatch:
        raise
    except Exception as exc:  # unreachable, refused, ...: one line, exit code 1
        raise RuntimeError(f"migrate: redis: {reason(exc)}") from None
    finally:
        await client.aclose()
