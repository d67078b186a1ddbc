"""Every request is bounded: in Redis script time, entries copied, fork work, body
size, memory, and time a client may hold a connection.

Script time is measured with Redis' SLOWLOG and printed; the assertions allow
20x the expected worst case (a few ms), so only unbounded work fails them.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import orjson
import pytest
from aiohttp import web
from aiohttp.client_exceptions import ClientConnectionResetError
from aiohttp.test_utils import make_mocked_request

from gateway.config import Settings
from gateway.http.app import GATEWAY
from gateway.http.bodies import BodyBudget
from gateway.http.context import Gateway
from gateway.http.endpoint import endpoint
from gateway.http.guard import Guard
from gateway.protocol import offsets
from gateway.redis_io import keys
from gateway.redis_io.limits import MAX_FORK_DEPTH, MAX_READ_ENTRIES

from .conftest import free_port, start_gateway

JSON = {"Content-Type": "application/json"}
BYTES = {"Content-Type": "application/octet-stream"}
TEXT = {"Content-Type": "text/plain; charset=utf-8"}


async def slowest_script_ms(redis) -> float:
    entries = await redis.slowlog_get(1024)
    scripts = [e["duration"] for e in entries if e["command"].split(b" ", 1)[0].upper() == b"EVALSHA"]
    return max(scripts, default=0) / 1000


async def test_reads_and_forks_copy_a_bounded_number_of_entries(redis_url, redis, http) -> None:
    # Every read in bulk (XRANGE, then JSON split by the gateway): a page copies at most
    # MAX_READ_ENTRIES entries, and a catch-up answer is read page after page to the tail.
    server = await start_gateway(redis_url, read_inline_bytes=0)
    try:
        base = f"/v1/stream/bounds-{uuid.uuid4().hex[:8]}"
        url = str(server.make_url(base))
        async with http.put(url, headers=JSON) as r:
            assert r.status == 201
        batch = b"[" + b",".join(b"%d" % n for n in range(1000)) + b"]"
        await asyncio.gather(*(http.post(url, data=batch, headers=JSON) for _ in range(50)))  # 50,000
        await redis.config_set("slowlog-log-slower-than", 0)
        await redis.slowlog_reset()
        async with http.get(url, params={"offset": "-1"}) as r:
            messages = await r.json()
        assert messages == list(range(1000)) * 50  # whole, in bounded pages
        # A fork 30,000 messages past the start: counted in pages of bounded reads.
        fork = str(server.make_url(base + "-fork"))
        headers = {**JSON, "Stream-Forked-From": base, "Stream-Fork-Offset": offsets.encode(0),
                   "Stream-Fork-Sub-Offset": "30000"}  # fmt: skip
        async with http.put(fork, headers=headers) as r:
            assert r.status == 201, await r.text()
            assert r.headers["Stream-Next-Offset"] == offsets.encode(
                len(b"".join(b"%d" % n for n in range(1000))) * 30
            )
        headers["Stream-Fork-Sub-Offset"] = str(10**12)
        async with http.put(fork + "2", headers=headers) as r:
            assert r.status == 400
        # A byte stream of 20,000 one-byte entries, read whole in bulk pages of at most
        # MAX_READ_ENTRIES entries.
        raw = str(server.make_url(base + "-bytes"))
        async with http.put(raw, headers=BYTES) as r:
            assert r.status == 201
        store = server.app[GATEWAY].store
        sid = keys.stream_id(base.split("/v1/stream/", 1)[1] + "-bytes")
        one = {"close": False, "stream_seq": None, "producer": None}
        kind = "application/octet-stream"
        await asyncio.gather(*(store.append(sid, kind, [(1, b"x")], **one) for _ in range(20_000)))
        async with http.get(raw, params={"offset": "-1"}) as r:
            assert await r.read() == b"x" * 20_000
        assert MAX_READ_ENTRIES < 20_000
        slowest = await slowest_script_ms(redis)
        print(f"slowest script: {slowest:.1f} ms")
        assert slowest < 100, f"a script ran {slowest:.0f} ms"
    finally:
        await redis.config_set("slowlog-log-slower-than", 10000)
        await server.close()


async def test_any_body_within_the_limit_is_stored_by_bounded_scripts(redis_url, redis, http) -> None:
    """The official clients batch on their own: a JSON array of millions of messages, or
    tens of MiB of bytes, in one request. Stored in bounded entries, by scripts that each
    run a few milliseconds (SLOWLOG), read back message by message. Default settings."""
    server = await start_gateway(redis_url)
    try:
        await _any_body(redis, http, str(server.make_url(f"/v1/stream/any-{uuid.uuid4().hex[:8]}")))
    finally:
        await redis.config_set("slowlog-log-slower-than", 10000)
        await server.close()


async def _any_body(redis, http, url: str) -> None:
    async with http.put(url, headers=JSON) as r:
        assert r.status == 201
    await redis.config_set("slowlog-log-slower-than", 0)
    await redis.slowlog_reset()
    ones = b"[" + b",".join([b"1"] * (2 * 1024 * 1024 - 1)) + b"]"  # 4 MiB: 2,097,151 messages
    objects = orjson.dumps([{"i": n} for n in range(100_000)])  # an IdempotentProducer's batch
    for body in (ones, objects):
        async with http.post(url, data=body, headers=JSON) as r:
            assert r.status == 204, await r.text()
    json_slowest = await slowest_script_ms(redis)
    sizes = [len(orjson.dumps({"i": n})) for n in range(100_000)]
    tail = 2 * 1024 * 1024 - 1 + sum(sizes)
    async with http.head(url) as r:
        assert r.headers["Stream-Next-Offset"] == offsets.encode(tail)
    # Reads start at any message, inside a stored group too (and at an offset + 1).
    # Each read answers everything to the tail (4 MiB and 1.3 MiB: under --max-chunk-bytes).
    ones_count = 2 * 1024 * 1024 - 1
    for start, first in ((0, 1), (1_000_000, 1), (ones_count, {"i": 0})):
        for token in (
            offsets.encode(start),
            offsets.encode(start)[:-1] + str(int(offsets.encode(start)[-1]) + 1),
        ):
            async with http.get(url, params={"offset": token}) as r:
                got = await r.json()
                assert got[0] == first and len(got) == ones_count - min(start, ones_count) + 100_000
                assert r.headers["Stream-Next-Offset"] == offsets.encode(tail)
    at = 2 * 1024 * 1024 - 1 + sum(sizes[:54_321])
    async with http.get(url, params={"offset": offsets.encode(at)}) as r:
        assert await r.json() == [{"i": n} for n in range(54_321, 100_000)]
        assert r.headers["Stream-Next-Offset"] == offsets.encode(tail)
    # A fork inside a group: its own data starts exactly there.
    headers = {
        **JSON,
        "Stream-Forked-From": url.split("/v1/stream/")[1],
        "Stream-Fork-Offset": offsets.encode(at),
    }
    async with http.put(url + "-fork", headers=headers) as r:
        assert r.status == 201, await r.text()
    async with http.get(url + "-fork", params={"offset": offsets.encode(at)}) as r:
        assert r.headers["Stream-Next-Offset"] == offsets.encode(at)  # up to date: nothing of its own
    # Bytes: one 48 MiB body (cut into bounded entries) and 15 concurrent 1 MiB appends.
    raw = url + "-bytes"
    async with http.put(raw, headers=BYTES) as r:
        assert r.status == 201
    await redis.slowlog_reset()
    big = os.urandom(48 * 1024 * 1024)
    async with http.post(raw, data=big, headers=BYTES) as r:
        assert r.status == 204, await r.text()
    mib = [bytes([n]) * (1024 * 1024) for n in range(15)]
    statuses = await asyncio.gather(*(_post_status(http, raw, data) for data in mib))
    assert statuses == [204] * 15
    bytes_slowest = await slowest_script_ms(redis)
    async with http.get(raw, params={"offset": offsets.encode(len(big) - 10)}) as r:
        assert (await r.read())[:10] == big[-10:]
    print(f"slowest script: JSON {json_slowest:.1f} ms, bytes {bytes_slowest:.1f} ms")
    assert json_slowest < 100 and bytes_slowest < 100, (json_slowest, bytes_slowest)


async def _post_status(http, url: str, data: bytes) -> int:
    async with http.post(url, data=data, headers=BYTES) as r:
        return r.status


async def test_fork_chains_are_bounded(http, gateway) -> None:
    base = f"chain-{uuid.uuid4().hex[:8]}"
    async with http.put(f"{gateway}/{base}-0", data=b"a", headers=TEXT) as r:
        assert r.status == 201
    for depth in range(1, MAX_FORK_DEPTH + 2):
        async with http.post(f"{gateway}/{base}-{depth - 1}", data=b"b", headers=TEXT) as r:
            assert r.status == 204
        headers = {**TEXT, "Stream-Forked-From": f"/v1/stream/{base}-{depth - 1}"}
        async with http.put(f"{gateway}/{base}-{depth}", headers=headers) as r:
            if depth < MAX_FORK_DEPTH:
                assert r.status == 201, (depth, await r.text())
            elif r.status == 400:
                break
    else:
        raise AssertionError("no bound on fork depth")
    async with http.get(f"{gateway}/{base}-{MAX_FORK_DEPTH - 1}", params={"offset": "-1"}) as r:
        assert r.status == 200


async def test_deleted_streams_leave_no_archive_hint_and_no_worker_means_no_hints(
    http, gateway, redis
) -> None:
    url = f"{gateway}/hinted-{uuid.uuid4().hex[:8]}"
    sid = keys.stream_id(url.split("/v1/stream/", 1)[1])
    await redis.delete(keys.ARCHIVE_WORKER_ALIVE)
    async with http.put(url, data=b"x", headers=TEXT) as r:
        assert r.status == 201
    await asyncio.sleep(1.5)  # a hints flush: no worker alive, nothing sent
    assert await redis.zscore(keys.ARCHIVE_HINTS, sid) is None
    await redis.set(keys.ARCHIVE_WORKER_ALIVE, "test", px=60_000)
    try:
        async with http.post(url, data=b"y", headers=TEXT) as r:
            assert r.status == 204
        for _ in range(30):
            if await redis.zscore(keys.ARCHIVE_HINTS, sid) is not None:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("no hint while a worker is alive")
        async with http.delete(url) as r:
            assert r.status == 204
        assert await redis.zscore(keys.ARCHIVE_HINTS, sid) is None
    finally:
        await redis.delete(keys.ARCHIVE_WORKER_ALIVE)


async def test_sse_text_is_cut_on_character_boundaries(http, url) -> None:
    """The session gateway reads 64 bytes at a time: 3- and 4-byte characters cross
    every chunk edge somewhere in this text."""
    text = "€uro 😀 ü " * 40
    async with http.put(url, data=text.encode(), headers=TEXT) as r:
        assert r.status == 201
    async with http.post(url, headers={"Stream-Closed": "true"}) as r:
        assert r.status == 204
    got = []
    async with http.get(url, params={"offset": "-1", "live": "sse"}) as r:
        event = None
        async for line in r.content:
            line = line.decode().rstrip("\n")
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and event == "data":
                value = line[5:]
                got.append(value[1:] if value.startswith(" ") else value)  # SSE strips one space
    assert "\ufffd" not in "".join(got)
    assert "".join(got) == text


def raw_connect(url: str) -> socket.socket:
    host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
    return socket.create_connection((host, int(port)), timeout=10)


async def test_slow_bodies_are_cut_off_and_bodies_in_flight_are_capped(redis_url, http) -> None:
    server = await start_gateway(
        redis_url, body_timeout=1.0, max_inflight_body_bytes=4500, max_body_bytes=2000
    )
    try:
        url = str(server.make_url(f"/v1/stream/slow-{uuid.uuid4().hex[:8]}"))
        path = "/" + url.split("//", 1)[1].split("/", 1)[1]
        async with http.put(url, headers=TEXT) as r:
            assert r.status == 201

        def slow_sender(size: int, send: int) -> tuple[int, float]:
            started = time.monotonic()
            with raw_connect(url) as s:
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
                          f"Content-Length: {size}\r\n\r\n".encode() + b"x" * send)  # fmt: skip
                answer = s.recv(4096)  # ... and never the rest
            return int(answer.split(b" ", 2)[1]), time.monotonic() - started

        # Two senders each reserve their declared 2,000 bytes of the 4,500-byte budget and
        # stall; a third body then finds no room: 503 with Retry-After, at once.
        holders = [asyncio.create_task(asyncio.to_thread(slow_sender, 2000, 1500)) for _ in range(2)]
        await asyncio.sleep(0.3)
        async with http.post(url, data=b"y" * 1000, headers=TEXT) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
        for status, took in await asyncio.gather(*holders):
            assert status == 408 and took < 5
        async with http.post(url, data=b"y" * 1000, headers=TEXT) as r:
            assert r.status == 204  # the budget is free again
        async with http.get(url, params={"offset": "-1"}) as r:
            assert await r.read() == b"y" * 1000
    finally:
        await server.close()


async def test_a_body_in_pieces_is_stored_whole_and_one_cut_short_not_at_all(redis_url, http) -> None:
    """A body larger than the fast path takes (bodies.py reads it as it arrives, in the
    pieces the parser hands over): every byte in order, or nothing when the client leaves."""
    server = await start_gateway(redis_url, body_timeout=10.0)
    try:
        url = str(server.make_url(f"/v1/stream/pieces-{uuid.uuid4().hex[:8]}"))
        path = "/" + url.split("//", 1)[1].split("/", 1)[1]
        async with http.put(url, headers=BYTES) as r:
            assert r.status == 201
        body = os.urandom(3 << 20)  # 3 MiB: several steps (STEP_BYTES) as well
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip

        def send(pieces: int, upto: int) -> bytes:
            with raw_connect(url) as s:
                s.sendall(head)
                step = -(-upto // pieces)
                for at in range(0, upto, step):
                    s.sendall(body[at : min(upto, at + step)])
                    time.sleep(0.05)
                if upto < len(body):
                    return b""  # gone before the end of its body
                return s.recv(4096)

        answer = await asyncio.to_thread(send, 9, len(body))
        assert answer.startswith(b"HTTP/1.1 204"), answer[:200]
        await asyncio.to_thread(send, 5, len(body) // 2)
        await asyncio.sleep(0.3)
        async with http.get(url, params={"offset": "-1"}) as r:
            assert r.status == 200 and await r.read() == body
    finally:
        await server.close()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def serve(redis_url: str, port: int, *flags: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--redis-url", redis_url, "--port", str(port), *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise AssertionError("gateway did not start")


async def test_compression_bombs_do_not_take_memory(redis_url, http) -> None:
    port = free_port()
    process = serve(redis_url, port, "--max-body-bytes", str(64 << 20))  # 256 MiB of bodies in flight
    try:
        url = f"http://127.0.0.1:{port}/v1/stream/bomb-{uuid.uuid4().hex[:8]}"
        async with http.put(url, headers=TEXT) as r:
            assert r.status == 201
        bomb = gzip.compress(b"\0" * 200_000_000, compresslevel=9)  # ~200 KB that inflate to 200 MB
        before = rss_mb(process.pid)

        async def send() -> int:
            async with http.post(url, data=bomb, headers={**TEXT, "Content-Encoding": "gzip"}) as r:
                return r.status

        statuses = await asyncio.gather(*(send() for _ in range(8)))
        assert set(statuses) <= {413, 503} and 413 in statuses, statuses  # too large, or no room now
        grown = rss_mb(process.pid) - before
        print(f"gateway RSS grew {grown:.0f} MB after 8 bombs of 200 MB ({statuses})")
        assert grown < 150
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.parametrize("workers", [1, 2])
async def test_sigterm_with_stalled_sse_readers_ends_within_seconds(redis_url, http, workers) -> None:
    """SSE readers that never read (their socket buffers full) must not hold a
    shutdown, and neither must any background task after traffic."""
    port = free_port()
    process = serve(
        redis_url, port, "--workers", str(workers), "--write-timeout", "2", "--sse-cycle-seconds", "3"
    )
    try:
        url = f"http://127.0.0.1:{port}/v1/stream/stalled-{uuid.uuid4().hex[:8]}"
        async with http.put(url, headers=BYTES) as r:
            assert r.status == 201
        path = "/" + url.split("//", 1)[1].split("/", 1)[1]
        readers = []
        for _ in range(4):
            s = raw_connect(url)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(f"GET {path}?offset=-1&live=sse HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            readers.append(s)  # never read from again
        chunk = os.urandom(256 * 1024)
        for _ in range(40):  # 10 MB: far more than the sockets hold
            async with http.post(url, data=chunk, headers=BYTES) as r:
                assert r.status == 204
        await asyncio.sleep(0.5)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(process.wait, 20)
        took = time.monotonic() - started
        print(f"SIGTERM to exit: {took:.1f} s ({workers} worker(s))")
        assert took < 8, took
        for s in readers:
            s.close()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def test_a_client_gone_is_no_error(caplog) -> None:
    """A handler that finds its client gone (SSE headers written to a closed connection,
    seen under load) answers nobody: no 500, no ERROR line with a traceback."""

    async def handler(request: web.Request) -> web.Response:
        raise ClientConnectionResetError("Cannot write to closing transport")

    app = web.Application()
    settings = Settings()
    app[GATEWAY] = Gateway(
        settings=settings,
        store=None,
        fanout=None,
        bodies=BodyBudget(1),
        guard=Guard(settings),
        preflight=None,
    )  # type: ignore[arg-type]
    request = make_mocked_request("GET", "/v1/stream/x", app=app)
    with caplog.at_level(logging.INFO):
        response = await endpoint(handler, "stream")(request)
    assert response.status == 499
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
