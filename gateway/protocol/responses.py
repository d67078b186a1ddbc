"""Which headers each kind of response carries: plain functions of stream state."""

from __future__ import annotations

from . import browser, caching, offsets
from .headers import (
    PRODUCER_EPOCH,
    PRODUCER_SEQ,
    STREAM_CLOSED,
    STREAM_COMPACTION,
    STREAM_CURSOR,
    STREAM_EXPIRES_AT,
    STREAM_NEXT_OFFSET,
    STREAM_SNAPSHOT_OFFSET,
    STREAM_TTL,
    STREAM_UP_TO_DATE,
)
from .models import AppendResult, Chunk, Meta

# Headers browsers may read from a cross-origin response (CORS).
EXPOSED = ", ".join(
    [
        STREAM_NEXT_OFFSET,
        STREAM_UP_TO_DATE,
        STREAM_CLOSED,
        STREAM_CURSOR,
        STREAM_TTL,
        STREAM_EXPIRES_AT,
        "Stream-SSE-Data-Encoding",
        PRODUCER_EPOCH,
        PRODUCER_SEQ,
        "Producer-Expected-Seq",
        "Producer-Received-Seq",
        "ETag",
        "Location",
        STREAM_SNAPSHOT_OFFSET,
        STREAM_COMPACTION,
        "Stream-Earliest-Offset",
    ]
)


def current_state(
    stream_id: str, created: str, tail: int, closed: bool, generation: int = 0
) -> dict[str, str]:
    """Where the stream is: its tail, its ETag (what If-Match compares) and closure.
    ``generation``: a compacted stream's (caching.etag)."""
    headers = {
        STREAM_NEXT_OFFSET: offsets.encode(tail),
        "ETag": caching.stream_etag(stream_id, created, tail, closed, generation),
    }
    if closed:
        headers[STREAM_CLOSED] = "true"
    return headers


def stream_state(meta: Meta) -> dict[str, str]:
    """Create and HEAD: the stream's configuration, tail and ETag."""
    headers = {"Content-Type": meta.content_type}
    headers.update(current_state(meta.sid, meta.created, meta.tail, meta.closed, meta.compacted.generation))
    if meta.compaction:
        headers[STREAM_COMPACTION] = meta.compaction
    if meta.ttl is not None:
        headers[STREAM_TTL] = str(meta.ttl)
    if meta.expires_at is not None:
        headers[STREAM_EXPIRES_AT] = meta.expires_at
    if meta.snapshot is not None:  # Ursula's: where its latest snapshot is (http/snapshots.py)
        headers[STREAM_SNAPSHOT_OFFSET] = offsets.encode(meta.snapshot)
    return headers


def append_result(result: AppendResult) -> dict[str, str]:
    headers = {STREAM_NEXT_OFFSET: offsets.encode(result.tail)}
    if result.closed:
        headers[STREAM_CLOSED] = "true"
    if result.producer_epoch is not None:
        headers[PRODUCER_EPOCH] = str(result.producer_epoch)
        headers[PRODUCER_SEQ] = str(result.producer_seq)
    return headers


def read_chunk(
    chunk: Chunk, *, cursor: str | None, at_now: bool, coding: str = "", vary: bool = False
) -> dict[str, str]:
    """Catch-up and long-poll reads (200, or 204 when a long-poll saw nothing).
    ``coding``: the content coding the body is sent in ('' as stored); ``vary``: the
    answer depends on Accept-Encoding (a stream whose reads may be compressed)."""
    headers = {"Content-Type": chunk.meta.content_type, STREAM_NEXT_OFFSET: offsets.encode(chunk.end)}
    if browser.is_active(chunk.meta.media_type):  # a tab opened on it downloads, never renders
        headers.update(browser.ATTACHMENT)
    if chunk.up_to_date:
        headers[STREAM_UP_TO_DATE] = "true"
    if chunk.eof:
        headers[STREAM_CLOSED] = "true"
    elif cursor is not None:
        headers[STREAM_CURSOR] = cursor
    if at_now:  # the tail moves: nothing to cache (long-poll 204s are made no-store in live.py)
        headers["Cache-Control"] = caching.NO_STORE
    else:
        headers["Cache-Control"] = caching.CACHEABLE
        headers["ETag"] = chunk_etag(chunk, coding)
    if coding:
        headers["Content-Encoding"] = coding
    if vary:
        headers["Vary"] = "Accept-Encoding"
    return headers


def chunk_etag(chunk: Chunk, coding: str = "") -> str:
    meta = chunk.meta
    return caching.etag(
        meta.sid, meta.created, chunk.start, chunk.end, chunk.eof, coding, meta.compacted.generation
    )
