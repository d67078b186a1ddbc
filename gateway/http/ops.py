"""The operations endpoints: /healthz (liveness), /readyz (readiness), /metrics."""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from aiohttp import web

from ..telemetry import metrics
from ..telemetry.logs import RateLimited
from .accesslog import AccessLog
from .context import GATEWAY
from .endpoint import Admit, add_routes

log = logging.getLogger(__name__)
limited = RateLimited(log)
EMBEDDED_REDIS = web.AppKey("embedded_redis", str)  # the URL of the Redis this server runs itself


def _admit_ops(route: str) -> Admit:
    return lambda guard, request: guard.admit_ops(request, route)


async def metrics_page(request: web.Request) -> web.Response:
    body, content_type = metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def healthz(request: web.Request) -> web.Response:
    """Liveness. With the embedded Redis (``durable-streams serve`` without --redis-url,
    which restarts it when it dies) also that Redis: 503 while it is down, on a
    connection of its own (not queued behind the pool). With an external Redis,
    liveness does not depend on Redis (an outage must not restart every gateway):
    /readyz reports it."""
    url = request.app.get(EMBEDDED_REDIS)
    if url:
        client = aioredis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        try:
            await client.ping()
        except Exception as exc:
            limited.log(logging.WARNING, "healthz", "embedded redis down: %s", exc)
            return web.Response(status=503, text="embedded storage down\n")
        finally:
            await client.aclose()
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    if gw.draining:  # SIGTERM came: out of the load balancer before this process stops listening
        return web.Response(status=503, text="not ready: shutting down\n")
    if not gw.preflight.ready:  # unreachable at start, or a check not passed yet (logged)
        return web.Response(status=503, text="not ready: waiting for storage\n")
    try:
        await gw.store.check_ready()
    except Exception as exc:  # the details (addresses, paths) go to the log, not to whoever asks
        limited.log(logging.WARNING, "readyz", "not ready: redis: %s", exc)
        return web.Response(status=503, text="not ready: storage unavailable\n")
    return web.Response(text="ready\n")


def mount(app: web.Application, access: AccessLog | None) -> None:
    """The operations endpoints, admitted by the Guard's ops rules (``--metrics-from``...)."""
    paths = [("/healthz", healthz), ("/readyz", readyz), ("/metrics", metrics_page)]
    # Ursula's readiness paths (its smoke test): this server is ready as a whole.
    paths += [("/readyz/local", readyz), ("/readyz/cluster", readyz)]
    for path, handler in paths:
        name = path.strip("/")
        add_routes(app, path, name, {"GET": handler, "HEAD": handler}, _admit_ops(name), access=access)
