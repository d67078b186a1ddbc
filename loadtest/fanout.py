"""Fan-out benchmark: N SSE subscribers on one stream, one writer.

    python -m loadtest.fanout --servers ours,reference --subscribers 100,1000
    python -m loadtest.fanout --base-url http://host:port/v1/stream --subscribers 1000

The writer appends ``--message-bytes`` messages at ``--rate`` per second for
``--duration`` seconds, keeping its schedule (appends in flight) however
slowly the server answers. Delivery latency is reported from the moment the
append was sent (p50/p99/max) and from its acknowledgement (ack p99; an
event that arrives before its acknowledgement counts 0 ms, which is common
when the server is busy). Every subscriber must receive every message
exactly once: losses and duplicates are counted. A subscribe answered other than
200 (a server at its live-connection limit: 503) is no subscriber: it is counted
``refused`` (``refd``), not connected, and tried again 0.2 s later, as a refused
connection is.
Loopback only; every loop is bounded in count and time.

Each run's subscribers are disconnected before the next run starts (they once
stayed connected: the 10,000-subscriber run then held 16,000 connections). The
server's RSS is read before the subscribers connect and once they all idle, for
``rss/sub KiB`` (the gateway's memory per idle SSE connection). Later runs on the
same server reuse memory freed by earlier ones and so read low:
``--server-per-run`` starts a fresh server for every subscriber count.

Subscribers are raw HTTP/1.1 over plain sockets, not an HTTP client library, so that
the load generator's own CPU cost stays small next to the server's: ``--generator go``
(``loadtest/ssegen``, built with the Go toolchain; the default where ``go`` is installed)
or ``--generator python`` (asyncio protocols in this process). At 10,000 subscribers
Python's took ~170% of this 2-core machine, more than the server it measured; Go's ~30%.
``--pin`` gives the server one CPU of its own and the subscribers, the writer and ours'
embedded Redis the others (``servers.pin``).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from .servers import KINDS, ProcessMeter, add_pin_option, pin, start, use_uvloop


@dataclass
class Subscriber:
    index: int
    received: dict[int, float] = field(default_factory=dict)  # seq -> arrival time
    duplicates: int = 0
    reconnects: int = 0
    refused: int = 0  # responses other than 200 (a server at a limit, a wrong path): retried
    connected: bool = False  # had a 200 (counted connected once, however often it reconnects)
    offset: str = "now"


@dataclass
class Result:
    server: str
    subscribers: int
    connected: int
    rate: float
    duration: float
    messages: int
    p50_ms: float  # append sent -> event received (the end-to-end figure)
    p99_ms: float
    max_ms: float
    ack_p50_ms: float  # append acknowledged -> event received (0 when the event came first)
    ack_p99_ms: float
    lost: int
    duplicated: int
    reconnects: int
    subscribers_missing_data: int
    refused: int  # subscribe attempts answered other than 200 (each retried 0.2 s later)
    server_cpu_percent: float | None
    server_peak_rss_mb: float | None
    server_rss_per_subscriber_kib: float | None  # RSS once connected and idle, less before, each
    generator: str  # the subscribers' implementation: python (this process) or go (loadtest/ssegen)
    generator_cpu_percent: float  # the subscribers' CPU: it competes for the same cores


class _SseClient(asyncio.Protocol):
    """One SSE subscriber as a bare protocol: data_received parses in place,
    with no task switch per event (the generator shares the server's cores)."""

    def __init__(self, sub: Subscriber, host: str, path: str, on_lost) -> None:
        self.sub, self.host, self.path = sub, host, path
        self.on_lost = on_lost
        self.buffer = b""
        self.headers_done = False
        self.refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        request = (
            f"GET {self.path}?offset={self.sub.offset}&live=sse HTTP/1.1\r\n"
            f"Host: {self.host}\r\nAccept: text/event-stream\r\n\r\n"
        )
        transport.write(request.encode())  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        buffer = self.buffer + data if self.buffer else data
        if not self.headers_done:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                self.buffer = buffer
                return
            self.headers_done = True
            if not buffer.startswith(b"HTTP/1.1 200 "):  # not a subscription: counted, retried
                self.sub.refused += 1
                self.refused = True
                self.transport.close()
                return
            self.sub.connected = True
            buffer = buffer[end + 4 :]
        sub, i = self.sub, 0
        while True:
            j = buffer.find(b"seq=", i)
            if j < 0 or j + 13 > len(buffer):
                break
            seq = int(buffer[j + 4 : j + 12])
            if seq in sub.received:
                sub.duplicates += 1
            else:
                sub.received[seq] = now
            i = j + 13
        k = buffer.rfind(b'"streamNextOffset":"')
        if k >= 0:
            close = buffer.find(b'"', k + 20)
            if close > 0:
                sub.offset = buffer[k + 20 : close].decode()
        self.buffer = buffer[max(i, len(buffer) - 64) :]
        if b"\r\n0\r\n\r\n" in buffer:  # the response ended (SSE cycle): reconnect at the offset
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.on_lost(self.sub, self.refused)


async def _subscribe_all(subs: list[Subscriber], host: str, port: int, path: str, stop: asyncio.Event,
                         clients: list[_SseClient]):  # fmt: skip
    """Connect every subscriber (in waves); reconnect any the server closes. ``clients``
    gets every connection made, to be closed at the end."""
    loop = asyncio.get_running_loop()
    pending: asyncio.Queue[Subscriber] = asyncio.Queue()

    def lost(sub: Subscriber, refused: bool) -> None:
        if stop.is_set():
            return
        if refused:  # as a connection refused: again 0.2 s later
            loop.call_later(0.2, pending.put_nowait, sub)
        else:
            sub.reconnects += 1
            pending.put_nowait(sub)

    async def connect(sub: Subscriber) -> None:
        for _ in range(50):
            try:
                _, client = await loop.create_connection(
                    lambda: _SseClient(sub, host, path, lost), host, port
                )
                clients.append(client)
                return
            except OSError:
                await asyncio.sleep(0.2)

    for i in range(0, len(subs), 250):
        await asyncio.gather(*(connect(sub) for sub in subs[i : i + 250]))

    async def reconnector() -> None:
        while not stop.is_set():
            sub = await pending.get()
            await connect(sub)

    return asyncio.create_task(reconnector())


def _http(method: str, url: str, body: bytes = b"", content_type: str = "text/plain") -> None:
    request = urllib.request.Request(
        url, data=body or None, method=method, headers={"Content-Type": content_type}
    )
    urllib.request.urlopen(request, timeout=10).close()


def _write_process(
    url: str, rate: float, duration: float, message_bytes: int, started: float
) -> tuple[dict[int, float], dict[int, float]]:
    """The writer, in a process of its own so that parsing thousands of
    subscriber streams cannot delay its sends. It keeps its schedule (up to 64
    appends in flight) however slowly the server answers. time.monotonic() is
    one clock for every process on the machine, so its times compare."""
    acked: dict[int, float] = {}
    sent_at: dict[int, float] = {}
    padding = b"x" * max(0, message_bytes - 13)

    async def write() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:

            async def append(seq: int) -> None:
                sent_at[seq] = time.monotonic()
                body = b"seq=%08d|" % seq + padding
                async with session.post(url, data=body, headers={"Content-Type": "text/plain"}) as r:
                    if r.status in (200, 204):
                        acked[seq] = time.monotonic()

            appends = []
            for seq in range(int(rate * duration)):
                if time.monotonic() > started + 3 * duration:
                    break  # bounded in time whatever happens
                delay = started + seq / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                appends.append(asyncio.create_task(append(seq)))
            await asyncio.gather(*appends, return_exceptions=True)

    asyncio.run(write())
    return sent_at, acked


class _Subscribers:
    """One run's subscribers, as ``run_one`` drives them: ``connect`` (how many did),
    ``begin`` as the writer starts, ``finish`` with the writer's times (deliveries drained,
    their summary: Result's fields), then ``drained_at`` (time.monotonic()) and ``cpu``
    (the subscribers' CPU seconds from ``begin`` to then). Leaving the ``async with``
    disconnects whatever is left, however the run ended."""

    name = ""
    drained_at: float
    cpu: float

    async def __aenter__(self) -> _Subscribers:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    async def connect(self) -> int:
        raise NotImplementedError

    def begin(self) -> None:
        raise NotImplementedError

    async def finish(self, sent_at: dict[int, float], acked: dict[int, float]) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _PythonSubscribers(_Subscribers):
    """The subscribers as asyncio protocols in this process (``--generator python``)."""

    name = "python"

    def __init__(self, count: int, host: str, port: int, path: str, connect_seconds: float = 60.0) -> None:
        self.subs = [Subscriber(i) for i in range(count)]
        self._where = host, port, path
        self._connect_seconds = connect_seconds
        self._stop = asyncio.Event()
        self._clients: list[_SseClient] = []
        self._reconnector: asyncio.Task[None] | None = None

    async def connect(self) -> int:
        self._reconnector = await _subscribe_all(self.subs, *self._where, self._stop, self._clients)
        deadline = time.monotonic() + self._connect_seconds
        while self._connected() < len(self.subs) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return self._connected()

    def _connected(self) -> int:
        return sum(sub.connected for sub in self.subs)

    def begin(self) -> None:
        self._meter = ProcessMeter(os.getpid())  # the generator's CPU is this process's

    async def finish(self, sent_at: dict[int, float], acked: dict[int, float]) -> dict[str, Any]:
        """Let deliveries drain (every one, or no progress for 5 s), disconnect, summarize."""
        subs, sent = self.subs, len(acked)
        last_total, last_change, drain_deadline = -1, time.monotonic(), time.monotonic() + 120
        while time.monotonic() < drain_deadline:
            got = sum(len(sub.received) for sub in subs)
            if got >= sent * len(subs):
                break
            if got != last_total:
                last_total, last_change = got, time.monotonic()
            elif time.monotonic() - last_change > 5:
                break
            await asyncio.sleep(0.2)
        self.drained_at, self.cpu = time.monotonic(), self._meter.cpu_used()
        self.close()

        def summary(since: dict[int, float]) -> tuple[float, float, float]:
            """p50, p99 and max in ms of arrival minus ``since``, over every delivery."""
            values = sorted(
                max(0.0, sub.received[s] - since[s]) * 1000
                for sub in subs
                for s in sub.received
                if s in acked
            )
            if not values:
                return float("nan"), float("nan"), float("nan")
            at = lambda p: round(values[min(len(values) - 1, int(p * len(values)))], 2)  # noqa: E731
            return at(0.5), at(0.99), round(values[-1], 2)

        sent_seqs = set(acked)
        p50, p99, worst = summary(sent_at)
        ack_p50, ack_p99, _ = summary(acked)
        return {
            "p50_ms": p50, "p99_ms": p99, "max_ms": worst, "ack_p50_ms": ack_p50, "ack_p99_ms": ack_p99,
            "lost": sum(len(sent_seqs - sub.received.keys()) for sub in subs),
            "duplicated": sum(sub.duplicates for sub in subs),
            "reconnects": sum(sub.reconnects for sub in subs),
            "subscribers_missing_data": sum(1 for sub in subs if sent_seqs - sub.received.keys()),
            "refused": sum(sub.refused for sub in subs),
        }  # fmt: skip

    def close(self) -> None:
        """Disconnect every subscriber: the next run starts without this one's connections."""
        self._stop.set()
        if self._reconnector is not None:
            self._reconnector.cancel()
        for client in self._clients:
            client.transport.close()


_SSEGEN = Path(__file__).parent / "ssegen"


def build_ssegen() -> Path:
    """``loadtest/ssegen`` (Go, standard library only) built once into a cache folder."""
    binary = Path(tempfile.gettempdir()) / f"ds-ssegen-{os.getuid()}" / "ssegen"
    sources = sorted(_SSEGEN.glob("*.go")) + [_SSEGEN / "go.mod"]
    if not binary.exists() or binary.stat().st_mtime < max(p.stat().st_mtime for p in sources):
        binary.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["go", "build", "-o", str(binary), "."], cwd=_SSEGEN, check=True)
    return binary


