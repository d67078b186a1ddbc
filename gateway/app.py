"""The aiohttp application: routes, middlewares, and Redis lifecycle."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
import redis.exceptions
from aiohttp import web

from . import durability, handlers, metrics
from .archive import Archive, ColdReader
from .config import Settings, from_env
from .context import GATEWAY, Gateway
from .errors import ProtocolError
from .fanout import Fanout
from .responses import SECURITY
from .store import UNAVAILABLE, Store

log = logging.getLogger(__name__)
HINTS_TASK = web.AppKey("hints_task", asyncio.Task)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def protocol_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """ProtocolError → its status; Redis unreachable → 503; never a bare 500 page."""
    try:
        return await handler(request)
    except ProtocolError as exc:
        return web.Response(status=exc.status, text=exc.message + "\n", headers=exc.headers)
    except UNAVAILABLE as exc:
        log.warning("redis unavailable: %s", exc)
        return web.Response(status=503, text="storage unavailable, retry\n", headers={"Retry-After": "1"})
    except redis.exceptions.ResponseError as exc:  # e.g. OOM at maxmemory: Redis refused the write
        log.error("redis refused a command: %s", exc)
        return web.Response(status=503, text="storage refused the request\n", headers={"Retry-After": "5"})


def _route(request: web.Request, prefix: str) -> str:
    """A low-cardinality name for the metrics: never the stream path."""
    if request.path.startswith(prefix):
        mode = request.query.get("live") if request.method == "GET" else None
        return f"stream-{mode}" if mode in ("sse", "long-poll") else "stream"
    return request.path.strip("/") if request.path in ("/healthz", "/readyz", "/metrics") else "other"


def _observe(prefix: str) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    @web.middleware
    async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
        route, started = _route(request, prefix), time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            metrics.child(metrics.REQUESTS, route, request.method, str(status)).inc()
            metrics.child(metrics.REQUEST_SECONDS, route, request.method).observe(
                time.perf_counter() - started
            )

    return observe


async def metrics_page(request: web.Request) -> web.Response:
    body, content_type = metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    for name, value in SECURITY.items():
        response.headers.setdefault(name, value)


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    try:
        await gw.store.redis.ping()
        loaded = await gw.store.redis.script_exists(*gw.store.scripts.shas())
    except Exception as exc:
        return web.Response(status=503, text=f"redis not ready: {exc}\n")
    if not all(loaded):
        await gw.store.scripts.load()
    return web.Response(text="ready\n")


async def app_from_env() -> web.Application:
    """For ``gunicorn gateway.app:app_from_env``: settings from DURABLE_STREAMS_* variables.

    Needs a Redis URL (``DURABLE_STREAMS_REDIS_URL`` or ``REDIS_URL``); only
    ``durable-streams serve`` starts an embedded Redis.
    """
    settings = from_env()
    if not settings.redis_url:
        raise RuntimeError("set DURABLE_STREAMS_REDIS_URL (or REDIS_URL) for gunicorn workers")
    return create_app(settings, settings.redis_url)


def create_app(settings: Settings, redis_url: str) -> web.Application:
    """The gateway app for one process; it connects to ``redis_url`` on startup."""
    middlewares = [_observe(settings.prefix.rstrip("/") + "/"), protocol_errors]
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=middlewares)
    app.on_response_prepare.append(_security_headers)

    async def startup(app: web.Application) -> None:
        # A bounded pool that makes requests wait for a connection: a burst of clients
        # (a reconnect herd of SSE readers) must queue, not fail with "too many connections".
        pool = aioredis.BlockingConnectionPool.from_url(
            redis_url, max_connections=settings.redis_max_connections, timeout=10, health_check_interval=30
        )
        client = aioredis.Redis(connection_pool=pool)
        pubsub_client = aioredis.Redis.from_url(redis_url, decode_responses=False)
        cold = ColdReader(Archive(settings.archive_location), settings.archive_cache_bytes)
        store = Store(client, cold, settings.max_chunk_bytes, settings.notice_payload_bytes)
        await client.ping()
        await durability.check(client, require=settings.require_durable)
        await store.scripts.load()
        fanout = Fanout(pubsub_client)
        await fanout.start()
        app[GATEWAY] = Gateway(settings=settings, store=store, fanout=fanout)
        store.hints.enabled = settings.archive_hints
        app[HINTS_TASK] = asyncio.create_task(store.hints.run())

    async def shutdown(app: web.Application) -> None:
        app[GATEWAY].fanout.stop_waiters()  # live responses end cleanly, in-flight writes finish

    async def cleanup(app: web.Application) -> None:
        gw = app[GATEWAY]
        app[HINTS_TASK].cancel()
        await asyncio.gather(app[HINTS_TASK], return_exceptions=True)
        await gw.fanout.close()
        await gw.store.redis.aclose()

    app.on_startup.append(startup)
    app.on_shutdown.append(shutdown)
    app.on_cleanup.append(cleanup)

    route = settings.prefix.rstrip("/") + "/{path:.*}"
    app.router.add_put(route, handlers.put_stream)
    app.router.add_post(route, handlers.post_stream)
    app.router.add_delete(route, handlers.delete_stream)
    app.router.add_head(route, handlers.head_stream)
    app.router.add_get(route, handlers.get_stream, allow_head=False)
    app.router.add_route("OPTIONS", route, handlers.options_stream)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_page)
    return app
