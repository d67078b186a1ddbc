"""Catch-up answers: everything from a read's offset to the tail (up to --max-chunk-bytes),
sent while it is read.

An answer that fits in one page is built and sent with a Content-Length. A longer one is
streamed: its headers (the next offset, the ETag) are known before its body, because
``Store.catch_up`` says where it ends; then page after page is read (Redis, the archive,
a fork's ancestors) while the one before is written. Each page is held in the process's
read budget (``ByteBudget``) from before it is read until it is sent, and ``write``
waits while the client's socket is full, so an answer holds about two pages whatever
its length and a reader that stops reading stops the reads. A client that goes away
ends it at its next write; one that takes nothing for --write-timeout is dropped.

A failure once the body has begun (Redis gone, data dropped meanwhile) cannot be
answered with an error any more: the connection is cut, so the client sees a body
shorter than its Content-Length or without its last chunk, never a short body that
looks complete (docs/reads.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import HttpVersion11, web

from ..protocol.encodings import compressible, negotiate
from ..protocol.entries import end_of
from ..protocol.jsonmode import json_items
from ..protocol.models import Chunk, Entry, Meta
from ..telemetry import metrics
from . import pipeline
from .compression import Compressor, compressor
from .context import BODY_SENT, Gateway
from .guard import principal_of

log = logging.getLogger("gateway.reads")

# Pages larger than this are made into body bytes (JSON items, State events' offsets,
# compression) in a thread: a page of State events takes ~20 ms per MiB on one core.
_THREAD_BYTES = 64 * 1024


def coding_for(gw: Gateway, request: web.Request, chunk: Chunk) -> tuple[str, bool]:
    """The content coding of a catch-up answer ('' as stored) and whether its
    representation depends on Accept-Encoding (``Vary``)."""
    offered = gw.codings
    if not offered or not compressible(chunk.meta.media_type):
        return "", False
    if chunk.end - chunk.start < gw.settings.compression_min_bytes:
        return "", True
    return negotiate(request.headers.get("Accept-Encoding"), offered), True


class _Body:
    """How an answer's pages become its body: one JSON array (State events given their
    offsets) or the bytes as stored, then the content coding."""

    __slots__ = ("is_json", "opened", "coder")

    def __init__(self, is_json: bool, coding: str) -> None:
        self.is_json = is_json
        self.opened = False  # a JSON answer's "[" is sent
        self.coder: Compressor | None = compressor(coding) if coding else None

    def part(self, entries: list[Entry]) -> bytes:
        if not entries:
            return b""
        if self.is_json:
            data = (b"," if self.opened else b"[") + json_items(entries)
            self.opened = True
        else:
            data = b"".join([d for _, d in entries])
        return self.coder.compress(data) if self.coder is not None else data

    def end(self) -> bytes:
        data = (b"]" if self.opened else b"[]") if self.is_json else b""
        if self.coder is None:
            return data
        return self.coder.compress(data) + self.coder.flush()


async def _encoded(body: _Body, entries: list[Entry]) -> bytes:
    """A page's body bytes: in a thread when that is work (JSON, compression) on a large
    page; bytes as stored are joined on the loop (one copy at most, no thread's arena
    holding freed pages: glibc gives each thread its own)."""
    if (not body.is_json and body.coder is None) or sum(len(d) for _, d in entries) <= _THREAD_BYTES:
        return body.part(entries)
    return await asyncio.to_thread(body.part, entries)


class FirstPage:
    """The read budget a catch-up read holds for its first page: two pages while it is
    read (the Redis client's copy, then the page: see ``_fetch``), one from then until it
    is sent. ``async with FirstPage(gw) as first: ... first.read() ... first.sent()``."""

    __slots__ = ("gw", "held")

    def __init__(self, gw: Gateway) -> None:
        self.gw, self.held = gw, 0

    async def __aenter__(self) -> FirstPage:
        self.held = await _hold(self.gw, 2 * self.gw.store.page_bytes)
        return self

    def read(self) -> None:
        self._keep(min(self.held, self.gw.store.page_bytes))

    def sent(self) -> None:
        self._keep(0)

    def _keep(self, size: int) -> None:
        _give(self.gw, self.held - size)
        self.held = size

    async def __aexit__(self, *exc: object) -> None:
        self.sent()


async def answer(
    request: web.Request, gw: Gateway, chunk: Chunk, headers: dict[str, str], coding: str, first: FirstPage
) -> web.StreamResponse:
    """A catch-up read's answer, its headers made (responses.read_chunk); ``first``: what
    its first page holds of the read budget, given back once it is sent."""
    body = _Body(chunk.meta.is_json, coding)
    if chunk.until is None:
        data = await _encoded(body, chunk.entries)
        return web.Response(status=200, body=data + body.end(), headers=headers)  # (sent by aiohttp)
    return await _stream(request, gw, chunk, headers, body, first)


async def _stream(
    request: web.Request, gw: Gateway, chunk: Chunk, headers: dict[str, str], body: _Body, first: FirstPage
) -> web.StreamResponse:
    assert chunk.until is not None
    response = web.StreamResponse(status=200, headers=headers)
    if not body.is_json and body.coder is None:
        response.content_length = chunk.until - chunk.start  # bytes as stored: known
    elif request.version >= HttpVersion11:
        response.enable_chunked_encoding()  # (HTTP/1.0: the end of the connection ends it)
    # Sent before the handler returns: endpoint() cannot add them (as an event stream's).
    if pipeline.seal(gw, 200, response.headers, request.headers.get("Origin"), principal_of(request)):
        response.force_close()
    await response.prepare(request)
    metrics.READS_STREAMED.inc()
    timeout = gw.settings.write_timeout
    pending: asyncio.Future[tuple[list[Entry], int]] | None = None
    until, meta = chunk.until, chunk.meta
    sent = 0  # (bytes out: the tenants' meter, endpoint.py)
    try:
        at = chunk.page_end
        data = await _encoded(body, chunk.entries)
        chunk.entries.clear()  # the handler's chunk would keep the first page for the whole answer
        sent += await _send(response, data, timeout)
        del data
        first.sent()
        pending = asyncio.ensure_future(_fetch(gw, meta, at, until))
        while pending is not None:
            entries, held = await pending
            try:
                # (none: a compacted stream kept nothing more up to the answer's end)
                at = end_of(*entries[-1], meta.is_json) if entries else until
                # The next page is read while this one is written: two in flight at most.
                pending = asyncio.ensure_future(_fetch(gw, meta, at, until)) if at < until else None
                data = await _encoded(body, entries)
                del entries  # a page is let go once sent, not when the next one is in hand
                sent += await _send(response, data, timeout)
                del data
            finally:
                _give(gw, held)
        sent += await _send(response, body.end(), timeout)
        request[BODY_SENT] = sent
        await response.write_eof()
    except BaseException as exc:
        request[BODY_SENT] = sent  # (what went out before it broke)
        await _drop(pending, gw)
        transport = request.transport
        if transport is not None:
            transport.abort()  # the client sees a broken body, never a short one that looks whole
        metrics.READS_BROKEN.labels(_why(exc)).inc()
        if isinstance(exc, asyncio.CancelledError):
            raise
        if not isinstance(exc, ConnectionError | TimeoutError):
            log.warning("catch-up read of %s broken mid-answer: %r", meta.sid, exc)
    return response


async def _fetch(gw: Gateway, meta: Meta, at: int, until: int) -> tuple[list[Entry], int]:
    """A page from ``at``, held in the read budget (returned with it, to give back). While
    it is read it counts twice: the Redis client holds the reply whole (hiredis' buffer)
    as it builds the page from it."""
    page = gw.store.page_bytes
    held = await _hold(gw, 2 * page)
    try:
        entries = await gw.store.page(meta, at, until)
    except BaseException:
        _give(gw, held)
        raise
    kept = min(held, page)
    _give(gw, held - kept)
    return entries, kept


async def _hold(gw: Gateway, size: int) -> int:
    held = await gw.reads.take(size)
    metrics.READ_BUDGET_HELD.inc(held)
    return held


def _give(gw: Gateway, held: int) -> None:
    gw.reads.give(held)
    metrics.READ_BUDGET_HELD.dec(held)


async def _drop(pending: asyncio.Future[tuple[list[Entry], int]] | None, gw: Gateway) -> None:
    """Stop a page read under way, giving back what it held."""
    if pending is None:
        return
    pending.cancel()
    with contextlib.suppress(BaseException):
        _, held = await pending
        _give(gw, held)


# A page is written in slices, each waiting for the client's socket to take the one
# before: the transport then never holds a copy of more than a slice (what a client
# does not take stays in the page, counted in the budget).
_SLICE = 256 * 1024


async def _send(response: web.StreamResponse, data: bytes, timeout: float) -> int:
    """``data`` written, a slice at a time; returns its length."""
    view = memoryview(data)
    for at in range(0, len(data), _SLICE):
        async with asyncio.timeout(timeout):  # a client that takes nothing for that long is dropped
            await response.write(view[at : at + _SLICE])
    return len(data)


def _why(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError | ConnectionError):
        return "client"
    if isinstance(exc, TimeoutError):
        return "stalled"
    return "server"
