"""Content codings for catch-up reads: which answers are compressed, and with what.

Plain rules, no I/O: ``compressible`` says which streams' bodies are worth compressing,
``negotiate`` picks a coding from a request's ``Accept-Encoding`` (RFC 9110 12.5.3).

What is compressed is decided by the stream's content type, never by looking at the
bytes: JSON and textual types (``text/*``, ``+json``, ``+xml``, a few well-known
textual ``application/`` types) are; everything else (``application/octet-stream``,
images, video, archives, ``application/gzip`` and other already compressed types) is
sent as stored: an opaque byte stream may already be compressed, and compressing it
again costs CPU for nothing.
"""

from __future__ import annotations

_TEXTUAL = frozenset(
    {
        "application/json",
        "application/x-ndjson",
        "application/ndjson",
        "application/jsonl",
        "application/json-seq",
        "application/xml",
        "application/javascript",
        "application/ecmascript",
        "application/yaml",
        "application/x-yaml",
        "application/toml",
        "application/csv",
        "application/graphql",
        "application/sql",
        "image/svg+xml",
    }
)


def compressible(media_type: str) -> bool:
    """Whether a stream of this (normalized) media type is textual enough to compress."""
    if media_type.startswith("text/") or media_type in _TEXTUAL:
        return True
    return media_type.endswith(("+json", "+xml", "+yaml"))


def _weights(accept_encoding: str) -> dict[str, float]:
    """Accept-Encoding as {coding: q}; a malformed q counts as 0 (not acceptable)."""
    weights: dict[str, float] = {}
    for item in accept_encoding.split(","):
        name, _, params = item.partition(";")
        name = name.strip().lower()
        if not name:
            continue
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = 0.0
                if not 0.0 <= q <= 1.0:
                    q = 0.0
        weights[name] = max(weights.get(name, 0.0), q)
    return weights


def negotiate(accept_encoding: str | None, offered: tuple[str, ...]) -> str:
    """The coding to answer with: among ``offered`` (the server's order of preference),
    the one the client weighs highest, ties to the server's order; '' for none (identity).
    No header, or one naming none of them (nor ``*``), means identity."""
    if not accept_encoding or not offered:
        return ""
    weights = _weights(accept_encoding)
    star = weights.get("*", 0.0)
    best, best_q = "", 0.0
    for name in offered:
        q = weights.get(name, star)
        if q > best_q:
            best, best_q = name, q
    return best
