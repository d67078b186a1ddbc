"""Tenants (``--tenants``, docs/tenants.md): whose a request is, what a tenant may hold
and use, and how a refusal reads. Plain functions, no I/O: the quotas are checked and
the usage counted by the write's own script (``lua/_prelude.lua``, "Tenants"), the
overrides kept in Redis (``features/tenants.py``).

A request's tenant is its credential's (a JWT's ``--tenant-claim``, a token file
entry's ``tenant``); a request without credentials (or with a signed URL) is the
tenant of the longest ``--tenant-paths`` rule that covers its path::

    rule = prefix "=" tenant      e.g.  "public/=demo acme/=acme"

A credential that names no tenant, or a request no rule covers, is refused (403):
with tenants on, every request is some tenant's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .access import normalize_prefix
from .errors import ProtocolError
from .quotas import RateRule

NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")  # safe in key names, URLs and logs
NAME_RULE = "1 to 64 of A-Z a-z 0-9 . _ - (not starting with . _ -)"
_SEPARATORS = re.compile(r"[\s,;]+")
MAX_QUOTA = 2**53  # exact in Lua's doubles

# The quotas (docs/tenants.md): what each limits. None (no value set anywhere): unlimited.
QUOTAS: Mapping[str, str] = {
    "streams": "streams held at once",
    "stored_bytes": "bytes stored in the tenant's streams (what their appends and creates stored)",
    "written_bytes": "bytes written (appended or created with) per written_period_seconds",
    "written_period_seconds": "the period written_bytes counts over (default: a day), aligned to Unix time",
    "live_connections": "live reads (SSE, long-poll) held at once on every gateway together",
    "writes_per_second": "stream requests needing write access (appends, creates) a second, all gateways",
    "reads_per_second": "stream reads (catch-up, live) a second, every gateway together",
}
# The rate quotas: a token bucket per tenant (features/ratelimit.py), its burst a second's worth.
RATE_QUOTAS = {"write": "writes_per_second", "read": "reads_per_second"}
DEFAULT_PERIOD_SECONDS = 86400
# What the scripts keep in a tenant's hash (keys.tenant): overrides "q.<quota>", usage "u.<...>".
USAGE = ("streams", "stored_bytes", "written_bytes", "period_start")


def valid_name(name: str) -> str:
    """``name`` when it may name a tenant, else ValueError."""
    if not NAME.match(name):
        raise ValueError(f"tenant {name!r}: a tenant name is {NAME_RULE}")
    return name


@dataclass(frozen=True)
class PathRule:
    prefix: str
    tenant: str


def parse_path_rules(spec: str) -> tuple[PathRule, ...]:
    """``--tenant-paths``: ``prefix=tenant`` rules (empty: none). ValueError names a bad one."""
    rules: dict[str, PathRule] = {}
    for text in _SEPARATORS.split(spec.strip()):
        if not text:
            continue
        prefix, equals, tenant = text.rpartition("=")
        if not equals:
            raise ValueError(f"tenant path rule {text!r}: expected <prefix>=<tenant>")
        try:
            valid_name(tenant)
        except ValueError as exc:
            raise ValueError(f"tenant path rule {text!r}: {exc}") from None
        prefix = normalize_prefix(prefix)
        if prefix in rules:
            raise ValueError(f"tenant path rule {text!r}: the prefix {prefix!r} is given twice")
        rules[prefix] = PathRule(prefix, tenant)
    return tuple(rules.values())


def tenant_of(
    credential_tenant: str | None, credentialed: bool, path: str, rules: tuple[PathRule, ...]
) -> str:
    """The tenant a request on ``path`` acts for: its credential's (``credentialed``: it
    came with a bearer token), else the longest path rule's. 403 when there is none."""
    if credential_tenant:
        return credential_tenant
    if credentialed:
        raise ProtocolError(403, "this credential names no tenant (tenants are on: every credential must)")
    best: PathRule | None = None
    for rule in rules:
        if path.startswith(rule.prefix) and (best is None or len(rule.prefix) > len(best.prefix)):
            best = rule
    if best is None:
        raise ProtocolError(
            403, "no tenant: without credentials, a request needs a --tenant-paths rule for its path"
        )
    return best.tenant


