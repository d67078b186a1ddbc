"""The ``durable-streams`` command: ``serve``, ``check`` (check.py), ``migrate``
(migrate.py), ``doctor`` (doctor.py), ``backup``/``restore``/``verify`` (backup.py) and the
client's commands (client.py: info, cat, tail, append, ...) here, more subcommands from the
``durable_streams.commands`` entry point group (``archive``: workers/commands.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from importlib.metadata import entry_points

from aiohttp import web

from .. import __version__, config
from ..protocol import access, quotas, ssrf, tenants
from ..telemetry import logs
from . import allocator, backup, check, client, doctor, migrate
from .embedded import EmbeddedRedis, Supervisor

# Entry point group of further subcommands: each entry names a function that adds
# its subparser to the ``commands`` given, with ``run`` (a function of Settings) as
# its default. The archive worker's ``archive`` comes this way (workers/commands.py).
COMMANDS = "durable_streams.commands"
# Settings whose text follows a grammar of a layer above config.py: checked when parsed,
# so a bad one is the same one line (exit code 2) as any other bad setting (every command
# taking one of them passes these: workers/commands.py too).
RULES: dict[str, Callable[[str], object]] = {
    "rate_limits": quotas.parse_rules,
    "tenant_paths": tenants.parse_path_rules,
    "auth_anonymous": access.parse_grants,
    "webhook_allow": ssrf.parse_allow_list,
}


def build_parser() -> argparse.ArgumentParser:
    parser = config.SettingsParser(
        prog="durable-streams",
        description="A Redis-backed, horizontally scaled Durable Streams server.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve_parser = commands.add_parser(
        "serve",
        help="run the HTTP gateway",
        description="Serve the Durable Streams protocol over HTTP, with all state in Redis. "
        "Without --redis-url an embedded redis-server is started in --data-dir and stopped on exit.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    config.add_arguments(serve_parser, config.taken_by("serve"), RULES)
    serve_parser.set_defaults(run=serve)
    check.register(commands)
    migrate.register(commands)
    doctor.register(commands)
    backup.register(commands)
    client.register(commands)
    registered = {entry.name: entry for entry in entry_points(group=COMMANDS)}  # one per name
    for name in sorted(registered):
        registered[name].load()(commands)
    return parser


def install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def raise_fd_limit() -> None:
    """Every SSE or long-poll client holds a file descriptor: take the hard limit, not a
    soft 1024 (containerd 2 and many distributions' defaults), which would refuse clients
    long before --max-live-connections."""
    try:
        import resource
    except ImportError:  # not on Windows
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as error:  # e.g. macOS' RLIM_INFINITY: keep what we have
            logging.getLogger("durable_streams").debug("open files limit stays %s: %s", soft, error)


def serve(settings: config.Settings) -> None:
    log = logging.getLogger("durable_streams")
    raise_fd_limit()  # before gunicorn forks: workers inherit it (and the next)
    allocator.keep_freed_memory()
    supervisor = None
    redis_url = settings.redis_url
    if not redis_url:
        embedded = EmbeddedRedis(settings.data_dir)
        embedded.start()
        redis_url = embedded.url
        log.info("embedded redis-server (%s) in %s", embedded.binary, embedded.data_dir)
        # It restarts a dead Redis; when it gives up it stops this process (gracefully,
        # as SIGTERM does, gunicorn's workers included), which then exits non-zero below.
        supervisor = Supervisor(embedded, lambda _: os.kill(os.getpid(), signal.SIGTERM))
        supervisor.start()
    try:
        if supervisor is not None:
            # Its own Redis: no gateway of another build shares it, so its key layout is
            # brought up to this build's here (with a Redis of its own, `migrate` does it).
            migrate.migrate_own(redis_url, lambda line: log.info("key %s", line))
        if settings.workers > 1:
            _run_gunicorn(settings, redis_url, embedded=supervisor is not None)
            return
        from ..http.app import create_app
        from ..http.context import GATEWAY

        install_uvloop()
        app = create_app(settings, redis_url, embedded=supervisor is not None, drain_on_sigterm=True)
        web.run_app(
            app,
            host=settings.host,
            port=settings.port,
            sock=_admin_socket(settings),
            print=lambda *_: log.info(
                "serving on http://%s:%s%s/", settings.host, settings.port, settings.prefix.rstrip("/")
            ),
            access_log=None,
            shutdown_timeout=settings.shutdown_seconds,  # after SIGTERM's delay (http/app.py)
            keepalive_timeout=settings.keepalive_seconds,  # also bounds an unfinished request head
        )
        gateway = app.get(GATEWAY)
        if gateway is not None and gateway.preflight.refusal:  # found after the start (Redis was away)
            raise RuntimeError(gateway.preflight.refusal)
    finally:
        # gunicorn workers are forks that leave through here too: only the process
        # that started Redis stops it (Supervisor.stop does nothing elsewhere).
        if supervisor is not None and os.getpid() == supervisor.redis.owner:
            supervisor.stop()
            if supervisor.failure:
                raise RuntimeError(supervisor.failure)


def _admin_socket(settings: config.Settings) -> socket.socket | None:
    """The admin listener (/metrics, /healthz, /readyz), when --admin-port is set."""
    if not settings.admin_port:
        return None
    return socket.create_server((settings.host, settings.admin_port), reuse_port=False)


def _run_gunicorn(settings: config.Settings, redis_url: str, embedded: bool = False) -> None:
    """N worker processes on one port, with ``gateway/cli/gunicorn_hooks.py`` and these settings."""
    from gunicorn.app.base import BaseApplication
    from gunicorn.errors import HaltServer

    from . import gunicorn_hooks

    # Workers' metrics add up through files here (gateway/telemetry/metrics.py); set before
    # anything imports prometheus-client, which reads it once.
    own_dir = None
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        own_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="durable-streams-metrics-")
    from ..http.app import create_app  # after the variable: prometheus-client reads it at import
    from ..redis_io import preflight

    create_app(settings, redis_url)  # a bad setting stops the start here, not in every worker
    # Redis' checks once, here: a refusal (durability, key layout) stops the start with one
    # line, not N workers failing. An unreachable Redis does not: the workers keep trying.
    cluster, durable, timeout = settings.redis_cluster, settings.require_durable, settings.redis_timeout
    asyncio.run(preflight.try_once(redis_url, cluster=cluster, require_durable=durable, timeout=timeout))

    class Gateway(BaseApplication):
        def load_config(self) -> None:
            for name in gunicorn_hooks.FIXED:
                if name in self.cfg.settings:  # e.g. control_socket_disable: gunicorn 25+
                    self.cfg.set(name, getattr(gunicorn_hooks, name))
            self.cfg.set("graceful_timeout", gunicorn_hooks.graceful_timeout(settings))
            self.cfg.set("keepalive", math.ceil(settings.keepalive_seconds))
            binds = [f"{settings.host}:{settings.port}"]
            if settings.admin_port:  # every worker serves both; the app tells them apart by port
                binds.append(f"{settings.host}:{settings.admin_port}")
            self.cfg.set("bind", binds)
            self.cfg.set("workers", settings.workers)
            self.cfg.set("loglevel", settings.log_level)

        def load(self):  # workers are forked: the settings travel with them
            async def factory() -> web.Application:
                return create_app(settings, redis_url, embedded=embedded, drain_on_sigterm=True)

            return factory

    master = os.getpid()
    try:
        Gateway().run()
    except HaltServer as exc:  # workers that failed to boot, reaped again while halting (a race
        # in gunicorn's arbiter): their reasons are logged already; the exit code says it
        raise SystemExit(exc.exit_status) from None
    finally:
        if own_dir and os.getpid() == master:  # not when a worker (a fork) leaves through here
            shutil.rmtree(own_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # a bad flag or variable: one line, exit code 2
    if getattr(args, "main", None) is not None:  # a command with options of its own (check)
        return int(args.main(args))
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # e.g. /tmp/metrics in the image: may not exist yet
        os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)
    settings = config.from_namespace(args)
    problem = config.conflict(settings)
    if problem:
        print(f"durable-streams: error: {problem}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, settings.log_format)
    try:
        args.run(settings)
    except RuntimeError as exc:  # a refusal to start, said in one line
        print(f"durable-streams: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