class _GoSubscribers(_Subscribers):
    """The subscribers in ``loadtest/ssegen`` (``--generator go``): the same requests and
    counting as _SseClient at a fraction of the CPU, so at 10,000 subscribers the
    generator does not take the server's cores. Times come back summarized."""

    name = "go"

    def __init__(self, count: int, host: str, port: int, path: str, connect_seconds: float = 60.0) -> None:
        self._args = [str(build_ssegen()), "-addr", f"{host}:{port}", "-path", path, "-n", str(count),
                      "-connect-seconds", str(connect_seconds)]  # fmt: skip
        self._proc: asyncio.subprocess.Process | None = None

    async def connect(self) -> int:
        # One scheduler thread: at 1,000 subscribers it costs ~40% of a core, against ~52% with
        # one per core (idle threads spinning for work); 10,000 take ~31% either way.
        env = {"GOMAXPROCS": "1", **os.environ}
        self._proc = await asyncio.create_subprocess_exec(
            *self._args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, limit=1 << 20, env=env
        )
        assert self._proc.stdout is not None
        line = await asyncio.wait_for(self._proc.stdout.readline(), 120)
        if not line:
            raise RuntimeError("ssegen ended before its subscribers connected")
        return int(json.loads(line)["ready"])

    def begin(self) -> None:
        assert self._proc is not None
        self._cpu0 = ProcessMeter(self._proc.pid).cpu_seconds()

    async def finish(self, sent_at: dict[int, float], acked: dict[int, float]) -> dict[str, Any]:
        """Hand over the writer's times; ssegen drains, disconnects and summarizes."""
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps({"sent": sent_at, "acked": acked}).encode() + b"\n")
        await self._proc.stdin.drain()
        line = await asyncio.wait_for(self._proc.stdout.readline(), 300)
        await asyncio.wait_for(self._proc.wait(), 30)
        if not line:
            raise RuntimeError("ssegen ended without a summary")
        result = json.loads(line)
        result.pop("connected", None)
        self.drained_at = result.pop("drained_at")
        self.cpu = result.pop("cpu_seconds") - self._cpu0
        return {k: (float("nan") if v == -1 else round(v, 2)) for k, v in result.items()}

    def close(self) -> None:
        """Stop ssegen if it is still running (a run that failed): its connections go with it."""
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()


