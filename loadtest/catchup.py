"""Catch-up reads (issue 41): one client reading a whole stream from ``offset=-1``, ours hot
(in Redis) and cold (archived to Parquet) beside the npm reference server (in memory); the
same JSON stream read with each ``Accept-Encoding``; and the gateway's memory under 50
concurrent readers, half of them slow.

    .venv/bin/python -m loadtest.catchup [--mb 256] [--messages 1000000] [--runs 3]
        [--only bytes|json|compression|memory] [--quick] [--ours-args="--max-chunk-bytes 4194304"]

``bytes``: a byte stream of ``--mb`` MiB (1 MiB appends of random data). ``json``: a JSON
stream of ``--messages`` messages of ~100-200 bytes, half State Protocol change events
(``{type, key, value, headers: {operation}}``, to which reads add ``headers.offset``), half
plain objects (``--json-kind state|plain``: all of one kind); every message carries one
``"seq":`` field, which the client counts. Each read follows ``Stream-Next-Offset`` until
``Stream-Up-To-Date`` (whatever the server's chunk size), streaming each body through
``resp.content.iter_chunked`` (never holding a body), decoding whatever ``Content-Encoding``
the server picked; median of ``--runs``, with the number of responses a read took, the
client's own CPU (is it the bottleneck?) and the server's (``/proc``). Cold reads: the
whole stream archived with the archive worker's code (hot window 0, as
``loadtest/archive.py``), then read through the gateway; at full size each stream is larger
than the gateway's archive cache (128 MiB), so every run fetches and decodes Parquet (at
``--quick`` sizes only the first: the others hit the cache).

``compression``: the JSON stream read with ``Accept-Encoding`` gzip, zstd, br and identity
(the reference server: gzip and identity): bytes on the wire, ratio, uncompressed MB/s and
the server's CPU seconds per GB of uncompressed data.

``memory``: ``--readers`` concurrent readers of a ``--memory-mb`` MiB byte stream for
``--window`` seconds, half of them slow (``--slow-mb-per-second`` each, 16 KiB reads and
sleeps), the others as fast as they go; then all disconnect. The gateway's RSS (VmRSS,
polled every 100 ms) before, at its peak and after, and its read budget
(``--max-inflight-read-bytes``) if ``serve --help`` has one.

Output: tables on stdout and ``loadtest/results/catchup.{json,md}`` (``--quick``: small
sizes, a smoke test of ~30 s that writes nothing unless ``--out`` is given).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from .appends import fill as fill_bytes
from .servers import ProcessMeter, Running, start, use_uvloop

MIB = 1 << 20
SECTIONS = ("bytes", "json", "compression", "memory")
ENCODINGS = ("identity", "gzip", "zstd", "br")
REFERENCE_ENCODINGS = ("identity", "gzip")  # it compresses with gzip or deflate only
MARKER = b'"seq":'  # once in every message of the JSON stream, never inside a value
READ_CHUNK = 1 << 20  # iter_chunked's most per step (it yields what has arrived, up to this)
FAST_BUFSIZE = 1 << 22  # aiohttp's read buffer for fast readers (its default, 64 KiB, pauses often)
SLOW_READ = 16 << 10
JSON_BATCH = 2000  # messages per append while filling
# serve's options that bear on catch-up reads, shown beside the results (absent ones: None)
SETTINGS = ("--max-chunk-bytes", "--max-inflight-read-bytes", "--read-page-bytes", "--read-inline-bytes",
            "--compression", "--compression-min-bytes", "--archive-cache-bytes")  # fmt: skip


# --- the client ------------------------------------------------------------------------------


class Decoder:
    """Undoes a response's Content-Encoding, piece by piece (several gzip members or zstd
    frames in one body are fine: a server may flush page by page)."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding.strip().lower() or "identity"
        self._gzip: Any = None
        self.decode: Callable[[bytes], bytes] | None
        if self.encoding == "identity":
            self.decode = None
        elif self.encoding in ("gzip", "x-gzip"):
            self._gzip = zlib.decompressobj(wbits=31)
            self.decode = self._gunzip
        elif self.encoding == "deflate":
            self.decode = zlib.decompressobj(wbits=47).decompress  # zlib- or gzip-wrapped
        elif self.encoding == "br":
            import brotli

            self.decode = brotli.Decompressor().process
        elif self.encoding == "zstd":
            import zstandard

            self.decode = zstandard.ZstdDecompressor().decompressobj(read_across_frames=True).decompress
        else:
            raise ValueError(f"unknown Content-Encoding {encoding!r}")

    def _gunzip(self, data: bytes) -> bytes:
        out = self._gzip.decompress(data)
        while self._gzip.eof and self._gzip.unused_data:  # another gzip member follows
            rest = self._gzip.unused_data
            self._gzip = zlib.decompressobj(wbits=31)
            out += self._gzip.decompress(rest)
        return out


