"""The command-line client's reading commands: ``ls``, ``info``, ``cat`` and ``tail``."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp

from .client_http import OK, UNAVAILABLE, USAGE, Failure, Reply, http_failure, stream_url
from .client_output import JSON_TYPE, Progress, emit, is_json_type, json_lines, offset_position, print_json
from .client_session import LISTING, connect

RECONNECT_MAX_SECONDS = 5.0  # longest pause between tail's reconnection attempts


async def ls(args: argparse.Namespace) -> int:
    """The streams under PREFIX, page after page (``next_cursor``) until ``--limit``."""
    listed, after = 0, ""
    async with connect(args) as client:
        url = stream_url(args.url, LISTING)
        while args.limit is None or listed < args.limit:
            size = 1000 if args.limit is None else min(1000, args.limit - listed)
            params = {"prefix": args.prefix, "limit": str(size), **({"after": after} if after else {})}
            page = json.loads((await client.call("GET", url, params=params, ok=(200,))).body)
            for item in page["streams"][:size]:
                listed += 1
                if args.json:
                    print_json(item)
                elif args.long:
                    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(item["created_at_ms"] / 1000))
                    print(
                        f"{item['status']:<7}{item['bytes']:>12} {created}  "
                        f"{item['content_type']:<26} {item['path']}"
                    )
                else:
                    print(item["path"])
            after = page.get("next_cursor") or ""
            if not page.get("has_more") or not after:
                break
    return OK


async def info(args: argparse.Namespace) -> int:
    async with connect(args) as client:
        url = stream_url(args.url, args.stream)
        h = (await client.head(url)).headers
    found = {
        "url": url,
        "content_type": h.get("Content-Type"),
        "next_offset": h.get("Stream-Next-Offset"),
        "closed": h.get("Stream-Closed", "").lower() == "true",
        "ttl": int(h["Stream-TTL"]) if h.get("Stream-TTL", "").isdigit() else None,
        "expires_at": h.get("Stream-Expires-At"),
        "forked_from": h.get("Stream-Forked-From"),  # when the server says (the protocol does not require it)
        "fork_offset": h.get("Stream-Fork-Offset"),
        "compaction": h.get("Stream-Compaction"),  # ours (docs/compaction.md)
    }
    if found["compaction"] and not args.stream.startswith(("http://", "https://")):
        async with connect(args) as client:  # how far it went: this server's listing says
            detail = await client.call(
                "GET", stream_url(stream_url(args.url, LISTING), args.stream), ok=(200, 401, 403, 404)
            )
        state = json.loads(detail.body).get("compaction") if detail.status == 200 else None
        if state:
            found["compacted_to"] = state["compacted_to_offset"]
            found["compaction_ratio"] = state["ratio"]
            found["dropped"] = f"{state['dropped_messages']} messages, {state['dropped_bytes']} bytes"
            found["last_compacted"] = (
                time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state["last_run_at_ms"] / 1000))
                if state["last_run_at_ms"]
                else None
            )
            found["not_folded"] = f"{state['lag_bytes']} bytes (the compaction lag, and what waits)"
    if args.json:
        print_json(found)
        return OK
    width = max(14, *(len(name) + 2 for name in found))
    for name, value in found.items():
        if value is None:
            value = "-"
        elif isinstance(value, bool):
            value = "yes" if value else "no"
        elif name == "ttl":
            value = f"{value} s (sliding: reset by every read and write)"
        print(f"{name.replace('_', '-') + ':':<{width}}{value}")
    return OK


async def cat(args: argparse.Namespace) -> int:
    async with connect(args) as client:
        url = stream_url(args.url, args.stream)
        head = (await client.head(url)).headers  # the content type, and the tail for the bar
        is_json = is_json_type(head.get("Content-Type"))
        if args.json_lines and not is_json:
            raise Failure(USAGE, f"--json-lines: {url} is {head.get('Content-Type')}, not {JSON_TYPE}")
        offset = args.offset
        progress = Progress(
            offset_position(offset) if offset != "-1" else 0, offset_position(head.get("Stream-Next-Offset"))
        )
        first = True
        if is_json and not args.json_lines:
            emit(b"[")  # the chunks' arrays joined into one
        try:
            while True:
                reply = await client.call("GET", url, params={"offset": offset}, ok=(200,))
                body = reply.body
                if args.json_lines:
                    emit(json_lines(body))
                elif is_json:
                    inner = body.strip()[1:-1]
                    if inner.strip():
                        emit((b"" if first else b",") + inner)
                        first = False
                else:
                    emit(body)
                offset = reply.headers.get("Stream-Next-Offset", offset)
                progress.show(offset_position(offset))
                if reply.headers.get("Stream-Up-To-Date", "").lower() == "true":
                    break
                if reply.headers.get("Stream-Closed", "").lower() == "true" or not body:
                    break  # EOF; an empty body without up-to-date would loop forever
        finally:
            progress.end()
        if is_json and not args.json_lines:
            emit(b"]")
    return OK


@dataclass
class _Event:
    kind: str = "message"
    data: list[str] | None = None


async def _sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, str]]:
    """(event, data) pairs of an SSE body. Lines are split here, not by aiohttp's readline,
    whose line limit a large data event (a base64 chunk) would exceed."""
    buffer, event = b"", _Event()
    async for piece in response.content.iter_any():
        buffer += piece
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8", "replace")
            if not line:
                if event.data is not None:
                    yield event.kind, "\n".join(event.data)
                event = _Event()
            elif line.startswith(":"):
                continue  # a heartbeat comment
            else:
                field, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if field == "event":
                    event.kind = value
                elif field == "data":
                    event.data = (event.data or []) + [value]


async def tail(args: argparse.Namespace) -> int:
    offset, cursor = args.offset, None
    async with connect(args, live=True) as client:
        url = stream_url(args.url, args.stream)
        head = (await client.head(url)).headers
        is_json = is_json_type(head.get("Content-Type"))
        failing_since: float | None = None
        pause = 0.2
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        while True:
            # Ctrl-C cancels this task (asyncio.run): a cancellation some library swallowed,
            # ending a response early or raised as a connection error, must not become a
            # reconnect, or tail never exits.
            if task.cancelling():
                raise asyncio.CancelledError
            params = {"offset": offset, "live": "sse", **({"cursor": cursor} if cursor else {})}
            try:
                async with client.session.get(
                    url, params=params, headers={"Accept": "text/event-stream"}
                ) as r:
                    if r.status != 200:
                        reply = Reply(r.status, r.headers, await r.read(), r.reason or "")
                        if r.status not in (502, 503, 504):
                            raise http_failure(reply, url)
                        raise aiohttp.ClientResponseError(r.request_info, (), status=r.status)
                    failing_since, pause = None, 0.2
                    binary = r.headers.get("Stream-SSE-Data-Encoding", "").lower() == "base64"
                    async for kind, data in _sse_events(r):
                        if kind == "data":
                            payload = (
                                base64.b64decode(data.replace("\n", "").replace("\r", ""))
                                if binary
                                else data.encode()
                            )
                            emit(json_lines(payload) if is_json else payload)
                        elif kind == "control":
                            control = json.loads(data)
                            offset = control.get("streamNextOffset", offset)
                            cursor = control.get("streamCursor", cursor)
                            if control.get("streamClosed"):
                                return OK  # EOF: the protocol forbids reconnecting
            except (aiohttp.ClientError, TimeoutError) as exc:
                # A dropped connection or a server restarting: resume from the last offset,
                # until it has failed for longer than --timeout.
                now = loop.time()
                failing_since = now if failing_since is None else failing_since
                if now - failing_since > args.timeout:
                    raise Failure(
                        UNAVAILABLE,
                        f"lost the stream for over {args.timeout:g} s: {exc or type(exc).__name__} ({url})",
                    ) from None
                await asyncio.sleep(pause)
                pause = min(pause * 2, RECONNECT_MAX_SECONDS)
            # The server ended the response (its cycle, for CDN collapsing): reconnect at once.
