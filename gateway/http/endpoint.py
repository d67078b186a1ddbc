"""aiohttp's door: the wrapper every route's requests go through (admission, then the
pipeline's readiness, errors answered, sealed headers, metrics and access log:
pipeline.py) and how a route's handlers are mounted with it."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping

from aiohttp import web

from ..features.usage import request_kind
from . import pipeline
from .accesslog import AccessLog
from .context import BODY_SENT, GATEWAY
from .guard import TENANT, Guard, principal_of

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# A Guard check a route's requests pass: raises a refusal, or returns what to await for the
# rest of it (None: nothing; Guard.admit_stream without access control).
Admit = Callable[[Guard, web.Request], Awaitable[None] | None]


def error_response(request: web.Request, exc: Exception) -> web.Response:
    """``pipeline.error_answer`` as a response."""
    status, headers, body = pipeline.error_answer(exc, request.method, request.path)
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
        headers: MutableMapping[str, str] | None = None  # the answer's, to seal
        response: web.StreamResponse | None = None
        try:
            try:
                if storage and (refusal := pipeline.unready(gw, request.method)) is not None:
                    raise refusal
                if admit is not None and (pending := admit(gw.guard, request)) is not None:
                    await pending
                response = await handler(request)
            except Exception as exc:
                response = error_response(request, exc)
            status = response.status
            if not response.prepared:  # an event stream sent its own headers already
                headers = response.headers
            if access is not None:
                size = _size(response)
            return response
        except web.HTTPException as exc:  # aiohttp's own answers, e.g. 413 from request.read()
            status, headers, response = exc.status, exc.headers, exc
            raise
        finally:
            if (
                response is not None
                and headers is not None
                and pipeline.seal(gw, status, headers, request.headers.get("Origin"), principal_of(request))
            ):
                # (An event stream's stays open: closed unannounced it could meet a proxy's next request.)
                response.force_close()
            name = route if isinstance(route, str) else route(request)
            tenant = request.get(TENANT)
            if tenant:  # (tenants on: a stream request's, metered)
                live = request.query.get("live") if request.method == "GET" else None
                sent = request.get(BODY_SENT)  # a streamed answer's; else the body aiohttp sends
                if sent is None:
                    sent = (
                        (response.content_length or 0)
                        if response is not None and not response.prepared
                        else 0
                    )
                gw.store.usage.request(tenant, request_kind(request.method, live), sent)
            remote, target = access.of(request) if access is not None else ("", "")
            seconds = time.perf_counter() - started
            pipeline.finish(
                gw, request, name, request.method, status, seconds,
                access=access, remote=remote, target=target, size=size,
            )  # fmt: skip

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
