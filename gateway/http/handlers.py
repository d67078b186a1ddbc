"""HTTP handlers: validate the request (protocol/), call the Store (streams/), shape the response."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import time
from collections.abc import Awaitable
from typing import NamedTuple
from urllib.parse import quote, unquote, urlencode

import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from ..concurrency.ready import ready
from ..protocol import access, caching, compaction, conditions, cursor, offsets, responses
from ..protocol.conditions import IfMatch
from ..protocol.entries import LogEntry, message_count, stored_bytes
from ..protocol.errors import ProtocolError, bad_request
from ..protocol.headers import (
    DEFAULT_CONTENT_TYPE,
    IF_MATCH,
    JSON_CONTENT_TYPE,
    STREAM_CLOSED,
    STREAM_COMPACTION,
    STREAM_EXPECTED_OFFSET,
    STREAM_FORK_OFFSET,
    STREAM_FORK_SUB_OFFSET,
    STREAM_FORKED_FROM,
    Producer,
    is_true,
    normalize_content_type,
    parse_decimal,
    parse_expiry,
    parse_producer,
    parse_stream_seq,
    validate_content_type,
)
from ..protocol.jsonmode import body_entries
from ..protocol.models import CreateSpec
from ..protocol.namespace import RESERVED
from ..redis_io import keys
from ..telemetry import metrics
from . import catchup, live
from .bodies import read_body
from .context import Gateway, gateway_of
from .guard import principal_of

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def stream_name(path: str, max_length: int) -> str:
    """Validate a stream path (the URL part after the prefix)."""
    if not path or path.strip("/") == "":
        raise ProtocolError(404, "no stream named")
    try:
        size = len(path.encode())
    except UnicodeEncodeError:  # undecodable bytes arrive as lone surrogates
        raise bad_request("stream path is not valid UTF-8") from None
    if size > max_length:
        raise bad_request(f"stream path longer than {max_length} bytes")
    if _CONTROL.search(path):
        raise bad_request("stream path contains control characters")
    if any(segment in (".", "..") for segment in path.split("/")):
        # Clients and proxies resolve dot segments: such a name would address another stream.
        raise bad_request("stream path has a '.' or '..' segment")
    if path.split("/", 1)[0] == RESERVED:
        raise ProtocolError(404, "reserved path")
    return path


def _sid(request: web.Request, gw: Gateway | None = None) -> str:
    """The request's stream id (``gw``: the request's Gateway, when the caller has it)."""
    settings = (gw or gateway_of(request)).settings
    return valid_stream_id(request.match_info["path"], settings.max_path_bytes)


@functools.lru_cache(maxsize=4096)
def valid_stream_id(path: str, max_length: int) -> str:
    """A valid stream path's id, remembered for the streams in use: validating a path
    (encoding, a regex, two splits) cost every request ~1.5 µs. A bad path raises, and
    exceptions are not cached: it is refused the same way every time."""
    return keys.stream_id(stream_name(path, max_length))


def _path_on_server(request: web.Request, value: str, what: str) -> str:
    """A stream path given in a header or body (Stream-Forked-From, /auth/sign): a
    path on this server, with or without the prefix."""
    settings = gateway_of(request).settings
    path = unquote(value.strip())
    prefix = settings.prefix.rstrip("/") + "/"
    if path.startswith(prefix):
        path = path[len(prefix) :]
    elif path.startswith("/"):
        raise ProtocolError(404, f"{what} is not a stream on this server")
    return stream_name(path, settings.max_path_bytes)


def _body(request: web.Request, gw: Gateway | None = None) -> Awaitable[bytes]:
    """The request's body, to await (not a coroutine of its own: see ``read_body``)."""
    gw = gw or gateway_of(request)
    s = gw.settings
    return read_body(request, max_bytes=s.max_body_bytes, timeout=s.body_timeout, budget=gw.bodies)


# JSON bodies larger than this are parsed in a thread: packing millions of messages takes
# a fraction of a second, and the thread gives the event loop its turn meanwhile. What is
# parsed on the loop stays within a few ms whatever its shape (16 KiB of `1,1,1,…`: ~8,000
# messages; 256 KiB held the loop 80-90 ms, tests/test_front_door.py).
_PARSE_INLINE_BYTES = 16 * 1024


