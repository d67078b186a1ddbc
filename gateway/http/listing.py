"""``GET {prefix}/__ds/streams``: the streams that exist, by path prefix, a page at a
time (protocol/listing.py: query and cursor; features/listing.py: the index); and
``GET {prefix}/__ds/streams/{path}``: one of them, with its producers' state (shown to
credentials that may write the stream).

Under the protocol's reserved namespace (``__ds/``, where the subscription APIs live):
no stream can be named there, so the route never shadows one, and it sits beside the
other control APIs under the same prefix (and proxy rules). The answer follows the
shape of Ursula's bucket listing (``streams``, ``next_cursor``, ``has_more``; fields
in ``_item``).

Access control: a credential lists only streams it may read (its grants narrow the
prefixes read; each path is checked; a signed URL lists its one stream). A request
without credentials that may read nothing there gets 401.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from ..features.listing import MAX_PRODUCERS, Listed, Listing, Page
from ..protocol import offsets
from ..protocol.access import Principal
from ..protocol.errors import ProtocolError
from ..protocol.listing import Position, check_listable, encode_cursor, parse_query, readable_prefixes
from ..protocol.models import Meta
from ..protocol.namespace import RESERVED
from ..redis_io import keys
from .context import gateway_of
from .guard import principal_of
from .handlers import options_stream, stream_name


async def list_streams(request: web.Request) -> web.Response:
    gw = gateway_of(request)
    parts = gw.store.listing.parts
    query = parse_query(request.query, parts)
    principal = await gw.guard.admit_listing(request, query.prefix)
    page = await visible_page(gw.store.listing, principal, query.prefix, query.start, query.limit)
    body = {
        "prefix": query.prefix,
        "streams": [_item(listed) for listed in page.streams],
        "next_cursor": None if page.next is None else encode_cursor(page.next, parts),
        "has_more": page.next is not None,
    }
    return web.json_response(body, headers={"Cache-Control": "no-store"})


async def visible_page(
    listing: Listing,
    principal: Principal,
    prefix: str,
    start: Position,
    limit: int,
    within: Callable[[str], bool] = lambda _: True,
) -> Page:
    """The page of paths under ``prefix`` (and ``within``) that ``principal`` may read:
    its grants narrow the ranges read and each path is checked; a signed URL's one stream
    is looked up exactly; 401 without credentials that may read anything there. Shared
    by this listing and a bucket's (http/buckets.py)."""
    only = principal.only_path
    if only is not None:  # a signed URL: its one stream, looked up exactly
        if start.after is not None or not only.startswith(prefix) or not within(only):
            return Page([], None)
        if not principal.allows("read", only):
            return Page([], None)
        listed = await listing.one(keys.stream_id(only), producers=0)
        return Page([] if listed is None else [listed], None)
    prefixes = readable_prefixes(principal, prefix)
    check_listable(principal, prefixes)
    return await listing.page(prefixes, start, limit, lambda p: within(p) and principal.allows("read", p))


async def one_stream(request: web.Request) -> web.Response:
    """``GET {prefix}/__ds/streams/{path}``: one stream as the listing shows it, with its
    idempotent producers' state (id, epoch, last sequence number accepted; at most 1,000,
    ``producer_count`` says how many there are). Needs read access to the stream."""
    gw = gateway_of(request)
    path = stream_name(request.match_info["path"], gw.settings.max_path_bytes)
    await gw.guard.admit_path(request, path, "read")
    # Producer ids and sequence numbers are the writers' business: shown to those who may write.
    writer = principal_of(request).allows("write", path)
    listed = await gw.store.listing.one(keys.stream_id(path), producers=MAX_PRODUCERS if writer else 0)
    if listed is None:
        raise ProtocolError(404, "stream not found")
    item = _item(listed)
    item["producer_count"] = listed.producer_count if writer else None
    item["producers"] = (
        [{"id": p.id, "epoch": p.epoch, "seq": p.seq} for p in listed.producers] if writer else None
    )
    return web.json_response(item, headers={"Cache-Control": "no-store"})


def _item(listed: Listed) -> dict[str, Any]:
    meta = listed.meta
    return {
        "path": listed.path,
        "status": "closed" if meta.closed else "open",
        "content_type": meta.content_type,
        "tail_offset": offsets.encode(meta.tail),
        "bytes": meta.tail,  # what a read from the start covers (a fork's inherited bytes too)
        "created_at_ms": int(meta.created),
        "last_write_at_ms": listed.last_write_ms,
        "expires_at_ms": listed.expires_at_ms,
        "ttl_seconds": meta.ttl,
        "forked_from": keys.path_of(meta.source) if meta.source else None,
        "compaction": _compaction(meta),
    }


def _compaction(meta: Meta) -> dict[str, Any] | None:
    """A compacted stream's compaction so far (docs/compaction.md), None for others."""
    if not meta.compaction:
        return None
    done = meta.compacted
    own = meta.tail - meta.base  # its own bytes (not a fork's inherited ones)
    return {
        "mode": meta.compaction,
        "compacted_to_offset": offsets.encode(max(done.upto, meta.base)),
        "dropped_bytes": done.dropped,
        "dropped_messages": done.dropped_messages,
        # bytes written / bytes kept: 1.0 before the first run
        "ratio": round(own / max(1, own - done.dropped), 2) if own else 1.0,
        "last_run_at_ms": done.last_run_ms or None,
        "lag_bytes": meta.tail - max(done.upto, meta.base),  # not folded yet
    }


def routes(prefix: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(route name, path, handlers by method), routed before the streams' route."""
    base = f"{prefix.rstrip('/')}/{RESERVED}/streams"
    # OPTIONS: browsers on another origin send a preflight before a request with a token.
    return [
        ("list", base, {"GET": list_streams, "OPTIONS": options_stream}),
        ("list", f"{base}/{{path:.+}}", {"GET": one_stream, "OPTIONS": options_stream}),
    ]
