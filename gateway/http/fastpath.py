"""Appends answered on the connection itself, before aiohttp's request machinery.

Every connection of an app made by ``fast_application`` is a ``Connection``: aiohttp's
own protocol (RequestHandler), whose bytes pass through ``data_received`` here first.
A plain POST to a stream, whose head protocol/http1.py recognises and whose whole body
is in, is answered here while aiohttp has nothing in hand: the same checks and the
same store call as the POST handler (``handlers.append_asked``/``append_body``), the
same errors (``endpoint.error_answer``), the same headers, metrics and body budget;
its answer is written to the transport directly. Anything else goes to aiohttp a
message at a time, byte for byte as it came, and once aiohttp answered it the next
plain POST is ours again; a message this module cannot frame gives the connection to
aiohttp for good. Answers leave in request order (one request at a time, as aiohttp), and
none is taken while the client reads no answers (writing paused), as aiohttp awaits the drain.

Why: aiohttp's path (a Request and a StreamWriter, a task, the router, the endpoint
wrapper, a Response prepared, its headers serialised) was over half of the ~75 µs of
gateway CPU an append cost (docs/benchmarks.md, issue 28).

Admission (Guard.admit_append: host, credentials and grants, rate limits) and the access
log's line are those of aiohttp's path too. Never answered here, so answered by aiohttp
exactly as before: a request with a query (a signed URL's), an Origin (browsers: CORS),
Expect, Upgrade, a Connection other than keep-alive, a Content-Encoding, a percent-escape,
fragment or dot segment in its path, no Host, a body over ``MAX_BODY_BYTES`` or
--max-body-bytes, or one not in within ``BODY_WAIT_SECONDS``; the reserved namespace;
anything while storage is not ready, the gateway drains (SIGTERM) or write backpressure is
on; everything with --no-fast-appends or streams at the root (``usable``).

Leans on aiohttp's RequestHandler internals (its message queue, waiter and keep-alive
fields), hence aiohttp pinned below 3.15 and tests/test_fastpath.py checking them.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from http import HTTPStatus
from typing import Any, Final

from aiohttp import web
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.web_protocol import RequestHandler

from ..config import Settings
from ..protocol import caching
from ..protocol.errors import ProtocolError
from ..protocol.http1 import OTHER, Head, parse_head
from ..protocol.namespace import RESERVED
from ..telemetry import metrics
from .accesslog import AccessLog
from .auth import peer_address, peer_ip
from .context import GATEWAY, Gateway
from .endpoint import error_answer
from .handlers import append_asked, append_body, valid_stream_id

# Larger bodies go through aiohttp, which reads them as they come: a body held whole
# in the connection's buffer before a byte is checked is kept small.
MAX_BODY_BYTES: Final = 256 * 1024
# A plain POST whose body has not all come this long after its head goes to aiohttp
# with what came, which reads the rest within --body-timeout (408 past it), as always.
BODY_WAIT_SECONDS: Final = 0.5
# Bytes a client sends behind an append still being answered (pipelining), held before
# reading from it pauses.
MAX_PENDING_BYTES: Final = 1 << 20

_REASONS = {status.value: status.phrase for status in HTTPStatus}
_SERVER = f"Server: {SERVER_SOFTWARE}\r\n"
_NO_BODY = (204, 304)
ACCESS = web.AppKey("fastpath_access_log", AccessLog)  # the access log, when it is on


def fast_application(access: AccessLog | None = None, **kwargs: Any) -> web.Application:
    """A web.Application whose connections are ``Connection``s (``kwargs``: web.Application's);
    ``access``: the access log its appends are recorded in, if on."""
    app = _Application(**kwargs)
    if access is not None:
        app[ACCESS] = access
    return app


with warnings.catch_warnings():  # aiohttp discourages subclassing Application (a DeprecationWarning)
    warnings.simplefilter("ignore", DeprecationWarning)

    class _Application(web.Application):
        def _make_handler(
            self, *, loop: asyncio.AbstractEventLoop | None = None, **kwargs: Any
        ) -> web.Server:
            # aiohttp's own server with everything it set (handler, request factory, handler
            # arguments), only its protocol class ours: every host (run_app, gunicorn's worker,
            # test servers) makes its server here.
            server = super()._make_handler(loop=loop, **kwargs)
            return _Server(
                self,
                server.request_handler,
                request_factory=server.request_factory,
                handler_cancellation=server.handler_cancellation,
                loop=loop,
                **server._kwargs,
            )


class _Server(web.Server):
    def __init__(self, app: web.Application, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.app = app
        self.prefix = ""
        self.plain = ""  # the plain browser headers (Guard.plain), as they are written
        self.access: AccessLog | None = None

    def __call__(self) -> RequestHandler:
        return Connection(self, loop=self._loop, **self._kwargs)

    def gateway(self) -> Gateway | None:
        """The app's Gateway, once startup made it; with it, what every answer here takes
        from it is worked out once (the stream prefix, the browser headers, the access log)."""
        gw = self.app.get(GATEWAY)
        if gw is not None and not self.prefix:
            self.access = self.app.get(ACCESS)
            self.prefix = gw.settings.prefix.rstrip("/") + "/"
            self.plain = "".join(f"{name}: {value}\r\n" for name, value in gw.guard.plain.items())
        return gw


def usable(settings: Settings) -> bool:
    """Whether any request could be answered here with these settings: if not, the plain
    aiohttp app is used, and no byte is looked at twice."""
    return (
        settings.fast_appends
        and bool(settings.prefix.rstrip("/"))  # streams at the root share it with every other route
    )


class Connection(RequestHandler):
    __slots__ = ("_pending", "_forward_left", "_aiohttp_only", "_busy", "_held", "_body_timer", "_answering")

    def __init__(self, manager: _Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._pending = bytearray()  # received, neither answered nor passed on yet
        self._forward_left = 0  # bytes of a message passed to aiohttp still to come
        self._aiohttp_only = False  # a message we cannot frame came: all of it is aiohttp's
        self._busy = False  # an append of ours is being answered
        self._held = False  # reading paused: too much pending behind our append
        self._body_timer: asyncio.TimerHandle | None = None
        self._answering: asyncio.Task[None] | None = None

    # -- bytes in ---------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._aiohttp_only:
            super().data_received(data)
            return
        if self._force_close or self._close:
            return
        if self._forward_left:  # the rest of a message aiohttp has (a body arriving)
            n = min(len(data), self._forward_left)
            self._forward_left -= n
            super().data_received(data[:n] if n < len(data) else data)
            data = data[n:]
            if not data:
                return
        self._pending += data
        self._pump()

    def _pump(self) -> None:
        """Take the pending messages in order: ours answered here, others passed on; then
        read on, or not, by what is left."""
        self._take()
        transport = self.transport
        if transport is None:
            return
        if len(self._pending) >= MAX_PENDING_BYTES:
            if transport.is_reading():  # (aiohttp may have resumed it meanwhile)
                self._held = True
                transport.pause_reading()
        elif self._held:
            self._held = False
            if not self._buffer_paused and not self._reading_paused:  # aiohttp's own pauses stay
                transport.resume_reading()

    def _take(self) -> None:
        if self._force_close or self._close:  # closing (keep-alive, shutdown): nothing more is taken
            return
        # Not while writing is paused (a client not reading its answers): as aiohttp, which
        # awaits the drain, take nothing more until resume_writing; what it sends meanwhile
        # waits in _pending, whose bound pauses reading. Else answers would pile up unbounded.
        while self._pending and not self._busy and not self._forward_left and not self._paused:
            if self._aiohttp_only:
                self._pass_on(len(self._pending))
                return
            head = parse_head(self._pending)
            if head is None:  # an incomplete head (aiohttp's keep-alive timer bounds a stalled one)
                return
            if head is OTHER:
                self._aiohttp_only = True
                continue
            assert isinstance(head, Head)
            size = head.size + head.body_length
            gw = self._ours(head)
            if gw is None:
                self._pass_on(size)
                continue
            if len(self._pending) < size:  # its body is still coming
                if self._body_timer is None:
                    try:  # its declared length counts from now, as on aiohttp's path
                        gw.bodies.take(self, head.body_length)
                    except ProtocolError:
                        self._pass_on(size)  # no room: aiohttp answers it (503), as always
                        continue
                    self._body_timer = self._loop.call_later(BODY_WAIT_SECONDS, self._give_up_waiting)
                return
            reserved = self._stop_waiting()
            with memoryview(self._pending) as pending:  # one copy (a bytearray slice is one more)
                body = bytes(pending[head.size : size])
            del self._pending[:size]
            self._answer(gw, head, body, reserved)

    def _pass_on(self, size: int) -> None:
        """The next message (``size`` bytes, some perhaps still to come) is aiohttp's."""
        if self._stop_waiting():
            self._release()
        n = min(size, len(self._pending))
        with memoryview(self._pending) as pending:
            chunk = bytes(pending[:n])
        del self._pending[:n]
        self._forward_left = size - n
        super().data_received(chunk)

    def _give_up_waiting(self) -> None:
        """BODY_WAIT_SECONDS passed and the body awaited is not all in: aiohttp's, with
        what came (its reservation released here, taken again by aiohttp's read)."""
        head = parse_head(self._pending)
        assert isinstance(head, Head)  # still the awaited message's, the first one pending
        self._pass_on(head.size + head.body_length)
        self._pump()

    def _stop_waiting(self) -> bool:
        """Wait no more for a body: whether one was awaited (its length then reserved)."""
        if self._body_timer is None:
            return False
        self._body_timer.cancel()
        self._body_timer = None
        return True

    def _release(self) -> None:
        gw = self._manager.gateway() if self._manager is not None else None  # type: ignore[attr-defined]
        if gw is not None:
            gw.bodies.release(self)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._pump()  # what waited for the client to read its answers

    def _process_keepalive(self) -> None:
        # aiohttp's keep-alive timer closes a connection whose start() waits for a message: not
        # while an append of ours is answered or its body awaited (re-armed in _done, or by
        # aiohttp after the message it is passed).
        if self._busy or self._body_timer is not None:
            self._keepalive_handle = None
            return
        if self._paused and self._pending:  # messages wait for the client to read its answers:
            # no timeout, as on aiohttp's path (in its drain); looked at again later
            self._keepalive_handle = self._loop.call_later(self._keepalive_timeout, self._process_keepalive)
            return
        super()._process_keepalive()

    def _ours(self, head: Head) -> Gateway | None:
        """The Gateway, when this message is an append answered here and aiohttp is idle."""
        if head.method != "POST" or head.body_length > MAX_BODY_BYTES:
            return None
        # aiohttp has nothing in hand: it waits for its next message, or has never had one
        # (its start() task may not have run yet on a new connection)
        waiter = self._waiter
        if self._messages or self._request_in_progress:
            return None
        if waiter.done() if waiter is not None else self._request_count:
            return None
        server: _Server = self._manager  # type: ignore[assignment]
        gw = server.gateway()
        if gw is None or not gw.preflight.ready or gw.draining:
            return None
        pause = gw.guard.pause
        if pause is not None and pause.active:
            return None
        target, prefix = head.target, server.prefix
        if (
            not target.startswith(prefix)
            or target.startswith(RESERVED, len(prefix))
            or "?" in target
            or "%" in target
            or "#" in target  # a fragment: aiohttp drops it from the path
            or "/." in target
            or "//" in target
        ):
            return None
        h = head.headers
        if "Origin" in h or "Expect" in h or "Upgrade" in h or "Content-Encoding" in h or "Host" not in h:
            return None
        connection = h.get("Connection")
        if connection is not None and connection.lower() != "keep-alive":
            return None
        if head.body_length > gw.settings.max_body_bytes:
            return None
        return gw

    # -- an append ----------------------------------------------------------------

    def _answer(self, gw: Gateway, head: Head, body: bytes, reserved: bool) -> None:
        self._busy = self._request_in_progress = True  # aiohttp's shutdown() waits for it too
        path = head.target[len(self._manager.prefix) :]  # type: ignore[union-attr]
        self._answering = self._loop.create_task(self._append(gw, head, path, body, reserved))

    async def _append(self, gw: Gateway, head: Head, path: str, body: bytes, reserved: bool) -> None:
        started, status, content = time.perf_counter(), 500, b""
        h, hops = head.headers, gw.settings.trusted_proxy_hops

        def address() -> str:  # the client's, as rate limits count it (asked when it counts)
            return peer_address(h.getall("X-Forwarded-For", []), self._remote(), hops)

        try:
            try:
                admitting = gw.guard.admit_append(h["Host"], h.get("Authorization"), path, address)
                if admitting is not None:
                    await admitting
                sid = valid_stream_id(path, gw.settings.max_path_bytes)
                asked = append_asked(h, sid)
                if not reserved:  # (else taken as it began to arrive)
                    gw.bodies.take(self, len(body))
                status, headers = await append_body(gw, self, sid, asked, h.get("Content-Type"), body)
            except Exception as exc:
                status, headers, content = error_answer(exc, head.method, head.target)
            if gw.draining:  # SIGTERM came meanwhile: as endpoint.py, this connection's last answer
                headers["Connection"] = "close"
                self.close()  # (the transport once it is written: _done)
            self._write(status, headers, content)
        finally:
            gw.bodies.release(self)
            seconds = time.perf_counter() - started
            metrics.observe_fast_request("stream", "POST", status, seconds)
            access = self._manager.access if self._manager is not None else None  # type: ignore[attr-defined]
            if access is not None:
                remote = peer_ip(h.getall("X-Forwarded-For", []), self._remote(), hops)
                access.line(remote, head.method, head.target, status, len(content), seconds)
            self._done()

    def _remote(self) -> str | None:
        """The peer's address, as aiohttp's ``request.remote`` has it."""
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return str(peer[0]) if isinstance(peer, (list, tuple)) else None if peer is None else str(peer)

    def _write(self, status: int, headers: dict[str, str], content: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return  # the client left; the append counts all the same, as on aiohttp's path
        if status >= 400:  # a CDN must not keep a 404 past the stream's creation, nor a 503
            headers.setdefault("Cache-Control", caching.NO_STORE)
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n"]
        lines += [f"{name}: {value}\r\n" for name, value in headers.items()]
        # The plain browser headers (no Origin): none is one an answer here sets itself.
        lines.append(self._manager.plain)  # type: ignore[union-attr]
        if status not in _NO_BODY:
            lines.append(f"Content-Length: {len(content)}\r\n")
        lines += ("Date: ", rfc822_formatted_time(), "\r\n", _SERVER, "\r\n")
        transport.write("".join(lines).encode("latin-1") + content)

    def _done(self) -> None:
        self._busy = self._request_in_progress = False
        self._answering = None
        if self._handler_waiter is not None and not self._handler_waiter.done():
            self._handler_waiter.set_result(None)  # aiohttp's shutdown() waited for this answer
        if self._close or self._force_close:  # closed meanwhile (shutdown): after this answer
            if self.transport is not None:
                self.transport.close()
            return
        close_time = self._next_keepalive_close_time = self._loop.time() + self._keepalive_timeout
        if self._keepalive_handle is None and self._keepalive_timeout > 0:
            self._keepalive_handle = self._loop.call_at(close_time, self._process_keepalive)
        self._pump()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._stop_waiting():
            self._release()
        self._pending.clear()
        super().connection_lost(exc)