@dataclass
class Read:
    """One whole catch-up read, from offset -1 to Stream-Up-To-Date."""

    wire_bytes: int = 0  # body bytes as they came (compressed, when they were)
    bytes: int = 0  # after decoding
    messages: int = 0  # MARKERs seen (JSON streams)
    responses: int = 0
    largest_response: int = 0  # decoded bytes
    seconds: float = 0.0
    client_cpu: float = 0.0  # this process' CPU seconds during the read
    server_cpu: float = 0.0  # the server process' (ours: the gateway, Redis apart)
    redis_cpu: float | None = None  # ours' embedded Redis
    machine_idle: float = 0.0  # share of the machine's CPU time left idle
    encodings: list[str] = field(default_factory=list)  # Content-Encodings seen


async def read_all(
    http: aiohttp.ClientSession, url: str, server: Running, *, accept: str = "identity", count: bool = False
) -> Read:
    """Read the stream at ``url`` from its start to its tail: each response's body streamed
    and decoded, never held whole; JSON messages counted by their MARKER."""
    out, offset, seen = Read(), "-1", set()
    meter = ProcessMeter(server.pid)
    cpu0, started = time.process_time(), time.perf_counter()
    headers = {"Accept-Encoding": accept}
    keep = len(MARKER) - 1
    while out.responses < 1_000_000:
        async with http.get(url, params={"offset": offset}, headers=headers) as r:
            if r.status != 200:
                raise RuntimeError(f"GET {url}?offset={offset}: {r.status} {(await r.read())[:200]!r}")
            encoding = r.headers.get("Content-Encoding", "identity")
            seen.add(encoding)
            decode = Decoder(encoding).decode
            size, tail = 0, b""
            async for chunk in r.content.iter_chunked(READ_CHUNK):
                out.wire_bytes += len(chunk)
                if decode is not None:
                    chunk = decode(chunk)
                size += len(chunk)
                if count and chunk:
                    # the marker cannot overlap itself: whole ones in the chunk, plus one
                    # that straddles the previous piece and this one
                    out.messages += chunk.count(MARKER) + (tail + chunk[:keep]).count(MARKER)
                    tail = (tail + chunk[-keep:])[-keep:]
            out.bytes += size
            out.responses += 1
            out.largest_response = max(out.largest_response, size)
            offset = r.headers["Stream-Next-Offset"]
            if r.headers.get("Stream-Up-To-Date") == "true":
                break
    out.seconds = time.perf_counter() - started
    out.client_cpu = time.process_time() - cpu0
    out.server_cpu = meter.cpu_used()
    out.redis_cpu = meter.redis_cpu_used()
    out.machine_idle = meter.idle_share()
    out.encodings = sorted(seen)
    return out


def reader_session(bufsize: int = FAST_BUFSIZE, limit: int = 1) -> aiohttp.ClientSession:
    """What the readers use: bodies as they came (Content-Encoding decoded by us, to count
    wire bytes), a larger read buffer, no total timeout (reads of GBs)."""
    return aiohttp.ClientSession(
        auto_decompress=False,
        read_bufsize=bufsize,
        connector=aiohttp.TCPConnector(limit=limit),
        timeout=aiohttp.ClientTimeout(total=None, sock_read=120),
    )


# --- the streams -----------------------------------------------------------------------------

WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar "
    "papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu review draft ship "
    "merge deploy invoice order cart payment refund customer account profile settings billing "
    "report search filter export import upload download share comment reply mention"
).split()
PATHS = ("/docs/getting-started", "/pricing", "/app/projects", "/app/settings/billing", "/blog/launch")
OPERATIONS = ("insert", "update", "update", "update", "delete")


