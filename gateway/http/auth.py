"""Who a request is: static bearer tokens, JWTs (a key, or a JWKS URL), signed
URLs, or anonymous. The rules (grants, signatures, 401 vs 403) are pure functions
in gateway/protocol/access.py; this module holds the keys and the I/O (token
file, JWKS fetches).

JWTs are verified by PyJWT; its own JWKS client fetches with blocking urllib, so
the JWKS is fetched here with aiohttp and handed to ``PyJWKSet``.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
import jwt
import orjson
from aiohttp import web

from ..config import Settings
from ..protocol import tenants
from ..protocol.access import Grants, Principal, has_signature, parse_grants, unauthorized, verify_signed
from ..protocol.errors import ProtocolError
from ..telemetry.logs import RateLimited

log = logging.getLogger(__name__)
limited = RateLimited(log)

TOKEN_FILE_CHECK_SECONDS = 5.0  # a changed token file (a rotated Secret) is read again this often
JWKS_REFETCH_SECONDS = 1.0  # an unknown key id fetches the JWKS again, at most this often
JWT_LEEWAY_SECONDS = 5.0  # clock skew allowed on exp/nbf/iat
VERIFIED_CACHE = 10_000  # JWTs verified recently: not verified again (an RS256 check costs ~50 µs) ...
VERIFIED_SECONDS = 60.0  # ... for this long at most (a key withdrawn from the JWKS stops working)
ASYMMETRIC = ["RS256", "RS384", "RS512", "PS256", "ES256", "ES384", "EdDSA"]


def _timestamp(value: object, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            pass
        else:  # without a zone: UTC, not whatever zone the server runs in
            return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()
    raise ValueError(f"{where}: expires_at must be Unix seconds or an ISO 8601 time")


@dataclass(frozen=True)
class _Token:
    name: str
    grants: Grants
    expires_at: float | None
    tenant: str | None = None


def load_tokens(path: str, tenanted: bool = False) -> dict[str, _Token]:
    """The token file: ``{"tokens": [{"name", "token" | "sha256", "grants", "expires_at"?, "tenant"?}]}``
    (or just the list). Keyed by the token's SHA-256, so the file may hold hashes only.
    ``tenanted`` (--tenants): each entry's ``tenant`` is read (else left alone, as any other field)."""
    with open(path, "rb") as f:
        try:
            doc = orjson.loads(f.read())
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
    entries = doc.get("tokens") if isinstance(doc, dict) else doc
    if not isinstance(entries, list):
        raise ValueError(f'{path}: expected {{"tokens": [...]}}')
    tokens: dict[str, _Token] = {}
    for i, entry in enumerate(entries):
        where = f"{path}: token {i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ValueError(f"{where}: needs a name")
        where = f"{path}: token {entry['name']!r}"
        secret, digest = entry.get("token"), entry.get("sha256")
        if isinstance(secret, str) and len(secret) >= 16:
            digest = hashlib.sha256(secret.encode()).hexdigest()
        elif secret is not None:
            raise ValueError(f"{where}: a token must be a string of 16 characters or more")
        if not isinstance(digest, str) or len(digest) != 64:
            raise ValueError(f"{where}: needs 'token' or 'sha256' (hex)")
        grants = parse_grants(entry.get("grants"))
        if not grants:
            raise ValueError(f"{where}: grants nothing")
        try:
            tenant = tenants.claim_tenant(entry.get("tenant")) if tenanted else None
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        expires_at = _timestamp(entry.get("expires_at"), where)
        tokens[digest.lower()] = _Token(entry["name"], grants, expires_at, tenant)
    return tokens


class _TokenFile:
    """Static tokens, read again when the file changes (a Kubernetes Secret update)."""

    def __init__(self, path: str, tenanted: bool) -> None:
        self.path, self.tenanted = path, tenanted
        self.mtime = os.stat(path).st_mtime_ns
        self.tokens = load_tokens(path, tenanted)
        self.checked = time.monotonic()

    def get(self, secret: str) -> _Token | None:
        now = time.monotonic()
        if now - self.checked >= TOKEN_FILE_CHECK_SECONDS:
            self.checked = now
            try:
                mtime = os.stat(self.path).st_mtime_ns
                if mtime != self.mtime:
                    self.tokens, self.mtime = load_tokens(self.path, self.tenanted), mtime
                    log.info("token file %s read again: %d tokens", self.path, len(self.tokens))
            except (OSError, ValueError) as exc:  # keep the tokens we have
                limited.log(logging.ERROR, "tokens", "token file not read again: %s", exc)
        return self.tokens.get(hashlib.sha256(secret.encode()).hexdigest())


