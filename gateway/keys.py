"""Redis key names, in one place.

A stream's keys share one hash tag, ``{<stream id>}``, so every script touches
one cluster slot. The stream id is its path with ``%``, ``{`` and ``}``
percent-encoded: readable in ``redis-cli``, reversible, and unable to close
the hash tag early.
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


def notify_channel(sid: str) -> str:
    return stream_keys(sid)[4]


def channel_stream_id(channel: str) -> str:
    """The stream id a notify channel belongs to."""
    return channel[len(PREFIX) + 2 : channel.rindex("}")]
