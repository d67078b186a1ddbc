"""Soak: mixed traffic for N minutes, the gateway's memory sampled throughout.

    python -m loadtest.soak --minutes 8
    python -m loadtest.soak --minutes 2 --base-url http://127.0.0.1:4437/v1/stream --pid 1234

Against a gateway it starts (``ours``: one process on its own embedded Redis, on a
loopback port) or an existing one (``--base-url`` and ``--pid``, loopback only):

- appends on ``--streams`` streams (JSON batches of up to ``--json-messages`` small
  messages, text and binary records, a few larger than a notice carries) at
  ``--append-rate`` per second;
- SSE churn: ``--sse`` readers at a time, each at the tail of a random stream (or, some,
  catching up from an offset a few appends old), reading for 0.2-2 s and dropping the
  connection, as a browser closing a tab does;
- long-polls: ``--long-polls`` at a time, half of them abandoned mid-wait;
- create / append / fork / read live / delete cycles on streams of their own.

The gateway's RSS is read from /proc every ``--sample-seconds``; the growth after the
warm-up (``--warmup``, a share of the run) is printed with the slope, and so are the
open counts /metrics reports (``ds_live_connections``, ``ds_pubsub_subscriptions``)
idle before, during, and once the clients are gone (subscriptions linger 30 s). Written
to ``<out>.json`` and a plot, ``<out>.png`` with matplotlib (the ``loadtest`` extra),
else a small ``<out>.svg``. Every loop is bounded in count and time: it stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import orjson

from .servers import Running, start, use_uvloop

_LOOP_CAP = 10_000_000  # no loop runs forever, whatever the duration says
_GAUGE = re.compile(r"^(ds_live_connections|ds_pubsub_subscriptions)(\{[^}]*\})? (\S+)$", re.M)
JSON, TEXT, BINARY = "application/json", "text/plain", "application/octet-stream"


@dataclass
class Traffic:
    """What to send, and for how long."""

    seconds: float
    streams: int = 500
    append_rate: float = 100.0  # appends per second, over all streams
    sse: int = 100  # SSE readers open at a time
    long_polls: int = 40  # long-polls open at a time
    lifecycles: int = 8  # create/fork/delete loops at a time
    content_types: tuple[str, ...] = (JSON, TEXT, BINARY)  # the streams', in turn
    json_messages: int = 200  # most messages in one append to a JSON stream
    message_bytes: tuple[int, int] = (8, 200)  # sizes of most appends to other streams
    large_share: float = 0.02  # appends larger than a notice carries: readers read Redis
    sse_seconds: tuple[float, float] = (0.2, 2.0)  # how long an SSE reader stays
    # SSE readers that come back from an offset a few appends old (a reopened tab resuming)
    # and catch up first; the others start at the tail.
    resume_share: float = 0.2


@dataclass
class Counts:
    appends: int = 0
    sse_sessions: int = 0
    sse_events: int = 0
    long_polls: int = 0
    lifecycles: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


def rss_mb(pid: int) -> float:
    """Resident memory of a process (Linux /proc), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def parse_gauges(text: str) -> dict[str, float]:
    """The live-read gauges of a /metrics text: ``name{labels}`` -> value."""
    return {name + (labels or ""): float(value) for name, labels, value in _GAUGE.findall(text)}