def _entries(
    gw: Gateway, owner: object, media: str, body: bytes, *, create: bool
) -> Awaitable[list[LogEntry]]:
    """The log entries a body becomes, to await: bounded ones, however many messages it
    holds (protocol/entries.py). --max-json-messages, when set, refuses larger arrays
    whole. Parsed now (a refusal raised at the call), but a large JSON body in a thread.
    ``owner``: whose bodies budget the parsed copy counts against (the request)."""
    if not _parsed_inline(media, body):
        return _entries_in_thread(gw, owner, media, body, create)
    return ready(_entries_now(gw, owner, media, body, create))


def _parsed_inline(media: str, body: bytes) -> bool:
    return media != JSON_CONTENT_TYPE or len(body) <= _PARSE_INLINE_BYTES


def _entries_now(gw: Gateway, owner: object, media: str, body: bytes, create: bool) -> list[LogEntry]:
    return _counted(gw, owner, media, body_entries(media, body, create=create))


async def _entries_in_thread(
    gw: Gateway, owner: object, media: str, body: bytes, create: bool
) -> list[LogEntry]:
    entries = await asyncio.to_thread(body_entries, media, body, create=create)
    return _counted(gw, owner, media, entries)


def _counted(gw: Gateway, owner: object, media: str, entries: list[LogEntry]) -> list[LogEntry]:
    """A JSON body's entries: a second copy beside the body, counted as such, and bounded."""
    if media == JSON_CONTENT_TYPE:
        gw.bodies.take(owner, stored_bytes(entries))
        limit = gw.settings.max_json_messages
        if limit and message_count(entries) > limit:
            raise ProtocolError(413, f"more than {limit} JSON messages in one request")
    return entries


# RFC 9110 Host: a name or IPv4 address, or an [IPv6] literal, then an optional port.
_HOST = re.compile(r"\A(?:[A-Za-z0-9._~-]+|\[[0-9A-Fa-f:.]+\])(?::([0-9]{1,5}))?\Z")


def public_url(request: web.Request, path: str | None = None) -> str:
    """A stream's URL (the request's, or ``path``'s): from --public-url when set, so no
    client-chosen Host header ever reaches a Location; else from the Host header,
    checked before anything is stored (``example.com:99999``, ``[::1`` are bad requests)."""
    settings = gateway_of(request).settings
    raw = request.raw_path.split("?", 1)[0]
    if path is not None:
        raw = settings.prefix.rstrip("/") + "/" + quote(path)
    if settings.public_url:
        return settings.public_url.rstrip("/") + raw
    match = _HOST.match(request.host)
    if match is None or (match.group(1) and int(match.group(1)) > 65535):
        raise bad_request("the Host header is not a valid host[:port]")
    try:
        return str(request.url.with_path(raw, encoded=True).with_query(None))
    except ValueError:
        raise bad_request("the Host header does not make a valid URL") from None


async def put_stream(request: web.Request) -> web.Response:
    gw = gateway_of(request)
    sid = _sid(request)
    location = public_url(request)
    h = request.headers
    if_match = conditions.parse_if_match(h.getall(IF_MATCH, None), sid)
    expiry = parse_expiry(h)
    fork_from, fork_offset, sub = (
        h.get(n) for n in (STREAM_FORKED_FROM, STREAM_FORK_OFFSET, STREAM_FORK_SUB_OFFSET)
    )
    if fork_from is None and (fork_offset is not None or sub is not None):
        raise bad_request("Stream-Fork-Offset and Stream-Fork-Sub-Offset need Stream-Forked-From")
    sub_offset = 0 if sub is None else parse_decimal(sub.strip(), STREAM_FORK_SUB_OFFSET)
    if sub_offset and fork_offset is None:
        raise bad_request("Stream-Fork-Sub-Offset needs Stream-Fork-Offset")
    if fork_offset is not None:
        fork_offset = fork_offset.strip()
        offsets.decode(fork_offset)
    tenant = gw.guard.tenant(principal_of(request), keys.path_of(sid))  # (403 before the body is read)
    raw_type = h.get("Content-Type")
    content_type = raw_type.strip() if raw_type and raw_type.strip() else None
    if content_type is not None:
        validate_content_type(content_type)
    body = await _body(request)
    source, pin_source = None, True
    if fork_from is not None:
        source_path = _path_on_server(request, fork_from, "fork source")
        source = keys.stream_id(source_path)
        # Forking reads the source. A fork holds its source's path (410, re-create 409)
        # after the source is deleted only if its creator could write that path itself.
        principal = principal_of(request)
        access.check(principal, "read", source_path)
        pin_source = principal.allows("write", source_path)
    if source == sid:
        raise bad_request("a stream cannot fork itself")
    media = normalize_content_type(content_type) or DEFAULT_CONTENT_TYPE
    if body and source is not None and content_type is None:
        # A fork's body is framed by the content type it inherits (looked up only when needed).
        media = (await gw.store.head(source)).media_type
    entries = await _entries(gw, request, media, body, create=True)
    spec = CreateSpec(
        content_type=content_type,
        expiry=expiry,
        closed=is_true(h.get(STREAM_CLOSED)),
        entries=tuple(entries),
        fork_from=source,
        fork_offset=fork_offset,
        fork_sub_offset=sub_offset,
        pin_source=pin_source,
        # Checked by create.lua: a missing stream matches nothing (RFC 9110 13.1.1), so such
        # a PUT never creates one; a soft-deleted one answers as without it (409).
        if_match=if_match.script_arg() if if_match is not None else "",
        compaction=compaction.asked(h.get(STREAM_COMPACTION)),
        tenant=tenant,
    )
    created, meta = await gw.store.create(sid, spec)
    headers = responses.stream_state(meta)
    if created:
        headers["Location"] = location
    return web.Response(status=201 if created else 200, headers=headers)


