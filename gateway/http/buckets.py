"""Ursula's bucket routes (seed 002, "API overview"): ``PUT/GET/DELETE /{bucket}``,
``GET /{bucket}/streams``, and the whole protocol on ``/{bucket}/{stream}``, which is
the stream ``{bucket}/{stream}`` of ``/v1/stream/`` (protocol/buckets.py: the mapping).

Statuses and JSON as the seed documents them. Where its pages disagree or are silent
(README, "Buckets"): ``PUT /{bucket}`` on an existing bucket is ``200`` (the concept page's
"idempotent"; the API page says 409), ``_default`` cannot be deleted (409
``default_bucket``), and errors carry ``{"error": {"code", "message"}}``.

Access control: a bucket is the path prefix ``{bucket}/`` (``_default``: every path
without a ``/``): creating one needs ``write`` there, reading it ``read``, deleting it
``admin``; its streams are checked as streams.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from ..features.buckets import Buckets
from ..protocol.buckets import (
    DEFAULT_BUCKET,
    LISTING,
    bucket_stream,
    in_bucket,
    path_prefix,
    stream_id_of,
    stream_path,
    validate_bucket,
)
from ..protocol.errors import coded
from ..protocol.listing import Position, encode_cursor, parse_query
from . import snapshots
from .context import gateway_of
from .guard import Guard
from .handlers import options_stream
from .listing import visible_page

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _buckets(request: web.Request) -> Buckets:
    return gateway_of(request).store.buckets


def _name(request: web.Request) -> str:
    return validate_bucket(request.match_info["bucket"])


def _not_found(name: str) -> Exception:
    return coded(404, "bucket_not_found", f"no bucket {name!r}")


async def put_bucket(request: web.Request) -> web.Response:
    name = _name(request)
    await gateway_of(request).guard.admit_path(request, path_prefix(name), "write")
    created = name != DEFAULT_BUCKET and await _buckets(request).create(name)
    return web.json_response({"bucket_id": name}, status=201 if created else 200)


async def get_bucket(request: web.Request) -> web.Response:
    name = _name(request)
    await gateway_of(request).guard.admit_path(request, path_prefix(name), "read")
    buckets = _buckets(request)
    if not await buckets.exists(name):
        raise _not_found(name)
    return web.json_response({"bucket_id": name, "streams": await buckets.count(name)})


async def delete_bucket(request: web.Request) -> web.Response:
    name = _name(request)
    await gateway_of(request).guard.admit_path(request, path_prefix(name), "admin")
    if name == DEFAULT_BUCKET:
        raise coded(409, "default_bucket", "the _default bucket holds the paths without '/': it stays")
    buckets = _buckets(request)
    if not await buckets.empty(name):
        raise coded(409, "bucket_not_empty", f"bucket {name!r} has streams: delete them first")
    if not await buckets.delete(name):
        raise _not_found(name)
    return web.Response(status=204)


async def list_bucket(request: web.Request) -> web.Response:
    """``GET /{bucket}/streams?prefix=&after=&limit=``: the listing (http/listing.py) of
    the bucket's paths, in Ursula's shape (stream ids local to the bucket; on one Redis
    ``after`` and ``next_cursor`` are stream ids, on a cluster opaque)."""
    gw = gateway_of(request)
    name = _name(request)
    listing = gw.store.listing
    parts = listing.parts
    query = parse_query(request.query, parts)
    full = path_prefix(name) + query.prefix
    principal = await gw.guard.admit_listing(request, full)
    if not await gw.store.buckets.exists(name):
        raise _not_found(name)
    start = query.start
    if parts == 1 and start.after is not None:
        start = Position(0, stream_path(name, start.after))
    page = await visible_page(listing, principal, full, start, query.limit, lambda p: in_bucket(name, p))
    cursor = None
    if page.next is not None:
        after = page.next.after
        if parts > 1:
            cursor = encode_cursor(page.next, parts)
        elif after is not None and in_bucket(name, after):
            cursor = stream_id_of(name, after)
        else:  # a walk past the bucket's range (the budget): resume from where it stopped
            cursor = after or ""
    streams = [
        {
            "stream_id": stream_id_of(name, s.path),
            "status": "closed" if s.meta.closed else "open",
            "content_type": s.meta.content_type,
            "tail_offset": s.meta.tail,
            "created_at_ms": int(s.meta.created),
            "last_write_at_ms": s.last_write_ms,
        }
        for s in page.streams
    ]
    body = {
        "bucket_id": name,
        "prefix": query.prefix,
        "stream_count": len(streams),
        "streams": streams,
        "next_cursor": cursor,
        "has_more": page.next is not None,
    }
    return web.json_response(body, headers={"Cache-Control": "no-store"})


async def admit_bucket_stream(guard: Guard, request: web.Request) -> None:
    """A ``/{bucket}/{stream}`` request is the stream ``{bucket}/{stream}``'s: its path is
    put where the stream handlers find it, then it is admitted as theirs. Creating a
    stream needs its bucket to exist (``/v1/stream/`` never asks)."""
    info = request.match_info
    name, info["path"] = bucket_stream(info["bucket"], info["stream"])
    pending = guard.admit_stream(request)
    if pending is not None:
        await pending
    if request.method == "PUT" and not await gateway_of(request).store.buckets.exists(name):
        raise _not_found(name)


def routes(stream: Mapping[str, Handler]) -> list[tuple[str, str, Mapping[str, Any], bool]]:
    """(route name, path, handlers by method, whether it is a stream's route), registered
    after everything else at the root (/healthz, /auth/sign, the streams' prefix)."""
    one, stream_at = "/{bucket}", "/{bucket}/{stream}"
    # OPTIONS: browsers on another origin send a preflight before a request with a token.
    cors = {"OPTIONS": options_stream}
    snapshot_at = {
        "PUT": snapshots.put_snapshot,
        "GET": snapshots.get_snapshot,
        "DELETE": snapshots.delete_snapshot,
        **cors,
    }
    return [
        ("bucket", one, {"PUT": put_bucket, "GET": get_bucket, "DELETE": delete_bucket, **cors}, False),
        ("bucket-streams", f"{one}/{LISTING}", {"GET": list_bucket, **cors}, False),
        ("stream", stream_at, stream, True),
        ("snapshot", f"{stream_at}/snapshot", {"GET": snapshots.latest_snapshot, **cors}, False),
        ("snapshot", f"{stream_at}/snapshot/{{offset}}", snapshot_at, False),
        ("bootstrap", f"{stream_at}/bootstrap", {"GET": snapshots.bootstrap, **cors}, False),
    ]
