"""HTTP handlers of the reserved subscription APIs (protocol sections 6 and 7) under
``{prefix}/__ds/``: parse (protocol/subscriptions.py), one storage call
(features/subscriptions.py), shape the documented JSON.

Access control: managing a subscription (create, delete, membership) needs ``write``
on ``__ds/subscriptions/<id>``, reading it ``read``, claiming a pull-wake ``write``;
creating one also needs ``read`` on what it watches (the pattern's literal prefix,
each explicit stream) and, for pull-wake, ``write`` on its wake stream. Callbacks,
acks and releases carry the wake's own token instead (spec 12.9), and the JWKS is
public.
"""

from __future__ import annotations

import asyncio
import socket
import time
import weakref
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from ..features.subscriptions import TOKEN_TTL_MS, Link, Subscriptions, not_found
from ..protocol import access, ssrf
from ..protocol.errors import coded
from ..protocol.namespace import RESERVED
from ..protocol.subscriptions import (
    SubscriptionConfig,
    check_token,
    issue_token,
    literal_prefix,
    normalize_path,
    parse_ack,
    parse_claim,
    parse_config,
    parse_membership,
    validate_id,
)
from ..protocol.webhooks import jwks as jwk_set
from .bodies import read_body
from .context import gateway_of
from .guard import principal_of
from .handlers import public_url

JWKS_PATH = f"{RESERVED}/jwks.json"
DNS_TIMEOUT_SECONDS = 5.0
MAX_CONTROL_BODY = 1024 * 1024  # a subscription's JSON: 1,000 paths of 1 KB at most


def _subscriptions(request: web.Request) -> Subscriptions:
    return gateway_of(request).store.subscriptions


def _id(request: web.Request) -> str:
    return validate_id(request.match_info["id"])  # aiohttp has decoded it


def control_path(sub: str) -> str:
    """The path access grants name a subscription by."""
    return f"{RESERVED}/subscriptions/{sub}"


async def _admit(request: web.Request, sub: str, scope: access.Scope) -> None:
    await gateway_of(request).guard.admit_path(request, control_path(sub), scope)


def stream_root(request: web.Request) -> str:
    """The stream root URL clients reach this server by (--public-url when set, else the
    request's checked Host): callback URLs are built on it."""
    return public_url(request, "").rstrip("/")


async def _body(request: web.Request) -> bytes:
    gw = gateway_of(request)
    limit = min(gw.settings.max_body_bytes, MAX_CONTROL_BODY)
    return await read_body(request, max_bytes=limit, timeout=gw.settings.body_timeout, budget=gw.bodies)


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# Lookups in flight at once, per event loop: getaddrinfo runs in the default thread pool,
# which cold (archive) reads use too, and a timed-out lookup's thread runs on.
_LOOKUPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]
_LOOKUPS = weakref.WeakKeyDictionary()


async def check_webhook_target(url: str, policy: ssrf.TargetPolicy) -> None:
    """Spec 6.2, 12.8: the URL's form, then every address its host resolves to now (the
    worker checks again at each delivery: DNS answers change)."""
    host, port = ssrf.check_url(url, policy)
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(DNS_TIMEOUT_SECONDS):
            async with _LOOKUPS.setdefault(loop, asyncio.Semaphore(8)):
                found = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError):
        raise coded(400, "WEBHOOK_URL_REJECTED", f"webhook host {host!r} does not resolve") from None
    ssrf.check_addresses(host, [str(info[4][0]) for info in found], policy)


def describe(sub: str, state: dict[str, str], links: list[Link], root: str, kid: str) -> dict[str, Any]:
    """The documented subscription JSON (spec 6.3)."""
    config = SubscriptionConfig.from_json(state["cfg"].encode())
    public = config.public()
    webhook = public["webhook"]
    if webhook is not None:
        webhook = {**webhook, "signing": {"alg": "ed25519", "kid": kid, "jwks_url": f"{root}/{JWKS_PATH}"}}
    return {
        "id": sub,
        "subscription_id": sub,
        "type": public["type"],
        "pattern": public["pattern"],
        "streams": [{"path": k.path, "link_type": k.link_type, "acked_offset": k.acked} for k in links],
        "webhook": webhook,
        "wake_stream": public["wake_stream"],
        "lease_ttl_ms": public["lease_ttl_ms"],
        "created_at": state.get("created_at"),
        "status": state.get("status", "active"),
        "description": public["description"],
    }


async def _described(request: web.Request, sub: str, status: int = 200) -> web.Response:
    subs = _subscriptions(request)
    found = await subs.get(sub)
    if found is None:
        raise not_found(sub)
    kid = (await subs.signing.signer()).kid
    return web.json_response(describe(sub, *found, stream_root(request), kid), status=status)


# -- configuration ---------------------------------------------------------------


