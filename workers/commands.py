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
from typing import Any

from gateway import config
from gateway.cli.embedded import redis_url_or_running
from gateway.cli.main import install_uvloop


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
    config.add_arguments(parser, config.COMMON + config.WORKER)
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

    redis_url = redis_url_or_running(settings.redis_url, settings.data_dir)
    install_uvloop()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await run_worker(settings, redis_url, stop)

    asyncio.run(main())
