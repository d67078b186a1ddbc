"""Ursula's buckets (seed 002): names, and how ``/{bucket}/{stream}`` maps onto this
server's stream paths. Plain functions, no I/O.

One stream, two addresses: ``/{bucket}/{stream}`` is the stream ``{bucket}/{stream}``
of the protocol's routes (``/v1/stream/{bucket}/{stream}``), and the bucket ``_default``
holds the paths without a ``/`` (``/_default/x`` is ``/v1/stream/x``): Ursula's v1
mapping ("the first ``/`` separates; no ``/`` means ``_default``") read backwards, so
today's clients and data need no change.
"""

from __future__ import annotations

import re

from .errors import coded  # Ursula's code words (e.g. bucket_not_empty) in a JSON body
from .namespace import RESERVED

DEFAULT_BUCKET = "_default"
MAX_PATH_BYTES = 122  # a stream id, and bucket + "/" + stream id, at most (Ursula's limit)
LISTING = "streams"  # /{bucket}/streams lists the bucket: no stream may be named so
_BUCKET = re.compile(r"[a-z0-9_-]{4,64}")
# Names the server's own routes take (/healthz, /readyz, /metrics, /auth/sign), and the
# protocol's reserved namespace (no stream may be named under __ds/).
RESERVED_BUCKETS = frozenset({"healthz", "readyz", "metrics", "auth", RESERVED})


def validate_bucket(name: str, reserved: frozenset[str] = RESERVED_BUCKETS) -> str:
    """400 unless ``name`` matches ``[a-z0-9_-]{4,64}`` and is no name of the server's
    own routes (``reserved``)."""
    if not _BUCKET.fullmatch(name):
        raise coded(400, "invalid_bucket_id", "bucket ids match [a-z0-9_-]{4,64}")
    if name in reserved:
        raise coded(400, "invalid_bucket_id", f"{name!r} is the name of one of the server's routes")
    return name


def validate_stream_id(bucket: str, stream: str) -> str:
    """400 unless ``stream`` is a stream id Ursula accepts: no ``/``, NUL or ``..``, not
    ``streams``, and at most 122 bytes with the bucket."""
    size = len(stream.encode("utf-8", "surrogatepass"))
    if not stream or "/" in stream or "\x00" in stream or ".." in stream or stream == LISTING:
        raise coded(
            400,
            "invalid_stream_id",
            "stream ids are not empty, have no '/', NUL or '..' and are not 'streams'",
        )
    if stream == "." or size > MAX_PATH_BYTES or len(bucket) + 1 + size > MAX_PATH_BYTES:
        raise coded(400, "invalid_stream_id", f"bucket and stream id take at most {MAX_PATH_BYTES} bytes")
    return stream


def bucket_stream(bucket: str, stream: str) -> tuple[str, str]:
    """(bucket, path) a ``/{bucket}/{stream}`` request names, both validated (400)."""
    name = validate_bucket(bucket)
    return name, stream_path(name, validate_stream_id(name, stream))


def stream_path(bucket: str, stream: str) -> str:
    """The path ``/{bucket}/{stream}`` names (under the protocol's prefix)."""
    return stream if bucket == DEFAULT_BUCKET else f"{bucket}/{stream}"


def path_prefix(bucket: str) -> str:
    """Where the bucket's streams' paths start (``_default``'s: anywhere, without a ``/``)."""
    return "" if bucket == DEFAULT_BUCKET else f"{bucket}/"


def in_bucket(bucket: str, path: str) -> bool:
    return "/" not in path if bucket == DEFAULT_BUCKET else path.startswith(f"{bucket}/")


def stream_id_of(bucket: str, path: str) -> str:
    """The stream id within the bucket of a path ``in_bucket``."""
    return path[len(path_prefix(bucket)) :]
