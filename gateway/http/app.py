"""The aiohttp application: routes, the wrapper every request goes through (errors,
security headers, metrics, the access log), health endpoints, and the Redis lifecycle."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping

import redis.asyncio as aioredis
import redis.exceptions
from aiohttp import web
from redis.asyncio import RedisCluster

from ..archive.cold import ColdReader
from ..archive.files import Archive
from ..config import Settings, conflict, from_env
from ..protocol import browser, caching
from ..protocol.errors import ProtocolError
from ..protocol.ssrf import parse_allow_list
from ..storage import client as redis_client
from ..storage.backpressure import WritePause
from ..storage.fanout import Fanout
from ..storage.outcomes import UNAVAILABLE
from ..storage.preflight import Preflight
from ..storage.ratelimit import RateLimiter
from ..storage.scripts import connect_scripts, replica_ack
from ..storage.store import Store
from ..telemetry import metrics
from ..telemetry.logs import QUIET_MALFORMED, RateLimited
from . import buckets, console, handlers, listing, stats, subscriptions
from .accesslog import AccessLog
from .bodies import BodyBudget
from .context import GATEWAY, Gateway
from .guard import Guard

log = logging.getLogger(__name__)
limited = RateLimited(log)
CLEANUP_STEP_SECONDS = 5.0  # each shutdown step; none may hold a shutdown past its grace period
HINTS_TASK = web.AppKey("hints_task", asyncio.Task)
SWEEP_TASK = web.AppKey("sweep_task", asyncio.Task)
PAUSE_TASK = web.AppKey("pause_task", asyncio.Task)  # write backpressure's polls (storage/backpressure.py)
PREFLIGHT_TASK = web.AppKey("preflight_task", asyncio.Task)
EMBEDDED_REDIS = web.AppKey("embedded_redis", str)  # the URL of the Redis this server runs itself
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# A Guard check a route's requests pass: raises a refusal, or returns what to await for the
# rest of it (None: nothing; Guard.admit_stream without access control).
Admit = Callable[[Guard, web.Request], Awaitable[None] | None]


def _error_response(request: web.Request, exc: Exception) -> web.Response:
    """ProtocolError → its status (not logged: the client's mistake, or said to it);
    Redis unreachable or refusing → 503; anything else is a bug → 500. Logged one line
    per kind at most every few seconds, so a flood of bad requests is no flood of logs."""
    if isinstance(exc, ProtocolError):
        if exc.body is not None:
            return web.json_response(exc.body, status=exc.status, headers=exc.headers)
        return web.Response(status=exc.status, text=exc.message + "\n", headers=exc.headers)
    if isinstance(exc, UNAVAILABLE):
        limited.log(logging.WARNING, "unavailable", "redis unavailable: %s", exc)
        return web.Response(status=503, text="storage unavailable, retry\n", headers={"Retry-After": "1"})
    if isinstance(exc, redis.exceptions.ResponseError):  # e.g. OOM at maxmemory: Redis refused the write
        limited.log(logging.WARNING, "refused", "redis refused a command: %s", exc)
        return web.Response(status=503, text="storage refused the request\n", headers={"Retry-After": "5"})
    if isinstance(exc, ConnectionError):  # the client left (e.g. before SSE headers went out): nobody to tell
        return web.Response(status=499, text="client closed the connection\n")
    limited.log(logging.ERROR, type(exc).__name__, "%s %s failed", request.method, request.path, exc_info=exc)
    return web.Response(status=500, text="internal error\n")


def _stream_route(request: web.Request) -> str:
    """A low-cardinality name for the metrics: never the stream path."""
    mode = request.query.get("live") if request.method == "GET" else None
    return f"stream-{mode}" if mode in ("sse", "long-poll") else "stream"


def _size(response: web.StreamResponse) -> int:
    """Body bytes of an answer: sent (a stream's), or about to be (a prepared body's)."""
    if response.prepared:
        return response.body_length
    return response.content_length or 0


def endpoint(
    handler: Handler,
    route: str | Callable[[web.Request], str],
    admit: Admit | None = None,
    *,
    storage: bool = False,
    access: AccessLog | None = None,
) -> Handler:
    """A route's handler with what every request gets: admission (``admit`` picks the
    Guard's check: origin, credentials, rate limits), errors answered (never a bare
    500 page), security headers, the request metrics and the access log. ``storage``:
    the route needs Redis, so until it passed the start-up checks its requests get 503.

    One wrapper per route rather than aiohttp middlewares and an on_response_prepare
    signal: each middleware layer costs every request a coroutine and a partial, the
    signal one more coroutine, which shows at 10k appends/s (README, Performance).
    """

    async def guarded(request: web.Request) -> web.StreamResponse:
        started, status, size = time.perf_counter(), 500, 0
        gw = request.app[GATEWAY]
        try:
            try:
                if storage and not gw.preflight.ready and request.method != "OPTIONS":
                    raise ProtocolError(503, "storage not ready yet, retry", {"Retry-After": "2"})
                if admit is not None and (pending := admit(gw.guard, request)) is not None:
                    await pending
                response = await handler(request)
            except Exception as exc:
                response = _error_response(request, exc)
            status = response.status
            if not response.prepared:  # an event stream sent its own headers already
                # SIGTERM came: Connection: close, so no proxy sends on this connection again. (An
                # event stream's stays open: closed unannounced it could meet a proxy's next request.)
                if gw.draining:
                    response.force_close()
                if status >= 400:  # a CDN must not keep a 404 past the stream's creation, nor a 503
                    response.headers.setdefault("Cache-Control", caching.NO_STORE)
                gw.guard.secure(request, response.headers)
            if access is not None:
                size = _size(response)
            return response
        except web.HTTPException as exc:  # aiohttp's own answers, e.g. 413 from request.read()
            status = exc.status
            if gw.draining:
                exc.force_close()
            if status >= 400:
                exc.headers.setdefault("Cache-Control", caching.NO_STORE)
            gw.guard.secure(request, exc.headers)
            raise
        finally:
            gw.bodies.release(request)
            name = route if isinstance(route, str) else route(request)
            seconds = time.perf_counter() - started
            metrics.observe_request(name, request.method, status, seconds)
            if access is not None:
                access.record(request, status, size, seconds)

    return guarded


def _method_not_allowed(allowed: list[str]) -> Handler:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=405, text="method not allowed\n", headers={"Allow": ", ".join(allowed)})

    return answer


async def _not_found(request: web.Request) -> web.Response:
    return web.Response(status=404, text="not found\n")


def _add_routes(
    app: web.Application,
    path: str,
    route: str | Callable[[web.Request], str],
    handlers: Mapping[str, Handler],
    admit: Admit | None = None,
    *,
    storage: bool = False,
    access: AccessLog | None = None,
) -> None:
    """``handlers`` by method on ``path``, and a 405 for any other method, all through ``endpoint``."""
    for method, handler in handlers.items():
        app.router.add_route(method, path, endpoint(handler, route, admit, storage=storage, access=access))
    refuse = _method_not_allowed(list(handlers))
    app.router.add_route("*", path, endpoint(refuse, route, admit, storage=storage, access=access))


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
    scripts = gw.store.scripts
    if scripts.cluster:  # one shard away must not make every gateway unready: its streams answer 503
        try:
            await scripts.redis.ping(target_nodes=RedisCluster.RANDOM)
        except Exception as exc:
            limited.log(logging.WARNING, "readyz", "not ready: redis cluster: %s", exc)
            return web.Response(status=503, text="not ready: storage unavailable\n")
        return web.Response(text="ready\n")
    try:
        await gw.store.redis.ping()
        loaded = await gw.store.redis.script_exists(*gw.store.scripts.shas())
    except Exception as exc:  # the details (addresses, paths) go to the log, not to whoever asks
        limited.log(logging.WARNING, "readyz", "not ready: redis: %s", exc)
        return web.Response(status=503, text="not ready: storage unavailable\n")
    if not all(loaded):
        await gw.store.scripts.load()
    return web.Response(text="ready\n")


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


def _stop_this_process(refusal: str) -> None:
    """A start-up check failed once Redis answered: stop gracefully (in-flight requests
    finish), without SIGTERM's delay: a process that was never ready is in no load balancer.
    ``durable-streams serve`` then exits non-zero with the refusal; a gunicorn worker is
    started again, refuses at once, and that stops gunicorn."""
    log.error("refusing to serve: %s", refusal)
    os.kill(os.getpid(), signal.SIGINT)


def _drain_on_sigterm(app: web.Application, delay: float) -> None:
    """SIGTERM starts the shutdown with ``delay`` seconds (--shutdown-delay-seconds) of still
    serving: /readyz answers 503, live responses end now (with their resume offset: readers
    reconnect, through the load balancer, elsewhere), every response closes its connection.
    Until a load balancer sees the probe fail, or its endpoints change, it keeps sending here;
    a proxy's keep-alive connection that this process closed while idle would meet its next
    request with a reset, and a POST it already sent is not retried: a 502. Closed after a
    response that says so, it is not reused (an event stream's connection, its headers out
    before, stays open: its next request gets the close). Then the process stops as on SIGINT,
    which both hosts (run_app; gunicorn's aiohttp worker) take as a graceful stop: the listener
    closes, idle connections close, in-flight requests get --shutdown-seconds.

    Installed from the app's startup, after the host's own handlers, so it replaces their
    SIGTERM one; SIGINT keeps theirs (a stop without the delay)."""
    loop = asyncio.get_running_loop()

    def begin() -> None:
        gw = app[GATEWAY]
        if gw.draining:  # a second SIGTERM changes nothing
            return
        gw.draining = True
        gw.fanout.stop_waiters()
        log.info("SIGTERM: not ready, closing connections after each response; stopping in %ss", delay)
        loop.call_later(delay, os.kill, os.getpid(), signal.SIGINT)

    try:
        loop.add_signal_handler(signal.SIGTERM, begin)
    except NotImplementedError:  # Windows: SIGTERM stays the host's (a stop without the delay)
        pass


def create_app(
    settings: Settings,
    redis_url: str,
    *,
    embedded: bool = False,
    on_refusal: Callable[[str], None] = _stop_this_process,
    drain_on_sigterm: bool = False,
) -> web.Application:
    """The gateway app for one process; it connects to ``redis_url`` on startup.
    ``embedded``: that Redis is this server's own child, so /healthz checks it too.
    ``drain_on_sigterm``: the app is this process' server (not one of a test's), and takes
    over SIGTERM for a graceful shutdown behind a load balancer (``_drain_on_sigterm``).

    On startup, the Redis checks (storage/preflight.py) run once: a refusal stops the
    start; an unreachable Redis does not: the app serves (/healthz 200, /readyz and
    stream requests 503) while a task tries again, and ``on_refusal`` is called if a
    check then refuses."""
    logging.getLogger("aiohttp.server").addFilter(QUIET_MALFORMED)  # once: the same filter object
    metrics.publish_build_info()
    # Bodies are inflated by gateway/http/bodies.py, within the size limit, not by aiohttp.
    app = web.Application(client_max_size=settings.max_body_bytes, handler_args={"auto_decompress": False})
    if embedded:
        app[EMBEDDED_REDIS] = redis_url
    try:
        guard = Guard(settings)  # reads token files and keys now: a bad one stops the start
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"access control: {exc}") from None
    if not settings.auth_enabled and settings.host not in browser.LOOPBACK:
        log.warning(
            "ACCESS CONTROL IS OFF while listening on %s: anyone who can reach this port can read, "
            "write and delete every stream (README, Security)",
            settings.host,
        )
    access = AccessLog(settings.trusted_proxy_hops) if settings.access_log else None

    async def startup(app: web.Application) -> None:
        # Nothing here waits for Redis: clients connect on first use, the fan-out's
        # listener and the hints task retry by themselves.
        # Its slot-map reads must not hang on one silent node (the listeners set their own).
        timeouts = {"socket_timeout": 2.0, "socket_connect_timeout": 2.0} if settings.redis_cluster else {}
        pubsub_client = redis_client.general(redis_url, cluster=settings.redis_cluster, **timeouts)
        fanout = Fanout(pubsub_client)
        scripts = connect_scripts(
            redis_url,
            cluster=settings.redis_cluster,
            max_connections=settings.redis_max_connections,
            timeout=settings.redis_timeout,
            replica_ack=replica_ack(settings.min_replicas_ack, settings.min_replicas_ack_timeout),
            answered=fanout.redis_answered,  # Redis is back: live readers' listener reconnects now
        )
        cold = ColdReader(Archive(settings.archive_location), settings.archive_cache_bytes)
        store = Store(
            scripts, cold, settings.max_chunk_bytes, settings.notice_payload_bytes, settings.read_inline_bytes
        )
        preflight = Preflight(
            scripts.redis,
            persistence=True,
            require_durable=settings.require_durable,
            prepare=scripts.load,
            durable=lambda durable: metrics.DURABLE.set(1 if durable else 0),
        )
        metrics.LIVE_CAPACITY.set(settings.max_live_connections)
        await fanout.start()
        pause = WritePause(
            store.redis,
            store.hints.hint_keys,
            memory=settings.write_pause_memory,
            archive_lag=settings.write_pause_archive_lag,
            retry_after=settings.write_pause_retry_after,
        )
        guard.attach(RateLimiter(store.scripts), pause)
        app[GATEWAY] = Gateway(
            settings=settings,
            store=store,
            fanout=fanout,
            bodies=BodyBudget(settings.max_inflight_body_bytes),
            guard=guard,
            preflight=preflight,
            webhook_policy=parse_allow_list(settings.webhook_allow),
        )
        store.hints.enabled = settings.archive_hints
        store.registry.enabled = settings.stream_registry
        app[HINTS_TASK] = asyncio.create_task(store.hints.run())
        app[SWEEP_TASK] = asyncio.create_task(store.index_sweep.run())
        app[PAUSE_TASK] = asyncio.create_task(pause.run())
        if not await preflight.attempt():  # a refusal is raised: the start fails
            log.warning(
                "redis not usable at start (%s): serving anyway; /readyz and stream requests answer "
                "503 until it is",
                preflight.problem,
            )
            app[PREFLIGHT_TASK] = asyncio.create_task(_keep_trying(preflight, on_refusal))
        if drain_on_sigterm:
            _drain_on_sigterm(app, settings.shutdown_delay_seconds)

    async def shutdown(app: web.Application) -> None:
        app[GATEWAY].fanout.stop_waiters()  # live responses end cleanly, in-flight writes finish

    async def cleanup(app: web.Application) -> None:
        """Each step bounded: a Redis that does not answer must not hold the process."""
        gw = app.get(GATEWAY)
        if gw is None:  # the start failed before anything was built
            return
        trying = app.get(PREFLIGHT_TASK)
        if trying is not None:
            trying.cancel()
        app[SWEEP_TASK].cancel()
        gw.store.hints.stop()
        if gw.guard.pause is not None:
            gw.guard.pause.stop()
        metrics.flush_requests()  # the last second's requests, into the metrics' files (multiprocess)
        for name, step in (
            ("access control", gw.guard.close()),
            ("archive hints", app[HINTS_TASK]),
            ("write backpressure", app[PAUSE_TASK]),
            ("fan-out", gw.fanout.close()),
            ("redis", gw.store.scripts.aclose()),
        ):
            try:
                await asyncio.wait_for(step, CLEANUP_STEP_SECONDS)
            except Exception as exc:  # TimeoutError included: go on with the next step
                log.warning("shutdown: %s did not close cleanly (%s)", name, exc or type(exc).__name__)

    app.on_startup.append(startup)
    app.on_shutdown.append(shutdown)
    app.on_cleanup.append(cleanup)
    stats.install(app, settings)  # the console's live statistics: this process' recorder

    stream = {
        "PUT": handlers.put_stream,
        "POST": handlers.post_stream,
        "DELETE": handlers.delete_stream,
        "HEAD": handlers.head_stream,
        "GET": handlers.get_stream,
        "OPTIONS": handlers.options_stream,
    }
    sign = {"POST": handlers.sign_url, "OPTIONS": handlers.options_stream}
    _add_routes(app, "/auth/sign", "sign", sign, access=access)
    ops = [("/healthz", healthz), ("/readyz", readyz), ("/metrics", metrics_page)]
    # Ursula's readiness paths (its smoke test): this server is ready as a whole.
    ops += [("/readyz/local", readyz), ("/readyz/cluster", readyz)]
    for path, handler in ops:
        name = path.strip("/")
        _add_routes(app, path, name, {"GET": handler, "HEAD": handler}, _admit_ops(name), access=access)
    # The reserved namespace ({prefix}/__ds/) is routed before the streams.
    for name, path, methods in [
        *console.routes(settings),
        *stats.routes(settings),
        *listing.routes(settings.prefix),
        *subscriptions.routes(settings.prefix),
    ]:
        _add_routes(app, path, name, methods, storage=True, access=access)
    streams = settings.prefix.rstrip("/") + "/{path:.*}"
    _add_routes(app, streams, _stream_route, stream, Guard.admit_stream, storage=True, access=access)
    if settings.prefix.rstrip("/"):  # Ursula's buckets at the root, beside the streams' prefix
        for route, path, handlers_of, is_stream in buckets.routes(stream):
            # A bucket's stream: the stream handlers, its path mapped (and admitted) first.
            names, admit = (_stream_route, buckets.admit_bucket_stream) if is_stream else (route, None)
            _add_routes(app, path, names, handlers_of, admit, storage=True, access=access)
    app.router.add_route("*", "/{anything:.*}", endpoint(_not_found, "other", access=access))
    return app


async def _keep_trying(preflight: Preflight, on_refusal: Callable[[str], None]) -> None:
    """The start-up checks again, with backoff, until they pass or one refuses."""
    try:
        await preflight.wait()
    except Exception as exc:  # a refusal (durability, key layout)
        on_refusal(str(exc))
        return
    log.info("redis is ready: serving streams")
