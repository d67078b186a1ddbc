"""The aiohttp application: the features it mounts, in order (create_app)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ..config import Settings, conflict, from_env
from ..protocol import browser
from ..telemetry import metrics
from ..telemetry.logs import QUIET_MALFORMED
from . import (
    aiohttp_seam,
    buckets,
    console,
    fastpath,
    handlers,
    lifecycle,
    listing,
    ops,
    stats,
    subscriptions,
    tenants,
)
from .accesslog import AccessLog
from .context import GATEWAY
from .endpoint import add_routes, endpoint, not_found, stream_route
from .guard import Guard

__all__ = ["GATEWAY", "app_from_env", "create_app"]
log = logging.getLogger(__name__)
STREAM = {  # the protocol's stream routes: {prefix}/{path}, and a bucket's streams
    "PUT": handlers.put_stream,
    "POST": handlers.post_stream,
    "DELETE": handlers.delete_stream,
    "HEAD": handlers.head_stream,
    "GET": handlers.get_stream,
    "OPTIONS": handlers.options_stream,
}


async def app_from_env() -> web.Application:
    """For ``gunicorn gateway.http.app:app_from_env``: settings from DURABLE_STREAMS_* variables.

    Needs a Redis URL (``DURABLE_STREAMS_REDIS_URL`` or ``REDIS_URL``); only
    ``durable-streams serve`` starts an embedded Redis.
    """
    settings = from_env()
    if not settings.redis_url:
        raise RuntimeError("set DURABLE_STREAMS_REDIS_URL (or REDIS_URL) for gunicorn workers")
    problem = conflict(settings)
    if problem:
        raise RuntimeError(problem)
    return create_app(settings, settings.redis_url, drain_on_sigterm=True)


def create_app(
    settings: Settings,
    redis_url: str,
    *,
    embedded: bool = False,
    on_refusal: Callable[[str], None] = lifecycle.stop_this_process,
    drain_on_sigterm: bool = False,
) -> web.Application:
    """The gateway app for one process; it connects to ``redis_url`` on startup.
    ``embedded``: that Redis is this server's own child, so /healthz checks it too.
    ``drain_on_sigterm``: the app is this process' server (not one of a test's), and takes
    over SIGTERM for a graceful shutdown behind a load balancer (``lifecycle.drain``).

    On startup, the Redis checks (redis_io/preflight.py) run once: a refusal stops the
    start; an unreachable Redis does not: the app serves (/healthz 200, /readyz and
    stream requests 503) while a task tries again, and ``on_refusal`` is called if a
    check then refuses."""
    logging.getLogger("aiohttp.server").addFilter(QUIET_MALFORMED)  # once: the same filter object
    metrics.publish_build_info()
    # Bodies are inflated by gateway/http/bodies.py, within the size limit, not by aiohttp.
    access = AccessLog(settings.trusted_proxy_hops) if settings.access_log else None
    options: dict[str, Any] = {
        "client_max_size": settings.max_body_bytes,
        "handler_args": {"auto_decompress": False},
    }
    # Every connection aiohttp's, with plain appends answered by their own door when usable
    # (fastpath.py); either way, a client's half-close is answered (aiohttp_seam.py).
    door = fastpath.Connection if fastpath.usable(settings) else aiohttp_seam.Protocol
    app = aiohttp_seam.application(door, **options)
    if access is not None:
        app[fastpath.ACCESS] = access
    if embedded:
        app[ops.EMBEDDED_REDIS] = redis_url
    guard = _guard(settings)
    lifecycle.install(
        app, settings, redis_url, guard, on_refusal=on_refusal, drain_on_sigterm=drain_on_sigterm
    )
    stats.install(app, settings)  # the console's live statistics: this process' recorder

    sign = {"POST": handlers.sign_url, "OPTIONS": handlers.options_stream}
    add_routes(app, "/auth/sign", "sign", sign, access=access)
    ops.mount(app, access)
    # The reserved namespace ({prefix}/__ds/) is routed before the streams.
    for name, path, methods in [
        *console.routes(settings),
        *stats.routes(settings),
        *listing.routes(settings.prefix),
        *tenants.routes(settings.prefix),
        *subscriptions.routes(settings.prefix),
    ]:
        add_routes(app, path, name, methods, storage=True, access=access)
    streams = settings.prefix.rstrip("/") + "/{path:.*}"
    add_routes(app, streams, stream_route, STREAM, Guard.admit_stream, storage=True, access=access)
    if settings.prefix.rstrip("/"):  # Ursula's buckets at the root, beside the streams' prefix
        for route, path, handlers_of, is_stream in buckets.routes(STREAM):
            # A bucket's stream: the stream handlers, its path mapped (and admitted) first.
            names, admit = (stream_route, buckets.admit_bucket_stream) if is_stream else (route, None)
            add_routes(app, path, names, handlers_of, admit, storage=True, access=access)
    app.router.add_route("*", "/{anything:.*}", endpoint(not_found, "other", access=access))
    return app


def _guard(settings: Settings) -> Guard:
    """Admission for every route: token files and keys are read now (a bad one stops the
    start), and access control left off on a non-loopback address is said loudly."""
    try:
        guard = Guard(settings)
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"access control: {exc}") from None
    if not settings.auth_enabled and settings.host not in browser.LOOPBACK:
        log.warning(
            "ACCESS CONTROL IS OFF while listening on %s: anyone who can reach this port can read, "
            "write and delete every stream (docs: Security)",
            settings.host,
        )
    return guard
