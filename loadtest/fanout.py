"""Fan-out benchmark: N SSE subscribers on one stream, one writer.

    python -m loadtest.fanout --servers ours,reference --subscribers 100,1000
    python -m loadtest.fanout --base-url http://host:port/v1/stream --subscribers 1000

The writer appends ``--message-bytes`` messages at ``--rate`` per second for
``--duration`` seconds. Delivery latency is measured from the append's
acknowledgement to the event's arrival at each subscriber (an event can
arrive before its acknowledgement; those count as 0 ms). Every subscriber
must receive every message exactly once: losses and duplicates are counted.
Loopback only; every loop is bounded in count and time.

Subscribers are plain asyncio sockets, not an HTTP client library, so that
the load generator's own CPU cost stays small next to the server's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from .servers import KINDS, ProcessMeter, start

_SEQ = re.compile(rb"seq=(\d{8})\|")
_OFFSET = re.compile(rb'"streamNextOffset":"([^"]+)"')


@dataclass
class Subscriber:
    index: int
    received: dict[int, float] = field(default_factory=dict)  # seq -> arrival time
    duplicates: int = 0
    reconnects: int = 0
    offset: str = "now"


@dataclass
class Result:
    server: str
    subscribers: int
    connected: int
    rate: float
    duration: float
    messages: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    lost: int
    duplicated: int
    server_cpu_percent: float | None
    server_peak_rss_mb: float | None


async def _subscribe(sub: Subscriber, host: str, port: int, path: str, stop: asyncio.Event, ready) -> None:
    """One SSE subscriber; reconnects from the last control event when the server ends the response."""
    first = True
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.2)
            continue
        request = (
            f"GET {path}?offset={sub.offset}&live=sse HTTP/1.1\r\n"
            f"Host: {host}\r\nAccept: text/event-stream\r\n\r\n"
        )
        writer.write(request.encode())
        buffer = b""
        try:
            await reader.readuntil(b"\r\n\r\n")  # response headers
            if first:
                ready()
                first = False
            while not stop.is_set():
                chunk = await reader.read(65536)
                if not chunk:
                    break
                now = time.monotonic()
                buffer += chunk
                last_end = 0
                for match in _SEQ.finditer(buffer):
                    seq = int(match.group(1))
                    if seq in sub.received:
                        sub.duplicates += 1
                    else:
                        sub.received[seq] = now
                    last_end = match.end()
                offsets = _OFFSET.findall(buffer)
                if offsets:
                    sub.offset = offsets[-1].decode()
                buffer = buffer[max(last_end, len(buffer) - 64) :]
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
        sub.reconnects += 1


def _http(method: str, url: str, body: bytes = b"", content_type: str = "text/plain") -> None:
    request = urllib.request.Request(
        url, data=body or None, method=method, headers={"Content-Type": content_type}
    )
    urllib.request.urlopen(request, timeout=10).close()


async def run_one(base_url: str, server: str, subscribers: int, rate: float, duration: float,
                  message_bytes: int, pid: int | None) -> Result:  # fmt: skip
    url = f"{base_url}/fanout-{uuid.uuid4().hex[:8]}"
    await asyncio.to_thread(_http, "PUT", url)
    parts = urlsplit(url)
    stop = asyncio.Event()
    subs = [Subscriber(i) for i in range(subscribers)]
    connected = 0

    def ready() -> None:
        nonlocal connected
        connected += 1

    tasks = []
    for i in range(0, subscribers, 200):  # open connections in waves
        for sub in subs[i : i + 200]:
            tasks.append(
                asyncio.create_task(_subscribe(sub, parts.hostname, parts.port, parts.path, stop, ready))
            )
        await asyncio.sleep(0.05)
    deadline = time.monotonic() + 60
    while connected < subscribers and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)

    meter = ProcessMeter(pid) if pid else None
    acked: dict[int, float] = {}
    padding = b"x" * max(0, message_bytes - 13)
    total = int(rate * duration)
    started = time.monotonic()
    wall0 = time.monotonic()
    for seq in range(total):
        target = started + seq / rate
        delay = target - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        body = b"seq=%08d|" % seq + padding
        await asyncio.to_thread(_http, "POST", url, body)
        acked[seq] = time.monotonic()
        if meter and seq % max(1, int(rate)) == 0:
            meter.sample()
    await asyncio.sleep(2.0)  # grace for the last deliveries
    elapsed = time.monotonic() - wall0
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

    latencies = [
        max(0.0, sub.received[s] - acked[s]) * 1000 for sub in subs for s in sub.received if s in acked
    ]
    lost = sum(total - len([s for s in sub.received if s < total]) for sub in subs)
    latencies.sort()

    def pct(p: float) -> float:
        return (
            round(latencies[min(len(latencies) - 1, int(p * len(latencies)))], 2)
            if latencies
            else float("nan")
        )

    return Result(
        server=server,
        subscribers=subscribers,
        connected=connected,
        rate=rate,
        duration=duration,
        messages=total,
        p50_ms=round(statistics.median(latencies), 2) if latencies else float("nan"),
        p99_ms=pct(0.99),
        max_ms=round(latencies[-1], 2) if latencies else float("nan"),
        lost=lost,
        duplicated=sum(sub.duplicates for sub in subs),
        server_cpu_percent=round(100 * meter.cpu_used() / elapsed, 1) if meter else None,
        server_peak_rss_mb=round(meter.peak_rss_mb, 1) if meter else None,
    )


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for server in sorted({r.server for r in results}):
        rows = sorted((r for r in results if r.server == server), key=lambda r: r.subscribers)
        xs = [r.subscribers for r in rows]
        ax.plot(xs, [r.p99_ms for r in rows], marker="o", label=f"{server} p99")
        ax.plot(xs, [r.p50_ms for r in rows], marker=".", linestyle="--", label=f"{server} p50")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("SSE subscribers on one stream")
    ax.set_ylabel("delivery latency (ms, ack → event)")
    ax.set_title(f"SSE fan-out at {results[0].rate:g} msgs/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: list[Result]) -> str:
    head = "server            subs  conn   p50 ms   p99 ms   max ms  lost  dup  cpu %   rss MB"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.server:<16} {r.subscribers:>5} {r.connected:>5} {r.p50_ms:>8} {r.p99_ms:>8} {r.max_ms:>8} "
            f"{r.lost:>5} {r.duplicated:>4} {r.server_cpu_percent!s:>6} {r.server_peak_rss_mb!s:>8}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--servers", default="ours", help=f"comma list of {', '.join(KINDS)}")
    parser.add_argument("--base-url", help="benchmark a running server instead (its stream prefix URL)")
    parser.add_argument("--subscribers", default="1000", help="comma list, e.g. 100,1000,10000")
    parser.add_argument("--rate", type=float, default=50.0, help="appends per second")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of appending per run")
    parser.add_argument("--message-bytes", type=int, default=256)
    parser.add_argument("--out", default="loadtest/results", help="folder for fanout.json and fanout.png")
    args = parser.parse_args()
    counts = [int(n) for n in args.subscribers.split(",")]
    results: list[Result] = []

    async def bench(base_url: str, name: str, pid: int | None) -> None:
        for n in counts:
            result = await run_one(base_url, name, n, args.rate, args.duration, args.message_bytes, pid)
            results.append(result)
            print(table([result]).splitlines()[-1], flush=True)

    print(table([]))
    if args.base_url:
        asyncio.run(bench(args.base_url, "target", None))
    else:
        for kind in args.servers.split(","):  # one after the other, same machine, same run
            with start(kind) as server:
                asyncio.run(bench(server.base_url, kind, server.pid))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fanout.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    plot(results, out / "fanout.png")
    print(f"\n{table(results)}\n\nwrote {out / 'fanout.json'} and {out / 'fanout.png'}")


if __name__ == "__main__":
    main()