class _Jwks:
    """Keys from a JWKS URL: cached for ``ttl`` seconds, fetched again at once
    (at most every JWKS_REFETCH_SECONDS) when a token names an unknown key id,
    so a key rotation needs no restart."""

    def __init__(self, url: str, ttl: float) -> None:
        self.url, self.ttl = url, ttl
        self.keys: dict[str, jwt.PyJWK] = {}
        self.fetched = -1e9
        self._lock = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None

    async def key(self, kid: str | None) -> jwt.PyJWK:
        now = time.monotonic()
        stale = now - self.fetched >= self.ttl
        unknown = kid not in self.keys if kid else len(self.keys) != 1
        if stale or (unknown and now - self.fetched >= JWKS_REFETCH_SECONDS):
            await self._fetch(now)
        if kid is None and len(self.keys) == 1:
            return next(iter(self.keys.values()))
        found = self.keys.get(kid or "")
        if found is None:
            raise unauthorized("token signed by an unknown key")
        return found

    async def _fetch(self, started: float) -> None:
        async with self._lock:
            if self.fetched >= started:  # another request fetched while we waited
                return
            if self._session is None:
                self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
            try:
                async with self._session.get(self.url) as response:
                    response.raise_for_status()
                    keyset = jwt.PyJWKSet.from_dict(await response.json(content_type=None))
            except Exception as exc:
                self.fetched = time.monotonic()  # don't hammer a failing JWKS endpoint
                limited.log(logging.WARNING, "jwks", "JWKS %s not fetched: %s", self.url, exc)
                if not self.keys:
                    raise ProtocolError(503, "token keys unavailable, retry", {"Retry-After": "5"}) from None
                return  # keep the keys we have
            self.keys = {k.key_id or "": k for k in keyset.keys}
            self.fetched = time.monotonic()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class _Jwt:
    def __init__(self, settings: Settings) -> None:
        if not settings.auth_jwt_audience:
            # Without one, any token the same issuer signed for another service would do.
            raise ValueError("JWT verification needs --auth-jwt-audience (the 'aud' this server accepts)")
        self.claim = settings.auth_jwt_claim
        self.tenant_claim = settings.tenant_claim if settings.tenants else None  # (off: not read)
        self.audience = settings.auth_jwt_audience
        self.issuer = settings.auth_jwt_issuer
        self.static_key: Any = None
        url = settings.auth_jwks_url
        self.jwks = _Jwks(url, settings.auth_jwks_cache_seconds) if url else None
        algorithms = [a.strip() for a in settings.auth_jwt_algorithms.split(",") if a.strip()]
        if settings.auth_jwt_key_file:
            with open(settings.auth_jwt_key_file, "rb") as f:
                raw = f.read().strip()
            if raw.startswith(b"-----BEGIN"):
                self.static_key = raw.decode()
                algorithms = algorithms or ASYMMETRIC
            elif raw.startswith(b"{"):
                self.static_key = jwt.PyJWK.from_json(raw.decode())
                algorithms = algorithms or ASYMMETRIC
            else:
                if len(raw) < 32:
                    raise ValueError(f"{settings.auth_jwt_key_file}: an HS256 secret needs 32 bytes or more")
                self.static_key = raw
                algorithms = algorithms or ["HS256"]
        self.algorithms = algorithms or ASYMMETRIC
        self.verified: OrderedDict[str, tuple[Principal, float]] = OrderedDict()

    async def principal(self, token: str) -> Principal:
        cached = self.verified.get(token)
        if cached is not None and cached[1] > time.time():
            return cached[0]
        try:
            header = jwt.get_unverified_header(token)
            key = self.static_key if self.jwks is None else await self.jwks.key(header.get("kid"))
            claims = jwt.decode(
                token,
                key,
                algorithms=self.algorithms,
                audience=self.audience,
                issuer=self.issuer,
                leeway=JWT_LEEWAY_SECONDS,
                options={"require": ["exp", "aud"]},
            )
        except jwt.ExpiredSignatureError:
            raise unauthorized("token expired") from None
        except jwt.PyJWTError as exc:
            raise unauthorized(f"token rejected ({type(exc).__name__})") from None
        except ProtocolError:
            raise
        except Exception:  # anything else a forged token makes the parser raise (e.g. deep nesting)
            raise unauthorized("token rejected") from None
        try:
            grants = parse_grants(claims.get(self.claim), strict=False)
        except ValueError:
            raise unauthorized("token grants unreadable") from None
        try:
            tenant = tenants.claim_tenant(claims.get(self.tenant_claim)) if self.tenant_claim else None
        except ValueError:
            raise unauthorized(f"token claim {self.tenant_claim!r} is not a tenant name") from None
        subject = f"jwt:{claims.get('iss', '')!r}:{claims.get('sub', '')!r}"
        principal = Principal(subject, grants, expires_at=float(claims["exp"]), tenant=tenant)
        self.verified[token] = (principal, min(float(claims["exp"]), time.time() + VERIFIED_SECONDS))
        if len(self.verified) > VERIFIED_CACHE:
            self.verified.popitem(last=False)
        return principal