async def put_subscription(request: web.Request) -> web.Response:
    sub = _id(request)
    await _admit(request, sub, "write")
    gw = gateway_of(request)
    config = parse_config(await _body(request), gw.settings.subscription_max_streams)
    principal = principal_of(request)
    if config.pattern is not None:
        prefix = literal_prefix(config.pattern)
        access.check(principal, "read", prefix)
        if config.pattern.startswith(prefix + "**") and prefix:  # `a/**` also matches the stream `a`
            access.check(principal, "read", prefix.rstrip("/"))
    for path in config.streams:
        access.check(principal, "read", path)
    if config.wake_stream is not None:
        access.check(principal, "write", config.wake_stream)
    if config.webhook_url is not None:
        await check_webhook_target(config.webhook_url, gw.webhook_policy)
    created = await _subscriptions(request).create(sub, config, _now_iso(), stream_root(request))
    return await _described(request, sub, 201 if created else 200)


async def get_subscription(request: web.Request) -> web.Response:
    sub = _id(request)
    await _admit(request, sub, "read")
    return await _described(request, sub)


async def delete_subscription(request: web.Request) -> web.Response:
    sub = _id(request)
    await _admit(request, sub, "write")
    if not await _subscriptions(request).delete(sub):
        raise not_found(sub)
    return web.Response(status=204)


async def add_streams(request: web.Request) -> web.Response:
    sub = _id(request)
    await _admit(request, sub, "write")
    paths = parse_membership(await _body(request), gateway_of(request).settings.subscription_max_streams)
    for path in paths:
        access.check(principal_of(request), "read", path)
    await _subscriptions(request).add_streams(sub, paths)
    return web.Response(status=204)


async def remove_stream(request: web.Request) -> web.Response:
    sub = _id(request)
    await _admit(request, sub, "write")
    path = normalize_path(request.match_info["path"])
    await _subscriptions(request).remove_stream(sub, path)
    return web.Response(status=204)


# -- wakes -----------------------------------------------------------------------


def _bearer(request: web.Request) -> str:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise coded(401, "TOKEN_INVALID", "a bearer token (the wake's) is required")
    return token.strip()


async def _wake_call(request: web.Request, mode: str, kind: str) -> tuple[str, bool]:
    """A callback, ack or release: the wake token checked, then the fenced script."""
    sub = _id(request)
    subs = _subscriptions(request)
    token = _bearer(request)
    ack = parse_ack(await _body(request))
    claims = check_token([await subs.secret()], token, sub, kind, int(time.time() * 1000))
    if claims.generation != ack.generation or claims.wake_id != ack.wake_id:
        raise coded(409, "FENCED", "the token is for another wake")
    return sub, await subs.ack(mode, sub, ack)


async def callback(request: web.Request) -> web.Response:
    _, next_wake = await _wake_call(request, "callback", "callback")
    return web.json_response({"ok": True, "next_wake": next_wake})


async def ack(request: web.Request) -> web.Response:
    _, next_wake = await _wake_call(request, "ack", "claim")
    return web.json_response({"ok": True, "next_wake": next_wake})


async def release(request: web.Request) -> web.Response:
    await _wake_call(request, "release", "claim")
    return web.Response(status=204)


async def claim(request: web.Request) -> web.Response:
    sub = _id(request)
    await _admit(request, sub, "write")
    worker = parse_claim(await _body(request))
    subs = _subscriptions(request)
    claimed = await subs.claim(sub, worker)
    token = issue_token(
        await subs.secret(),
        sub,
        claimed["generation"],
        claimed["wake_id"],
        "claim",
        TOKEN_TTL_MS,
        int(time.time() * 1000),
    )
    return web.json_response(
        {
            "wake_id": claimed["wake_id"],
            "generation": claimed["generation"],
            "token": token,
            "streams": claimed["streams"],
            "lease_ttl_ms": claimed["lease_ttl_ms"],
        }
    )


async def jwks(request: web.Request) -> web.Response:
    """Spec 6.5: the public keys webhooks are signed with (and those about to be)."""
    keys = await _subscriptions(request).signing.published()
    return web.json_response(
        jwk_set(keys),
        content_type="application/jwk-set+json",
        headers={"Cache-Control": "public, max-age=300"},
    )


async def reserved(request: web.Request) -> web.Response:
    raise coded(404, "NOT_FOUND", "no such control API")


_ANY = ("GET", "HEAD", "PUT", "POST", "DELETE")


def routes(prefix: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(route name, path, handlers by method), before the streams' route: the reserved
    prefix is routed first (spec 6)."""
    base = f"{prefix.rstrip('/')}/{RESERVED}"
    one = f"{base}/subscriptions/{{id}}"
    return [
        ("jwks", f"{base}/jwks.json", {"GET": jwks, "HEAD": jwks}),
        (
            "subscription",
            one,
            {"PUT": put_subscription, "GET": get_subscription, "DELETE": delete_subscription},
        ),
        ("subscription-streams", f"{one}/streams", {"POST": add_streams}),
        ("subscription-streams", f"{one}/streams/{{path:.+}}", {"DELETE": remove_stream}),
        ("subscription-callback", f"{one}/callback", {"POST": callback}),
        ("subscription-claim", f"{one}/claim", {"POST": claim}),
        ("subscription-ack", f"{one}/ack", {"POST": ack}),
        ("subscription-release", f"{one}/release", {"POST": release}),
        ("reserved", base, dict.fromkeys(_ANY, reserved)),
        ("reserved", f"{base}/{{rest:.*}}", dict.fromkeys(_ANY, reserved)),
    ]
