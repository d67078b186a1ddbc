"""Offsets: opaque to clients, server-minted, fixed width, sorting as strings.

An offset names a byte position in the stream (for JSON streams: in the
concatenation of its stored messages). The token is two 16-digit decimal
fields, ``<format>_<value>``, as the reference server's are (clients and the
official conformance suite use ``0000000000000000_0000000000000000`` as "the start").

Format 1, minted since key layout 3: the value is *twice* the position. Offsets are
opaque, but official packages derive some: y-durable-streams' compactor reads from
its snapshot's offset plus 1 in the last field (the reference's offsets count a
5-byte frame per message, so that lands inside the same message there). Here
``2p + 1`` names position ``p`` as ``2p`` does, so a derived offset reads exactly as
the one issued. Format 0 (the value is the position) was minted before; such offsets
are still read, so clients holding one resume where they were. Every format-1 token
sorts after every format-0 one, so offsets still grow as strings across the change.

The Redis Stream entry holding position P has the id ``P-1`` (positions, not tokens,
are what Redis and the archive keep), so XRANGE, XREVRANGE and XTRIM MINID work on
positions directly.
"""

from __future__ import annotations

import re

from .errors import bad_request

START = "-1"  # sentinel: the beginning of the stream
BEGINNING = -1  # what START parses to: the oldest data still retained (usually position 0)
NOW = "now"  # sentinel: the current tail
_WIDTH = 16
_MAX_VALUE = 10**_WIDTH - 1
MAX_POSITION = _MAX_VALUE // 2
_TOKEN = re.compile(r"\A([0-9]{16})_([0-9]{16})\Z")  # ASCII digits: \d takes any script's
_FORMAT_1 = "0" * (_WIDTH - 1) + "1_"
_VALUE = f"0{_WIDTH}d"


def encode(position: int) -> str:
    """The offset token for a byte position."""
    if not 0 <= position <= MAX_POSITION:
        raise ValueError(f"position out of range: {position}")
    return _FORMAT_1 + format(2 * position, _VALUE)  # every response has one: kept cheap


ZERO = encode(0)  # the offset of an empty stream's tail


def entry_id(position: int) -> str:
    """The Redis Stream id of the log entry that starts at ``position``."""
    return f"{position}-1"


def decode(token: str) -> int:
    """The byte position an offset token names; 400 for anything malformed."""
    match = _TOKEN.match(token)
    if match is None:
        raise bad_request(f"malformed offset: {token[:80]!r}")
    kind, value = int(match.group(1)), int(match.group(2))
    if kind == 1:
        return value // 2
    if kind == 0:
        return value
    raise bad_request(f"malformed offset: {token[:80]!r}")


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
