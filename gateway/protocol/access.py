"""Who may do what to which stream: scopes, grants, principals, signed URLs.

Plain functions of the request's credentials and the stream path (no I/O): the
HTTP layer (gateway/http/auth.py) finds the principal, ``endpoint`` asks
``decide``. Paths are stream paths as routed (after the URL prefix, no leading
slash); a grant's prefix covers every path that starts with it, as a string
(``chat/`` covers ``chat/42``; ``chat`` also covers ``chatter``).

Scopes nest: ``admin`` covers ``write``, which covers ``read``.

* read: GET and HEAD (catch-up, long-poll, SSE), and forking a stream as source
* write: PUT (create, or fork into) and POST (append, close)
* admin: DELETE; on the public listener, /metrics; minting signed URLs needs
  the scope being granted
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from .errors import ProtocolError

Scope = Literal["read", "write", "admin"]
SCOPES: tuple[Scope, ...] = ("read", "write", "admin")
_RANK = {scope: rank for rank, scope in enumerate(SCOPES)}
_METHOD_SCOPE: dict[str, Scope] = {
    "GET": "read",
    "HEAD": "read",
    "PUT": "write",
    "POST": "write",
    "DELETE": "admin",
}
REALM = 'Bearer realm="durable-streams"'


def required_scope(method: str) -> Scope:
    """The scope a request method needs on its stream (OPTIONS never gets here)."""
    return _METHOD_SCOPE.get(method, "admin")


@dataclass(frozen=True)
class Grants:
    """Path prefixes per scope."""

    prefixes: Mapping[Scope, tuple[str, ...]] = field(default_factory=dict)

    def allows(self, scope: Scope, path: str) -> bool:
        for held in SCOPES[_RANK[scope] :]:
            for prefix in self.prefixes.get(held, ()):
                if path.startswith(prefix):
                    return True
        return False

    def __bool__(self) -> bool:
        return any(self.prefixes.values())


EVERYTHING = Grants({"admin": ("",)})


def normalize_prefix(raw: str) -> str:
    """``/chat/`` and ``chat/`` name the same streams; ``*`` and ``/`` name all."""
    raw = raw.strip()
    return "" if raw in ("*", "/") else raw.lstrip("/")


def parse_grants(value: object, *, strict: bool = True) -> Grants:
    """Grants from configuration or a JWT claim, in any of three spellings:

    * ``"read:chat/ write:chat/42/"`` (space- or comma-separated ``scope:prefix``),
    * ``["read:chat/", "write:chat/42/"]``,
    * ``{"read": ["chat/"], "write": ["chat/42/"]}``.

    ``strict``: an entry that is not ``scope:prefix`` is an error (configuration);
    otherwise it is skipped (the OAuth ``scope`` claim also holds e.g. ``openid``).
    """
    pairs: list[tuple[str, str]] = []
    if isinstance(value, str):
        value = value.replace(",", " ").split()
    if isinstance(value, Mapping):
        for scope, prefixes in value.items():
            items = [prefixes] if isinstance(prefixes, str) else prefixes
            if not isinstance(items, Iterable) or not all(isinstance(p, str) for p in items):
                raise ValueError(f"grants for {scope!r} must be a list of path prefixes")
            pairs.extend((str(scope), p) for p in items)
    elif isinstance(value, Iterable):
        for entry in value:
            scope, sep, prefix = str(entry).partition(":")
            if not sep or scope not in _RANK:
                if strict:
                    raise ValueError(f"grant {entry!r} is not scope:prefix (scope read, write or admin)")
                continue
            pairs.append((scope, prefix))
    elif value is not None:
        raise ValueError("grants must be a string, a list or an object")
    found: dict[Scope, list[str]] = {}
    for scope, prefix in pairs:
        if scope not in _RANK:
            if strict:
                raise ValueError(f"unknown scope {scope!r} (read, write or admin)")
            continue
        found.setdefault(SCOPES[_RANK[scope]], []).append(normalize_prefix(prefix))
    return Grants({scope: tuple(prefixes) for scope, prefixes in found.items()})


@dataclass(frozen=True)
class Principal:
    """Who a request acts as: ``id`` names the credential for rate limits and live
    caps (never the secret itself); ``expires_at`` (Unix seconds) ends live
    responses it opened."""

    id: str
    grants: Grants
    expires_at: float | None = None
    anonymous: bool = False
    only_path: str | None = None  # a signed URL's stream: its grants cover no other
    tenant: str | None = None  # the credential's tenant (protocol/tenants.py), None: it names none

    def allows(self, scope: Scope, path: str) -> bool:
        if self.only_path is not None and path != self.only_path:
            return False
        return self.grants.allows(scope, path)


OPEN = Principal("open", EVERYTHING, anonymous=True)  # access control off


def deny(principal: Principal, scope: Scope, path: str) -> ProtocolError:
    """The answer to a request its principal may not make: 401 when it came
    without (usable) credentials, 403 when they do not cover the path."""
    if principal.anonymous:
        return ProtocolError(401, "credentials required", {"WWW-Authenticate": REALM})
    return ProtocolError(
        403,
        f"{scope} access to this stream is not granted",
        {"WWW-Authenticate": f'{REALM}, error="insufficient_scope", scope="{scope}"'},
    )


def unauthorized(reason: str) -> ProtocolError:
    """Credentials that were sent and cannot be used (bad, expired, unknown)."""
    header = f'{REALM}, error="invalid_token", error_description="{reason}"'
    return ProtocolError(401, f"invalid credentials: {reason}", {"WWW-Authenticate": header})


def check(principal: Principal, scope: Scope, path: str) -> None:
    if not principal.allows(scope, path):
        raise deny(principal, scope, path)


# Signed URLs: like presigned object-store URLs, for clients that cannot send an
# Authorization header (EventSource, <img>, a link). The signature covers the
# scope, the exact stream path, the expiry and who minted it (a digest of the
# minting credential's id, so rate limits and live caps count against it).
SIG_EXPIRES, SIG_SCOPE, SIG_BY, SIG = "ds_expires", "ds_scope", "ds_by", "ds_sig"
SIG_TENANT = "ds_tenant"  # the minter's tenant (docs/tenants.md), signed too when there is one
SIGNED_SCOPES: tuple[Scope, ...] = ("read", "write")


def _utf8(value: str) -> bytes:
    """Query values and paths may hold lone surrogates (bytes that were not UTF-8)."""
    return value.encode("utf-8", "surrogatepass")


def _mac(key: bytes, scope: str, path: str, expires: int, by: str, tenant: str = "") -> str:
    # v1 without a tenant: URLs signed before tenants were keep their meaning
    text = (
        f"v2\n{scope}\n{path}\n{expires}\n{by}\n{tenant}"
        if tenant
        else f"v1\n{scope}\n{path}\n{expires}\n{by}"
    )
    message = _utf8(text)
    return base64.urlsafe_b64encode(hmac.new(key, message, hashlib.sha256).digest()).rstrip(b"=").decode()


def minter_digest(principal_id: str) -> str:
    return hashlib.sha256(principal_id.encode()).hexdigest()[:16]


def sign(key: bytes, scope: Scope, path: str, expires: int, by: str, tenant: str = "") -> dict[str, str]:
    """The query parameters that let their bearer use ``scope`` on ``path`` until ``expires``
    (as ``tenant``'s, when the minter has one: its requests are that tenant's)."""
    by = minter_digest(by)
    query = {SIG_EXPIRES: str(expires), SIG_SCOPE: scope, SIG_BY: by}
    if tenant:
        query[SIG_TENANT] = tenant
    query[SIG] = _mac(key, scope, path, expires, by, tenant)
    return query


def holder(principal: Principal) -> str:
    """Whom rate limits and live caps count a request against: a signed URL counts
    against the credential that minted it, as that credential's own requests do."""
    if principal.id.startswith("signed:"):
        return "minter:" + principal.id[len("signed:") :]
    if principal.anonymous:
        return principal.id
    return "minter:" + minter_digest(principal.id)


def has_signature(query: Mapping[str, str]) -> bool:
    return SIG in query


def verify_signed(key: bytes, query: Mapping[str, str], path: str, now: float) -> Principal:
    """The principal a signed URL stands for, or 401 (bad signature, other path, expired)."""
    scope, by, sig = query.get(SIG_SCOPE, ""), query.get(SIG_BY, ""), query.get(SIG, "")
    tenant = query.get(SIG_TENANT, "")
    try:
        expires = int(query.get(SIG_EXPIRES, ""))
    except ValueError:
        raise unauthorized("signed URL without a valid expiry") from None
    if scope not in SIGNED_SCOPES:
        raise unauthorized("signed URL with an unknown scope")
    if not hmac.compare_digest(_mac(key, scope, path, expires, by, tenant).encode(), _utf8(sig)):
        raise unauthorized("signed URL signature does not match")
    if now >= expires:
        raise unauthorized("signed URL expired")
    grants = Grants({scope: (path,)})
    return Principal(f"signed:{by}", grants, expires_at=float(expires), only_path=path, tenant=tenant or None)
