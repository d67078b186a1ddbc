"""Slow and stuck clients must not hold the server: bounded body reads, bounded shutdown.

* A request body trickled at 1 byte/second (or stalled after a few bytes) is
  cut off (4xx, 408 ideally, or the connection closed) within the body read
  timeout plus a margin, stores nothing, and does not slow anyone else.
* SSE clients that never read their socket (their buffers full) must not keep
  a gateway from exiting: after SIGTERM it exits within its shutdown grace
  period plus a margin.

The settings these need are passed through the environment, under the names
of the gateway's settings (``DURABLE_STREAMS_<SETTING>``: a gateway without
such a setting ignores the variable, and the test then fails on its bound):

* ``body_timeout`` (``--body-timeout``): seconds a client may take to send a whole body;
* ``keepalive_seconds`` (``--keepalive-seconds``): seconds a client may take to send its request head;
* ``shutdown_seconds`` (``--shutdown-seconds``): the grace period after SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest

from gateway.cli.embedded import find_redis_server

from . import harness, rawhttp
from .conftest import Summary
from .workload import PREFIX, TEXT

BODY_TIMEOUT = 3.0
HEADER_TIMEOUT = 3.0
SHUTDOWN_SECONDS = 3.0
MARGIN = 5.0  # on a loaded 2-core machine
TRICKLE_SECONDS = 15  # how long a slow client keeps going if nobody stops it
ENV = {
    "DURABLE_STREAMS_BODY_TIMEOUT": str(BODY_TIMEOUT),
    "DURABLE_STREAMS_KEEPALIVE_SECONDS": str(HEADER_TIMEOUT),
    "DURABLE_STREAMS_SHUTDOWN_SECONDS": str(SHUTDOWN_SECONDS),
}


@pytest.fixture
def one_gateway(tmp_path: Path):  # type: ignore[no-untyped-def]
    try:
        find_redis_server()
    except RuntimeError:
        pytest.skip("needs a redis-server binary")
    flags = ["--sse-heartbeat-seconds", "1"]
    with harness.cluster(tmp_path, gateways=1, archivers=0, gateway_flags=flags, gateway_env=ENV) as cluster:
        yield cluster.gateways[0]


def head(method: str, path: str, headers: list[tuple[str, str]]) -> bytes:
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: 127.0.0.1",
        "Connection: close",
        *(f"{k}: {v}" for k, v in headers),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def verdict(name: str, r: rawhttp.RawResponse, bound: float) -> list[str]:
    """A slow request must be cut off in time: a 4xx or the connection closed, never a 5xx."""
    if r.reacted is None or r.reacted > bound:
        when = "never" if r.reacted is None else f"only after {r.reacted:.1f}s"
        return [f"{name}: still connected after {r.elapsed:.1f}s of trickling; the server reacted {when}, "
                f"bound {bound:.0f}s"]  # fmt: skip
    if r.status is not None and not 400 <= r.status < 500:
        return [f"{name}: cut off after {r.reacted:.1f}s, but answered {r.describe()}; expected a 4xx (408)"]
    return []


async def test_trickled_bodies_are_cut_off(one_gateway: harness.GatewayProc, summary: Summary) -> None:
    gw = one_gateway
    async with aiohttp.ClientSession() as http:
        async with http.put(f"{gw.base}{PREFIX}victim", data=b"kept;", headers=TEXT) as r:
            assert r.status == 201
        async with http.put(f"{gw.base}{PREFIX}other", headers=TEXT) as r:
            assert r.status == 201
        victim = f"{PREFIX}victim"
        slow = {
            "POST body at 1 byte/s": [head("POST", victim, [("Content-Type", "text/plain"),
                                                            ("Content-Length", "64")])] + [b"x"] * 64,
            "POST body stalled after 2 bytes": [head("POST", victim, [("Content-Type", "text/plain"),
                                                                      ("Content-Length", "64")]) + b"x;"]
            + [b""] * TRICKLE_SECONDS,
            "POST chunked body, a 1-byte chunk per second": [head("POST", victim, [
                ("Content-Type", "text/plain"), ("Transfer-Encoding", "chunked")])] + [b"1\r\nx\r\n"] * 64,
            "PUT (create) body at 1 byte/s": [head("PUT", f"{PREFIX}fresh", [
                ("Content-Type", "text/plain"), ("Content-Length", "64")])] + [b"x"] * 64,
        }  # fmt: skip
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(len(slow)) as pool:
            futures = {
                name: loop.run_in_executor(
                    pool,
                    lambda parts=parts: rawhttp.send_parts(
                        gw.port, parts, delay=1.0, timeout=TRICKLE_SECONDS
                    ),
                )
                for name, parts in slow.items()
            }
            # Meanwhile everyone else is served as usual.
            others: list[str] = []
            for i in range(20):
                began = time.monotonic()
                async with http.post(f"{gw.base}{PREFIX}other", data=f"o:{i};", headers=TEXT) as r:
                    if r.status != 204 or time.monotonic() - began > 2:
                        others.append(f"append {i}: {r.status} after {time.monotonic() - began:.1f}s")
                await asyncio.sleep(0.1)
            results = {name: await future for name, future in futures.items()}
        failures = [f for name, r in results.items() for f in verdict(name, r, BODY_TIMEOUT + MARGIN)]
        if others:
            failures.append(f"other clients' appends suffered while slow clients trickled: {others}")
        async with http.get(f"{gw.base}{PREFIX}victim") as r:
            body = await r.read()
            if body != b"kept;":
                failures.append(f"the cut-off requests stored data: stream 'victim' reads {body!r}")
        async with http.head(f"{gw.base}{PREFIX}fresh") as r:
            if r.status != 404:
                failures.append(f"the cut-off PUT created stream 'fresh' (HEAD {r.status})")
    summary.bad_inputs += len(slow)
    summary.violations += len(failures)
    if failures:
        pytest.fail(
            f"slow request bodies (gateway started with DURABLE_STREAMS_BODY_TIMEOUT={BODY_TIMEOUT}, i.e. "
            f"--body-timeout; bound {BODY_TIMEOUT + MARGIN:.0f}s):\n  " + "\n  ".join(failures),
            pytrace=False,
        )


async def test_trickled_request_heads_are_cut_off(one_gateway: harness.GatewayProc, summary: Summary) -> None:
    gw = one_gateway
    request = head("GET", f"{PREFIX}victim?offset=-1", [("X-Padding", "y" * 64)])
    parts = [request[i : i + 1] for i in range(len(request))]
    r = await asyncio.to_thread(rawhttp.send_parts, gw.port, parts, delay=1.0, timeout=TRICKLE_SECONDS)
    failures = verdict("request head at 1 byte/s", r, HEADER_TIMEOUT + MARGIN)
    summary.bad_inputs += 1
    summary.violations += len(failures)
    if failures:
        pytest.fail(
            f"slow request head (gateway started with DURABLE_STREAMS_KEEPALIVE_SECONDS={HEADER_TIMEOUT}, "
            f"i.e. --keepalive-seconds; bound {HEADER_TIMEOUT + MARGIN:.0f}s): {failures}",
            pytrace=False,
        )


def stuck_sse_client(port: int, path: str) -> socket.socket:
    """An SSE request from a client that never reads: a tiny receive buffer, soon full."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(head("GET", f"{path}?offset=-1&live=sse", []))
    return sock