def messages(start: int, count: int, rng: random.Random, kind: str = "mixed") -> list[dict[str, Any]]:
    """Realistic messages of ~100-200 bytes: a State Protocol change event (``kind`` state,
    or even ``seq`` of mixed), else a plain analytics-like object."""
    out: list[dict[str, Any]] = []
    for seq in range(start, start + count):
        if kind == "state" or (kind == "mixed" and seq % 2 == 0):
            op = OPERATIONS[rng.randrange(len(OPERATIONS))]
            out.append({
                "type": "todo",
                "key": f"todo-{rng.randrange(100_000)}",
                "value": {
                    "seq": seq,
                    "title": " ".join(rng.choices(WORDS, k=rng.randint(2, 6))),
                    "done": rng.random() < 0.3,
                    "owner": f"user-{rng.randrange(5000)}",
                    "updated_at": 1_760_000_000_000 + seq * 7,
                },
                "headers": {"operation": op},
            })  # fmt: skip
        else:
            out.append({
                "seq": seq,
                "event": rng.choice(("page_view", "click", "signup", "purchase")),
                "user": f"u-{rng.randrange(100_000)}",
                "path": rng.choice(PATHS),
                "ref": rng.choice(WORDS),
                "ts": 1_760_000_000_000 + seq * 7,
                "ms": rng.randrange(2000),
            })  # fmt: skip
    return out


async def fill_json(http: aiohttp.ClientSession, url: str, count: int, kind: str = "mixed") -> int:
    """Create a JSON stream of ``count`` messages (appends of JSON_BATCH): the bytes sent."""
    headers = {"Content-Type": "application/json"}
    async with http.put(url, headers=headers) as r:
        assert r.status in (200, 201), r.status
    rng, sent = random.Random(41), 0
    for start_at in range(0, count, JSON_BATCH):
        body = orjson.dumps(messages(start_at, min(JSON_BATCH, count - start_at), rng, kind))
        sent += len(body)
        async with http.post(url, data=body, headers=headers) as r:
            assert r.status in (200, 204), (r.status, await r.text())
    return sent


# --- the runs --------------------------------------------------------------------------------


def summary(runs: list[Read], *, label: str, encoding: str = "identity") -> dict[str, Any]:
    """The median of a case's runs, and each run."""
    mid = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
    gb = mid.bytes / 1e9
    return {
        "case": label,
        "accept_encoding": encoding,
        "content_encodings": sorted({e for r in runs for e in r.encodings}),
        "mb_per_second": round(statistics.median(r.bytes / r.seconds / 1e6 for r in runs), 1),
        "mb_per_second_runs": [round(r.bytes / r.seconds / 1e6, 1) for r in runs],
        "messages_per_second": round(statistics.median(r.messages / r.seconds for r in runs))
        if mid.messages
        else None,
        "wire_mb": round(mid.wire_bytes / 1e6, 1),
        "mb": round(mid.bytes / 1e6, 1),
        "ratio": round(mid.bytes / mid.wire_bytes, 2) if mid.wire_bytes else None,
        "messages": mid.messages,
        "responses": mid.responses,
        "largest_response_mb": round(mid.largest_response / 1e6, 1),
        "seconds": round(mid.seconds, 2),
        "client_cpu_share": round(mid.client_cpu / mid.seconds, 2),
        "server_cpu_share": round(mid.server_cpu / mid.seconds, 2),
        "redis_cpu_share": round(mid.redis_cpu / mid.seconds, 2) if mid.redis_cpu is not None else None,
        "machine_idle_share": round(mid.machine_idle, 2),
        "server_cpu_seconds_per_gb": round(mid.server_cpu / gb, 2) if gb else None,
        "client_cpu_seconds_per_gb": round(mid.client_cpu / gb, 2) if gb else None,
        "runs": [asdict(r) for r in runs],
    }


async def measure(
    server: Running,
    url: str,
    label: str,
    runs: int,
    *,
    accept: str = "identity",
    count: bool = False,
    expect_bytes: int | None = None,
    expect_messages: int | None = None,
) -> dict[str, Any]:
    out = []
    async with reader_session() as http:
        for _ in range(runs):
            r = await read_all(http, url, server, accept=accept, count=count)
            if expect_bytes is not None:
                assert r.bytes == expect_bytes, (label, r.bytes, expect_bytes)
            if expect_messages is not None:
                assert r.messages == expect_messages, (label, r.messages, expect_messages)
            out.append(r)
    result = summary(out, label=label, encoding=accept)
    print(f"  {label:<40} {accept:<8} {result['mb_per_second']:>8,.1f} MB/s  "
          f"{result['responses']:>5} responses  client CPU {result['client_cpu_share']:.0%}  "
          f"server CPU {result['server_cpu_share']:.0%}", flush=True)  # fmt: skip
    return result