_TOKEN = re.compile(r"\A[\x21-\x7e]{1,8192}\Z")  # a token is visible ASCII (RFC 6750 asks even less)


def client_ip(request: web.Request, proxy_hops: int) -> str:
    """The client's IP: the peer, or with ``proxy_hops`` trusted proxies in front, the
    address the outermost of them saw (X-Forwarded-For, counted from the right)."""
    return peer_ip(request.headers.getall("X-Forwarded-For", []), request.remote, proxy_hops)


def peer_ip(forwarded_for: list[str], remote: str | None, proxy_hops: int) -> str:
    """``client_ip`` of a request's X-Forwarded-For lines and its peer's address."""
    if proxy_hops:
        hops = [h.strip() for h in ",".join(forwarded_for).split(",")]
        hops = [h for h in hops if h]
        if len(hops) >= proxy_hops:
            return hops[-proxy_hops]
    return remote or "unknown"


def client_address(request: web.Request, proxy_hops: int) -> str:
    """Who an anonymous client is counted as: its IP (``client_ip``), an IPv6 one as its /64."""
    return _network(client_ip(request, proxy_hops))


def peer_address(forwarded_for: list[str], remote: str | None, proxy_hops: int) -> str:
    """``client_address`` of a request's X-Forwarded-For lines and its peer's address."""
    return _network(peer_ip(forwarded_for, remote, proxy_hops))


def _network(address: str) -> str:
    """An IPv6 client is its /64 (one host usually holds a whole /64 to rotate through)."""
    if ":" not in address:
        return address
    try:
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    except ValueError:
        return address


class Authenticator:
    """Finds a request's principal. Built at startup: a bad token file or key is a
    startup error (ValueError/OSError), not a stream of 401s."""

    def __init__(self, settings: Settings) -> None:
        path = settings.auth_tokens_file
        self.tokens = _TokenFile(path, settings.tenants) if path else None
        has_jwt = settings.auth_jwt_key_file or settings.auth_jwks_url
        self.jwt = _Jwt(settings) if has_jwt else None
        self.signing_key: bytes | None = None
        if settings.auth_signing_key_file:
            with open(settings.auth_signing_key_file, "rb") as f:
                self.signing_key = f.read().strip()
            if len(self.signing_key) < 32:
                raise ValueError(f"{settings.auth_signing_key_file}: a signing key needs 32 bytes or more")
        self.anonymous = parse_grants(settings.auth_anonymous)
        self.proxy_hops = settings.trusted_proxy_hops

    async def principal(self, request: web.Request, path: str) -> Principal:
        """From the Authorization header, else a signed URL for ``path``, else anonymous."""
        hops = self.proxy_hops
        return await self.principal_of(
            request.headers.get("Authorization"), request.query, path, lambda: client_address(request, hops)
        )

    async def principal_of(
        self, authorization: str | None, query: Mapping[str, str], path: str, address: Callable[[], str]
    ) -> Principal:
        """``principal`` of a request's Authorization header, query and ``client_address``
        (asked only for an anonymous request)."""
        if authorization is not None:
            return await self.bearer(authorization)
        if has_signature(query):
            if self.signing_key is None:
                raise unauthorized("signed URLs are not enabled")
            return verify_signed(self.signing_key, query, path, time.time())
        return self.nobody_at(address())

    def nobody_at(self, address: str) -> Principal:
        """The anonymous principal of a client at ``address`` (``client_address``)."""
        return Principal(f"ip:{address}", self.anonymous, anonymous=True)

    async def bearer(self, header: str) -> Principal:
        """The principal of an Authorization header (only ``Bearer <token>`` is taken)."""
        scheme, _, token = header.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not _TOKEN.match(token):
            raise unauthorized("use Authorization: Bearer <token> (visible ASCII)")
        return await self._bearer(token)

    async def _bearer(self, token: str) -> Principal:
        if self.tokens is not None:
            found = self.tokens.get(token)
            if found is not None:
                if found.expires_at is not None and time.time() >= found.expires_at:
                    raise unauthorized("token expired")
                return Principal(
                    f"token:{found.name}", found.grants, expires_at=found.expires_at, tenant=found.tenant
                )
        if self.jwt is not None and token.count(".") == 2:
            return await self.jwt.principal(token)
        raise unauthorized("unknown token")

    async def close(self) -> None:
        if self.jwt is not None and self.jwt.jwks is not None:
            await self.jwt.jwks.close()
