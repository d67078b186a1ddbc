"""Streamed catch-up answers under faults (issue 41), with real processes.

A catch-up read answers everything from its offset to the tail (up to --max-chunk-bytes),
read page by page while it is sent (gateway/http/catchup.py). Here:

* a reader that stops reading pauses the reads: the gateway's RSS stays bounded while
  it sits on a 128 MiB answer, and the pages it holds (ds_read_budget_bytes) stay at two;
* one that goes away stops them: the pages held go back to none, the answer counts as
  broken by its client;
* Redis killed mid-answer: the client sees a broken body (shorter than its
  Content-Length, or without its last chunk), never a short body that looks whole; once
  Redis is back, the same read answers whole.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import socket
import time
import urllib.request
from pathlib import Path

import aiohttp
import orjson
import pytest

from gateway.cli.embedded import find_redis_server

from . import harness

MIB = 1024 * 1024
PAGE = MIB
SIZE = 128 * MIB
BYTES = {"Content-Type": "application/octet-stream"}
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def deployment(tmp_path: Path):  # type: ignore[no-untyped-def]
    try:
        find_redis_server()
    except RuntimeError:
        pytest.skip("needs a redis-server binary")
    flags = ["--read-page-bytes", str(PAGE), "--write-timeout", "60"]
    with harness.cluster(tmp_path, gateways=1, archivers=0, gateway_flags=flags) as cluster:
        yield cluster


def _block(n: int) -> bytes:
    return hashlib.sha256(b"%d" % n).digest() * (8 * MIB // 32)


async def _fill_bytes(http: aiohttp.ClientSession, url: str) -> str:
    async with http.put(url, headers=BYTES) as r:
        assert r.status == 201
    whole = hashlib.sha256()
    for n in range(SIZE // (8 * MIB)):
        async with http.post(url, data=_block(n), headers=BYTES) as r:
            assert r.status == 204, await r.text()
        whole.update(_block(n))
    return whole.hexdigest()


def _rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


def _metric(base: str, name: str, label: str = "") -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not label or label in line) and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] == name:
                total += float(value)
    return total


async def test_a_reader_that_stops_pauses_the_reads_and_one_that_leaves_stops_them(deployment) -> None:
    gw = deployment.gateways[0]
    url = f"{gw.base}/v1/stream/catchup-slow"
    async with aiohttp.ClientSession() as http:
        await _fill_bytes(http, url)
    rss_before = _rss(gw.pid)
    broken_before = _metric(gw.base, "ds_reads_broken_total", 'reason="client"')
    # A reader with a small receive buffer that takes 1 MiB of the answer, then nothing.
    sock = socket.create_connection(("127.0.0.1", gw.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.sendall(b"GET /v1/stream/catchup-slow?offset=-1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    sock.settimeout(30)
    first = sock.recv(256 * 1024)
    assert first.startswith(b"HTTP/1.1 200"), first[:200]
    got = len(first)
    while got < MIB:
        part = sock.recv(256 * 1024)
        assert part, "the answer ended early"
        got += len(part)
    held, rss = [], []
    for _ in range(20):  # 2 s sitting on the answer
        await asyncio.sleep(0.1)
        held.append(_metric(gw.base, "ds_read_budget_bytes"))
        rss.append(_rss(gw.pid))
    assert max(held) <= 2 * PAGE, held  # two pages at most: the one being sent, the next
    assert held[-1] > 0  # still under way, paused
    growth = max(rss) - rss_before
    print(f"RSS before {rss_before / MIB:.0f} MiB, most while paused {max(rss) / MIB:.0f} MiB")
    assert growth < 48 * MIB, f"RSS grew {growth / MIB:.0f} MiB on a paused 128 MiB answer"
    sock.close()  # gone: its reads stop, what they held is given back
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _metric(gw.base, "ds_read_budget_bytes") > 0:
        await asyncio.sleep(0.1)
    assert _metric(gw.base, "ds_read_budget_bytes") == 0
    assert _metric(gw.base, "ds_reads_broken_total", 'reason="client"') == broken_before + 1


@pytest.mark.parametrize("kind", ["bytes", "json"])
async def test_redis_killed_mid_answer_breaks_the_body(deployment, kind: str) -> None:
    gw, redis = deployment.gateways[0], deployment.redis
    url = f"{gw.base}/v1/stream/catchup-kill-{kind}"
    timeout = aiohttp.ClientTimeout(total=120, sock_read=30)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        if kind == "bytes":
            digest = await _fill_bytes(http, url)
        else:
            async with http.put(url, headers=JSON) as r:
                assert r.status == 201
            for n in range(8):  # 400,000 messages, ~40 MiB
                batch = orjson.dumps([{"n": n * 50_000 + i, "pad": "p" * 64} for i in range(50_000)])
                async with http.post(url, data=batch, headers=JSON) as r:
                    assert r.status == 204, await r.text()
        received = 0
        with pytest.raises(aiohttp.ClientError):
            async with http.get(url, params={"offset": "-1"}, headers={"Accept-Encoding": "identity"}) as r:
                assert r.status == 200
                declared = r.headers.get("Content-Length")
                async for part in r.content.iter_chunked(64 * 1024):
                    received += len(part)
                    if redis.pid is not None and received >= 2 * MIB:
                        redis.kill()  # SIGKILL, mid-answer
                    await asyncio.sleep(0)
                await r.read()
        print(f"{kind}: broken after {received / MIB:.1f} MiB (declared {declared})")
        assert received < (SIZE if kind == "bytes" else 40 * MIB)
        redis.start()
        assert gw.wait_ready(30), gw.log_tail()
        async with http.get(url, params={"offset": "-1"}) as r:
            assert r.status == 200
            body = await r.read()
        if kind == "bytes":
            assert hashlib.sha256(body).hexdigest() == digest  # acknowledged appends survive (AOF)
        else:
            assert [m["n"] for m in orjson.loads(body)] == list(range(400_000))
        assert _metric(gw.base, "ds_reads_broken_total", 'reason="server"') >= 1
