"""Append throughput and latency, and catch-up read throughput.

    python -m loadtest.appends --servers ours,reference,reference-memory
    python -m loadtest.appends --base-url http://host:4437/v1/stream

Scenarios (``--scenarios`` picks some): ``writers x streams x body bytes``,
with or without idempotent-producer headers. Each runs ``--seconds`` long
with every writer appending back to back; only successful appends count
(errors are reported by status). ``read`` builds a ``--read-mb`` stream and
reads it from the start as one client would, following Stream-Next-Offset.
Loopback only; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import shutil
import tempfile
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from .servers import KINDS, ProcessMeter, add_pin_option, client_headers, pin, start, use_uvloop

# name: (writers, streams, body bytes, idempotent producer headers)
SCENARIOS = {
    "1w-1s-100B": (1, 1, 100, False),
    "8w-1s-100B": (8, 1, 100, False),
    "64w-1s-100B": (64, 1, 100, False),
    "64w-1000s-100B": (64, 1000, 100, False),
    "64w-1s-100B-producer": (64, 1, 100, True),
    "8w-1s-64KiB": (8, 1, 65536, False),
}
# Scenarios only some comparisons run (loadtest/cluster.py): large bodies spread over streams,
# so over a Redis Cluster's shards.
MORE_SCENARIOS = {
    "8w-64s-64KiB": (8, 64, 65536, False),
}


def scenario(name: str) -> tuple[int, int, int, bool]:
    """(writers, streams, body bytes, producer headers) of a scenario of either table."""
    return SCENARIOS[name] if name in SCENARIOS else MORE_SCENARIOS[name]


@dataclass
class AppendResult:
    server: str
    scenario: str
    appends_per_second: float
    mb_per_second: float
    mean_ms: float
    p50_ms: float
    p99_ms: float
    errors: dict[str, int]
    server_cpu_percent: float | None
    generator: str = "aiohttp"
    # CPU of the server's own processes (not the embedded Redis) per successful append, µs:
    # what a pod pays per append, the figure issue 28's target is set in
    server_cpu_us_per_append: float | None = None
    # ... its embedded Redis's (none for the reference server), and the machine's CPU left
    # idle meanwhile (%): where the append rate is bounded, by CPU or by waiting
    redis_cpu_us_per_append: float | None = None
    machine_idle_percent: float | None = None


# wrk (C, epoll) drives the scenarios: it costs the 2-core machine far less CPU than a Python
# client, so servers are measured rather than the generator. A producer's appends must go in
# sequence: producer scenarios give each writer a wrk thread with one connection (-t = -c), its
# Lua state counting that writer's Producer-Seq.
WRK_SCRIPT = """
local paths = {%(paths)s}
local body = string.rep("x", %(size)d)
local headers = {["Content-Type"] = "text/plain"%(auth)s}
local producers = %(producers)s
local threads = 0
setup = function(thread)
  thread:set("writer", threads)
  threads = threads + 1
