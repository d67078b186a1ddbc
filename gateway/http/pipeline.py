"""One request pipeline behind both doors: what every request gets, whichever door
answered it (aiohttp's routes, through ``endpoint.endpoint``; a plain append answered on
its connection, through ``fastpath.Connection``), written once, with no aiohttp type in it.

* ``unready``: storage not ready yet → 503 (the doors ask before the handler runs);
* ``error_answer``: an exception → the status, headers and body that answer it;
* ``seal``: what every answer carries (``no-store`` on errors, the browser headers, reads
  with credentials kept out of shared caches) and whether it closes the connection
  (while draining: SIGTERM came);
* ``finish``: the request's body budget released, the request metrics, the access log.
"""

from __future__ import annotations

import json
import logging
from collections.abc import MutableMapping

import redis.exceptions

from ..protocol import caching
from ..protocol.access import Principal
from ..protocol.errors import ProtocolError
from ..redis_io.outcomes import UNAVAILABLE
from ..telemetry import metrics
from ..telemetry.logs import RateLimited
from .accesslog import AccessLog
from .context import Gateway

log = logging.getLogger(__name__)
limited = RateLimited(log)
_TEXT = {"Content-Type": "text/plain; charset=utf-8"}
_JSON = {"Content-Type": "application/json; charset=utf-8"}


def unready(gw: Gateway, method: str) -> ProtocolError | None:
    """The refusal of a request that needs storage, while it has not passed the start-up
    checks (a preflight, OPTIONS, needs none)."""
    if gw.preflight.ready or method == "OPTIONS":
        return None
    return ProtocolError(503, "storage not ready yet, retry", {"Retry-After": "2"})


def error_answer(exc: Exception, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body that answer ``exc``: ProtocolError → its status (not
    logged: the client's mistake, or said to it); Redis unreachable or refusing → 503;
    anything else is a bug → 500. Logged one line per kind at most every few seconds, so
    a flood of bad requests is no flood of logs."""
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


def seal(
    gw: Gateway,
    status: int,
    headers: MutableMapping[str, str],
    origin: str | None,
    principal: Principal,
    browser: bool = True,
) -> bool:
    """Complete an answer's headers; whether it is the connection's last (draining: it
    says ``Connection: close`` then, so no proxy sends on this connection again).
    ``browser=False``: the caller writes ``gw.guard.headers_for(origin)`` itself (the append
    door, whose answers never carry those names: it writes them serialised once)."""
    if status >= 400:  # a CDN must not keep a 404 past the stream's creation, nor a 503
        headers.setdefault("Cache-Control", caching.NO_STORE)
    if browser:
        gw.guard.secure_answer(origin, principal, headers)
    return gw.draining


def finish(
    gw: Gateway,
    owner: object,
    route: str,
    method: str,
    status: int,
    seconds: float,
    fast: bool = False,
    access: AccessLog | None = None,
    remote: str = "",
    target: str = "",
    size: int = 0,
) -> None:
    """A request is answered: its body bytes are free again, it is counted (``fast``: by
    the append door) and, with ``access``, logged (``target`` redacted already)."""
    gw.bodies.release(owner)
    if fast:
        metrics.observe_fast_request(route, method, status, seconds)
    else:
        metrics.observe_request(route, method, status, seconds)
    if access is not None:
        access.line(remote, method, target, status, size, seconds)