class AppendAsked(NamedTuple):
    """What a POST's headers ask of its append, beside the body."""

    close: bool
    producer: Producer | None
    stream_seq: str | None
    if_match: IfMatch | None
    expected_offset: int | None


def append_asked(h: CIMultiDictProxy[str] | CIMultiDict[str], sid: str) -> AppendAsked:
    """A POST's headers, checked before its body is read (a bad one: 400, nothing read)."""
    return AppendAsked(
        is_true(h.get(STREAM_CLOSED)),
        parse_producer(h),
        parse_stream_seq(h),
        conditions.parse_if_match(h.getall(IF_MATCH, None), sid),
        conditions.parse_expected_offset(h.get(STREAM_EXPECTED_OFFSET)),
    )


async def append_body(
    gw: Gateway,
    owner: object,
    sid: str,
    asked: AppendAsked,
    raw_type: str | None,
    body: bytes,
    tenant: str = "",
) -> tuple[int, dict[str, str]]:
    """A POST's append, its body in hand: the status and headers of its answer. Shared by
    the POST handler and the connection's own append path (fastpath.py); ``owner``: whose
    bodies budget a JSON body's parsed copy counts against; ``tenant``: whose quotas it
    counts against ('' none)."""
    entries: list[LogEntry] = []
    media = ""
    if body:
        if not raw_type or not raw_type.strip():
            raise bad_request("Content-Type is required with a body")
        media = validate_content_type(raw_type)
        if _parsed_inline(media, body):  # (as _entries does, without a future: every append comes here)
            entries = _entries_now(gw, owner, media, body, False)
        else:
            entries = await _entries_in_thread(gw, owner, media, body, False)
    elif not asked.close:
        raise bad_request("empty body: send data, or Stream-Closed: true to close")
    result = await gw.store.append(
        sid,
        media,
        entries,
        close=asked.close,
        stream_seq=asked.stream_seq,
        producer=asked.producer,
        if_match=asked.if_match,
        expected_offset=asked.expected_offset,
        tenant=tenant,
    )
    # New data from an idempotent producer is 200; duplicates and close-only are 204.
    status = 200 if asked.producer is not None and result.status == "ok" and entries else 204
    headers = responses.append_result(result)
    if (asked.if_match is not None or asked.expected_offset is not None) and result.created is not None:
        # A conditional writer's next If-Match: the ETag of the stream it just wrote.
        headers.update(responses.current_state(sid, result.created, result.tail, result.closed))
    return status, headers


async def post_stream(request: web.Request) -> web.Response:
    gw = gateway_of(request)
    sid = _sid(request, gw)
    asked = append_asked(request.headers, sid)
    tenant = gw.guard.tenant(principal_of(request), keys.path_of(sid))  # (403 before the body is read)
    body = await _body(request, gw)
    raw_type = request.headers.get("Content-Type")
    status, headers = await append_body(gw, request, sid, asked, raw_type, body, tenant)
    return web.Response(status=status, headers=headers)


async def delete_stream(request: web.Request) -> web.Response:
    gw = gateway_of(request)
    sid = _sid(request)
    await gw.store.delete(sid, gw.guard.tenant(principal_of(request), keys.path_of(sid)))
    return web.Response(status=204)


