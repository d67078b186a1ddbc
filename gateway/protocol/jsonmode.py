"""JSON mode: a stream of JSON messages.

A POST body is one value, or an array whose elements are the messages (one
level is flattened), stored compactly encoded in bounded groups (entries.py).
Reads wrap the messages of a range in one array.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from typing import Any

import orjson

from . import offsets
from .entries import SEPARATOR, LogEntry, messages, pack_bytes, pack_messages
from .errors import ProtocolError, bad_request
from .headers import JSON_CONTENT_TYPE

MAX_DEPTH = 254  # the deepest nesting orjson's encoder takes; both parsers enforce it


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):  # 1e400: refused, never stored as null
        raise ValueError(f"{text} is too large for a JSON number")
    return value


def _depth(value: object) -> int:
    """How deeply arrays and objects nest (iteratively: no recursion limit to hit)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, list | dict):
            deepest = max(deepest, level)
            todo.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


# orjson turns integers past 64 bits into floats, silently losing digits;
# bodies with such long digit runs go through the standard library instead.
_LONG_DIGITS = re.compile(rb"\d{19}")
# The same question for a short text (a stored message, when a read gives a State event
# its offset): digits mapped to "0", anything else to "x", then one substring search,
# ~10x faster there than the regular expression (2 us for 130 bytes).
_DIGITS_AS_ZERO = bytes(48 if 48 <= c <= 57 else 120 for c in range(256))
_SHORT = 4096


def _long_digits(body: bytes) -> bool:
    if len(body) <= _SHORT:
        return b"0" * 19 in body.translate(_DIGITS_AS_ZERO)
    return _LONG_DIGITS.search(body) is not None


def _loads(body: bytes) -> object:
    """Parse a body, or 400. orjson refuses lone surrogates and numbers past a double by
    itself; the standard library is told to."""
    if not _long_digits(body):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            raise bad_request("body is not valid JSON") from None
    try:
        value = json.loads(body, parse_constant=_reject_constant, parse_float=_finite)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise bad_request("body is not valid JSON") from None
    if _depth(value) > MAX_DEPTH:
        raise bad_request(f"JSON nested deeper than {MAX_DEPTH} levels")
    return value


def _dumps(value: object) -> bytes:
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        if "Recursion" in str(exc):
            raise bad_request(f"JSON nested deeper than {MAX_DEPTH} levels") from None
        if "surrogates" in str(exc):
            raise bad_request("JSON text holds a lone surrogate (not valid Unicode)") from None
    # An integer orjson cannot hold (parsed exactly by the standard library).
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except (ValueError, UnicodeEncodeError):
        raise bad_request("JSON text holds a lone surrogate (not valid Unicode)") from None


def _encoded(items: Iterable[object]) -> Iterator[bytes]:
    dumps = orjson.dumps
    for item in items:
        try:
            yield dumps(item)
        except orjson.JSONEncodeError:
            yield _dumps(item)  # says why (400), or takes what orjson cannot (huge integers)


def split_messages(body: bytes, *, allow_empty_array: bool) -> Iterator[bytes]:
    """The messages a body stores, compactly re-encoded (lazily: see entries.pack_messages).

    ``[]`` stores nothing: fine on create (PUT), rejected on append (POST).
    """
    value = _loads(body)
    if isinstance(value, list):
        if not value and not allow_empty_array:
            raise bad_request("an empty JSON array appends nothing")
        return _encoded(value)
    return _encoded((value,))


def to_array(messages: Iterable[bytes]) -> bytes:
    return b"[" + b",".join(messages) + b"]"


def state_headers(message: bytes) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """A stored message that may be a State Protocol event (@durable-streams/state): its
    value and its ``headers``, both objects; None for anything else. Most messages are
    told apart by one substring search, without parsing; parsed exactly for integers past
    64 bits, as _dumps writes them."""
    if b'"headers"' not in message or message[:1] != b"{":
        return None
    try:
        value = _loads(message)
    except ProtocolError:  # stored messages are valid JSON: not reached
        return None
    if not isinstance(value, dict) or not isinstance(headers := value.get("headers"), dict):
        return None
    return value, headers


def with_offset(position: int, message: bytes) -> bytes:
    """A message as reads send it: a State Protocol event (an object whose ``headers``
    has a string ``operation`` or ``control``, see @durable-streams/state) gets
    ``headers.offset``, the offset right after it (where a reader resumes having applied
    it), as the reference server adds on every read; anything else goes unchanged."""
    parts = state_headers(message)
    if parts is None:
        return message
    value, headers = parts
    if not isinstance(headers.get("operation"), str) and not isinstance(headers.get("control"), str):
        return message
    headers["offset"] = offsets.encode(position + len(message))
    return _dumps(value)


def json_items(pieces: Iterable[tuple[int, bytes]]) -> bytes:
    """The messages of a read's pieces (each one message, or several of one stored entry
    joined by ``\\n``: entries.end_of) as an array's items, comma-separated. Compact JSON
    holds no raw newline, so a piece without State events is one ``replace`` away."""
    parts: list[bytes] = []
    for pos, data in pieces:
        if b'"headers"' not in data:
            parts.append(data.replace(SEPARATOR, b","))
        else:
            parts.extend(with_offset(at, message) for at, message in messages(pos, data))
    return b",".join(parts)


def json_body(entries: Iterable[tuple[int, bytes]]) -> bytes:
    """A JSON read's body: its messages (with their positions) in one array."""
    return b"[" + json_items(entries) + b"]"


def body_entries(media_type: str, body: bytes, *, create: bool) -> list[LogEntry]:
    """The log entries a request body becomes (see entries.py): a JSON body's messages in
    bounded groups, any other body in bounded slices."""
    if media_type == JSON_CONTENT_TYPE:
        if not body:
            return []
        return pack_messages(split_messages(body, allow_empty_array=create))
    return pack_bytes(body)
