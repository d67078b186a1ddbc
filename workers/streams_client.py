"""A small synchronous Durable Streams client, for Spark's Python workers (the data source
in ``workers/spark_*.py``): plain ``http.client`` over one kept-alive connection,
no event loop, nothing to install beyond the project's dependencies.

It speaks the protocol like any client (catch-up reads following ``Stream-Next-Offset``,
``HEAD``, appends with idempotent-producer headers, the listing API
``GET {base}/__ds/streams``) with a bearer token when given one. Two things go beyond
what the protocol promises, both this server's documented behaviour, and both checked
on every response so that another server fails loudly instead of producing wrong rows:

* **Offsets are positions.** Tokens are ``<format>_<value>`` with 16 digits each;
  format 1 (every offset this server mints) names byte position ``value // 2``
  (``gateway/protocol/offsets.py``, a pure module, does the arithmetic). The protocol
  has no way to read *up to* an offset, nor to tell how many bytes lie between two
  offsets: a read from S may return past a planned end E, and the only protocol-level
  remedy, reading again from E and matching the overlap, is ambiguous when data repeats
  and concurrent appends move the tail (B = "aaa" read from S, C = "aa" read from E
  later: is the overlap one byte or two?). Knowing positions, a reader keeps exactly
  ``E - S`` bytes; every byte response is checked: ``len(body)`` must equal
  ``position(Stream-Next-Offset) - position(offset)``.
* **A JSON message takes the positions of its stored (compact) encoding**
  (``gateway/protocol/entries.py``), which is what a read returns, except that a State
  Protocol event (an object whose ``headers`` has a string ``operation`` or ``control``)
  comes back with ``headers.offset``: the offset right after it. So each message's own
  offset is known (the archive's ``offset``/``next_offset`` columns hold the same), and
  the positions of a response's messages must add up to its ``Stream-Next-Offset``.

A third tells a stream created again at a path from the one read before: the
**incarnation** (the stream's creation time, ms), which the listing gives as
``created_at_ms`` and HEAD and reads carry in their ``ETag``
(``gateway/protocol/caching.py``: ``"<created>-<check>:<start>:<end>"``). Where a
response has none (another server), the incarnation is unknown and nothing is compared.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from urllib.parse import quote, urlencode, urlsplit

import orjson

from gateway.protocol import caching as _caching
from gateway.protocol import offsets as _offsets
from gateway.protocol.errors import ProtocolError
from gateway.protocol.jsonmode import split_messages
from gateway.protocol.namespace import RESERVED

log = logging.getLogger("durable_streams.spark")

BEGINNING = "-1"  # the protocol's "from the start of the stream"
ZERO = _offsets.ZERO  # position 0: what this source reads instead of -1 (see read_range)
JSON_TYPE = "application/json"
RETRY_STATUSES = (429, 502, 503, 504)


class StreamsError(Exception):
    """An answer the caller cannot go on with (or no answer after the retries)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class OffsetMismatch(StreamsError):
    """A response whose lengths do not match its offsets: not this server's offsets."""


def position(token: str) -> int:
    """The byte position an offset token names (this server's tokens; see the module doc)."""
    try:
        return _offsets.decode(token)
    except ProtocolError:
        raise ValueError(f"not an offset of this server: {token[:80]!r}") from None


def token(pos: int) -> str:
    """The offset token of a byte position (as the server mints them)."""
    return _offsets.encode(pos)


def start_position(offset: str) -> int:
    """Where a range starting at ``offset`` starts (-1: the stream's start, position 0)."""
    return 0 if offset == BEGINNING else position(offset)


def is_json(content_type: str | None) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == JSON_TYPE


@dataclass(frozen=True)
class Reply:
    status: int
    headers: Mapping[str, str]  # lower-case names
    body: bytes

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    @property
    def text(self) -> str:
        return self.body[:300].decode("utf-8", "replace").strip()


@dataclass(frozen=True)
class StreamInfo:
    """What a listing page or a HEAD says about one stream."""

    path: str
    tail: str  # the offset after its last byte (Stream-Next-Offset)
    content_type: str
    closed: bool = False
    created: str | None = None  # the incarnation (creation time, ms); None: not said

    @property
    def json(self) -> bool:
        return is_json(self.content_type)


