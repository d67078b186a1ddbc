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


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


# orjson turns integers past 64 bits into floats, silently losing digits;
# bodies with such long digit runs go through the standard library instead.
_LONG_DIGITS = re.compile(rb"\d{19}")


def _loads(body: bytes) -> object:
    if not _LONG_DIGITS.search(body):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            raise bad_request("body is not valid JSON") from None
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise bad_request("body is not valid JSON") from None


def _dumps(value: object) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # an integer orjson cannot hold
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


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
