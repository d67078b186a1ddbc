"""Raw HTTP/1.1 over a socket: malformed requests reach the server exactly as written.

No client library in between to validate, normalise or encode headers: a
request is bytes, the answer is parsed just enough to get its status, headers
and body. Every call is bounded in time.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field


@dataclass
class RawResponse:
    status: int | None  # None: no (complete) status line before the connection ended or timed out
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    raw: bytes = b""
    elapsed: float = 0.0
    timed_out: bool = False
    error: str | None = None
    reacted: float | None = None  # seconds until the server first answered, closed or reset

    def header(self, name: str) -> bytes | None:
        wanted = name.lower().encode()
        for key, value in self.headers:
            if key.lower() == wanted:
                return value
        return None

    def describe(self) -> str:
        if self.status is None:
            what = "timed out" if self.timed_out else f"no answer ({self.error})"
            return f"{what} after {self.elapsed:.1f}s"
        return f"{self.status} after {self.elapsed:.1f}s: {self.body[:200]!r}"


def build(
    method: bytes | str,
    target: bytes | str,
    headers: list[tuple[bytes | str, bytes | str]],
    body: bytes = b"",
    *,
    host: bytes | str | None = b"127.0.0.1",
    content_length: bool = True,
) -> bytes:
    """A request; header names and values are sent byte for byte (str as UTF-8)."""

    def b(value: bytes | str) -> bytes:
        return value if isinstance(value, bytes) else value.encode()

    lines = [b(method) + b" " + b(target) + b" HTTP/1.1"]
    names = {b(k).lower() for k, _ in headers}
    if host is not None and b"host" not in names:
        lines.append(b"Host: " + b(host))
    for key, value in headers:
        lines.append(b(key) + b": " + b(value))
    if content_length and b"content-length" not in names and b"transfer-encoding" not in names:
        lines.append(b"Content-Length: " + str(len(body)).encode())
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _parse(raw: bytes, response: RawResponse) -> None:
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return
    response.status = int(parts[1])
    for line in lines[1:]:
        key, _, value = line.partition(b":")
        response.headers.append((key.strip(), value.strip()))
    if response.header("Transfer-Encoding") == b"chunked":
        body, data = bytearray(), rest
        while data:
            size_line, _, data = data.partition(b"\r\n")
            try:
                size = int(size_line.split(b";")[0], 16)
            except ValueError:
                break
            if size == 0:
                break
            body += data[:size]
            data = data[size + 2 :]
        response.body = bytes(body)
    else:
        response.body = rest


def send(port: int, request: bytes, *, timeout: float = 10.0, host: str = "127.0.0.1") -> RawResponse:
    """Send ``request`` and read until the server closes (we ask it to) or ``timeout``."""
    return send_parts(port, [request], timeout=timeout, host=host)


def send_parts(
    port: int,
    parts: list[bytes],
    *,
    delay: float = 0.0,
    timeout: float = 10.0,
    host: str = "127.0.0.1",
) -> RawResponse:
    """Send ``parts`` with ``delay`` seconds between them (a slow client), then read.

    Sending stops as soon as the server reacts (answers, closes or resets);
    ``timeout`` bounds the whole exchange.
    """
    started = time.monotonic()
    deadline = started + timeout
    response = RawResponse(status=None)
    raw = bytearray()

    def reacted() -> None:
        if response.reacted is None:
            response.reacted = time.monotonic() - started

    with socket.create_connection((host, port), timeout=5) as sock:
        try:
            for index, part in enumerate(parts):
                if index and delay:
                    # Wait ``delay``, watching for an early answer (or close) from the server.
                    sock.settimeout(max(0.01, min(delay, deadline - time.monotonic())))
                    try:
                        chunk = sock.recv(65536)
                    except TimeoutError:
                        chunk = None
                    if chunk is not None:
                        reacted()
                        if not chunk:
                            response.error = "server closed the connection while we were sending"
                        raw += chunk
                        break
                if time.monotonic() >= deadline:
                    break
                sock.sendall(part)
        except OSError as exc:  # reset or broken pipe: the server gave up on us
            reacted()
            response.error = f"{type(exc).__name__}: {exc}"
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            except OSError as exc:
                reacted()
                response.error = response.error or f"{type(exc).__name__}: {exc}"
                break
            reacted()
            if not chunk:
                break
            raw += chunk
        if response.reacted is None:
            response.timed_out = True
    response.elapsed = time.monotonic() - started
    response.raw = bytes(raw)
    _parse(response.raw, response)
    return response
