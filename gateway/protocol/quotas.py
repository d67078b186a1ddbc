"""Rate limits (``--rate-limits``): the rules and which one a request falls under.

Plain functions, no I/O: the buckets themselves are token buckets in Redis,
shared by every gateway (``features/ratelimit.py``, ``lua/rate_limit.lua``).

The spec is rules separated by whitespace, commas or semicolons::

    rule   = ["anonymous:"] scope ":" prefix "=" count "/" unit ["+" burst]
    scope  = "read" | "write" | "admin"
    unit   = "s" | "sec" | "second" | "m" | "min" | "minute" | "h" | "hour"
    count, burst = a decimal number, e.g. 50 or 0.5

e.g. ``write:=100/s+200 read:chat/=50/s anonymous:read:=10/s``. ``count`` per
``unit`` is the refill rate, ``burst`` the bucket's size (default: the count,
at least 1): a client may send ``burst`` requests at once, then ``count`` per
``unit``. A prefix is spelled as in grants (``protocol/access.py``): stream
paths have no leading slash, so ``/chat/`` is ``chat/``, and ``*``, ``/`` or
nothing cover every stream; it matches as a plain string prefix (``chat``
also covers ``chatter``). Rules are per scope: a request is counted under its
own scope's rule only (``write:`` does not limit reads).

Every credential has its own bucket per rule; anonymous requests are counted
per client address. ``anonymous:`` rules apply to requests without
credentials only, and take precedence for them: an anonymous request falls
under the longest matching ``anonymous:`` rule of its scope and, only when
none matches its path, under the rules everyone else uses.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from .access import SCOPES, normalize_prefix

ANONYMOUS = "anonymous:"
UNIT_SECONDS = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60, "h": 3600, "hour": 3600}
MAX_COUNT = 1e12  # far beyond any sensible limit; keeps the bucket's arithmetic exact
GRAMMAR = "[anonymous:]<read|write|admin>:<prefix>=<count>/<s|m|h>[+<burst>]"
_SEPARATORS = re.compile(r"[\s,;]+")
_NUMBER = r"[0-9]+(?:\.[0-9]+)?"  # ASCII digits only: \d would take any script's digits
_RATE = re.compile(rf"\A({_NUMBER})/([a-z]+)(?:\+({_NUMBER}))?\Z")


@dataclass(frozen=True)
class RateRule:
    """One rule: ``per_second`` tokens flow into a bucket of ``burst``.

    ``key`` names the rule in its buckets' Redis keys (``keys.rate_bucket``):
    ``[anonymous:]<scope>:<prefix>``, what the rule limits, not how much, so a
    changed rate or burst keeps the buckets already filled or drained."""

    scope: str
    prefix: str
    per_second: float
    burst: float
    anonymous: bool
    key: str


def parse_rules(spec: str) -> tuple[RateRule, ...]:
    """The rules of a ``--rate-limits`` value (empty: none). ValueError names the
    first bad rule and what is wrong with it."""
    rules: list[RateRule] = []
    seen: dict[str, str] = {}
    for text in _SEPARATORS.split(spec.strip()):
        if not text:
            continue
        rule = parse_rule(text)
        if rule.key in seen:
            raise ValueError(f"rate limit {text!r}: {seen[rule.key]!r} already limits the same streams")
        seen[rule.key] = text
        rules.append(rule)
    return tuple(rules)


def parse_rule(text: str) -> RateRule:
    """One rule, as in ``parse_rules``."""

    def bad(why: str) -> ValueError:
        return ValueError(f"rate limit {text!r}: {why} (expected {GRAMMAR})")

    rest, anonymous = text, text.startswith(ANONYMOUS)
    if anonymous:
        rest = rest[len(ANONYMOUS) :]
    scope, colon, rest = rest.partition(":")
    if not colon or scope not in SCOPES:
        raise bad("the scope must be read, write or admin")
    raw_prefix, equals, rate = rest.rpartition("=")  # a prefix may hold '=', a rate never does
    if not equals:
        raise bad("'=' and a rate are missing")
    m = _RATE.match(rate)
    if not m:
        raise bad(f"{rate!r} is not <count>/<unit>[+<burst>]")
    count_text, unit, burst_text = m.groups()
    if unit not in UNIT_SECONDS:
        raise bad(f"unknown unit {unit!r} (s, m or h)")
    count = float(count_text)
    if not 0 < count <= MAX_COUNT:
        raise bad("the count must be above 0 (to refuse requests, grant no access)")
    burst = max(count, 1.0) if burst_text is None else float(burst_text)
    if not 1 <= burst <= MAX_COUNT or not math.isfinite(burst):
        raise bad("the burst must be at least 1 (the bucket must hold one request)")
    prefix = normalize_prefix(raw_prefix)
    try:
        prefix.encode()
    except UnicodeEncodeError:
        raise bad("the prefix is not valid UTF-8") from None
    key = f"{ANONYMOUS if anonymous else ''}{scope}:{prefix}"
    return RateRule(scope, prefix, count / UNIT_SECONDS[unit], burst, anonymous, key)


def match(rules: Iterable[RateRule], scope: str, path: str, anonymous: bool) -> RateRule | None:
    """The rule a request on stream ``path`` (no leading slash) needing ``scope`` falls
    under, or None (not limited): the longest matching prefix among the rules of its
    scope; for an anonymous request, among the ``anonymous:`` rules first, then, if
    none matches, among the others. Others never fall under ``anonymous:`` rules."""
    best: RateRule | None = None
    fallback: RateRule | None = None
    for rule in rules:
        if rule.scope != scope or not path.startswith(rule.prefix):
            continue
        if rule.anonymous and anonymous:
            if best is None or len(rule.prefix) > len(best.prefix):
                best = rule
        elif not rule.anonymous:
            if fallback is None or len(rule.prefix) > len(fallback.prefix):
                fallback = rule
    return best if best is not None else fallback
