"""The command-line client's writing commands: ``append``, ``create``, ``fork``, ``close``
and ``rm``."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any
from urllib.parse import urlsplit

from .client_http import OK, UNAVAILABLE, USAGE, Failure, Reply, stream_url
from .client_output import is_json_type, print_json
from .client_session import connect

DEFAULT_CONTENT_TYPE = "application/octet-stream"  # what the protocol (and this server) default to
PRODUCER_RETRIES = 3  # a producer's append is deduplicated by the server: resending it is safe


def _body(data: list[str], content_type: str | None) -> bytes:
    """DATA arguments, else stdin. Arguments are joined by newlines (none added at the end);
    on a JSON stream each argument is one message (sent as one array)."""
    if not data:
        return sys.stdin.buffer.read()
    if is_json_type(content_type) and len(data) > 1:
        return ("[" + ",".join(data) + "]").encode()
    return "\n".join(data).encode()


def _producer_headers(args: argparse.Namespace) -> dict[str, str]:
    if args.producer_id is None:
        if args.epoch is not None or args.seq is not None:
            raise Failure(USAGE, "--epoch and --seq need --producer-id")
        return {}
    return {
        "Producer-Id": args.producer_id,
        "Producer-Epoch": str(args.epoch or 0),
        "Producer-Seq": str(args.seq or 0),
    }


async def append(args: argparse.Namespace) -> int:
    producer = _producer_headers(args)
    async with connect(args) as client:
        url = stream_url(args.url, args.stream)
        content_type = args.content_type or (await client.head(url)).headers.get("Content-Type")
        body = _body(args.data, content_type)
        headers = dict(producer)
        if body:
            headers["Content-Type"] = content_type or DEFAULT_CONTENT_TYPE
        if args.close:
            headers["Stream-Closed"] = "true"
        attempts = 1 + (PRODUCER_RETRIES if producer else 0)
        for attempt in range(attempts):
            try:
                reply = await client.call("POST", url, headers=headers, data=body)
                break
            except Failure as exc:
                if exc.code != UNAVAILABLE or attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.2 * 2**attempt)  # same producer seq: a duplicate is dropped
    result = {
        "url": url,
        "next_offset": reply.headers.get("Stream-Next-Offset"),
        "closed": reply.headers.get("Stream-Closed", "").lower() == "true",
    }
    if producer:  # 204 to a producer's append: this batch was appended before (a retry)
        result["duplicate"] = reply.status == 204
        result["producer_epoch"] = reply.headers.get("Producer-Epoch")
        result["producer_seq"] = reply.headers.get("Producer-Seq")
    if args.json:
        print_json(result)
    else:
        note = " (duplicate: appended before)" if result.get("duplicate") else ""
        print(f"{result['next_offset']}{note}")
    return OK


def _lifetime_headers(args: argparse.Namespace) -> dict[str, str]:
    headers = {}
    if args.ttl is not None:
        headers["Stream-TTL"] = str(args.ttl)
    if args.expires_at is not None:
        headers["Stream-Expires-At"] = args.expires_at
    return headers


def _created(args: argparse.Namespace, url: str, reply: Reply, extra: dict[str, Any]) -> int:
    result = {
        "url": url,
        "created": reply.status == 201,  # 200: it existed already, with this configuration
        "content_type": reply.headers.get("Content-Type"),
        "next_offset": reply.headers.get("Stream-Next-Offset"),
        "closed": reply.headers.get("Stream-Closed", "").lower() == "true",
        **extra,
    }
    if args.json:
        print_json(result)
    else:
        what = "created" if result["created"] else "exists"
        print(f"{what} {url} ({result['content_type']}, next offset {result['next_offset']})")
    return OK


async def create(args: argparse.Namespace) -> int:
    content_type = args.content_type or DEFAULT_CONTENT_TYPE
    headers = {"Content-Type": content_type, **_lifetime_headers(args)}
    if args.closed:
        headers["Stream-Closed"] = "true"
    body = _body(args.data, content_type) if args.data else b""  # never waits on stdin
    async with connect(args) as client:
        url = stream_url(args.url, args.stream)
        reply = await client.call("PUT", url, headers=headers, data=body, ok=(200, 201))
    return _created(args, url, reply, {})


async def fork(args: argparse.Namespace) -> int:
    headers = _lifetime_headers(args)
    if args.offset is not None:
        headers["Stream-Fork-Offset"] = args.offset
    if args.content_type:
        headers["Content-Type"] = args.content_type
    async with connect(args) as client:
        url = stream_url(args.url, args.stream)
        source = stream_url(args.url, args.source)
        headers["Stream-Forked-From"] = urlsplit(source).path
        reply = await client.call("PUT", url, headers=headers, data=b"", ok=(200, 201))
    return _created(args, url, reply, {"forked_from": source, "fork_offset": args.offset})


async def close(args: argparse.Namespace) -> int:
    async with connect(args) as client:
        url = stream_url(args.url, args.stream)
        reply = await client.call("POST", url, headers={"Stream-Closed": "true"}, data=b"")
    offset = reply.headers.get("Stream-Next-Offset")
    if args.json:
        print_json({"url": url, "closed": True, "next_offset": offset})
    else:
        print(f"closed {url} at {offset}")
    return OK


async def rm(args: argparse.Namespace) -> int:
    async with connect(args) as client:
        url = stream_url(args.url, args.stream)
        await client.call("DELETE", url, ok=(200, 202, 204))
    if args.json:
        print_json({"url": url, "deleted": True})
    else:
        print(f"deleted {url}")
    return OK