async def gauges(http: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """The live-read gauges of the gateway serving ``base_url``."""
    root = urlsplit(base_url)
    async with http.get(f"{root.scheme}://{root.netloc}/metrics", timeout=aiohttp.ClientTimeout(30)) as r:
        return parse_gauges(await r.text())


def busy(found: dict[str, float]) -> dict[str, float]:
    """The gauges that are not zero (an idle gateway has none; absent means zero)."""
    return {name: value for name, value in found.items() if value}


def _loopback(url: str) -> None:
    if urlsplit(url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"loopback only: {url}")


async def _until(deadline: float, step: Callable[[], Awaitable[None]], counts: Counts, what: str) -> None:
    """``step`` again and again until ``deadline`` (loop time), errors counted, never forever."""
    loop = asyncio.get_running_loop()
    for _ in range(_LOOP_CAP):
        if loop.time() >= deadline:
            return
        try:
            await step()
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as error:
            counts.error(f"{what}: {type(error).__name__}")
            await asyncio.sleep(0.05)


async def run_traffic(base_url: str, traffic: Traffic) -> Counts:
    """Mixed traffic against ``base_url`` (a gateway's stream prefix) for ``traffic.seconds``;
    the streams it made are deleted at the end."""
    _loopback(base_url)
    counts = Counts()
    loop = asyncio.get_running_loop()
    run = uuid.uuid4().hex[:8]
    names = [f"soak-{run}-{i}" for i in range(traffic.streams)]
    kind = {name: traffic.content_types[i % len(traffic.content_types)] for i, name in enumerate(names)}
    seen = {name: deque(["-1"], maxlen=8) for name in names}  # offsets after each stream's last appends
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(60)) as http:
        several = asyncio.Semaphore(32)

        async def create(name: str) -> None:
            async with several, http.put(f"{base_url}/{name}", headers={"Content-Type": kind[name]}) as r:
                if r.status not in (200, 201):
                    counts.error(f"create: {r.status}")

        await asyncio.gather(*(create(name) for name in names))
        deadline = loop.time() + traffic.seconds
        appenders = max(1, min(50, int(traffic.append_rate // 10)))
        interval = appenders / traffic.append_rate if traffic.append_rate > 0 else traffic.seconds

        async def append() -> None:
            began = loop.time()
            name = random.choice(names)
            if kind[name] == JSON:
                # A batch of small messages, as a chat or a state sync sends them.
                n = random.randint(max(1, traffic.json_messages // 2), traffic.json_messages)
                body = orjson.dumps([{"n": counts.appends, "i": i} for i in range(n)])
            else:
                large = random.random() < traffic.large_share
                size = random.randint(10_000, 40_000) if large else random.randint(*traffic.message_bytes)
                body = b"m%d-" % counts.appends + b"x" * size
            async with http.post(f"{base_url}/{name}", data=body, headers={"Content-Type": kind[name]}) as r:
                await r.read()
                if r.status in (200, 204):
                    counts.appends += 1
                    seen[name].append(r.headers.get("Stream-Next-Offset", "-1"))
                else:
                    counts.error(f"append: {r.status}")
            await asyncio.sleep(max(0.0, interval - (loop.time() - began)))

        async def sse() -> None:
            name = random.choice(names)
            stay = random.uniform(*traffic.sse_seconds)
            # A catch-up from a bounded distance: from the start it would grow with the streams.
            offset = seen[name][0] if random.random() < traffic.resume_share else "now"
            response = await http.get(f"{base_url}/{name}", params={"offset": offset, "live": "sse"})
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(stay):
                        async for data in response.content.iter_any():
                            counts.sse_events += data.count(b"event: data")
                counts.sse_sessions += 1
            finally:
                response.close()  # drops the connection mid-stream, unread data and all

        async def long_poll() -> None:
            name = random.choice(names)
            # Half wait for their answer; the others give up first, as a client timing out does.
            patience = 30.0 if random.random() < 0.5 else random.uniform(0.1, 1.5)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(patience):
                    params = {"offset": seen[name][-1], "live": "long-poll"}
                    async with http.get(f"{base_url}/{name}", params=params) as r:
                        await r.read()
            counts.long_polls += 1

        async def lifecycle() -> None:
            name = f"soak-{run}-life-{uuid.uuid4().hex[:8]}"
            url, fork = f"{base_url}/{name}", f"{base_url}/{name}-fork"
            text = {"Content-Type": TEXT}
            async with http.put(url, data=b"first", headers=text) as r:
                await r.read()
            async with http.post(url, data=b"second", headers=text) as r:
                await r.read()
            async with http.put(fork, headers={**text, "Stream-Forked-From": name}) as r:
                await r.read()
            response = await http.get(fork, params={"offset": "-1", "live": "sse"})
            try:
                async with http.post(fork, data=b"third", headers=text) as r:
                    await r.read()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.3):
                        async for _ in response.content.iter_any():
                            pass
            finally:
                response.close()
            for target in (fork, url):
                async with http.delete(target) as r:
                    await r.read()
            counts.lifecycles += 1

        jobs = [_until(deadline, append, counts, "append") for _ in range(appenders)]
        jobs += [_until(deadline, sse, counts, "sse") for _ in range(traffic.sse)]
        jobs += [_until(deadline, long_poll, counts, "long-poll") for _ in range(traffic.long_polls)]
        jobs += [_until(deadline, lifecycle, counts, "lifecycle") for _ in range(traffic.lifecycles)]
        await asyncio.gather(*jobs)

        async def delete(name: str) -> None:
            async with several, http.delete(f"{base_url}/{name}") as r:
                await r.read()

        await asyncio.gather(*(delete(name) for name in names))
    return counts


@dataclass
class Sample:
    t: float  # seconds since the traffic began
    rss_mb: float


@dataclass
class Report:
    seconds: float
    warmup_seconds: float
    samples: list[Sample]
    counts: Counts
    idle_before: dict[str, float]  # the /metrics gauges that were not zero
    during: dict[str, float]
    idle_after: dict[str, float]
    rss_idle_before_mb: float
    rss_idle_after_mb: float

    def growth(self) -> tuple[float, float, float]:
        """RSS at the end of the warm-up, its highest since, and the growth in percent."""
        kept = [s for s in self.samples if s.t >= self.warmup_seconds] or self.samples
        first, peak = kept[0].rss_mb, max(s.rss_mb for s in kept)
        return first, peak, 100.0 * (peak - first) / first

    def slope_mb_per_minute(self) -> float:
        """Least-squares slope of RSS after the warm-up: a leak shows as a steady climb."""
        kept = [s for s in self.samples if s.t >= self.warmup_seconds]
        if len(kept) < 2:
            return 0.0
        mt, mr = sum(s.t for s in kept) / len(kept), sum(s.rss_mb for s in kept) / len(kept)
        var = sum((s.t - mt) ** 2 for s in kept)
        return 60.0 * sum((s.t - mt) * (s.rss_mb - mr) for s in kept) / var if var else 0.0

    def summary(self) -> str:
        first, peak, percent = self.growth()
        return "\n".join(
            [
                f"traffic: {asdict(self.counts)}",
                f"RSS: idle {self.rss_idle_before_mb:.1f} MB; after the warm-up {first:.1f} MB, "
                f"highest since {peak:.1f} MB ({percent:+.1f}%), slope {self.slope_mb_per_minute():+.2f} "
                f"MB/min; idle again {self.rss_idle_after_mb:.1f} MB",
                f"open (/metrics, non-zero): idle {self.idle_before}, during {self.during}, "
                f"after {self.idle_after}",
            ]
        )


async def soak(
    base_url: str,
    pid: int,
    traffic: Traffic,
    warmup_seconds: float,
    sample_seconds: float = 5.0,
    settle_seconds: float = 45.0,
) -> Report:
    """``traffic`` with the RSS of ``pid`` sampled meanwhile; then the gauges once the
    clients are gone, waiting up to ``settle_seconds`` for them to be idle again."""
    loop = asyncio.get_running_loop()
    samples: list[Sample] = []
    async with aiohttp.ClientSession() as http:
        idle_before, rss_before = busy(await gauges(http, base_url)), rss_mb(pid)
        began = loop.time()
        sending = asyncio.ensure_future(run_traffic(base_url, traffic))
        during: dict[str, float] = {}
        for _ in range(_LOOP_CAP):
            samples.append(Sample(round(loop.time() - began, 1), rss_mb(pid)))
            if sending.done():
                break
            if not during and loop.time() - began > traffic.seconds / 2:
                during = busy(await gauges(http, base_url))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(sending), sample_seconds)
        counts = sending.result()
        settled = loop.time() + settle_seconds
        idle_after = busy(await gauges(http, base_url))
        while idle_after != idle_before and loop.time() < settled:
            await asyncio.sleep(1.0)
            idle_after = busy(await gauges(http, base_url))
    return Report(
        traffic.seconds,
        warmup_seconds,
        samples,
        counts,
        idle_before,
        during,
        idle_after,
        rss_before,
        rss_mb(pid),
    )


def _named(out: Path, suffix: str) -> Path:
    """``out`` plus a suffix (not with_suffix: ``soak.before-fix`` keeps its whole name)."""
    return out.with_name(out.name + suffix)


def plot(report: Report, out: Path) -> Path:
    """RSS over time: ``<out>.png`` with matplotlib, else a small hand-written ``<out>.svg``."""
    xs, ys = [s.t / 60 for s in report.samples], [s.rss_mb for s in report.samples]
    title = "soak: gateway RSS ({:.0f} MB after warm-up, highest {:.0f} MB: {:+.1f}%)".format(
        *report.growth()
    )
    try:
        import matplotlib
    except ImportError:
        return _svg(xs, ys, report.warmup_seconds / 60, title, _named(out, ".svg"))
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(xs, ys, marker=".", linewidth=1)
    ax.axvline(report.warmup_seconds / 60, color="grey", linestyle="--", linewidth=1, label="end of warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MB)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = _named(out, ".png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _svg(xs: list[float], ys: list[float], warmup: float, title: str, path: Path) -> Path:
    width, height, pad = 640, 320, 50
    x_max, y_max = max(xs[-1] if xs else 1.0, 1e-6), max(ys, default=1.0) * 1.1 or 1.0

    def x(value: float) -> float:
        return pad + (width - 2 * pad) * value / x_max

    def y(value: float) -> float:
        return height - pad - (height - 2 * pad) * value / y_max

    points = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in zip(xs, ys, strict=True))
    ticks = "".join(
        f'<text x="{pad - 6}" y="{y(y_max * f):.1f}" text-anchor="end" font-size="10">{y_max * f:.0f}</text>'
        for f in (0, 0.25, 0.5, 0.75, 1)
    )
    bottom = height - pad
    lines = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="12">{title}</text>',
        f'<line x1="{pad}" y1="{bottom}" x2="{width - pad}" y2="{bottom}" stroke="black"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{bottom}" stroke="black"/>',
        f'<line x1="{x(warmup):.1f}" y1="{pad}" x2="{x(warmup):.1f}" y2="{bottom}" stroke="grey" '
        'stroke-dasharray="4"><title>end of warm-up</title></line>',
        ticks,
        f'<text x="{pad}" y="{bottom + 16}" font-size="10">0</text>',
        f'<text x="{width - pad}" y="{bottom + 16}" text-anchor="end" font-size="10">{x_max:.1f} min</text>',
        f'<text x="14" y="{height / 2}" font-size="11" text-anchor="middle" '
        f'transform="rotate(-90 14 {height / 2})">RSS (MB)</text>',
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{points}"/>',
        "</svg>",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@contextlib.contextmanager
def _target(args: argparse.Namespace) -> Iterator[Running]:
    if args.base_url:
        if not args.pid:
            raise SystemExit("--base-url needs --pid (the gateway process whose memory to read)")
        _loopback(args.base_url)
        yield Running("given", args.base_url.rstrip("/"), args.pid)
        return
    # Departed readers are noticed at the next heartbeat or notice, so a long-poll or an SSE
    # response outlives its client by up to these: shorter, the idle counts come back sooner.
    with start("ours", "--long-poll-timeout", "5", "--sse-heartbeat-seconds", "5") as running:
        yield running


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=0.2, help="share of the run that is warm-up")
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--append-rate", type=float, default=100.0, help="appends per second")
    parser.add_argument("--json-messages", type=int, default=200, help="most messages in a JSON append")
    parser.add_argument("--sse", type=int, default=100, help="SSE readers at a time")
    parser.add_argument("--long-polls", type=int, default=40, help="long-polls at a time")
    parser.add_argument("--lifecycles", type=int, default=8, help="create/fork/delete loops at a time")
    parser.add_argument("--sample-seconds", type=float, default=5.0)
    parser.add_argument("--base-url", help="an existing gateway's stream prefix (loopback)")
    parser.add_argument("--pid", type=int, help="with --base-url: the gateway's process id")
    parser.add_argument("--out", default="loadtest/results/soak", help="<out>.json and <out>.png (or .svg)")
    args = parser.parse_args()
    if not 0 < args.minutes <= 24 * 60:
        raise SystemExit("--minutes: more than 0, at most a day")
    use_uvloop()
    seconds = args.minutes * 60
    traffic = Traffic(
        seconds,
        streams=args.streams,
        append_rate=args.append_rate,
        json_messages=args.json_messages,
        sse=args.sse,
        long_polls=args.long_polls,
        lifecycles=args.lifecycles,
    )
    with _target(args) as server:
        print(f"soak: {args.minutes:g} min against {server.base_url} (pid {server.pid})", flush=True)
        report = asyncio.run(
            soak(server.base_url, server.pid, traffic, seconds * args.warmup, args.sample_seconds)
        )
    print(report.summary())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _named(out, ".json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    print(f"wrote {_named(out, '.json')} and {plot(report, out)}")


if __name__ == "__main__":
    main()
