"""Ursula's snapshots and bootstrap on ``/{bucket}/{stream}`` (seed 002: "Snapshots",
"Bootstrap", "Publish snapshot", "Read snapshot"): parse, one storage call
(features/snapshots.py; the stream's reads for bootstrap), shape the documented answer.

Offsets in the URL are this server's offset tokens (as every response gives them);
Ursula's 20-digit decimal form is accepted too. Access: publishing needs ``write`` on
the stream, reading (and bootstrap) ``read``, a delete ``admin``.
"""

from __future__ import annotations

import uuid

from aiohttp import web

from ..features.snapshots import Snapshot, Snapshots, State
from ..protocol import offsets
from ..protocol.access import Scope
from ..protocol.buckets import bucket_stream
from ..protocol.errors import ProtocolError, bad_request
from ..protocol.headers import DEFAULT_CONTENT_TYPE, validate_content_type
from ..protocol.headers import STREAM_SNAPSHOT_OFFSET as SNAPSHOT_OFFSET
from ..protocol.jsonmode import with_offset
from ..redis_io import keys
from .bodies import read_body
from .context import BODY_SENT, gateway_of
from .guard import TENANT

_DECIMAL_WIDTH = 20  # Ursula's offsets: 20-digit zero-padded decimals


async def _stream(request: web.Request, scope: Scope) -> str:
    """The stream id a ``/{bucket}/{stream}/...`` request names, once admitted for ``scope``."""
    _, path = bucket_stream(request.match_info["bucket"], request.match_info["stream"])
    await gateway_of(request).guard.admit_path(request, path, scope, stream=True)  # (its tenant too)
    return keys.stream_id(path)


def _position(request: web.Request) -> int:
    raw = request.match_info["offset"]
    if len(raw) == _DECIMAL_WIDTH and raw.isascii() and raw.isdigit():
        return int(raw)
    return offsets.decode(raw)  # 400 for anything else


def _state_headers(state: State, snapshot: Snapshot) -> dict[str, str]:
    return {
        "Stream-Next-Offset": offsets.encode(state.tail),
        SNAPSHOT_OFFSET: offsets.encode(snapshot.position),
        "Stream-Up-To-Date": "true" if snapshot.position >= state.tail else "false",
        "Cache-Control": "no-store",
    }


async def put_snapshot(request: web.Request) -> web.Response:
    """Publish: 204 with the stream's next offset and the snapshot's."""
    gw = gateway_of(request)
    sid = await _stream(request, "write")
    position = _position(request)
    raw_type = (request.headers.get("Content-Type") or "").strip()
    content_type = raw_type if raw_type else DEFAULT_CONTENT_TYPE
    validate_content_type(content_type)
    limit = gw.settings.max_snapshot_bytes
    timeout, budget = gw.settings.body_timeout, gw.bodies
    body = await read_body(request, max_bytes=limit, timeout=timeout, budget=budget, streamed=True)
    tenant = request.get(TENANT, "")
    tail = await gw.store.snapshots.publish(sid, position, content_type, body, tenant)
    headers = {"Stream-Next-Offset": offsets.encode(tail), SNAPSHOT_OFFSET: offsets.encode(position)}
    return web.Response(status=204, headers=headers)


async def latest_snapshot(request: web.Request) -> web.Response:
    """307 to the latest snapshot's own URL; 404 when none was published."""
    sid = await _stream(request, "read")
    state = await gateway_of(request).store.snapshots.state(sid)
    if state.snapshot is None:
        raise ProtocolError(404, "no snapshot has been published for this stream")
    # The raw (still percent-encoded) path: a decoded '?' or '%' would name another URL.
    location = f"{request.raw_path.split('?', 1)[0].rstrip('/')}/{offsets.encode(state.snapshot.position)}"
    return web.Response(status=307, headers={"Location": location, **_state_headers(state, state.snapshot)})


async def get_snapshot(request: web.Request) -> web.Response:
    sid = await _stream(request, "read")
    position = _position(request)
    snapshots = gateway_of(request).store.snapshots
    state = await snapshots.state(sid)
    snapshot = state.snapshot
    blob = None
    if snapshot is not None and snapshot.position == position:
        blob = await snapshots.blob(snapshot)
    if snapshot is None or blob is None:
        raise ProtocolError(404, "no snapshot at this offset (only the latest is kept)")
    headers = {"Content-Type": snapshot.content_type, **_state_headers(state, snapshot)}
    if state.closed:
        headers["Stream-Closed"] = "true"
    return web.Response(status=200, body=blob, headers=headers)


