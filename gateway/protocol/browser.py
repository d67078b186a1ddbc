"""What browsers get: CORS answers, and user content that can never run in the
gateway's origin. Plain functions of the configured policy and the request's
``Origin`` (no I/O)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ProtocolError

# On every response. ``sandbox`` gives a document rendered from a stream (a
# text/html or image/svg+xml stream opened in a tab) an opaque origin with scripts
# off, so stored markup cannot act as the gateway's origin. Fetch, EventSource and
# every protocol client ignore it.
BASE = {
    "X-Content-Type-Options": "nosniff",
    "Cross-Origin-Resource-Policy": "cross-origin",
    "Content-Security-Policy": "sandbox; default-src 'none'",
}

# Media types a browser renders as a document or runs as a script: reads of such
# streams are also served as downloads when navigated to.
_ACTIVE = re.compile(
    r"^(?:text/(?:html|xml|xsl|javascript|ecmascript|vtt|cache-manifest)"
    r"|application/(?:xhtml\+xml|xml|javascript|ecmascript|x-javascript|pdf|wasm|x-shockwave-flash)"
    r"|image/svg\+xml|[a-z0-9.+-]+/[a-z0-9.+-]*\+xml|multipart/x-mixed-replace)$"
)
ATTACHMENT = {"Content-Disposition": "attachment"}


def is_active(media_type: str) -> bool:
    """Whether a browser would render or execute content of this (normalized, lower-case) type."""
    return bool(_ACTIVE.match(media_type))


# With access control off, only pages served from this machine may call across origins:
# a page on the web must not drive a local server through its visitor's browser.
LOCAL_ORIGINS = ("http://localhost", "http://127.0.0.1", "http://[::1]")


@dataclass(frozen=True)
class Cors:
    """Which origins may call, with which methods, with or without credentials."""

    any_origin: bool
    origins: frozenset[str]
    local_any_port: bool
    methods: str
    credentials: bool

    def allows(self, origin: str) -> bool:
        if self.any_origin or origin in self.origins:
            return True
        if self.local_any_port:
            host, _, port = origin.rpartition(":")
            return origin in LOCAL_ORIGINS or (host in LOCAL_ORIGINS and port.isdigit())
        return False


def cors_policy(origins: str | None, methods: str, credentials: bool, auth_enabled: bool) -> Cors:
    """``origins``: comma-separated, ``*`` for any, ``none`` for no cross-origin
    calls; unset: local pages only with access control off, none with it on."""
    methods = ", ".join(m.strip().upper() for m in methods.split(",") if m.strip())
    if origins is None:
        return Cors(False, frozenset(), not auth_enabled, methods, False)
    listed = {o.strip().rstrip("/") for o in origins.split(",") if o.strip()}
    if "*" in listed and credentials:
        raise ValueError("--cors-credentials needs explicit --cors-origins, not '*'")
    listed.discard("none")
    return Cors("*" in listed, frozenset(listed - {"*"}), False, methods, credentials)


def response_headers(policy: Cors, origin: str | None, exposed: str) -> dict[str, str]:
    """CORS headers of an actual (non-preflight) response."""
    headers = {"Access-Control-Expose-Headers": exposed}
    if policy.any_origin and not policy.credentials:
        headers["Access-Control-Allow-Origin"] = "*"
        return headers
    headers["Vary"] = "Origin"
    if origin and policy.allows(origin):
        headers["Access-Control-Allow-Origin"] = origin
        if policy.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
    return headers


def preflight_headers(
    policy: Cors, origin: str | None, private_network: bool, exposed: str
) -> dict[str, str]:
    """An OPTIONS answer: always 204 (a preflight carries no credentials); the
    allowing headers only for an allowed origin."""
    headers = response_headers(policy, origin, exposed)
    headers["Access-Control-Allow-Methods"] = policy.methods
    # "*" never covers Authorization (Fetch): it is named as well.
    headers["Access-Control-Allow-Headers"] = (
        "Authorization, *" if not policy.credentials else _CREDENTIALED_HEADERS
    )
    headers["Access-Control-Max-Age"] = "86400"
    if private_network and "Access-Control-Allow-Origin" in headers:
        headers["Access-Control-Allow-Private-Network"] = "true"  # Chrome: public page → local server
    return headers


# "*" means no header names at all for credentialed requests: list the protocol's.
_CREDENTIALED_HEADERS = ", ".join(
    [
        "Authorization",
        "Content-Type",
        "Content-Encoding",
        "If-None-Match",
        "If-Match",
        "Stream-Expected-Offset",
        "Stream-Seq",
        "Stream-Closed",
        "Stream-TTL",
        "Stream-Expires-At",
        "Stream-Forked-From",
        "Stream-Fork-Offset",
        "Stream-Fork-Sub-Offset",
        "Stream-Compaction",
        "Producer-Id",
        "Producer-Epoch",
        "Producer-Seq",
    ]
)


LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]", "::1"})
LOOPBACK = ("127.0.0.1", "::1", "localhost")  # --host values that listen on loopback only


def local_host(host: str) -> bool:
    """Whether a Host header names this machine's loopback (any port)."""
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return name.lower() in LOCAL_HOSTS


def same_origin(origin: str, host: str, public_url: str | None) -> bool:
    """Whether ``origin`` is this server: its public URL's origin, else the host the
    request was sent to (any scheme: TLS often ends at a proxy in front)."""
    if public_url:
        scheme, _, rest = public_url.partition("://")
        return origin == f"{scheme}://{rest.split('/', 1)[0]}"
    return origin.partition("://")[2] == host


def check_origin(policy: Cors, origin: str | None, same: bool) -> None:
    """A state-changing request a browser sent from a page of another origin that
    is not allowed: refused before anything happens (a simple cross-origin POST
    needs no preflight, so CORS alone would not stop it being stored)."""
    if origin is None or same or policy.allows(origin):
        return
    raise ProtocolError(403, "requests from this origin are not allowed (see --cors-origins)")