GENERATORS: dict[str, type[_PythonSubscribers | _GoSubscribers]] = {
    kind.name: kind for kind in (_PythonSubscribers, _GoSubscribers)
}


def default_generator() -> str:
    """Go's subscribers where a Go toolchain is installed (``apt-get install golang``)."""
    return "go" if shutil.which("go") else "python"


async def run_one(base_url: str, server: str, subscribers: int, rate: float, duration: float,
                  message_bytes: int, pid: int | None, generator: str = "python") -> Result:  # fmt: skip
    url = f"{base_url}/fanout-{uuid.uuid4().hex[:8]}"
    await asyncio.to_thread(_http, "PUT", url)
    parts = urlsplit(url)
    rss_before = ProcessMeter(pid).rss_mb() if pid else None
    assert parts.hostname is not None and parts.port is not None
    async with GENERATORS[generator](subscribers, parts.hostname, parts.port, parts.path) as subs:
        connected = await subs.connect()
        await asyncio.sleep(1.0)

        meter = ProcessMeter(pid) if pid else None
        rss_per_subscriber = None
        if meter and rss_before is not None and connected:
            rss_per_subscriber = round((meter.peak_rss_mb - rss_before) * 1024 / connected, 1)
        subs.begin()
        started = wall0 = time.monotonic() + 2.0  # time for the writer process to start
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
            writing = asyncio.get_running_loop().run_in_executor(
                pool, _write_process, url, rate, duration, message_bytes, started
            )
            while not writing.done():  # sample the server while the writer works
                if meter:
                    meter.sample()
                await asyncio.wait([writing], timeout=1.0)
            sent_at, acked = writing.result()
        delivered = await subs.finish(sent_at, acked)
        server_cpu = meter.cpu_used() if meter else None  # idle since the drain
        elapsed = subs.drained_at - wall0  # CPU shares up to the drain (not the summary's sorting)
    await asyncio.sleep(1.0)  # for the server to see them go
    return Result(
        server=server,
        subscribers=subscribers,
        connected=connected,
        rate=rate,
        duration=duration,
        messages=len(acked),
        **delivered,
        server_cpu_percent=round(100 * server_cpu / elapsed, 1) if server_cpu is not None else None,
        server_peak_rss_mb=round(meter.peak_rss_mb, 1) if meter else None,
        server_rss_per_subscriber_kib=rss_per_subscriber,
        generator=subs.name,
        generator_cpu_percent=round(100 * subs.cpu / elapsed, 1),
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
    ax.set_ylabel("delivery latency, ms (append sent → event received)")
    ax.set_title(f"SSE fan-out at {results[0].rate:g} msgs/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: list[Result]) -> str:
    head = (
        "server            subs  conn   p50 ms   p99 ms   max ms  ack p99  sent  lost  dup  refd"
        "  cpu %   rss MB rss/sub KiB  gen cpu %  gen"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.server[:16]:<16} {r.subscribers:>5} {r.connected:>5} {r.p50_ms:>8} {r.p99_ms:>8} "
            f"{r.max_ms:>8} {r.ack_p99_ms:>8} {r.messages:>5} {r.lost:>5} {r.duplicated:>4} {r.refused:>5} "
            f"{r.server_cpu_percent!s:>6} {r.server_peak_rss_mb!s:>8} {r.server_rss_per_subscriber_kib!s:>11}"
            f" {r.generator_cpu_percent:>10}  {r.generator}"
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
    parser.add_argument(
        "--generator",
        choices=sorted(GENERATORS),
        default=default_generator(),
        help="the subscribers: go (loadtest/ssegen, the default where Go is installed: a fraction of"
        " python's CPU, which at 10,000 subscribers takes more of this machine than the server) or python",
    )
    parser.add_argument("--out", default="loadtest/results", help="folder for fanout.json and fanout.png")
    parser.add_argument(
        "--ours-args", default="", help='extra flags for our gateway, e.g. "--sse-cycle-seconds 600"'
    )
    parser.add_argument(
        "--server-per-run",
        action="store_true",
        help="a fresh server for every subscriber count (clean RSS figures; else one server for all)",
    )
    add_pin_option(parser)
    args = parser.parse_args()
    counts = [int(n) for n in args.subscribers.split(",")]
    results: list[Result] = []

    async def bench(base_url: str, name: str, pid: int | None, counts: list[int] = counts) -> None:
        for n in counts:
            result = await run_one(
                base_url, name, n, args.rate, args.duration, args.message_bytes, pid, args.generator
            )
            results.append(result)
            print(table([result]).splitlines()[-1], flush=True)

    use_uvloop()
    print(table([]))
    if args.base_url:
        asyncio.run(bench(args.base_url, "target", None))
    else:
        for kind in args.servers.split(","):  # one after the other, same machine, same run
            extra = args.ours_args.split() if kind.startswith("ours") else []
            label = " ".join([kind, *extra])
            for runs in [[n] for n in counts] if args.server_per_run else [counts]:
                with start(kind, *extra) as server:
                    if args.pin:
                        print(pin(server), flush=True)
                    asyncio.run(bench(server.base_url, label, server.pid, runs))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fanout.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    try:
        plot(results, out / "fanout.png")
    except ImportError:  # matplotlib is optional: the table and the JSON are the results
        print("(no chart: matplotlib is not installed)")
    print(f"\n{table(results)}\n\nwrote {out / 'fanout.json'} and {out / 'fanout.png'}")


if __name__ == "__main__":
    main()
