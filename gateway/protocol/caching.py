"""ETags and Cache-Control for reads (protocol section 10)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

# Catch-up and long-poll data never changes at a given offset range.
CACHEABLE = "public, max-age=60, stale-while-revalidate=300"
# Anything that names the moving tail (HEAD, offset=now) or is live.
NO_STORE = "no-store"
SSE = "no-cache, no-store"

# Our ETags' opaque part: "<created>-<check>:<start>:<end>[:c][:g<generation>][+<coding>]"
# (see etag()).
_OURS = re.compile(
    r"\A([0-9]{1,20})-([0-9a-f]{8}):([0-9]{1,20}):([0-9]{1,20})(:c)?(?::g[0-9]{1,20})?(?:\+[a-z]{1,8})?\Z"
)


def _check(stream_id: str, created: str) -> str:
    return hashlib.blake2b(f"{stream_id}\0{created}".encode(), digest_size=4).hexdigest()


def etag(
    stream_id: str, created: str, start: int, end: int, closed: bool, coding: str = "", generation: int = 0
) -> str:
    """A strong ETag for the bytes [start, end) of one incarnation of a stream, as sent
    in ``coding`` ('' for as stored: a compressed answer is another representation, so
    another tag, RFC 9110 8.8.3; it names the same state for If-Match).

    The creation time tells a re-created stream at the same path apart; it is
    written out (not hashed) so a conditional append can hand it to append.lua,
    which compares it with the stream's own (``conditions.py``). The check ties
    the tag to its stream, and the closure flag makes the tail response change
    when the stream closes. A compacted stream's ``generation`` (raised by every
    compaction step that drops messages, docs/compaction.md) makes a range's tag change
    when what the range holds does; If-Match ignores it (appends go to the tail).
    """
    suffix = ("+" + coding) if coding else ""
    gen = f":g{generation}" if generation else ""
    return f'"{created}-{_check(stream_id, created)}:{start}:{end}{":c" if closed else ""}{gen}{suffix}"'


def stream_etag(stream_id: str, created: str, tail: int, closed: bool, generation: int = 0) -> str:
    """The stream's own ETag (HEAD, PUT, a failed conditional append): the one a read
    of all of it, from position 0 to the tail, carries."""
    return etag(stream_id, created, 0, tail, closed, generation=generation)


@dataclass(frozen=True)
class Named:
    """The stream state one of our ETags names: an incarnation, a read's end, closure."""

    created: str
    end: int
    closed: bool


def named_state(opaque: str, stream_id: str) -> Named | None:
    """What an ETag's opaque part (between the quotes) names, if it is one of ours
    for this stream; None for anything else (it can then match nothing here)."""
    match = _OURS.match(opaque)
    if match is None or match.group(2) != _check(stream_id, match.group(1)):
        return None
    return Named(created=match.group(1), end=int(match.group(4)), closed=match.group(5) is not None)


def incarnation(tag: str | None) -> str | None:
    """The creation time (ms) an ``ETag`` header of ours names (HEAD's, a read's): which
    incarnation of its path answered. None for any other tag. For clients (the Spark
    source) that must tell a stream created again at a path from the one they read."""
    if not tag or len(tag) < 2 or tag[0] != '"' or tag[-1] != '"':
        return None  # weak or unquoted: not one of ours
    match = _OURS.match(tag[1:-1])
    return str(int(match.group(1))) if match else None


def matches(if_none_match: str | None, current: str) -> bool:
    """Whether an If-None-Match header names the current ETag (weak or strong)."""
    if not if_none_match:
        return False
    for candidate in if_none_match.split(","):
        candidate = candidate.strip()
        if candidate == "*":
            return True
        if candidate.startswith("W/"):
            candidate = candidate[2:]
        if candidate == current:
            return True
    return False
