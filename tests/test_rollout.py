"""A rolling update, as Kubernetes runs it: SSE clients survive pods going away.

Two gateway processes ("pods") share one Redis. SSE readers tail a stream on
the first while a writer appends through the other. The first pod gets
SIGTERM, its readers reconnect to the other pod at the offset of the last
control event; a new pod starts and the second one is stopped in turn. Every
reader ends with every record exactly once, in order.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request

import aiohttp

from loadtest.sse_client import sse_lines

from .conftest import free_port

RECORD = 16


def start_pod(redis_url: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--port", str(port), "--redis-url",
                             redis_url, "--log-level", "warning"])  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(f"{base}/readyz", timeout=1)
            break
        except OSError:
            assert proc.poll() is None
            time.sleep(0.1)
    return proc, base


async def reader(
    http: aiohttp.ClientSession, pods: list[str], path: str, got: bytearray, hops: list[str]
) -> None:
    """Follow the stream to its end, reconnecting to whichever pod is up (a Service would)."""
    offset = "-1"
    while True:
        base = pods[-1]
        hops.append(base)
        try:
            async with http.get(f"{base}/v1/stream/{path}", params={"offset": offset, "live": "sse"}) as r:
                async for event, data in sse_lines(r):
                    if event == "data":
                        got.extend(data.encode())
                    elif event == "control":
                        control = json.loads(data)
                        offset = control["streamNextOffset"]
                        if control.get("streamClosed"):
                            return
        except aiohttp.ClientError:
            await asyncio.sleep(0.05)  # the pod went away between requests: try the next one


async def test_rolling_update_loses_and_repeats_nothing(http, redis_url):
    pods_procs = [start_pod(redis_url), start_pod(redis_url)]
    pods = [base for _, base in pods_procs]  # the last one is where new connections go
    path = f"rollout-{free_port()}"
    async with http.put(f"{pods[0]}/v1/stream/{path}", headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 201
    live = [pods[0]]  # readers start on the first pod
    gots = [bytearray() for _ in range(5)]
    hops: list[list[str]] = [[] for _ in gots]
    readers = [asyncio.create_task(reader(http, live, path, g, h)) for g, h in zip(gots, hops, strict=True)]
    sent = bytearray()

    async def write(count: int, through: str) -> None:
        for _ in range(count):
            record = f"{len(sent) // RECORD:015d};".encode()
            async with http.post(f"{through}/v1/stream/{path}", data=record,
                                 headers={"Content-Type": "text/plain"}) as r:  # fmt: skip
                assert r.status == 204
            sent.extend(record)
            await asyncio.sleep(0.005)

    try:
        await write(50, pods[1])
        live.append(pods[1])  # the Service stops sending to pod 0, then it gets SIGTERM
        pods_procs[0][0].send_signal(signal.SIGTERM)
        await write(50, pods[1])
        assert pods_procs[0][0].wait(20) == 0
        new_proc, new_base = start_pod(redis_url)  # the new version comes up
        pods_procs.append((new_proc, new_base))
        live.append(new_base)
        pods_procs[1][0].send_signal(signal.SIGTERM)  # and the last old pod goes
        await write(50, new_base)
        assert pods_procs[1][0].wait(20) == 0
        async with http.post(f"{new_base}/v1/stream/{path}", headers={"Stream-Closed": "true"}) as r:
            assert r.status == 204
        await asyncio.wait_for(asyncio.gather(*readers), 30)
    finally:
        for task in readers:
            task.cancel()
        for proc, _ in pods_procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(20)
    for got, hop in zip(gots, hops, strict=True):
        assert bytes(got) == bytes(sent)  # every record once, in order
        assert {pods[0], pods[1], new_base} <= set(hop)  # and it really moved across all three pods