end
local i = 0
local seq = 0
request = function()
  i = i + 1
  if producers then
    headers["Producer-Id"] = "w" .. writer
    headers["Producer-Epoch"] = "0"
    headers["Producer-Seq"] = tostring(seq)
    return wrk.format("POST", paths[(writer %% #paths) + 1], headers, body)
  end
  return wrk.format("POST", paths[(i %% #paths) + 1], headers, body)
end
if producers then
  -- the next seq once this one is answered (wrk also calls request() once to check it)
  response = function(status, headers, body)
    if status < 300 then seq = seq + 1 end
  end
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %%d %%d %%d %%d %%d %%d\\n", summary.requests, e.status,
    e.connect + e.read + e.write + e.timeout, latency:percentile(50), latency:percentile(99), latency.mean))
end
"""


def use_wrk(name: str, generator: str) -> bool:
    return generator != "aiohttp" and shutil.which("wrk") is not None


async def run_appends(
    base_url: str,
    server: str,
    name: str,
    seconds: float,
    pid: int | None,
    generator: str = "wrk",
    measure: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
) -> AppendResult:
    """One scenario; ``measure``, if given, makes a context manager entered just before the
    load starts (the streams exist) and left when it ends (e.g. Redis counters, read around)."""
    writers, streams, size, producer = scenario(name)
    prefix = f"{base_url}/appends-{uuid.uuid4().hex[:8]}"
    urls = [f"{prefix}-{i}" for i in range(streams)]
    body = b"x" * size
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    connector = aiohttp.TCPConnector(limit=writers)
    async with aiohttp.ClientSession(connector=connector, headers=client_headers(server)) as http:
        for i in range(0, streams, 100):
            await asyncio.gather(
                *(http.put(u, headers={"Content-Type": "text/plain"}) for u in urls[i : i + 100])
            )
        meter = ProcessMeter(pid) if pid else None
        deadline = 0.0  # set when the load starts

        async def writer(n: int) -> None:
            seq = 0
            while time.monotonic() < deadline:
                url = urls[(n + seq * writers) % streams]
                headers = {"Content-Type": "text/plain"}
                if producer:
                    headers |= {"Producer-Id": f"w{n}", "Producer-Epoch": "0", "Producer-Seq": str(seq)}
                began = time.monotonic()
                try:
                    async with http.post(url, data=body, headers=headers) as r:
                        await r.read()
                        if r.status in (200, 204):
                            latencies.append(time.monotonic() - began)
                        else:
                            errors[str(r.status)] += 1
                except aiohttp.ClientError as exc:
                    errors[type(exc).__name__] += 1
                seq += 1

        with measure() if measure else contextlib.nullcontext():
            if use_wrk(name, generator):
                return await _run_wrk(server, name, urls, seconds, meter)
            started = time.monotonic()
            deadline = started + seconds
            await asyncio.gather(*(writer(n) for n in range(writers)))
            elapsed = time.monotonic() - started
    latencies.sort()
    count = len(latencies)

    def at(p: float) -> float:
        return round(1000 * latencies[min(count - 1, int(p * count))], 2) if count else float("nan")

    return AppendResult(
        server=server,
        scenario=name,
        appends_per_second=round(count / elapsed, 1),
        generator="aiohttp",
        mb_per_second=round(count * size / elapsed / 1e6, 2),
        mean_ms=round(1000 * sum(latencies) / count, 2) if count else float("nan"),
        p50_ms=at(0.5),
        p99_ms=at(0.99),
        errors=dict(errors),
        server_cpu_percent=round(100 * meter.cpu_used() / elapsed, 1) if meter else None,
        **_costs(meter, count),
    )


def _costs(meter: ProcessMeter | None, count: float) -> dict[str, float | None]:
    """The CPU figures per append (µs) of a run, and the machine's idle share (%)."""
    if meter is None or not count:
        return {}
    redis = meter.redis_cpu_used()
    return {
        "server_cpu_us_per_append": round(1e6 * meter.cpu_used() / count, 1),
        "redis_cpu_us_per_append": None if redis is None else round(1e6 * redis / count, 1),
        "machine_idle_percent": round(100 * meter.idle_share(), 1),
    }


async def _run_wrk(server: str, name: str, urls: list[str], seconds: float, meter: ProcessMeter | None):
    writers, _, size, producer = scenario(name)
    base = urls[0].split("/", 3)
    origin = "/".join(base[:3])
    paths = ", ".join(f'"/{u.split("/", 3)[3]}"' for u in urls)
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        auth = "".join(f', ["{k}"] = "{v}"' for k, v in client_headers(server).items())
        lua = {"paths": paths, "size": size, "auth": auth, "producers": "true" if producer else "false"}
        script.write(WRK_SCRIPT % lua)
    try:
        proc = await asyncio.create_subprocess_exec(
            "wrk", f"-t{writers if producer else 1}", f"-c{writers}", f"-d{max(1, round(seconds))}s",
            "-s", script.name, origin,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await proc.communicate()
    finally:
        os.unlink(script.name)
    line = next(x for x in out.decode().splitlines() if x.startswith("RESULT "))
    total, bad_status, socket_errors, p50_us, p99_us, mean_us = (float(v) for v in line.split()[1:])
    elapsed = max(1, round(seconds))
    ok = total - bad_status
    errors = {k: int(v) for k, v in (("non-2xx", bad_status), ("socket", socket_errors)) if v}
    return AppendResult(
        server=server,
        scenario=name,
        appends_per_second=round(ok / elapsed, 1),
        mb_per_second=round(ok * size / elapsed / 1e6, 2),
        mean_ms=round(mean_us / 1000, 2),
        p50_ms=round(p50_us / 1000, 2),
        p99_ms=round(p99_us / 1000, 2),
        errors=errors,
        server_cpu_percent=round(100 * meter.cpu_used() / elapsed, 1) if meter else None,
        generator="wrk",
        **_costs(meter, ok),
    )


async def fill(http: aiohttp.ClientSession, url: str, megabytes: int, piece_bytes: int = 1 << 20) -> None:
    """Create a byte stream of ``megabytes`` MiB of random (incompressible) data."""
    headers = {"Content-Type": "application/octet-stream"}
    await http.put(url, headers=headers)
    for _ in range((megabytes << 20) // piece_bytes):
        async with http.post(url, data=os.urandom(piece_bytes), headers=headers) as r:
            assert r.status in (200, 204), r.status


def catch_up(url: str, headers: dict[str, str] | None = None) -> tuple[int, int, float]:
    """Read a stream from its start to its tail, as one client: (bytes, requests, seconds).

    A plain blocking HTTP/1.1 connection (http.client): on this 2-core machine an
    asyncio client costs enough CPU to become what is measured.
    """
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port)
    total, requests, offset = 0, 0, "-1"
    started = time.monotonic()
    try:
        while requests < 1_000_000:
            conn.request("GET", f"{parts.path}?offset={urllib.parse.quote(offset)}", headers=headers or {})
            r = conn.getresponse()
            body = r.read()
            assert r.status == 200, r.status
            total += len(body)
            requests += 1
            offset = r.getheader("Stream-Next-Offset")
            if r.getheader("Stream-Up-To-Date") == "true":
                break
    finally:
        conn.close()
    return total, requests, time.monotonic() - started


async def run_read(base_url: str, server: str, megabytes: int) -> dict:
    url = f"{base_url}/read-{uuid.uuid4().hex[:8]}"
    async with aiohttp.ClientSession(headers=client_headers(server)) as http:
        await fill(http, url, megabytes)
    total, requests, elapsed = await asyncio.to_thread(catch_up, url, client_headers(server))
    assert total == megabytes << 20, (total, megabytes << 20)
    return {
        "server": server,
        "scenario": f"read {megabytes} MiB",
        "mb_per_second": round(total / elapsed / 1e6, 1),
        "requests": requests,
        "seconds": round(elapsed, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--servers", default="ours", help=f"comma list of {', '.join(KINDS)}")
    parser.add_argument("--base-url", help="benchmark a running server instead (its stream prefix URL)")
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"comma list of {', '.join(SCENARIOS)}"
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per append scenario")
    parser.add_argument("--read-mb", type=int, default=256, help="size of the catch-up read stream (0: skip)")
    parser.add_argument("--out", default="loadtest/results/appends.json")
    add_pin_option(parser)
    args = parser.parse_args()
    use_uvloop()
    results: list[dict] = []

    def bench(base_url: str, name: str, pid: int | None) -> None:
        for scenario in args.scenarios.split(","):
            r = asyncio.run(run_appends(base_url, name, scenario, args.seconds, pid))
            results.append(asdict(r))
            print(f"{name:<18} {scenario:<22} {r.appends_per_second:>9}/s {r.mb_per_second:>8} MB/s "
                  f"mean {r.mean_ms:>7} p50 {r.p50_ms:>7} p99 {r.p99_ms:>8} ms  cpu {r.server_cpu_percent}% "
                  f"errors {r.errors}", flush=True)  # fmt: skip
        if args.read_mb:
            r = asyncio.run(run_read(base_url, name, args.read_mb))
            results.append(r)
            print(
                f"{name:<18} {r['scenario']:<22} {r['mb_per_second']:>9} MB/s in {r['requests']} reads",
                flush=True,
            )

    if args.base_url:
        bench(args.base_url, "target", None)
    else:
        for kind in args.servers.split(","):
            with start(kind) as server:
                if args.pin:
                    print(pin(server), flush=True)
                bench(server.base_url, kind, server.pid)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