async def test_sigterm_with_stuck_sse_clients_exits_within_grace(
    one_gateway: harness.GatewayProc, summary: Summary
) -> None:
    gw = one_gateway
    path = f"{PREFIX}stuck"
    async with aiohttp.ClientSession() as http:
        async with http.put(f"{gw.base}{path}", headers=TEXT) as r:
            assert r.status == 201
        clients = [stuck_sse_client(gw.port, path) for _ in range(20)]
        try:
            await asyncio.sleep(0.5)
            chunk = b"0123456789abcdef" * 4096  # 64 KiB
            for _ in range(64):  # 4 MiB: far more than the stuck clients' buffers hold
                async with http.post(f"{gw.base}{path}", data=chunk, headers=TEXT) as r:
                    assert r.status == 204, r.status
            await asyncio.sleep(1.0)  # the gateway's writes to them block
            assert gw.running, f"gateway died before SIGTERM:\n{gw.log_tail()}"
            sent = time.monotonic()
            gw.signal(signal.SIGTERM)
            bound = SHUTDOWN_SECONDS + MARGIN
            deadline = sent + bound
            while gw.running and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            took = time.monotonic() - sent
            still_running = gw.running
            if still_running:
                gw.kill()
            code = gw.process.returncode if gw.process is not None else None
        finally:
            for sock in clients:
                sock.close()
    summary.violations += still_running or code != 0
    if still_running:
        pytest.fail(
            f"gateway still running {took:.1f}s after SIGTERM with 20 SSE clients that do not read "
            f"(DURABLE_STREAMS_SHUTDOWN_SECONDS={SHUTDOWN_SECONDS}, i.e. --shutdown-seconds; "
            f"bound {bound:.0f}s); log:\n{gw.log_tail()[-1500:]}",
            pytrace=False,
        )
    if code != 0:
        pytest.fail(
            f"gateway exited {took:.1f}s after SIGTERM with status {code}, expected 0:\n{gw.log_tail()}",
            pytrace=False,
        )
