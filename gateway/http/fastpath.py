"""The append door: plain appends answered on their connection, before aiohttp's request
machinery (a Request, a task, the router, a Response prepared and serialised).

Every connection is an ``aiohttp_seam.Protocol``: aiohttp's own, whose parser (llhttp) frames
every byte it receives. Each message llhttp frames is offered to ``Connection.take`` while
aiohttp has nothing in hand; a plain POST to a stream whose whole body came with it is answered
here, with the POST handler's own functions (``handlers.append_asked``/``append_body``) and the
pipeline every request goes through (pipeline.py: errors, sealed headers, the body budget,
metrics, the access log). Anything else is aiohttp's, as llhttp framed it: this module reads no
byte itself, so both doors frame every request alike by construction.

Why: aiohttp's path was over half of the ~75 µs of gateway CPU an append cost
(docs/benchmarks.md, issue 28).

Never taken here, so answered by aiohttp exactly as before: a request with a query (a signed
URL's), an Origin (browsers: CORS), Expect, Upgrade, a Transfer-Encoding, a Content-Encoding,
``Connection: close`` or HTTP/1.0, a percent-escape, fragment or dot segment in its path, no
Host, a target in absolute form, a body over ``MAX_BODY_BYTES`` or --max-body-bytes or not all
in yet; the reserved namespace; anything while storage is not ready, the gateway drains
(SIGTERM), write backpressure is on or the client reads no answers (writing paused);
everything with --no-fast-appends or streams at the root (``usable``).
"""

from __future__ import annotations

import time
from http import HTTPStatus
from typing import Final

from aiohttp import web
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE, HttpVersion11
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader

from ..config import Settings
from ..protocol.access import OPEN, Principal
from ..protocol.namespace import RESERVED
from ..redis_io import keys
from . import pipeline
from .accesslog import AccessLog
from .aiohttp_seam import Protocol, whole_body
from .auth import peer_address, peer_ip
from .context import GATEWAY, Gateway
from .handlers import append_asked, append_body, valid_stream_id

# Larger bodies go through aiohttp, which reads them as they come and bounds them as it reads.
MAX_BODY_BYTES: Final = 256 * 1024

_REASONS = {status.value: status.phrase for status in HTTPStatus}
_SERVER = f"Server: {SERVER_SOFTWARE}\r\n"
_NO_BODY = (204, 304)
ACCESS = web.AppKey("fastpath_access_log", AccessLog)  # the access log, when it is on


def usable(settings: Settings) -> bool:
    """Whether any request could be answered here with these settings."""
    return (
        settings.fast_appends
        and bool(settings.prefix.rstrip("/"))  # streams at the root share it with every other route
    )


class Connection(Protocol):
    __slots__ = ("_gw", "_prefix", "_access", "_plain")

    _gw: Gateway | None
    _prefix: str
    _access: AccessLog | None
    _plain: str  # the browser headers of an answer to a request without Origin, serialised

    def take(self, message: RawRequestMessage, payload: StreamReader) -> bool:
        if message.method != "POST" or self.writing_paused:
            return False
        gw = self._gateway()
        if gw is None or not gw.preflight.ready or gw.draining:
            return False
        pause = gw.guard.pause
        if pause is not None and pause.active:
            return False
        if (
            message.should_close  # Connection: close, or HTTP/1.0
            or message.upgrade
            or message.chunked
            or message.version != HttpVersion11
            or not payload.is_eof()  # its body is still coming: aiohttp reads it as it comes
            or payload.total_bytes > MAX_BODY_BYTES
            or payload.total_bytes > gw.settings.max_body_bytes  # aiohttp answers 413
        ):
            return False
        target, prefix = message.path, self._prefix
        if (
            not target.startswith(prefix)  # (an absolute-form target too)
            or target.startswith(RESERVED, len(prefix))
            or "?" in target
            or "%" in target
            or "#" in target  # a fragment: aiohttp drops it from the path
            or "/." in target
            or "//" in target
        ):
            return False
        h = message.headers
        if (
            "Origin" in h
            or "Expect" in h
            or "Host" not in h
            or "Transfer-Encoding" in h
            or "Content-Encoding" in h
        ):
            return False
        body = whole_body(payload)
        self.begin()
        self._loop.create_task(self._append(gw, message, target, body))
        return True

    def _gateway(self) -> Gateway | None:
        """The app's Gateway, once startup made it (kept by the connection from then on)."""
        gw = getattr(self, "_gw", None)
        if gw is None:
            gw = self._gw = self.app.get(GATEWAY)
            if gw is not None:
                self._prefix = gw.settings.prefix.rstrip("/") + "/"
                self._access = self.app.get(ACCESS)
                plain = gw.guard.headers_for(None)
                self._plain = "".join(f"{name}: {value}\r\n" for name, value in plain.items())
        return gw

    async def _append(self, gw: Gateway, message: RawRequestMessage, target: str, body: bytes) -> None:
        started, status, content = time.perf_counter(), 500, b""
        h, hops = message.headers, gw.settings.trusted_proxy_hops
        principal: Principal = OPEN
        tenant = ""

        def address() -> str:  # the client's, as rate limits count it (asked when it counts)
            return peer_address(h.getall("X-Forwarded-For", []), self._remote(), hops)

        try:
            path = target[len(self._prefix) :]
            try:
                admitting = gw.guard.admit_append(h["Host"], h.get("Authorization"), path, address)
                if admitting is not None:
                    principal = await admitting
                sid = valid_stream_id(path, gw.settings.max_path_bytes)
                asked = append_asked(h, sid)
                tenant = gw.guard.tenant(principal, keys.path_of(sid)) if gw.guard.tenants_on else ""
                gw.bodies.take(self, len(body))
                status, headers = await append_body(gw, self, sid, asked, h.get("Content-Type"), body, tenant)
            except Exception as exc:
                status, headers, content = pipeline.error_answer(exc, "POST", target)
            # (the browser headers: _write's, as seal would add them; none is an append answer's)
            if pipeline.seal(gw, status, headers, None, principal, False):
                headers["Connection"] = "close"
                self.close()  # (the transport once it is written: done())
            self._write(status, headers, content)
        except Exception:  # an answer that cannot be written: later ones must not take its place
            if self.transport is not None:
                self.transport.close()
            raise
        finally:
            try:
                access = self._access
                xff = h.getall("X-Forwarded-For", [])
                remote = "" if access is None else peer_ip(xff, self._remote(), hops)
                seconds = time.perf_counter() - started
                pipeline.finish(
                    gw, self, "stream", "POST", status, seconds, True, access, remote, target, len(content)
                )
                if tenant:
                    gw.store.usage.request(tenant, "append", 0)
            finally:
                self.done()  # whatever happened: the messages behind it go on

    def _remote(self) -> str | None:
        """The peer's address, as aiohttp's ``request.remote`` has it."""
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return str(peer[0]) if isinstance(peer, (list, tuple)) else None if peer is None else str(peer)

    def _write(self, status: int, headers: dict[str, str], content: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return  # the client left; the append counts all the same, as on aiohttp's path
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n"]
        lines += [f"{name}: {value}\r\n" for name, value in headers.items()]
        lines.append(self._plain)
        if status not in _NO_BODY:
            lines.append(f"Content-Length: {len(content)}\r\n")
        lines += ("Date: ", rfc822_formatted_time(), "\r\n", _SERVER, "\r\n")
        transport.write("".join(lines).encode("latin-1") + content)
