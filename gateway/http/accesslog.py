"""The access log (``--access-log``): one line per request, through the logger
``durable_streams.access`` (so ``--log-format json`` makes each line an object
with the fields method, path, status, bytes, duration_ms, remote).

The path is logged as the client sent it (percent-encoded: no control characters
reach a text log), with the query's values kept only for parameters known to be
harmless. A signed URL carries its signature in the query (``ds_sig``): that, and
any parameter we do not know (a client may put a token where it does not
belong), is logged as ``REDACTED``.
"""

from __future__ import annotations

import logging
from urllib.parse import unquote_plus

from aiohttp import web

from ..protocol.access import SIG_BY, SIG_EXPIRES, SIG_SCOPE
from .auth import client_ip

log = logging.getLogger("durable_streams.access")
SHOWN = frozenset({"offset", "live", "cursor", SIG_EXPIRES, SIG_SCOPE, SIG_BY})
REDACTED = "REDACTED"


def redacted_target(raw_path: str, raw_query: str) -> str:
    """``raw_path?raw_query`` with the values of parameters not in ``SHOWN`` replaced."""
    if not raw_query:
        return raw_path
    parts = []
    for part in raw_query.split("&"):
        name, equals, _ = part.partition("=")
        if not part or unquote_plus(name) in SHOWN:
            parts.append(part)
        elif equals:
            parts.append(f"{name}={REDACTED}")
        else:
            parts.append(REDACTED)  # a bare word may itself be a secret
    return f"{raw_path}?{'&'.join(parts)}"


class AccessLog:
    def __init__(self, proxy_hops: int) -> None:
        self.proxy_hops = proxy_hops
        log.setLevel(logging.INFO)  # on means on, whatever --log-level says

    def of(self, request: web.Request) -> tuple[str, str]:
        """An aiohttp request's client address and target, as its line shows them."""
        url = request.rel_url
        return client_ip(request, self.proxy_hops), redacted_target(url.raw_path, url.raw_query_string)

    def line(self, remote: str, method: str, path: str, status: int, size: int, seconds: float) -> None:
        """One request's line (``path`` redacted already; the append door's have no
        query, so theirs is as sent)."""
        duration_ms = round(seconds * 1000, 3)
        log.info(
            '%s "%s %s" %d %d %.1fms',
            remote, method, path, status, size, duration_ms,
            extra={
                "method": method, "path": path, "status": status, "bytes": size,
                "duration_ms": duration_ms, "remote": remote,
            },
        )  # fmt: skip
