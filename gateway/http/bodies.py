"""Request bodies, read within bounds on size, time and memory.

aiohttp's own decompression is turned off (``auto_decompress=False`` in app.py):
it inflates what arrives before anyone checks the size, so a small gzip bomb
became hundreds of megabytes per request. Here a body is inflated as it
arrives with ``max_length``, so no more than ``--max-body-bytes`` is ever held,
and refused (413) the moment it would pass it.

A transfer coding other than chunked is refused (400): aiohttp would leave it on the bytes.

Bounds, each answered without storing anything:
- size: ``--max-body-bytes``, after decompression (413);
- time: ``--body-timeout`` for the whole body (408; slow senders hold no
  connection forever);
- memory: ``--max-inflight-body-bytes``, body bytes held by this process at
  once, across requests (503 with Retry-After beyond it).
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable

from aiohttp import StreamReader, web

from ..concurrency.ready import ready
from ..protocol.errors import ProtocolError

# Content-Encoding -> zlib window bits (gzip header / zlib header).
_ENCODINGS = {"gzip": 31, "x-gzip": 31, "deflate": 15}


def _too_large(limit: int) -> ProtocolError:
    return ProtocolError(413, f"request body larger than {limit} bytes")


class BodyBudget:
    """Body bytes held by this process's requests, capped."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        # By id(owner): the owner is alive until release(), so ids cannot repeat
        # meanwhile; a plain dict, as the request's own storage costs more per lookup.
        self._by_owner: dict[int, int] = {}

    def take(self, owner: object, size: int) -> None:
        """Count ``size`` more bytes against the budget for ``owner`` (a request, or a
        connection's own append: fastpath.py) until ``release``. A body is always
        admitted while no other request holds any, however large."""
        if size <= 0:
            return
        mine = self._by_owner.get(id(owner), 0)
        if self.held > mine and self.held + size > self.limit:
            raise ProtocolError(503, "too many request bodies in flight, retry", {"Retry-After": "1"})
        self.held += size
        self._by_owner[id(owner)] = mine + size

    def release(self, owner: object) -> None:
        """The request is answered: its bytes are free again."""
        self.held -= self._by_owner.pop(id(owner), 0)


def read_body(
    request: web.Request, *, max_bytes: int, timeout: float, budget: BodyBudget, streamed: bool = False
) -> Awaitable[bytes]:
    """The decoded body, or a 4xx/503 ProtocolError (nothing stored yet by then), to await.
    ``streamed``: read an uncompressed body in a loop bounded by ``max_bytes`` rather than
    by aiohttp's read, whose bound (client_max_size) is --max-body-bytes: for bodies that
    may be larger (snapshots).

    Not a coroutine itself: an append's body (small, uncompressed, in with its headers) is
    aiohttp's own read, awaited by the caller, not three coroutines deep (each ~0.4 µs).
    Refusals found from the headers alone are raised at the call."""
    codings = request.headers.get("Transfer-Encoding")
    if codings is not None and any(c.strip().lower() not in ("chunked", "") for c in codings.split(",")):
        # aiohttp's parser takes the chunked framing off and leaves any other coding (gzip,
        # ...) on the bytes, which would be stored as they came. Empty list elements are
        # nothing (RFC 9110, 5.6.1). 400 where RFC 9112 (6.1) suggests 501: bad input is 4xx
        # here, a 5xx reads as the server's own fault.
        raise ProtocolError(400, f"Transfer-Encoding {codings[:40]!r} is not supported (chunked only)")
    encoding = request.headers.get("Content-Encoding")
    encoding = encoding.strip().lower() if encoding else ""
    if encoding in ("", "identity"):
        declared = request.content_length
        if declared is not None and declared > max_bytes:
            raise _too_large(max_bytes)
        if streamed:
            return _read_streamed(request, declared, max_bytes, timeout, budget)
        return _read_plain(request, declared, max_bytes, timeout, budget)
    if encoding not in _ENCODINGS:
        raise ProtocolError(415, f"Content-Encoding {encoding[:40]!r} is not supported (gzip, deflate)")
    return _read_inflated(request, encoding, max_bytes, timeout, budget)