async def head_stream(request: web.Request) -> web.Response:
    meta = await gateway_of(request).store.head(_sid(request))
    headers = responses.stream_state(meta)
    headers["Cache-Control"] = caching.NO_STORE
    if caching.matches(request.headers.get("If-None-Match"), headers["ETag"]):  # Ursula's polling
        return web.Response(status=304, headers={"ETag": headers["ETag"], "Cache-Control": caching.NO_STORE})
    return web.Response(status=200, headers=headers)


async def get_stream(request: web.Request) -> web.StreamResponse:
    gw = gateway_of(request)
    sid = _sid(request)
    query = request.query
    start = offsets.parse_read_offset(query.getall("offset", []))
    mode = query.get("live")
    client_cursor = cursor.parse_client_cursor(query.getall("cursor", []))
    if mode in ("sse", "long-poll") and "offset" not in query:
        raise bad_request(f"live={mode} needs an offset")
    if mode in ("sse", "long-poll"):
        # A live read ends when the credential that opened it expires (the client
        # comes back with a fresh one), and counts against the live-connection caps.
        until = principal_of(request).expires_at
        serve = live.sse if mode == "sse" else live.long_poll
        slot = gw.guard.live.hold(gw.guard.live_holder(request))
        tenant = gw.guard.tenant(principal_of(request), keys.path_of(sid))
        lease = gw.store.tenant_live.hold(tenant) if tenant else contextlib.nullcontext()
        async with lease:  # the tenant's live connections, fleet-wide (features/tenant_live.py)
            with slot, metrics.child(metrics.LIVE_CONNECTIONS, mode).track_inprogress():
                return await serve(request, gw, sid, start, cursor.response_cursor(client_cursor), until)
    if mode is not None:
        raise bad_request("live must be long-poll or sse")
    async with catchup.FirstPage(gw) as first:  # its share of the read budget
        chunk = await gw.store.catch_up(sid, start)
        first.read()
        coding, vary = catchup.coding_for(gw, request, chunk)
        headers = responses.read_chunk(chunk, cursor=None, at_now=start is None, coding=coding, vary=vary)
        if "ETag" in headers and caching.matches(request.headers.get("If-None-Match"), headers["ETag"]):
            kept: dict[str, str] = {n: headers[n] for n in ("ETag", "Cache-Control", "Vary") if n in headers}
            return web.Response(status=304, headers=kept)
        return await catchup.answer(request, gw, chunk, headers, coding, first)


async def options_stream(request: web.Request) -> web.Response:
    return web.Response(status=204, headers=gateway_of(request).guard.preflight(request))


SIGN_DEFAULT_SECONDS = 300


async def sign_url(request: web.Request) -> web.Response:
    """POST /auth/sign {"path", "scope"?: "read", "expires_in"?: 300}: a signed URL for
    one stream, for clients that cannot send headers (EventSource). It grants no more
    than its minter holds, and expires no later than the minter's own credential."""
    gw = gateway_of(request)
    principal = await gw.guard.authenticated(request)
    key = gw.guard.auth.signing_key if gw.guard.auth is not None else None
    if key is None:
        raise ProtocolError(404, "signed URLs are not enabled (--auth-signing-key-file)")
    body = await _body(request)
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise bad_request("expected a JSON object") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("path"), str):
        raise bad_request('expected {"path": "<stream path>", "scope": "read", "expires_in": 300}')
    path = _path_on_server(request, doc["path"], "path")
    scope = doc.get("scope", "read")
    if scope not in access.SIGNED_SCOPES:
        raise bad_request(f"scope must be one of {', '.join(access.SIGNED_SCOPES)}")
    seconds = doc.get("expires_in", SIGN_DEFAULT_SECONDS)
    longest = gw.settings.auth_signed_url_max_seconds
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not 0 < seconds <= longest:
        raise bad_request(f"expires_in must be a whole number of seconds from 1 to {longest:g}")
    access.check(principal, scope, path)
    await gw.guard.limit(request, principal, scope, path)
    expires = int(time.time()) + seconds
    if principal.expires_at is not None:
        expires = min(expires, int(principal.expires_at))
    query = access.sign(key, scope, path, expires, principal.id, principal.tenant or "")
    url = public_url(request, path) + "?" + urlencode(query)
    payload = {"url": url, "query": query, "expires_at": expires, "scope": scope}
    return web.Response(body=orjson.dumps(payload), content_type="application/json")