def claim_tenant(value: Any) -> str | None:
    """A credential's tenant, as its JWT claim or token entry gives it: None when absent;
    ValueError when present and not a tenant name (the credential is refused)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError("the tenant must be a string")
    return valid_name(value)


def parse_quotas(doc: Any) -> dict[str, int | None]:
    """A quota update (``PUT .../quotas``): ``{quota: whole number | null}``, null removing
    the value (back to the default; in the defaults: unlimited). ValueError names the
    first bad entry; nothing of a bad update is applied."""
    if not isinstance(doc, dict) or not doc:
        raise ValueError(
            f'expected a JSON object of quotas, e.g. {{"streams": 100}} (quotas: {", ".join(QUOTAS)})'
        )
    update: dict[str, int | None] = {}
    for name, value in doc.items():
        if name not in QUOTAS:
            raise ValueError(f"unknown quota {name!r} (quotas: {', '.join(QUOTAS)})")
        if value is None:
            update[name] = None
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_QUOTA:
            raise ValueError(f"quota {name!r}: expected a whole number from 0 to {MAX_QUOTA}, or null")
        if name == "written_period_seconds" and value == 0:
            raise ValueError("quota 'written_period_seconds': a period must be at least 1 second")
        update[name] = value
    return update


def rate_rule(scope: str, per_second: int) -> RateRule:
    """A tenant's rate quota as the rate limiter's rule (its bucket: ``tenant:<name>``)."""
    return RateRule(scope, "", float(per_second), float(max(per_second, 1)), False, f"tenant-{scope}")


def quotas_of(fields: Mapping[str, str]) -> dict[str, int]:
    """The quotas set in a hash's ``q.<quota>`` fields (others ignored)."""
    return {name: int(fields[f"q.{name}"]) for name in QUOTAS if f"q.{name}" in fields}


def effective(overrides: Mapping[str, int], defaults: Mapping[str, int]) -> dict[str, int | None]:
    """Each quota as the scripts apply it: the tenant's value, else the default, else None
    (unlimited; the period: a day)."""
    out: dict[str, int | None] = {}
    for name in QUOTAS:
        out[name] = overrides.get(name, defaults.get(name))
    if out["written_period_seconds"] is None:
        out["written_period_seconds"] = DEFAULT_PERIOD_SECONDS
    return out


def usage_of(fields: Mapping[str, str], now_ms: int, period_seconds: int) -> dict[str, int]:
    """What a tenant's hash says it uses now: ``written_bytes`` only if its period is this one."""
    period_start = now_ms // 1000 // period_seconds * period_seconds
    this_period = int(fields.get("u.period_start", -1)) == period_start
    written = int(fields.get("u.written_bytes", 0)) if this_period else 0
    return {
        "streams": int(fields.get("u.streams", 0)),
        "stored_bytes": int(fields.get("u.stored_bytes", 0)),
        "written_bytes": written,
        "period_start": period_start,
    }


RETRY_LIVE_SECONDS = 5  # a refused live read's Retry-After: connections come and go


def refused(quota: str, limit: int, usage: int, asked: int) -> ProtocolError:
    """A request a quota refuses, naming the quota, its limit and the usage, in the text and
    in ``Stream-Quota``: 403 for storage (retrying does not help until usage goes down),
    429 + Retry-After for live connections (it helps once one ends)."""
    headers = {"Stream-Quota": f"quota={quota}; limit={limit}; usage={usage}; asked={asked}"}
    status = 403
    if quota == "live_connections":
        status, headers["Retry-After"] = 429, str(RETRY_LIVE_SECONDS)
    message = f"tenant quota {quota!r} exceeded: limit {limit}, usage {usage}, this request {asked}"
    return ProtocolError(status, message, headers)


def foreign() -> ProtocolError:
    """A write to a stream another tenant holds."""
    return ProtocolError(403, "this stream belongs to another tenant")
