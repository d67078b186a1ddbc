"""``durable-streams archive``: the archive worker's subcommand.

Registered through the ``durable_streams.commands`` entry point group
(pyproject.toml), which ``gateway/cli/main.py`` reads: the gateway's command
line offers it without importing the workers. Registering imports nothing
heavy: the worker (and prometheus-client, which ``serve --workers N`` must let
read PROMETHEUS_MULTIPROC_DIR first) is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from gateway import config
from gateway.cli.embedded import redis_url_or_running
from gateway.cli.main import RULES, install_uvloop


def register_archive(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser(
        "archive",
        help="run an archive worker (Redis -> Parquet)",
        description="Move each stream's data older than the hot window from Redis to Parquet files "
        "(--archive-url), then trim Redis. Run as many as you like: they share the work. Without "
        "--redis-url it uses the embedded Redis of a `durable-streams serve` on the same --data-dir. "
        "With --metrics-port, /metrics and /healthz (a liveness probe: 503 once the loop is stuck "
        "for --archive-stall-seconds) are served there.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    config.add_arguments(parser, config.taken_by("archive"))
    parser.set_defaults(run=archive)


def archive(settings: config.Settings) -> None:
    from .archiver import run_worker

    # A busy worker's heartbeat may come only from renewing its lease (every third of it,
    # during a long round): a stall limit below two renewals would restart healthy workers.
    if settings.metrics_port and settings.archive_stall_seconds <= 2 * settings.archive_lease_seconds / 3:
        raise RuntimeError(
            f"--archive-stall-seconds ({settings.archive_stall_seconds:g}) must exceed two lease renewals "
            f"(2/3 of --archive-lease-seconds, {settings.archive_lease_seconds:g}): a worker busy with one "
            "long round would be restarted"
        )

    _run(settings, run_worker)


def _run(
    settings: config.Settings, run_worker: Callable[[config.Settings, str, asyncio.Event], Awaitable[None]]
) -> None:
    """A worker's loop until SIGTERM or SIGINT, on --redis-url or the embedded Redis."""
    redis_url = redis_url_or_running(settings.redis_url, settings.data_dir)
    install_uvloop()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await run_worker(settings, redis_url, stop)

    asyncio.run(main())


def register_deliver(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser(
        "deliver",
        help="run a subscription delivery worker (webhooks, pull-wake)",
        description="Wake subscriptions (the __ds/subscriptions APIs) from what appends recorded: "
        "deliver signed webhooks (retried with backoff) and write pull-wake events. Run as many as "
        "you like: they share the work. Without --redis-url it uses the embedded Redis of a "
        "`durable-streams serve` on the same --data-dir. With --metrics-port, /metrics and /healthz "
        "are served there.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    config.add_arguments(parser, config.taken_by("deliver"), RULES)  # a bad --webhook-allow: one line
    parser.set_defaults(run=deliver)


def deliver(settings: config.Settings) -> None:
    from .delivery import run_worker

    _run(settings, run_worker)


def register_webhook_keys(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser(
        "webhook-keys",
        help="list or rotate the webhook signing keys",
        description="The Ed25519 keys webhooks are signed with, kept in Redis and published at "
        "<prefix>/__ds/jwks.json. `rotate` adds a new key, published at once and signing after "
        "--activate-after seconds (receivers cache the JWKS up to 300 s); the keys it replaces stay "
        "published --retire-after seconds longer (a signature is accepted for 300 s).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("action", choices=("list", "rotate"))
    parser.add_argument(
        "--activate-after", type=float, default=330.0, help="seconds before the new key signs"
    )
    parser.add_argument(
        "--retire-after", type=float, default=900.0, help="seconds the old keys stay published"
    )
    config.add_arguments(parser, config.taken_by("webhook-keys"))
    parser.set_defaults(main=webhook_keys)


def webhook_keys(ns: argparse.Namespace) -> int:
    import json

    from gateway.features.subscriptions import SigningKeys
    from gateway.redis_io.scripts import connect_scripts

    settings = config.from_namespace(ns)
    redis_url = redis_url_or_running(settings.redis_url, settings.data_dir)

    async def main() -> None:
        scripts = connect_scripts(redis_url, cluster=settings.redis_cluster, max_connections=2, timeout=10.0)
        try:
            signing = SigningKeys(scripts)
            if ns.action == "rotate":
                new = await signing.rotate(int(ns.activate_after * 1000), int(ns.retire_after * 1000))
                print(f"added {new.kid}: signing in {ns.activate_after:g} s")
            print(json.dumps(await signing.listing(), indent=2))
        finally:
            await scripts.aclose()

    asyncio.run(main())
    return 0