async def delete_snapshot(request: web.Request) -> web.Response:
    """Snapshots are immutable (Ursula refuses every delete): the latest 409, others 404."""
    sid = await _stream(request, "admin")
    position = _position(request)
    state = await gateway_of(request).store.snapshots.state(sid)
    if state.snapshot is not None and state.snapshot.position == position:
        raise ProtocolError(409, "the current snapshot cannot be deleted: publish a newer one")
    raise ProtocolError(404, "no snapshot at this offset")


async def _with_blob(snapshots: Snapshots, sid: str) -> tuple[State, bytes]:
    """The stream's state and its latest snapshot's blob (b"" without one). A blob replaced
    between the two reads: once more, with the newer one; one that stays missing (an
    archive store restored behind Redis) is 503, never an empty snapshot."""
    for _ in range(2):
        state = await snapshots.state(sid)
        if state.snapshot is None:
            return state, b""
        blob = await snapshots.blob(state.snapshot)
        if blob is not None:
            return state, blob
    raise ProtocolError(503, "the snapshot's blob is missing from the archive store", {"Retry-After": "1"})


async def bootstrap(request: web.Request) -> web.StreamResponse:
    """``multipart/mixed``: the latest snapshot (an empty part without one), then the
    updates after it up to the tail the request found: one part per message on a JSON
    stream, one per read chunk (at most --max-chunk-bytes) otherwise.

    Written by hand rather than with aiohttp's MultipartWriter, which holds every part
    before it writes: here each part goes out as it is read, so a long stream is never
    in memory at once."""
    if "live" in request.query:
        raise bad_request("bootstrap is not live: read it, then GET the stream from Stream-Next-Offset")
    gw = gateway_of(request)
    sid = await _stream(request, "read")
    # The first read before anything is sent: a 404 is still an answer of its own. A newer
    # snapshot published in between raised the floor above this one (410): start again
    # from it. Once under way, the rest is read below the floor if need be (still stored).
    for attempt in range(3):
        state, blob = await _with_blob(gw.store.snapshots, sid)
        snapshot, end = state.snapshot, state.tail
        try:
            chunk = await gw.store.read(sid, snapshot.position if snapshot is not None else offsets.BEGINNING)
            break
        except ProtocolError as exc:
            if exc.status != 410 or attempt == 2:
                raise
    boundary = uuid.uuid4().hex
    response = web.StreamResponse(
        headers={
            "Content-Type": f'multipart/mixed; boundary="{boundary}"',
            "Stream-Next-Offset": offsets.encode(end),
            SNAPSHOT_OFFSET: offsets.encode(snapshot.position) if snapshot is not None else "none",
            "Stream-Up-To-Date": "true",
            "Cache-Control": "no-store",
            **({"Stream-Closed": "true"} if state.closed else {}),
        }
    )
    gw.guard.secure(request, response.headers)
    await response.prepare(request)
    dash = f"--{boundary}\r\n".encode()
    request[BODY_SENT] = 0  # (bytes out: the tenants' meter, endpoint.py)

    async def part(content_type: str, data: bytes) -> None:
        head = f"Content-Type: {content_type}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        await response.write(dash + head + data + b"\r\n")
        request[BODY_SENT] += len(dash) + len(head) + len(data) + 2

    await part(snapshot.content_type if snapshot is not None else DEFAULT_CONTENT_TYPE, blob)
    media = chunk.meta.content_type
    while True:
        entries = [(pos, data) for pos, data in chunk.entries if pos < end]
        if chunk.meta.is_json:
            for pos, message in entries:
                await part(media, with_offset(pos, message))
        elif entries:
            await part(media, b"".join(data[: end - pos] for pos, data in entries))
        if not entries or chunk.end >= end:
            break
        chunk = await gw.store.read(sid, chunk.end, below_floor=True)
    end_line = f"--{boundary}--\r\n".encode()
    await response.write(end_line)
    request[BODY_SENT] += len(end_line)
    await response.write_eof()
    return response
