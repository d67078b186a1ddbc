"""The wrapper every request goes through (admission, errors answered, security headers,
the request metrics, the access log) and how a route's handlers are mounted with it."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

import redis.exceptions
from aiohttp import web

from ..protocol import caching
from ..protocol.errors import ProtocolError
from ..redis_io.outcomes import UNAVAILABLE
from ..telemetry import metrics
from ..telemetry.logs import RateLimited
from .accesslog import AccessLog
from .context import GATEWAY
from .guard import Guard

log = logging.getLogger(__name__)
limited = RateLimited(log)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# A Guard check a route's requests pass: raises a refusal, or returns what to await for the
# rest of it (None: nothing; Guard.admit_stream without access control).
Admit = Callable[[Guard, web.Request], Awaitable[None] | None]


def error_answer(exc: Exception, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body that answer ``exc``: ProtocolError → its status (not
    logged: the client's mistake, or said to it); Redis unreachable or refusing → 503;
    anything else is a bug → 500. Logged one line per kind at most every few seconds, so
    a flood of bad requests is no flood of logs. (Also the connection's own append path's
    answers, fastpath.py: both say the same.)"""
    if isinstance(exc, ProtocolError):
        if exc.body is not None:
            return exc.status, {**_JSON, **exc.headers}, json.dumps(exc.body).encode()
        return exc.status, {**_TEXT, **exc.headers}, (exc.message + "\n").encode()
    if isinstance(exc, UNAVAILABLE):
        limited.log(logging.WARNING, "unavailable", "redis unavailable: %s", exc)
        return 503, {**_TEXT, "Retry-After": "1"}, b"storage unavailable, retry\n"
    if isinstance(exc, redis.exceptions.ResponseError):  # e.g. OOM at maxmemory: Redis refused the write
        limited.log(logging.WARNING, "refused", "redis refused a command: %s", exc)
        return 503, {**_TEXT, "Retry-After": "5"}, b"storage refused the request\n"
    if isinstance(exc, ConnectionError):  # the client left (e.g. before SSE headers went out): nobody to tell
        return 499, dict(_TEXT), b"client closed the connection\n"
    limited.log(logging.ERROR, type(exc).__name__, "%s %s failed", method, path, exc_info=exc)
    return 500, dict(_TEXT), b"internal error\n"


_TEXT = {"Content-Type": "text/plain; charset=utf-8"}
_JSON = {"Content-Type": "application/json; charset=utf-8"}


def error_response(request: web.Request, exc: Exception) -> web.Response:
    """``error_answer`` as a response."""
    status, headers, body = error_answer(exc, request.method, request.path)
    return web.Response(status=status, headers=headers, body=body)


def stream_route(request: web.Request) -> str:
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
                response = error_response(request, exc)
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


async def not_found(request: web.Request) -> web.Response:
    return web.Response(status=404, text="not found\n")


def add_routes(
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
