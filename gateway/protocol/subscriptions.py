"""Subscription rules: paths, glob patterns, configuration, ack bodies, tokens, retry delays.

Everything here is pure (no Redis, no HTTP): features/subscriptions.py keeps the state in
Redis and the HTTP layer calls these to validate what clients send (PROTOCOL sections 6 and 7). Every refusal
is a ``coded`` ProtocolError, so the subscription APIs answer with their JSON error body.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from secrets import token_hex
from typing import Any, Literal, TypeGuard, cast

import jwt
import orjson
from jwt.types import Options

from . import offsets
from .errors import ProtocolError, coded
from .namespace import RESERVED

DEFAULT_LEASE_TTL_MS = 30_000
MIN_LEASE_TTL_MS = 1_000  # the spec: "from 1 second to 10 minutes"
MAX_LEASE_TTL_MS = 600_000
BEFORE_FIRST = "-1"  # acked_offset of a stream linked before it held any data
ZERO_OFFSET = offsets.ZERO  # an empty stream's tail (lua/_subs.lua has it as ZERO)
MAX_RETRY_DELAY_MS = 60_000
BASE_RETRY_DELAY_MS = 1_000

MAX_PATH_BYTES = 1024
MAX_ID_CHARS = 200
MAX_PATTERN_SEGMENTS = 32
MAX_DESCRIPTION_CHARS = 1024
MAX_WORKER_CHARS = 200

SubscriptionType = Literal["webhook", "pull-wake"]
_TYPES: tuple[SubscriptionType, ...] = ("webhook", "pull-wake")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # C0, DEL and C1: never in a path, id or name
_OFFSET = re.compile(r"\A[0-9]{16}_[0-9]{16}\Z")  # ASCII digits only (\d takes any script's)


def _invalid(message: str) -> Exception:
    return coded(400, "INVALID_REQUEST", message)


def _show(value: str) -> str:
    """A client value quoted for an error message, cut short so messages stay small."""
    return repr(value[:80])


# --- paths, ids and patterns ----------------------------------------------------------------


def normalize_path(path: str) -> str:
    """A stream-root-relative path as stored: leading and trailing '/' removed, nothing else.

    Paths are compared as strings (links, acks, glob matching), so anything that a URL layer
    might rewrite ('.', '..', empty segments) or that could not appear in a stream URL is
    refused rather than silently cleaned up into a different stream's name.
    """
    if not isinstance(path, str):
        raise _invalid("a stream path must be a string")
    stripped = path.strip("/")
    if not stripped:
        raise _invalid("a stream path must not be empty")
    if len(stripped.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise _invalid(f"a stream path must be at most {MAX_PATH_BYTES} bytes")
    if _CONTROL.search(stripped):
        raise _invalid(f"a stream path must not contain control characters: {_show(stripped)}")
    segments = stripped.split("/")
    if segments[0] == RESERVED:
        raise _invalid(f"stream paths under {RESERVED}/ are reserved: {_show(stripped)}")
    for segment in segments:
        if segment in ("", ".", ".."):
            raise _invalid(f"a stream path must not contain empty, '.' or '..' segments: {_show(stripped)}")
    return stripped


def validate_id(sub_id: str) -> str:
    """A subscription id: 1..200 characters, one URL segment, no control characters."""
    if not isinstance(sub_id, str) or not 1 <= len(sub_id) <= MAX_ID_CHARS:
        raise _invalid(f"a subscription id must be 1 to {MAX_ID_CHARS} characters")
    if "/" in sub_id or sub_id in (".", "..") or _CONTROL.search(sub_id):
        raise _invalid(f"invalid subscription id: {_show(sub_id)}")
    return sub_id


def validate_pattern(pattern: str) -> str:
    """A glob pattern, normalized like a path; its segments are ``*``, ``**`` or literals.

    ``*`` matches one whole segment, so a segment mixing it with other characters (``ev*``)
    would promise a partial match the protocol does not define: refused, not taken literally.
    """
    if not isinstance(pattern, str):
        raise _invalid("pattern must be a string")
    normalized = normalize_path(pattern)
    segments = normalized.split("/")
    if len(segments) > MAX_PATTERN_SEGMENTS:
        raise _invalid(f"a pattern must have at most {MAX_PATTERN_SEGMENTS} segments")
    for segment in segments:
        if "*" in segment and segment not in ("*", "**"):
            raise _invalid(
                f"pattern segment {_show(segment)}: '*' and '**' must be a whole segment "
                "('*' matches one segment, '**' zero or more)"
            )
    return normalized


def _segments(path: str) -> list[str]:
    return [s for s in path.strip("/").split("/") if s]


def glob_match(pattern: str, path: str) -> bool:
    """Whether ``path`` matches ``pattern``: ``*`` is one segment, ``**`` zero or more.

    Runs the pattern as an NFA over the path's segments (the set of pattern positions
    reachable so far), so the cost is O(pattern segments x path segments) whatever the
    number of ``**``: the backtracking form is exponential on ``**/**/**/.../x``.
    """
    parts = _segments(pattern)
    n = len(parts)

    def closure(states: set[int]) -> set[int]:
        # ``**`` may match nothing: a position on it also reaches the next one.
        todo = list(states)
        while todo:
            i = todo.pop()
            if i < n and parts[i] == "**" and i + 1 not in states:
                states.add(i + 1)
                todo.append(i + 1)
        return states

    states = closure({0})
    for segment in _segments(path):
        following: set[int] = set()
        for i in states:
            if i == n:
                continue
            part = parts[i]
            if part == "**":
                following.add(i)
            elif part == "*" or part == segment:
                following.add(i + 1)
        if not following:
            return False
        states = closure(following)
    return n in states


def literal_prefix(pattern: str) -> str:
    """The segments before the first wildcard, each followed by '/'.

    ``events/*`` -> ``events/``, ``**`` -> ``""``, ``a/b/c`` -> ``a/b/c/``. Every path the
    pattern matches, with a '/' appended, starts with this prefix, and the prefix is one of
    that path's segment prefixes (``""``, ``a/``, ``a/b/``, ...): PatternIndex buckets on it.
    """
    prefix = []
    for segment in _segments(pattern):
        if segment in ("*", "**"):
            break
        prefix.append(segment + "/")
    return "".join(prefix)


class PatternIndex:
    """Which subscriptions' patterns match a stream path, without trying every pattern.

    Patterns are bucketed by their literal prefix; a path looks up only the buckets of its
    own segment prefixes (one per segment, plus ``""``), then glob-matches those candidates.
    An append to ``tenant-a/orders/1`` never looks at the patterns under ``tenant-b/``.
    """

    def __init__(self) -> None:
        self._buckets: dict[str, dict[str, str]] = {}  # literal prefix -> {sub id: pattern}
        self._prefix_of: dict[str, str] = {}  # sub id -> its pattern's bucket

    def add(self, sub_id: str, pattern: str) -> None:
        """Index (or re-index, replacing the old pattern) a subscription's pattern."""
        self.remove(sub_id)
        prefix = literal_prefix(pattern)
        self._buckets.setdefault(prefix, {})[sub_id] = pattern
        self._prefix_of[sub_id] = prefix

    def remove(self, sub_id: str) -> None:
        """Forget a subscription's pattern; absent ids are ignored."""
        prefix = self._prefix_of.pop(sub_id, None)
        if prefix is None:
            return
        bucket = self._buckets[prefix]
        del bucket[sub_id]
        if not bucket:
            del self._buckets[prefix]

    def match(self, path: str) -> list[str]:
        """The sorted ids of the subscriptions whose pattern matches ``path``."""
        found: list[str] = []
        prefix = ""
        for segment in [*_segments(path), None]:
            bucket = self._buckets.get(prefix)
            if bucket:
                found.extend(sub_id for sub_id, pattern in bucket.items() if glob_match(pattern, path))
            if segment is not None:
                prefix += segment + "/"
        return sorted(found)

    def __len__(self) -> int:
        return len(self._prefix_of)


# --- subscription configuration (section 6.2) -----------------------------------------------


@dataclass(frozen=True)
class SubscriptionConfig:
    """A subscription's configuration as the client set it, normalized."""

    type: SubscriptionType
    pattern: str | None
    streams: tuple[str, ...]  # normalized, deduplicated, sorted
    webhook_url: str | None
    wake_stream: str | None
    lease_ttl_ms: int
    description: str | None

    def _canonical(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "pattern": self.pattern,
            "streams": list(self.streams),
            "webhook": None if self.webhook_url is None else {"url": self.webhook_url},
            "wake_stream": self.wake_stream,
            "lease_ttl_ms": self.lease_ttl_ms,
            "description": self.description,
        }

    def config_hash(self) -> str:
        """The SHA-256 (hex) of the canonical configuration: what a re-confirming PUT must equal.

        Keys sorted, no whitespace, absent fields as null, so the hash depends only on the
        normalized values (spec 6.2), not on how the client spelled or ordered its JSON.
        """
        return hashlib.sha256(orjson.dumps(self._canonical(), option=orjson.OPT_SORT_KEYS)).hexdigest()

    def to_json(self) -> bytes:
        """The stored form (read back with from_json)."""
        return orjson.dumps(self._canonical())

    @classmethod
    def from_json(cls, data: bytes) -> SubscriptionConfig:
        """A configuration stored by to_json (trusted: it was validated when it was written)."""
        raw = orjson.loads(data)
        webhook = raw.get("webhook")
        return cls(
            type=raw["type"],
            pattern=raw.get("pattern"),
            streams=tuple(raw.get("streams") or ()),
            webhook_url=None if webhook is None else webhook["url"],
            wake_stream=raw.get("wake_stream"),
            lease_ttl_ms=int(raw.get("lease_ttl_ms", DEFAULT_LEASE_TTL_MS)),
            description=raw.get("description"),
        )

    def public(self) -> dict[str, Any]:
        """The configuration fields of the GET response (the caller adds id, streams, status...)."""
        return {
            "type": self.type,
            "pattern": self.pattern,
            "webhook": None if self.webhook_url is None else {"url": self.webhook_url},
            "wake_stream": self.wake_stream,
            "lease_ttl_ms": self.lease_ttl_ms,
            "description": self.description,
        }


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise _invalid("the request body must be JSON") from None
    if not isinstance(value, dict):
        raise _invalid("the request body must be a JSON object")
    return value


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_streams(value: object, max_streams: int = 1000, field: str = "streams") -> tuple[str, ...]:
    """A list of stream paths: normalized, deduplicated and sorted (also the POST .../streams body)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _invalid(f"{field} must be a list of stream paths")
    if len(value) > max_streams:
        raise _invalid(f"{field} must list at most {max_streams} streams")
    paths = set()
    for item in value:
        if not isinstance(item, str):
            raise _invalid(f"{field} must be a list of stream paths (strings)")
        paths.add(normalize_path(item))
    return tuple(sorted(paths))


def parse_membership(body: bytes, max_streams: int = 1000) -> tuple[str, ...]:
    """The body of POST .../streams (spec 6.4): ``{"streams": [path, ...]}``."""
    return parse_streams(_json_object(body).get("streams"), max_streams)


def parse_config(body: bytes, max_streams: int = 1000) -> SubscriptionConfig:
    """The body of ``PUT .../__ds/subscriptions/:id``, validated and normalized.

    Unknown top-level fields are ignored (forward compatibility). The webhook URL is only
    checked for being a string here: its SSRF policy (ssrf.check_url) needs the server's
    settings, so the caller applies it.
    """
    raw = _json_object(body)

    kind = raw.get("type")
    if kind not in _TYPES:
        raise _invalid("type is required and must be 'webhook' or 'pull-wake'")
    kind = cast(SubscriptionType, kind)

    pattern = raw.get("pattern")
    if pattern is not None:
        pattern = validate_pattern(pattern)
    streams = parse_streams(raw.get("streams"), max_streams)
    if pattern is None and not streams:
        raise _invalid("at least one of pattern or a non-empty streams list is required")

    webhook = raw.get("webhook")
    wake_stream = raw.get("wake_stream")
    webhook_url: str | None = None
    if kind == "webhook":
        if not isinstance(webhook, dict) or not isinstance(webhook.get("url"), str) or not webhook["url"]:
            raise _invalid("webhook subscriptions require webhook.url (a string)")
        if wake_stream is not None:
            raise _invalid("wake_stream is only for pull-wake subscriptions")
        webhook_url = webhook["url"]
    else:
        if webhook is not None:
            raise _invalid("webhook is only for webhook subscriptions")
        if not isinstance(wake_stream, str):
            raise _invalid("pull-wake subscriptions require wake_stream (a stream path)")
        wake_stream = normalize_path(wake_stream)

    lease_ttl_ms = raw.get("lease_ttl_ms")
    if lease_ttl_ms is None:
        lease_ttl_ms = DEFAULT_LEASE_TTL_MS
    elif not _is_int(lease_ttl_ms) or not MIN_LEASE_TTL_MS <= lease_ttl_ms <= MAX_LEASE_TTL_MS:
        raise _invalid(f"lease_ttl_ms must be an integer from {MIN_LEASE_TTL_MS} to {MAX_LEASE_TTL_MS}")

    description = raw.get("description")
    if description is not None and (
        not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS
    ):
        raise _invalid(f"description must be a string of at most {MAX_DESCRIPTION_CHARS} characters")

    return SubscriptionConfig(
        type=kind,
        pattern=pattern,
        streams=streams,
        webhook_url=webhook_url,
        wake_stream=wake_stream,
        lease_ttl_ms=lease_ttl_ms,
        description=description,
    )


# --- callback, ack, release and claim bodies (section 7) ------------------------------------


@dataclass(frozen=True)
class AckRequest:
    """A callback, ack or release body: which wake it is for, and the cursors it moves."""

    wake_id: str
    generation: int
    acks: tuple[tuple[str, str], ...]  # (normalized stream path, offset), in request order
    done: bool


def _parse_offset(value: object) -> str:
    if value == BEFORE_FIRST:
        # An ack names the last processed offset: "before the first" is never one (upstream too).
        raise coded(409, "INVALID_OFFSET", "an ack offset must not be -1")
    if not isinstance(value, str) or not _OFFSET.match(value):
        shown = _show(value) if isinstance(value, str) else type(value).__name__
        raise _invalid(f"an ack offset must be an offset token: {shown}")
    try:
        position = offsets.decode(value)
    except ProtocolError:
        raise _invalid(f"an ack offset must be an offset token: {_show(value)}") from None
    # As minted now (offsets.py): the scripts compare offsets as strings.
    return offsets.encode(min(position, offsets.MAX_POSITION))


def parse_ack(body: bytes, require_acks: bool = False, max_acks: int = 1000) -> AckRequest:
    """The body of a callback, ack or release (release ignores the acks).

    Only the shape is checked here; whether each stream is linked and each offset lies
    between its cursor and its tail needs the stored state, so the caller checks that.
    """
    raw = _json_object(body)
    wake_id = raw.get("wake_id")
    if not isinstance(wake_id, str) or not wake_id:
        raise _invalid("wake_id is required (a string)")
    generation = raw.get("generation")
    if not _is_int(generation) or generation < 0:
        raise _invalid("generation is required (a non-negative integer)")

    value = raw.get("acks")
    if value is None:
        if require_acks:
            raise _invalid("acks is required (a list of {stream, offset})")
        value = []
    if not isinstance(value, list):
        raise _invalid("acks must be a list of {stream, offset}")
    if len(value) > max_acks:
        raise _invalid(f"acks must hold at most {max_acks} entries")
    acks = []
    for item in value:
        if not isinstance(item, dict):
            raise _invalid("each ack must be an object {stream, offset}")
        stream = item.get("stream", item.get("path"))
        if not isinstance(stream, str):
            raise _invalid("each ack needs a stream (a stream path)")
        acks.append((normalize_path(stream), _parse_offset(item.get("offset"))))

    done = raw.get("done", False)
    if done is None:
        done = False
    if not isinstance(done, bool):
        raise _invalid("done must be a boolean")
    return AckRequest(wake_id=wake_id, generation=generation, acks=tuple(acks), done=done)


def parse_claim(body: bytes) -> str:
    """The worker name of a claim body ``{"worker": "..."}``."""
    worker = _json_object(body).get("worker")
    if not isinstance(worker, str) or not 1 <= len(worker) <= MAX_WORKER_CHARS:
        raise _invalid(f"worker is required (a string of 1 to {MAX_WORKER_CHARS} characters)")
    if _CONTROL.search(worker):
        raise _invalid("worker must not contain control characters")
    return worker


def new_wake_id() -> str:
    """A wake id: unguessable, so a request cannot be replayed into another wake."""
    return "w_" + token_hex(12)


# --- callback and claim tokens (section 12.9) -----------------------------------------------

_ALGORITHM = "HS256"
_REQUIRED_CLAIMS = ["sub", "gen", "wake", "kind", "exp", "iat"]


@dataclass(frozen=True)
class TokenClaims:
    """What a valid token vouches for; the caller compares them with the current wake."""

    generation: int
    wake_id: str


def _subject(sub_id: str) -> str:
    return f"subscription:{sub_id}"


def issue_token(
    secret: bytes, sub_id: str, generation: int, wake_id: str, kind: str, ttl_ms: int, now_ms: int
) -> str:
    """An HS256 JWT for one wake of one subscription; ``kind`` ("callback", "claim") keeps a
    token for one endpoint family from being used at another.

    ``exp`` is rounded up to the second, so a token lives at least ``ttl_ms``.
    """
    claims = {
        "sub": _subject(sub_id),
        "gen": generation,
        "wake": wake_id,
        "kind": kind,
        "iat": now_ms // 1000,
        "exp": -(-(now_ms + ttl_ms) // 1000),
    }
    return jwt.encode(claims, secret, algorithm=_ALGORITHM)


def check_token(secrets: Sequence[bytes], token: str, sub_id: str, kind: str, now_ms: int) -> TokenClaims:
    """The claims of a token signed with any of ``secrets`` (the first signs; the others are
    kept during a rotation) for this subscription and kind: 401 TOKEN_INVALID or TOKEN_EXPIRED.

    Expiry is checked against ``now_ms`` here (no leeway), not against the clock by PyJWT,
    so the caller's clock is the only one.
    """
    if not secrets:
        raise ValueError("check_token needs at least one secret")
    options: Options = {
        "verify_exp": False,
        "verify_iat": False,
        "verify_nbf": False,
        "verify_aud": False,
        "require": _REQUIRED_CLAIMS,
    }
    claims: dict[str, Any] | None = None
    for secret in secrets:
        try:
            claims = jwt.decode(token, secret, algorithms=[_ALGORITHM], options=options)
            break
        except jwt.InvalidSignatureError:
            continue
        except (jwt.InvalidTokenError, ValueError, TypeError):
            break
    if claims is None:
        raise coded(401, "TOKEN_INVALID", "token invalid")
    generation, wake_id, exp = claims.get("gen"), claims.get("wake"), claims.get("exp")
    if (
        claims.get("sub") != _subject(sub_id)
        or claims.get("kind") != kind
        or not _is_int(generation)
        or not isinstance(wake_id, str)
        or not _is_int(exp)
    ):
        raise coded(401, "TOKEN_INVALID", "token invalid")
    if now_ms >= exp * 1000:
        raise coded(401, "TOKEN_EXPIRED", "token expired")
    return TokenClaims(generation=generation, wake_id=wake_id)


# --- webhook retries (section 7.1) ----------------------------------------------------------


def retry_delay_ms(attempt: int, rand: Callable[[], float] = random.random) -> int:
    """The delay before webhook attempt ``attempt + 1``: 1 s doubling to 60 s, with ±20%
    jitter so subscriptions failing together do not retry in lockstep (upstream's formula).
    """
    exponent = min(max(attempt, 1) - 1, 16)  # 2**16 s is far past the cap: no huge integers
    base = min(BASE_RETRY_DELAY_MS << exponent, MAX_RETRY_DELAY_MS)
    return max(0, round(base * (1 + 0.2 * (2 * rand() - 1))))
