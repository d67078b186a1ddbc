"""What a request passes before its handler runs, and the browser headers every
answer gets: the origin check, access control, write backpressure, rate limits
and caps on live connections. ``endpoint`` (app.py) calls ``admit_*``; handlers
read the principal with ``principal_of``.

With access control off and no rate limits, a stream request costs one header
lookup here (the origin check of writes) and, unless writes are paused, one
attribute lookup (features/backpressure.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping

from aiohttp import web

from ..config import Settings
from ..features.backpressure import WritePause
from ..features.ratelimit import RateLimiter
from ..features.tenants import TenantRates
from ..protocol import access, browser, quotas, tenants
from ..protocol.access import OPEN, Principal, Scope
from ..protocol.errors import ProtocolError
from ..protocol.headers import STREAM_CLOSED, is_true
from ..protocol.responses import EXPOSED
from .auth import Authenticator, client_address

PRINCIPAL = web.RequestKey("principal", Principal)
TENANT = web.RequestKey("tenant", str)  # a stream request's, with tenants on (metered by endpoint.py)
_WRITES = frozenset({"PUT", "POST", "DELETE"})
_PATHS_KEPT = 10_000  # stream paths whose --tenant-paths tenant is remembered (then all forgotten)


def principal_of(request: web.Request) -> Principal:
    """Who the request acts as (OPEN when access control is off)."""
    return request.get(PRINCIPAL, OPEN)


def stores_data(request: web.Request) -> bool:
    """A stream request that may add data: what write backpressure refuses. Reads and
    DELETE (it frees memory) go on, and so does a close without a body: it stores a flag,
    and a closed stream's data is archived without waiting for more (README, "Write
    backpressure")."""
    if request.method == "PUT":
        return True
    if request.method != "POST":
        return False
    return not (request.content_length == 0 and is_true(request.headers.get(STREAM_CLOSED)))


def local_port(request: web.Request) -> int | None:
    """The port of the listener a request came in on."""
    transport = request.transport
    name = transport.get_extra_info("sockname") if transport is not None else None
    return name[1] if isinstance(name, tuple) else None


class LiveSlots:
    """Caps on live reads (SSE, long-poll) held at once: per process, and per
    credential (anonymous clients: per address) when access control is on."""

    def __init__(self, per_process: int, per_credential: int) -> None:
        self.per_process, self.per_credential = per_process, per_credential
        self.total = 0
        self.held: dict[str, int] = {}

    @contextlib.contextmanager
    def hold(self, who: str | None) -> Iterator[None]:
        if self.per_process and self.total >= self.per_process:
            raise ProtocolError(503, "too many live connections on this server", {"Retry-After": "5"})
        if who is not None and self.per_credential and self.held.get(who, 0) >= self.per_credential:
            raise ProtocolError(503, "too many live connections for this credential", {"Retry-After": "5"})
        self.total += 1
        if who is not None:
            self.held[who] = self.held.get(who, 0) + 1
        try:
            yield
        finally:
            self.total -= 1
            if who is not None:
                left = self.held[who] - 1
                if left:
                    self.held[who] = left
                else:
                    del self.held[who]


