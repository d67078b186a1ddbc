"""A new client reaching the tail of a long stream: replaying it from ``offset=-1`` vs
one ``GET /{bucket}/{stream}/bootstrap`` after a snapshot (Ursula's API, issue 18).

    .venv/bin/python -m loadtest.bootstrap [--mb 256] [--snapshot-kb 1024] [--tail-kb 1024]

Our server (one process, embedded Redis, fsync always) gets a byte stream of ``--mb``
MiB (1 MiB appends). A client replays it from -1, chunk after chunk (following
``Stream-Next-Offset`` until ``Stream-Up-To-Date``), timed. Then a snapshot of
``--snapshot-kb`` (the application's compacted state) is published ``--tail-kb`` before
the tail, and a new client's bootstrap (snapshot + the updates after it, multipart) is
timed. Each measured three times, the median printed and written to
``loadtest/results/bootstrap.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import aiohttp

from gateway.protocol import offsets

from .report import publish
from .servers import start, use_uvloop

MIB = 1024 * 1024
RUNS = 3


async def _replay(http: aiohttp.ClientSession, url: str) -> tuple[float, int]:
    started, size, offset = time.perf_counter(), 0, "-1"
    while True:
        async with http.get(url, params={"offset": offset}) as r:
            assert r.status == 200, r.status
            size += len(await r.read())
            offset = r.headers["Stream-Next-Offset"]
            if r.headers.get("Stream-Up-To-Date") == "true":
                return time.perf_counter() - started, size


async def _bootstrap(http: aiohttp.ClientSession, url: str) -> tuple[float, int]:
    started, size = time.perf_counter(), 0
    async with http.get(f"{url}/bootstrap") as r:
        assert r.status == 200, r.status
        size = len(await r.read())
    return time.perf_counter() - started, size


async def run(mb: int, snapshot_kb: int, tail_kb: int) -> dict[str, float]:
    with start("ours") as server:
        root = server.base_url.split("/v1/stream")[0]
        url = f"{root}/bench/stream"
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            assert (await http.put(f"{root}/bench")).status in (200, 201)
            assert (await http.put(url)).status in (200, 201)
            chunk = b"x" * MIB
            for _ in range(mb):
                async with http.post(
                    url, data=chunk, headers={"Content-Type": "application/octet-stream"}
                ) as r:
                    assert r.status in (200, 204)
                    tail = r.headers["Stream-Next-Offset"]
            replays = [await _replay(http, url) for _ in range(RUNS)]
            at = offsets.encode(offsets.decode(tail) - tail_kb * 1024)
            async with http.put(f"{url}/snapshot/{at}", data=b"s" * (snapshot_kb * 1024)) as r:
                assert r.status == 204, await r.text()
            boots = [await _bootstrap(http, url) for _ in range(RUNS)]
    return {
        "stream_mb": mb,
        "replay_seconds": statistics.median(t for t, _ in replays),
        "replay_bytes": replays[0][1],
        "bootstrap_seconds": statistics.median(t for t, _ in boots),
        "bootstrap_bytes": boots[0][1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--snapshot-kb", type=int, default=1024)
    parser.add_argument("--tail-kb", type=int, default=1024)
    parser.add_argument("--out", default="loadtest/results/bootstrap")
    args = parser.parse_args()
    use_uvloop()
    result = asyncio.run(run(args.mb, args.snapshot_kb, args.tail_kb))
    lines = [
        "| a new client reaches the tail of a stream of | time | bytes read |",
        "|---|---:|---:|",
        f"| {args.mb} MiB, replaying from offset=-1 | {result['replay_seconds']:.2f} s | "
        f"{result['replay_bytes'] / MIB:,.0f} MiB |",
        f"| {args.mb} MiB, bootstrap (snapshot of {args.snapshot_kb} KiB, {args.tail_kb} KiB after it) | "
        f"{result['bootstrap_seconds'] * 1000:.0f} ms | {result['bootstrap_bytes'] / MIB:,.1f} MiB |",
    ]
    publish(args.out, result, lines)


if __name__ == "__main__":
    main()
