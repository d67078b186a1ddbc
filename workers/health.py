"""The archive worker's liveness: a heartbeat its loop keeps, and the HTTP server
on ``--metrics-port`` that answers ``/healthz`` from it (and ``/metrics``).

The loop beats after every pass, every stream it works on, every batch of a
reconciliation and every lease renewal, each time saying when the next beat is
due at the latest (an idle loop sleeps ``--archive-interval``). ``/healthz``
answers 503 once that moment is more than ``--archive-stall-seconds`` past: the
loop is stuck (a call that never returns, e.g. to a Redis that stopped
answering; a blocked event loop). A liveness probe then restarts the worker;
its leases expire and other workers take its streams.

The server runs in a thread of its own, not on the event loop: a blocked loop
must not also block the probe that is to report it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from gateway.config import Settings
from gateway.telemetry import metrics


class Heartbeat:
    """When the loop last showed progress, and whether that is too long ago."""

    def __init__(
        self,
        stall_seconds: float = Settings.archive_stall_seconds,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stall_seconds = stall_seconds
        self._clock = clock
        self._last = clock()
        self._due = self._last  # the next beat is expected by then

    def beat(self, next_within: float = 0.0) -> None:
        """Progress now; the next beat comes within ``next_within`` seconds (an idle wait)."""
        self._last = self._clock()
        self._due = self._last + next_within  # floats: one assignment each, safe to read from the probe

    def problem(self) -> str | None:
        """None while the loop keeps beating; else the one-line reason it is considered stuck."""
        now = self._clock()
        if now - self._due <= self.stall_seconds:
            return None
        return (
            f"stalled: the archive loop has made no progress for {now - self._last:.0f} s "
            f"(--archive-stall-seconds {self.stall_seconds:g})"
        )


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: no line each
        pass


def _app(heartbeat: Heartbeat) -> Callable[..., Iterable[bytes]]:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/healthz":
            problem = heartbeat.problem()
            status = "503 Service Unavailable" if problem else "200 OK"
            start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
            return [f"{problem or 'ok'}\n".encode()]
        body, content_type = metrics.render()  # any other path, as prometheus-client's own server
        start_response("200 OK", [("Content-Type", content_type)])
        return [body]

    return app


def serve(host: str, port: int, heartbeat: Heartbeat) -> WSGIServer:
    """``/healthz`` and ``/metrics`` on ``host:port``, in a daemon thread."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class: type[_Server] = type("Server", (_Server,), {"address_family": family})
    server = make_server(host, port, _app(heartbeat), server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-health", daemon=True).start()
    return server