async def _read_inflated(
    request: web.Request, encoding: str, max_bytes: int, timeout: float, budget: BodyBudget
) -> bytes:
    """A compressed body, inflated as it arrives, never to more than ``max_bytes``."""
    inflater = zlib.decompressobj(wbits=_ENCODINGS[encoding])
    declared = request.content_length
    # What arrives compressed is bounded too: compression adds a little to data that
    # does not compress, never more than this.
    max_raw = max_bytes + max_bytes // 64 + 1024
    if declared is not None and declared > max_raw:
        raise _too_large(max_bytes)
    content = request.content
    parts: list[bytes] = []
    size = raw = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in content.iter_any():
                raw += len(chunk)
                if raw > max_raw:
                    raise _too_large(max_bytes)
                try:
                    chunk = inflater.decompress(chunk, max_bytes + 1 - size)
                except zlib.error:
                    raise ProtocolError(400, f"body is not valid {encoding}") from None
                if inflater.unconsumed_tail:  # more output than the limit allows
                    raise _too_large(max_bytes)
                if inflater.unused_data:  # zlib would keep collecting whatever follows
                    raise ProtocolError(400, f"trailing data after the {encoding} body")
                size += len(chunk)
                if size > max_bytes:
                    raise _too_large(max_bytes)
                budget.take(request, len(chunk))
                parts.append(chunk)
    except TimeoutError:
        raise ProtocolError(408, f"request body not received within {timeout:g} s") from None
    except ConnectionError:
        raise _gone() from None
    if not inflater.eof:
        raise ProtocolError(400, f"body is truncated {encoding}")
    return b"".join(parts)


async def _read_streamed(
    request: web.Request, declared: int | None, max_bytes: int, timeout: float, budget: BodyBudget
) -> bytes:
    """An uncompressed body read a chunk at a time, never more than ``max_bytes``."""
    if declared:
        budget.take(request, declared)
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.content.iter_chunked(1 << 20):
                size += len(chunk)
                if size > max_bytes:
                    raise _too_large(max_bytes)
                parts.append(chunk)
    except TimeoutError:
        raise ProtocolError(408, f"request body not received within {timeout:g} s") from None
    except ConnectionError:
        raise _gone() from None
    if declared is None:
        budget.take(request, size)
    return b"".join(parts)


def _read_plain(
    request: web.Request, declared: int | None, max_bytes: int, timeout: float, budget: BodyBudget
) -> Awaitable[bytes]:
    """An uncompressed body: its declared length is reserved before a byte is read,
    then aiohttp's own read collects it (its client_max_size is --max-body-bytes).
    A streamed loop here cost 64 KiB appends a fifth of their rate; this costs nothing
    measurable. A chunked body (no length) is counted once it is in."""
    if declared:
        budget.take(request, declared)
    content = request.content
    if declared is not None and content.is_eof():
        # All of it is here already (small bodies come with their headers): taken as the
        # parser handed it over (joined only if it came in pieces), not through aiohttp's
        # read, which is a coroutine and copies it twice (into a bytearray, then out).
        return ready(content.read_nowait())
    return _read_arriving(request, declared, max_bytes, timeout, budget)


async def _read_arriving(
    request: web.Request, declared: int | None, max_bytes: int, timeout: float, budget: BodyBudget
) -> bytes:
    """The rest of ``_read_plain``: a body still arriving, within ``timeout``."""
    reading = request.read() if declared is None else _collect(request.content, declared)
    if request.content.is_eof():
        body = await reading
    else:
        try:
            async with asyncio.timeout(timeout):
                body = await reading
        except TimeoutError:
            raise ProtocolError(408, f"request body not received within {timeout:g} s") from None
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(max_bytes) from None
        except ConnectionError:
            raise _gone() from None
    if declared is None:
        budget.take(request, len(body))
    return body


async def _collect(content: StreamReader, declared: int) -> bytes:
    """A body of a declared length, read: its pieces as the parser handed them over, joined
    once. aiohttp's read copies a large body three times (joining what is buffered, into a
    bytearray, out of it), each copy in fresh memory the kernel must hand over and zero:
    ~1.5 ms of gateway CPU per MiB, more than the rest of a large append's path."""
    content.set_read_chunk_size(declared)  # no pauses while it comes in (as read() does)
    chunks: list[bytes] = []
    while chunk := (await content.readchunk())[0]:
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _gone() -> ProtocolError:
    """The client went away mid-body: nobody reads the answer."""
    return ProtocolError(400, "the client closed the connection before the body ended")
