"""Live reads: long-poll and SSE, woken by the fan-out, never sleeping through data."""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from . import caching, offsets, responses
from .context import Gateway
from .errors import ProtocolError
from .headers import STREAM_SSE_DATA_ENCODING, is_text
from .sse import comment, control_event, data_event
from .store import Chunk


async def long_poll(
    request: web.Request, gw: Gateway, sid: str, start: int | None, cursor: str
) -> web.Response:
    """Data now if there is any (or the stream is closed), else wait for an append."""
    chunk = await gw.store.read_shared(sid, start)
    if not chunk.entries and not chunk.meta.closed:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + gw.settings.long_poll_timeout
        async with gw.fanout.watch(sid) as watch:
            while True:
                chunk = await gw.store.read_shared(sid, chunk.start)  # after subscribing: nothing slips by
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


async def sse(
    request: web.Request, gw: Gateway, sid: str, start: int | None, cursor: str
) -> web.StreamResponse:
    """An event stream: data events, each followed by a control event.

    Ends when the stream closes (after the final control event), when the
    reconnect cycle is up (clients resume from the last control event), or
    on shutdown.
    """
    chunk = await gw.store.read_shared(sid, start)  # 404 and friends before the stream starts
    text = is_text(chunk.meta.content_type)
    headers = {"Content-Type": "text/event-stream", "Cache-Control": caching.SSE, "X-Accel-Buffering": "no"}
    if not text:
        headers[STREAM_SSE_DATA_ENCODING] = "base64"
    response = web.StreamResponse(status=200, headers=headers)
    await response.prepare(request)
    settings = gw.settings
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.sse_cycle_seconds
    position = chunk.start

    async def send(chunk: Chunk) -> None:
        frames = data_event(chunk.body(), text=text) if chunk.entries else b""
        frames += control_event(
            offsets.encode(chunk.end), cursor=cursor, up_to_date=chunk.up_to_date, closed=chunk.eof
        )
        await response.write(frames)

    try:
        async with gw.fanout.watch(sid) as watch:
            await send(chunk)
            while not chunk.eof:
                position = chunk.end
                if chunk.up_to_date:
                    remaining = deadline - loop.time()
                    if remaining <= 0 or watch.stopping:
                        break
                    if not await watch.wait(min(remaining, settings.sse_heartbeat_seconds)):
                        if watch.stopping or loop.time() >= deadline:
                            break
                        await response.write(comment())
                        continue
                chunk = await gw.store.read_shared(sid, position)
                if chunk.entries or chunk.eof:
                    await send(chunk)
            if not chunk.eof:  # cycle over or shutting down: say where to resume
                await response.write(
                    control_event(
                        offsets.encode(chunk.end), cursor=cursor, up_to_date=chunk.up_to_date, closed=False
                    )
                )
    except ProtocolError:
        pass  # deleted or expired mid-stream: end the event stream
    except (ConnectionResetError, asyncio.CancelledError):
        return response  # the client left
    with contextlib.suppress(ConnectionResetError):
        await response.write_eof()
    return response