async def archive_everything(server: Running, names: list[str]) -> dict[str, Any]:
    """Archive the streams whole with the archive worker's code (hot window 0), as
    loadtest/archive.py does; what stays in Redis is checked."""
    import redis.asyncio as aioredis

    from gateway.archive.files import Archive
    from gateway.cli.embedded import EmbeddedRedis
    from gateway.redis_io import keys
    from workers.archiver import Archiver, Policy

    client = aioredis.Redis.from_url(EmbeddedRedis(server.data_dir, binary="redis-server").url)
    try:
        before = (await client.info("memory"))["used_memory"]
        archive = Archive(str(Path(server.data_dir) / "archive"))
        policy = Policy(hot_bytes=0, hot_ms=0, min_bytes=0, max_delay_ms=0, file_bytes=128 << 20)
        archiver = Archiver(client, archive, policy)
        await archiver.scripts.load()
        started = time.monotonic()
        left = {}
        for name in names:
            sid = keys.stream_id(name)
            await archiver.archive_stream(sid)
            left[name] = await client.xlen(keys.stream_keys(sid)[1])
        seconds = time.monotonic() - started
        after = (await client.info("memory"))["used_memory"]
        files = archive.files()
    finally:
        await client.aclose()
    return {
        "archive_seconds": round(seconds, 2),
        "archive_files": len(files),
        "redis_used_memory_mib_before": round(before / MIB, 1),
        "redis_used_memory_mib_after": round(after / MIB, 1),
        "log_entries_left_in_redis": left,
    }


async def bench_server(kind: str, sections: set[str], args: argparse.Namespace) -> dict[str, Any]:
    """One server: fill the streams its sections need, then each section's reads."""
    out: dict[str, Any] = {"server": kind}
    ours = kind == "ours"
    extra = shlex.split(args.ours_args) if ours else []
    total_bytes = args.mb * MIB
    with start(kind, *extra) as server:
        print(f"{kind}: filling", flush=True)
        byte_name, json_name = f"catchup-bytes-{uuid.uuid4().hex[:8]}", f"catchup-json-{uuid.uuid4().hex[:8]}"
        byte_url, json_url = f"{server.base_url}/{byte_name}", f"{server.base_url}/{json_name}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
            if "bytes" in sections:
                started = time.monotonic()
                await fill_bytes(http, byte_url, args.mb)
                out["fill_bytes_mb_per_second"] = round(total_bytes / (time.monotonic() - started) / 1e6, 1)
                print(f"  bytes: {args.mb} MiB at {out['fill_bytes_mb_per_second']} MB/s", flush=True)
            if sections & {"json", "compression"}:
                started = time.monotonic()
                out["json_bytes_appended"] = await fill_json(http, json_url, args.messages, args.json_kind)
                out["fill_json_messages_per_second"] = round(args.messages / (time.monotonic() - started))
                print(
                    f"  json: {args.messages:,} messages at {out['fill_json_messages_per_second']:,}/s",
                    flush=True,
                )
        reads = out["reads"] = []

        async def case(stream: str, state: str, accept: str = "identity") -> dict[str, Any]:
            """Read the stream ``runs`` times, checking it whole."""
            if stream == "bytes":
                url, label, check = byte_url, f"bytes {args.mb} MiB", {"expect_bytes": total_bytes}
            else:
                url, label, check = (
                    json_url,
                    f"json {args.messages:,} msgs",
                    {"expect_messages": args.messages},
                )
            label = f"{label}, {'ours' if ours else 'reference'} {state}"
            result = await measure(
                server, url, label, args.runs, accept=accept, count=stream == "json", **check
            )
            return {"stream": stream, "state": state, **result}

        state = "hot" if ours else "in memory"
        for stream in ("bytes", "json"):
            if stream in sections:
                reads.append(await case(stream, state))
        if "compression" in sections:
            out["compression"] = [
                await case("json", state, accept) for accept in (ENCODINGS if ours else REFERENCE_ENCODINGS)
            ]
        if ours and sections & {"bytes", "json"}:
            names = [n for n, s in ((byte_name, "bytes"), (json_name, "json")) if s in sections]
            print("ours: archiving", flush=True)
            out["archive"] = await archive_everything(server, names)
            for stream in ("bytes", "json"):
                if stream in sections:
                    reads.append(await case(stream, "cold"))
    return out


# --- memory ----------------------------------------------------------------------------------


