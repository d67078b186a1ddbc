"""Protocol request headers: names and parsing rules, no I/O.

Every parser raises a 400 ProtocolError for malformed input, so handlers can
validate everything before touching Redis.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from .errors import bad_request

STREAM_NEXT_OFFSET = "Stream-Next-Offset"
STREAM_UP_TO_DATE = "Stream-Up-To-Date"
STREAM_CLOSED = "Stream-Closed"
STREAM_CURSOR = "Stream-Cursor"
STREAM_SEQ = "Stream-Seq"
STREAM_TTL = "Stream-TTL"
STREAM_EXPIRES_AT = "Stream-Expires-At"
STREAM_SNAPSHOT_OFFSET = "Stream-Snapshot-Offset"  # Ursula's: a stream's latest snapshot
STREAM_FORKED_FROM = "Stream-Forked-From"
STREAM_FORK_OFFSET = "Stream-Fork-Offset"
STREAM_FORK_SUB_OFFSET = "Stream-Fork-Sub-Offset"
STREAM_SSE_DATA_ENCODING = "Stream-SSE-Data-Encoding"
STREAM_EXPECTED_OFFSET = "Stream-Expected-Offset"
STREAM_COMPACTION = "Stream-Compaction"  # ours: a State stream compacted by key (docs/compaction.md)
IF_MATCH = "If-Match"
PRODUCER_ID = "Producer-Id"
PRODUCER_EPOCH = "Producer-Epoch"
PRODUCER_SEQ = "Producer-Seq"
PRODUCER_EXPECTED_SEQ = "Producer-Expected-Seq"
PRODUCER_RECEIVED_SEQ = "Producer-Received-Seq"

DEFAULT_CONTENT_TYPE = "application/octet-stream"
JSON_CONTENT_TYPE = "application/json"
MAX_SAFE_INTEGER = 2**53 - 1  # producer numbers stay exact in JavaScript

_DECIMAL = re.compile(r"\A(0|[1-9][0-9]*)\Z")
_RFC3339 = re.compile(  # ASCII digits only: \d would take any script's digits
    r"\A([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt ]([0-9]{2}):([0-9]{2}):([0-9]{2})(\.[0-9]+)?"
    r"([Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])\Z"
)
_TOKEN_CHARS = re.compile(r"\A[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")
_PRINTABLE_ASCII = re.compile(r"\A[\x20-\x7e]*\Z")  # what a stored text header may hold
_VISIBLE_ASCII = re.compile(r"\A[\t\x20-\x7e]*\Z")  # what a Content-Type may hold, parameters too


def is_true(value: str | None) -> bool:
    """Stream-Closed and friends: only ``true`` (any case) counts; anything else is absent."""
    return value is not None and value.strip().lower() == "true"


def text_value(value: str, name: str) -> str:
    """A header value stored as text: visible ASCII. (aiohttp hands undecodable bytes
    over as lone surrogates, which Redis could not encode; browsers cannot send other
    characters in headers at all.)"""
    if not _PRINTABLE_ASCII.match(value):
        raise bad_request(f"{name} must be visible ASCII")
    return value


def parse_decimal(value: str, name: str, maximum: int | None = None) -> int:
    """A non-negative decimal integer: no sign, no leading zeros, no fraction or exponent."""
    if not _DECIMAL.match(value):
        raise bad_request(f"{name} must be a non-negative integer without leading zeros")
    if len(value) > 20:  # past any limit here; and int() of thousands of digits is refused (ValueError)
        raise bad_request(f"{name} is too large")
    number = int(value)
    if maximum is not None and number > maximum:
        raise bad_request(f"{name} must be at most {maximum}")
    return number


def parse_expires_at(value: str) -> int:
    """An RFC 3339 timestamp (offset required) as milliseconds since the epoch."""
    match = _RFC3339.match(value.strip())
    if match is None:
        raise bad_request("Stream-Expires-At must be an RFC 3339 timestamp")
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    fraction, zone = match.group(7), match.group(8)
    try:
        moment = datetime(year, month, day, hour, minute, min(second, 59), tzinfo=UTC)
        if zone not in ("Z", "z"):
            sign = 1 if zone[0] == "+" else -1
            moment -= sign * timedelta(hours=int(zone[1:3]), minutes=int(zone[4:6]))
    except (ValueError, OverflowError) as exc:  # e.g. 0001-01-01T00:00:00+01:00 is before year 1
        raise bad_request(f"Stream-Expires-At is not a valid date: {exc}") from None
    millis = int(moment.timestamp() * 1000) + (second - min(second, 59)) * 1000
    if fraction:
        millis += int((fraction[1:] + "000")[:3])
    return millis


def normalize_content_type(value: str | None) -> str:
    """The media type alone, lower-cased: what stream content types are compared by."""
    if value is None:
        return ""
    return value.split(";", 1)[0].strip().lower()


@functools.lru_cache(maxsize=1024)  # every append parses one; clients send few distinct values
def validate_content_type(value: str) -> str:
    """A usable ``type/subtype`` (parameters in visible ASCII) or 400."""
    if not _VISIBLE_ASCII.match(value):
        raise bad_request("Content-Type must be visible ASCII")
    media = normalize_content_type(value)
    kind, _, sub = media.partition("/")
    if not (_TOKEN_CHARS.match(kind or "") and _TOKEN_CHARS.match(sub or "")):
        raise bad_request(f"malformed Content-Type: {value[:100]!r}")
    return media


def is_text(content_type: str) -> bool:
    """Types whose SSE data events carry text; every other type is base64."""
    media = normalize_content_type(content_type)
    return media.startswith("text/") or media == JSON_CONTENT_TYPE


@dataclass(frozen=True)
class Expiry:
    """A create request's lifetime: a sliding TTL or an absolute deadline (or neither)."""

    ttl_seconds: int | None = None
    expires_at: str | None = None  # as given, echoed back on HEAD
    expires_at_ms: int | None = None