@dataclass
class Client:
    """One server's streams under ``base_url`` (``http://host:4437/v1/stream``)."""

    base_url: str
    token: str | None = None
    timeout: float = 30.0
    retries: int = 8  # tries after the first, for connection errors and 429/502/503/504
    _conn: http.client.HTTPConnection | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        parts = urlsplit(self.base_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"url must be the streams' base URL, http(s)://host:port/prefix: {self.base_url!r}"
            )
        self._scheme, self._host, self._port = parts.scheme, parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/")

    # --- transport ---

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            kind = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
            self._conn = kind(self._host, self._port, timeout=self.timeout)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def request(
        self,
        method: str,
        target: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        """One request, retried on connection errors and 429/502/503/504 (honouring
        Retry-After) with jittered backoff. Callers only send requests that are safe to
        repeat: reads, HEAD, PUT (idempotent create), appends with producer headers."""
        sent = dict(headers or {})
        if self.token:
            sent["Authorization"] = f"Bearer {self.token}"
        delay = 0.1
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                conn = self._connection()
                conn.request(method, target, body=body, headers=sent)
                response = conn.getresponse()
                data = response.read()
                reply = Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, data)
                if response.will_close:
                    self.close()
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if last:
                    raise StreamsError(f"{method} {target}: {exc!r} after {attempt + 1} tries") from exc
                log.debug("%s %s: %r, retrying", method, target, exc)
            else:
                if reply.status not in RETRY_STATUSES or last:
                    return reply
                after = reply.header("Retry-After")
                if after and after.replace(".", "", 1).isdigit():
                    delay = max(delay, min(float(after), 10.0))
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 5.0)
        raise AssertionError("not reached")

    def target(self, path: str, query: Mapping[str, str] | None = None) -> str:
        """The request target of a stream path (percent-encoded) and query."""
        out = f"{self._prefix}/{quote(path, safe='/')}"
        return f"{out}?{urlencode(query)}" if query else out

    # --- protocol ---

    def head(self, path: str) -> Reply:
        return self.request("HEAD", self.target(path))

    def read(self, path: str, offset: str) -> Reply:
        """One catch-up read (a chunk at most) from ``offset``."""
        return self.request("GET", self.target(path, {"offset": offset}))

    def info(self, path: str) -> StreamInfo | None:
        """HEAD: the stream's tail and content type; None when it does not exist (404/410)."""
        reply = self.head(path)
        if reply.status in (404, 410):
            return None
        if reply.status != 200:
            raise StreamsError(f"HEAD {path}: {reply.status} {reply.text}", reply.status)
        return StreamInfo(
            path,
            reply.header("Stream-Next-Offset") or ZERO,
            reply.header("Content-Type") or "application/octet-stream",
            (reply.header("Stream-Closed") or "").lower() == "true",
            _caching.incarnation(reply.header("ETag")),
        )

    def list_streams(self, prefix: str = "", page: int = 1000) -> Iterator[StreamInfo]:
        """Every stream whose path starts with ``prefix``, page after page of
        ``GET {base}/__ds/streams`` (the server's listing; a credential sees what it may read)."""
        after: str | None = None
        while True:
            query = {"prefix": prefix, "limit": str(page)} | ({"after": after} if after else {})
            reply = self.request("GET", f"{self._prefix}/{RESERVED}/streams?{urlencode(query)}")
            if reply.status != 200:
                raise StreamsError(f"listing {prefix!r}: {reply.status} {reply.text}", reply.status)
            doc = json.loads(reply.body)
            for item in doc["streams"]:
                yield StreamInfo(
                    item["path"],
                    item["tail_offset"],
                    item.get("content_type") or "",
                    item.get("status") == "closed",
                    str(item["created_at_ms"]) if item.get("created_at_ms") is not None else None,
                )
            after = doc.get("next_cursor")
            if not doc.get("has_more") or not after:
                return

    def create(self, path: str, content_type: str) -> Reply:
        return self.request("PUT", self.target(path), headers={"Content-Type": content_type})

    def append(
        self, path: str, body: bytes, content_type: str, producer: tuple[str, int, int] | None = None
    ) -> Reply:
        headers = {"Content-Type": content_type}
        if producer is not None:
            headers |= {"Producer-Id": producer[0], "Producer-Epoch": str(producer[1]),
                        "Producer-Seq": str(producer[2])}  # fmt: skip
        return self.request("POST", self.target(path), body=body, headers=headers)


# --- Reading a range of a stream ---


@dataclass(frozen=True, slots=True)
class Piece:
    """One row's worth: a byte stream's piece (as read, cut at the range's end) or one
    JSON message, with the offsets it spans."""

    offset: str
    next_offset: str
    data: bytes
    content_type: str
    json: bool


def _state_event_end(message: bytes) -> int | None:
    """A State Protocol event's ``headers.offset`` (the position after it), which reads
    add (``gateway/protocol/jsonmode.with_offset``); None for any other message."""
    if message[:1] != b"{" or b'"headers"' not in message:
        return None
    try:
        value = orjson.loads(message)
    except orjson.JSONDecodeError:
        value = json.loads(message)  # integers past 64 bits
    headers = value.get("headers") if isinstance(value, dict) else None
    if not isinstance(headers, dict):
        return None
    if not isinstance(headers.get("operation"), str) and not isinstance(headers.get("control"), str):
        return None
    found = headers.get("offset")
    return position(found) if isinstance(found, str) else None


