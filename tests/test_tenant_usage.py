"""Usage metering end to end (docs/tenants.md, "Usage metering"): a mixed workload of two
tenants (creates, appends, deletes, catch-up, long-poll and SSE reads, some served from the
archive) across gateway processes, with a gateway SIGKILLed while appends are in flight and
the archive worker (which runs the meter) SIGKILLed and started again; then the usage in
Parquet equals what the clients observed, exactly.

What a killed gateway stored is counted by the write scripts even when its client never
heard back, so the writes are checked against what the streams hold (each append carries a
unique marker). What gateways count themselves (requests, bytes out) is flushed every second:
the reads go to the gateway that lives, and are checked to the byte."""

from __future__ import annotations

import asyncio
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis

from gateway.archive.files import Archive
from workers.meter import GRACE_SECONDS, Meter
from workers.usage_bill import local_sums

from .conftest import gateway_process, ready_worker, started_gateway

TEXT = {"Content-Type": "text/plain"}
PLAIN = {"Accept-Encoding": "identity"}  # bytes out are counted as sent: compare them uncompressed
MARK = re.compile(rb"<(\w+)\.(\d+)\.(\d+)>")


def _archive_worker(redis_url: str, archive: Path) -> subprocess.Popen[bytes]:
    return ready_worker([
        sys.executable, "-m", "gateway", "archive", "--redis-url", redis_url, "--archive-url", str(archive),
        "--tenants", "--archive-hot-bytes", "0", "--archive-hot-seconds", "0", "--archive-min-bytes", "0",
        "--log-level", "error",
    ])  # fmt: skip


async def test_parquet_usage_equals_what_the_clients_saw(own_redis, http, tmp_path: Path) -> None:
    tenants = [f"u{uuid.uuid4().hex[:8]}" for _ in range(2)]
    rules = " ".join(f"{t}/={t}" for t in tenants)
    archive = tmp_path / "archive"
    flags = ("--tenants", "--tenant-paths", rules, "--archive-url", str(archive), "--log-level", "error")
    created: Counter[str] = Counter()
    deleted: Counter[str] = Counter()
    held: dict[str, bytes] = {}  # what each stream held at the end, the deleted ones too
    doomed_proc, doomed = started_gateway(own_redis.url, tmp_path / "doomed.log", *flags)
    worker = doomed_proc  # (until the worker starts: what the cleanup below kills)
    try:
        worker = _archive_worker(own_redis.url, archive)
        with gateway_process(own_redis.url, tmp_path / "lives.log", *flags) as lives:
            streams = {t: [f"{t}/s{i}" for i in range(6)] for t in tenants}
            for tenant, paths in streams.items():
                for path in paths:
                    body = f"[{path}]".encode()
                    async with http.put(f"{lives}/{path}", data=body, headers=TEXT) as r:
                        assert r.status == 201
                    created[tenant] += 1

            unanswered = 0  # appends the doomed gateway never answered

            async def writer(w: int, tenant: str) -> None:
                nonlocal unanswered
                rng = random.Random(w)
                for k in range(150):
                    path = rng.choice(streams[tenant])
                    body = f"<{tenant}.{w}.{k}>".encode().ljust(rng.randrange(16, 300), b"~")
                    base = doomed if k % 2 else lives
                    try:
                        async with http.post(f"{base}/{path}", data=body, headers=TEXT) as r:
                            assert r.status == 204 or r.status >= 500, await r.text()
                    except aiohttp.ClientError:  # the doomed gateway died with it in flight:
                        unanswered += 1  # stored or not, the stream says

            writing = [asyncio.create_task(writer(w, tenants[w % 2])) for w in range(8)]
            await asyncio.sleep(0.3)
            doomed_proc.send_signal(signal.SIGKILL)  # appends in flight on it
            worker.send_signal(signal.SIGKILL)  # the meter's worker too, archiving meanwhile
            await asyncio.gather(*writing)
            assert unanswered, "the gateway must die with appends in flight"
            worker.wait(10)
            worker = _archive_worker(own_redis.url, archive)
            received: Counter[str] = Counter()  # what each tenant's reads received, byte for byte
            reads: Counter[tuple[str, str]] = Counter()
            for tenant in tenants:  # a delete each; the rest closed, so SSE answers end
                gone = streams[tenant].pop()
                async with http.get(f"{lives}/{gone}", params={"offset": "-1"}, headers=PLAIN) as r:
                    held[gone] = await r.read()
                received[tenant] += len(held[gone])
                reads[(tenant, "read")] += 1
                async with http.delete(f"{lives}/{gone}") as r:
                    assert r.status == 204
                deleted[tenant] += 1
                for path in streams[tenant]:
                    async with http.post(f"{lives}/{path}", headers={"Stream-Closed": "true"}) as r:
                        assert r.status == 204
            await asyncio.sleep(2)  # the worker archives what Redis holds: some reads come from Parquet

            # Reads, all on the gateway that lives.
            for tenant, paths in streams.items():
                for path in paths:
                    async with http.get(f"{lives}/{path}", params={"offset": "-1"}, headers=PLAIN) as r:
                        data = await r.read()
                    held[path] = data
                    received[tenant] += len(data)
                    reads[(tenant, "read")] += 1
                    sse = {"offset": "-1", "live": "sse"}
                    async with http.get(f"{lives}/{path}", params=sse, headers=PLAIN) as r:
                        received[tenant] += len(await r.read())  # (closed: the answer ends)
                    reads[(tenant, "sse")] += 1
                    poll = {"offset": "-1", "live": "long-poll"}
                    async with http.get(f"{lives}/{path}", params=poll, headers=PLAIN) as r:
                        received[tenant] += len(await r.read())
                    reads[(tenant, "long_poll")] += 1
        # (the gateway stopped gracefully: its last counts went to Redis)
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
        redis = aioredis.Redis.from_url(own_redis.url)
        try:  # what the workers would do once the hour has closed: every hour moved now
            await Meter(redis, Archive(str(archive))).flush_once(time.time() + 3600 + GRACE_SECONDS + 1)
        finally:
            await redis.aclose()
    finally:
        for proc in (doomed_proc, worker):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    usage: Counter[tuple[str, str]] = Counter()
    for tenant, _day, counter, value in local_sums(str(archive)):
        usage[(tenant, counter)] += value
    for tenant in tenants:
        mine = [data for path, data in held.items() if path.startswith(f"{tenant}/")]
        appended = [m.group(0) for data in mine for m in MARK.finditer(data)]
        assert len(set(appended)) == len(appended), "an append stored twice"
        # What was stored, the killed gateway's unanswered appends included, counted once each.
        assert usage[(tenant, "appends")] == len(appended) > 0
        assert usage[(tenant, "bytes_in")] == sum(len(data) for data in mine)  # (creates' bodies too)
        assert usage[(tenant, "streams_created")] == created[tenant]
        assert usage[(tenant, "streams_deleted")] == deleted[tenant]
        assert usage[(tenant, "bytes_out")] == received[tenant]
        for kind in ("read", "sse", "long_poll"):
            assert usage[(tenant, f"requests_{kind}")] == reads[(tenant, kind)], (tenant, kind)
