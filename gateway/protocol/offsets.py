"""Offsets: opaque to clients, server-minted, fixed width, sorting as strings.

An offset names a byte position in the stream (for JSON streams: in the
concatenation of its stored messages). The token is two 16-digit decimal
fields, ``<generation>_<position>``; the generation is always 0 today and is
kept so the format matches the reference server's (clients and the official
conformance suite use ``0000000000000000_0000000000000000`` as "the start").
The Redis Stream entry holding position P has the id ``P-1``, so XRANGE,
XREVRANGE and XTRIM MINID work on offsets directly.
"""

from __future__ import annotations

import re

from .errors import bad_request

START = "-1"  # sentinel: the beginning of the stream
BEGINNING = -1  # what START parses to: the oldest data still retained (usually position 0)
NOW = "now"  # sentinel: the current tail
_WIDTH = 16
_MAX_POSITION = 10**_WIDTH - 1
_TOKEN = re.compile(r"\A([0-9]{16})_([0-9]{16})\Z")  # ASCII digits: \d takes any script's
_GENERATION_0 = "0" * _WIDTH + "_"
_POSITION = f"0{_WIDTH}d"


def encode(position: int) -> str:
    """The offset token for a byte position."""
    if not 0 <= position <= _MAX_POSITION:
        raise ValueError(f"position out of range: {position}")
    return _GENERATION_0 + format(position, _POSITION)  # every response has one: kept cheap


def entry_id(position: int) -> str:
    """The Redis Stream id of the log entry that starts at ``position``."""
    return f"{position}-1"


def decode(token: str) -> int:
    """The byte position an offset token names; 400 for anything malformed."""
    match = _TOKEN.match(token)
    if match is None or int(match.group(1)) != 0:
        raise bad_request(f"malformed offset: {token[:80]!r}")
    return int(match.group(2))


def parse_read_offset(values: list[str]) -> int | None:
    """The ``offset`` query parameter: a position, BEGINNING, or None for ``now``.

    Absent and ``-1`` both mean the beginning. A repeated parameter is
    ambiguous and rejected.
    """
    if len(values) > 1:
        raise bad_request("offset given more than once")
    if not values or values[0] == START:
        return BEGINNING
    if values[0] == NOW:
        return None
    return decode(values[0])