class Guard:
    """Admission for every route, built once per process from the settings."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.auth = Authenticator(settings) if settings.auth_enabled else None
        self.rules = quotas.parse_rules(settings.rate_limits)
        self.tenants_on = settings.tenants
        self.tenant_rules = tenants.parse_path_rules(settings.tenant_paths)
        self._by_path: dict[str, str] = {}  # stream path -> its --tenant-paths tenant
        self.limiter: RateLimiter | None = None
        self.tenant_rates: TenantRates | None = None
        self.pause: WritePause | None = None
        self.cors = browser.cors_policy(
            settings.cors_origins, settings.cors_methods, settings.cors_credentials, settings.auth_enabled
        )
        self.admin_port = settings.admin_port
        # Access control off on loopback (a laptop): only requests for a loopback name (or the
        # public URL's) are served, so a web page cannot reach it by DNS rebinding.
        self.local_names: frozenset[str] | None = None
        if self.auth is None and settings.host in browser.LOOPBACK:
            public = (settings.public_url or "").partition("://")[2].split("/", 1)[0].lower()
            self.local_names = frozenset({public} if public else set())
        self.live = LiveSlots(settings.max_live_connections, settings.max_live_per_credential)
        # The browser headers of an answer to a request without an Origin (most clients),
        # or to any request when they do not depend on its Origin: built once.
        self.plain = {**browser.BASE, **browser.response_headers(self.cors, None, EXPOSED)}
        self.origin_blind = self.cors.any_origin and not self.cors.credentials

    def attach(
        self, limiter: RateLimiter, pause: WritePause | None = None, rates: TenantRates | None = None
    ) -> None:
        """The Redis-backed buckets, once connected (used only when rules are set, or tenants
        with their rate quotas), the write backpressure monitor, and the tenants' rates."""
        if self.rules or (self.tenants_on and rates is not None):
            self.limiter = limiter
        self.pause = pause
        self.tenant_rates = rates if self.tenants_on else None

    # -- admission ---------------------------------------------------------------

    def admit_stream(self, request: web.Request) -> Awaitable[None] | None:
        """A stream request: origin, then credentials and grants, then write backpressure
        (after them: a client that may not write is told so, not to retry), then rate
        limits (a refused write takes no token).

        With access control off and no rate limits nothing here waits: the checks run now
        (a refusal is raised) and None is returned, not a coroutine to await (~0.8 µs a
        request for two coroutines). Otherwise the awaitable of ``admit_path``."""
        if self.auth is not None or self.rules:
            return self.admit_path(
                request, request.match_info["path"], access.required_scope(request.method), stream=True
            )
        if request.method == "OPTIONS":  # a preflight carries no credentials: answered for anyone
            return None
        self._check_host_and_origin(request)
        if self.tenants_on:  # every stream request is some tenant's: 403 here when none
            path, scope = request.match_info["path"], access.required_scope(request.method)
            tenant = request[TENANT] = self.tenant(OPEN, path)
            if not self._rate_free(tenant, scope):  # its own rate quota (or not known yet)
                return self.admit_path(request, path, scope, stream=True)
        if self.pause is not None and self.pause.active and stores_data(request):
            self.pause.check(request.match_info["path"])
        return None

    async def admit_path(
        self, request: web.Request, path: str, scope: Scope, *, stream: bool = False
    ) -> None:
        """Origin, then credentials and ``scope`` on ``path``, then (``stream``) write
        backpressure, then rate limits: a stream's request, or a subscription API's (its
        path: ``__ds/subscriptions/<id>``; small bookkeeping, never paused)."""
        if request.method == "OPTIONS":  # a preflight carries no credentials: answered for anyone
            return
        self._check_host_and_origin(request)
        authorization, address = request.headers.get("Authorization"), self._address(request)
        paused = stream and stores_data(request)
        principal = await self._admit(
            authorization, request.query, scope, path, address, paused=paused, stream=stream
        )
        if self.auth is not None or self.limiter is not None:
            request[PRINCIPAL] = principal
        if stream and self.tenants_on:
            request[TENANT] = self.tenant(principal, path)

    def admit_append(
        self, host: str, authorization: str | None, path: str, address: Callable[[], str]
    ) -> Awaitable[Principal] | None:
        """``admit_path`` for an append answered on its connection (fastpath.py): its request
        has no Origin and no query (so no signed URL), and write backpressure was found off
        before. ``address``: its ``client_address``, asked only when it counts. None when
        admitted at once (no access control, no rate limits: nothing to await, every append
        comes here); else what to await."""
        self.check_host(host)
        if self.auth is None and not self.rules:
            if not self.tenants_on or self._rate_free(self.tenant(OPEN, path), "write"):
                return None
        return self._admit(authorization, {}, "write", path, address, paused=False, stream=True)

    def _rate_free(self, tenant: str, scope: Scope) -> bool:
        """Whether a request of ``tenant`` needs no rate check (features/tenants.TenantRates.unlimited)."""
        return self.tenant_rates is None or self.tenant_rates.unlimited(tenant, scope)

    async def _admit(
        self,
        authorization: str | None,
        query: Mapping[str, str],
        scope: Scope,
        path: str,
        address: Callable[[], str],
        *,
        paused: bool,
        stream: bool = False,
    ) -> Principal:
        """Credentials and ``scope`` on ``path``, then (``stream``: a stream's request) its
        tenant, then write backpressure (``paused``: a request that may store data; after
        them, a client that may not write is told so, not to retry), then rate limits (a
        refused write takes no token; with tenants, a stream request's are its tenant's)."""
        principal = OPEN
        if self.auth is not None or self.limiter is not None:
            principal = await self._principal_of(authorization, query, scope, path, address)
            access.check(principal, scope, path)
        tenant = self.tenant(principal, path) if stream else ""
        if paused and self.pause is not None and self.pause.active:
            self.pause.check(path)
        await self._limit(principal, scope, path, address, tenant)
        return principal

    def tenant(self, principal: Principal, path: str) -> str:
        """The tenant a request on stream ``path`` acts for ('' with tenants off); 403
        when it has none (protocol/tenants.py)."""
        if not self.tenants_on:
            return ""
        if principal.tenant:  # (the credential's, whatever the path)
            return principal.tenant
        if not principal.anonymous and principal.only_path is None:
            return tenants.tenant_of(None, True, path, self.tenant_rules)  # 403: it names none
        found = self._by_path.get(path)  # an append asks twice (admission, then its handler)
        if found is None:
            if len(self._by_path) >= _PATHS_KEPT:
                self._by_path.clear()
            found = self._by_path[path] = tenants.tenant_of(None, False, path, self.tenant_rules)
        return found

    async def admit_listing(self, request: web.Request, prefix: str) -> Principal:
        """A listing of ``prefix`` (http/listing.py): like a read of it, except that
        credentials covering part of it (or none) are not refused here: the listing
        shows what they may read. Rate limited as a read of the prefix."""
        self._check_host_and_origin(request)
        principal = await self._principal(request, "read", prefix)
        request[PRINCIPAL] = principal
        await self.limit(request, principal, "read", prefix)
        return principal

    def _check_host_and_origin(self, request: web.Request) -> None:
        self.check_host(request.host)
        if request.method in _WRITES:
            origin = request.headers.get("Origin")
            if origin is not None:
                same = browser.same_origin(origin, request.host, self.settings.public_url)
                browser.check_origin(self.cors, origin, same)

    def check_host(self, host: str) -> None:
        """Access control off on loopback: only a loopback name (or the public URL's) is
        served, so a web page cannot reach this server by DNS rebinding."""
        if self.local_names is not None:
            if not browser.local_host(host) and host.lower() not in self.local_names:
                raise ProtocolError(403, "this server answers only to localhost (access control is off)")

    async def _principal(self, request: web.Request, scope: Scope, path: str) -> Principal:
        """Who the request acts as (``_principal_of``)."""
        authorization = request.headers.get("Authorization")
        return await self._principal_of(authorization, request.query, scope, path, self._address(request))

    async def _principal_of(
        self, authorization: str | None, query: Mapping[str, str], scope: Scope, path: str,
        address: Callable[[], str],
    ) -> Principal:  # fmt: skip
        """Who a request acts as (OPEN without access control); bad credentials are
        charged to the rate limits as anonymous, then refused (401)."""
        if self.auth is None:
            return OPEN
        try:
            return await self.auth.principal_of(authorization, query, path, address)
        except ProtocolError as exc:
            if exc.status == 401:
                await self._limit(self.auth.nobody_at(address()), scope, path, address)
            raise

    def _address(self, request: web.Request) -> Callable[[], str]:
        """The request's ``client_address``, to ask when it counts."""
        hops = self.settings.trusted_proxy_hops
        return lambda: client_address(request, hops)

    async def admit_ops(self, request: web.Request, route: str) -> None:
        """/metrics, /healthz, /readyz: only on the admin listener when there is one;
        without one, /metrics needs admin access when access control is on."""
        if self.admin_port:
            if local_port(request) != self.admin_port:
                raise ProtocolError(404, "not found")
            return
        if route == "metrics" and self.auth is not None:
            principal = await self.auth.principal(request, "")
            access.check(principal, "admin", "")

    async def admit_tenants(self, request: web.Request, own: str) -> None:
        """The tenants API (http/tenants.py): ``admin`` on every stream; or, ``own`` being a
        tenant's name, a read of its entry by that tenant's credentials."""
        self._check_host_and_origin(request)
        principal = await self._principal(request, "admin", "")
        request[PRINCIPAL] = principal
        if not (own and request.method == "GET" and principal.tenant == own):
            access.check(principal, "admin", "")
        await self.limit(request, principal, "admin", "")

    async def authenticated(self, request: web.Request) -> Principal:
        """The principal of a request that must carry credentials (e.g. /auth/sign)."""
        if self.auth is None:
            raise ProtocolError(404, "access control is off")
        principal = await self.auth.principal(request, "")
        if principal.anonymous:
            raise access.deny(principal, "read", "")
        return principal

    async def limit(self, request: web.Request, principal: Principal, scope: Scope, path: str) -> None:
        """429 + Retry-After when the bucket of the rule that applies is empty."""
        await self._limit(principal, scope, path, self._address(request))

    async def _limit(
        self, principal: Principal, scope: Scope, path: str, address: Callable[[], str], tenant: str = ""
    ) -> None:
        """``limit``; ``address``: the client's address, asked only when it counts;
        ``tenant``: counted as that tenant's (every credential and client of it share its
        buckets), '' as the principal's."""
        if self.limiter is None:
            return
        if tenant and self.tenant_rates is not None:
            await self._limit_tenant(tenant, scope)
        rule = quotas.match(self.rules, scope, path, principal.anonymous)
        if rule is None:
            return
        if tenant:
            who = f"tenant:{tenant}"
        else:
            who = f"ip:{address()}" if principal is OPEN else access.holder(principal)
        await self._take(who, rule)

    async def _limit_tenant(self, tenant: str, scope: Scope) -> None:
        """The tenant's own rate quota for ``scope`` (features/tenants.TenantRates)."""
        assert self.tenant_rates is not None and self.limiter is not None
        per_second = (await self.tenant_rates.rates(tenant)).get(scope)
        if per_second is None:
            return
        if per_second == 0:
            raise tenants.refused(tenants.RATE_QUOTAS[scope], 0, 0, 1)
        await self._take(f"tenant:{tenant}", tenants.rate_rule(scope, per_second))

    async def _take(self, who: str, rule: quotas.RateRule) -> None:
        """A token from ``who``'s bucket under ``rule``; 429 + Retry-After when there is none."""
        assert self.limiter is not None
        wait = await self.limiter.take(who, rule)
        if wait > 0:
            raise ProtocolError(429, "rate limit exceeded", {"Retry-After": str(max(1, math.ceil(wait)))})

    def live_holder(self, request: web.Request) -> str | None:
        """Whose live-connection count a live read counts against (None: only the process's)."""
        if self.auth is None:
            return None
        return access.holder(principal_of(request))

    # -- answers -----------------------------------------------------------------

    def browser_headers(self, request: web.Request) -> dict[str, str]:
        """Security and CORS headers for an answer to ``request``."""
        return self.headers_for(request.headers.get("Origin"))

    def headers_for(self, origin: str | None) -> dict[str, str]:
        """Security and CORS headers for an answer to a request from ``origin`` (None: no
        Origin header)."""
        if origin is None or self.origin_blind:
            return self.plain
        return {**browser.BASE, **browser.response_headers(self.cors, origin, EXPOSED)}

    def preflight(self, request: web.Request) -> dict[str, str]:
        h = request.headers
        private = h.get("Access-Control-Request-Private-Network") == "true"
        return browser.preflight_headers(self.cors, h.get("Origin"), private, EXPOSED)

    def secure(self, request: web.Request, headers: MutableMapping[str, str]) -> None:
        """``secure_answer`` for an aiohttp request."""
        self.secure_answer(request.headers.get("Origin"), principal_of(request), headers)

    def secure_answer(
        self, origin: str | None, principal: Principal, headers: MutableMapping[str, str]
    ) -> None:
        """Browser headers on an answer (unless a handler chose its own), and reads
        made with credentials kept out of shared caches."""
        for name, value in self.headers_for(origin).items():
            if name == "Vary" and "Vary" in headers:  # a read's Accept-Encoding, and Origin
                if value not in headers["Vary"]:
                    headers["Vary"] = f"{headers['Vary']}, {value}"
            else:
                headers.setdefault(name, value)
        if self.auth is not None and not principal.anonymous:
            cache = headers.get("Cache-Control")
            if cache is not None and cache.startswith("public"):
                headers["Cache-Control"] = "private" + cache[len("public") :]

    async def close(self) -> None:
        if self.auth is not None:
            await self.auth.close()