def parse_expiry(headers: Mapping[str, str]) -> Expiry:
    ttl = headers.get(STREAM_TTL)
    expires = headers.get(STREAM_EXPIRES_AT)
    if ttl is not None and expires is not None:
        raise bad_request("give Stream-TTL or Stream-Expires-At, not both")
    if ttl is not None:
        return Expiry(ttl_seconds=parse_decimal(ttl.strip(), STREAM_TTL, 10**10))
    if expires is not None:
        return Expiry(expires_at=expires.strip(), expires_at_ms=parse_expires_at(expires))
    return Expiry()


@dataclass(frozen=True)
class Producer:
    """Idempotent producer headers: all three or none."""

    id: str
    epoch: int
    seq: int


def parse_producer(headers: Mapping[str, str]) -> Producer | None:
    if PRODUCER_ID not in headers and PRODUCER_EPOCH not in headers and PRODUCER_SEQ not in headers:
        return None  # most appends: checked first, cheaply
    values = [headers.get(name) for name in (PRODUCER_ID, PRODUCER_EPOCH, PRODUCER_SEQ)]
    if any(v is None for v in values):
        raise bad_request("Producer-Id, Producer-Epoch and Producer-Seq go together")
    producer_id, epoch, seq = (v.strip() for v in values)  # type: ignore[union-attr]
    text_value(producer_id, PRODUCER_ID)
    if not producer_id:
        raise bad_request("Producer-Id must not be empty")
    return Producer(
        id=producer_id,
        epoch=parse_decimal(epoch, PRODUCER_EPOCH, MAX_SAFE_INTEGER),
        seq=parse_decimal(seq, PRODUCER_SEQ, MAX_SAFE_INTEGER),
    )


def parse_stream_seq(headers: Mapping[str, str]) -> str | None:
    value = headers.get(STREAM_SEQ)
    if value is None:
        return None
    if not value.strip():
        raise bad_request("Stream-Seq must not be empty")
    return text_value(value.strip(), STREAM_SEQ)
