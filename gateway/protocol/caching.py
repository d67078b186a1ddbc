"""ETags and Cache-Control for reads (protocol section 10)."""

from __future__ import annotations

import hashlib

# Catch-up and long-poll data never changes at a given offset range.
CACHEABLE = "public, max-age=60, stale-while-revalidate=300"
# Anything that names the moving tail (HEAD, offset=now) or is live.
NO_STORE = "no-store"
SSE = "no-cache, no-store"


def etag(stream_id: str, created: str, start: int, end: int, closed: bool) -> str:
    """A strong ETag for the bytes [start, end) of one incarnation of a stream.

    The creation time tells a re-created stream at the same path apart, and
    the closure flag makes the tail response change when the stream closes.
    """
    tag = hashlib.blake2b(f"{stream_id}\0{created}".encode(), digest_size=8).hexdigest()
    return f'"{tag}:{start}:{end}{":c" if closed else ""}"'


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