@dataclass
class Reader:
    slow: bool
    bytes: int = 0
    responses: int = 0
    refused: int = 0  # 503/429 answers (a read budget saying "later")
    errors: list[str] = field(default_factory=list)
    finished: bool = False  # reached Stream-Up-To-Date within the window
    first_byte_seconds: float | None = None


async def run_reader(http: aiohttp.ClientSession, url: str, me: Reader, rate: float, t0: float) -> None:
    """Read from -1 to the tail (or until cancelled): fast readers as fast as they go,
    slow ones SLOW_READ bytes at a time, paced to ``rate`` bytes/s."""
    offset, started = "-1", time.monotonic()
    while me.responses + me.refused < 100_000:
        async with http.get(url, params={"offset": offset}, headers={"Accept-Encoding": "identity"}) as r:
            if r.status in (429, 503):
                me.refused += 1
                await asyncio.sleep(min(float(r.headers.get("Retry-After", "1") or 1), 2.0))
                continue
            if r.status != 200:
                me.errors.append(f"{r.status}")
                return
            me.responses += 1  # started (a response may outlast the window)
            while True:
                chunk = await (r.content.read(SLOW_READ) if me.slow else r.content.readany())
                if not chunk:
                    break
                if me.first_byte_seconds is None:
                    me.first_byte_seconds = time.monotonic() - t0
                me.bytes += len(chunk)
                if me.slow:
                    ahead = started + me.bytes / rate - time.monotonic()
                    if ahead > 0:
                        await asyncio.sleep(ahead)
            offset = r.headers["Stream-Next-Offset"]
            if r.headers.get("Stream-Up-To-Date") == "true":
                me.finished = True
                return


class RssPoller(threading.Thread):
    """The gateway's RSS every ``interval`` s, and every ``metrics_every``-th time its read
    budget's bytes held (``ds_read_budget_bytes`` on /metrics, when it has it), in a thread
    (the readers keep the loop busy)."""

    def __init__(
        self, meter: ProcessMeter, metrics_url: str, interval: float = 0.1, metrics_every: int = 5
    ) -> None:
        super().__init__(daemon=True)
        self.meter, self.metrics_url, self.interval, self.every = meter, metrics_url, interval, metrics_every
        self.samples: list[tuple[float, float]] = []  # (seconds, RSS MiB)
        self.budget: list[tuple[float, float]] = []  # (seconds, MiB held)
        self._done = threading.Event()

    def run(self) -> None:
        t0, n = time.monotonic(), 0
        while not self._done.is_set():
            self.samples.append((round(time.monotonic() - t0, 2), round(self.meter.rss_mb(), 1)))
            if n % self.every == 0 and self.metrics_url:
                held = budget_held(self.metrics_url)
                if held is None:
                    self.metrics_url = ""  # not in this build
                else:
                    self.budget.append((round(time.monotonic() - t0, 2), round(held / MIB, 1)))
            n += 1
            self._done.wait(self.interval)

    def stop(self) -> None:
        self._done.set()
        self.join()

    @property
    def peak(self) -> float:
        return max((mb for _, mb in self.samples), default=0.0)

    @property
    def budget_peak(self) -> float | None:
        return max((mb for _, mb in self.budget), default=None)


