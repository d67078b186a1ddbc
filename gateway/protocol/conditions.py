"""Conditional writes: If-Match (POST and PUT) and Stream-Expected-Offset (POST).

An append's conditions are checked by append.lua, at the append's turn in its
batch; this module parses the headers (400 for a malformed one, before anything
is sent) and encodes what the script compares (``IfMatch.script_arg``).
``IfMatch.matches`` is the same rule in Python, for PUT. The order of the
checks and the statuses are in the README ("Conditional appends").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from . import caching, offsets
from .errors import ProtocolError, bad_request
from .headers import IF_MATCH, STREAM_EXPECTED_OFFSET

# One element of an If-Match list (RFC 9110 5.6.1, 8.8.3): an entity-tag, weak or
# strong (etagc: visible characters but DQUOTE, and obs-text), or a bare offset as
# upstream's OCC proposal sends it; then a comma or the end. Empty elements are allowed.
_ELEMENT = re.compile(r'[ \t]*(?:(W/)?"([^"\x00-\x20\x7f]*)"|([^ \t,"]+))?[ \t]*(?:,|\Z)')
_SYNTAX = "If-Match must be *, or entity-tags (quoted, as ETag gives them) or offsets (Stream-Next-Offset)"


@dataclass(frozen=True)
class Expected:
    """A stream state one If-Match element names: a tail, and for our ETags the
    incarnation and closure too (None: any; an offset names the tail alone)."""

    tail: int
    created: str | None = None
    closed: bool | None = None


@dataclass(frozen=True)
class IfMatch:
    """A parsed If-Match: ``*``, or the states its tags name. A tag that names no
    state of this stream (weak, another stream's, not ours) is dropped: it can
    never match, so a header of only such tags matches nothing (412)."""

    states: tuple[Expected, ...] = ()
    any: bool = False

    def matches(self, created: str, tail: int, closed: bool) -> bool:
        """Whether the stream, in this state, meets the condition (strong comparison)."""
        return self.any or any(
            s.tail == tail and s.created in (None, created) and s.closed in (None, closed)
            for s in self.states
        )

    def script_arg(self) -> str:
        """For append.lua: '*', or '<created>:<tail>:<closed 0|1>' items joined by spaces
        (an empty created or closed matches any), or '!' (matches nothing)."""
        if self.any:
            return "*"
        items = [
            f"{s.created or ''}:{s.tail}:{'' if s.closed is None else int(s.closed)}" for s in self.states
        ]
        return " ".join(items) or "!"


def _position(token: str) -> int | None:
    """The position an offset token names, or None if it is not one we mint."""
    try:
        return offsets.decode(token)
    except ProtocolError:
        return None


def parse_if_match(values: list[str] | None, stream_id: str) -> IfMatch | None:
    """The If-Match header lines of a request to ``stream_id`` (None: no header)."""
    if values is None:
        return None
    value = ",".join(values)
    if value.strip() == "*":
        return IfMatch(any=True)
    states: list[Expected] = []
    elements, pos = 0, 0
    while pos < len(value):
        match = _ELEMENT.match(value, pos)
        if match is None:
            raise bad_request(_SYNTAX)
        pos = match.end()
        weak, opaque, bare = match.groups()
        if opaque is not None:
            elements += 1
            if weak:
                continue  # If-Match compares strongly: a weak tag never matches
            named = caching.named_state(opaque, stream_id)
            if named is not None:
                states.append(Expected(named.end, named.created, named.closed))
            elif (position := _position(opaque)) is not None:
                states.append(Expected(position))
        elif bare is not None:
            elements += 1
            position = _position(bare)
            if position is None:
                raise bad_request("If-Match: * stands alone" if bare == "*" else f"{_SYNTAX}: {bare[:80]!r}")
            states.append(Expected(position))
    if not elements:
        raise bad_request(f"{IF_MATCH} names no entity-tag")
    return IfMatch(states=tuple(states))


def parse_expected_offset(value: str | None) -> int | None:
    """Stream-Expected-Offset: the position the stream's tail must be at (None: no header)."""
    if value is None:
        return None
    position = _position(value.strip())
    if position is None:
        raise bad_request(f"{STREAM_EXPECTED_OFFSET} must be an offset as Stream-Next-Offset gives it")
    return position


def precondition_failed(state: dict[str, str]) -> ProtocolError:
    """412 for a false If-Match. ``state``: the stream's current Stream-Next-Offset and
    ETag (``responses.current_state``), so the client can retry without a HEAD."""
    return ProtocolError(412, "precondition failed: If-Match does not name the stream's current state", state)


def offset_conflict(state: dict[str, str]) -> ProtocolError:
    """409 for a Stream-Expected-Offset that is not the tail (``state`` as above)."""
    return ProtocolError(409, "expected offset conflict: the stream's tail is at Stream-Next-Offset", state)