def split_array(body: bytes) -> list[bytes]:
    """A JSON read's body (``[`` + messages joined by ``,`` + ``]``, each message compactly
    encoded) as the messages' texts. Fast path: orjson parses the array and re-encodes
    each value, which must be found verbatim where the message sits; anything else (an
    integer past 64 bits, which orjson turns into a float; another encoder's spacing)
    goes through the server's own parser and encoder (``jsonmode.split_messages``), which
    gives back the server's texts unchanged. ``json_messages`` checks the lengths."""
    try:
        values = orjson.loads(body)
    except orjson.JSONDecodeError:
        values = None
    if isinstance(values, list):
        out, at, dumps = [], 1, orjson.dumps
        try:
            for value in values:
                text = dumps(value)
                if not body.startswith(text, at):
                    break
                out.append(text)
                at += len(text) + 1
            else:
                if at == len(body) or (not values and body == b"[]"):
                    return out
        except orjson.JSONEncodeError:
            pass
    return list(split_messages(body, allow_empty_array=True))


def json_messages(body: bytes, start: int, end: int) -> list[tuple[int, int, bytes]]:
    """A JSON read's messages as (position, next position, text), the read having started
    at message boundary ``start`` and answered ``Stream-Next-Offset`` ``end``."""
    out = []
    at = start
    for message in split_array(body):
        stop = _state_event_end(message)
        if stop is None:
            stop = at + len(message)
        if stop <= at:
            raise OffsetMismatch(f"a JSON message at position {at} ends at {stop}")
        out.append((at, stop, message))
        at = stop
    if at != end:
        raise OffsetMismatch(
            f"JSON messages from position {start} add up to {at}, the read said {end}: "
            "not this server's offsets (or a changed encoding)"
        )
    return out


def read_range(
    client: Client, path: str, start: str, end: str, created: str | None = None
) -> Iterator[Piece]:
    """The stream's data in [start, end): catch-up reads from ``start`` following
    ``Stream-Next-Offset`` until ``end``, the last response cut at ``end`` (a byte
    stream keeps ``end - offset`` bytes of it; a JSON stream the messages that start
    before ``end``, ends being message boundaries: tails, or user-given offsets).

    ``start`` -1 reads from position 0, so that the first JSON message's position is
    known; where retention dropped data the server answers 410 with
    ``Stream-Earliest-Offset`` and the read goes on from there. A stream that is gone
    (404/410) ends the range: logged, no rows, no error; so does one created again
    since the range was planned in incarnation ``created`` (a read's ``ETag`` names
    another), whose bytes are not the planned ones.
    """
    stop = position(end)
    offset = ZERO if start == BEGINNING else start
    at = position(offset)
    while at < stop:
        reply = client.read(path, offset)
        earliest = reply.header("Stream-Earliest-Offset")
        if reply.status == 410 and earliest and position(earliest) > at:
            if start != BEGINNING or at != 0:
                log.warning(
                    "%s: data in [%s, %s) was dropped by retention before it was read", path, offset, earliest
                )
            offset, at = earliest, position(earliest)
            continue
        if reply.status in (404, 410):
            log.warning("%s: %s (deleted or expired) reading from %s: skipped", path, reply.status, offset)
            return
        if reply.status == 400 and "beyond" in reply.text:
            log.warning(
                "%s: offset %s is beyond its tail (deleted and created again?): skipped", path, offset
            )
            return
        if reply.status != 200:
            raise StreamsError(f"GET {path} at {offset}: {reply.status} {reply.text}", reply.status)
        now = _caching.incarnation(reply.header("ETag"))
        if created and now and now != created:
            log.warning("%s: created again (at %s) since planned at %s: the range ends at %s", path, now,
                        created, offset)  # fmt: skip
            return
        following = reply.header("Stream-Next-Offset")
        if not following:
            raise StreamsError(f"GET {path} at {offset}: no Stream-Next-Offset")
        after = position(following)
        if after <= at:
            log.warning(
                "%s: no data at %s below the planned end %s (created again?): skipped", path, offset, end
            )
            return
        content_type = reply.header("Content-Type") or "application/octet-stream"
        if is_json(content_type):
            previous = token(at)
            for first, last, message in json_messages(reply.body, at, after):
                if first >= stop:
                    break
                following_message = token(last)
                yield Piece(previous, following_message, message, content_type, True)
                previous = following_message
        else:
            if len(reply.body) != after - at:
                raise OffsetMismatch(
                    f"GET {path} at {offset}: {len(reply.body)} bytes, offsets say {after - at}: "
                    "not this server's offsets"
                )
            keep = reply.body if after <= stop else reply.body[: stop - at]
            yield Piece(token(at), token(at + len(keep)), keep, content_type, False)
        offset, at = following, after
