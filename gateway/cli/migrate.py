"""``durable-streams migrate [--finish]``: bring the key layout in Redis up to this build's.

Gateways and workers refuse to start on a layout their build does not read; this runs
the steps between under a lock (gateway/redis_io/migration.py: offline steps, then a
rolling change's expand, and with ``--finish`` its switch and contract) and reports each,
then what is left to do or that the layout is current (it stamps a Redis that has no
version yet).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any

from .. import config
from ..redis_io import fleet, keys, layout, migration
from ..redis_io.connections import general
from ..redis_io.preflight import reason
from ..telemetry import logs
from .embedded import redis_url_or_running


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser(
        "migrate",
        help="upgrade the key layout in Redis to this build's",
        description="Run the steps from the key layout Redis holds to the one this build uses, under a "
        "lock, and report each; `layout vN is current` when there is nothing to do. A rolling change "
        "is prepared without --finish (the build before can still come back) and switched to with it, "
        "once every gateway and worker runs this build (`durable-streams fleet`). Without "
        "--redis-url it uses the embedded Redis of a `durable-streams serve` on the same --data-dir.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--reindex",
        action="store_true",
        help="then list in the stream index every stream missing there (idempotent): run it once "
        "gateways of a build from before layout v2 are all gone (streams they made are unlisted)",
    )
    parser.add_argument(
        "--finish",
        action="store_true",
        help="the contract step of a rolling change: switch to writing the new layout (refused while "
        "a live gateway or worker does not read it), then rewrite what is left in the old one; "
        "no going back to the build before after it",
    )
    config.add_arguments(parser, config.taken_by("migrate"))
    parser.set_defaults(main=main)
    listing = commands.add_parser(
        "fleet",
        help="list the live gateways and workers, their builds and key layouts",
        description="The fleet registry: every live gateway and worker (host, pid, build, the key "
        "layouts it reads, the one it writes, seconds left on its lease), then the layout Redis holds. "
        "`migrate --finish` switches only when every one reads the new layout.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    config.add_arguments(listing, config.taken_by("fleet"))
    listing.set_defaults(main=list_fleet)


def main(ns: argparse.Namespace) -> int:
    settings = config.from_namespace(ns)
    logs.configure(settings.log_level, settings.log_format)
    try:
        redis_url = redis_url_or_running(settings.redis_url, settings.data_dir)
        asyncio.run(
            _migrate(redis_url, settings.redis_cluster, settings.redis_timeout, ns.reindex, ns.finish)
        )
    except RuntimeError as exc:  # a refusal, said in one line
        print(f"durable-streams: {exc}", file=sys.stderr)
        return 1
    return 0


def list_fleet(ns: argparse.Namespace) -> int:
    settings = config.from_namespace(ns)
    logs.configure(settings.log_level, settings.log_format)
    try:
        redis_url = redis_url_or_running(settings.redis_url, settings.data_dir)
        for line in asyncio.run(_fleet(redis_url, settings.redis_cluster, settings.redis_timeout)):
            print(line)
    except RuntimeError as exc:
        print(f"durable-streams: {exc}", file=sys.stderr)
        return 1
    return 0


async def _fleet(url: str, cluster: bool, timeout: float) -> list[str]:
    client = general(url, cluster=cluster, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        members = await fleet.members(client)
        raw = await client.get(keys.LAYOUT)
        written = int(raw) if raw is not None else None
        oldest = await layout.oldest_held(client, written) if written is not None else None
    except Exception as exc:
        raise RuntimeError(f"fleet: redis: {reason(exc)}") from None
    finally:
        await client.aclose()
    now_ms = time.time() * 1000
    rows = [("ROLE", "HOST:PID", "BUILD", "READS", "WRITES", "LEASE")]
    rows += [
        (m.role, f"{m.host}:{m.pid}", m.build, f"v{m.reads[0]}-v{m.reads[1]}", f"v{m.writes}",
         f"{max(0.0, (m.until_ms - now_ms) / 1000):.0f}s")
        for m in members
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if written is None:
        lines.append("key layout: none stamped yet")
    elif oldest is not None and oldest < written:
        lines.append(f"key layout: v{written} written, data of v{oldest} left (`migrate --finish` ends it)")
    else:
        lines.append(f"key layout: v{written}; this build reads v{layout.OLDEST_READ}-v{layout.CURRENT}")
    return lines


def migrate_own(url: str, say: Callable[[str], None]) -> None:
    """The embedded Redis of ``durable-streams serve`` (its own: no other build's gateways
    share it) brought up to this build's layout at start, instead of refusing. The records
    of the processes of its last run (killed outright, their leases not over) go first."""
    asyncio.run(_migrate(url, False, 10.0, False, True, say, own=True))


def _print(line: str) -> None:
    print(line, flush=True)


async def _migrate(
    url: str, cluster: bool, timeout: float, reindex: bool, finish: bool, say: Callable[[str], None] = _print,
    *, own: bool = False,
) -> None:  # fmt: skip
    client = general(url, cluster=cluster, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        if own:
            await client.delete(keys.FLEET)
        await migration.migrate(client, say, finish=finish)
        if reindex:
            say(f"reindexed: {await layout.index_streams(client)} stream(s) added to the index")
    except layout.Mismatch:
        raise
    except Exception as exc:  # unreachable, refused, ...: one line, exit code 1
        raise RuntimeError(f"migrate: redis: {reason(exc)}") from None
    finally:
        await client.aclose()
