"""End-to-end latency: an append acknowledged → the same bytes at a live reader.

    python -m loadtest.latency --servers ours,reference,reference-memory [--rate 50 --seconds 10]

One writer appends 100-byte records to a text stream at ``--rate`` per second
(paced, not back to back); one SSE reader and one long-poll reader tail the
stream from ``now``. For every record we note when the POST was sent, when
its 2xx arrived, and when each reader got it, and report ack→receive (what a
user of a chat or job stream waits after the server confirmed a write) and
send→receive. All on loopback, in one process, bounded by ``--seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from pathlib import Path

import aiohttp

from .servers import KINDS, client_headers, start, use_uvloop
from .sse_client import sse_lines

RECORD = 100  # bytes; the first 10 are the record's number


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


async def sse_reader(
    http: aiohttp.ClientSession, url: str, got: dict[int, float], stop: asyncio.Event
) -> None:
    offset = "now"
    buffer = ""
    while not stop.is_set():
        async with http.get(url, params={"offset": offset, "live": "sse"}) as r:
            async for event, data in sse_lines(r):
                if event == "data":
                    buffer += data
                    while len(buffer) >= RECORD:
                        got.setdefault(int(buffer[:10]), time.perf_counter())
                        buffer = buffer[RECORD:]
                elif event == "control":
                    offset = json.loads(data).get("streamNextOffset", offset)
                if stop.is_set():
                    return


async def long_poll_reader(
    http: aiohttp.ClientSession, url: str, got: dict[int, float], stop: asyncio.Event
) -> None:
    offset = "now"
    while not stop.is_set():
        async with http.get(url, params={"offset": offset, "live": "long-poll"}) as r:
            body = await r.read()
            now = time.perf_counter()
            offset = r.headers.get("Stream-Next-Offset", offset)
        for i in range(0, len(body) - RECORD + 1, RECORD):
            got.setdefault(int(body[i : i + 10]), now)


async def run(base_url: str, server: str, rate: float, seconds: float) -> dict:
    url = f"{base_url}/latency-{uuid.uuid4().hex[:8]}"
    sent: dict[int, float] = {}
    acked: dict[int, float] = {}
    by_reader: dict[str, dict[int, float]] = {"sse": {}, "long-poll": {}}
    stop = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout, headers=client_headers(server)) as http:
        async with http.put(url, headers={"Content-Type": "text/plain"}) as r:
            assert r.status in (200, 201), r.status
        readers = [
            asyncio.create_task(sse_reader(http, url, by_reader["sse"], stop)),
            asyncio.create_task(long_poll_reader(http, url, by_reader["long-poll"], stop)),
        ]
        await asyncio.sleep(1.0)  # readers connected and waiting
        start = time.perf_counter()
        n = 0
        while time.perf_counter() - start < seconds:
            due = start + n / rate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            body = f"{n:010d}".encode().ljust(RECORD, b".")
            sent[n] = time.perf_counter()
            async with http.post(url, data=body, headers={"Content-Type": "text/plain"}) as r:
                assert r.status in (200, 204), r.status
            acked[n] = time.perf_counter()
            n += 1
        for _ in range(50):  # let the last records arrive
            if all(len(g) >= n for g in by_reader.values()):
                break
            await asyncio.sleep(0.1)
        stop.set()
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    result: dict = {"server": server, "appends": n, "rate": rate}
    for reader, got in by_reader.items():
        ack = [1000 * (got[i] - acked[i]) for i in got if i in acked]
        send = [1000 * (got[i] - sent[i]) for i in got if i in sent]
        result[reader] = {
            "received": len(got),
            "ack_p50_ms": round(percentile(ack, 0.5), 2),
            "ack_p99_ms": round(percentile(ack, 0.99), 2),
            "send_p50_ms": round(percentile(send, 0.5), 2),
            "send_p99_ms": round(percentile(send, 0.99), 2),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--servers", default="ours", help=f"comma list of {', '.join(KINDS)}")
    parser.add_argument("--base-url", help="measure a running server instead (its stream prefix URL)")
    parser.add_argument("--rate", type=float, default=50.0, help="appends per second")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", default="loadtest/results/latency.json")
    args = parser.parse_args()
    use_uvloop()
    targets = [("target", args.base_url)] if args.base_url else [(k, None) for k in args.servers.split(",")]
    results = []
    for name, base_url in targets:
        if base_url:
            results.append(asyncio.run(run(base_url, name, args.rate, args.seconds)))
        else:
            with start(name) as server:
                results.append(asyncio.run(run(server.base_url, name, args.rate, args.seconds)))
        r = results[-1]
        for reader in ("sse", "long-poll"):
            m = r[reader]
            print(f"{r['server']:<18} {reader:<10} {m['received']:>5}/{r['appends']} received  "
                  f"ack→recv p50 {m['ack_p50_ms']:>6} p99 {m['ack_p99_ms']:>7} ms  "
                  f"send→recv p50 {m['send_p50_ms']:>6} p99 {m['send_p99_ms']:>7} ms",
                  flush=True)  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
