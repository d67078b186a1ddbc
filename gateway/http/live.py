"""Live reads: long-poll and SSE, woken by the fan-out, never sleeping through data."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import replace

from aiohttp import HttpVersion11, web

from ..live.channels import Watch
from ..protocol import caching, offsets, responses
from ..protocol.errors import ProtocolError
from ..protocol.headers import STREAM_SSE_DATA_ENCODING, is_text
from ..protocol.jsonmode import json_body
from ..protocol.models import Chunk
from ..protocol.notices import Delivery
from ..protocol.sse import comment, control_event, cut_character, events
from ..redis_io.outcomes import UNAVAILABLE, not_found
from .context import BODY_SENT, Gateway

_RETRY_SECONDS = 0.25
_STOPPING_WRITE_SECONDS = 1.0
_SINK_BUFFER_LIMIT = 256 * 1024  # a client this far behind is served by its own task


class _SseSink:
    """A caught-up SSE response the fan-out writes small appends to directly."""

    __slots__ = ("position", "closed", "key", "sent", "_transport", "_text", "_json", "_cursor", "_chunked")

    def __init__(
        self, transport: asyncio.Transport, *, text: bool, is_json: bool, cursor: str, chunked: bool
    ) -> None:
        self.position = 0
        self.closed = False
        self.sent = 0  # body bytes written (without chunk framing)
        self.key = (text, is_json, cursor, chunked)
        self._transport = transport
        self._text, self._json, self._cursor, self._chunked = text, is_json, cursor, chunked

    def frame(self, delivery: Delivery) -> bytes:
        body = None
        if delivery.entries:
            body = json_body(delivery.entries) if self._json else b"".join([d for _, d in delivery.entries])
        frame = events(
            body, offsets.encode(delivery.tail), text=self._text, cursor=self._cursor, up_to_date=True,
            closed=delivery.closed,
        )  # fmt: skip
        return b"%x\r\n%b\r\n" % (len(frame), frame) if self._chunked else frame

    def writable(self) -> bool:
        t = self._transport
        return not t.is_closing() and t.get_write_buffer_size() < _SINK_BUFFER_LIMIT

    def write(self, frame: bytes) -> None:
        self._transport.write(frame)
        self.sent += len(frame) - (frame.index(b"\r\n") + 4 if self._chunked else 0)


class _Stalled(Exception):
    """A live client took no data for --write-timeout seconds."""


def _whole_characters(chunk: Chunk, text: bool) -> Chunk:
    """A text stream's chunk that a read cut short ends on a character boundary
    (the bytes held back come first in the next event). A chunk that ends at the
    tail is left as the writers left it."""
    if not text or chunk.meta.is_json or not chunk.entries or chunk.up_to_date:
        return chunk
    cut = cut_character(b"".join(data for _, data in chunk.entries[-4:])[-4:])  # may span entries
    if not cut or cut >= chunk.end - chunk.start:
        return chunk  # nothing to hold back, or nothing would be left to send
    entries = list(chunk.entries)
    while cut:
        pos, data = entries[-1]
        if len(data) <= cut:
            entries.pop()
            cut -= len(data)
        else:
            entries[-1] = (pos, data[:-cut])
            cut = 0
    return Chunk(chunk.meta, chunk.start, entries)


async def _reread(gw: Gateway, sid: str, watch: Watch, chunk: Chunk, start: int) -> Chunk:
    """The stream from ``start`` on, read from Redis (shared with this process's other
    readers at the same offset), as the stream ``chunk`` was read from: one deleted and
    created anew meanwhile is not the stream the reader followed (its offsets started
    over), so it ends as if the deletion had been seen alone (404), also where the read
    refused the offset (the new stream shorter: 400; below what it retains: 410)."""
    try:
        found = await gw.store.read_shared(sid, start, watch.reading())
    except ProtocolError as refused:
        if refused.status == 404 or (await gw.store.head(sid)).created == chunk.meta.created:
            raise
        raise not_found("missing") from None
    if found.meta.created != chunk.meta.created:
        raise not_found("missing")
    return found


async def _after(gw: Gateway, sid: str, watch: Watch, chunk: Chunk) -> Chunk:
    """What follows ``chunk``: straight from the pub/sub notices when they carry
    all of it (small appends, nothing missed), else read from Redis (``_reread``)."""
    delivery = watch.delivery(chunk.end)
    if delivery is None:
        return await _reread(gw, sid, watch, chunk, chunk.end)
    key = ("chunk", chunk.meta.sid, chunk.meta.created)  # one Chunk for all readers it reaches
    shared = delivery.cache.get(key)
    if shared is None:
        meta = replace(chunk.meta, tail=max(chunk.meta.tail, delivery.tail), closed=delivery.closed)
        shared = delivery.cache[key] = Chunk(meta, delivery.start, list(delivery.entries))
    return shared


def _deadline(loop: asyncio.AbstractEventLoop, seconds: float, until: float | None) -> float:
    """When a live response ends (loop time): after ``seconds``, or when the credential
    that opened it expires (``until``, Unix seconds), whichever comes first."""
    deadline = loop.time() + seconds
    if until is not None:
        deadline = min(deadline, loop.time() + max(0.0, until - time.time()))
    return deadline


async def long_poll(
    request: web.Request, gw: Gateway, sid: str, start: int | None, cursor: str, until: float | None = None
) -> web.Response:
    """Data now if there is any (or the stream is closed), else wait for an append
    (no longer than the credential that asked stays valid: ``until``).

    If Redis goes away while we wait, we keep trying until the timeout and then
    answer with the last tail we knew; the client simply polls again.
    """
    first_read = time.monotonic()
    chunk = await gw.store.read_shared(sid, start, first_read)
    if not chunk.entries and not chunk.meta.closed:
        loop = asyncio.get_running_loop()
        deadline = _deadline(loop, gw.settings.long_poll_timeout, until)
        async with gw.fanout.watch(sid, first_read) as watch:
            recheck = True  # after subscribing, look once more: nothing slips by
            while True:
                try:
                    if recheck:
                        chunk = await _reread(gw, sid, watch, chunk, chunk.start)
                    else:
                        chunk = await _after(gw, sid, watch, chunk)
                except UNAVAILABLE:
                    if loop.time() >= deadline or watch.stopping:
                        break
                    recheck = True
                    await asyncio.sleep(_RETRY_SECONDS)
                    continue
                if chunk.entries and not recheck:
                    watch.delivered()  # woken, and answering with what the notice announced
                recheck = False
                if chunk.entries or chunk.meta.closed:
                    break
                if not await watch.wait(deadline - loop.time()):
                    break
    headers = responses.read_chunk(chunk, cursor=cursor, at_now=start is None)
    if not chunk.entries:
        headers.pop("ETag", None)
        headers["Cache-Control"] = caching.NO_STORE
        return web.Response(status=204, headers=headers)
    return web.Response(status=200, body=chunk.body(), headers=headers)


def _control(chunk: Chunk, cursor: str) -> bytes:
    return control_event(
        offsets.encode(chunk.end), cursor=cursor, up_to_date=chunk.up_to_date, closed=chunk.eof
    )


async def _write(gw: Gateway, response: web.StreamResponse, data: bytes) -> int:
    """A client that takes nothing for --write-timeout seconds is dropped: it must
    not hold a connection, memory, or a graceful shutdown. Shutting down, a last
    event gets a second, not the full timeout. Returns the bytes written."""
    seconds = _STOPPING_WRITE_SECONDS if gw.fanout.stopping else gw.settings.write_timeout
    try:
        async with asyncio.timeout(seconds):
            await response.write(data)
    except TimeoutError:
        raise _Stalled from None
    return len(data)


async def _send(gw: Gateway, response: web.StreamResponse, chunk: Chunk, text: bool, cursor: str) -> int:
    key = ("sse", text, cursor)  # encoded once, however many readers this chunk reaches
    frames = chunk.cache.get(key)
    if frames is None:
        body = chunk.body() if chunk.entries else None
        frames = chunk.cache[key] = events(
            body, offsets.encode(chunk.end), text=text, cursor=cursor, up_to_date=chunk.up_to_date,
            closed=chunk.eof,
        )  # fmt: skip
    return await _write(gw, response, frames)


async def sse(
    request: web.Request, gw: Gateway, sid: str, start: int | None, cursor: str, until: float | None = None
) -> web.StreamResponse:
    """An event stream: data events, each followed by a control event.

    Ends when the stream closes (after the final control event), when the
    reconnect cycle is up, when the credential that opened it expires
    (``until``), or on shutdown; all but the first end with a control
    event saying where to resume. A Redis outage does not end it: reads are
    retried, and the fan-out wakes every reader once Redis is back.

    Thousands of these wait at once, mostly parked: what one keeps while it
    waits is kept small (no closures, no headers once sent, no chunk data).
    """
    first_read = time.monotonic()
    chunk = await gw.store.read_shared(sid, start, first_read)  # 404 and friends first
    text = is_text(chunk.meta.content_type)
    chunk = _whole_characters(chunk, text)
    headers = {
        **gw.guard.browser_headers(request),  # sent before the handler returns: endpoint() can't add them
        "Content-Type": "text/event-stream",
        "Cache-Control": caching.SSE,
        "X-Accel-Buffering": "no",
    }
    if not text:
        headers[STREAM_SSE_DATA_ENCODING] = "base64"
    response = web.StreamResponse(status=200, headers=headers)
    del headers
    chunked = request.version >= HttpVersion11
    if chunked:
        response.enable_chunked_encoding()  # explicit: the fan-out frames its direct writes the same way
    await response.prepare(request)
    # Serialised and sent with the first event: nothing reads them again (endpoint() and
    # aiohttp look at a prepared response's status and sizes only).
    response.headers.clear()
    transport = request.transport
    assert transport is not None
    loop = asyncio.get_running_loop()
    # Spread reconnects: clients that connected together must not all come back together.
    deadline = _deadline(loop, gw.settings.sse_cycle_seconds * random.uniform(0.75, 1.0), until)

    sent, sink = 0, None  # (bytes out: the tenants' meter, endpoint.py)
    try:
        async with gw.fanout.watch(sid, first_read) as watch:
            sent += await _send(gw, response, chunk, text, cursor)
            sink = _SseSink(transport, text=text, is_json=chunk.meta.is_json, cursor=cursor, chunked=chunked)
            # The first read came before the registration: an append in between reaches only
            # readers registered then, so look again if the channel moved since (as long-poll does).
            unread = watch.moved_since(first_read)  # woken (or a read failed) and not yet read since
            while not chunk.eof and not watch.stopping and loop.time() < deadline:
                if chunk.up_to_date and not unread:
                    if chunk.entries or chunk.cache:  # sent: keep no data (nor its frames) while parked
                        chunk = Chunk(chunk.meta, chunk.end)
                    sink.position = chunk.end
                    heartbeat = min(deadline - loop.time(), gw.settings.sse_heartbeat_seconds)
                    woke = await watch.park(sink, heartbeat)
                    if sink.position != chunk.end or sink.closed:  # the fan-out wrote to us meanwhile
                        meta = replace(chunk.meta, tail=sink.position, closed=sink.closed)
                        chunk = Chunk(meta, sink.position)
                    if chunk.eof:
                        break
                    if not woke:
                        if not watch.stopping and loop.time() < deadline:
                            sent += await _write(gw, response, comment())
                        continue
                try:
                    chunk = _whole_characters(await _after(gw, sid, watch, chunk), text)
                except UNAVAILABLE:
                    unread = True
                    await asyncio.sleep(_RETRY_SECONDS)
                    continue
                unread = False
                if chunk.entries or chunk.eof:
                    sent += await _send(gw, response, chunk, text, cursor)
                    if chunk.entries:
                        watch.delivered()
            if not chunk.eof:  # cycle over or shutting down: say where to resume
                sent += await _write(gw, response, _control(chunk, cursor))
    except ProtocolError:
        pass  # deleted or expired mid-stream: end the event stream
    except _Stalled:
        transport.abort()  # drop what it never took
        return response
    except (ConnectionResetError, asyncio.CancelledError):
        return response  # the client left
    finally:
        request[BODY_SENT] = sent + (sink.sent if sink is not None else 0)
    seconds = _STOPPING_WRITE_SECONDS if gw.fanout.stopping else gw.settings.write_timeout
    with contextlib.suppress(ConnectionResetError, TimeoutError):
        async with asyncio.timeout(seconds):
            await response.write_eof()
    return response
