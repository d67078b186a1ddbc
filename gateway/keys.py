"""Redis key names, in one place.

A stream's keys share one hash tag, ``{<stream id>}``, so every script touches
one cluster slot (but a batched append, which may span streams: append.lua).
The stream id is its path with ``%``, ``{`` and ``}`` percent-encoded:
readable in ``redis-cli``, reversible, and unable to close the hash tag early.
"""

from __future__ import annotations

PREFIX = "ds"


def stream_id(path: str) -> str:
    return path.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def path_of(stream_id: str) -> str:
    return stream_id.replace("%7D", "}").replace("%7B", "{").replace("%25", "%")


def stream_keys(sid: str) -> list[str]:
    """meta, log, producers, forks, notify channel: the KEYS every script gets."""
    tag = f"{PREFIX}:{{{sid}}}"
    return [f"{tag}:meta", f"{tag}:log", f"{tag}:prod", f"{tag}:forks", f"{tag}:notify"]


def lease(sid: str) -> str:
    """Held by the archive worker working on the stream (a redis-py Lock)."""
    return f"{PREFIX}:{{{sid}}}:lease"


def segments(sid: str, incarnation: str) -> str:
    """An incarnation's archived segments (sorted set; see gateway/segments.py).

    Named by incarnation and never expiring, so the files of a deleted or
    expired stream stay findable until the worker removes them, and a new
    stream at the same path starts with none.
    """
    return f"{PREFIX}:{{{sid}}}:segs:{incarnation}"


SEGMENTS_PATTERN = f"{PREFIX}:*:segs:*"
META_PATTERN = f"{PREFIX}:*:meta"
# Streams with data to archive: score = when to look (ms). Gateways add
# streams they appended to (NX, about once a second); workers take them.
ARCHIVE_HINTS = f"{PREFIX}:archive:hints"
ARCHIVE_RECONCILE = f"{PREFIX}:archive:reconcile"  # who scans for lost hints and dead archives, when


def split_segments_key(key: str) -> tuple[str, str]:
    """(stream id, incarnation) of a segments key."""
    return key_stream_id(key), key[key.rindex("}") + len(":segs:") + 1 :]


def key_stream_id(key: str) -> str:
    """The stream id inside any of a stream's key or channel names."""
    return key[len(PREFIX) + 2 : key.rindex("}")]


def notify_channel(sid: str) -> str:
    return stream_keys(sid)[4]


def channel_stream_id(channel: str) -> str:
    """The stream id a notify channel belongs to."""
    return key_stream_id(channel)