def budget_held(url: str) -> float | None:
    """``ds_read_budget_bytes`` from /metrics (summed over label sets); None: no such metric."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    values = [
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("ds_read_budget_bytes")
    ]
    if values:
        return sum(values)
    return 0.0 if "# TYPE ds_read_budget_bytes" in text else None


async def bench_memory(args: argparse.Namespace) -> dict[str, Any]:
    extra = shlex.split(args.ours_args)
    with start("ours", *extra) as server:
        url = f"{server.base_url}/catchup-memory-{uuid.uuid4().hex[:8]}"
        print(f"memory: filling {args.memory_mb} MiB", flush=True)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
            await fill_bytes(http, url, args.memory_mb)
        await asyncio.sleep(1)
        meter = ProcessMeter(server.pid)
        before = meter.rss_mb()
        poller = RssPoller(meter, server.base_url.split("/v1/stream")[0] + "/metrics")
        slow_count = args.readers // 2
        readers = [Reader(slow=i < slow_count) for i in range(args.readers)]
        rate = args.slow_mb_per_second * 1e6
        print(f"memory: {args.readers} readers ({slow_count} slow) for {args.window:g} s", flush=True)
        poller.start()
        t0 = time.monotonic()
        cpu0, client0 = meter.cpu_seconds(), time.process_time()
        async with reader_session(limit=0) as fast, reader_session(bufsize=1 << 16, limit=0) as slow:
            tasks = [
                asyncio.create_task(run_reader(slow if me.slow else fast, url, me, rate, t0))
                for me in readers
            ]
            done, pending = await asyncio.wait(tasks, timeout=args.window)
            for task in pending:
                task.cancel()  # the response closes: the reader disconnects mid-body
            await asyncio.gather(*pending, return_exceptions=True)
            for task in done:
                if task.exception() is not None:
                    readers[tasks.index(task)].errors.append(repr(task.exception()))
        seconds = time.monotonic() - t0
        gateway_cpu, client_cpu = meter.cpu_seconds() - cpu0, time.process_time() - client0
        idle = meter.idle_share()
        await asyncio.sleep(2)
        poller.stop()
        after = meter.rss_mb()
    fast_readers = [r for r in readers if not r.slow]
    slow_readers = [r for r in readers if r.slow]

    def group(rs: list[Reader]) -> dict[str, Any]:
        firsts = sorted(r.first_byte_seconds for r in rs if r.first_byte_seconds is not None)
        return {
            "readers": len(rs),
            "mb_read": round(sum(r.bytes for r in rs) / 1e6, 1),
            "mb_per_second_each": round(sum(r.bytes for r in rs) / len(rs) / seconds / 1e6, 2) if rs else 0,
            "finished": sum(r.finished for r in rs),
            "responses": sum(r.responses for r in rs),
            "refused": sum(r.refused for r in rs),
            "errors": sorted({e for r in rs for e in r.errors}),
            "first_byte_seconds_max": round(firsts[-1], 2) if firsts else None,
        }

    return {
        "stream_mib": args.memory_mb,
        "window_seconds": round(seconds, 1),
        "slow_mb_per_second": args.slow_mb_per_second,
        "rss_mib_before": round(before, 1),
        "rss_mib_peak": round(poller.peak, 1),
        "read_budget_mib_held_peak": poller.budget_peak,  # sampled every 0.5 s
        "rss_mib_after": round(after, 1),
        "gateway_cpu_share": round(gateway_cpu / seconds, 2),
        "client_cpu_share": round(client_cpu / seconds, 2),
        "machine_idle_share": round(idle, 2),
        "fast": group(fast_readers),
        "slow": group(slow_readers),
        "rss_samples": poller.samples,
        "read_budget_samples": poller.budget,
    }


# --- the gateway's settings ------------------------------------------------------------------


def gateway_settings(ours_args: str) -> dict[str, Any]:
    """The read settings ``serve --help`` shows (their defaults; None: no such option in this
    build), and what --ours-args set."""
    env = {**os.environ, "COLUMNS": "2000"}
    text = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--help"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    blocks = {  # option: its help text, one line
        m.group(1): " ".join(m.group(2).split())
        for m in re.finditer(r"^  (--[a-z0-9-]+)(?: [A-Z0-9_]+)?(.*?)(?=^  -|\Z)", text, re.S | re.M)
    }
    out: dict[str, Any] = {}
    for option in SETTINGS:
        found = re.search(r"default: ([^\]]*)\]", blocks.get(option, ""))
        out[option.lstrip("-")] = (found.group(1) if found else "?") if option in blocks else None
    given = shlex.split(ours_args)
    for i, arg in enumerate(given):
        name, equals, value = arg.lstrip("-").partition("=")
        if arg.startswith("--") and name in out:
            if not equals:
                value = given[i + 1] if i + 1 < len(given) else ""
            out[name] = f"{value or repr('')} (--ours-args)"
    return out


# --- output ----------------------------------------------------------------------------------


def _mib(value: str | None) -> str:
    if value is None:
        return "absent"
    head, _, rest = value.partition(" ")
    if head.isdigit() and int(head) >= MIB:
        return f"{int(head) / MIB:g} MiB" + (f" {rest}" if rest else "")
    return value or "''"


def _cpu(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def tables(result: dict[str, Any]) -> str:
    settings = result["gateway"]
    shown = ", ".join(f"--{k} {_mib(v)}" for k, v in settings.items())
    lines = [
        f"ours (serve --help defaults; absent: not in this build): {shown}"
        + (f"; --ours-args {result['ours_args']!r}" if result["ours_args"] else ""),
    ]
    if result.get("verdict"):
        lines.append(result["verdict"])
    reads = [r for s in result["servers"] for r in s.get("reads", [])]
    if reads:
        lines += [
            "",
            f"Catch-up reads from offset -1, one client, median of {result['runs']} "
            "(client/server/Redis CPU: share of one core during the read; idle: of the whole machine)",
            "",
            "| stream | server | MB/s (runs) | messages/s | responses | largest | client CPU | server CPU | "
            "Redis CPU | idle | server CPU s/GB |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        order = {"hot": 0, "cold": 1, "in memory": 2}
        for r in sorted(reads, key=lambda r: (r["stream"] != "bytes", order[r["state"]])):
            stream = result["bytes_label"] if r["stream"] == "bytes" else result["json_label"]
            server = "reference (npm), in memory" if r["state"] == "in memory" else f"ours, {r['state']}"
            runs = "–".join(f"{x:,.0f}" for x in (min(r["mb_per_second_runs"]), max(r["mb_per_second_runs"])))
            msgs = f"{r['messages_per_second']:,}" if r["messages_per_second"] else "-"
            lines.append(
                f"| {stream} | {server} | **{r['mb_per_second']:,.0f}** ({runs}) | {msgs} "
                f"| {r['responses']:,} "
                f"| {r['largest_response_mb']:,.1f} MB | {_cpu(r['client_cpu_share'])} "
                f"| {_cpu(r['server_cpu_share'])} | {_cpu(r['redis_cpu_share'])} "
                f"| {_cpu(r['machine_idle_share'])} | {r['server_cpu_seconds_per_gb']} |"
            )
    archive = next((s["archive"] for s in result["servers"] if "archive" in s), None)
    if archive:
        lines += [
            "",
            f"Archived before the cold reads in {archive['archive_seconds']} s "
            f"({archive['archive_files']} files); "
            f"Redis used_memory {archive['redis_used_memory_mib_before']} → "
            f"{archive['redis_used_memory_mib_after']} MiB; log entries left in Redis: "
            f"{sum(archive['log_entries_left_in_redis'].values())}",
        ]
    comp = [(s["server"], c) for s in result["servers"] for c in s.get("compression", [])]
    if comp:
        lines += [
            "",
            f"Compression: the {result['json_label']} stream, hot (ours) / in memory (reference), "
            f"median of {result['runs']}; MB/s of uncompressed JSON",
            "",
            "| server | Accept-Encoding | Content-Encoding | wire MB | ratio | MB/s | messages/s | responses "
            "| server CPU | server CPU s/GB | client CPU | idle |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for kind, c in comp:
            lines.append(
                f"| {'ours' if kind == 'ours' else 'reference'} | {c['accept_encoding']} "
                f"| {', '.join(c['content_encodings'])} | {c['wire_mb']:,.1f} | {c['ratio']} "
                f"| **{c['mb_per_second']:,.0f}** | {c['messages_per_second']:,} | {c['responses']:,} "
                f"| {_cpu(c['server_cpu_share'])} | {c['server_cpu_seconds_per_gb']} "
                f"| {_cpu(c['client_cpu_share'])} | {_cpu(c['machine_idle_share'])} |"
            )
    mem = result.get("memory")
    if mem:
        f, s = mem["fast"], mem["slow"]
        firsts = [g["first_byte_seconds_max"] for g in (f, s) if g["first_byte_seconds_max"] is not None]
        first = f"{max(firsts):.2f} s" if firsts else "-"
        held = (
            "" if mem["read_budget_mib_held_peak"] is None else f" ({mem['read_budget_mib_held_peak']:g} MiB)"
        )
        lines += [
            "",
            f"Memory: {f['readers'] + s['readers']} concurrent readers "
            f"of a {mem['stream_mib']} MiB byte stream "
            f"for {mem['window_seconds']} s ({s['readers']} slow at {mem['slow_mb_per_second']} MB/s each), "
            "then all disconnect; the gateway's RSS (VmRSS every 100 ms, its embedded Redis apart)",
            "",
            "| RSS before | peak | after (+2 s) | read budget (most held) | gateway CPU | client CPU | idle "
            "| fast: MB read, MB/s each, done | slow: MB read, MB/s each | slowest first byte "
            "| responses | refused | errors |",
            "|---:|---:|---:|---|---:|---:|---:|---|---|---:|---:|---:|---|",
            f"| {mem['rss_mib_before']:,.0f} MiB | **{mem['rss_mib_peak']:,.0f} MiB** "
            f"| {mem['rss_mib_after']:,.0f} MiB | {_mib(settings['max-inflight-read-bytes'])}{held} "
            f"| {_cpu(mem['gateway_cpu_share'])} | {_cpu(mem['client_cpu_share'])} "
            f"| {_cpu(mem['machine_idle_share'])} "
            f"| {f['mb_read']:,.0f}, {f['mb_per_second_each']:g}, {f['finished']}/{f['readers']} "
            f"| {s['mb_read']:,.0f}, {s['mb_per_second_each']:g} | {first} "
            f"| {f['responses'] + s['responses']:,} "
            f"| {f['refused'] + s['refused']} | {', '.join(f['errors'] + s['errors']) or '-'} |",
        ]
    busy = [r for r in reads + [c for _, c in comp] if r["client_cpu_share"] >= 0.8]
    if busy:
        cases = (f"{r['case']} {r['accept_encoding']} ({r['client_cpu_share']:.0%})" for r in busy)
        lines += ["", "Client-bound? the client used ≥ 80% of a core in: " + "; ".join(cases)]
    return "\n".join(lines)


def verdict(result: dict[str, Any]) -> str | None:
    """Old gateway (answers of 4 MiB) or new (a catch-up read carries up to the tail)?"""
    for s in result["servers"]:
        for r in s.get("reads", []):
            if s["server"] == "ours" and r["stream"] == "bytes" and r["state"] == "hot" and r["mb"] > 4.2:
                if r["responses"] == 1:
                    kind = "new gateway (the whole stream in one response)"
                else:
                    kind = f"{r['responses']} responses, the largest {r['largest_response_mb']} MB"
                return f"GET ?offset=-1 of the {r['mb']:,.0f} MB byte stream on ours: {kind}"
    return None


# --- main ------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sections = {args.only} if args.only else set(SECTIONS)
    result: dict[str, Any] = {
        "quick": args.quick,
        "runs": args.runs,
        "ours_args": args.ours_args,
        "gateway": gateway_settings(args.ours_args),
        "bytes_label": f"bytes, {args.mb} MiB",
        "json_label": f"JSON, {args.messages:,} messages"
        + ("" if args.json_kind == "mixed" else f" ({args.json_kind} only)"),
        "servers": [],
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    started = time.monotonic()
    if sections & {"bytes", "json", "compression"}:
        for kind in ("ours", "reference-memory"):
            result["servers"].append(await bench_server(kind, sections, args))
    if "memory" in sections:
        result["memory"] = await bench_memory(args)
    result["verdict"] = verdict(result)
    result["total_seconds"] = round(time.monotonic() - started, 1)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=int, help="byte stream size, MiB (default 256; --quick 16)")
    parser.add_argument(
        "--messages", type=int, help="JSON stream messages (default 1,000,000; --quick 50,000)"
    )
    parser.add_argument(
        "--json-kind",
        choices=("mixed", "state", "plain"),
        default="mixed",
        help="the JSON stream's messages: State Protocol events, plain objects, or half each (default)",
    )
    parser.add_argument("--runs", type=int, default=3, help="reads of each case (the median is shown)")
    parser.add_argument("--only", choices=SECTIONS, help="one section only")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test of ~30 s")
    parser.add_argument("--memory-mb", type=int, help="the memory section's stream, MiB (512; --quick 64)")
    parser.add_argument("--readers", type=int, default=50, help="the memory section's concurrent readers")
    parser.add_argument(
        "--window", type=float, help="seconds the memory section's readers read (20; --quick 5)"
    )
    parser.add_argument("--slow-mb-per-second", type=float, default=2.0, help="each slow reader's pace")
    parser.add_argument(
        "--ours-args",
        default="",
        help='extra `serve` options for our gateway, one string: --ours-args="--max-chunk-bytes 4194304"',
    )
    parser.add_argument("--out", help="results prefix (default loadtest/results/catchup; --quick: none)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.mb = args.mb or (16 if quick else 256)
    args.messages = args.messages or (50_000 if quick else 1_000_000)
    args.memory_mb = args.memory_mb or (64 if quick else 512)
    args.window = args.window or (5.0 if quick else 20.0)
    out = args.out or (None if quick else "loadtest/results/catchup")
    use_uvloop()
    result = asyncio.run(run(args))
    text = tables(result)
    print()
    print(text)
    print(f"\n({result['total_seconds']} s in all)")
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        command = "python -m loadtest.catchup" + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")
        path.with_suffix(".md").write_text(f"`{command}`, {result['started']}\n\n{text}\n")
        print(f"written: {path.with_suffix('.json')}, {path.with_suffix('.md')}")
    else:
        print("(--quick: nothing written; pass --out to keep it)")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
