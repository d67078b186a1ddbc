"""JSON mode: a stream of JSON messages, one Redis entry per message.

A POST body is one value, or an array whose elements are the messages (one
level is flattened). Reads wrap the messages of a range in one array.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

import orjson

from .errors import bad_request
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


def _loads(body: bytes) -> object:
    """Parse a body, or 400. orjson refuses lone surrogates and numbers past a double by
    itself; the standard library is told to."""
    if not _LONG_DIGITS.search(body):
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


def split_messages(body: bytes, *, allow_empty_array: bool) -> list[bytes]:
    """The messages a body stores, compactly re-encoded.

    ``[]`` stores nothing: fine on create (PUT), rejected on append (POST).
    """
    value = _loads(body)
    if isinstance(value, list):
        if not value and not allow_empty_array:
            raise bad_request("an empty JSON array appends nothing")
        return [_dumps(item) for item in value]
    return [_dumps(value)]


def to_array(messages: Iterable[bytes]) -> bytes:
    return b"[" + b",".join(messages) + b"]"


def body_entries(media_type: str, body: bytes, *, create: bool) -> list[bytes]:
    """The log entries a request body becomes: one per JSON message, else the body."""
    if media_type == JSON_CONTENT_TYPE:
        if not body:
            return []
        return split_messages(body, allow_empty_array=create)
    return [body] if body else []
