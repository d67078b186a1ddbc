"""The web console at ``{prefix}/__ds/console/``: its static files (gateway/console/static/)
and the ``config.json`` the page starts from.

The page holds no data: everything it shows comes from the protocol's own requests
(and the listing, the live statistics of http/stats.py, and ``/auth/sign`` for live
tails), made from the browser with the user's own credentials, so serving it needs no
access control. Its answers carry a
strict Content-Security-Policy of their own instead of the ``sandbox`` every stream
answer gets (which would stop the page's scripts).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson
from aiohttp import web

from ..config import Settings
from ..console import STATIC
from ..protocol import caching
from ..protocol.namespace import RESERVED

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Nothing from another origin, no inline script or style, not framed, forms never sent.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "Cross-Origin-Resource-Policy": "same-origin",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # Revalidated on every load (ETag, 304): an upgraded server never runs an old page.
    "Cache-Control": "no-cache",
}
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".json": "application/json",
}


@dataclass(frozen=True)
class _File:
    body: bytes
    content_type: str
    etag: str

    @classmethod
    def of(cls, body: bytes, content_type: str) -> _File:
        return cls(body, content_type, '"' + hashlib.sha256(body).hexdigest()[:32] + '"')

    def answer(self, request: web.Request) -> web.Response:
        headers = {**HEADERS, "ETag": self.etag}
        if caching.matches(request.headers.get("If-None-Match"), self.etag):
            return web.Response(status=304, headers=headers)
        return web.Response(body=self.body, headers={**headers, "Content-Type": self.content_type})


def enabled(settings: Settings) -> tuple[bool, str | None]:
    """Whether the console is served, and why ``auto`` left it off (None: it did not)."""
    if settings.console == "off":
        return False, None
    if settings.console == "on" or not settings.auth_enabled or settings.auth_signing_key_file:
        return True, None
    # EventSource sends no Authorization header: with tokens, a live tail needs a signed URL.
    return False, "access control is on without --auth-signing-key-file, so its live tail could not sign in"


def _config(settings: Settings) -> bytes:
    """What the page needs to know, with every URL relative to the page, so the console
    works behind a proxy that serves the gateway under another path."""
    depth = len([part for part in settings.prefix.split("/") if part])
    return orjson.dumps(
        {
            "auth": settings.auth_enabled,
            "signed_urls": bool(settings.auth_enabled and settings.auth_signing_key_file),
            "signed_url_max_seconds": int(settings.auth_signed_url_max_seconds),
            "stream_root": "../../",
            "listing": "../streams",
            "detail": "../streams/",  # + a stream's path: its listing entry and producers
            "stats": "../stats",  # the live statistics (http/stats.py); + /streams/{path}, /subscriptions
            "sign": "../../" + "../" * depth + "auth/sign",
            "tenants": "../tenants" if settings.tenants else None,  # the tenants API (http/tenants.py)
        }
    )


def _load(settings: Settings) -> dict[str, _File]:
    found = {"config.json": _File.of(_config(settings), TYPES[".json"])}
    for item in STATIC.iterdir():
        suffix = "." + item.name.rpartition(".")[2]
        if item.is_file() and suffix in TYPES:
            found[item.name] = _File.of(item.read_bytes(), TYPES[suffix])
    return found


def _redirect(location: str) -> Handler:
    async def answer(request: web.Request) -> web.Response:
        # A relative Location: right behind a proxy that moves the gateway to another path.
        return web.Response(status=302, headers={"Location": location, "Cache-Control": caching.NO_STORE})

    return answer


def routes(settings: Settings) -> list[tuple[str, str, dict[str, Handler]]]:
    """(route name, path, handlers by method), like subscriptions.routes: nothing when
    the console is off. ``GET /`` leads to it too unless the streams live at ``/``."""
    on, why = enabled(settings)
    if not on:
        if why:
            log.info("web console off (--console auto): %s; --console on serves it anyway", why)
        return []
    files = _load(settings)

    async def index(request: web.Request) -> web.Response:
        return files["index.html"].answer(request)

    async def static(request: web.Request) -> web.Response:
        found = files.get(request.match_info["name"])
        if found is None:
            return web.Response(status=404, text="not found\n")
        return found.answer(request)

    stream_root = settings.prefix.rstrip("/")
    base = f"{stream_root}/{RESERVED}/console"
    to_console = _redirect("console/")
    found: list[tuple[str, str, dict[str, Handler]]] = [
        ("console", base, {"GET": to_console, "HEAD": to_console}),
        ("console", base + "/", {"GET": index, "HEAD": index}),
        ("console", base + "/{name}", {"GET": static, "HEAD": static}),
    ]
    if stream_root:
        to_page = _redirect(f"{stream_root.lstrip('/')}/{RESERVED}/console/")
        found.append(("console", "/", {"GET": to_page, "HEAD": to_page}))
    return found
