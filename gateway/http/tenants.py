"""The tenants API under ``{prefix}/__ds/tenants`` (docs/tenants.md): parse
(protocol/tenants.py), one storage call (features/tenants.py), shape the JSON.

- ``GET .../tenants[?limit=100]``: the tenants, those storing the most first.
- ``GET .../tenants/<name>``: its quotas (in force, its own) and usage now; ``_defaults``:
  the defaults. 404 for a tenant that never stored anything and has no quotas of its own.
- ``GET .../tenants/<name>/usage[?from=YYYY-MM-DD&to=YYYY-MM-DD]``: its usage per UTC day,
  counter by counter (the meter's usage files in the archive, and what Redis holds not yet
  moved there); the last 7 days by default, at most MAX_HISTORY_DAYS.
- ``PATCH .../tenants/<name>/quotas`` (or ``PUT``): a JSON merge patch of its quotas
  (``{"stored_bytes": 1000000, "streams": null}``; null: back to the default), applied
  whole or (400) not at all; ``_defaults`` changes the defaults. Writes see it at once.

Needs ``admin`` on every stream (``admin:*``); a tenant's own credentials may read its
entry. With access control off: anyone who can reach the port (loopback by default).
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

import orjson
from aiohttp import web

from ..features.tenants import DEFAULTS, Tenants
from ..protocol import tenants
from ..protocol.errors import ProtocolError, bad_request
from ..protocol.namespace import RESERVED
from .bodies import read_body
from .context import gateway_of

MAX_QUOTA_BODY = 4096  # a quota update: a few small numbers
MAX_LIST = 1000
MAX_HISTORY_DAYS = 92  # a usage history's longest span (it reads every usage file of those days)
NO_STORE = {"Cache-Control": "no-store"}


def _tenants(request: web.Request) -> Tenants:
    return gateway_of(request).store.tenants


def _name(request: web.Request) -> str:
    name = request.match_info["name"]
    if name == DEFAULTS:
        return name
    try:
        return tenants.valid_name(name)
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def _limit(request: web.Request) -> int:
    raw = request.query.get("limit", "100")
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIST:
        raise bad_request(f"limit must be a whole number from 1 to {MAX_LIST}")
    return int(raw)


async def list_tenants(request: web.Request) -> web.Response:
    await gateway_of(request).guard.admit_tenants(request, "")
    found = await _tenants(request).every(_limit(request))
    return web.json_response({"tenants": found}, headers=NO_STORE, dumps=_dumps)


async def get_tenant(request: web.Request) -> web.Response:
    name = _name(request)
    await gateway_of(request).guard.admit_tenants(request, name)
    return web.json_response(await _described(request, name), headers=NO_STORE, dumps=_dumps)


def _day(request: web.Request, name: str, default: date) -> date:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        return date.fromisoformat(raw)
    except ValueError:
        raise bad_request(f"{name} must be a day, YYYY-MM-DD") from None


async def get_usage(request: web.Request) -> web.Response:
    name = _name(request)
    if name == DEFAULTS:
        raise ProtocolError(404, "the defaults have no usage")
    await gateway_of(request).guard.admit_tenants(request, name)
    today = datetime.now(UTC).date()
    last = _day(request, "to", today)
    first = _day(request, "from", last - timedelta(days=6))
    if first > last or (last - first).days >= MAX_HISTORY_DAYS:
        raise bad_request(f"from must not be after to, and at most {MAX_HISTORY_DAYS} days apart")
    days = await _tenants(request).history(name, first, last)
    body = {
        "tenant": name,
        "from": first.isoformat(),
        "to": last.isoformat(),
        "days": [{"day": day.isoformat(), "usage": counters} for day, counters in days.items()],
    }
    return web.json_response(body, headers=NO_STORE, dumps=_dumps)


async def patch_quotas(request: web.Request) -> web.Response:
    name = _name(request)
    gw = gateway_of(request)
    await gw.guard.admit_tenants(request, "")
    raw = await read_body(
        request, max_bytes=MAX_QUOTA_BODY, timeout=gw.settings.body_timeout, budget=gw.bodies
    )
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise bad_request("the body is not JSON") from None
    try:
        update = tenants.parse_quotas(doc)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    await _tenants(request).set_quotas(name, update)
    return web.json_response(await _described(request, name), headers=NO_STORE, dumps=_dumps)


async def _described(request: web.Request, name: str) -> dict[str, Any]:
    store = _tenants(request)
    if name == DEFAULTS:
        return {"tenant": DEFAULTS, "quotas": await store.defaults()}
    if not await store.known(name):
        raise ProtocolError(404, f"unknown tenant {name!r}: it stored nothing and has no quotas of its own")
    return await store.describe(name)


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def routes(prefix: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(route name, path, handlers by method), before the reserved catch-all."""
    base = f"{prefix.rstrip('/')}/{RESERVED}/tenants"
    return [
        ("tenants", base, {"GET": list_tenants}),
        ("tenant", f"{base}/{{name}}", {"GET": get_tenant}),
        ("tenant-quotas", f"{base}/{{name}}/quotas", {"PATCH": patch_quotas, "PUT": patch_quotas}),
        ("tenant-usage", f"{base}/{{name}}/usage", {"GET": get_usage}),
    ]
